//! A store down for a moment on the node that hosts an actor, seen from another node:
//! the caller on node-1 of a counter placed on node-2, while node-2's store fails
//! `Unavailable`, gets `StorageFailed { source: StoreError::Unavailable }` (transient),
//! the error node-2's own callers get; its server answers it 503 `storage_unavailable`
//! with `Retry-After` (`troupe-server`'s `tests/remote_store_unavailable.rs`). Before
//! transport protocol version 8 the wire carried `Unavailable` as `Backend`, and node-1's
//! caller got `Backend` (500 `storage_failed`, "do not retry").
//!
//! Method: the simulated etcd and two `ClusterNode`s on one `MemoryStore`; node-2 reaches
//! it through [`Outage`], which fails every operation `Unavailable` while it is down (a
//! node whose connection to the database is refused, the other's not). The counter is
//! placed on node-2 by a call through node-2; then node-2's store goes down and a call
//! through node-1 is forwarded to node-2, whose turn's commit fails until the deadline.
//! Once the store is back, a call through node-1 counts on from the committed count.
//!
//! The network runs at the simulator's default latency, 1 to 10 ms a message: node-2
//! stops trying its store 5 to 10 ms before its deadline, which is the caller's,
//! translated and made earlier by the connection's return allowance (at least
//! `RETURN_ALLOWANCE_MS_MIN`), so its answer arrives before the caller gives up; a
//! `Timeout` fails the test. (Until the return allowance this test ran at 1 to 3 ms:
//! at the default, the transport's own test, `troupe-runtime`'s
//! `tests/transport_store_unavailable.rs`, ended `Timeout` on 4 seeds in 40.)
//!
//! Run with `CARGO_TARGET_DIR=target/madsim RUSTFLAGS="--cfg madsim" cargo nextest run
//! -p troupe-cluster --test cluster_store_unavailable_sim`.
#![cfg(madsim)]

#[path = "../../troupe-agent/tests/support/forwarding_store.rs"]
mod forwarding_store;
#[path = "support/sim_etcd.rs"]
mod sim_etcd;
#[allow(dead_code)]
#[path = "support/counter.rs"]
mod support;

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use forwarding_store::{forwarding_state_store, ForwardingStore};
use madsim::runtime::{Handle, NodeHandle};
use sim_etcd::start_sim_etcd;
use support::{counter, counter_runtime, parse_reply};
use troupe_cluster::ClusterNode;
use troupe_core::{ActorId, InvokeError};
use troupe_etcd::{EtcdConfig, NodeId};
use troupe_runtime::{MemoryStore, StoreError, StoreOperation};

const ETCD_ADDRESS: &str = "10.0.0.1:2379";
/// The nodes' transport port.
const NODE_PORT: u16 = 7100;
const NODE_NAMES: [&str; 2] = ["node-1", "node-2"];
/// Lease TTL, in seconds.
const SIM_LEASE_TTL_S: u64 = 3;
/// etcd request timeout, in milliseconds.
const SIM_REQUEST_TIMEOUT_MS: u64 = 500;
/// Pause before a node retries joining, in milliseconds.
const REJOIN_DELAY_MS: u64 = 500;
/// The deadline of a call made while node-2's store is up, in milliseconds.
const CALL_MS: u64 = 5_000;
/// The deadline of the call made while node-2's store is down, in milliseconds.
const OUTAGE_CALL_MS: u64 = 1_000;
/// What node-2's store says while it is down.
const OUTAGE_CAUSE: &str = "connection refused (the test's outage)";

/// The shared store as one node reaches it: every operation fails `Unavailable` while
/// `down` is set, and each failure is counted.
#[derive(Clone)]
struct Outage {
    inner: MemoryStore,
    down: Arc<AtomicBool>,
    failed: Arc<AtomicU64>,
}

impl ForwardingStore for Outage {
    type Inner = MemoryStore;

    fn inner(&self) -> &MemoryStore {
        &self.inner
    }

    fn gate(&self, _actor: &ActorId, operation: StoreOperation) -> Result<(), StoreError> {
        if !self.down.load(Ordering::SeqCst) {
            return Ok(());
        }
        self.failed.fetch_add(1, Ordering::SeqCst);
        Err(StoreError::Unavailable {
            operation,
            cause: OUTAGE_CAUSE.to_string(),
        })
    }
}

forwarding_state_store!(Outage, fenced);

fn node_ip(index: usize) -> IpAddr {
    format!("10.0.1.{}", index + 1).parse().expect("an IP address")
}

/// Two joined nodes: node-1 on the shared store, node-2 through `outage`.
struct Cluster {
    nodes: Vec<NodeHandle>,
    members: Vec<Arc<ClusterNode>>,
    _etcd: NodeHandle,
}

