//! The cluster probed from outside, as an embedder uses it on day one: two
//! `ClusterNode`s in one process on a real etcd (Debian `etcd-server`, started per test
//! on loopback) and one SQLite file both nodes open (one handle each, as two processes
//! would), on tokio's multi-thread runtime. Only the public API is used.
//!
//! Each test checks one promise an embedder relies on: one activation per actor for a
//! burst of first calls from both nodes; a dropped node's actors taken over even while
//! the embedder still holds a client of it; a node leaving under traffic; a node that
//! lost its lease still routing calls as a client; a second node under a live node's
//! name refused at start; a call's deadline kept across nodes; etcd unreachable at
//! start, or one of its endpoints dead, reported or survived within bounded times; etcd
//! restarted.
//! Every await is bounded; each test ends by itself within seconds.
//!
//! Run with `cargo nextest run -p troupe-cluster --test embedder_probes`.
#![cfg(not(madsim))]

#[path = "../../troupe-etcd/tests/support/etcd_server.rs"]
mod etcd_server;

use std::collections::BTreeSet;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use etcd_server::{free_port, TestEtcd, TEST_LEASE_TTL_S, TEST_REQUEST_TIMEOUT_MS};
use tokio::time::Instant;
use troupe_cluster::{ClusterError, ClusterNode};
use troupe_core::{ActorId, ActorKind, InvokeError};
use troupe_etcd::{EtcdConfig, LeaseLostReason, NodeId, PlacementError};
use troupe_runtime::{Actor, ActorBox, ActorError, KindConfig, RuntimeBuilder, SqliteStore, Turn};

/// Deadline of an ordinary call, in milliseconds.
const CALL_TIMEOUT_MS: u64 = 5_000;
/// Bound on any single await of a test that is not a call, in milliseconds.
const STEP_TIMEOUT_MS: u64 = 15_000;
/// Allowance for a loaded 2-core machine on top of a bound a test checks, in ms.
const SCHEDULING_ALLOWANCE_MS: u64 = 2_000;
/// Concurrent first calls each node makes in the burst test.
const BURST_CALLS_PER_NODE: usize = 24;
/// Pause between two attempts of a call that waits for a takeover, in milliseconds.
const RETRY_PAUSE_MS: u64 = 50;

/// Counts its calls; `sleep:<ms>` sleeps first. Each reply is `node:count`.
struct Probe {
    node: String,
    count: u64,
}

impl Actor for Probe {
    async fn handle(&mut self, _turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        if let Some(size) = payload.strip_prefix(b"big:".as_slice()) {
            let size: usize = std::str::from_utf8(size)
                .ok()
                .and_then(|text| text.parse().ok())
                .ok_or_else(|| ActorError::failed("big:<bytes>"))?;
            return Ok(Bytes::from(vec![b'x'; size]));
        }
        if payload.len() > 1_024 {
            return Ok(Bytes::from(format!("{}:{}", self.node, payload.len())));
        }
        if let Some(ms) = payload.strip_prefix(b"sleep:".as_slice()) {
            let ms: u64 = std::str::from_utf8(ms)
                .ok()
                .and_then(|text| text.parse().ok())
                .ok_or_else(|| ActorError::failed("sleep:<ms>"))?;
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        self.count += 1;
        Ok(Bytes::from(format!("{}:{}", self.node, self.count)))
    }

    fn snapshot(&self) -> Result<Option<Bytes>, ActorError> {
        Ok(Some(Bytes::from(self.count.to_string())))
    }
}

/// A runtime with the `probe` kind; every activation (factory call) on any node counts
/// in `activations`.
fn probe_runtime(node: &str, activations: Arc<AtomicU64>) -> RuntimeBuilder {
    let node = node.to_string();
    troupe_runtime::Runtime::builder()
        .register(
            ActorKind::new("probe").expect("a kind name"),
            move |_id: &ActorId, saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
                activations.fetch_add(1, Ordering::SeqCst);
                let count = match saved {
                    None => 0,
                    Some(bytes) => std::str::from_utf8(&bytes)
                        .ok()
                        .and_then(|text| text.parse().ok())
                        .ok_or_else(|| ActorError::failed("the saved count is not a number"))?,
                };
                Ok(ActorBox::new(Probe {
                    node: node.clone(),
                    count,
                }))
            },
            KindConfig::default(),
        )
        .expect("register the probe kind")
}

fn probe(key: &str) -> ActorId {
    ActorId::new("probe", key).expect("an actor id")
}

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().expect("an address")
}

/// Awaits `future`, failing the test with `what` if it takes longer than
/// [`STEP_TIMEOUT_MS`].
async fn bounded<T>(what: &str, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_millis(STEP_TIMEOUT_MS), future)
        .await
        .unwrap_or_else(|_| panic!("{what} did not end within {STEP_TIMEOUT_MS} ms"))
}

/// Splits a reply `node:count`.
fn parse_reply(reply: &[u8]) -> (String, u64) {
    let text = std::str::from_utf8(reply).expect("a text reply");
    let (node, count) = text.rsplit_once(':').expect("node:count");
    (node.to_string(), count.parse().expect("a count"))
}

/// An etcd of its own and a shared SQLite file in a directory of its own, for nodes that
/// count their activations together ([`two_nodes`]).
struct Pair {
    etcd: TestEtcd,
    _directory: tempfile::TempDir,
    path: std::path::PathBuf,
    activations: Arc<AtomicU64>,
}

