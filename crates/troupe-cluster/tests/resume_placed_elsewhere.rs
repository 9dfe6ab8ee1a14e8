//! Goal: `AgentClient::resume_pending` (at `attach`, and in each resume sweep round)
//! wakes an agent with pending entries only when the runtime's root router says it is not
//! placed on another node: placed elsewhere, or not known where (the lookup failed), it
//! is left alone (nothing activated, not counted as woken) for a later call to look
//! again; placed here or nowhere, it is woken and its entry processed. One lookup per
//! agent with pending entries, none for the others.
//!
//! Method: one process, no etcd: a root router whose answer to `placed_elsewhere` the
//! test sets (its requests run locally), installed before the agent system attaches. A
//! notification to `b` is left pending by a first process that died
//! (`troupe-agent/tests/support/left_pending.rs`); the second process, with the router,
//! has agents `a` (nothing pending) and `b`.
//!
//! Run with `cargo nextest run -p troupe-cluster --test resume_placed_elsewhere`.
#![cfg(not(madsim))]

#[path = "../../troupe-agent/tests/support/gate_store.rs"]
#[allow(dead_code)]
mod gate_store;
#[path = "../../troupe-agent/tests/support/left_pending.rs"]
#[allow(dead_code)]
mod left_pending;

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use left_pending::{leave_a_notification_pending, notifications};
use troupe_agent::{AgentClient, AgentSpec, AgentSystem, ScriptRule, ScriptedLlm};
use troupe_core::{ActorId, Deadline, InvokeError};
use troupe_runtime::{MemoryStore, RootCallRouter, Runtime, RuntimeHandle, WeakRuntimeHandle};

/// The model's latency on a notification, in milliseconds: long enough for the first
/// process to die before its turn on it commits.
const NOTIFICATION_LATENCY_MS: u64 = 300;
/// How long the test watches a left-alone entry stay pending, in milliseconds: past the
/// time attach's resume and the entry's turn would take.
const LEFT_ALONE_MS: u64 = 4 * NOTIFICATION_LATENCY_MS;
/// How long the entry may take to be processed once woken, in milliseconds.
const PROCESS_BOUND_MS: u64 = 10_000;
/// Pause between polls, in milliseconds.
const POLL_MS: u64 = 20;

/// What the test router says of every actor.
#[derive(Clone, Copy)]
#[repr(u8)]
enum Answer {
    Elsewhere = 0,
    Unknown = 1,
    HereOrNowhere = 2,
}

/// A root router that runs every request locally and answers `placed_elsewhere` as the
/// test set it, counting the questions by actor.
struct TestRouter {
    handle: WeakRuntimeHandle,
    answer: AtomicU8,
    asked_b: AtomicU64,
    asked_others: AtomicU64,
}

impl TestRouter {
    fn set(&self, answer: Answer) {
        self.answer.store(answer as u8, Ordering::SeqCst);
    }
}

#[async_trait]
impl RootCallRouter for TestRouter {
    async fn invoke_root(&self, target: &ActorId, payload: Bytes, deadline: Deadline) -> Result<Bytes, InvokeError> {
        let handle = self.handle.upgrade().ok_or(InvokeError::Shutdown)?;
        handle.invoke_root_for_router(target, payload, deadline).await
    }

    async fn placed_elsewhere(&self, target: &ActorId) -> Result<bool, InvokeError> {
        if target.key() == "b" {
            self.asked_b.fetch_add(1, Ordering::SeqCst);
        } else {
            self.asked_others.fetch_add(1, Ordering::SeqCst);
        }
        match self.answer.load(Ordering::SeqCst) {
            0 => Ok(true),
            1 => Err(InvokeError::Unreachable {
                target: target.clone(),
                cause: "the test's placement store does not answer".to_string(),
            }),
            _ => Ok(false),
        }
    }
}

