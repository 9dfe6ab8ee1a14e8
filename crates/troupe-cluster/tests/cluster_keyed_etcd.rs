//! Goal: on real etcd, a keyed request in flight when its owner crashes is sent again by
//! the calling node's router by itself until the actor is placed anew (once the crashed
//! owner's lease has ended), and is answered there with its effect counted once; an
//! unkeyed one ends `Unreachable` (it may have run, so it is not sent again).
//!
//! Method: two `ClusterNode`s on a real etcd (Debian `etcd-server`, started per test on
//! loopback) and one SQLite file, on tokio's multi-thread runtime. The counter is placed
//! on node B; node A sends it `slow@node-b` (a turn that sleeps there before counting)
//! through `ClusterClient::invoke_keyed` (or `ClusterClient::invoke`, the control), and
//! node B is abandoned as a crash is (it stops serving and committing at once; its lease
//! is left to expire) while that turn sleeps.
//!
//! Run with `cargo nextest run -p troupe-cluster --test cluster_keyed_etcd`.
#![cfg(not(madsim))]

#[path = "../../troupe-etcd/tests/support/etcd_server.rs"]
mod etcd_server;
#[allow(dead_code)]
#[path = "support/counter.rs"]
mod support;

use std::time::Duration;

use bytes::Bytes;
use etcd_server::{TestEtcd, TEST_LEASE_TTL_S};
use support::{counter, parse_reply, start_counter_nodes};
use troupe_core::InvokeError;
use troupe_runtime::IdempotencyKey;

/// A quick call's timeout, in milliseconds.
const CALL_TIMEOUT_MS: u64 = 5_000;
/// When node B is abandoned after node A sent the slow request, in milliseconds: the
/// request has reached B and its turn sleeps (for `support::SLOW_TURN_MS`).
const ABANDON_AFTER_MS: u64 = 500;

/// The slow request's outcome, sent keyed or not, when its owner crashes mid-turn; and
/// node A's count of keyed retries.
async fn a_request_whose_owner_crashes(name: &str, keyed: bool) -> (Result<(String, u64), InvokeError>, u64) {
    let etcd = TestEtcd::start(name).await;
    let directory = tempfile::tempdir().expect("a directory");
    let path = directory.path().join("state.db");
    let mut nodes = start_counter_nodes(&["node-a", "node-b"], |node| etcd.config(node, ""), &path).await;
    let b = nodes.pop().unwrap();
    let a = nodes.pop().unwrap();
    let actor = counter("on-b");
    let deadline = b.handle().deadline_in(Duration::from_millis(CALL_TIMEOUT_MS));
    let placed = b.invoke(&actor, Bytes::from_static(b"inc"), deadline).await;
    assert_eq!(parse_reply(&placed.expect("placed on B")), ("node-b".to_string(), 1));

    // Long enough for B's lease to end and the actor to be placed anew on A.
    let timeout = Duration::from_secs(TEST_LEASE_TTL_S * 4);
    let client = a.client();
    let request = tokio::spawn({
        let actor = actor.clone();
        async move {
            let deadline = client.deadline_in(timeout);
            let payload = Bytes::from_static(b"slow@node-b");
            let reply = if keyed {
                let key = IdempotencyKey::new("order-17").expect("a key");
                client.invoke_keyed(&actor, &key, payload, deadline).await
            } else {
                client.invoke(&actor, payload, deadline).await
            };
            reply.map(|reply| parse_reply(&reply))
        }
    });
    tokio::time::sleep(Duration::from_millis(ABANDON_AFTER_MS)).await;
    b.abandon().await;
    let outcome = request.await.expect("the request's task");
    let retries = a.stats().keyed_retries;
    a.leave().await.expect("node A leaves");
    (outcome, retries)
}

/// Goal: keyed, the request is answered by the actor placed anew on A, counted once
/// (B's turn never committed). Method: its reply and node A's keyed retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_request_outlives_its_owners_crash() {
    let (outcome, retries) = a_request_whose_owner_crashes("keyed-owner-crash", true).await;
    assert_eq!(
        outcome.expect("sent again until a new owner answered"),
        ("node-a".to_string(), 2),
        "placed anew on A, counted once"
    );
    assert!(retries >= 1, "node A sent it again ({retries} keyed retries)");
}

/// Goal: the control: unkeyed, the caller hears `Unreachable` at once and nothing is
/// sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unkeyed_request_whose_owner_crashes_ends_unreachable() {
    let (outcome, retries) = a_request_whose_owner_crashes("unkeyed-owner-crash", false).await;
    assert!(matches!(outcome, Err(InvokeError::Unreachable { .. })), "{outcome:?}");
    assert_eq!(retries, 0);
}

/// Goal: on real etcd, `ClusterClient::tell_keyed` sent three times with one key (twice
/// through node A, once through node B, the owner) lands once on the owner, and an
/// unkeyed `ClusterClient::tell` lands as well. Method: the count an `inc` sent through
/// A behind the tells replies: 1 placed + 1 keyed + 1 unkeyed + itself = 4 (6 if the
/// key were dropped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_keyed_tell_sent_through_both_nodes_lands_once_on_the_owner() {
    let etcd = TestEtcd::start("keyed-tell").await;
    let directory = tempfile::tempdir().expect("a directory");
    let path = directory.path().join("state.db");
    let mut nodes = start_counter_nodes(&["node-a", "node-b"], |node| etcd.config(node, ""), &path).await;
    let b = nodes.pop().unwrap();
    let a = nodes.pop().unwrap();
    let actor = counter("told-on-b");
    let deadline = || b.handle().deadline_in(Duration::from_millis(CALL_TIMEOUT_MS));
    let placed = b.invoke(&actor, Bytes::from_static(b"inc"), deadline()).await;
    assert_eq!(parse_reply(&placed.expect("placed on B")), ("node-b".to_string(), 1));

    let key = IdempotencyKey::new("deposit-21").expect("a key");
    for client in [a.client(), a.client(), b.client()] {
        client
            .tell_keyed(&actor, &key, Bytes::from_static(b"inc"), deadline())
            .await
            .expect("accepted by B");
    }
    a.client()
        .tell(&actor, Bytes::from_static(b"inc"), deadline())
        .await
        .expect("accepted by B");
    let behind = a.client().invoke(&actor, Bytes::from_static(b"inc"), deadline()).await;
    assert_eq!(
        parse_reply(&behind.expect("an inc behind the tells")),
        ("node-b".to_string(), 4),
        "the keyed tell landed once, the unkeyed one too"
    );
    a.leave().await.expect("node A leaves");
    b.leave().await.expect("node B leaves");
}
