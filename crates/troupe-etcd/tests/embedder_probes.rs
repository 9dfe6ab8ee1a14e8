//! `EtcdPlacement` probed as an embedder runs it: against a real etcd (Debian
//! `etcd-server`, started per test on loopback), with an etcd member down among the
//! endpoints, and with a second node under a name in use. Every await is bounded.
//!
//! Run with `cargo nextest run -p troupe-etcd --test embedder_probes`.
#![cfg(not(madsim))]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use troupe_core::ActorId;
use troupe_etcd::{EtcdPlacement, Placement, PlacementError};

#[path = "support/etcd_server.rs"]
mod etcd_server;

use etcd_server::{free_port, TestEtcd, TEST_LEASE_TTL_S};

/// Bound on any single await of a test, in milliseconds.
const STEP_TIMEOUT_MS: u64 = 15_000;
/// Pause between two requests of the dead-endpoint test, in milliseconds.
const REQUEST_PAUSE_MS: u64 = 20;

async fn bounded<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_millis(STEP_TIMEOUT_MS), future)
        .await
        .unwrap_or_else(|_| panic!("{what} did not end within {STEP_TIMEOUT_MS} ms"))
}

fn actor(key: &str) -> ActorId {
    ActorId::new("counter", key).expect("a valid actor id")
}

/// Goal: one etcd member down among a node's endpoints (one of three in production; a
/// closed port here) costs the node nothing: every request is answered by the live
/// member and the lease is kept. Before, the client's balancer sent about every other
/// request to the dead endpoint, whose connection error came back at once as
/// `EtcdUnavailable`, and keep-alives failed as often. Method: endpoints [dead, live];
/// for two lease TTLs, a `place` and a `lookup` every 20 ms, each must succeed, and
/// `lease_lost` must not resolve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_dead_endpoint_among_two_fails_no_request_and_loses_no_lease() {
    let etcd = TestEtcd::start("probe-dead-endpoint").await;
    let mut config = etcd.config("node-a", "node-a.internal:7100");
    config.endpoints = vec![format!("127.0.0.1:{}", free_port()), etcd.endpoint()];
    let placement = bounded("joining", EtcdPlacement::join(config))
        .await
        .expect("joins with one live endpoint");
    let until = Instant::now() + Duration::from_secs(2 * TEST_LEASE_TTL_S);
    let mut requests = 0_usize;
    while Instant::now() < until {
        let target = actor(&format!("k{requests}"));
        let placed = bounded("a place", placement.place(&target))
            .await
            .unwrap_or_else(|error| panic!("place after {requests} requests: {error}"));
        let found = bounded("a lookup", placement.lookup(&target))
            .await
            .unwrap_or_else(|error| panic!("lookup after {requests} requests: {error}"));
        assert_eq!(found, Some(placed));
        requests += 2;
        tokio::select! {
            biased;
            reason = placement.lease_lost() => panic!("the lease was lost after {requests} requests: {reason:?}"),
            () = tokio::time::sleep(Duration::from_millis(REQUEST_PAUSE_MS)) => {}
        }
    }
    eprintln!("{requests} requests answered with one of two endpoints dead");
    bounded("leaving", placement.leave()).await.expect("leaves");
}

/// Goal: `join_unless_in_use` refuses a name whose membership record names another
/// address where a live node serves, and writes nothing; it overwrites the record of a
/// node that is gone, and does not ask about its own address. Method: node-a joins at
/// address X; a second node-a at Y, told X is live, is refused naming X, and the record
/// still says X; told X is gone, it joins and the record says Y; a third at Y is not
/// asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_in_use_by_a_live_node_is_refused_and_a_gone_ones_is_taken() {
    let etcd = TestEtcd::start("probe-name-in-use").await;
    let first = bounded(
        "the first join",
        EtcdPlacement::join(etcd.config("node-a", "10.0.0.1:7100")),
    )
    .await
    .expect("the first node-a joins");
    let asked = Arc::new(AtomicBool::new(false));
    let in_use = |answer: bool| {
        let asked = Arc::clone(&asked);
        move |address: String| {
            assert_eq!(address, "10.0.0.1:7100", "asked about the recorded address");
            asked.store(true, Ordering::SeqCst);
            std::future::ready(answer)
        }
    };
    let refused = bounded(
        "a join under a live name",
        EtcdPlacement::join_unless_in_use(etcd.config("node-a", "10.0.0.2:7100"), in_use(true)),
    )
    .await;
    match refused {
        Err(ref error @ PlacementError::NodeNameInUse { ref node, ref address }) => {
            assert_eq!((node.as_str(), address.as_str()), ("node-a", "10.0.0.1:7100"));
            eprintln!("{error}");
        }
        other => panic!("not refused as a name in use: {other:?}"),
    }
    assert!(asked.swap(false, Ordering::SeqCst));
    let members = bounded("listing", first.nodes()).await.expect("nodes");
    assert_eq!(members.len(), 1);
    assert_eq!(members[0].address, "10.0.0.1:7100", "the refused join wrote nothing");

    let second = bounded(
        "a join under a gone node's name",
        EtcdPlacement::join_unless_in_use(etcd.config("node-a", "10.0.0.2:7100"), in_use(false)),
    )
    .await
    .expect("a gone node's name is taken");
    assert!(asked.swap(false, Ordering::SeqCst));
    let members = bounded("listing", first.nodes()).await.expect("nodes");
    assert_eq!(members[0].address, "10.0.0.2:7100");

    let third = bounded(
        "a join at the recorded address",
        EtcdPlacement::join_unless_in_use(
            etcd.config("node-a", "10.0.0.2:7100"),
            |_address: String| -> std::future::Ready<bool> { panic!("asked about its own address") },
        ),
    )
    .await
    .expect("a node at its own recorded address joins");
    for placement in [first, second, third] {
        bounded("leaving", placement.leave()).await.expect("leaves");
    }
}

