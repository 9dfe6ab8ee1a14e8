//! Admission while a change of the organisation waits out a store that fails for a
//! moment (`StoreError::Unavailable`). The change holds the organisation's writers'
//! lock while it tries again (up to `AGENT_API_STORE_WAIT_MS`, 10 s, since ce7858f);
//! a read of a cache older than `ORG_CACHE_MAX_AGE_MS` waits for that lock at most
//! `ORG_READ_LOCK_WAIT_MS` and then decides on its cache, if it is younger than
//! `ORG_CACHE_STALE_MAX_MS`. Before 2026-12-07 (second session) the read waited for
//! the lock until the change's tries ended: every `ask_as`, `call_agent` and turn of
//! the process was held up to 10 s.
//!
//! Method: a `MemoryStore` behind a wrapper that fails every operation on the
//! organisation's record (`troupe-org/org`) `Unavailable` while told to, so the agents'
//! own activations and turns go on. Both builds: paused time on the normal build,
//! simulated time under madsim; one test on worker threads (normal build, real time).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use troupe_agent::{
    AgentCallError, AgentEvent, AgentSpec, AgentSystem, ContactKind, Link, NotPermitted, NotPermittedReason, OrgPolicy,
    ScriptRule, ScriptedLlm, ORG_CACHE_MAX_AGE_MS, ORG_CACHE_STALE_MAX_MS, ORG_READ_LOCK_WAIT_MS,
};
use troupe_core::Deadline;
use troupe_runtime::StateStore;

#[path = "support/org_outage.rs"]
mod org_outage;

use org_outage::OrgOutage;

/// The most an admission may take past `ORG_READ_LOCK_WAIT_MS`, in milliseconds of
/// paused or simulated time: the in-memory store and the dispatcher take microseconds.
const DECISION_SLACK_MS: u64 = 20;
/// How long a test lets the change try again before it reads, in milliseconds: past
/// the first pauses (10, 20 ms), so the change holds the lock between two tries.
const CHANGE_HEAD_START_MS: u64 = 50;
/// How long the test's `ask_as` may wait for its reply.
const ASK_TIMEOUT: Duration = Duration::from_secs(20);

/// Agents `a`, `b` and `c`, each answering "ok"; links required, one link `a ↔ b`.
/// Returns the system and the organisation's version after that setup.
async fn system(store: &Arc<OrgOutage>) -> (AgentSystem, u64) {
    let system = AgentSystem::builder()
        .llm(Arc::new(ScriptedLlm::new().rule(ScriptRule::any_agent().reply("ok"))))
        .store(Arc::clone(store) as Arc<dyn StateStore>)
        .agent(AgentSpec::new("a"))
        .agent(AgentSpec::new("b"))
        .agent(AgentSpec::new("c"))
        .start()
        .expect("the system starts");
    system.set_org_policy(OrgPolicy::Enforced).await.expect("the policy");
    system.add_link(Link::new("a", "b")).await.expect("the link a-b");
    let version = system.organisation().await.expect("the organisation").version();
    (system, version)
}

/// Milliseconds from `from` to `to` on the runtime's clock.
fn ms_between(from: Deadline, to: Deadline) -> u64 {
    to.as_micros().saturating_sub(from.as_micros()) / 1_000
}

/// The first `ContactDecided` event from `from` to `to` received: its organisation's
/// version, whether it was permitted, and when.
fn decided(events: &mut tokio::sync::broadcast::Receiver<AgentEvent>, from: &str, to: &str) -> (u64, bool, Deadline) {
    loop {
        match events.try_recv() {
            Ok(AgentEvent::ContactDecided {
                from: sender,
                to: target,
                org_version,
                permitted,
                at,
                ..
            }) if sender.key() == from && target.key() == to => return (org_version, permitted, at),
            Ok(_) => {}
            Err(error) => panic!("no decision of {from} -> {to} was reported: {error}"),
        }
    }
}

