//! Goal: however a `ClusterNode` ends (dropped, `leave`, `abandon`), it frees its
//! runtime and all it holds once it has served calls in both directions: its own
//! actors called from the other node, and the other node's actors called from it. An
//! embedder that restarts a node in one process must not keep the old one in memory.
//! The other node goes on serving, and takes over the ended node's actors.
//!
//! Method: two nodes on a real etcd (Debian `etcd-server`, started per test on
//! loopback) and one SQLite file. The test keeps only a `WeakRuntimeHandle` of the node
//! it ends; within `RELEASE_WAIT_MS` of the end that handle must no longer reach the
//! runtime (a reference cycle or a task left running would keep it for good).
//!
//! Run with `cargo nextest run -p troupe-cluster --test cluster_node_end`.
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
use troupe_cluster::ClusterNode;
use troupe_core::ActorId;

/// Each call's timeout (ms).
const CALL_TIMEOUT_MS: u64 = 5_000;
/// How long the ended node's runtime gets to be freed (ms).
const RELEASE_WAIT_MS: u64 = 5_000;
/// How often the test looks meanwhile (ms).
const POLL_MS: u64 = 10;

/// How the test ends node A.
#[derive(Debug, Clone, Copy)]
enum End {
    Drop,
    Leave,
    Abandon,
}

async fn call(node: &ClusterNode, actor: &ActorId) -> Result<(String, u64), troupe_core::InvokeError> {
    let deadline = node.handle().deadline_in(Duration::from_millis(CALL_TIMEOUT_MS));
    node.invoke(actor, Bytes::from_static(b"inc"), deadline)
        .await
        .map(|reply| parse_reply(&reply))
}

async fn node_ends_and_is_freed(end: End, name: &str) {
    let etcd = TestEtcd::start(name).await;
    let directory = tempfile::tempdir().expect("a directory");
    let path = directory.path().join("state.db");
    let mut nodes = start_counter_nodes(&["node-a", "node-b"], |node| etcd.config(node, ""), &path).await;
    let b = nodes.pop().unwrap();
    let a = nodes.pop().unwrap();
    let (on_a, on_b) = (counter("on-a"), counter("on-b"));
    // Each actor is activated where it is first called, then called from the other node.
    assert_eq!(call(&a, &on_a).await.unwrap(), ("node-a".to_string(), 1));
    assert_eq!(call(&b, &on_b).await.unwrap(), ("node-b".to_string(), 1));
    assert_eq!(call(&b, &on_a).await.unwrap(), ("node-a".to_string(), 2));
    assert_eq!(call(&a, &on_b).await.unwrap(), ("node-b".to_string(), 2));

    let weak = a.handle().downgrade();
    match end {
        End::Drop => drop(a),
        End::Leave => a.leave().await.expect("node A leaves"),
        End::Abandon => a.abandon().await,
    }
    let deadline = tokio::time::Instant::now() + Duration::from_millis(RELEASE_WAIT_MS);
    while weak.upgrade().is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{RELEASE_WAIT_MS} ms after node A ended ({end:?}), its runtime is still alive: something it \
             owns (a task, or a cycle through its routing) keeps it"
        );
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }

    // B goes on, and takes A's actor over once A's placement is gone (at once after a
    // leave, one lease later otherwise), with the count A committed.
    let bound = Duration::from_secs(TEST_LEASE_TTL_S * 3);
    let started = tokio::time::Instant::now();
    let served = loop {
        match call(&b, &on_a).await {
            Ok(served) => break served,
            Err(error) => {
                // Transient, and not a fenced turn (transient too since 2026-12-06):
                // the callers' node claims afresh, so none of its turns is fenced.
                assert!(
                    error.is_transient() && !matches!(error, troupe_core::InvokeError::StorageFailed { .. }),
                    "only transient errors while A's actor moves: {error}"
                );
                assert!(
                    started.elapsed() < bound,
                    "B did not take A's actor over within {bound:?}: {error}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    assert_eq!(served, ("node-b".to_string(), 3), "A's actor moves to B with its count");
    assert_eq!(call(&b, &on_b).await.unwrap(), ("node-b".to_string(), 3));
    b.leave().await.expect("node B leaves");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_node_frees_its_runtime() {
    node_ends_and_is_freed(End::Drop, "node-end-drop").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_left_frees_its_runtime() {
    node_ends_and_is_freed(End::Leave, "node-end-leave").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_node_frees_its_runtime() {
    node_ends_and_is_freed(End::Abandon, "node-end-abandon").await;
}