/// Rounds of the race in `two_joins_under_one_name_at_the_same_moment_have_one_winner`.
const NAME_RACE_ROUNDS: usize = 20;

/// Goal: two joins under one name at the same moment never both succeed: exactly one
/// writes the membership record, the other is refused `NodeNameInUse` naming the
/// winner's address, and the record names the winner. Before, the check was a read
/// and the write a later put: both joins read the same record (or none), both wrote,
/// the later put won the record and both nodes ran under one name. Method: 20 rounds
/// of two `join_unless_in_use` spawned together on a multi-thread runtime, each told
/// that the other contender's address is live; in even rounds the name is free (the
/// last winner left), in odd rounds the last winner's record is still there and
/// counts as gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_joins_under_one_name_at_the_same_moment_have_one_winner() {
    let etcd = TestEtcd::start("probe-name-race").await;
    let mut holder: Option<EtcdPlacement> = None;
    for round in 0..NAME_RACE_ROUNDS {
        let addresses = [format!("10.0.{round}.1:7100"), format!("10.0.{round}.2:7100")];
        if round % 2 == 0 {
            if let Some(last) = holder.take() {
                bounded("the last winner leaving", last.leave()).await.expect("leaves");
            }
        }
        let contenders: Vec<_> = addresses
            .iter()
            .map(|address| {
                let config = etcd.config("node-a", address);
                let live = addresses.clone();
                tokio::spawn(EtcdPlacement::join_unless_in_use(config, move |recorded: String| {
                    std::future::ready(live.contains(&recorded))
                }))
            })
            .collect();
        let mut won = Vec::new();
        let mut refused = Vec::new();
        for (contender, address) in contenders.into_iter().zip(&addresses) {
            match bounded("a racing join", contender).await.expect("the join task ends") {
                Ok(placement) => won.push((placement, address.clone())),
                Err(PlacementError::NodeNameInUse { address: named, .. }) => refused.push((address.clone(), named)),
                Err(other) => panic!("round {round}: a join failed otherwise: {other}"),
            }
        }
        assert_eq!(
            (won.len(), refused.len()),
            (1, 1),
            "round {round}: {} joins won and {} were refused (the won ones at {:?})",
            won.len(),
            refused.len(),
            won.iter().map(|(_, address)| address).collect::<Vec<_>>()
        );
        let (winner, winner_address) = won.pop().expect("one winner");
        let (_, named) = refused.pop().expect("one refused");
        assert_eq!(named, winner_address, "round {round}: the refusal names the winner");
        let members = bounded("listing", winner.nodes()).await.expect("nodes");
        assert_eq!(members.len(), 1, "round {round}");
        assert_eq!(
            members[0].address, winner_address,
            "round {round}: the record names the winner"
        );
        if let Some(last) = holder.replace(winner) {
            bounded("the last winner leaving", last.leave()).await.expect("leaves");
            let members = bounded("listing", holder.as_ref().expect("held").nodes())
                .await
                .expect("nodes");
            assert_eq!(
                members.first().map(|member| member.address.clone()),
                Some(winner_address),
                "round {round}: the old holder's leave took the new record with it"
            );
        }
    }
    if let Some(last) = holder {
        bounded("leaving", last.leave()).await.expect("leaves");
    }
}

