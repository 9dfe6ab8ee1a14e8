//! `EtcdPlacement` against a real etcd server that each test starts and kills.
//!
//! Each test starts `etcd` (Debian package `etcd-server`, `/usr/bin/etcd`) on two free
//! loopback ports with a temporary data directory, and kills it when its [`TestEtcd`] is
//! dropped. Without the binary every test fails and says to install the package; none
//! is skipped. The fencing tests use a `SqliteStore` file opened twice, one handle per
//! node, as two processes on one store would.
//!
//! Run with `cargo nextest run -p troupe-etcd`.
#![cfg(not(madsim))]

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;
use troupe_core::ActorId;
use troupe_etcd::{
    ConfigError, EtcdConfig, EtcdPlacement, LeaseLostReason, NodeId, Placement, PlacementError, PlacementOperation,
};
use troupe_runtime::{FencedClaim, SqliteStore, StateChange, StateStore, StoreError, TurnCommit};

#[path = "support/etcd_server.rs"]
mod etcd_server;

use etcd_server::{TestEtcd, TEST_LEASE_TTL_S, TEST_REQUEST_TIMEOUT_MS};

/// Allowance for a loaded 2-core machine on top of a bound a test checks, in ms.
const SCHEDULING_ALLOWANCE_MS: u64 = 1_500;

/// A node of the tests, with a made-up address (these tests call no node).
fn config(etcd: &TestEtcd, node: &str) -> EtcdConfig {
    etcd.config(node, &format!("{node}.internal:7100"))
}

async fn join(etcd: &TestEtcd, node: &str) -> EtcdPlacement {
    EtcdPlacement::join(config(etcd, node)).await.expect("join the cluster")
}

fn actor(key: &str) -> ActorId {
    ActorId::new("counter", key).expect("a valid actor id")
}

fn set_state(text: &str) -> TurnCommit {
    TurnCommit {
        state: StateChange::Set(Bytes::copy_from_slice(text.as_bytes())),
        writes: Vec::new(),
    }
}

fn node_names(nodes: &[troupe_etcd::NodeRecord]) -> Vec<&str> {
    nodes.iter().map(|record| record.node.as_str()).collect()
}

/// Two nodes race to place each of 64 actors, every attempt in a task of its own on a
/// multi-thread runtime: for every actor exactly one node wins, the other is told the
/// winner's name, and a lookup names the same node with the same fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_nodes_place_each_actor_exactly_once() {
    const ACTORS: usize = 64;
    let etcd = TestEtcd::start("race").await;
    let nodes = [join(&etcd, "node-a").await, join(&etcd, "node-b").await];
    let mut attempts = Vec::new();
    for index in 0..ACTORS {
        for node in &nodes {
            let node = node.clone();
            let actor = actor(&format!("raced-{index}"));
            attempts.push(tokio::spawn(async move {
                let outcome = node.place(&actor).await;
                (actor, node.node().clone(), outcome)
            }));
        }
    }
    let mut winners: BTreeMap<ActorId, Vec<(NodeId, troupe_runtime::Fence)>> = BTreeMap::new();
    let mut losers: BTreeMap<ActorId, NodeId> = BTreeMap::new();
    for attempt in attempts {
        let (actor, node, outcome) = attempt.await.expect("the attempt ran");
        match outcome {
            Ok(record) => {
                assert_eq!(record.owner, node, "a successful place names the placing node");
                winners.entry(actor).or_default().push((node, record.fence));
            }
            Err(PlacementError::PlacementConflict { owner, .. }) => {
                assert_ne!(owner, node, "a conflict names the other node");
                losers.insert(actor, owner);
            }
            Err(other) => panic!("placing {actor} on {node} failed: {other}"),
        }
    }
    assert_eq!(winners.len(), ACTORS, "every actor was placed");
    for (actor, won) in &winners {
        assert_eq!(won.len(), 1, "{actor} was placed by exactly one node, not {won:?}");
        let (winner, fence) = &won[0];
        assert_eq!(
            losers.get(actor),
            Some(winner),
            "the loser of {actor} was told the winner"
        );
        let looked_up = nodes[0].lookup(actor).await.expect("lookup").expect("a placement");
        assert_eq!((&looked_up.owner, looked_up.fence), (winner, *fence));
    }
}