/// A [`Pair`] and nodes `node-a` and `node-b` on it.
async fn two_nodes(name: &str) -> (Pair, ClusterNode, ClusterNode) {
    let etcd = TestEtcd::start(name).await;
    let directory = tempfile::tempdir().expect("a directory");
    let path = directory.path().join("state.db");
    let activations = Arc::new(AtomicU64::new(0));
    let a = start_node(&etcd, "node-a", &path, &activations).await;
    let b = start_node(&etcd, "node-b", &path, &activations).await;
    let pair = Pair {
        etcd,
        _directory: directory,
        path,
        activations,
    };
    (pair, a, b)
}

async fn start_node(etcd: &TestEtcd, name: &str, path: &std::path::Path, activations: &Arc<AtomicU64>) -> ClusterNode {
    let store = SqliteStore::open(path).expect("open the shared SQLite file");
    bounded(
        "starting a node",
        ClusterNode::start(
            etcd.config(name, ""),
            loopback(),
            probe_runtime(name, Arc::clone(activations)),
            store,
        ),
    )
    .await
    .unwrap_or_else(|error| panic!("start {name}: {error}"))
}

async fn call(node: &ClusterNode, actor: &ActorId, payload: &'static [u8]) -> Result<(String, u64), InvokeError> {
    let deadline = node.handle().deadline_in(Duration::from_millis(CALL_TIMEOUT_MS));
    bounded("a call", node.invoke(actor, Bytes::from_static(payload), deadline))
        .await
        .map(|reply| parse_reply(&reply))
}

/// Calls `actor` through `node` until a call is served, allowing only transient errors
/// meanwhile; fails the test with the last error after `bound`.
async fn call_until_served(node: &ClusterNode, actor: &ActorId, bound: Duration) -> (String, u64) {
    let started = Instant::now();
    loop {
        match call(node, actor, b"inc").await {
            Ok(reply) => return reply,
            Err(error) => {
                assert!(
                    started.elapsed() < bound,
                    "{actor} was not served through {} within {bound:?}; last error: {error}",
                    node.node()
                );
                assert!(
                    error.is_transient(),
                    "{actor}: only transient errors meanwhile: {error}"
                );
                tokio::time::sleep(Duration::from_millis(RETRY_PAUSE_MS)).await;
            }
        }
    }
}

/// Goal: one activation per actor across nodes, for the commonest race: a new actor id
/// called first by many callers on two nodes at once. Method: 24 concurrent calls from
/// each node to an actor never seen; the factory counts activations on both nodes.
/// Every call must be answered (the node that lost the placement reroutes its queued
/// calls to the winner), with 48 distinct counts, all from one node, and one
/// activation in all.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_of_first_calls_from_two_nodes_activates_the_actor_once() {
    let (pair, a, b) = two_nodes("probe-burst").await;
    let target = probe("fresh");

    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..BURST_CALLS_PER_NODE {
        for node in [&a, &b] {
            let client = node.client();
            let target = target.clone();
            calls.spawn(async move {
                let deadline = client.deadline_in(Duration::from_millis(CALL_TIMEOUT_MS));
                (
                    client.node().to_string(),
                    client.invoke(&target, Bytes::from_static(b"inc"), deadline).await,
                )
            });
        }
    }
    let mut counts = BTreeSet::new();
    let mut servers = BTreeSet::new();
    while let Some(joined) = bounded("the burst", calls.join_next()).await {
        let (caller, result) = joined.expect("a call task");
        let (served_by, count) =
            parse_reply(&result.unwrap_or_else(|error| panic!("a call through {caller}: {error}")));
        assert!(counts.insert(count), "count {count} acknowledged twice");
        servers.insert(served_by);
    }
    let calls = (2 * BURST_CALLS_PER_NODE) as u64;
    assert_eq!(counts, (1..=calls).collect(), "every call counted once");
    assert_eq!(servers.len(), 1, "one node served every call: {servers:?}");
    assert_eq!(
        pair.activations.load(Ordering::SeqCst),
        1,
        "pair.activations of one actor, both nodes together"
    );
    bounded("a leaves", a.leave()).await.expect("a leaves");
    bounded("b leaves", b.leave()).await.expect("b leaves");
}

/// Goal: a node the embedder drops (without `leave` or `abandon`) hands its actors over
/// within a lease time, also while the embedder still holds something of it: a
/// `ClusterClient` (to call through) or a `RuntimeHandle` clone (an attached
/// `AgentClient` holds one). Method: node A activates an actor and commits count 1; the
/// test keeps A's client and runtime handle and drops A; B calls the actor until it is
/// served, which must happen within the lease TTL plus allowance, with A's committed
/// count. A's kept client still gets answers or typed errors, promptly.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dropped_node_hands_its_actors_over_while_its_client_is_still_held() {
    let (_pair, a, b) = two_nodes("probe-drop-held").await;
    let target = probe("held");
    assert_eq!(
        call(&a, &target, b"inc").await.expect("A serves"),
        ("node-a".to_string(), 1)
    );

    let kept_client = a.client();
    let kept_handle = a.handle().clone();
    drop(a);
    let dropped_at = Instant::now();
    let bound = Duration::from_millis(TEST_LEASE_TTL_S * 1_000 + SCHEDULING_ALLOWANCE_MS);
    let served = call_until_served(&b, &target, bound).await;
    assert_eq!(
        served,
        ("node-b".to_string(), 2),
        "B takes A's actor over with its count"
    );
    eprintln!(
        "served by B {} ms after A was dropped",
        dropped_at.elapsed().as_millis()
    );

    // The client the embedder kept: routed to B now, or a typed error; never a hang.
    let deadline = kept_client.deadline_in(Duration::from_millis(CALL_TIMEOUT_MS));
    match bounded(
        "the kept client's call",
        kept_client.invoke(&target, Bytes::from_static(b"inc"), deadline),
    )
    .await
    {
        Ok(reply) => assert_eq!(parse_reply(&reply).0, "node-b"),
        Err(error) => eprintln!("the dropped node's client: {error}"),
    }
    drop((kept_client, kept_handle));
    bounded("b leaves", b.leave()).await.expect("b leaves");
}

