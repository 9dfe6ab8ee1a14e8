//! An agent activation resumes its own pending inbox entries on its first request, even
//! when nothing else resumes them (on a cluster: the agent's node died and another node
//! activates it; `resume_pending` at that node's start may not reach it). Here the
//! start-up `resume_pending` is made to fail by a store that refuses scans until the
//! test lets them through, so only the activation's own resume can process the entry.
#![cfg(not(madsim))]

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use troupe_agent::{ScriptRule, ScriptedLlm};
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
/// How long the entry may take to be processed once the agent is asked, in ms.
const PROCESS_BOUND_MS: u64 = 10_000;
/// Pause between polls, in milliseconds.
const POLL_MS: u64 = 20;

/// Goal: a persisted, acknowledged notification whose wake-up died with its process is
/// processed exactly once by the agent's next activation, on its first request, when
/// the start-up `resume_pending` could not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_activation_processes_entries_left_pending_when_nothing_resumed_them() {
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::any_agent()
                .on_user_containing("[notification")
                .reply("noted")
                .latency(Duration::from_millis(NOTIFICATION_LATENCY_MS)),
        )
        .rule(ScriptRule::any_agent().on_user_containing("ping").reply("pong"));
    let data = MemoryStore::new();

    // The first process acknowledges the notification, then dies before processing it.
    leave_a_notification_pending(&llm, &data).await;

    // The second process: its start-up resume fails (scans refused).
    let second_store = GateStore::new(Arc::new(data.clone()), true);
    let second = start(&llm, Arc::clone(&second_store));
    while second_store.refused_scans.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
    tokio::time::sleep(Duration::from_millis(NOTIFICATION_LATENCY_MS * 2)).await;
    second_store.refuse_scans.store(false, Ordering::SeqCst);
    assert_eq!(
        second.pending("b").await.unwrap(),
        (1, 0),
        "the acknowledged notification is still pending: nothing resumed it"
    );

    // Any request activates b, and the activation resumes its own entry.
    let reply = second.ask("b", "ping").await.expect("b answers");
    assert_eq!(reply.text, "pong");
    let asked = tokio::time::Instant::now();
    loop {
        let log = second.conversation_log("b").await.unwrap();
        if second.pending("b").await.unwrap() == (0, 0) && notifications(&log) > 0 {
            assert_eq!(notifications(&log), 1, "processed once: {log:?}");
            break;
        }
        assert!(
            asked.elapsed() < Duration::from_millis(PROCESS_BOUND_MS),
            "the pending notification was not processed after b's activation: {:?}",
            second.pending("b").await
        );
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
    second.shutdown().await;
}
