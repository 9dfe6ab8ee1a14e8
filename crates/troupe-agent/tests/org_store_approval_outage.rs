//! Admission's approval writes while the store is down for a moment
//! (`StoreError::Unavailable`: PostgreSQL restarting, a connection refused): a contact
//! that needs approval records it once the store is back, within the contact's
//! deadline, instead of being refused. Until 2026-12-07 (third session) the write went
//! to the store once: one `Unavailable` refused the contact at once (`NotPermitted`,
//! reason `Unavailable`), though it had 20 s left.
//!
//! Method: a `MemoryStore` switched unavailable (`MemoryStoreFaults::set_unavailable`)
//! just before an `ask_as` from a supervised agent (every contact of it needs approval),
//! and back up by a spawned task [`OUTAGE_MS`] later; for a delegation made in the
//! sender's turn, a store that fails only the organisation's record while told to (so
//! the turn itself goes on and meets the outage at the approval's write). The
//! organisation's read is the cache (fresh, or kept while the load fails); its write is
//! what is tried again. Both builds: paused time on the normal build, simulated time
//! under madsim; one test on worker threads (normal build, real time).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use troupe_agent::limits::AGENT_TASKS_OPEN_MAX;
use troupe_agent::{
    AgentEvent, AgentSpec, AgentSystem, BehaviourMode, ContactKind, InboxError, Membership, ScriptRule, ScriptedLlm,
};
use troupe_core::Deadline;
use troupe_runtime::{MemoryStore, StateStore};

#[path = "support/org_outage.rs"]
mod org_outage;

use org_outage::OrgOutage;

/// How long the store is down, in milliseconds from the ask.
const OUTAGE_MS: u64 = 300;
/// How long the ask may wait for its reply (its deadline, and its approval's).
const ASK_TIMEOUT: Duration = Duration::from_secs(20);
/// The most the whole test may take, in milliseconds (of real time on worker threads).
#[cfg(not(madsim))]
const TEST_WAIT_MS_MAX: u64 = 15_000;

