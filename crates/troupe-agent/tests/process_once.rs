//! Resumes of an agent tell each pending inbox entry's `Process` once while it is
//! queued: a second would be a turn that reads the entry and finds it gone. On a slow
//! disk a cluster's resume sweep (one round a second) piled such turns up in a busy
//! agent's mailbox (`cluster_conversation_partition_dst.rs`, seed 13: 107 of 180
//! `Process` turns found nothing).
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

/// How long `b`'s holding turn takes: every resume of the test is queued behind it.
const HOLD: Duration = Duration::from_secs(2);
/// The model's latency on the notification, longer than the first process lives.
const NOTIFICATION_LATENCY: Duration = Duration::from_millis(300);
/// Resumes told while `b` holds.
const RESUMES: usize = 10;
/// How long the entry may take to be processed after the hold, at most.
const PROCESS_BOUND: Duration = Duration::from_secs(10);

/// Goal: a pending notification (left by a process that died) is read by exactly one
/// `Process` turn in the next process, although that process resumed `b` 11 times
/// while `b` was busy (its first request's own resume, then [`RESUMES`] from
/// `resume_pending`), all queued behind the busy turn. Before, each resume told another
/// `Process`, and each read the entry (`inbox/` gets of `b`, counted): 11 reads. The
/// notification is processed once either way. Multi-thread runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumes_of_a_busy_agent_tell_a_queued_entry_once() {
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("b")
                .on_user_containing("hold")
                .reply("held")
                .latency(HOLD),
        )
        .rule(
            ScriptRule::agent("b")
                .on_user_containing("[notification")
                .reply("noted")
                .latency(NOTIFICATION_LATENCY),
        );
    let data = MemoryStore::new();
    leave_a_notification_pending(&llm, &data).await;

    // The second process's start-up resume fails (scans refused), so the entry waits
    // for the resumes below.
    let store = GateStore::new(Arc::new(data.clone()), true);
    let second = start(&llm, Arc::clone(&store));
    tokio::time::sleep(Duration::from_millis(100)).await;
    store.refuse_scans.store(false, Ordering::SeqCst);
    store.count_gets(|actor, key| actor.key() == "b" && key.starts_with("inbox/"));

    // b's first request holds it; its activation's own resume is queued behind it.
    let client = second.client();
    let hold = tokio::spawn(async move { client.ask("b", "hold").await.unwrap() });
    tokio::time::sleep(Duration::from_millis(200)).await;
    for _ in 0..RESUMES {
        assert_eq!(second.resume_pending().await.unwrap(), 1, "b has a pending entry");
    }
    assert!(!hold.is_finished(), "every resume is queued behind the holding turn");
    assert_eq!(hold.await.unwrap().text, "held");

    tokio::time::timeout(PROCESS_BOUND, async {
        while second.pending("b").await.unwrap().0 > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the notification is processed");
    // What was queued behind the hold has run by the end of one more request.
    assert_eq!(second.ask("b", "hold").await.unwrap().text, "held");
    assert_eq!(
        store.counted_gets(),
        1,
        "one Process turn read the entry; no resume told a second while it was queued"
    );
    let log = second.conversation_log("b").await.unwrap();
    assert_eq!(notifications(&log), 1, "processed once");
    second.shutdown().await;
}
