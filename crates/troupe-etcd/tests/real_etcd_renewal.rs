//! The lease's late-renewal wait and its failed-round retry against a real etcd
//! (`/usr/bin/etcd`, Debian `etcd-server`), through a TCP proxy on 127.0.0.1 that holds
//! back etcd's answers or cuts the connections (tests/support/delaying_proxy.rs). The
//! simulator shows the same in tests/simulated_etcd.rs; these show that the real
//! `etcd-client` over real gRPC/HTTP2 (a stalled stream, a reset connection) behaves so.
//!
//! Each test starts its own etcd and proxy; the node under test reaches etcd only
//! through the proxy, a second node (where one is needed) directly. 3 s leases: each
//! test takes a few seconds.
//!
//! Run with `cargo nextest run -p troupe-etcd --test real_etcd_renewal`.
#![cfg(not(madsim))]

use std::time::Duration;

use tokio::time::Instant;
use troupe_core::ActorId;
use troupe_etcd::{EtcdConfig, EtcdPlacement, LeaseLostReason, NodeId, Placement, PlacementError, PlacementRecord};

#[path = "support/delaying_proxy.rs"]
mod delaying_proxy;
#[path = "support/etcd_server.rs"]
mod etcd_server;

use delaying_proxy::DelayingProxy;
use etcd_server::{TestEtcd, TEST_LEASE_TTL_S, TEST_REQUEST_TIMEOUT_MS};

/// The request timeout of the late-renewal tests, in milliseconds: the largest a 3 s
/// lease accepts (the CI cluster tests' setting). Renewals go every 901 ms (TTL − 1 s
/// slack − request − 100 ms headroom); one leaves 2 s of validity after it was sent.
const LATE_RENEWAL_REQUEST_TIMEOUT_MS: u64 = 999;
/// The renewal interval with [`LATE_RENEWAL_REQUEST_TIMEOUT_MS`], in milliseconds:
/// TTL − slack − request − headroom = 901 ms, sooner than TTL/3.
const LATE_RENEWAL_INTERVAL_MS: u64 = TEST_LEASE_TTL_S * 1_000
    - troupe_etcd::ETCD_LEASE_EXPIRY_SLACK_MS
    - LATE_RENEWAL_REQUEST_TIMEOUT_MS
    - troupe_etcd::ETCD_RENEWAL_HEADROOM_MS;
/// How long after the join returns the proxy starts holding back etcd's answers, in
/// milliseconds: after the join's last answer, before the first renewal (901 ms after
/// the grant was sent).
const PAUSE_AFTER_JOIN_MS: u64 = 500;
/// How long the first renewal after the pause may take to show up at the proxy, in
/// milliseconds (901 ms after the grant at most, plus a loaded machine's delay).
const RENEWAL_SEEN_WITHIN_MS: u64 = 3_000;
/// When the node places an actor, after its first renewal reached the proxy, in
/// milliseconds: that renewal was sent 901 ms or more after the grant, so the grant's
/// 2 s of validity leave at most 849 ms, less than one request (999 ms).
const PLACE_AFTER_RENEWAL_MS: u64 = 250;
/// When the held-back answers are let through, after the renewal reached the proxy, in
/// milliseconds: within the renewal round's 999 ms and before the grant's validity
/// (1,099 ms after the renewal at the latest) ends.
const RELEASE_AFTER_RENEWAL_MS: u64 = 500;
/// How much later than a bound a test checks an event may come on a loaded 2-core
/// machine, in milliseconds.
const SCHEDULING_ALLOWANCE_MS: u64 = 300;
/// How long the failed-round test watches the lease after the cut, in milliseconds:
/// two TTLs, so several renewals on the new connection must land.
const WATCH_AFTER_CUT_MS: u64 = 2 * TEST_LEASE_TTL_S * 1_000;
/// Pause between two looks at the lease in the failed-round test, in milliseconds.
const WATCH_EVERY_MS: u64 = 20;

fn actor(key: &str) -> ActorId {
    ActorId::new("counter", key).expect("a valid actor id")
}