/// Agents `a` and `b` answering "ok", on `store`, `a` supervised: its every contact
/// needs approval.
async fn system(store: Arc<dyn StateStore>) -> AgentSystem {
    let system = AgentSystem::builder()
        .llm(Arc::new(ScriptedLlm::new().rule(ScriptRule::any_agent().reply("ok"))))
        .store(store)
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

/// The ask `a` → `b` ("status?", [`ASK_TIMEOUT`]) started in a task, and the id and time
/// of the approval it requests; panics, saying after how long, if the ask ends first.
async fn ask_until_approval_requested(
    system: &AgentSystem,
    events: &mut tokio::sync::broadcast::Receiver<AgentEvent>,
) -> (
    tokio::task::JoinHandle<Result<troupe_agent::AgentReply, troupe_agent::AgentCallError>>,
    u64,
    Deadline,
) {
    let start = system.runtime().now();
    let client = system.client();
    let mut asked = tokio::spawn(async move { client.ask_as("a", "b", "status?", ASK_TIMEOUT).await });
    loop {
        tokio::select! {
            biased;
            event = events.recv() => {
                if let AgentEvent::ApprovalRequested { id, at, .. } = event.expect("the events") {
                    return (asked, id, at);
                }
            }
            result = &mut asked => panic!(
                "the ask ended before its approval was requested (after {} ms): {:?}",
                ms_between(start, system.runtime().now()),
                result.expect("the ask's task")
            ),
        }
    }
}

/// Checks that approval `id` is the one pending, approves it, and that `asked` is then
/// answered "ok".
async fn approve_the_one_pending(
    system: &AgentSystem,
    id: u64,
    asked: tokio::task::JoinHandle<Result<troupe_agent::AgentReply, troupe_agent::AgentCallError>>,
) {
    let pending = system.pending_approvals().await.expect("the pending approvals");
    assert_eq!(
        pending.iter().map(|approval| approval.id).collect::<Vec<_>>(),
        vec![id],
        "one approval for the one ask: {pending:?}"
    );
    assert_eq!((pending[0].from.as_str(), pending[0].to.as_str()), ("a", "b"));
    system.approve(id).await.expect("the approval");
    let reply = asked
        .await
        .expect("the ask's task")
        .unwrap_or_else(|error| panic!("the approved ask: {error}"));
    assert_eq!(reply.text, "ok");
}

/// Goal: an `ask_as` from `a` (supervised) to `b` made while the store is down records
/// its approval once the store is back, [`OUTAGE_MS`] later, not refused; exactly one
/// approval is pending (the write tried again is one record), and once it is approved
/// the ask is answered. Before the fix the ask ended at once with `NotPermitted`
/// (reason `Unavailable`, "the memory store is switched unavailable") and no approval
/// was requested.
async fn an_approval_requested_while_the_store_is_down_is_recorded_once_it_is_back() {
    let store = Arc::new(MemoryStore::new());
    let system = system(Arc::clone(&store) as Arc<dyn StateStore>).await;
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
    let (asked, id, requested_at) = ask_until_approval_requested(&system, &mut events).await;
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

    approve_the_one_pending(&system, id, asked).await;
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

/// Goal: a delegation that needs approval, made in its sender's turn while the
/// organisation's store is down, records its approval once the store is back
/// ([`OUTAGE_MS`] later) instead of being refused: the sender's model reads "pending
/// approval N", the approval is listed once its delivery waits for it (one approval:
/// the write tried again is one record), and once approved the task reaches `b`.
/// Before the fix the turn answered after 0 ms and the model read "delegate_to_agent
/// failed: not permitted: a may not delegate to b: the organisation could not be read:
/// the organisation could not be stored: claim failed: connection refused (the test's
/// outage)"; nothing was recorded.
async fn a_delegation_needing_approval_while_the_org_store_is_down_is_recorded_once_it_is_back() {
    let store = Arc::new(OrgOutage::default());
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("hand off")
                .call("delegate_to_agent", json!({"agent_id": "b", "message": "do it"})),
        )
        .rule(ScriptRule::agent("a").on_tool_result().reply("{tool_result}"))
        .rule(ScriptRule::any_agent().reply("done"));
    let system = AgentSystem::builder()
        .llm(Arc::new(llm.clone()))
        .store(Arc::clone(&store) as Arc<dyn StateStore>)
        .agent(AgentSpec::new("a"))
        .agent(AgentSpec::new("b"))
        .start()
        .expect("the system starts");
    let supervised = Membership {
        manager: None,
        mode: BehaviourMode::Supervised,
    };
    system.set_membership("a", supervised).await.expect("a supervised");

    store.org_down.store(true, Ordering::SeqCst);
    let outage = {
        let store = Arc::clone(&store);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(OUTAGE_MS)).await;
            store.org_down.store(false, Ordering::SeqCst);
        })
    };
    let start = system.runtime().now();
    let reply = system.ask("a", "hand off").await.expect("the ask");
    let answered_ms = ms_between(start, system.runtime().now());
    let failures = store.org_failures.load(Ordering::SeqCst);
    eprintln!(
        "the delegating turn answered after {answered_ms} ms, {failures} organisation operations failed: {}",
        reply.text
    );
    assert!(failures > 0, "the approval's write met the outage");
    assert!(
        reply.text.starts_with("task a.0 is pending approval "),
        "the delegation waits for its approval: {}",
        reply.text
    );
    outage.await.expect("the outage's task");

    let mut pending = Vec::new();
    for _ in 0..1_000 {
        pending = system.pending_approvals().await.expect("the pending approvals");
        if !pending.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(pending.len(), 1, "one approval, requested once: {pending:?}");
    assert_eq!(pending[0].kind, ContactKind::Delegate);
    assert!(
        reply
            .text
            .starts_with(&format!("task a.0 is pending approval {}:", pending[0].id)),
        "{}",
        reply.text
    );
    system.approve(pending[0].id).await.expect("the approval");
    for _ in 0..1_000 {
        if !llm.requests_of("b").is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(llm.requests_of("b").len(), 1, "the approved task reached b");
    system.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_delegation_needing_approval_while_the_org_store_is_down_is_recorded_once_it_is_back_paused() {
    a_delegation_needing_approval_while_the_org_store_is_down_is_recorded_once_it_is_back().await;
}

/// Goal: an approval recorded for a send that then fails a later check (the sender has
/// `AGENT_TASKS_OPEN_MAX` delegations open) is withdrawn though the organisation's
/// store goes down just after the approval's write, for [`OUTAGE_MS`]: the withdrawal
/// is tried again (for `ORG_WITHDRAW_STORE_WAIT_MS`, 2 s) and lands once the store is
/// back (the refused send answered after 310 ms). Before the fix it failed at once
/// (logged; the send answered after 0 ms) and the approval stayed recorded, unlisted,
/// until its deadline: 65 pending approvals, `AGENT_TASKS_OPEN_MAX` + 1. Method:
/// `a` supervised delegates `AGENT_TASKS_OPEN_MAX` jobs through the API (each waits for
/// approval), then one more with the outage armed to start after its approval's commit.
async fn an_approval_withdrawn_while_the_org_store_is_down_is_withdrawn_once_it_is_back() {
    let store = Arc::new(OrgOutage::default());
    let system = AgentSystem::builder()
        .llm(Arc::new(ScriptedLlm::new().rule(ScriptRule::any_agent().reply("done"))))
        .store(Arc::clone(&store) as Arc<dyn StateStore>)
        .agent(AgentSpec::new("a"))
        .agent(AgentSpec::new("b"))
        .start()
        .expect("the system starts");
    let supervised = Membership {
        manager: None,
        mode: BehaviourMode::Supervised,
    };
    system.set_membership("a", supervised).await.expect("a supervised");
    for job in 0..AGENT_TASKS_OPEN_MAX {
        system
            .delegate("a", "b", &format!("job {job}"), None)
            .await
            .expect("a delegation waiting for approval");
    }

    // Every delivery lists its approval (a write of the organisation) once its turn
    // committed: all listed, the next write is the refused send's approval.
    let max = usize::try_from(AGENT_TASKS_OPEN_MAX).unwrap();
    for _ in 0..1_000 {
        if system.pending_approvals().await.expect("the pending approvals").len() == max {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(
        system.pending_approvals().await.expect("the pending approvals").len(),
        max
    );

    store.down_after_commit.store(true, Ordering::SeqCst);
    let outage = {
        let store = Arc::clone(&store);
        tokio::spawn(async move {
            while !store.org_down.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            tokio::time::sleep(Duration::from_millis(OUTAGE_MS)).await;
            store.org_down.store(false, Ordering::SeqCst);
        })
    };
    let start = system.runtime().now();
    let one_more = system.delegate("a", "b", "one job too many", None).await;
    let answered_ms = ms_between(start, system.runtime().now());
    let failures = store.org_failures.load(Ordering::SeqCst);
    eprintln!("the refused delegation answered after {answered_ms} ms, {failures} organisation operations failed");
    assert!(matches!(one_more, Err(InboxError::OutboxFull { .. })), "{one_more:?}");
    assert!(failures > 0, "the withdrawal met the outage");
    outage.await.expect("the outage's task");

    let org = system.organisation().await.expect("the organisation");
    let recorded = org.pending_approvals();
    assert!(
        recorded.iter().all(|approval| approval.message != "one job too many"),
        "the refused delegation's approval was withdrawn: {} recorded",
        recorded.len()
    );
    assert_eq!(recorded.len(), max);
    system.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn an_approval_withdrawn_while_the_org_store_is_down_is_withdrawn_once_it_is_back_paused() {
    an_approval_withdrawn_while_the_org_store_is_down_is_withdrawn_once_it_is_back().await;
}

/// Goal: an approval whose write lands but whose answer is lost, and whose record is
/// then claimed by another process before the write is tried again, is recorded once:
/// the write made again (fenced, then decided on the newest record) finds the first
/// try's approval there and answers its id instead of recording a second. Method: a
/// store whose next commit of the organisation's record lands, is followed by a claim
/// of that record, and answers `Unavailable`; `a` (supervised) asks `b`. Before the fix
/// two approvals were pending for the one ask, the first (nobody waiting for it) left
/// until its deadline: "one approval for the one ask: [Approval { id: 1, .. }, Approval
/// { id: 2, .. }]".
async fn an_approval_whose_write_landed_unseen_and_was_claimed_since_is_recorded_once() {
    let store = Arc::new(OrgOutage::default());
    let system = system(Arc::clone(&store) as Arc<dyn StateStore>).await;
    let mut events = system.subscribe();

    store.unseen_then_claimed.store(true, Ordering::SeqCst);
    let (asked, id, _) = ask_until_approval_requested(&system, &mut events).await;
    assert_eq!(
        store.org_failures.load(Ordering::SeqCst),
        1,
        "the approval's answer was lost once"
    );
    assert!(!store.unseen_then_claimed.load(Ordering::SeqCst), "the fault was met");

    approve_the_one_pending(&system, id, asked).await;
    system.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn an_approval_whose_write_landed_unseen_and_was_claimed_since_is_recorded_once_paused() {
    an_approval_whose_write_landed_unseen_and_was_claimed_since_is_recorded_once().await;
}

#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_whose_write_landed_unseen_and_was_claimed_since_is_recorded_once_on_worker_threads() {
    tokio::time::timeout(
        Duration::from_millis(TEST_WAIT_MS_MAX),
        an_approval_whose_write_landed_unseen_and_was_claimed_since_is_recorded_once(),
    )
    .await
    .expect("the test ends in time");
}
