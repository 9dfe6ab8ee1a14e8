//! A node that finds its lease lost while its requests still reach etcd (a one-way
//! cut, a slow return path: etcd's answers held back by the TCP proxy of
//! tests/support/delaying_proxy.rs, the node's bytes let through) stops renewing at
//! once and revokes the lease, so another node can place its actors at once instead of
//! waiting for etcd's TTL to run out after the last keep-alive etcd received — time in
//! which nobody serves them.
//!
//! Each test starts its own etcd (`/usr/bin/etcd`, Debian `etcd-server`) and proxy;
//! node-a reaches etcd only through the proxy, node-b directly. 3 s leases.
//!
//! Run with `cargo nextest run -p troupe-etcd --test real_etcd_lost_lease`.
#![cfg(not(madsim))]

use std::time::Duration;

use tokio::time::Instant;
use troupe_core::ActorId;
use troupe_etcd::{EtcdConfig, EtcdPlacement, LeaseLostReason, NodeId, Placement, PlacementError};

// The connection cut and count are for tests/real_etcd_renewal.rs.
#[allow(dead_code)]
#[path = "support/delaying_proxy.rs"]
mod delaying_proxy;
#[path = "support/etcd_server.rs"]
mod etcd_server;

use delaying_proxy::DelayingProxy;
use etcd_server::{TestEtcd, TEST_LEASE_TTL_S, TEST_REQUEST_TIMEOUT_MS};

/// The request timeout of the writer-loss test, in milliseconds: the largest a 3 s
/// lease accepts. Renewals go every 901 ms; each round may take 999 ms, so the round
/// after a failed one is still in flight when the validity ends.
const LONG_REQUEST_TIMEOUT_MS: u64 = 999;
/// How long after the join returns the proxy starts holding back etcd's answers, in
/// milliseconds: after the join's last answer, before the first renewal.
const PAUSE_AFTER_JOIN_MS: u64 = 500;
/// How long node-a's loss may take after the answers are held back, in milliseconds:
/// the validity (TTL − 1 s slack) plus one request and a loaded machine's delay.
const LOSS_WITHIN_MS: u64 = 4_000;
/// When node-a places an actor in the writer-loss test, after its first held-back
/// renewal reached the proxy, in milliseconds: less than one request of validity is
/// then left, so the placement waits for a renewal and is refused at the validity's end.
const PLACE_AFTER_RENEWAL_MS: u64 = 250;
/// When the held-back answers are let through in the writer-loss test, after the loss,
/// in milliseconds: within the renewal round then in flight (999 ms long).
const RELEASE_AFTER_LOSS_MS: u64 = 200;
/// How long node-b tries to place node-a's actor after the loss, in milliseconds:
/// three TTLs, longer than any lease left to expire by itself.
const TAKEOVER_WATCH_MS: u64 = 3 * TEST_LEASE_TTL_S * 1_000;
/// Pause between two placement attempts of node-b, in milliseconds.
const TAKEOVER_EVERY_MS: u64 = 20;
/// How much later than a bound a test accepts an event on a loaded 2-core machine, in
/// milliseconds.
const SCHEDULING_ALLOWANCE_MS: u64 = 300;

fn actor(key: &str) -> ActorId {
    ActorId::new("counter", key).expect("a valid actor id")
}

/// node-a's configuration, reaching etcd through `proxy`.
fn config_through(proxy: &DelayingProxy, request_timeout_ms: u64) -> EtcdConfig {
    EtcdConfig::new(
        vec![proxy.endpoint()],
        "test",
        NodeId::new("node-a").expect("a valid node name"),
        "node-a.internal:7100",
    )
    .with_lease_ttl_s(TEST_LEASE_TTL_S)
    .with_request_timeout_ms(request_timeout_ms)
}

/// node-a joined through the proxy with `x` placed, node-b joined directly; returns
/// both and when node-a's join returned.
async fn two_nodes(
    etcd: &TestEtcd,
    proxy: &DelayingProxy,
    request_timeout_ms: u64,
    x: &ActorId,
) -> (EtcdPlacement, EtcdPlacement, Instant) {
    let a = EtcdPlacement::join(config_through(proxy, request_timeout_ms))
        .await
        .expect("node-a joins through the proxy");
    let joined = tokio::time::Instant::now();
    let placed = a.place(x).await.expect("node-a places x");
    assert_eq!(placed.owner.as_str(), "node-a");
    let b = EtcdPlacement::join(etcd.config("node-b", "node-b.internal:7100"))
        .await
        .expect("node-b joins directly");
    (a, b, joined)
}

/// node-b places `x` every [`TAKEOVER_EVERY_MS`] until it owns it, for at most
/// [`TAKEOVER_WATCH_MS`] after `lost`; answers how long after `lost` it did, `None` if
/// it never did.
async fn takeover_after(b: &EtcdPlacement, x: &ActorId, lost: Instant) -> Option<Duration> {
    while lost.elapsed() < Duration::from_millis(TAKEOVER_WATCH_MS) {
        match b.place(x).await {
            Ok(record) if record.owner.as_str() == "node-b" => return Some(lost.elapsed()),
            Ok(record) => panic!("node-b's placement named {}", record.owner),
            Err(PlacementError::PlacementConflict { owner, .. }) => assert_eq!(owner.as_str(), "node-a"),
            Err(error) => panic!("node-b placing x: {error}"),
        }
        tokio::time::sleep(Duration::from_millis(TAKEOVER_EVERY_MS)).await;
    }
    None
}