/// A node's configuration reaching etcd at `endpoint`: the tests' 3 s lease and the
/// given request timeout.
fn config(endpoint: String, node: &str, request_timeout_ms: u64) -> EtcdConfig {
    EtcdConfig::new(
        vec![endpoint],
        "test",
        NodeId::new(node).expect("a valid node name"),
        format!("{node}.internal:7100"),
    )
    .with_lease_ttl_s(TEST_LEASE_TTL_S)
    .with_request_timeout_ms(request_timeout_ms)
}

/// A node joined through `proxy`; returns it with when its join started and returned.
/// The keep-alive sends its first renewal as the join ends, then one every interval.
async fn join_through(proxy: &DelayingProxy, request_timeout_ms: u64) -> (EtcdPlacement, Instant, Instant) {
    let started = tokio::time::Instant::now();
    let placement = EtcdPlacement::join(config(proxy.endpoint(), "node-a", request_timeout_ms))
        .await
        .expect("node-a joins through the proxy");
    (placement, started, tokio::time::Instant::now())
}

/// Holds back etcd's answers [`PAUSE_AFTER_JOIN_MS`] after `joined` and waits for the
/// node's first renewal to reach the proxy (its answer held back); returns when it did.
async fn hold_back_the_first_renewal(proxy: &DelayingProxy, joined: Instant) -> Instant {
    tokio::time::sleep_until(joined + Duration::from_millis(PAUSE_AFTER_JOIN_MS)).await;
    proxy.pause_answers();
    let deadline = tokio::time::Instant::now() + Duration::from_millis(RENEWAL_SEEN_WITHIN_MS);
    proxy
        .next_request(deadline)
        .await
        .unwrap_or_else(|| panic!("the node sent no renewal within {RENEWAL_SEEN_WITHIN_MS} ms"))
}

/// Places `actor` in a task of its own; answers the outcome and when it came.
fn place_in_task(
    placement: &EtcdPlacement,
    actor: &ActorId,
) -> tokio::task::JoinHandle<(Result<PlacementRecord, PlacementError>, Instant)> {
    let (placement, actor) = (placement.clone(), actor.clone());
    tokio::spawn(async move {
        let outcome = placement.place(&actor).await;
        (outcome, tokio::time::Instant::now())
    })
}

/// Goal: against a real etcd, a node whose renewal's answer is held back until less
/// than one request of validity is left places an actor once the answer arrives,
/// instead of refusing. Method: 3 s lease, 999 ms requests, the node behind the proxy;
/// the proxy holds back etcd's answers from 0.5 s after the join, the node's first
/// renewal reaches etcd (its answer held); 250 ms later (at most 849 ms of validity
/// left) the node places `x`; 500 ms after the renewal the proxy lets the answers
/// through. The placement succeeds after the release, having waited
/// (`late_renewal_waits` is 1), and the node holds its lease. Before the wait (before
/// eb4c677) it was refused at once: `EtcdUnavailable` "the lease's
/// last confirmed renewal leaves ... ms, less than one request (999 ms)".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placement_waits_for_a_held_back_renewal_and_succeeds_once_its_answer_arrives() {
    let etcd = TestEtcd::start("renewal-held-back").await;
    let proxy = DelayingProxy::start(&etcd.endpoint()).await;
    let (placement, _join_started, joined) = join_through(&proxy, LATE_RENEWAL_REQUEST_TIMEOUT_MS).await;
    let renewal_seen = hold_back_the_first_renewal(&proxy, joined).await;
    let x = actor("x");

    tokio::time::sleep_until(renewal_seen + Duration::from_millis(PLACE_AFTER_RENEWAL_MS)).await;
    let placing = place_in_task(&placement, &x);
    tokio::time::sleep_until(renewal_seen + Duration::from_millis(RELEASE_AFTER_RENEWAL_MS)).await;
    let released = tokio::time::Instant::now();
    proxy.release_answers();
    let (placed, answered) = placing.await.expect("the placing task");
    eprintln!(
        "renewal reached the proxy {} ms after the join returned; the placement was answered {} ms after the release",
        (renewal_seen - joined).as_millis(),
        (answered - released).as_millis()
    );
    let record = match placed {
        Ok(record) => record,
        Err(error) => panic!("the placement must wait for the held-back renewal and succeed: {error}"),
    };
    assert_eq!(record.owner.as_str(), "node-a");
    assert!(answered >= released, "answered before etcd's answers were let through");
    assert_eq!(
        placement.late_renewal_waits(),
        1,
        "the placement waited for the renewal"
    );
    assert!(placement.holds_lease(), "the renewed lease is held");
    let looked_up = placement.lookup(&x).await.expect("a lookup").expect("x is placed");
    assert_eq!(looked_up.owner.as_str(), "node-a");
}

