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
    assert_eq!(
        run(
            SingleActivation::default(),
            vec![(0, activated(1, "a")), (1, activated(2, "a"))]
        ),
        Err(String::from(
            "a activated on node 2 while its activation on node 1 is live"
        ))
    );
    let killed = vec![
        (0, activated(1, "a")),
        (1, Event::NodeKilled { node: 1 }),
        (2, activated(2, "a")),
    ];
    assert_eq!(run(SingleActivation::default(), killed), Ok(()));
}

#[test]
fn depth_bounded_catches_a_turn_at_depth_six() {
    let chain = ["a", "b", "c", "d", "e", "f"];
    assert_eq!(
        run(DepthBounded, vec![(0, turn("g", 6, &chain, 1, 1))]),
        Err(String::from(
            "a turn of g runs at depth 6 > 5 (chain [\"a\", \"b\", \"c\", \"d\", \"e\", \"f\"])"
        ))
    );
    assert_eq!(run(DepthBounded, vec![(0, turn("f", 5, &chain[..5], 1, 1))]), Ok(()));
}

#[test]
fn no_cycle_catches_an_actor_running_inside_its_own_chain() {
    assert_eq!(
        run(NoCycleInCallChain, vec![(0, turn("a", 2, &["a", "b"], 1, 1))]),
        Err(String::from(
            "a turn of a runs with a twice in chain [\"a\", \"b\"] + a"
        ))
    );
    assert_eq!(
        run(NoCycleInCallChain, vec![(0, turn("c", 2, &["a", "b"], 1, 1))]),
        Ok(())
    );
}

#[test]
fn deadline_monotone_catches_a_child_outliving_its_parent() {
    assert_eq!(run(
        DeadlineMonotone::default(),
        vec![(0, turn("b", 1, &["a"], 2_000, 1_000))]
    )
    , Err(String::from("a turn of b (chain [\"a\"], local) runs until 2000 us, later than its caller's deadline 1000 us by 1000 us (allowed 1 us)")));
    assert_eq!(
        run(
            DeadlineMonotone::default(),
            vec![(0, turn("b", 1, &["a"], 1_000, 1_000))]
        ),
        Ok(())
    );
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
    assert_eq!(run(WaitForGraphAcyclic::default(), refused_at_once), Ok(()));
    let survives = vec![
        (0, begin(1, "a", "b")),
        (0, begin(2, "b", "a")),
        (30_000, end(2)),
        (30_000, end(1)),
    ];
    assert_eq!(
        run(WaitForGraphAcyclic::default(), survives),
        Err(String::from(
            "the wait-for cycle a -> b -> a has survived 30.000 ms (grace 1.000 ms)"
        ))
    );
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
    assert_eq!(
        run(EveryCallResolves::default(), vec![(0, sent(1)), (900, resolved(1))]),
        Ok(())
    );
    assert_eq!(
        run(EveryCallResolves::default(), vec![(0, sent(1)), (5_000, resolved(1))]),
        Err(String::from(
            "request to a resolved at 5.000 ms, after its deadline 1.000 ms"
        ))
    );
    assert_eq!(
        run(EveryCallResolves::default(), vec![(0, sent(1))]),
        Err(String::from(
            "1 requests never resolved; request 1 to a is still pending at 1000.000 ms, its deadline was 1.000 ms"
        ))
    );
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
    assert_eq!(run(NoAckedStateLost::default(), events(5)), Ok(()));
    assert_eq!(
        run(NoAckedStateLost::default(), events(0)),
        Err(String::from(
            "a reads 0, but 5 had been acknowledged before the read: acknowledged state was lost"
        ))
    );
    assert_eq!(
        run(NoAckedStateLost::default(), events(6)),
        Err(String::from("a reads 6, more than the 5 ever sent"))
    );
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
    assert_eq!(
        run(TurnWritesAtomic, vec![(0, audit(2, vec![group(0, 3), group(1, 3)]))]),
        Ok(())
    );
    assert_eq!(
        run(TurnWritesAtomic, vec![(0, audit(2, vec![group(0, 3), group(1, 2)]))]),
        Err(String::from("a: batch 1 has 2 of its 3 writes"))
    );
    assert_eq!(
        run(TurnWritesAtomic, vec![(0, audit(1, vec![group(0, 3), group(1, 3)]))]),
        Err(String::from(
            "a: its state counts 1 batches but its writes hold batches [0, 1]"
        ))
    );
}

#[test]
fn every_call_resolves_catches_a_turn_that_outlives_its_deadline() {
    let ended = Event::TurnEnded {
        node: 1,
        actor: "a".into(),
        ok: true,
    };
    assert_eq!(
        run(
            EveryCallResolves::default(),
            vec![(0, turn("a", 0, &[], 1_000, 1_000)), (900, ended.clone())]
        ),
        Ok(())
    );
    assert_eq!(
        run(
            EveryCallResolves::default(),
            vec![(0, turn("a", 0, &[], 1_000, 1_000)), (9_000, ended)]
        ),
        Err(String::from(
            "a turn of a ran until 9.000 ms, past its deadline 1.000 ms"
        ))
    );
}