/// Goal: with the organisation's store down and a change of it trying again (holding
/// the writers' lock), an `ask_as` over a link whose cached organisation is older than
/// `ORG_CACHE_MAX_AGE_MS` is decided on that cache within `ORG_READ_LOCK_WAIT_MS`, and
/// answered; a contact without a link is refused `NoLink` as fast; the change is still
/// trying meanwhile. Once the store is back the change lands, once. Before 2026-12-07
/// (second session) the ask waited for the lock until the change's tries ended at
/// `AGENT_API_STORE_WAIT_MS` (10 s), and the change had failed by then.
#[tokio::test(start_paused = true)]
async fn an_admission_during_an_org_change_waiting_out_the_store_decides_on_the_cache() {
    let store = Arc::new(OrgOutage::default());
    let (system, version) = system(&store).await;
    // The cache is older than its fresh age, younger than the stale bound.
    tokio::time::sleep(Duration::from_millis(ORG_CACHE_MAX_AGE_MS + 500)).await;

    store.org_down.store(true, Ordering::SeqCst);
    let client = system.client();
    let change = tokio::spawn(async move { client.add_link(Link::new("b", "c")).await });
    tokio::time::sleep(Duration::from_millis(CHANGE_HEAD_START_MS)).await;
    assert!(
        store.org_failures.load(Ordering::SeqCst) >= 2,
        "the change is trying again"
    );

    let mut events = system.subscribe();
    let start = system.runtime().now();
    let reply = system
        .ask_as("a", "b", "status?", ASK_TIMEOUT)
        .await
        .unwrap_or_else(|error| panic!("the ask over the link: {error}"));
    let answered_ms = ms_between(start, system.runtime().now());
    assert_eq!(reply.text, "ok");
    let (decided_on, permitted, at) = decided(&mut events, "a", "b");
    let decided_ms = ms_between(start, at);
    assert!(
        decided_ms <= ORG_READ_LOCK_WAIT_MS + DECISION_SLACK_MS,
        "the ask was decided after {decided_ms} ms (answered after {answered_ms} ms); the bound {ORG_READ_LOCK_WAIT_MS} ms"
    );
    assert!(permitted);
    assert_eq!(decided_on, version, "decided on the cached organisation");

    let start = system.runtime().now();
    let refused = system.ask_as("a", "c", "status?", ASK_TIMEOUT).await;
    let refused_ms = ms_between(start, system.runtime().now());
    match refused {
        Err(AgentCallError::NotPermitted(NotPermitted {
            kind: ContactKind::Ask,
            reason: NotPermittedReason::NoLink,
            ..
        })) => {}
        other => panic!("a -> c without a link: {other:?}"),
    }
    assert!(
        refused_ms <= ORG_READ_LOCK_WAIT_MS + DECISION_SLACK_MS,
        "the refusal took {refused_ms} ms; the bound {ORG_READ_LOCK_WAIT_MS} ms"
    );
    assert!(
        !change.is_finished(),
        "the change is still trying while the store is down"
    );

    store.org_down.store(false, Ordering::SeqCst);
    change
        .await
        .expect("the change's task")
        .unwrap_or_else(|error| panic!("the change once the store is back: {error}"));
    let org = system.reload_org().await.expect("the organisation reads");
    let links = org
        .links()
        .iter()
        .filter(|link| link.from == "b" && link.to == "c")
        .count();
    assert_eq!(links, 1, "{:?}", org.links());
    assert_eq!(org.version(), version + 1, "one change landed");
    assert_eq!(
        system
            .ask_as("b", "c", "status?", ASK_TIMEOUT)
            .await
            .expect("b -> c")
            .text,
        "ok"
    );
    system.shutdown().await;
}