async fn start_cluster(store: &MemoryStore, outage: &Outage) -> Cluster {
    let handle = Handle::current();
    let etcd = start_sim_etcd(&handle, ETCD_ADDRESS).await;
    type Slots = Vec<Option<Arc<ClusterNode>>>;
    let slots: Arc<Mutex<Slots>> = Arc::new(Mutex::new(vec![None; NODE_NAMES.len()]));
    let nodes = (0..NODE_NAMES.len())
        .map(|index| {
            let (slots, store, outage) = (Arc::clone(&slots), store.clone(), outage.clone());
            handle
                .create_node()
                .name(NODE_NAMES[index])
                .ip(node_ip(index))
                .init(move || {
                    let (slots, store, outage) = (Arc::clone(&slots), store.clone(), outage.clone());
                    async move {
                        let node = loop {
                            let config = EtcdConfig::new(
                                vec![ETCD_ADDRESS.to_string()],
                                "sim",
                                NodeId::new(NODE_NAMES[index]).expect("a node name"),
                                SocketAddr::new(node_ip(index), NODE_PORT).to_string(),
                            )
                            .with_lease_ttl_s(SIM_LEASE_TTL_S)
                            .with_request_timeout_ms(SIM_REQUEST_TIMEOUT_MS);
                            let listen = SocketAddr::new("0.0.0.0".parse().expect("an address"), NODE_PORT);
                            let runtime = counter_runtime(NODE_NAMES[index]);
                            let started = if index == 0 {
                                ClusterNode::start(config, listen, runtime, store.clone()).await
                            } else {
                                ClusterNode::start(config, listen, runtime, outage.clone()).await
                            };
                            match started {
                                Ok(node) => break Arc::new(node),
                                Err(_) => tokio::time::sleep(Duration::from_millis(REJOIN_DELAY_MS)).await,
                            }
                        };
                        slots.lock().expect("slots")[index] = Some(Arc::clone(&node));
                        std::future::pending::<()>().await;
                        drop(node);
                    }
                })
                .build()
        })
        .collect();
    let members = loop {
        let ready: Option<Vec<Arc<ClusterNode>>> = slots.lock().expect("slots").iter().cloned().collect();
        if let Some(ready) = ready {
            break ready;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    Cluster {
        nodes,
        members,
        _etcd: etcd,
    }
}

impl Cluster {
    /// `inc` of `target` through node `index`, from inside that node, within
    /// `within_ms`: the serving node and the count.
    async fn inc(&self, index: usize, target: &ActorId, within_ms: u64) -> Result<(String, u64), InvokeError> {
        let (node, target) = (Arc::clone(&self.members[index]), target.clone());
        self.nodes[index]
            .spawn(async move {
                let deadline = node.handle().deadline_in(Duration::from_millis(within_ms));
                let reply = node.invoke(&target, Bytes::from_static(b"inc"), deadline).await?;
                Ok(parse_reply(&reply))
            })
            .await
            .expect("the call's task")
    }
}

/// Goal and method: see the file's documentation.
#[madsim::test]
async fn a_call_through_another_node_to_an_actor_whose_hosts_store_is_down_fails_unavailable() {
    let store = MemoryStore::new();
    let outage = Outage {
        inner: store.clone(),
        down: Arc::default(),
        failed: Arc::default(),
    };
    let cluster = start_cluster(&store, &outage).await;
    let target = counter("x");
    let placed = cluster.inc(1, &target, CALL_MS).await.expect("placed on node-2");
    assert_eq!(placed, ("node-2".to_string(), 1));

    outage.down.store(true, Ordering::SeqCst);
    let forwarded_before = cluster.members[0].stats().forwarded_calls;
    let error = cluster
        .inc(0, &target, OUTAGE_CALL_MS)
        .await
        .expect_err("node-2's store is down");
    outage.down.store(false, Ordering::SeqCst);
    match &error {
        InvokeError::StorageFailed {
            target: failed,
            source: StoreError::Unavailable { operation, cause },
        } if *failed == target && *operation == StoreOperation::Commit && cause == OUTAGE_CAUSE => {}
        other => panic!(
            "not node-2's store failing for a moment at its commit (StorageFailed {{ source: Unavailable }}): \
             {other:?}"
        ),
    }
    assert!(error.is_transient(), "{error}");
    let stats = cluster.members[0].stats();
    assert_eq!(
        stats.forwarded_calls,
        forwarded_before + 1,
        "node-1 sent the call to node-2: {stats:?}"
    );
    let failed = outage.failed.load(Ordering::SeqCst);
    assert!(failed >= 2, "node-2 tried its store again: {failed} failures");

    let (_, count) = cluster.inc(0, &target, CALL_MS).await.expect("the store is back");
    assert_eq!(count, 2, "from the committed count: the failed turn committed nothing");
}
