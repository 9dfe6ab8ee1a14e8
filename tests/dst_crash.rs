//! Crashes: a node killed in the middle of calls loses its memory and nothing that was
//! acknowledged; a disk crash loses only unflushed, never acknowledged, commits; storage
//! failures surface as errors and roll turns back.
//!
//! Faults: node kill during calls, disk crash with lost unflushed writes (fsync window),
//! storage commit/load/read failures. Invariants: all eight, in particular
//! NoAckedStateLost (reads through the runtime against the acknowledged model) and
//! TurnWritesAtomic (audits of batches).
#![cfg(madsim)]

use std::collections::BTreeMap;
use std::time::Duration;

use troupe_core::InvokeError;
use troupe_sim::workload::keys_on;
use troupe_sim::{probe, AuditGroup, Fault, ProbeOp, ProbeReply, Scenario, Sim, SimConfig, StoreMode};

const TEST: &str = "dst_crash";

/// Goal: node 2 dies while calls from node 1 wait on its probes and while its own turns
/// run; every such call fails by its deadline, node 2 comes back from its disk, and
/// every probe reads at least what was acknowledged. Method: acknowledged adds and
/// batches first; then slow cross-node calls and direct adds; the crash (kill + disk
/// crash) lands at a random moment inside them; a restart after a random down time.
#[madsim::test]
async fn crash_during_call_loses_nothing_acknowledged() {
    let scenario = Scenario {
        test: TEST,
        name: "crash_during_call_loses_nothing_acknowledged",
    };
    let config = SimConfig {
        nodes: 2,
        store: StoreMode::Fsync { latency_ms: 3 },
        ..SimConfig::default()
    };
    let mut sim = Sim::start(scenario, config).await;
    let (callers, victims) = (keys_on(1, 2, 4), keys_on(2, 2, 2));
    for key in victims.iter().chain(&callers) {
        let amount = sim.rng().range(1, 10);
        sim.request(key, ProbeOp::Add { amount }, Duration::from_millis(500))
            .await
            .expect("a warm-up add");
        sim.request(
            key,
            ProbeOp::Batch {
                keys: 3,
                fail_after: None,
            },
            Duration::from_millis(500),
        )
        .await
        .expect("a warm-up batch");
    }
    // Warm node 1's connection to node 2 too, so the slow calls below reach node 2 within
    // their two hops (a cold connection also pays the TCP connect and the transport's
    // clock handshake; seed 646 crashed node 2 before they got there).
    let warm_call = ProbeOp::Call {
        target: format!("probe/{}", victims[0]),
        op: Box::new(ProbeOp::Get),
        timeout_ms: 300,
        delay_ms: 0,
    };
    sim.request(&callers[0], warm_call, Duration::from_millis(500))
        .await
        .expect("a warm-up call");
    sim.phase("safety");
    let slow_ms = sim.rng().range(40, 80);
    // One call per caller (a caller's turns are serial), two per victim.
    for (index, caller) in callers.iter().enumerate() {
        let victim = &victims[index % victims.len()];
        let op = ProbeOp::Call {
            target: format!("probe/{victim}"),
            op: Box::new(ProbeOp::Sleep {
                ms: slow_ms,
                then: Box::new(ProbeOp::Add { amount: 1 }),
            }),
            timeout_ms: 300,
            delay_ms: 0,
        };
        sim.spawn_request(caller, op, Duration::from_millis(400));
    }
    for victim in &victims {
        sim.spawn_request(
            victim,
            ProbeOp::Batch {
                keys: 4,
                fail_after: None,
            },
            Duration::from_millis(400),
        );
    }
    // After every call has reached node 2 (two hops of at most 10 ms), before any can
    // have finished.
    let before_crash = sim.rng().range(25, slow_ms);
    sim.advance(Duration::from_millis(before_crash)).await;
    sim.inject(Fault::CrashNode(2)).await;
    let down = sim.rng().range(1, 100);
    sim.advance(Duration::from_millis(down)).await;
    sim.inject(Fault::RestartNode(2)).await;
    let outcomes = sim.drain().await;
    assert_eq!(
        outcomes.len(),
        callers.len() + victims.len(),
        "a request hung: {outcomes:?}"
    );
    // The slow calls were cut by the crash, which broke node 1's connection to node 2
    // while each waited: every one is `Unreachable`, naming its victim.
    for (index, outcome) in outcomes.iter().take(callers.len()).enumerate() {
        let victim = probe(&victims[index % victims.len()]);
        assert!(
            matches!(outcome, Err(InvokeError::Unreachable { target, .. }) if *target == victim),
            "a call into a crashed node: {outcome:?}"
        );
    }
    // A victim's batch either ran before the crash (its second batch) or was still
    // queued behind the slow calls when the crash broke its connection.
    for (victim, outcome) in victims.iter().zip(&outcomes[callers.len()..]) {
        assert!(
            *outcome == Ok(ProbeReply::Count(2))
                || matches!(outcome, Err(InvokeError::Unreachable { target, .. }) if *target == probe(victim)),
            "the batch of {victim}: {outcome:?}"
        );
    }
    sim.phase("liveness");
    sim.heal().await;
    let keys: Vec<&str> = victims.iter().chain(&callers).map(String::as_str).collect();
    sim.read_back(&keys).await;
    sim.audit(&keys).await;
    sim.finish().await;
}

