//! The agent layer's own store operations outside a turn while the store fails for a
//! moment (`StoreError::Unavailable`): an agent's records read by the API, the
//! organisation and the stored directory changed. Since 2026-12-07 each is tried again
//! (`store_wait.rs`, through `RuntimeHandle::retry_store`) for up to
//! `AGENT_API_STORE_WAIT_MS`; before, each failed at the first `Unavailable`.
//!
//! Method: a `MemoryStore` behind a wrapper that fails its next N operations
//! `Unavailable` on command, or applies its next commit and then answers `Unavailable`
//! (a commit that landed unseen, as a connection cut after the server committed).
//! Both builds; paused time on the normal build, simulated time under madsim; one test
//! on worker threads (normal build).

#[path = "support/forwarding_store.rs"]
mod forwarding_store;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use forwarding_store::{forwarding_state_store, ForwardingStore};
use troupe_agent::{AgentSpec, AgentSystem, DirectoryError, Link, OrgError, ScriptedLlm, AGENT_API_STORE_WAIT_MS};
use troupe_core::ActorId;
use troupe_runtime::{MemoryStore, StateStore, StoreError, StoreOperation};

/// A memory store that fails on command.
#[derive(Default)]
struct Flaky {
    inner: MemoryStore,
    /// How many of the next operations fail `Unavailable` without reaching the data.
    failing: AtomicU32,
    /// How many of the next commits are applied and then answered `Unavailable`.
    applied_unseen: AtomicU32,
}

fn unavailable(operation: StoreOperation) -> StoreError {
    StoreError::Unavailable {
        operation,
        cause: "connection refused (the test's outage)".to_string(),
    }
}

/// Takes one from `left` if it is not 0: whether one was due.
fn take_one(left: &AtomicU32) -> bool {
    left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| left.checked_sub(1))
        .is_ok()
}

#[async_trait]
impl ForwardingStore for Flaky {
    type Inner = MemoryStore;

    fn inner(&self) -> &MemoryStore {
        &self.inner
    }

    /// `Unavailable` if one of the `failing` operations is due.
    fn gate(&self, _actor: &ActorId, operation: StoreOperation) -> Result<(), StoreError> {
        if take_one(&self.failing) {
            return Err(unavailable(operation));
        }
        Ok(())
    }

    /// `Unavailable` if one of the `applied_unseen` commits is due.
    async fn committed(&self, _actor: &ActorId) -> Result<(), StoreError> {
        if take_one(&self.applied_unseen) {
            return Err(unavailable(StoreOperation::Commit));
        }
        Ok(())
    }
}

forwarding_state_store!(Flaky);

/// A system of agents `a` and `b` on `store`.
fn system(store: &Arc<Flaky>) -> AgentSystem {
    AgentSystem::builder()
        .llm(Arc::new(ScriptedLlm::new()))
        .store(Arc::clone(store) as Arc<dyn StateStore>)
        .agent(AgentSpec::new("a"))
        .agent(AgentSpec::new("b"))
        .start()
        .expect("the system starts")
}

fn retries(system: &AgentSystem) -> u64 {
    system.runtime().counters().store_retries
}

/// Goal: an agent's committed records read by the API (`pending`, `task`,
/// `conversation_log_page`) while the store fails three times answer as with the store
/// up, each failure tried again (`store_retries` counts them). Before 2026-12-07 each
/// read failed `Unavailable` at once.
#[tokio::test(start_paused = true)]
async fn an_agents_records_read_while_the_store_fails_three_times_answer() {
    let store = Arc::new(Flaky::default());
    let system = system(&store);
    for read in ["pending", "task", "log page"] {
        let before = retries(&system);
        store.failing.store(3, Ordering::SeqCst);
        let answered = match read {
            "pending" => system.pending("a").await.map(|boxes| format!("{boxes:?}")),
            "task" => system.task("a", "a-task-none").await.map(|task| format!("{task:?}")),
            _ => system
                .conversation_log_page("a", None, 10)
                .await
                .map(|page| format!("{} of {}", page.messages.len(), page.total)),
        };
        let answer = answered.unwrap_or_else(|error| panic!("{read}: {error}"));
        assert_eq!(store.failing.load(Ordering::SeqCst), 0, "{read}: every failure was met");
        assert_eq!(
            retries(&system) - before,
            3,
            "{read} ({answer}): tried again three times"
        );
    }
    system.shutdown().await;
}

