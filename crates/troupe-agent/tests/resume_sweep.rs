//! A resume sweep (`AgentClient::start_resume_sweep`) processes pending entries that
//! nothing else resumes: no request reaches the agent and the start-up `resume_pending`
//! failed (on a cluster: the agent's node died, and no node starts or asks it). The
//! start-up resume is made to fail by a store that refuses scans until the test lets
//! them through; the sweep's rounds fail meanwhile and go on.
#![cfg(not(madsim))]

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use troupe_agent::limits::{AGENT_RESUME_SWEEP_MS_MAX, AGENT_RESUME_SWEEP_MS_MIN};
use troupe_agent::{ResumeSweepError, ScriptRule, ScriptedLlm};
use troupe_runtime::MemoryStore;

#[path = "support/gate_store.rs"]
mod gate_store;
#[path = "support/left_pending.rs"]
mod left_pending;
use gate_store::GateStore;
use left_pending::{leave_a_notification_pending, notifications, start};

/// The model's latency on a notification, in milliseconds: long enough for the test to
/// stop the first process before the notification's turn commits.
const NOTIFICATION_LATENCY_MS: u64 = 300;
/// The sweep's period in the test, in milliseconds.
const SWEEP_MS: u64 = 200;
/// How long the entry may take to be processed once scans are let through, in ms.
const PROCESS_BOUND_MS: u64 = 10_000;
/// Pause between polls, in milliseconds.
const POLL_MS: u64 = 20;

/// Goal: a persisted, acknowledged notification whose wake-up died with its process,
/// in a second process whose start-up resume failed and which no request reaches, is
/// processed exactly once by the sweep once the store answers again; the sweep's rounds
/// that failed meanwhile did not stop it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sweep_processes_entries_no_request_and_no_start_resumed() {
    let llm = ScriptedLlm::new().rule(
        ScriptRule::any_agent()
            .on_user_containing("[notification")
            .reply("noted")
            .latency(Duration::from_millis(NOTIFICATION_LATENCY_MS)),
    );
    let data = MemoryStore::new();

    // The first process acknowledges the notification, then dies before processing it.
    leave_a_notification_pending(&llm, &data).await;

    // The second process: its start-up resume and the sweep's first rounds fail.
    let second_store = GateStore::new(Arc::new(data.clone()), true);
    let second = start(&llm, Arc::clone(&second_store));
    let sweep = second
        .start_resume_sweep(Duration::from_millis(SWEEP_MS))
        .expect("the period is in range");
    tokio::time::sleep(Duration::from_millis(SWEEP_MS * 3 + NOTIFICATION_LATENCY_MS * 2)).await;
    assert!(
        second_store.refused_scans.load(Ordering::SeqCst) >= 2,
        "the start-up resume and a sweep round tried and were refused"
    );
    assert!(sweep.rounds() >= 2, "failed rounds are counted and the sweep goes on");
    second_store.refuse_scans.store(false, Ordering::SeqCst);
    assert_eq!(
        second.pending("b").await.unwrap(),
        (1, 0),
        "the acknowledged notification is still pending: nothing resumed it"
    );

    // No request: the sweep's next round wakes b, and its activation processes the entry.
    let opened = tokio::time::Instant::now();
    loop {
        let log = second.conversation_log("b").await.unwrap();
        if second.pending("b").await.unwrap() == (0, 0) && notifications(&log) > 0 {
            assert_eq!(notifications(&log), 1, "processed once: {log:?}");
            break;
        }
        assert!(
            opened.elapsed() < Duration::from_millis(PROCESS_BOUND_MS),
            "the pending notification was not processed by the sweep: {:?}",
            second.pending("b").await
        );
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
    // Dropping the sweep stops it: no round completes after.
    let rounds = sweep.rounds();
    drop(sweep);
    tokio::time::sleep(Duration::from_millis(SWEEP_MS * 3)).await;
    let scans = second_store.refused_scans.load(Ordering::SeqCst);
    second_store.refuse_scans.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(SWEEP_MS * 3)).await;
    assert_eq!(
        second_store.refused_scans.load(Ordering::SeqCst),
        scans,
        "a dropped sweep scans no more (it had completed {rounds} rounds)"
    );
    second.shutdown().await;
}

/// Goal: a period outside `AGENT_RESUME_SWEEP_MS_MIN..=AGENT_RESUME_SWEEP_MS_MAX`, or
/// not a whole number of milliseconds, is refused with the range, and nothing runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_period_out_of_range_is_refused_with_the_range() {
    let llm = ScriptedLlm::new().rule(ScriptRule::any_agent().reply("ok"));
    let store = GateStore::new(Arc::new(MemoryStore::new()), false);
    let system = start(&llm, Arc::clone(&store));
    for (every, every_ms) in [
        (Duration::ZERO, 0),
        (
            Duration::from_millis(AGENT_RESUME_SWEEP_MS_MIN - 1),
            AGENT_RESUME_SWEEP_MS_MIN - 1,
        ),
        (
            Duration::from_millis(AGENT_RESUME_SWEEP_MS_MAX + 1),
            AGENT_RESUME_SWEEP_MS_MAX + 1,
        ),
        (Duration::from_micros(150_500), 150),
    ] {
        let refused = system.start_resume_sweep(every).expect_err("out of range");
        assert_eq!(
            refused,
            ResumeSweepError::PeriodOutOfRange {
                every_ms,
                min_ms: AGENT_RESUME_SWEEP_MS_MIN,
                max_ms: AGENT_RESUME_SWEEP_MS_MAX,
            }
        );
        assert!(refused.to_string().contains("100..=3600000 ms"), "{refused}");
    }
    let at_bounds = [AGENT_RESUME_SWEEP_MS_MIN, AGENT_RESUME_SWEEP_MS_MAX]
        .map(|ms| system.start_resume_sweep(Duration::from_millis(ms)).expect("in range"));
    assert_eq!(at_bounds.iter().map(|sweep| sweep.rounds()).sum::<u64>(), 0);
    system.shutdown().await;
}
