//! Three `ClusterNode`s in one process, a real etcd (Debian `etcd-server`, started per
//! test on loopback) and one SQLite file that every node opens (one handle each, as
//! separate processes would). Calls go from every node to actors spread over all of
//! them; then one node loses its lease (revoked behind its back) or crashes (stops
//! renewing), and its actors must move to the others with newer fences, with no actor
//! ever served by two nodes: checked from the replies (no count acknowledged twice) and
//! from the store's log (a fence claimed by one node only, a count committed once only,
//! newer counts never under older fences).
//!
//! Run with `cargo nextest run -p troupe-cluster` (add `--no-capture` for the timings).
#![cfg(not(madsim))]

#[path = "support/agents.rs"]
mod agents;
#[path = "../../troupe-etcd/tests/support/etcd_server.rs"]
mod etcd_server;
#[path = "support/hop.rs"]
mod hops;
#[path = "support/counter.rs"]
mod support;

use std::time::Duration;

use bytes::Bytes;
use etcd_server::{TestEtcd, TEST_LEASE_TTL_S, TEST_REQUEST_TIMEOUT_MS};
use support::{check_distinct_acks, counter, counter_runtime, parse_reply, LoggingStore, StoreLog, SLOW_TURN_MS};
use tokio::time::Instant;
use troupe_cluster::{ClusterError, ClusterNode};
use troupe_core::{ActorId, InvokeError, StoreError};
use troupe_etcd::{LeaseLostReason, Placement};
use troupe_runtime::{Fence, SqliteStore, StateChange, StateStore, TurnCommit};

/// Deadline of each call, in milliseconds.
const CALL_TIMEOUT_MS: u64 = 5_000;
/// Deadline of the call through a node without a lease to an actor nobody holds, in
/// milliseconds: long, so that a refusal at once and one at the deadline differ.
const UNPLACED_CALL_TIMEOUT_MS: u64 = 20_000;
/// Allowance for a loaded 2-core machine on top of a bound a test checks, in ms.
const SCHEDULING_ALLOWANCE_MS: u64 = 2_000;
/// Actors in each test, spread over the nodes.
const ACTORS: usize = 12;
/// Calls each node makes to each actor in a round.
const CALLS_PER_NODE_PER_ACTOR: usize = 2;

struct Cluster {
    etcd: TestEtcd,
    nodes: Vec<ClusterNode>,
    log: StoreLog,
    stores: Vec<LoggingStore<SqliteStore>>,
    _directory: tempfile::TempDir,
}

async fn start_cluster(name: &str) -> Cluster {
    let etcd = TestEtcd::start(name).await;
    let directory = tempfile::tempdir().expect("a directory");
    let path = directory.path().join("state.db");
    let log = StoreLog::default();
    let mut nodes = Vec::new();
    let mut stores = Vec::new();
    for node in ["node-a", "node-b", "node-c"] {
        let store = LoggingStore {
            inner: SqliteStore::open(&path).expect("open the shared SQLite file"),
            node: node.to_string(),
            log: log.clone(),
        };
        stores.push(store.clone());
        let started = ClusterNode::start(
            etcd.config(node, ""),
            "127.0.0.1:0".parse().expect("an address"),
            hops::with_hop(counter_runtime(node), node),
            store,
        )
        .await
        .expect("start the node");
        nodes.push(started);
    }
    Cluster {
        etcd,
        nodes,
        log,
        stores,
        _directory: directory,
    }
}

fn actors() -> Vec<ActorId> {
    (0..ACTORS).map(|index| counter(&format!("k{index}"))).collect()
}

async fn call(node: &ClusterNode, actor: &ActorId, payload: &'static [u8]) -> Result<(String, u64), InvokeError> {
    let deadline = node.handle().deadline_in(Duration::from_millis(CALL_TIMEOUT_MS));
    node.invoke(actor, Bytes::from_static(payload), deadline)
        .await
        .map(|reply| parse_reply(&reply))
}

/// Places actor `i` on node `i % 3` by a first call from there, then has every node call
/// every actor concurrently; returns the acknowledged replies.
async fn spread_and_call_everything(cluster: &Cluster, acks: &mut Vec<(ActorId, String, u64)>) {
    for (index, actor) in actors().iter().enumerate() {
        let node = &cluster.nodes[index % cluster.nodes.len()];
        let (served_by, count) = call(node, actor, b"inc").await.expect("the first call");
        assert_eq!(
            served_by,
            node.node().as_str(),
            "{actor}: a free actor is activated where it is called"
        );
        acks.push((actor.clone(), served_by, count));
    }
    let mut calls = tokio::task::JoinSet::new();
    for node in &cluster.nodes {
        for actor in actors() {
            for _ in 0..CALLS_PER_NODE_PER_ACTOR {
                let client = node.client();
                let actor = actor.clone();
                let caller = node.node().to_string();
                calls.spawn(async move {
                    let deadline = client.deadline_in(Duration::from_millis(CALL_TIMEOUT_MS));
                    let result = client.invoke(&actor, Bytes::from_static(b"inc"), deadline).await;
                    (actor, caller, result)
                });
            }
        }
    }
    let mut served = std::collections::BTreeMap::<String, usize>::new();
    while let Some(joined) = calls.join_next().await {
        let (actor, caller, result) = joined.expect("a call task");
        let (served_by, count) = parse_reply(&result.unwrap_or_else(|error| panic!("{caller} → {actor}: {error}")));
        let expected = format!(
            "node-{}",
            ["a", "b", "c"][actor.key()[1..].parse::<usize>().expect("k<index>") % 3]
        );
        assert_eq!(served_by, expected, "{actor} moved while every node was up");
        *served.entry(served_by.clone()).or_default() += 1;
        acks.push((actor, served_by, count));
    }
    assert_eq!(served.len(), 3, "every node served some actors: {served:?}");
}

