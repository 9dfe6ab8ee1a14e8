//! Goal: `PlacedStore::check_fence` (what a turn asks before it acts outside the store,
//! and what a commit would find first) answers `NotOwner` for a placed actor on a node
//! that may no longer serve (its lease is lost), without asking the store behind it,
//! and otherwise forwards to that store, whose answer comes back unchanged.
//!
//! Method: one node on a real etcd (Debian `etcd-server`, started per test on loopback)
//! over a `MemoryStore` the test keeps a handle on; a counter activated there; its fence
//! read from etcd. While the node serves, the current fence is `Ok` and an older one
//! the store's `Fenced`; once the node is abandoned (its lease counted lost at once),
//! the current fence is `NotOwner`, though the store behind it still holds that fence
//! (asked directly, it says `Ok`).
//!
//! Run with `cargo nextest run -p troupe-cluster --test placed_store_fence`.
#![cfg(not(madsim))]

#[path = "../../troupe-etcd/tests/support/etcd_server.rs"]
mod etcd_server;
#[allow(dead_code)]
#[path = "support/counter.rs"]
mod support;

use std::time::Duration;

use bytes::Bytes;
use etcd_server::TestEtcd;
use support::{counter, counter_runtime, parse_reply};
use troupe_cluster::ClusterNode;
use troupe_etcd::Placement;
use troupe_runtime::{Fence, MemoryStore, StateStore, StoreError};

/// Each call's timeout, in milliseconds.
const CALL_TIMEOUT_MS: u64 = 5_000;

/// Goal and method: see the module documentation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_fence_refuses_a_placed_actor_once_the_lease_is_lost_and_forwards_otherwise() {
    let etcd = TestEtcd::start("placed-store-fence").await;
    let memory = MemoryStore::default();
    let node = ClusterNode::start(
        etcd.config("node-a", ""),
        "127.0.0.1:0".parse().expect("an address"),
        counter_runtime("node-a"),
        memory.clone(),
    )
    .await
    .expect("start node-a");
    let x = counter("x");
    let deadline = node.handle().deadline_in(Duration::from_millis(CALL_TIMEOUT_MS));
    let reply = node
        .invoke(&x, Bytes::from_static(b"inc"), deadline)
        .await
        .expect("node-a serves x");
    assert_eq!(parse_reply(&reply), ("node-a".to_string(), 1));
    let fence = node
        .placement()
        .lookup(&x)
        .await
        .expect("etcd answers")
        .expect("x is placed")
        .fence;
    let store = std::sync::Arc::clone(node.handle().store());

    // Serving: forwarded to the store, whose answer comes back unchanged.
    assert_eq!(store.check_fence(&x, fence).await, Ok(()), "the current fence");
    let older = memory_older_fence(&memory, &x, fence).await;
    match store.check_fence(&x, older).await {
        Err(StoreError::Fenced { held, current, .. }) => {
            assert_eq!((held, current), (older, Some(fence)), "the store's own answer");
        }
        other => panic!("an older fence is the store's Fenced: {other:?}"),
    }

    // The lease is lost (abandoned: counted lost at once): refused here, the store not
    // asked, though it still holds the fence.
    node.abandon().await;
    match store.check_fence(&x, fence).await {
        Err(StoreError::NotOwner { actor, owner: None }) => assert_eq!(actor, x),
        other => panic!("a node that may no longer serve answers NotOwner: {other:?}"),
    }
    assert_eq!(
        memory.check_fence(&x, fence).await,
        Ok(()),
        "the store behind it still holds the fence: the refusal is the node's"
    );
}

/// A fence older than `current` for `actor` in `memory`: claims one a revision later
/// would be refused; `Fence` values are etcd revisions here, so `current - 1` is older.
async fn memory_older_fence(memory: &MemoryStore, actor: &troupe_core::ActorId, current: Fence) -> Fence {
    let older = Fence::from_token(current.token() - 1).expect("an older fence");
    assert!(older < current);
    // The store does not hold it: its check refuses it.
    assert!(memory.check_fence(actor, older).await.is_err());
    older
}
