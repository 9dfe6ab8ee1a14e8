//! Each invariant fails on a trace that breaks it and passes on one that does not.
//! These run in the normal build; the DST planted-bug tests show the same checkers
//! catching real runs.

use super::*;
use crate::probe::AuditGroup;
use crate::trace::Event;

fn run(mut check: impl Invariant, events: Vec<(u64, Event)>) -> Result<(), String> {
    for (at_us, event) in events {
        check.observe(&Stamped { at_us, event })?;
    }
    check.finish(1_000_000)
}

fn activated(node: u32, actor: &str) -> Event {
    Event::Activated {
        node,
        actor: actor.into(),
        count: 0,
    }
}

fn turn(actor: &str, depth: u32, chain: &[&str], deadline_us: u64, parent_deadline_us: u64) -> Event {
    Event::TurnStarted {
        node: 1,
        actor: actor.into(),
        depth,
        chain: chain.iter().map(|s| s.to_string()).collect(),
        deadline_us,
        parent_deadline_us,
        remote: false,
    }
}

#[test]
fn single_activation_catches_two_live_activations_and_forgets_killed_nodes() {
    assert!(run(
        SingleActivation::default(),
        vec![(0, activated(1, "a")), (1, activated(2, "a"))]
    )
    .is_err());
    let killed = vec![
        (0, activated(1, "a")),
        (1, Event::NodeKilled { node: 1 }),
        (2, activated(2, "a")),
    ];
    assert!(run(SingleActivation::default(), killed).is_ok());
}

#[test]
fn depth_bounded_catches_a_turn_at_depth_six() {
    let chain = ["a", "b", "c", "d", "e", "f"];
    assert!(run(DepthBounded, vec![(0, turn("g", 6, &chain, 1, 1))]).is_err());
    assert!(run(DepthBounded, vec![(0, turn("f", 5, &chain[..5], 1, 1))]).is_ok());
}

#[test]
fn no_cycle_catches_an_actor_running_inside_its_own_chain() {
    assert!(run(NoCycleInCallChain, vec![(0, turn("a", 2, &["a", "b"], 1, 1))]).is_err());
    assert!(run(NoCycleInCallChain, vec![(0, turn("c", 2, &["a", "b"], 1, 1))]).is_ok());
}

#[test]
fn deadline_monotone_catches_a_child_outliving_its_parent() {
    assert!(run(
        DeadlineMonotone::default(),
        vec![(0, turn("b", 1, &["a"], 2_000, 1_000))]
    )
    .is_err());
    assert!(run(
        DeadlineMonotone::default(),
        vec![(0, turn("b", 1, &["a"], 1_000, 1_000))]
    )
    .is_ok());
}

#[test]
fn wait_for_cycle_may_not_outlive_its_grace() {
    let begin = |call, caller: &str, target: &str| Event::WaitBegin {
        call,
        caller: caller.into(),
        target: target.into(),
        host: 1,
    };
    let end = |call| Event::WaitEnd {
        call,
        outcome: "x".into(),
    };
    let refused_at_once = vec![
        (0, begin(1, "a", "b")),
        (0, begin(2, "b", "a")),
        (10, end(2)),
        (500, end(1)),
    ];
    assert!(run(WaitForGraphAcyclic::default(), refused_at_once).is_ok());
    let survives = vec![
        (0, begin(1, "a", "b")),
        (0, begin(2, "b", "a")),
        (30_000, end(2)),
        (30_000, end(1)),
    ];
    assert!(run(WaitForGraphAcyclic::default(), survives).is_err());
}

#[test]
fn every_call_resolves_catches_late_and_missing_resolutions() {
    let sent = |request| Event::RequestSent {
        request,
        target: "a".into(),
        deadline_us: 1_000,
    };
    let resolved = |request| Event::RequestResolved {
        request,
        outcome: "ok".into(),
    };
    assert!(run(EveryCallResolves::default(), vec![(0, sent(1)), (900, resolved(1))]).is_ok());
    assert!(run(EveryCallResolves::default(), vec![(0, sent(1)), (5_000, resolved(1))]).is_err());
    assert!(run(EveryCallResolves::default(), vec![(0, sent(1))]).is_err());
}

#[test]
fn no_acked_state_lost_catches_a_read_below_the_acknowledged_floor() {
    let events = |read| {
        vec![
            (
                0,
                Event::AddSent {
                    request: 1,
                    actor: "a".into(),
                    amount: 5,
                },
            ),
            (
                1,
                Event::AddAcked {
                    request: 1,
                    actor: "a".into(),
                    value: 5,
                },
            ),
            (
                2,
                Event::GetSent {
                    request: 2,
                    actor: "a".into(),
                },
            ),
            (
                3,
                Event::GetReplied {
                    request: 2,
                    actor: "a".into(),
                    value: read,
                },
            ),
        ]
    };
    assert!(run(NoAckedStateLost::default(), events(5)).is_ok());
    assert!(run(NoAckedStateLost::default(), events(0)).is_err());
    assert!(run(NoAckedStateLost::default(), events(6)).is_err());
}

#[test]
fn turn_writes_atomic_catches_a_partial_batch_and_a_state_that_disagrees() {
    let group = |batch, present| AuditGroup {
        batch,
        present,
        expected: 3,
    };
    let audit = |batches, groups| Event::Audited {
        actor: "a".into(),
        batches,
        groups,
    };
    assert!(run(TurnWritesAtomic, vec![(0, audit(2, vec![group(0, 3), group(1, 3)]))]).is_ok());
    assert!(run(TurnWritesAtomic, vec![(0, audit(2, vec![group(0, 3), group(1, 2)]))]).is_err());
    assert!(run(TurnWritesAtomic, vec![(0, audit(1, vec![group(0, 3), group(1, 3)]))]).is_err());
}

#[test]
fn every_call_resolves_catches_a_turn_that_outlives_its_deadline() {
    let ended = Event::TurnEnded {
        node: 1,
        actor: "a".into(),
        ok: true,
    };
    assert!(run(
        EveryCallResolves::default(),
        vec![(0, turn("a", 0, &[], 1_000, 1_000)), (900, ended.clone())]
    )
    .is_ok());
    assert!(run(
        EveryCallResolves::default(),
        vec![(0, turn("a", 0, &[], 1_000, 1_000)), (9_000, ended)]
    )
    .is_err());
}