/// Goal: a cluster name on one etcd is bound to the store of its first node that names
/// one: a node with another store identity is refused `StoreMismatch` naming the
/// cluster and both identities, and writes nothing; the binding outlives every node.
/// Before, nothing was compared: two deployments sharing a cluster name (each with its
/// own database) joined one cluster and mixed their placements. Method: node-a joins
/// with store-1; node-b with store-2 is refused and is no member; node-c with store-1
/// and node-d with no identity join; all leave; node-e with store-2 is still refused;
/// another cluster name takes store-2; an empty identity is refused before anything is
/// sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_bound_to_one_store_refuses_a_node_of_another() {
    let etcd = TestEtcd::start("probe-store-binding").await;
    let join = |node: &str, identity: Option<&str>| {
        let config = etcd.config(node, &format!("10.0.9.{}:7100", node.len()));
        let config = match identity {
            Some(identity) => config.with_store_identity(identity),
            None => config,
        };
        EtcdPlacement::join(config)
    };
    let a = bounded("node-a joining", join("node-a", Some("store-1")))
        .await
        .expect("the first node binds the cluster to its store");
    match bounded("node-b joining", join("node-b", Some("store-2"))).await {
        Err(
            ref error @ PlacementError::StoreMismatch {
                ref cluster,
                ref recorded,
                ref store,
            },
        ) => {
            assert_eq!((recorded.as_str(), store.as_str()), ("store-1", "store-2"), "{error}");
            let text = error.to_string();
            assert!(
                text.contains(cluster.as_str()) && text.contains("store-1") && text.contains("store-2"),
                "{text}"
            );
            assert!(text.contains("cluster name"), "says what to do: {text}");
            eprintln!("{error}");
        }
        other => panic!("a node of another store was not refused: {other:?}"),
    }
    let members = bounded("listing", a.nodes()).await.expect("nodes");
    assert_eq!(
        members.iter().map(|member| member.node.as_str()).collect::<Vec<_>>(),
        ["node-a"],
        "the refused node is no member"
    );
    let c = bounded("node-c joining", join("node-c", Some("store-1")))
        .await
        .expect("a node of the same store joins");
    let d = bounded("node-d joining", join("node-d", None))
        .await
        .expect("a node that names no store is not checked");
    for placement in [a, c, d] {
        bounded("leaving", placement.leave()).await.expect("leaves");
    }
    assert!(
        matches!(
            bounded("node-e joining", join("node-e", Some("store-2"))).await,
            Err(PlacementError::StoreMismatch { .. })
        ),
        "the binding outlives the nodes"
    );
    let mut other_cluster = etcd.config("node-b", "10.0.9.2:7100").with_store_identity("store-2");
    other_cluster.cluster = format!("{}-other", other_cluster.cluster);
    let b = bounded("node-b joining another cluster", EtcdPlacement::join(other_cluster))
        .await
        .expect("another cluster name takes the other store");
    bounded("leaving", b.leave()).await.expect("leaves");
    assert!(
        matches!(
            bounded("an empty identity", join("node-f", Some(""))).await,
            Err(PlacementError::Config(
                troupe_etcd::ConfigError::BadStoreIdentity { .. }
            ))
        ),
        "an empty identity is refused"
    );
}

/// Actors placed before the compaction in `compaction_under_placements_changes_no_owner_and_no_fence`.
const COMPACTION_ACTORS: usize = 16;

/// Goal: etcd's compaction (an operator runs `etcdctl compact`, or the server's
/// auto-compaction) changes nothing this crate relies on: placements keep their owner
/// and fence (a key's create_revision survives compaction), fences placed after it are
/// larger than every one before, the lease keeps being renewed and a node joins. Method:
/// node-a places 16 actors; etcd is compacted at its current revision (physically);
/// the 16 are looked up again; node-a releases one and node-b places it (new fence
/// larger than all); both hold their leases for one more TTL; node-c joins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compaction_under_placements_changes_no_owner_and_no_fence() {
    let etcd = TestEtcd::start("probe-compaction").await;
    let a = bounded(
        "node-a joining",
        EtcdPlacement::join(etcd.config("node-a", "10.0.8.1:7100")),
    )
    .await
    .expect("node-a joins");
    let b = bounded(
        "node-b joining",
        EtcdPlacement::join(etcd.config("node-b", "10.0.8.2:7100")),
    )
    .await
    .expect("node-b joins");
    let mut placed = Vec::new();
    for index in 0..COMPACTION_ACTORS {
        let target = actor(&format!("k{index}"));
        placed.push(bounded("a place", a.place(&target)).await.expect("placed"));
    }
    let mut client = etcd_client::Client::connect([etcd.endpoint()], None)
        .await
        .expect("an etcd client");
    let revision = client
        .get("/", None)
        .await
        .expect("a read")
        .header()
        .expect("a header")
        .revision();
    client
        .compact(revision, Some(etcd_client::CompactionOptions::new().with_physical()))
        .await
        .expect("etcd compacts");
    for record in &placed {
        let found = bounded("a lookup", b.lookup(&record.actor)).await.expect("lookup");
        assert_eq!(found.as_ref(), Some(record), "after compaction at revision {revision}");
    }
    let moved = placed[0].actor.clone();
    assert!(bounded("a release", a.release(&moved)).await.expect("release"));
    let again = bounded("a place by node-b", b.place(&moved))
        .await
        .expect("node-b places it");
    let newest = placed.iter().map(|record| record.fence).max().expect("fences");
    assert!(
        again.fence > newest,
        "a fence after compaction {:?} is not above {newest:?}",
        again.fence
    );
    tokio::time::sleep(Duration::from_secs(TEST_LEASE_TTL_S)).await;
    assert!(
        a.holds_lease() && b.holds_lease(),
        "the leases are still renewed after compaction"
    );
    let c = bounded(
        "node-c joining",
        EtcdPlacement::join(etcd.config("node-c", "10.0.8.3:7100")),
    )
    .await
    .expect("node-c joins after compaction");
    assert_eq!(bounded("listing", c.nodes()).await.expect("nodes").len(), 3);
    for placement in [a, b, c] {
        bounded("leaving", placement.leave()).await.expect("leaves");
    }
}