/// The second process on `data`: agents `a` and `b`, the router installed (answering
/// `answer`) before the system attaches, so attach's own resume asks it.
fn second_process(llm: &ScriptedLlm, data: &MemoryStore, answer: Answer) -> (Runtime, Arc<TestRouter>, AgentClient) {
    let (builder, pending) = AgentSystem::builder()
        .store(Arc::new(data.clone()))
        .llm(Arc::new(llm.clone()))
        .agent(AgentSpec::new("a"))
        .agent(AgentSpec::new("b"))
        .prepare()
        .expect("the system is valid");
    let runtime = builder.start();
    let handle: RuntimeHandle = runtime.handle();
    let router = Arc::new(TestRouter {
        handle: handle.downgrade(),
        answer: AtomicU8::new(answer as u8),
        asked_b: AtomicU64::new(0),
        asked_others: AtomicU64::new(0),
    });
    assert!(handle.set_root_call_router(router.clone()).is_ok(), "no router yet");
    let client = pending.attach(handle).expect("the runtime has the agent kinds");
    (runtime, router, client)
}

/// `b`'s pending (inbox, outbox) entries and the activations the runtime has started.
async fn pending_and_activations(client: &AgentClient) -> ((u64, u64), u64) {
    let pending = client.pending("b").await.expect("the counters read");
    (pending, client.runtime().counters().activations_started)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agent_placed_elsewhere_or_not_known_where_is_not_resumed_here() {
    let llm = ScriptedLlm::new().rule(
        ScriptRule::any_agent()
            .on_user_containing("[notification")
            .reply("noted")
            .latency(Duration::from_millis(NOTIFICATION_LATENCY_MS)),
    );
    let data = MemoryStore::new();
    leave_a_notification_pending(&llm, &data).await;

    // Placed on another node: attach's resume leaves b alone.
    let (_runtime, router, client) = second_process(&llm, &data, Answer::Elsewhere);
    let attached = tokio::time::Instant::now();
    tokio::time::sleep(Duration::from_millis(LEFT_ALONE_MS)).await;
    assert_eq!(
        pending_and_activations(&client).await,
        ((1, 0), 0),
        "placed elsewhere: b's entry still pending, nothing activated here (attach)"
    );
    while router.asked_b.load(Ordering::SeqCst) == 0 {
        assert!(
            attached.elapsed() < Duration::from_millis(PROCESS_BOUND_MS),
            "attach's resume did not ask where b is"
        );
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
    assert_eq!(client.resume_pending().await, Ok(0), "placed elsewhere: none woken");

    // Not known where (the lookup failed): left alone too, for a later round.
    router.set(Answer::Unknown);
    assert_eq!(client.resume_pending().await, Ok(0), "not known where: none woken");
    tokio::time::sleep(Duration::from_millis(LEFT_ALONE_MS)).await;
    assert_eq!(
        pending_and_activations(&client).await,
        ((1, 0), 0),
        "not known where: b's entry still pending, nothing activated here"
    );
    assert_eq!(
        (
            router.asked_b.load(Ordering::SeqCst),
            router.asked_others.load(Ordering::SeqCst)
        ),
        (3, 0),
        "one lookup per resume for b (attach, then two calls), none for a (nothing pending)"
    );

    // Here or nowhere: woken here, and its entry processed once.
    router.set(Answer::HereOrNowhere);
    assert_eq!(client.resume_pending().await, Ok(1), "placed here or nowhere: b woken");
    let woken = tokio::time::Instant::now();
    loop {
        let log = client.conversation_log("b").await.expect("the log reads");
        if client.pending("b").await.expect("the counters read") == (0, 0) && notifications(&log) > 0 {
            assert_eq!(notifications(&log), 1, "processed once: {log:?}");
            break;
        }
        assert!(
            woken.elapsed() < Duration::from_millis(PROCESS_BOUND_MS),
            "the woken entry was not processed: {:?}",
            client.pending("b").await
        );
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
}