/// Goal: a link added while the organisation's claim fails twice and its commit is then
/// applied unseen (answered `Unavailable` after it landed) is added once and answered
/// `Ok`: the commit is made again under the same fence with the same state, which the
/// store applies to the same effect; adding it again is `LinkExists`. An agent defined
/// while the directory's claim fails twice is defined. Before 2026-12-07 both failed
/// `Store(Unavailable)` at the first failure.
#[tokio::test(start_paused = true)]
async fn org_and_directory_changes_wait_out_a_store_down_for_a_moment_and_apply_once() {
    let store = Arc::new(Flaky::default());
    let system = system(&store);
    store.failing.store(2, Ordering::SeqCst);
    store.applied_unseen.store(1, Ordering::SeqCst);
    system
        .add_link(Link::new("a", "b"))
        .await
        .unwrap_or_else(|error| panic!("the link: {error}"));
    assert_eq!(
        store.applied_unseen.load(Ordering::SeqCst),
        0,
        "the commit was applied unseen"
    );
    let org = system.reload_org().await.expect("the organisation reads");
    let links = org
        .links()
        .iter()
        .filter(|link| link.from == "a" && link.to == "b")
        .count();
    assert_eq!(links, 1, "{:?}", org.links());
    match system.add_link(Link::new("a", "b")).await {
        Err(OrgError::LinkExists { .. }) => {}
        other => panic!("the link again: {other:?}"),
    }

    store.failing.store(2, Ordering::SeqCst);
    system
        .define_agent(AgentSpec::new("c"))
        .await
        .unwrap_or_else(|error| panic!("the agent: {error}"));
    assert!(system.current_directory().await.contains("c"));
    system.shutdown().await;
}

/// Goal: with the store down past `AGENT_API_STORE_WAIT_MS`, a read and a change still
/// fail `Unavailable`, after that long (not at once, as before 2026-12-07; not an
/// unbounded wait), with tries made again meanwhile.
#[tokio::test(start_paused = true)]
async fn a_store_down_past_the_wait_still_fails_unavailable_after_it() {
    let store = Arc::new(Flaky::default());
    let system = system(&store);
    let wait = Duration::from_millis(AGENT_API_STORE_WAIT_MS);
    store.failing.store(u32::MAX, Ordering::SeqCst);
    let before = retries(&system);
    let asked = tokio::time::Instant::now();
    let read = system.pending("a").await;
    let took = asked.elapsed();
    assert!(matches!(read, Err(StoreError::Unavailable { .. })), "{read:?}");
    assert!(
        took >= wait - Duration::from_millis(20) && took <= wait,
        "the read failed after {took:?}, its wait {wait:?}"
    );
    let asked = tokio::time::Instant::now();
    let defined = system.define_agent(AgentSpec::new("c")).await;
    let took = asked.elapsed();
    assert!(
        matches!(defined, Err(DirectoryError::Store(StoreError::Unavailable { .. }))),
        "{defined:?}"
    );
    assert!(
        took >= wait - Duration::from_millis(20) && took <= wait,
        "the definition failed after {took:?}, its wait {wait:?}"
    );
    assert!(retries(&system) - before > 20, "tried again meanwhile");
    store.failing.store(0, Ordering::SeqCst);
    system.shutdown().await;
}

/// Goal: on worker threads, reads of many agents' records at once while the store
/// fails for a moment all answer, each failure tried again once. Normal build only
/// (the simulator has one thread).
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_reads_on_worker_threads_wait_out_failures_and_all_answer() {
    /// How many reads run at once.
    const READS: u32 = 16;
    let store = Arc::new(Flaky::default());
    let system = system(&store);
    let before = retries(&system);
    store.failing.store(READS, Ordering::SeqCst);
    let reads: Vec<_> = (0..READS)
        .map(|n| {
            let client = system.client();
            tokio::spawn(async move { client.pending(if n % 2 == 0 { "a" } else { "b" }).await })
        })
        .collect();
    for read in reads {
        let boxes = read.await.expect("the read's task").expect("the read");
        assert_eq!(boxes, (0, 0));
    }
    assert_eq!(store.failing.load(Ordering::SeqCst), 0);
    assert_eq!(retries(&system) - before, u64::from(READS));
    system.shutdown().await;
}
