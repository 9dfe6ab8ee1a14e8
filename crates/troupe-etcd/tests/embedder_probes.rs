//! `EtcdPlacement` probed as an embedder runs it: against a real etcd (Debian
//! `etcd-server`, started per test on loopback), with an etcd member down among the
//! endpoints. Every await is bounded.
//!
//! Run with `cargo nextest run -p troupe-etcd --test embedder_probes`.
#![cfg(not(madsim))]

use std::time::Duration;

use tokio::time::Instant;
use troupe_core::ActorId;
use troupe_etcd::{EtcdPlacement, Placement};

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
