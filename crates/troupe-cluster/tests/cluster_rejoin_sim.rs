//! Goal: a node with `ClusterNode::rejoin_after_a_lost_lease` on that is cut from etcd
//! for longer than its lease TTL loses its lease (it stops serving at once), and once
//! the cut heals takes a new lease by itself and serves its actors again, from their
//! committed state, without being restarted; with it off, the node refuses them until
//! its deadline ("this node has lost its cluster lease").
//!
//! Method: the simulated etcd, one node on a `MemoryStore`, a counter placed on it
//! (count 1); the link between the node and etcd cut for 5 s (TTL 3 s); then calls
//! through the node every 100 ms until one is answered, within 5 s of the heal.
//!
//! Run with `CARGO_TARGET_DIR=target/madsim RUSTFLAGS="--cfg madsim" cargo nextest run
//! -p troupe-cluster --test cluster_rejoin_sim`.
#![cfg(madsim)]

#[path = "support/sim_etcd.rs"]
mod sim_etcd;
#[allow(dead_code)]
#[path = "support/counter.rs"]
mod support;

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use madsim::net::NetSim;
use madsim::runtime::Handle;
use sim_etcd::start_sim_etcd;
use support::{counter, counter_runtime, parse_reply};
use troupe_cluster::{ClusterNode, ClusterStats};
use troupe_core::InvokeError;
use troupe_etcd::{EtcdConfig, NodeId};
use troupe_runtime::MemoryStore;

const ETCD_ADDRESS: &str = "10.0.0.1:2379";
const NODE_IP: &str = "10.0.1.1";
/// The node's transport port.
const NODE_PORT: u16 = 7100;
/// Lease TTL, in seconds.
const SIM_LEASE_TTL_S: u64 = 3;
/// etcd request timeout, in milliseconds.
const SIM_REQUEST_TIMEOUT_MS: u64 = 500;
/// How long the node is cut from etcd, in milliseconds: past the lease TTL.
const CUT_MS: u64 = 5_000;
/// Deadline of each call, in milliseconds.
const CALL_MS: u64 = 1_000;
/// Pause between two calls after the heal, in milliseconds.
const CALL_PAUSE_MS: u64 = 100;
/// How long after the heal the node must serve again, in milliseconds: a rejoin attempt
/// every `REJOIN_RETRY_PAUSE_MS` (500 ms), each within the request timeout, and a call.
const SERVED_AGAIN_WITHIN_MS: u64 = 5_000;

/// What the node did after the heal: the first answer (or the last error) and its stats.
type Outcome = (Result<(String, u64), InvokeError>, ClusterStats);

/// Runs the scenario with the node's rejoin set to `rejoin`.
async fn cut_from_etcd_past_the_ttl(rejoin: bool) -> Outcome {
    let handle = Handle::current();
    let etcd = start_sim_etcd(&handle, ETCD_ADDRESS).await;
    let outcome: Arc<Mutex<Option<Outcome>>> = Arc::default();
    let node = handle
        .create_node()
        .name("node-1")
        .ip(NODE_IP.parse::<IpAddr>().expect("an IP address"))
        .build();
    let (etcd_id, node_id) = (etcd.id(), node.id());
    let store = MemoryStore::new();
    let reported = Arc::clone(&outcome);
    node.spawn(async move {
        let address = SocketAddr::new(NODE_IP.parse().expect("an IP address"), NODE_PORT);
        let config = EtcdConfig::new(
            vec![ETCD_ADDRESS.to_string()],
            "sim",
            NodeId::new("node-1").expect("a node name"),
            address.to_string(),
        )
        .with_lease_ttl_s(SIM_LEASE_TTL_S)
        .with_request_timeout_ms(SIM_REQUEST_TIMEOUT_MS);
        let node = ClusterNode::start(config, address, counter_runtime("node-1"), store)
            .await
            .expect("node-1 starts");
        node.rejoin_after_a_lost_lease(rejoin);
        let x = counter("x");
        let call = |payload: &'static [u8]| {
            let deadline = node.handle().deadline_in(Duration::from_millis(CALL_MS));
            node.invoke(&x, Bytes::from_static(payload), deadline)
        };
        let first = call(b"inc").await.expect("node-1 serves x");
        assert_eq!(parse_reply(&first), ("node-1".to_string(), 1));

        let net = NetSim::current();
        net.clog_link(node_id, etcd_id);
        net.clog_link(etcd_id, node_id);
        tokio::time::sleep(Duration::from_millis(CUT_MS)).await;
        assert!(!node.placement().holds_lease(), "the lease ran out during the cut");
        net.unclog_link(node_id, etcd_id);
        net.unclog_link(etcd_id, node_id);

        let healed = tokio::time::Instant::now();
        let answered = loop {
            let answer = call(b"inc").await.map(|reply| parse_reply(&reply));
            if answer.is_ok() || healed.elapsed() >= Duration::from_millis(SERVED_AGAIN_WITHIN_MS) {
                break answer;
            }
            tokio::time::sleep(Duration::from_millis(CALL_PAUSE_MS)).await;
        };
        *reported.lock().expect("the outcome") = Some((answered, node.stats()));
        node.leave().await.ok();
    })
    .await
    .expect("node-1's task");
    let outcome = outcome.lock().expect("the outcome").take();
    outcome.expect("the node reported")
}

/// Goal and method: see the module documentation (rejoin on).
#[madsim::test]
async fn a_node_cut_from_etcd_past_its_ttl_rejoins_and_serves_again_unrestarted() {
    let (answered, stats) = cut_from_etcd_past_the_ttl(true).await;
    assert_eq!(
        answered.map_err(|error| error.to_string()),
        Ok(("node-1".to_string(), 2)),
        "served again from the committed count"
    );
    assert_eq!(stats.rejoins, 1, "{stats:?}");
}

/// Goal: the control: with the rejoin off (the default) the node, unrestarted, still
/// refuses the actor after the heal: it lost its lease for good.
#[madsim::test]
async fn a_node_cut_from_etcd_past_its_ttl_without_rejoin_stays_fenced_off() {
    let (answered, stats) = cut_from_etcd_past_the_ttl(false).await;
    assert!(
        matches!(&answered, Err(InvokeError::StorageFailed { .. })),
        "refused: {answered:?}"
    );
    assert_eq!(stats.rejoins, 0, "{stats:?}");
}