/// Goal: the fsync window. An add whose commit is visible on the disk but not yet
/// flushed when the node dies with its disk is lost, and it was never acknowledged; a
/// kill that spares the disk loses nothing committed. Method: three acknowledged adds
/// (count 3); an add of 100 in flight with a 20 ms fsync; the node is killed 5 ms later,
/// with or without a disk crash (drawn from the seed); after the restart the count is
/// exactly 3 (disk crashed: the unflushed commit is gone) or 103 (disk intact: the
/// commit was on it, only its acknowledgement was lost).
#[madsim::test]
async fn lost_unflushed_writes_are_never_acknowledged_ones() {
    let scenario = Scenario {
        test: TEST,
        name: "lost_unflushed_writes_are_never_acknowledged_ones",
    };
    let config = SimConfig {
        store: StoreMode::Fsync { latency_ms: 20 },
        ..SimConfig::default()
    };
    let mut sim = Sim::start(scenario, config).await;
    sim.inject(Fault::Latency { min_ms: 1, max_ms: 2 }).await;
    for _ in 0..3 {
        sim.request("d", ProbeOp::Add { amount: 1 }, Duration::from_millis(500))
            .await
            .expect("acknowledged");
    }
    sim.phase("safety");
    sim.spawn_request("d", ProbeOp::Add { amount: 100 }, Duration::from_millis(500));
    sim.advance(Duration::from_millis(5)).await;
    let crash_disk = sim.rng().chance(50);
    sim.inject(if crash_disk {
        Fault::CrashNode(1)
    } else {
        Fault::KillNode(1)
    })
    .await;
    sim.inject(Fault::RestartNode(1)).await;
    let outcomes = sim.drain().await;
    assert!(
        matches!(&outcomes[..], [Err(InvokeError::Unreachable { target, .. })] if *target == probe("d")),
        "the add in its fsync window cannot have been acknowledged: the kill breaks its connection: {outcomes:?}"
    );
    sim.phase("liveness");
    sim.heal().await;
    let values = sim.read_back(&["d"]).await;
    assert_eq!(
        values,
        vec![if crash_disk { 3 } else { 103 }],
        "disk crashed: {crash_disk}"
    );
    sim.finish().await;
}

/// Goal: storage failures are errors the caller sees, never silent: a failed commit
/// rolls the turn back (count and batch writes), a failed load fails the activation
/// (no default state), a failed read fails the turn. Method: random adds, batches and
/// audits under random commit, load and read failures; every reply equals what a model
/// of the acknowledged operations predicts (a `StorageFailed` operation changed
/// nothing), and afterwards the reads equal the model and every batch is whole.
#[madsim::test]
async fn storage_failures_surface_as_errors_and_roll_turns_back() {
    let scenario = Scenario {
        test: TEST,
        name: "storage_failures_surface_as_errors_and_roll_turns_back",
    };
    let config = SimConfig {
        idle_timeout: Duration::from_millis(3),
        ..SimConfig::default()
    };
    let mut sim = Sim::start(scenario, config).await;
    // (count, batches) of each probe, from the acknowledged operations.
    let mut model: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    sim.phase("safety");
    for round in 0..30 {
        let count = sim.rng().range(1, 3);
        let fault = match round % 3 {
            0 => Fault::FailCommits { node: 1, count },
            1 => Fault::FailLoads { node: 1, count },
            _ => Fault::FailReads { node: 1, count },
        };
        if sim.rng().chance(50) {
            sim.inject(fault).await;
        }
        let op = match sim.rng().range(0, 3) {
            0 => ProbeOp::Add {
                amount: sim.rng().range(1, 5),
            },
            1 => ProbeOp::Batch {
                keys: 3,
                fail_after: None,
            },
            _ => ProbeOp::Audit,
        };
        let key = if sim.rng().chance(50) { "s1" } else { "s2" };
        let outcome = sim.request(key, op.clone(), Duration::from_millis(300)).await;
        let (count, batches) = model.entry(key).or_default();
        match (&op, outcome) {
            (_, Err(InvokeError::StorageFailed { target, .. })) => assert_eq!(target, probe(key)),
            (ProbeOp::Add { amount }, Ok(ProbeReply::Count(value))) => {
                *count += amount;
                assert_eq!(value, *count, "the add to {key}");
            }
            (ProbeOp::Batch { .. }, Ok(ProbeReply::Count(value))) => {
                *batches += 1;
                assert_eq!(value, *batches, "the batch of {key}");
            }
            (ProbeOp::Audit, Ok(ProbeReply::Audit { batches: found, groups })) => {
                let whole: Vec<AuditGroup> = (0..*batches)
                    .map(|batch| AuditGroup {
                        batch,
                        present: 3,
                        expected: 3,
                    })
                    .collect();
                assert_eq!((found, groups), (*batches, whole), "the audit of {key}");
            }
            (op, outcome) => panic!("{op:?} on {key}: storage faults must surface as StorageFailed: {outcome:?}"),
        }
        // Let idle actors deactivate so loads happen too.
        let gap = sim.rng().range(0, 8);
        sim.advance(Duration::from_millis(gap)).await;
    }
    sim.inject(Fault::FailCommits { node: 1, count: 1 }).await;
    let failed = sim
        .request("s1", ProbeOp::Add { amount: 1 }, Duration::from_millis(300))
        .await;
    assert!(
        matches!(&failed, Err(InvokeError::StorageFailed { target, .. }) if *target == probe("s1")),
        "{failed:?}"
    );
    sim.phase("liveness");
    sim.heal().await;
    let counts = sim.read_back(&["s1", "s2"]).await;
    let expected: Vec<u64> = ["s1", "s2"]
        .iter()
        .map(|key| model.get(key).map_or(0, |(count, _)| *count))
        .collect();
    assert_eq!(counts, expected, "the counts of s1 and s2");
    sim.audit(&["s1", "s2"]).await;
    sim.finish().await;
}