/// Goal: against a real etcd, a placement waiting for a renewal whose answer is held
/// back past the lease's validity is refused `LeaseExpired` at the validity's end: not
/// before it, not much after it, and nothing is placed afterwards. Method: as the test
/// above, but the answers stay held back until 0.5 s after the refusal. The last
/// confirmed renewal is the one the keep-alive sends as it starts, at the join's end:
/// sent after the join started and [`LATE_RENEWAL_INTERVAL_MS`] or more before the
/// renewal the proxy saw, so the validity (TTL − 1 s slack after it) ends no earlier
/// than 2 s after the join started and no later than 2 s − 901 ms after that renewal;
/// the refusal must come in between (plus [`SCHEDULING_ALLOWANCE_MS`] at the end).
/// After the release the node's next placement is refused `LeaseExpired` too, and `x`
/// was never placed: a node reaching etcd directly finds it free and places it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placement_waiting_for_a_renewal_held_back_past_the_leases_validity_is_refused_at_its_end() {
    let etcd = TestEtcd::start("renewal-held-past-validity").await;
    let proxy = DelayingProxy::start(&etcd.endpoint()).await;
    let (placement, join_started, joined) = join_through(&proxy, LATE_RENEWAL_REQUEST_TIMEOUT_MS).await;
    let renewal_seen = hold_back_the_first_renewal(&proxy, joined).await;
    let x = actor("x");

    tokio::time::sleep_until(renewal_seen + Duration::from_millis(PLACE_AFTER_RENEWAL_MS)).await;
    let (refused, answered) = place_in_task(&placement, &x).await.expect("the placing task");
    let validity =
        Duration::from_secs(TEST_LEASE_TTL_S) - Duration::from_millis(troupe_etcd::ETCD_LEASE_EXPIRY_SLACK_MS);
    eprintln!(
        "refused {} ms after the join started; the validity ended between {} and {} ms after it started",
        (answered - join_started).as_millis(),
        validity.as_millis(),
        (renewal_seen + validity - Duration::from_millis(LATE_RENEWAL_INTERVAL_MS) - join_started).as_millis()
    );
    match refused {
        Err(PlacementError::LeaseExpired { reason, .. }) => assert_eq!(reason, LeaseLostReason::NotRenewedInTime),
        other => panic!("a placement past the lease's validity must be refused LeaseExpired: {other:?}"),
    }
    assert!(
        answered >= join_started + validity,
        "refused {:?} after the join started, before the lease's validity could end",
        answered - join_started
    );
    let latest_end = renewal_seen + validity - Duration::from_millis(LATE_RENEWAL_INTERVAL_MS);
    assert!(
        answered <= latest_end + Duration::from_millis(SCHEDULING_ALLOWANCE_MS),
        "refused {:?} after the lease's validity ended at the latest",
        answered - latest_end
    );
    assert!(!placement.holds_lease(), "the lease counts as lost once refused");

    tokio::time::sleep(Duration::from_millis(RELEASE_AFTER_RENEWAL_MS)).await;
    proxy.release_answers();
    let again = placement.place(&x).await;
    assert!(
        matches!(again, Err(PlacementError::LeaseExpired { .. })),
        "a node whose lease was lost places nothing, even with etcd answering again: {again:?}"
    );
    let other = EtcdPlacement::join(etcd.config("node-b", "node-b.internal:7100"))
        .await
        .expect("node-b joins directly");
    assert_eq!(
        other.lookup(&x).await.expect("a lookup by node-b"),
        None,
        "node-a's refused placements never reached etcd"
    );
    let taken = other.place(&x).await.expect("node-b places x");
    assert_eq!(taken.owner.as_str(), "node-b", "x is free for another node at once");
}