/// Goal: a second node started under the name of a live node is refused at start,
/// naming the name and where the live node serves, and the live node keeps its actors
/// reachable. Before, the second node overwrote the live node's membership record:
/// every call to the live node's actors from the other nodes went to the second node,
/// which refused them ("not owner", naming the name they share), until the deadline.
/// Method: A (`node-a`) serves an actor; a second `node-a` starts on another port; then
/// B calls A's actor.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_node_under_a_live_nodes_name_is_refused_at_start() {
    let (pair, a, b) = two_nodes("probe-same-name").await;
    let target = probe("of-a");
    assert_eq!(
        call(&a, &target, b"inc").await.expect("A serves"),
        ("node-a".to_string(), 1)
    );

    let started = Instant::now();
    let second = bounded(
        "starting a second node-a",
        ClusterNode::start(
            pair.etcd.config("node-a", ""),
            loopback(),
            probe_runtime("node-a-twin", Arc::clone(&pair.activations)),
            SqliteStore::open(&pair.path).expect("open the shared SQLite file"),
        ),
    )
    .await;
    match second {
        Err(ref error @ ClusterError::NodeNameInUse { ref node, ref address }) => {
            eprintln!("refused in {} ms: {error}", started.elapsed().as_millis());
            assert_eq!(node.as_str(), "node-a");
            assert_eq!(address, &a.address().to_string());
            let text = error.to_string();
            assert!(text.contains("node-a") && text.contains(address.as_str()), "{text}");
        }
        Err(other) => panic!("refused, but not as a name in use: {other}"),
        Ok(twin) => panic!(
            "a second node started under node-a (at {}) while node-a serves at {}",
            twin.address(),
            a.address()
        ),
    }
    assert_eq!(
        call(&b, &target, b"inc").await.expect("B reaches A's actor"),
        ("node-a".to_string(), 2)
    );
    bounded("a leaves", a.leave()).await.expect("a leaves");
    bounded("b leaves", b.leave()).await.expect("b leaves");
}