/// Goal: a node whose answers from etcd stop while its requests still reach etcd
/// revokes its lease once it finds it lost, so another node places its actor at once
/// rather than one TTL after the last keep-alive etcd received. Method: 3 s lease,
/// 500 ms requests; node-a (through the proxy) places `x`; the proxy holds back etcd's
/// answers from 0.5 s after node-a's join and never lets them through; node-a's
/// keep-alives still reach etcd. From node-a's `lease_lost` (`NotRenewedInTime`) on,
/// node-b (direct) places `x` every 20 ms: it must own it within one request timeout
/// (the revoke's bound) plus [`SCHEDULING_ALLOWANCE_MS`]. Before the revoke: node-b
/// waited until etcd expired the lease, one TTL after node-a's last keep-alive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_finds_its_lease_lost_revokes_it_and_another_node_takes_its_actor_at_once() {
    let etcd = TestEtcd::start("lost-lease-revoked").await;
    let proxy = DelayingProxy::start(&etcd.endpoint()).await;
    let x = actor("x");
    let (a, b, joined) = two_nodes(&etcd, &proxy, TEST_REQUEST_TIMEOUT_MS, &x).await;

    tokio::time::sleep_until(joined + Duration::from_millis(PAUSE_AFTER_JOIN_MS)).await;
    proxy.pause_answers();
    let paused = tokio::time::Instant::now();
    let reason = tokio::time::timeout(Duration::from_millis(LOSS_WITHIN_MS), a.lease_lost())
        .await
        .unwrap_or_else(|_| panic!("node-a's lease was not lost within {LOSS_WITHIN_MS} ms of the held-back answers"));
    let lost = tokio::time::Instant::now();
    assert_eq!(reason, LeaseLostReason::NotRenewedInTime);

    let waited = takeover_after(&b, &x, lost).await;
    eprintln!(
        "node-a lost its lease {} ms after its join returned ({} ms after the answers were held back); \
         node-b placed x {:?} after the loss",
        (lost - joined).as_millis(),
        (lost - paused).as_millis(),
        waited
    );
    let bound = Duration::from_millis(TEST_REQUEST_TIMEOUT_MS + SCHEDULING_ALLOWANCE_MS);
    match waited {
        Some(waited) => assert!(
            waited <= bound,
            "node-b placed node-a's actor {waited:?} after node-a found its lease lost; \
             the revoke should have freed it within {bound:?}"
        ),
        None => panic!("node-b could not place node-a's actor within {TAKEOVER_WATCH_MS} ms of the loss"),
    }
    assert!(
        matches!(a.place(&actor("y")).await, Err(PlacementError::LeaseExpired { .. })),
        "node-a places nothing under its lost lease"
    );
}

/// Goal: once a placement found the lease lost (at its validity's end, the renewal
/// late), a renewal answered afterwards neither brings the lease back nor keeps it
/// alive on etcd: the keep-alive stops and the lease is revoked, so another node takes
/// the actor at once. Method: 3 s lease, 999 ms requests; node-a places `x`; the proxy
/// holds back etcd's answers from 0.5 s after the join; 250 ms after node-a's first
/// held-back renewal node-a places `y`, which waits and is refused `LeaseExpired`
/// (`NotRenewedInTime`) at the validity's end; 200 ms later the answers are let
/// through, while a renewal round is still in flight. node-b must own `x` within one
/// request timeout plus [`SCHEDULING_ALLOWANCE_MS`] of the refusal, and node-a stays
/// lost. Before the fix the in-flight round's answer was recorded and the keep-alive
/// went on renewing the lost lease: node-b never got `x`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_answered_after_a_placement_found_the_lease_lost_does_not_keep_it_alive() {
    let etcd = TestEtcd::start("lost-lease-late-answer").await;
    let proxy = DelayingProxy::start(&etcd.endpoint()).await;
    let x = actor("x");
    let (a, b, joined) = two_nodes(&etcd, &proxy, LONG_REQUEST_TIMEOUT_MS, &x).await;

    tokio::time::sleep_until(joined + Duration::from_millis(PAUSE_AFTER_JOIN_MS)).await;
    proxy.pause_answers();
    let renewal_seen = proxy
        .next_request(tokio::time::Instant::now() + Duration::from_millis(LOSS_WITHIN_MS))
        .await
        .unwrap_or_else(|| panic!("node-a sent no renewal within {LOSS_WITHIN_MS} ms"));
    tokio::time::sleep_until(renewal_seen + Duration::from_millis(PLACE_AFTER_RENEWAL_MS)).await;
    let refused = a.place(&actor("y")).await;
    let lost = tokio::time::Instant::now();
    match refused {
        Err(PlacementError::LeaseExpired { reason, .. }) => assert_eq!(reason, LeaseLostReason::NotRenewedInTime),
        other => panic!("node-a's placement past its lease's validity must be refused LeaseExpired: {other:?}"),
    }
    // node-b tries from the loss on; the answers are let through meanwhile.
    let release = async {
        tokio::time::sleep_until(lost + Duration::from_millis(RELEASE_AFTER_LOSS_MS)).await;
        proxy.release_answers();
    };
    let (waited, ()) = tokio::join!(takeover_after(&b, &x, lost), release);
    eprintln!(
        "node-a's placement was refused {} ms after its join returned; node-b placed x {:?} after the refusal",
        (lost - joined).as_millis(),
        waited
    );
    let bound = Duration::from_millis(LONG_REQUEST_TIMEOUT_MS + SCHEDULING_ALLOWANCE_MS);
    match waited {
        Some(waited) => assert!(
            waited <= bound,
            "node-b placed node-a's actor {waited:?} after node-a found its lease lost; \
             the revoke should have freed it within {bound:?}"
        ),
        None => panic!(
            "node-b could not place node-a's actor within {TAKEOVER_WATCH_MS} ms of node-a's loss: \
             etcd still holds node-a's lease (node-a holds it: {})",
            a.holds_lease()
        ),
    }
    assert!(!a.holds_lease(), "a lost lease stays lost after a late answer");
}