/// Goal: against a real etcd, a renewal round that fails is followed by another at
/// once, and when the connection is cut under that one it is sent again on a new
/// connection and the lease is kept. Method: 3 s lease, 500 ms requests (renewals every
/// 1 s, 2 s of validity after each); the proxy holds back etcd's answers from 0.5 s
/// after the join, so the first renewal's round gets no answer and fails after 500 ms;
/// the node's next bytes to etcd (the failed stream's reset and the next round) must
/// reach the proxy within 500 ms + [`SCHEDULING_ALLOWANCE_MS`] of that renewal; 100 ms
/// after them the proxy cuts every connection (the held answers are lost) and lets
/// answers through again. From then on, for two TTLs, the node holds its lease at every
/// look (every 20 ms) and places an actor at each; the proxy accepted a new
/// connection; the lease is the join's. Before the retry at once (before 9b4304c) the
/// next round was due one interval after the failed one was sent, when the validity
/// ended: the lease was lost `NotRenewedInTime`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_renewal_round_is_retried_at_once_on_a_new_connection_and_the_lease_kept() {
    let etcd = TestEtcd::start("renewal-connection-cut").await;
    let proxy = DelayingProxy::start(&etcd.endpoint()).await;
    let (placement, _join_started, joined) = join_through(&proxy, TEST_REQUEST_TIMEOUT_MS).await;
    let lease = placement.lease();
    let first_round = hold_back_the_first_renewal(&proxy, joined).await;
    let retry_deadline = first_round + Duration::from_millis(TEST_REQUEST_TIMEOUT_MS + SCHEDULING_ALLOWANCE_MS);
    let second_round = proxy.next_request(retry_deadline).await.unwrap_or_else(|| {
        panic!(
            "the node sent nothing within {} ms of the renewal whose answer was held back (holds the lease: {})",
            TEST_REQUEST_TIMEOUT_MS + SCHEDULING_ALLOWANCE_MS,
            placement.holds_lease()
        )
    });
    eprintln!(
        "the first renewal reached the proxy {} ms after the join returned, the node's next bytes {} ms after it",
        (first_round - joined).as_millis(),
        (second_round - first_round).as_millis()
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    let connections_before = proxy.accepted();
    proxy.cut_connections();
    proxy.release_answers();
    let cut = tokio::time::Instant::now();

    let mut placed = 0_u32;
    while cut.elapsed() < Duration::from_millis(WATCH_AFTER_CUT_MS) {
        assert!(
            placement.holds_lease(),
            "the lease was lost {:?} after the cut: {:?}",
            cut.elapsed(),
            tokio::time::timeout(Duration::from_millis(1), placement.lease_lost()).await
        );
        let placing = tokio::time::Instant::now();
        let record = placement
            .place(&actor(&format!("after-cut-{placed}")))
            .await
            .unwrap_or_else(|error| panic!("placing {:?} after the cut: {error}", cut.elapsed()));
        assert_eq!(record.owner.as_str(), "node-a");
        if placed == 0 {
            eprintln!(
                "the first placement after the cut took {} ms",
                placing.elapsed().as_millis()
            );
        }
        placed += 1;
        tokio::time::sleep(Duration::from_millis(WATCH_EVERY_MS)).await;
    }
    eprintln!(
        "{placed} placements in {WATCH_AFTER_CUT_MS} ms after the cut, {} waited for a renewal; {} connections accepted",
        placement.late_renewal_waits(),
        proxy.accepted()
    );
    assert!(
        proxy.accepted() > connections_before,
        "the node did not reconnect after the cut"
    );
    assert_eq!(placement.lease(), lease, "the join's lease was kept, not replaced");
}