/// Goal: a node whose lease was lost stays a client: a call through it to one of its
/// former actors, which another node serves now, is served there. Before, while the
/// lost node still waited for its running turns to end (its route cache is emptied
/// only then), such a call met the node's cached route to itself and failed at once
/// with `StorageFailed(NotOwner)`, "this node has lost its cluster lease", which is
/// not transient. Method: A serves x and y; a 3 s turn of y runs on A; A's lease is
/// revoked through etcd; B serves x; once A knows its lease is lost, and before it has
/// ended its activations, x is called through A.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_that_lost_its_lease_routes_calls_for_its_former_actors_to_the_new_owner() {
    let (pair, a, b) = two_nodes("probe-lost-client").await;
    let (x, y) = (probe("x"), probe("y"));
    assert_eq!(
        call(&a, &x, b"inc").await.expect("A serves x"),
        ("node-a".to_string(), 1)
    );
    assert_eq!(
        call(&a, &y, b"inc").await.expect("A serves y"),
        ("node-a".to_string(), 1)
    );
    let slow = {
        let client = a.client();
        let y = y.clone();
        tokio::spawn(async move {
            let deadline = client.deadline_in(Duration::from_millis(CALL_TIMEOUT_MS));
            client.invoke(&y, Bytes::from_static(b"sleep:3000"), deadline).await
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut admin = etcd_client::Client::connect([pair.etcd.endpoint()], None)
        .await
        .expect("an admin client");
    bounded("the revoke", admin.lease_revoke(a.placement().lease()))
        .await
        .expect("revoke A's lease");
    let bound = Duration::from_millis(TEST_LEASE_TTL_S * 1_000 + SCHEDULING_ALLOWANCE_MS);
    assert_eq!(call_until_served(&b, &x, bound).await, ("node-b".to_string(), 2));
    bounded("A noticing its lease is gone", async {
        while a.placement().holds_lease() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(
        tokio::time::timeout(Duration::ZERO, a.fenced_off()).await.is_err(),
        "A ended its pair.activations already: the test missed the window it probes"
    );
    let through_a = call(&a, &x, b"inc").await;
    assert_eq!(
        through_a.as_ref().map_err(ToString::to_string),
        Ok(&("node-b".to_string(), 3)),
        "a call through the node that lost its lease, to its former actor served by B"
    );
    let slow = bounded("the slow call", slow).await.expect("the slow call's task");
    eprintln!("the slow turn's call: {slow:?}");
    bounded("b leaves", b.leave()).await.expect("b leaves");
    drop(a);
}

/// Goal: a node that leaves (`ClusterNode::leave`) while another node's callers keep
/// calling its actors hands them over with everything it committed: every call ends
/// by its deadline with a reply or a transient typed error, no count is acknowledged
/// twice, and the counts the other node serves after the takeover continue the ones
/// the leaving node acknowledged. Method: 4 actors on A, each slow every fourth call
/// (200 ms), 4 callers on B; A leaves 300 ms into the traffic; the traffic goes on 1 s
/// after the leave.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_leaving_under_traffic_hands_over_everything_it_committed() {
    /// Actors the traffic goes to.
    const ACTORS: usize = 4;
    /// Concurrent callers on B.
    const CALLERS: usize = 4;
    /// Deadline of each call of the traffic, in milliseconds.
    const TRAFFIC_CALL_TIMEOUT_MS: u64 = 2_000;
    let (_pair, a, b) = two_nodes("probe-leave-traffic").await;
    let actors: Vec<ActorId> = (0..ACTORS).map(|index| probe(&format!("l{index}"))).collect();
    for actor in &actors {
        assert_eq!(
            call(&a, actor, b"inc").await.expect("A serves"),
            ("node-a".to_string(), 1)
        );
    }
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut callers = tokio::task::JoinSet::new();
    for caller in 0..CALLERS {
        let (client, stop, actors) = (b.client(), Arc::clone(&stop), actors.clone());
        callers.spawn(async move {
            let (mut acks, mut errors) = (Vec::new(), Vec::new());
            let mut round = caller;
            while !stop.load(Ordering::SeqCst) {
                round += 1;
                let target = actors[round % ACTORS].clone();
                let payload = if round % 4 == 0 { "sleep:200" } else { "inc" };
                let deadline = client.deadline_in(Duration::from_millis(TRAFFIC_CALL_TIMEOUT_MS));
                let started = Instant::now();
                let result = tokio::time::timeout(
                    Duration::from_millis(TRAFFIC_CALL_TIMEOUT_MS + SCHEDULING_ALLOWANCE_MS),
                    client.invoke(&target, Bytes::from(payload), deadline),
                )
                .await
                .unwrap_or_else(|_| panic!("a call to {target} outlived its deadline"));
                match result {
                    Ok(reply) => acks.push((target, parse_reply(&reply), Instant::now())),
                    Err(error) => {
                        errors.push((error, started.elapsed()));
                        tokio::time::sleep(Duration::from_millis(RETRY_PAUSE_MS)).await;
                    }
                }
            }
            (acks, errors)
        });
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let leaving_at = Instant::now();
    bounded("A leaving", a.leave()).await.expect("A leaves");
    let left_at = Instant::now();
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    stop.store(true, Ordering::SeqCst);

    let mut by_actor: std::collections::BTreeMap<String, Vec<(String, u64, Instant)>> = Default::default();
    let mut errors = Vec::new();
    while let Some(joined) = bounded("the callers", callers.join_next()).await {
        let (acks, caller_errors) = joined.expect("a caller task");
        for (target, (served_by, count), at) in acks {
            by_actor
                .entry(target.to_string())
                .or_default()
                .push((served_by, count, at));
        }
        errors.extend(caller_errors);
    }
    for (error, took) in &errors {
        assert!(error.is_transient(), "a call failed with {error} after {took:?}");
    }
    let mut first_on_b: Option<Instant> = None;
    for (actor, mut acks) in by_actor {
        acks.sort_by_key(|(_, count, _)| *count);
        let counts: BTreeSet<u64> = acks.iter().map(|(_, count, _)| *count).collect();
        assert_eq!(
            counts.len(),
            acks.len(),
            "{actor}: a count acknowledged twice: {acks:?}"
        );
        let highest_on_a = acks
            .iter()
            .filter(|(node, ..)| node == "node-a")
            .map(|(_, count, _)| *count)
            .max();
        let on_b: Vec<_> = acks.iter().filter(|(node, ..)| node == "node-b").collect();
        assert!(!on_b.is_empty(), "{actor}: never served by B after A left");
        let lowest_on_b = on_b.iter().map(|(_, count, _)| *count).min().expect("one");
        assert!(
            highest_on_a.is_none_or(|highest| lowest_on_b > highest),
            "{actor}: B served count {lowest_on_b}, A had acknowledged {highest_on_a:?}: a committed count was lost"
        );
        let earliest = on_b.iter().map(|(_, _, at)| *at).min().expect("one");
        first_on_b = Some(first_on_b.map_or(earliest, |first| first.min(earliest)));
    }
    eprintln!(
        "leave took {} ms; B served A's actors from {} ms after the leave began; {} transient errors: {:?}",
        left_at.duration_since(leaving_at).as_millis(),
        first_on_b
            .expect("B served")
            .saturating_duration_since(leaving_at)
            .as_millis(),
        errors.len(),
        errors
            .iter()
            .map(|(error, _)| error.to_string())
            .collect::<BTreeSet<_>>()
    );
    bounded("b leaves", b.leave()).await.expect("b leaves");
}

/// Goal: a call's deadline holds across nodes: a call with 100 ms left to a busy actor
/// on another node ends `Timeout` about then, not after a transport or turn default.
/// Method: the actor is activated on B; from A, a call whose turn sleeps 3 s, under a
/// 100 ms deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_call_to_another_node_with_100_ms_left_times_out_on_time() {
    /// The call's deadline, in milliseconds.
    const SHORT_DEADLINE_MS: u64 = 100;
    /// How late after its deadline the call may end, in milliseconds.
    const LATE_MAX_MS: u64 = 400;
    let (_pair, a, b) = two_nodes("probe-deadline").await;
    let target = probe("far");
    assert_eq!(
        call(&b, &target, b"inc").await.expect("B serves"),
        ("node-b".to_string(), 1)
    );
    // Warm A's route and connection, as a running system has them.
    assert_eq!(
        call(&a, &target, b"inc").await.expect("A reaches B"),
        ("node-b".to_string(), 2)
    );

    let started = Instant::now();
    let deadline = a.handle().deadline_in(Duration::from_millis(SHORT_DEADLINE_MS));
    let result = bounded(
        "the short call",
        a.invoke(&target, Bytes::from_static(b"sleep:3000"), deadline),
    )
    .await;
    let took = started.elapsed();
    assert!(matches!(result, Err(InvokeError::Timeout { .. })), "{result:?}");
    assert!(
        took < Duration::from_millis(SHORT_DEADLINE_MS + LATE_MAX_MS),
        "the call with {SHORT_DEADLINE_MS} ms ended after {took:?}"
    );
    eprintln!("Timeout after {} ms", took.as_millis());
    bounded("a leaves", a.leave()).await.expect("a leaves");
    bounded("b leaves", b.leave()).await.expect("b leaves");
}

/// Goal: a call to an actor whose owner's published address accepts connections but
/// never answers (a hung process, a black hole) ends by the caller's deadline, not at
/// the transport's connect or handshake timeout (5 s). Method: B publishes the address
/// of a listener that accepts and stays silent, and serves z (called through B); A
/// calls z with 300 ms left, twice (the second finds the connection attempt under
/// way), and once keyed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_call_to_a_silent_owner_ends_by_its_deadline() {
    /// The calls' deadline, in milliseconds.
    const SHORT_DEADLINE_MS: u64 = 300;
    /// How late after its deadline a call may end, in milliseconds.
    const LATE_MAX_MS: u64 = 500;
    let etcd = TestEtcd::start("probe-silent-owner").await;
    let directory = tempfile::tempdir().expect("a directory");
    let path = directory.path().join("state.db");
    let silent = tokio::net::TcpListener::bind(loopback()).await.expect("bind");
    let silent_address = silent.local_addr().expect("an address");
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((connection, _)) = silent.accept().await {
            held.push(connection);
        }
    });
    let activations = Arc::new(AtomicU64::new(0));
    let a = start_node(&etcd, "node-a", &path, &activations).await;
    let b = bounded(
        "starting B",
        ClusterNode::start(
            etcd.config("node-b", &silent_address.to_string()),
            loopback(),
            probe_runtime("node-b", Arc::clone(&activations)),
            SqliteStore::open(&path).expect("open the shared SQLite file"),
        ),
    )
    .await
    .expect("start B");
    let target = probe("z");
    assert_eq!(
        call(&b, &target, b"inc").await.expect("B serves z"),
        ("node-b".to_string(), 1)
    );

    for attempt in ["first", "second", "keyed"] {
        let started = Instant::now();
        let deadline = a.handle().deadline_in(Duration::from_millis(SHORT_DEADLINE_MS));
        let call = async {
            if attempt == "keyed" {
                let key = troupe_runtime::IdempotencyKey::new("probe-silent").expect("a key");
                a.client()
                    .invoke_keyed(&target, &key, Bytes::from_static(b"inc"), deadline)
                    .await
            } else {
                a.invoke(&target, Bytes::from_static(b"inc"), deadline).await
            }
        };
        let result = bounded("a call to a silent owner", call).await;
        let took = started.elapsed();
        eprintln!("{attempt}: {result:?} after {} ms", took.as_millis());
        assert!(
            matches!(
                result,
                Err(InvokeError::Timeout { .. } | InvokeError::Unreachable { .. })
            ),
            "{attempt}: {result:?}"
        );
        assert!(
            took < Duration::from_millis(SHORT_DEADLINE_MS + LATE_MAX_MS),
            "{attempt}: the call with {SHORT_DEADLINE_MS} ms ended after {took:?}"
        );
    }
    holder.abort();
    bounded("a leaves", a.leave()).await.expect("a leaves");
    bounded("b leaves", b.leave()).await.expect("b leaves");
}

