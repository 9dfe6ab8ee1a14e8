//! Admission's approval writes while the store is down for a moment
//! (`StoreError::Unavailable`: PostgreSQL restarting, a connection refused): a contact
//! that needs approval records it once the store is back, within the contact's
//! deadline, instead of being refused. Until 2026-12-07 (third session) the write went
//! to the store once: one `Unavailable` refused the contact at once (`NotPermitted`,
//! reason `Unavailable`), though it had 20 s left.
//!
//! Method: a `MemoryStore` switched unavailable (`MemoryStoreFaults::set_unavailable`)
//! just before an `ask_as` from a supervised agent (every contact of it needs approval),
//! and back up by a spawned task [`OUTAGE_MS`] later. The organisation's read is the
//! cache (fresh, or kept while the load fails); its write is what is tried again.
//! Both builds: paused time on the normal build, simulated time under madsim; one test
//! on worker threads (normal build, real time).

use std::sync::Arc;
use std::time::Duration;

use troupe_agent::{AgentEvent, AgentSpec, AgentSystem, BehaviourMode, Membership, ScriptRule, ScriptedLlm};
use troupe_core::Deadline;
use troupe_runtime::{MemoryStore, StateStore};

/// How long the store is down, in milliseconds from the ask.
const OUTAGE_MS: u64 = 300;
/// How long the ask may wait for its reply (its deadline, and its approval's).
const ASK_TIMEOUT: Duration = Duration::from_secs(20);
/// The most the whole test may take, in milliseconds (of real time on worker threads).
const TEST_WAIT_MS_MAX: u64 = 15_000;

/// Agents `a` and `b` answering "ok", on `store`, `a` supervised: its every contact
/// needs approval.
async fn system(store: &Arc<MemoryStore>) -> AgentSystem {
    let system = AgentSystem::builder()
        .llm(Arc::new(ScriptedLlm::new().rule(ScriptRule::any_agent().reply("ok"))))
        .store(Arc::clone(store) as Arc<dyn StateStore>)
        .agent(AgentSpec::new("a"))
        .agent(AgentSpec::new("b"))
        .start()
        .expect("the system starts");
    let supervised = Membership {
        manager: None,
        mode: BehaviourMode::Supervised,
    };
    system.set_membership("a", supervised).await.expect("a supervised");
    system
}

/// Milliseconds from `from` to `to` on the runtime's clock.
fn ms_between(from: Deadline, to: Deadline) -> u64 {
    to.as_micros().saturating_sub(from.as_micros()) / 1_000
}

/// Goal: an `ask_as` from `a` (supervised) to `b` made while the store is down records
/// its approval once the store is back, [`OUTAGE_MS`] later, not refused; exactly one
/// approval is pending (the write tried again is one record), and once it is approved
/// the ask is answered. Before the fix the ask ended at once with `NotPermitted`
/// (reason `Unavailable`, "the memory store is switched unavailable") and no approval
/// was requested.
async fn an_approval_requested_while_the_store_is_down_is_recorded_once_it_is_back() {
    let store = Arc::new(MemoryStore::new());
    let system = system(&store).await;
    let mut events = system.subscribe();

    let start = system.runtime().now();
    store.faults().set_unavailable(true);
    let outage = {
        let store = Arc::clone(&store);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(OUTAGE_MS)).await;
            store.faults().set_unavailable(false);
        })
    };
    let client = system.client();
    let mut asked = tokio::spawn(async move { client.ask_as("a", "b", "status?", ASK_TIMEOUT).await });
    let (id, requested_at) = loop {
        tokio::select! {
            event = events.recv() => {
                if let AgentEvent::ApprovalRequested { id, at, .. } = event.expect("the events") {
                    break (id, at);
                }
            }
            result = &mut asked => panic!(
                "the ask ended before its approval was requested (after {} ms): {:?}",
                ms_between(start, system.runtime().now()),
                result.expect("the ask's task")
            ),
        }
    };
    let requested_ms = ms_between(start, requested_at);
    eprintln!(
        "approval {id} requested {requested_ms} ms after the ask, the store down for {OUTAGE_MS} ms, {} operations failed",
        store.faults().injected_count()
    );
    assert!(
        requested_ms >= OUTAGE_MS,
        "the approval was recorded after {requested_ms} ms, while the store was down ({OUTAGE_MS} ms)"
    );
    assert!(store.faults().injected_count() > 0, "the outage was met");
    outage.await.expect("the outage's task");

    let pending = system.pending_approvals().await.expect("the pending approvals");
    assert_eq!(
        pending.iter().map(|approval| approval.id).collect::<Vec<_>>(),
        vec![id],
        "one approval, requested once: {pending:?}"
    );
    assert_eq!((pending[0].from.as_str(), pending[0].to.as_str()), ("a", "b"));
    system.approve(id).await.expect("the approval");
    let reply = asked
        .await
        .expect("the ask's task")
        .unwrap_or_else(|error| panic!("the approved ask: {error}"));
    assert_eq!(reply.text, "ok");
    system.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn an_approval_requested_while_the_store_is_down_is_recorded_once_it_is_back_paused() {
    an_approval_requested_while_the_store_is_down_is_recorded_once_it_is_back().await;
}

#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_requested_while_the_store_is_down_is_recorded_once_it_is_back_on_worker_threads() {
    tokio::time::timeout(
        Duration::from_millis(TEST_WAIT_MS_MAX),
        an_approval_requested_while_the_store_is_down_is_recorded_once_it_is_back(),
    )
    .await
    .expect("the test ends in time");
}