/// Node A places an actor, claims its state with the placement's fence and commits; then
/// A stops renewing (its handle is dropped, as if the process froze) but keeps its store
/// handle, a zombie. Node B can place the actor once A's lease has expired, within the
/// TTL plus allowances, with a strictly greater fence; B claims with it, and from then on
/// the store refuses A's commit and A's claim with the old fence, while B's commits land.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_lease_lets_another_node_place_with_a_newer_fence_and_the_zombie_is_refused() {
    let etcd = TestEtcd::start("takeover").await;
    let directory = tempfile::tempdir().expect("a directory for the store");
    let path = directory.path().join("state.db");
    let store_a = SqliteStore::open(&path).expect("open the store for A");
    let store_b = SqliteStore::open(&path).expect("open the store for B");
    let x = actor("x");

    let node_a = join(&etcd, "node-a").await;
    let node_b = join(&etcd, "node-b").await;
    let placed_a = node_a.place(&x).await.expect("A places x");
    let claimed_a = store_a.claim_with_fence(&x, placed_a.fence).await.expect("A claims x");
    assert_eq!(claimed_a.fence, placed_a.fence);
    store_a
        .commit(&x, placed_a.fence, set_state("from A"))
        .await
        .expect("A commits while it owns x");
    match node_b.place(&x).await {
        Err(PlacementError::PlacementConflict { owner, .. }) => assert_eq!(owner.as_str(), "node-a"),
        other => panic!("B must not place x while A's lease lives: {other:?}"),
    }

    drop(node_a);
    let stopped = Instant::now();
    let takeover_bound = Duration::from_millis(TEST_LEASE_TTL_S * 1_000 + 1_000 + SCHEDULING_ALLOWANCE_MS);
    // Answers that took etcd longer than the request timeout, retried within the bound: a
    // loaded CI machine once held one Place past its 500 ms (2026-12-02); what is tested
    // here is the takeover's bound and fences, not etcd's latency.
    let mut unanswered = 0;
    let placed_b = loop {
        match node_b.place(&x).await {
            Ok(record) => break record,
            Err(PlacementError::PlacementConflict { .. }) => {
                assert!(
                    stopped.elapsed() < takeover_bound,
                    "A's placement outlived its lease: still there after {:?}",
                    stopped.elapsed()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(PlacementError::EtcdUnavailable { .. }) if stopped.elapsed() < takeover_bound => {
                unanswered += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(other) => panic!("B's place failed: {other}"),
        }
    };
    eprintln!(
        "B placed x {:?} after A stopped renewing ({unanswered} place requests unanswered in time)",
        stopped.elapsed()
    );
    assert_eq!(placed_b.owner.as_str(), "node-b");
    assert!(
        placed_b.fence > placed_a.fence,
        "the new placement's fence {} is newer than the old {}",
        placed_b.fence,
        placed_a.fence
    );
    let claimed_b = store_b.claim_with_fence(&x, placed_b.fence).await.expect("B claims x");
    assert_eq!(
        claimed_b.state.as_deref(),
        Some(&b"from A"[..]),
        "B starts from A's last commit"
    );

    match store_a.commit(&x, placed_a.fence, set_state("zombie A")).await {
        Err(StoreError::Fenced { held, current, .. }) => {
            assert_eq!(held, placed_a.fence);
            assert_eq!(current, Some(placed_b.fence));
        }
        other => panic!("the zombie's commit must be fenced: {other:?}"),
    }
    match store_a.claim_with_fence(&x, placed_a.fence).await {
        Err(StoreError::Fenced { current, .. }) => assert_eq!(current, Some(placed_b.fence)),
        other => panic!("the zombie's claim must be fenced: {other:?}"),
    }
    store_b
        .commit(&x, placed_b.fence, set_state("from B"))
        .await
        .expect("B commits");
    assert_eq!(
        store_b.load(&x).await.expect("load").as_deref(),
        Some(&b"from B"[..]),
        "the zombie wrote nothing"
    );
}

/// A lease revoked behind the node's back (as etcd does when it expires a lease) is
/// noticed by the keep-alive task within one renewal interval plus a request: the
/// `lease_lost` signal fires with `ExpiredOnServer`, and `place` is refused with
/// `LeaseExpired` without asking etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoked_lease_fires_lease_lost_and_the_node_places_nothing_more() {
    let etcd = TestEtcd::start("revoked").await;
    let node = join(&etcd, "node-a").await;
    assert!(node.holds_lease());
    let mut admin = etcd_client::Client::connect([etcd.endpoint()], None)
        .await
        .expect("an admin client");
    admin.lease_revoke(node.lease()).await.expect("revoke the node's lease");
    let bound = Duration::from_millis(TEST_LEASE_TTL_S * 1_000 / 3 + TEST_REQUEST_TIMEOUT_MS + SCHEDULING_ALLOWANCE_MS);
    let reason = tokio::time::timeout(bound, node.lease_lost())
        .await
        .unwrap_or_else(|_| panic!("lease_lost did not fire within {bound:?}"));
    assert_eq!(reason, LeaseLostReason::ExpiredOnServer);
    assert!(!node.holds_lease());
    match node.place(&actor("y")).await {
        Err(PlacementError::LeaseExpired {
            node: name,
            lease,
            reason,
        }) => {
            assert_eq!(name.as_str(), "node-a");
            assert_eq!(lease, node.lease());
            assert_eq!(reason, LeaseLostReason::ExpiredOnServer);
        }
        other => panic!("a node without its lease must not place: {other:?}"),
    }
}

/// The member list follows joins, a clean leave (at once, with the leaver's
/// placements) and a crash (after the lease TTL); so do the HTTP addresses the nodes
/// publish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_list_follows_joins_leaves_and_crashes() {
    let etcd = TestEtcd::start("members").await;
    let node_a = join(&etcd, "node-a").await;
    assert_eq!(node_names(&node_a.nodes().await.expect("list")), ["node-a"]);
    let node_b = join(&etcd, "node-b").await;
    let node_c = join(&etcd, "node-c").await;
    let listed = node_a.nodes().await.expect("list");
    assert_eq!(node_names(&listed), ["node-a", "node-b", "node-c"]);
    assert_eq!(listed[1].address, "node-b.internal:7100");
    // The HTTP address a node publishes is read by the others, and goes with its lease.
    let (name_b, name_c) = (NodeId::new("node-b").unwrap(), NodeId::new("node-c").unwrap());
    assert_eq!(
        node_a.http_address(&name_b).await.expect("lookup"),
        None,
        "none published yet"
    );
    node_b.publish_http("127.0.0.1:8081").await.expect("B publishes");
    node_c.publish_http("127.0.0.1:8082").await.expect("C publishes");
    assert_eq!(
        node_a.http_address(&name_b).await.expect("lookup").as_deref(),
        Some("127.0.0.1:8081")
    );

    let z = actor("z");
    node_b.place(&z).await.expect("B places z");
    node_b.leave().await.expect("B leaves");
    assert_eq!(node_b.lease_lost().await, LeaseLostReason::Left);
    assert_eq!(node_names(&node_a.nodes().await.expect("list")), ["node-a", "node-c"]);
    assert_eq!(
        node_a.http_address(&name_b).await.expect("lookup"),
        None,
        "a leaver's HTTP address goes with it"
    );
    assert_eq!(
        node_a.lookup(&z).await.expect("lookup"),
        None,
        "a leaver's placements go with it"
    );

    drop(node_c);
    let crashed = Instant::now();
    let bound = Duration::from_millis(TEST_LEASE_TTL_S * 1_000 + 1_000 + SCHEDULING_ALLOWANCE_MS);
    while node_names(&node_a.nodes().await.expect("list")) != ["node-a"] {
        assert!(crashed.elapsed() < bound, "a crashed node stayed listed for {bound:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("a crashed node left the list after {:?}", crashed.elapsed());
    assert_eq!(
        node_a.http_address(&name_c).await.expect("lookup"),
        None,
        "a crashed node's HTTP address went with its lease"
    );
}

/// With etcd killed, every operation fails with `EtcdUnavailable` within the request
/// timeout (plus scheduling), never hangs; the lease counts as lost once no renewal was
/// confirmed for TTL − slack; and joining a cluster whose etcd is down fails the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopped_etcd_gives_etcd_unavailable_within_the_request_timeout() {
    let mut etcd = TestEtcd::start("stopped").await;
    let node = join(&etcd, "node-a").await;
    let config = config(&etcd, "node-b");
    etcd.kill();
    let bound = Duration::from_millis(TEST_REQUEST_TIMEOUT_MS + SCHEDULING_ALLOWANCE_MS);
    let started = Instant::now();
    match node.lookup(&actor("w")).await {
        Err(PlacementError::EtcdUnavailable { operation, .. }) => assert_eq!(operation, PlacementOperation::Lookup),
        other => panic!("lookup with etcd down: {other:?}"),
    }
    assert!(started.elapsed() < bound, "lookup took {:?}", started.elapsed());
    let started = Instant::now();
    match node.place(&actor("w")).await {
        Err(PlacementError::EtcdUnavailable { operation, .. }) => assert_eq!(operation, PlacementOperation::Place),
        other => panic!("place with etcd down: {other:?}"),
    }
    assert!(started.elapsed() < bound, "place took {:?}", started.elapsed());
    let started = Instant::now();
    assert!(matches!(
        node.nodes().await,
        Err(PlacementError::EtcdUnavailable { .. })
    ));
    assert!(started.elapsed() < bound, "nodes took {:?}", started.elapsed());
    let started = Instant::now();
    match EtcdPlacement::join(config).await {
        Err(PlacementError::EtcdUnavailable { .. }) => {}
        other => panic!("join with etcd down: {other:?}"),
    }
    assert!(started.elapsed() < bound * 2, "join took {:?}", started.elapsed());

    let lost_bound = Duration::from_millis(TEST_LEASE_TTL_S * 1_000 + SCHEDULING_ALLOWANCE_MS);
    let reason = tokio::time::timeout(lost_bound, node.lease_lost())
        .await
        .unwrap_or_else(|_| panic!("lease_lost did not fire within {lost_bound:?} of etcd's death"));
    assert_eq!(reason, LeaseLostReason::NotRenewedInTime);
}

/// Bad configurations are refused before anything is sent, naming the field and bound.
#[tokio::test]
async fn invalid_configurations_are_refused_with_the_violated_bound() {
    assert!(matches!(
        NodeId::new("a/b"),
        Err(ConfigError::BadName { what: "node", .. })
    ));
    assert!(matches!(
        NodeId::new(""),
        Err(ConfigError::BadName { what: "node", .. })
    ));
    let node = NodeId::new("n1").expect("valid");
    let base = EtcdConfig::new(vec!["127.0.0.1:1".to_string()], "c", node.clone(), "n1:1");
    assert_eq!(base.validate(), Ok(()));
    let cases = [
        (base.clone().with_lease_ttl_s(2), "lease_ttl_s", 3, 300),
        (base.clone().with_lease_ttl_s(301), "lease_ttl_s", 3, 300),
        // TTL 3 s leaves 3000 − 1000 (slack) − 1000 (TTL/3) − 1 = 999 ms for a request.
        (base.clone().with_lease_ttl_s(3), "request_timeout_ms", 50, 999),
        (
            base.clone().with_request_timeout_ms(10),
            "request_timeout_ms",
            50,
            2_333,
        ),
    ];
    for (config, field, min, max) in cases {
        match EtcdPlacement::join(config).await {
            Err(PlacementError::Config(ConfigError::OutOfRange {
                field: got_field,
                min: got_min,
                max: got_max,
                ..
            })) => assert_eq!((got_field, got_min, got_max), (field, min, max)),
            other => panic!("expected {field} out of range, got {other:?}"),
        }
    }
    let mut no_endpoints = base.clone();
    no_endpoints.endpoints.clear();
    assert_eq!(no_endpoints.validate(), Err(ConfigError::NoEndpoints));
    let bad_cluster = EtcdConfig::new(vec!["127.0.0.1:1".to_string()], "a b", node, "n1:1");
    assert!(matches!(
        bad_cluster.validate(),
        Err(ConfigError::BadName { what: "cluster", .. })
    ));
}