/// Goal: a cluster moved to an etcd whose revisions are behind the store's fences (a
/// new etcd cluster, or one whose data was lost and rebuilt) fails loudly, naming the
/// cause, rather than refusing every known actor as a transient `Fenced` until the
/// caller's deadline. Method: on etcd 1, whose revision is pushed past 100 first, node
/// A serves x (fence > 100); A leaves; a node on a fresh etcd 2 (revision about 3)
/// with the same store calls x.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fresh_etcd_behind_the_stores_fences_fails_loudly() {
    /// Writes that push etcd 1's revision up before the actor is placed.
    const REVISION_PUSH_WRITES: usize = 100;
    let first = TestEtcd::start("probe-etcd-reset-1").await;
    let directory = tempfile::tempdir().expect("a directory");
    let path = directory.path().join("state.db");
    let mut admin = etcd_client::Client::connect([first.endpoint()], None)
        .await
        .expect("an admin client");
    for index in 0..REVISION_PUSH_WRITES {
        bounded("a write", admin.put("/elsewhere", index.to_string(), None))
            .await
            .expect("a write");
    }
    let activations = Arc::new(AtomicU64::new(0));
    let a = start_node(&first, "node-a", &path, &activations).await;
    let target = probe("x");
    assert_eq!(
        call(&a, &target, b"inc").await.expect("A serves x"),
        ("node-a".to_string(), 1)
    );
    bounded("a leaves", a.leave()).await.expect("a leaves");
    drop(first);

    let second = TestEtcd::start("probe-etcd-reset-2").await;
    let again = start_node(&second, "node-a", &path, &activations).await;
    let started = Instant::now();
    let result = call(&again, &target, b"inc").await;
    let took = started.elapsed();
    eprintln!("after {} ms: {result:?}", took.as_millis());
    match &result {
        Err(error @ InvokeError::StorageFailed { .. }) if !error.is_transient() => {
            let text = error.to_string();
            assert!(text.contains("etcd"), "the error does not name etcd: {text}");
        }
        other => panic!("not a loud, non-transient refusal naming etcd: {other:?} after {took:?}"),
    }
    assert!(
        took < Duration::from_millis(CALL_TIMEOUT_MS / 2),
        "the refusal came after {took:?}, near the call's deadline"
    );
    bounded("leaving", again.leave()).await.expect("leaves");
}