/// Goal: a cache older than `ORG_CACHE_STALE_MAX_MS` is never decided on: with the
/// store down and a change trying again, an `ask_as` waits for the change (as before
/// 2026-12-07) and, the store back, is decided on the organisation the change made.
/// (Not a test of the fix: it holds before and after it, and fails if the read fell
/// back on a cache of any age.)
#[tokio::test(start_paused = true)]
async fn an_admission_with_a_cache_too_old_to_keep_waits_for_the_change() {
    /// When the store comes back after the change started, in milliseconds.
    const OUTAGE_MS: u64 = 2_000;
    let store = Arc::new(OrgOutage::default());
    let (system, version) = system(&store).await;
    tokio::time::sleep(Duration::from_millis(ORG_CACHE_STALE_MAX_MS + 1_000)).await;

    store.org_down.store(true, Ordering::SeqCst);
    let client = system.client();
    let change = tokio::spawn(async move { client.add_link(Link::new("b", "c")).await });
    let outage = Arc::clone(&store);
    let back = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(OUTAGE_MS)).await;
        outage.org_down.store(false, Ordering::SeqCst);
    });
    tokio::time::sleep(Duration::from_millis(CHANGE_HEAD_START_MS)).await;

    let mut events = system.subscribe();
    let start = system.runtime().now();
    let reply = system
        .ask_as("a", "b", "status?", ASK_TIMEOUT)
        .await
        .unwrap_or_else(|error| panic!("the ask over the link: {error}"));
    assert_eq!(reply.text, "ok");
    let (decided_on, permitted, at) = decided(&mut events, "a", "b");
    assert!(permitted);
    assert_eq!(decided_on, version + 1, "decided on the changed organisation");
    let decided_ms = ms_between(start, at);
    assert!(
        decided_ms >= OUTAGE_MS - CHANGE_HEAD_START_MS - DECISION_SLACK_MS,
        "decided after {decided_ms} ms, before the store was back"
    );
    change.await.expect("the change's task").expect("the change");
    back.await.expect("the outage's task");
    system.shutdown().await;
}

/// Goal: on worker threads, many `ask_as` at once over a link, while a change of the
/// organisation waits out its store, are all answered on the cached organisation
/// while the change still tries; the store back, the change lands once. Normal build
/// only (the simulator has one thread), real time: the cache is made old by a real
/// 1.1 s sleep. Before 2026-12-07 (second session) every ask waited for the change's
/// tries to end (10 s), and the change had failed by then.
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_admissions_on_worker_threads_do_not_wait_for_an_org_change() {
    /// How many asks run at once.
    const ASKS: usize = 8;
    /// How long the test waits for the change to start trying again, in milliseconds.
    const CHANGE_START_WAIT_MS: u64 = 5_000;
    let store = Arc::new(OrgOutage::default());
    let (system, version) = system(&store).await;
    tokio::time::sleep(Duration::from_millis(ORG_CACHE_MAX_AGE_MS + 100)).await;

    store.org_down.store(true, Ordering::SeqCst);
    let client = system.client();
    let change = tokio::spawn(async move { client.add_link(Link::new("b", "c")).await });
    let waiting = tokio::time::Instant::now();
    while store.org_failures.load(Ordering::SeqCst) < 2 {
        assert!(
            waiting.elapsed() < Duration::from_millis(CHANGE_START_WAIT_MS),
            "the change did not start"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }

    let started = tokio::time::Instant::now();
    let asks: Vec<_> = (0..ASKS)
        .map(|n| {
            let client = system.client();
            let (from, to) = if n % 2 == 0 { ("a", "b") } else { ("b", "a") };
            tokio::spawn(async move { client.ask_as(from, to, "status?", ASK_TIMEOUT).await })
        })
        .collect();
    for ask in asks {
        let reply = ask.await.expect("the ask's task").expect("the ask over the link");
        assert_eq!(reply.text, "ok");
    }
    let took = started.elapsed();
    assert!(
        !change.is_finished(),
        "every ask was answered while the change still tried (they took {took:?})"
    );
    assert!(
        took < Duration::from_millis(troupe_agent::AGENT_API_STORE_WAIT_MS),
        "the asks took {took:?}"
    );

    store.org_down.store(false, Ordering::SeqCst);
    change.await.expect("the change's task").expect("the change");
    let org = system.reload_org().await.expect("the organisation reads");
    assert_eq!(org.version(), version + 1, "one change landed: {:?}", org.links());
    system.shutdown().await;
}