/// The actors first placed on node C (`k2`, `k5`, …).
fn actors_of_c() -> Vec<ActorId> {
    actors().into_iter().skip(2).step_by(3).collect()
}

/// Calls `actor` through `node` until a call succeeds; returns the reply and when.
async fn call_until_served(node: &ClusterNode, actor: &ActorId, bound: Duration) -> (String, u64) {
    let started = Instant::now();
    loop {
        match call(node, actor, b"inc").await {
            Ok(reply) => return reply,
            Err(error) => {
                assert!(
                    started.elapsed() < bound,
                    "{actor} was not served within {bound:?}; last error: {error}"
                );
                // Transient, and not a fenced turn (transient too since 2026-12-06):
                // the serving node claims afresh, so none of its turns is fenced.
                assert!(
                    error.is_transient() && !matches!(error, InvokeError::StorageFailed { .. }),
                    "{actor}: only transient errors while it moves: {error}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// The highest fence each node claimed `actor` with, from the checked log.
fn highest_fence(
    fences: &std::collections::BTreeMap<String, std::collections::BTreeMap<String, u64>>,
    actor: &ActorId,
    node: &str,
) -> Option<u64> {
    fences
        .get(&actor.to_string())
        .and_then(|by_node| by_node.get(node))
        .copied()
}

/// Node C's lease is revoked while a slow turn runs on it: C fences itself off (no
/// claim or commit from then on) and deactivates; its actors are served by A and B with
/// newer fences at once (a revoke deletes C's placements); the slow call, whose commit
/// C refused, is rerouted and served by the new owner; C's store handle cannot commit
/// under its old fence; C still works as a client.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_that_loses_its_lease_hands_its_actors_over_with_newer_fences() {
    let cluster = start_cluster("revoked").await;
    let mut acks = Vec::new();
    spread_and_call_everything(&cluster, &mut acks).await;
    let before = cluster.log.check_single_owner();
    let (node_a, node_c) = (&cluster.nodes[0], &cluster.nodes[2]);

    let slow = {
        let client = node_a.client();
        tokio::spawn(async move {
            let deadline = client.deadline_in(Duration::from_millis(3 * SLOW_TURN_MS));
            client
                .invoke(&counter("k2"), Bytes::from_static(b"slow@node-c"), deadline)
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut admin = etcd_client::Client::connect([cluster.etcd.endpoint()], None)
        .await
        .expect("an admin client");
    admin
        .lease_revoke(node_c.placement().lease())
        .await
        .expect("revoke C's lease");
    let revoked_at = Instant::now();

    let bound = Duration::from_millis(TEST_LEASE_TTL_S * 1_000 + SCHEDULING_ALLOWANCE_MS);
    for (index, actor) in actors_of_c().iter().enumerate() {
        let node = &cluster.nodes[index % 2];
        let (served_by, count) = call_until_served(node, actor, bound).await;
        assert_ne!(served_by, "node-c", "{actor} served by the node that lost its lease");
        eprintln!(
            "{actor}: served by {served_by} {} ms after the revoke",
            revoked_at.elapsed().as_millis()
        );
        acks.push((actor.clone(), served_by, count));
    }
    let reason = tokio::time::timeout(
        Duration::from_millis(SLOW_TURN_MS + SCHEDULING_ALLOWANCE_MS),
        node_c.fenced_off(),
    )
    .await
    .expect("C fenced itself off");
    assert_eq!(reason, LeaseLostReason::ExpiredOnServer);
    eprintln!("C fenced off {} ms after the revoke", revoked_at.elapsed().as_millis());

    let (served_by, count) = parse_reply(
        &slow
            .await
            .expect("the slow call's task")
            .expect("the slow call is served"),
    );
    assert_ne!(
        served_by, "node-c",
        "the slow turn's commit on C must have been refused"
    );
    assert!(
        node_a.stats().reroutes >= 1,
        "the slow call was rerouted: {:?}",
        node_a.stats()
    );
    acks.push((counter("k2"), served_by, count));

    // C, without a lease, still calls: routed to the new owners.
    let (served_by, count) = call(node_c, &counter("k5"), b"inc").await.expect("C calls as a client");
    assert_ne!(served_by, "node-c");
    acks.push((counter("k5"), served_by, count));

    // An actor nobody holds, called through C: C would place it on itself, which its
    // lost lease refuses for good. The call is refused at once, not retried until its
    // deadline (the router's fast refusal in node.rs, shown before only in the
    // simulator's mention scenario).
    let asked_at = Instant::now();
    let deadline = node_c
        .handle()
        .deadline_in(Duration::from_millis(UNPLACED_CALL_TIMEOUT_MS));
    let refused = node_c
        .invoke(&counter("unplaced"), Bytes::from_static(b"inc"), deadline)
        .await;
    let refused_after = asked_at.elapsed();
    match refused {
        Err(InvokeError::StorageFailed {
            source: StoreError::NotOwner { owner: None, .. },
            ..
        }) => {}
        other => panic!("a call through C to an unplaced actor must be refused NotOwner: {other:?}"),
    }
    assert!(
        refused_after < Duration::from_millis(SCHEDULING_ALLOWANCE_MS),
        "refused after {refused_after:?}: at once, not near its {UNPLACED_CALL_TIMEOUT_MS} ms deadline"
    );
    eprintln!(
        "C refused a call to an unplaced actor in {} ms",
        refused_after.as_millis()
    );

    let after = cluster.log.check_single_owner();
    check_distinct_acks(&acks);
    for actor in actors_of_c() {
        let old = highest_fence(&before, &actor, "node-c").expect("C claimed its actors");
        let new = ["node-a", "node-b"]
            .iter()
            .filter_map(|node| highest_fence(&after, &actor, node))
            .max()
            .expect("A or B claimed it");
        assert!(new > old, "{actor}: new fence {new} must be newer than C's {old}");
        // The zombie's commit under its old fence is refused by the shared store itself.
        let zombie = cluster.stores[2]
            .commit(
                &actor,
                Fence::from_token(old).expect("a fence"),
                TurnCommit {
                    state: StateChange::Set(Bytes::from_static(b"999")),
                    writes: Vec::new(),
                },
            )
            .await;
        match zombie {
            Err(StoreError::Fenced { held, current, .. }) => {
                assert_eq!(held.token(), old);
                assert!(current.is_some_and(|current| current.token() >= new));
            }
            other => panic!("{actor}: C's commit under {old} must be fenced: {other:?}"),
        }
    }
    assert!(
        cluster
            .log
            .entries()
            .iter()
            .all(|entry| !(entry.ok && entry.count == Some(999))),
        "no zombie commit landed"
    );
}

/// Node C crashes (stops serving and renewing; its lease is left to expire): its
/// actors are served by A and B within the lease TTL (plus scheduling allowance), with
/// newer fences; meanwhile calls to them fail only with transient errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crashed_node_s_actors_move_within_the_lease_time() {
    let mut cluster = start_cluster("crashed").await;
    let mut acks = Vec::new();
    spread_and_call_everything(&cluster, &mut acks).await;
    let before = cluster.log.check_single_owner();
    let node_c = cluster.nodes.pop().expect("three nodes");
    node_c.abandon().await;
    let crashed_at = Instant::now();

    let bound = Duration::from_millis(TEST_LEASE_TTL_S * 1_000 + TEST_REQUEST_TIMEOUT_MS + SCHEDULING_ALLOWANCE_MS);
    let mut slowest = Duration::ZERO;
    for (index, actor) in actors_of_c().iter().enumerate() {
        let node = &cluster.nodes[index % 2];
        let (served_by, count) = call_until_served(node, actor, bound).await;
        assert_ne!(served_by, "node-c");
        slowest = slowest.max(crashed_at.elapsed());
        acks.push((actor.clone(), served_by, count));
    }
    eprintln!(
        "every actor of the crashed node served again {} ms after the crash (TTL {} s)",
        slowest.as_millis(),
        TEST_LEASE_TTL_S
    );
    // The others' actors were never disturbed.
    for actor in actors().iter().filter(|actor| !actors_of_c().contains(actor)) {
        let (served_by, count) = call(&cluster.nodes[0], actor, b"inc").await.expect("a call");
        assert_ne!(served_by, "node-c");
        acks.push((actor.clone(), served_by, count));
    }
    let after = cluster.log.check_single_owner();
    check_distinct_acks(&acks);
    for actor in actors_of_c() {
        let old = highest_fence(&before, &actor, "node-c").expect("C claimed its actors");
        let new = ["node-a", "node-b"]
            .iter()
            .filter_map(|node| highest_fence(&after, &actor, node))
            .max()
            .expect("A or B claimed it");
        assert!(new > old, "{actor}: new fence {new} must be newer than C's {old}");
    }
    let members: Vec<String> = cluster.nodes[0]
        .placement()
        .nodes()
        .await
        .expect("members")
        .into_iter()
        .map(|member| member.node.to_string())
        .collect();
    assert_eq!(members, ["node-a", "node-b"]);
}

/// An actor deactivated on its node gives its placement back: another node then
/// activates it (with a newer fence) instead of forwarding.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deactivation_releases_the_placement() {
    let cluster = start_cluster("release").await;
    let actor = counter("r");
    let (served_by, _) = call(&cluster.nodes[0], &actor, b"inc").await.expect("a call");
    assert_eq!(served_by, "node-a");
    let placed = cluster.nodes[0]
        .placement()
        .lookup(&actor)
        .await
        .expect("lookup")
        .expect("placed");
    assert_eq!(placed.owner.as_str(), "node-a");
    assert!(cluster.nodes[0].handle().deactivate(&actor).await.expect("deactivate"));
    let started = Instant::now();
    while cluster.nodes[0]
        .placement()
        .lookup(&actor)
        .await
        .expect("lookup")
        .is_some()
    {
        assert!(
            started.elapsed() < Duration::from_millis(SCHEDULING_ALLOWANCE_MS),
            "the placement was not released"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (served_by, count) = call(&cluster.nodes[1], &actor, b"inc").await.expect("a call");
    assert_eq!(
        (served_by.as_str(), count),
        ("node-b", 2),
        "B activates it from A's saved state"
    );
    let fences = cluster.log.check_single_owner();
    assert!(highest_fence(&fences, &actor, "node-b") > highest_fence(&fences, &actor, "node-a"));
    // And back on A: A's leftover route to itself is corrected by B's refusal... A asks etcd.
    let (served_by, count) = call(&cluster.nodes[0], &actor, b"inc").await.expect("a call");
    assert_eq!((served_by.as_str(), count), ("node-b", 3));
}

/// Deactivating an actor and calling it again at once races the release of the old
/// placement against the new activation's claim on the same node: whichever runs
/// first, every call is served, each activation claims a newer fence (a placement left
/// from the previous activation is released and made anew), and no count is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reactivating_at_once_on_the_same_node_claims_a_newer_fence_each_time() {
    const ROUNDS: u64 = 20;
    let cluster = start_cluster("reactivate").await;
    let actor = counter("again");
    let node = &cluster.nodes[0];
    let mut acks = Vec::new();
    for round in 1..=ROUNDS {
        let (served_by, count) = call(node, &actor, b"inc").await.expect("a call");
        assert_eq!((served_by.as_str(), count), ("node-a", round));
        acks.push((actor.clone(), served_by, count));
        assert!(node.handle().deactivate(&actor).await.expect("deactivate"));
    }
    check_distinct_acks(&acks);
    cluster.log.check_single_owner();
    let claims: Vec<u64> = cluster
        .log
        .entries()
        .into_iter()
        .filter(|entry| entry.ok && entry.count.is_none())
        .map(|entry| entry.fence)
        .collect();
    assert_eq!(claims.len() as u64, ROUNDS, "one claim per activation: {claims:?}");
    assert!(
        claims.windows(2).all(|pair| pair[0] < pair[1]),
        "fences grow: {claims:?}"
    );
    eprintln!(
        "{ROUNDS} reactivations; {} found the previous placement still there and replaced it",
        node.stats().placements_replaced
    );
}

/// How long each root's turn sleeps before it calls in the cycle test, in milliseconds.
const CYCLE_SLEEP_MS: u64 = 300;
/// Deadline of the cycle test's roots, in milliseconds.
const CYCLE_DEADLINE_MS: u64 = 10_000;

async fn hop_call(node: &ClusterNode, key: &str, payload: String, timeout_ms: u64) -> Result<String, InvokeError> {
    let deadline = node.handle().deadline_in(Duration::from_millis(timeout_ms));
    node.invoke(&hops::hop(key), Bytes::from(payload), deadline)
        .await
        .map(|reply| String::from_utf8(reply.to_vec()).expect("text"))
}

/// Activates `hop:<key>` on `node`.
async fn place_hop(node: &ClusterNode, key: &str) {
    let reply = hop_call(node, key, "ping".into(), CALL_TIMEOUT_MS)
        .await
        .expect("a ping");
    assert_eq!(reply, node.node().as_str(), "{key} placed where it was first called");
}

/// Three independent roots at once on three nodes over a real etcd: `a`(node-a) calls
/// `b`(node-b), `b` calls `c`(node-c), `c` calls `a`. The probes find the cycle: at
/// least one call is refused with `DeadlockDetected` naming the ring, long before the
/// 10 s deadline, and the other roots then finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cross_node_cycle_is_refused_by_probes_over_real_etcd() {
    let cluster = start_cluster("xnode-cycle").await;
    let ring = ["a", "b", "c"];
    for (index, key) in ring.iter().enumerate() {
        place_hop(&cluster.nodes[index], key).await;
    }
    let started = Instant::now();
    let roots = ring.iter().enumerate().map(|(index, key)| {
        let next = ring[(index + 1) % ring.len()];
        let node = &cluster.nodes[index];
        async move {
            let reply = hop_call(node, key, format!("{CYCLE_SLEEP_MS};{next}"), CYCLE_DEADLINE_MS).await;
            (key, reply, started.elapsed())
        }
    });
    let results = futures::future::join_all(roots).await;
    let mut refused = 0;
    for (key, reply, took) in &results {
        let reply = hops::parse_hop(reply.as_ref().unwrap_or_else(|error| panic!("root {key}: {error}")));
        match &reply.outcome {
            hops::Outcome::Deadlock(cycle) => {
                assert!(hops::is_rotation_of(cycle, &ring), "root {key} named {cycle:?}");
                refused += 1;
            }
            hops::Outcome::Ok(_) => {}
            other => panic!("root {key}: {other:?}"),
        }
        eprintln!("root {key}: {:?} after {} ms", reply.outcome, took.as_millis());
        assert!(
            *took < Duration::from_millis(CYCLE_SLEEP_MS + SCHEDULING_ALLOWANCE_MS),
            "root {key} took {took:?}: the cycle was not refused quickly"
        );
    }
    assert!(refused >= 1, "no call of the cycle was refused: {results:?}");
    let probes: u64 = cluster.nodes.iter().map(|node| node.stats().probes_sent).sum();
    assert!(probes >= 1, "the refusal came from probes");
}

/// Crossing chains over a real etcd: every node sends roots that call chains of actors
/// spread over the three nodes, always in increasing order (no cycle can form), so the
/// calls cross between nodes both ways and queue behind one another. None is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crossing_calls_across_nodes_are_never_refused_over_real_etcd() {
    const CROSSING_ACTORS: usize = 6;
    const CROSSING_ROOTS: usize = 30;
    let cluster = start_cluster("xnode-crossing").await;
    for index in 0..CROSSING_ACTORS {
        place_hop(&cluster.nodes[index % 3], &format!("x{index}")).await;
    }
    let roots = (0..CROSSING_ROOTS).map(|root| {
        // Chains of increasing indices: x{root % 6} then every later one of the same parity.
        let first = root % CROSSING_ACTORS;
        let rest: Vec<String> = (first + 1..CROSSING_ACTORS)
            .filter(|index| (index + root) % 2 == 0 || *index == CROSSING_ACTORS - 1)
            .map(|index| format!("x{index}"))
            .collect();
        let node = &cluster.nodes[root % 3];
        let payload = format!("{};{}", (root * 37) % 100, rest.join(","));
        async move { hop_call(node, &format!("x{first}"), payload, CALL_TIMEOUT_MS).await }
    });
    let mut hops_seen = 0;
    for reply in futures::future::join_all(roots).await {
        let mut level = hops::parse_hop(&reply.expect("a root"));
        loop {
            hops_seen += 1;
            match level.outcome {
                hops::Outcome::Ok(inner) => level = *inner,
                hops::Outcome::Leaf => break,
                other => panic!("a chain with no cycle ended {other:?}"),
            }
        }
    }
    assert!(hops_seen > CROSSING_ROOTS, "the chains made calls");
}

/// A turn's call follows the actor when it moves: `w` (node-a) calls `x` (node-b), so
/// node-a's route says node-b; `x` is deactivated there and placed on node-c; `w`'s next
/// call meets node-b's `NotOwner` refusal, looks the owner up again and is served by
/// node-c alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_turn_s_call_on_a_stale_route_is_rerouted_to_the_new_owner() {
    let cluster = start_cluster("xnode-stale").await;
    let [a, b, c] = [&cluster.nodes[0], &cluster.nodes[1], &cluster.nodes[2]];
    place_hop(a, "w").await;
    place_hop(b, "x").await;
    let first = hops::parse_hop(&hop_call(a, "w", "0;x".into(), CALL_TIMEOUT_MS).await.expect("w → x"));
    let hops::Outcome::Ok(inner) = first.outcome else {
        panic!("{first:?}")
    };
    assert_eq!(inner.node, "node-b", "x served by its owner");
    assert!(
        b.handle().deactivate(&hops::hop("x")).await.expect("deactivate"),
        "x was active on node-b"
    );
    let released = Instant::now();
    while b.placement().lookup(&hops::hop("x")).await.expect("a lookup").is_some() {
        assert!(
            released.elapsed() < Duration::from_millis(SCHEDULING_ALLOWANCE_MS),
            "x's placement was never released"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    place_hop(c, "x").await;
    let reroutes_before = a.stats().reroutes;
    let second = hops::parse_hop(
        &hop_call(a, "w", "0;x".into(), CALL_TIMEOUT_MS)
            .await
            .expect("w → x again"),
    );
    let hops::Outcome::Ok(inner) = second.outcome else {
        panic!("{second:?}")
    };
    assert_eq!(inner.node, "node-c", "the stale route was corrected");
    assert!(
        a.stats().reroutes > reroutes_before,
        "node-b refused and node-a looked x up again"
    );
    assert!(
        a.stats().turn_calls_forwarded >= 2,
        "both calls from w's turns crossed nodes"
    );
}

/// Goal: a node restarted under its name at another address (a supervisor restarting it
/// on a free port, a pod given a new IP) is reached there by the nodes that called it
/// before. Method: A calls an actor on B (A now holds a transport client for B); B
/// leaves and starts again as "node-b" on 127.0.0.2 and hosts the actor again; A calls
/// it at most `CALLS_AFTER_RESTART` times. The first call may still meet the old address
/// (`Unreachable`, not resent: unkeyed); one of them must be served by the new B.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_restarted_under_its_name_at_a_new_address_is_reached_there() {
    const CALLS_AFTER_RESTART: usize = 3;
    let mut cluster = start_cluster("readdress").await;
    let actor = counter("readdressed");
    let (served_by, _) = call(&cluster.nodes[1], &actor, b"inc").await.expect("placed on B");
    assert_eq!(served_by, "node-b");
    let (served_by, count) = call(&cluster.nodes[0], &actor, b"inc").await.expect("A reaches B");
    assert_eq!((served_by.as_str(), count), ("node-b", 2));

    let old = cluster.nodes.remove(1);
    let old_address = old.address();
    old.leave().await.expect("B leaves");
    let restarted = ClusterNode::start(
        cluster.etcd.config("node-b", ""),
        "127.0.0.2:0".parse().expect("an address"),
        hops::with_hop(counter_runtime("node-b"), "node-b"),
        cluster.stores[1].clone(),
    )
    .await
    .expect("B starts again");
    assert_ne!(restarted.address(), old_address);
    let (served_by, count) = call(&restarted, &actor, b"inc").await.expect("placed on the new B");
    assert_eq!((served_by.as_str(), count), ("node-b", 3));

    let mut failures = Vec::new();
    let mut served = None;
    for _ in 0..CALLS_AFTER_RESTART {
        match call(&cluster.nodes[0], &actor, b"inc").await {
            Ok(reply) => {
                served = Some(reply);
                break;
            }
            Err(error) => failures.push(error),
        }
    }
    let (served_by, count) = served.unwrap_or_else(|| {
        panic!(
            "A never reached B at {} after {CALLS_AFTER_RESTART} calls: {failures:?}",
            restarted.address()
        )
    });
    assert_eq!((served_by.as_str(), count), ("node-b", 4));
    assert!(
        failures.len() <= 1,
        "at most the first call met the old address: {failures:?}"
    );
}

/// Goal: a node does not publish an address other nodes cannot dial. Listening on the
/// unspecified address (`0.0.0.0`, `::`) with no `EtcdConfig::address` would publish
/// `0.0.0.0:port`, which every other node dials as itself; an explicit address that is
/// not `ip:port`, or is unspecified or port 0, is never dialled (callers then end in
/// `Timeout`, far from the cause). Method: each of those configurations is refused at
/// start, naming the address and what to set, and nothing joins etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_refuses_to_publish_an_address_other_nodes_cannot_dial() {
    let etcd = TestEtcd::start("undialable").await;
    let loopback: std::net::SocketAddr = "127.0.0.1:0".parse().expect("an address");
    let cases = [
        ("", "0.0.0.0:0".parse().expect("an address")),
        ("", "[::]:0".parse().expect("an address")),
        ("node-z.internal:7100", loopback),
        ("0.0.0.0:7100", loopback),
        ("127.0.0.1:0", loopback),
        ("127.0.0.1", loopback),
    ];
    for (published, listen) in cases {
        let directory = tempfile::tempdir().expect("a directory");
        let store = SqliteStore::open(directory.path().join("state.db")).expect("a store");
        let started = ClusterNode::start(
            etcd.config("node-z", published),
            listen,
            counter_runtime("node-z"),
            store,
        )
        .await;
        let refusal = match started {
            Ok(node) => panic!(
                "published {published:?} listening on {listen}: started at {}",
                node.address()
            ),
            Err(error) => error,
        };
        assert!(
            matches!(&refusal, ClusterError::Address { address, .. } if *address == published || published.is_empty()),
            "{published:?} on {listen}: {refusal:?}"
        );
        let message = refusal.to_string();
        assert!(
            message.contains("cannot dial") && message.contains("EtcdConfig::address"),
            "{published:?} on {listen}: {message}"
        );
    }
    let directory = tempfile::tempdir().expect("a directory");
    let store = SqliteStore::open(directory.path().join("state.db")).expect("a store");
    let members = ClusterNode::start(etcd.config("node-y", ""), loopback, counter_runtime("node-y"), store)
        .await
        .expect("a loopback node starts")
        .placement()
        .nodes()
        .await
        .expect("the members");
    let names: Vec<&str> = members.iter().map(|member| member.node.as_str()).collect();
    assert_eq!(names, ["node-y"], "no refused node joined");
}

/// One node of [`agents_on_two_nodes_call_each_other_and_their_history_persists`]: the
/// node and its attached agent client.
async fn start_agent_node(
    etcd: &TestEtcd,
    name: &str,
    index: usize,
    path: &std::path::Path,
    llm: &troupe_agent::ScriptedLlm,
    seen: &agents::Seen,
) -> (ClusterNode, troupe_agent::AgentClient) {
    let (runtime, pending) = agents::agent_system(llm, index, seen)
        .prepare()
        .expect("the agent system is valid");
    let node = ClusterNode::start(
        etcd.config(name, ""),
        "127.0.0.1:0".parse().expect("an address"),
        runtime,
        SqliteStore::open(path).expect("open the shared SQLite file"),
    )
    .await
    .expect("start the node");
    let client = pending
        .attach(node.handle().clone())
        .expect("the node's runtime has the agent kinds");
    (node, client)
}

/// node-a and node-b on one SQLite file in `directory`, `a` placed on node-a and `b` on
/// node-b (each asked `ping` through its node).
async fn two_agent_nodes(
    etcd: &TestEtcd,
    directory: &std::path::Path,
    llm: &troupe_agent::ScriptedLlm,
    seen: &agents::Seen,
) -> (
    (ClusterNode, troupe_agent::AgentClient),
    (ClusterNode, troupe_agent::AgentClient),
) {
    let path = directory.join("state.db");
    let a = start_agent_node(etcd, "node-a", 0, &path, llm, seen).await;
    let b = start_agent_node(etcd, "node-b", 1, &path, llm, seen).await;
    let timeout = Duration::from_millis(CALL_TIMEOUT_MS);
    for ((_, client), agent, node) in [(&a, "a", 0), (&b, "b", 1)] {
        let reply = client.ask_with_timeout(agent, "ping", timeout).await.expect("a ping");
        assert_eq!(reply.text, "pong");
        assert_eq!(
            seen.turns_of(agent).pop().map(|turn| turn.0),
            Some(node),
            "{agent} placed"
        );
    }
    (a, b)
}

/// Agents on two nodes over real etcd, on a multi-thread runtime: `a` (node-a) asks `b`
/// (node-b) with `call_agent`, the ask itself made through node-b's client (routed to
/// node-a); the reply comes back through both; each turn ran on its agent's node. Then
/// node-b leaves: asking `b` through node-a activates it there from the shared store,
/// with its earlier exchange in its log and in its model's history window.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agents_on_two_nodes_call_each_other_and_their_history_persists() {
    let etcd = TestEtcd::start("agents").await;
    let directory = tempfile::tempdir().expect("a directory");
    let llm = agents::script();
    let seen = agents::Seen::default();
    let ((node_a, client_a), (node_b, client_b)) = two_agent_nodes(&etcd, directory.path(), &llm, &seen).await;
    let timeout = Duration::from_millis(CALL_TIMEOUT_MS);
    seen.clear();
    let started = Instant::now();
    // Under a trace id: routed from node-b to a's owner, each turn runs under it.
    let trace = troupe_core::TraceId::new(0x7472_6f75_7065_0000_0000_0000_0000_0003);
    let options = troupe_agent::AskOptions::default().timeout(timeout).traced(trace);
    let reply = client_b.ask_with("a", "ask just b", options).await.expect("a answers");
    eprintln!("a → b across nodes answered in {} ms", started.elapsed().as_millis());
    assert_eq!(reply.text, "a<b-answer");
    assert_eq!(seen.turns_of("a"), vec![(0, 0, vec![])], "a ran on node-a");
    assert_eq!(
        seen.turns_of("b"),
        vec![(1, 1, vec!["a".to_string()])],
        "b ran on node-b, called by a"
    );
    for agent in ["a", "b"] {
        assert_eq!(
            seen.traces_of(agent),
            vec![Some(trace)],
            "{agent}'s turn ran under the ask's trace id"
        );
    }
    assert!(node_a.stats().turn_calls_forwarded >= 1, "{:?}", node_a.stats());
    assert!(
        node_b.stats().forwarded_calls >= 1,
        "the root ask went to node-a: {:?}",
        node_b.stats()
    );
    let before = client_a.conversation_log("b").await.expect("b's log");
    let texts: Vec<&str> = before.iter().map(|message| message.content.as_str()).collect();
    assert_eq!(
        texts,
        vec!["ping", "pong", "[message from agent a] question for b", "b-answer"]
    );

    node_b.leave().await.expect("node-b leaves");
    seen.clear();
    // node-a's cached route still names node-b: the first ask meets the closed port
    // (`Unreachable`, which the cluster returns rather than retries: the request may
    // have run) and forgets the route; the next one places b on node-a.
    let mut unreachable = 0;
    let reply = loop {
        match client_a.ask_with_timeout("b", "ping", timeout).await {
            Ok(reply) => break reply,
            Err(troupe_agent::AgentCallError::Invoke(InvokeError::Unreachable { .. })) if unreachable < 3 => {
                unreachable += 1;
            }
            Err(error) => panic!("b answers on node-a: {error}"),
        }
    };
    assert_eq!(reply.text, "pong");
    assert_eq!(
        seen.turns_of("b").first().map(|turn| turn.0),
        Some(0),
        "b now runs on node-a"
    );
    let after = client_a.conversation_log("b").await.expect("b's log");
    assert_eq!(after[..before.len()], before[..], "b's log survived its node");
    assert_eq!(after.len(), before.len() + 2);
    let last = llm.requests_of("b").pop().expect("b's model was asked");
    assert!(
        last.messages.iter().any(|message| message.content == "b-answer"),
        "b's history window was reloaded on node-a"
    );
    node_a.leave().await.expect("node-a leaves");
}

/// Slack over the organisation's cache age for a change written on one node to reach
/// another node's admission, in milliseconds (wall clock, loaded 2-core machine).
const ORG_REACH_SLACK_MS: u64 = 500;
/// Links each node writes at once in the concurrent-writers step (40 per node met 9
/// fenced commits, 3 of them twice in a row, on the 2-core machine).
const ORG_LINKS_PER_NODE: usize = 40;
/// How long a call may wait for its approval to be requested, in milliseconds.
const APPROVAL_REQUEST_BOUND_MS: u64 = 5_000;

/// The first approval pending in the stored organisation, read through `client`.
async fn pending_approval(client: &troupe_agent::AgentClient) -> u64 {
    let started = Instant::now();
    loop {
        let org = client.reload_org().await.expect("the organisation reads");
        if let Some(approval) = org.pending_approvals().first() {
            return approval.id;
        }
        assert!(
            started.elapsed() < Duration::from_millis(APPROVAL_REQUEST_BOUND_MS),
            "no approval was requested within {APPROVAL_REQUEST_BOUND_MS} ms"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The organisation on a cluster, over real etcd, on a multi-thread runtime: its record
/// is not an actor, so no node holds it; every node writes it (the store's fences order
/// the writers) and admits calls on it within the cache age of the newest write.
/// - the enforced policy written on node-a refuses `a → b` (no link), asked through
///   node-b and admitted on node-a;
/// - a link written on node-b (the record last written by node-a: before the change,
///   node-b was refused `NotOwner` for good) lets `a → b` through on node-a once node-a's
///   copy is a cache age old;
/// - `a`, made supervised on node-b, asks `b`: the approval is requested on node-a
///   (where `a`'s turn waits), found and given on node-b, and the call proceeds;
/// - both nodes write links at once: every write lands, both nodes read them all;
/// - an agent defined through node-a answers through node-b; removed through node-b,
///   it is refused through node-a a refresh period later.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_organisation_is_one_record_every_node_writes_and_admits_on() {
    use troupe_agent::{BehaviourMode, Link, Membership, OrgPolicy, ORG_CACHE_MAX_AGE_MS};

    let etcd = TestEtcd::start("org").await;
    let directory = tempfile::tempdir().expect("a directory");
    let llm = agents::script();
    let seen = agents::Seen::default();
    let ((node_a, client_a), (node_b, client_b)) = two_agent_nodes(&etcd, directory.path(), &llm, &seen).await;
    let timeout = Duration::from_millis(CALL_TIMEOUT_MS);
    let reach = Duration::from_millis(ORG_CACHE_MAX_AGE_MS + ORG_REACH_SLACK_MS);

    client_a
        .set_org_policy(OrgPolicy::Enforced)
        .await
        .expect("node-a writes the policy");
    let refused = client_b
        .ask_with_timeout("a", "ask just b", timeout)
        .await
        .expect("a answers");
    assert!(
        refused.text.contains("call not permitted: a may not ask b"),
        "a's call to b refused without a link: {}",
        refused.text
    );

    client_b
        .add_link(Link::new("a", "b"))
        .await
        .expect("node-b writes a link to the record node-a wrote last");
    tokio::time::sleep(reach).await;
    seen.clear();
    let reply = client_b
        .ask_with_timeout("a", "ask just b", timeout)
        .await
        .expect("a answers");
    assert_eq!(
        reply.text, "a<b-answer",
        "the link written on node-b admits a → b on node-a"
    );
    assert_eq!(
        seen.turns_of("a").first().map(|turn| turn.0),
        Some(0),
        "a ran on node-a"
    );

    let supervised = Membership {
        manager: None,
        mode: BehaviourMode::Supervised,
    };
    client_b
        .set_membership("a", supervised)
        .await
        .expect("node-b makes a supervised");
    tokio::time::sleep(reach).await;
    let asking = tokio::spawn({
        let client_b = client_b.clone();
        async move { client_b.ask_with_timeout("a", "ask just b", timeout).await }
    });
    let id = pending_approval(&client_b).await;
    let approved = Instant::now();
    client_b.approve(id).await.expect("node-b approves");
    let reply = asking.await.expect("the ask's task").expect("a answers");
    eprintln!(
        "approval {id} given on node-b reached a's waiting call on node-a in {} ms",
        approved.elapsed().as_millis()
    );
    assert_eq!(
        reply.text, "a<b-answer",
        "approved on node-b, a's call on node-a proceeds"
    );

    let pairs: Vec<(String, String)> = (0..2 * ORG_LINKS_PER_NODE)
        .map(|index| (format!("d{}", index % 6), format!("z{index}")))
        .collect();
    let writes = pairs.iter().enumerate().map(|(index, (from, to))| {
        let client = if index % 2 == 0 { &client_a } else { &client_b };
        client.add_link(Link::new(from.clone(), to.clone()))
    });
    for (written, (from, to)) in futures::future::join_all(writes).await.into_iter().zip(&pairs) {
        written.unwrap_or_else(|error| panic!("the link {from} → {to} is written: {error}"));
    }
    for client in [&client_a, &client_b] {
        let links = client.reload_org().await.expect("the organisation reads").links();
        for (from, to) in &pairs {
            assert!(
                links.iter().any(|link| &link.from == from && &link.to == to),
                "{from} → {to} is in the record: {links:?}"
            );
        }
        assert_eq!(links.len(), pairs.len() + 1, "{links:?}");
    }
    // The agent directory is shared the same way: defined through node-a, asked
    // through node-b; removed through node-b, refused through node-a a period later.
    client_b.reload_directory().await.expect("node-b reads the directory");
    client_a
        .define_agent(troupe_agent::AgentSpec::new("x"))
        .await
        .expect("node-a defines x");
    tokio::time::sleep(Duration::from_millis(troupe_agent::DIRECTORY_REFRESH_MS)).await;
    let reply = client_b
        .ask_with_timeout("x", "ping", timeout)
        .await
        .expect("x answers through node-b");
    assert_eq!(reply.text, "pong");
    client_a.reload_directory().await.expect("node-a reads the directory");
    client_b.remove_agent("x").await.expect("node-b removes x");
    tokio::time::sleep(Duration::from_millis(troupe_agent::DIRECTORY_REFRESH_MS)).await;
    let refused = client_a.ask_with_timeout("x", "ping", timeout).await;
    assert!(
        matches!(
            refused,
            Err(troupe_agent::AgentCallError::Refused(
                troupe_core::CallRefused::AgentNotFound { .. }
            ))
        ),
        "the removal made through node-b holds on node-a: {refused:?}"
    );
    node_b.leave().await.expect("node-b leaves");
    node_a.leave().await.expect("node-a leaves");
}