/// Goal: a request or reply too large for the link between nodes (over the transport's
/// 16 MiB frame) fails typed and at once, and costs the other calls on the same
/// connection nothing. Method: x on B; from A, a 17 MiB request, then a request whose
/// reply is 17 MiB, each beside a small call in flight on the same connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_oversized_request_or_reply_between_nodes_fails_typed_and_spares_the_connection() {
    /// A size over the transport's frame limit, in bytes.
    const OVERSIZED_BYTES: usize = 17 * 1024 * 1024;
    let (_pair, a, b) = two_nodes("probe-oversized").await;
    let (x, y) = (probe("x"), probe("y"));
    assert_eq!(
        call(&b, &x, b"inc").await.expect("B serves x"),
        ("node-b".to_string(), 1)
    );
    assert_eq!(
        call(&b, &y, b"inc").await.expect("B serves y"),
        ("node-b".to_string(), 1)
    );
    assert_eq!(
        call(&a, &x, b"inc").await.expect("A reaches x"),
        ("node-b".to_string(), 2)
    );

    let big_request = Bytes::from(vec![b'r'; OVERSIZED_BYTES]);
    let big_reply = Bytes::from(format!("big:{OVERSIZED_BYTES}"));
    for (what, payload) in [("request", big_request), ("reply", big_reply)] {
        let beside = {
            let client = a.client();
            let y = y.clone();
            tokio::spawn(async move {
                let deadline = client.deadline_in(Duration::from_millis(CALL_TIMEOUT_MS));
                client.invoke(&y, Bytes::from_static(b"sleep:300"), deadline).await
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        let started = Instant::now();
        let deadline = a.handle().deadline_in(Duration::from_millis(CALL_TIMEOUT_MS));
        let result = bounded("an oversized call", a.invoke(&x, payload, deadline)).await;
        let took = started.elapsed();
        eprintln!(
            "oversized {what}: {:?} after {} ms",
            result.as_ref().map(Bytes::len),
            took.as_millis()
        );
        let beside = bounded("the call beside it", beside).await.expect("a task");
        eprintln!("the call beside it: {beside:?}");
        assert!(result.is_err(), "an oversized {what} crossed the link");
        assert!(
            !matches!(result, Err(InvokeError::Timeout { .. })),
            "the oversized {what} waited out its deadline: {result:?}"
        );
        assert_eq!(
            beside.map(|reply| parse_reply(&reply).0),
            Ok("node-b".to_string()),
            "a call on the same connection as the oversized {what}"
        );
    }
    assert_eq!(call(&a, &x, b"inc").await.expect("A still reaches x").0, "node-b");
    bounded("a leaves", a.leave()).await.expect("a leaves");
    bounded("b leaves", b.leave()).await.expect("b leaves");
}

/// Goal: a node pointed at an etcd nobody serves fails to start with a typed error that
/// names the endpoint, within about the request timeout, and frees its listen port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_pointed_at_no_etcd_fails_to_start_quickly_and_frees_its_port() {
    let dead_endpoint = format!("127.0.0.1:{}", free_port());
    let config = EtcdConfig::new(
        vec![dead_endpoint.clone()],
        "probe",
        NodeId::new("node-a").expect("a node name"),
        "",
    )
    .with_lease_ttl_s(TEST_LEASE_TTL_S)
    .with_request_timeout_ms(TEST_REQUEST_TIMEOUT_MS);
    let listen: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("an address");
    let directory = tempfile::tempdir().expect("a directory");
    let store = SqliteStore::open(directory.path().join("state.db")).expect("open SQLite");
    let started = Instant::now();
    let result = bounded(
        "starting against no etcd",
        ClusterNode::start(config, listen, probe_runtime("node-a", Arc::default()), store),
    )
    .await;
    let took = started.elapsed();
    match result {
        Err(ref error @ ClusterError::Join(PlacementError::EtcdUnavailable { ref endpoints, .. })) => {
            assert!(endpoints.contains(&dead_endpoint), "{endpoints}");
            eprintln!("refused in {} ms: {error}", took.as_millis());
        }
        Err(other) => panic!("not EtcdUnavailable: {other}"),
        Ok(_) => panic!("started without etcd"),
    }
    assert!(
        took < Duration::from_millis(3 * TEST_REQUEST_TIMEOUT_MS + SCHEDULING_ALLOWANCE_MS),
        "took {took:?}"
    );
    std::net::TcpListener::bind(listen).expect("the failed start freed its listen port");
}

/// Goal: a node given two etcd endpoints, one of them dead (a member of a three-member
/// etcd down), joins, places actors and keeps its lease over two lease times: the dead
/// endpoint costs nothing. Method: endpoints [dead, live]; calls every 250 ms for 2 TTLs,
/// each served, and `fenced_off` never resolves.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_with_one_dead_etcd_endpoint_keeps_its_lease_and_serves() {
    let etcd = TestEtcd::start("probe-dead-endpoint").await;
    let directory = tempfile::tempdir().expect("a directory");
    let path = directory.path().join("state.db");
    let mut config = etcd.config("node-a", "");
    config.endpoints = vec![format!("127.0.0.1:{}", free_port()), etcd.endpoint()];
    let node = bounded(
        "starting with a dead endpoint",
        ClusterNode::start(
            config,
            loopback(),
            probe_runtime("node-a", Arc::default()),
            SqliteStore::open(&path).expect("open SQLite"),
        ),
    )
    .await
    .expect("a node with one live endpoint starts");
    let until = Instant::now() + Duration::from_secs(2 * TEST_LEASE_TTL_S);
    let mut round = 0_u64;
    while Instant::now() < until {
        round += 1;
        let target = probe(&format!("k{}", round % 4));
        call(&node, &target, b"inc")
            .await
            .unwrap_or_else(|error| panic!("round {round}: {error}"));
        tokio::select! {
            biased;
            reason = node.fenced_off() => panic!("the node lost its lease in round {round}: {reason:?}"),
            () = tokio::time::sleep(Duration::from_millis(250)) => {}
        }
    }
    bounded("leaving", node.leave()).await.expect("leaves");
}

