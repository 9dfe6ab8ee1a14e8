//! Goal: a cluster node tells, without activating an actor, whether another node owns it
//! right now (`RuntimeHandle::placed_elsewhere`, through the node's root router: the
//! question the agent layer's resumes ask before waking an actor with a local tell), from
//! etcd, not from its route cache; it says it does not know when etcd does not answer;
//! a runtime without a router answers `false` at once.
//!
//! Method: two nodes on a real etcd (Debian `etcd-server`, started per test on
//! loopback) and one SQLite file; counters activated where they are first called.
//!
//! Run with `cargo nextest run -p troupe-cluster --test cluster_placed_elsewhere_etcd`.
#![cfg(not(madsim))]

#[path = "../../troupe-etcd/tests/support/etcd_server.rs"]
mod etcd_server;
#[allow(dead_code)]
#[path = "support/counter.rs"]
mod support;

use std::time::Duration;

use bytes::Bytes;
use etcd_server::{TestEtcd, TEST_REQUEST_TIMEOUT_MS};
use support::{counter, parse_reply, start_counter_nodes};
use tokio::time::Instant;
use troupe_cluster::ClusterNode;
use troupe_core::{ActorId, InvokeError};
use troupe_etcd::Placement;

/// Each call's timeout, in milliseconds.
const CALL_TIMEOUT_MS: u64 = 5_000;
/// Allowance for a loaded 2-core machine on top of a bound a test checks, in ms.
const SCHEDULING_ALLOWANCE_MS: u64 = 2_000;
/// Pause between polls, in milliseconds.
const POLL_MS: u64 = 20;

async fn call(node: &ClusterNode, actor: &ActorId) -> (String, u64) {
    let deadline = node.handle().deadline_in(Duration::from_millis(CALL_TIMEOUT_MS));
    let reply = node
        .invoke(actor, Bytes::from_static(b"inc"), deadline)
        .await
        .unwrap_or_else(|error| panic!("{actor}: {error}"));
    parse_reply(&reply)
}

/// Where `node` says `actor` is: `Ok(true)` if on another node.
async fn elsewhere(node: &ClusterNode, actor: &ActorId) -> Result<bool, InvokeError> {
    node.handle().placed_elsewhere(actor).await
}

/// Goal: the owner says `false` and the other node `true` for a placed actor; both
/// `false` for an actor placed nowhere; and, once the owner has released the actor, the
/// other node says `false` though its route cache still names the old owner (a stale
/// route must not keep an actor from being resumed where it is free). A runtime with no
/// router says `false`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_tells_from_etcd_whether_another_node_owns_an_actor() {
    let etcd = TestEtcd::start("placed-elsewhere").await;
    let directory = tempfile::tempdir().expect("a directory");
    let path = directory.path().join("state.db");
    let nodes = start_counter_nodes(&["node-a", "node-b"], |node| etcd.config(node, ""), &path).await;
    let (a, b) = (&nodes[0], &nodes[1]);
    let (on_a, nowhere) = (counter("on-a"), counter("nowhere"));
    assert_eq!(call(a, &on_a).await, ("node-a".to_string(), 1));
    // Through B: B's route cache now names node-a for it.
    assert_eq!(call(b, &on_a).await, ("node-a".to_string(), 2));

    assert_eq!(elsewhere(a, &on_a).await, Ok(false), "A owns it");
    assert_eq!(elsewhere(b, &on_a).await, Ok(true), "A owns it, B asks");
    assert_eq!(elsewhere(a, &nowhere).await, Ok(false), "placed nowhere, A asks");
    assert_eq!(elsewhere(b, &nowhere).await, Ok(false), "placed nowhere, B asks");
    let activations = b.handle().counters().activations_started;
    assert_eq!(activations, 0, "asking activated nothing on B");

    // A releases it (deactivation ends its placement); B's cached route is stale.
    assert!(a.handle().deactivate(&on_a).await.expect("deactivate"));
    let released = Instant::now();
    while a.placement().lookup(&on_a).await.expect("lookup").is_some() {
        assert!(
            released.elapsed() < Duration::from_millis(SCHEDULING_ALLOWANCE_MS),
            "the placement was not released"
        );
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
    assert_eq!(
        elsewhere(b, &on_a).await,
        Ok(false),
        "released: B reads etcd, not its cached route to A"
    );

    let single = troupe_runtime::Runtime::builder().start();
    assert_eq!(
        single.handle().placed_elsewhere(&on_a).await,
        Ok(false),
        "no router: nothing is placed elsewhere"
    );
}

/// Goal: with etcd down, a node does not claim to know: `Unreachable` naming the actor,
/// within the etcd request timeout (and the machine's allowance).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_cannot_reach_etcd_does_not_say_where_an_actor_is() {
    let mut etcd = TestEtcd::start("placed-elsewhere-down").await;
    let directory = tempfile::tempdir().expect("a directory");
    let path = directory.path().join("state.db");
    let nodes = start_counter_nodes(&["node-a", "node-b"], |node| etcd.config(node, ""), &path).await;
    let (a, b) = (&nodes[0], &nodes[1]);
    let on_a = counter("on-a");
    assert_eq!(call(a, &on_a).await, ("node-a".to_string(), 1));
    assert_eq!(elsewhere(b, &on_a).await, Ok(true), "A owns it, B asks");
    etcd.kill();
    let asked = Instant::now();
    let answer = elsewhere(b, &on_a).await;
    let took = asked.elapsed();
    assert!(
        matches!(&answer, Err(InvokeError::Unreachable { target, .. }) if *target == on_a),
        "not known: {answer:?}"
    );
    assert!(
        took < Duration::from_millis(TEST_REQUEST_TIMEOUT_MS + SCHEDULING_ALLOWANCE_MS),
        "answered in {took:?}"
    );
}