/// Goal: etcd restarted (killed until the node gives its lease up, started again on
/// its data): the node reports it has ended (`fenced_off`, `NotRenewedInTime`) within
/// the lease time, its calls fail with typed errors while etcd is down, and once etcd
/// is back a new node under the same name serves the actor with the count committed
/// before (after the old lease, which etcd restores with its data, has expired).
/// Method: one node; etcd killed until the node is fenced off; then restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_etcd_restarts_a_new_node_serves_the_committed_state() {
    let mut etcd = TestEtcd::start("probe-etcd-restart").await;
    let directory = tempfile::tempdir().expect("a directory");
    let path = directory.path().join("state.db");
    let activations = Arc::new(AtomicU64::new(0));
    let a = start_node(&etcd, "node-a", &path, &activations).await;
    let target = probe("survivor");
    assert_eq!(
        call(&a, &target, b"inc").await.expect("A serves"),
        ("node-a".to_string(), 1)
    );

    etcd.stop();
    let stopped_at = Instant::now();
    let reason = bounded("fenced off", a.fenced_off()).await;
    assert_eq!(reason, LeaseLostReason::NotRenewedInTime);
    let fenced_after = stopped_at.elapsed();
    assert!(
        fenced_after < Duration::from_millis(TEST_LEASE_TTL_S * 1_000 + SCHEDULING_ALLOWANCE_MS),
        "fenced off {fenced_after:?} after etcd stopped"
    );
    let deadline = a.handle().deadline_in(Duration::from_millis(1_000));
    let error = bounded(
        "a call without etcd",
        a.invoke(&target, Bytes::from_static(b"inc"), deadline),
    )
    .await
    .expect_err("no owner can be found without etcd");
    assert!(
        error.is_transient() || matches!(error, InvokeError::StorageFailed { .. }),
        "{error}"
    );
    eprintln!(
        "fenced off {} ms after etcd stopped; a call then: {error}",
        fenced_after.as_millis()
    );
    drop(a);

    etcd.restart().await;
    let restarted_at = Instant::now();
    let again = start_node(&etcd, "node-a", &path, &activations).await;
    // The old lease comes back with etcd and must expire first: a lease TTL.
    let bound = Duration::from_millis(2 * TEST_LEASE_TTL_S * 1_000 + SCHEDULING_ALLOWANCE_MS);
    let served = call_until_served(&again, &target, bound).await;
    assert_eq!(
        served,
        ("node-a".to_string(), 2),
        "the count committed before the restart"
    );
    eprintln!(
        "served again {} ms after etcd restarted",
        restarted_at.elapsed().as_millis()
    );
    bounded("leaving", again.leave()).await.expect("leaves");
}

/// Rounds of the race in `two_nodes_started_under_one_name_at_once_have_one_winner`.
const START_RACE_ROUNDS: usize = 8;

/// Goal: two `ClusterNode::start` under one name at the same moment never both start:
/// exactly one serves, the other is refused `NodeNameInUse` naming the winner's
/// address, and the other nodes reach the winner's actors. Before, the name check was
/// a read (and a TCP connect to the recorded address) followed by a later write: both
/// starts read no record, both wrote, and two live nodes shared one membership record.
/// Method: next to A and B, 8 rounds of two `node-c` starts spawned together on loopback
/// ports; the winner serves an actor B calls; it then leaves (the next race finds the
/// name free) or is abandoned as by a crash (the next race finds its record, whose
/// address no longer answers, and overwrites it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_nodes_started_under_one_name_at_once_have_one_winner() {
    let (pair, a, b) = two_nodes("probe-start-race").await;
    let mut previous: Option<String> = None;
    for round in 0..START_RACE_ROUNDS {
        let contenders: Vec<_> = (0..2)
            .map(|_| {
                let config = pair.etcd.config("node-c", "");
                let runtime = probe_runtime("node-c", Arc::clone(&pair.activations));
                let store = SqliteStore::open(&pair.path).expect("open the shared SQLite file");
                tokio::spawn(ClusterNode::start(config, loopback(), runtime, store))
            })
            .collect();
        let mut won = Vec::new();
        let mut refused = Vec::new();
        for contender in contenders {
            match bounded("a racing start", contender).await.expect("the start task ends") {
                Ok(node) => won.push(node),
                Err(ClusterError::NodeNameInUse { address, .. }) => refused.push(address),
                Err(other) => panic!("round {round}: a start failed otherwise: {other}"),
            }
        }
        assert_eq!(
            (won.len(), refused.len()),
            (1, 1),
            "round {round}: {} starts won and {} were refused (the won ones at {:?})",
            won.len(),
            refused.len(),
            won.iter().map(ClusterNode::address).collect::<Vec<_>>()
        );
        let winner = won.pop().expect("one winner");
        assert_eq!(
            refused[0],
            winner.address().to_string(),
            "round {round}: the refusal names the winner"
        );
        let target = probe(&format!("of-c-{round}"));
        assert_eq!(
            call(&winner, &target, b"inc").await.expect("the winner serves"),
            ("node-c".to_string(), 1)
        );
        // B may still hold a client of the last round's node-c, whose address no longer
        // answers: that call ends `Unreachable` (documented: it is not retried) and
        // drops the client, so the next one reads the new record.
        let reply = match call(&b, &target, b"inc").await {
            Err(InvokeError::Unreachable { cause, .. })
                if previous
                    .as_ref()
                    .is_some_and(|address| cause.contains(address.as_str())) =>
            {
                call(&b, &target, b"inc").await
            }
            other => other,
        };
        assert_eq!(
            reply.expect("B reaches the winner's actor"),
            ("node-c".to_string(), 2),
            "round {round}"
        );
        previous = Some(winner.address().to_string());
        if round % 2 == 0 {
            bounded("the winner leaves", winner.leave()).await.expect("leaves");
        } else {
            bounded("the winner is abandoned", winner.abandon()).await;
        }
    }
    bounded("a leaves", a.leave()).await.expect("a leaves");
    bounded("b leaves", b.leave()).await.expect("b leaves");
}

/// Starts `name` on the SQLite file at `path` in the test cluster, with the file's
/// identity; the outcome as it is.
async fn start_with_sqlite_identity(
    etcd: &TestEtcd,
    name: &str,
    path: &std::path::Path,
) -> Result<ClusterNode, ClusterError> {
    let store = SqliteStore::open(path).expect("open the SQLite file");
    let identity = troupe_cluster::sqlite_store_identity(path).expect("the file's identity");
    bounded(
        "starting a node",
        ClusterNode::start(
            etcd.config(name, "").with_store_identity(identity),
            loopback(),
            probe_runtime(name, Arc::new(AtomicU64::new(0))),
            store,
        ),
    )
    .await
}

/// Goal: two deployments sharing a cluster name on one etcd, each with its own SQLite
/// file, are told apart: the second one's node is refused `StoreMismatch` naming both
/// files; a node of the first deployment that names the file by another path (a
/// symbolic link) has the same identity and starts. Before, the second deployment's
/// node started in the first one's cluster and its calls reached the first one's
/// actors. Method: node-a on file one serves x; node-x on file two is refused; node-b
/// on file one through a link reaches x.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_of_another_sqlite_file_under_the_same_cluster_name_is_refused() {
    let etcd = TestEtcd::start("probe-sqlite-two-deployments").await;
    let directory = tempfile::tempdir().expect("a directory");
    let (one, two) = (directory.path().join("one.db"), directory.path().join("two.db"));
    let a = start_with_sqlite_identity(&etcd, "node-a", &one)
        .await
        .expect("node-a binds the cluster to file one");
    let x = probe("x");
    assert_eq!(call(&a, &x, b"inc").await.expect("A serves"), ("node-a".to_string(), 1));
    match start_with_sqlite_identity(&etcd, "node-x", &two).await {
        Err(
            ref error @ ClusterError::StoreMismatch {
                ref recorded,
                ref store,
                ..
            },
        ) => {
            assert!(recorded.ends_with("one.db") && store.ends_with("two.db"), "{error}");
            eprintln!("{error}");
        }
        Err(other) => panic!("refused, but not as another store: {other}"),
        Ok(node) => panic!("node-x on file two started in file one's cluster at {}", node.address()),
    }
    let link = directory.path().join("link-to-one.db");
    std::os::unix::fs::symlink(&one, &link).expect("a symbolic link");
    let b = start_with_sqlite_identity(&etcd, "node-b", &link)
        .await
        .expect("node-b on file one through a link starts");
    assert_eq!(
        call(&b, &x, b"inc").await.expect("B reaches x"),
        ("node-a".to_string(), 2)
    );
    bounded("a leaves", a.leave()).await.expect("a leaves");
    bounded("b leaves", b.leave()).await.expect("b leaves");
}
