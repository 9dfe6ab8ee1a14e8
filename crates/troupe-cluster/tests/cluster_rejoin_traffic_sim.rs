//! Goal: a node that rejoins by itself after a lost lease
//! ([`ClusterNode::rejoin_after_a_lost_lease`]) keeps the cluster's guarantees while
//! callers keep calling through the loss and the rejoin: nothing acknowledged is lost,
//! no actor is served by two nodes at once, every call ends by its deadline, and the
//! node serves again after the rejoin.
//!
//! Method: the simulated etcd, two nodes (node-1 with the rejoin on, node-2) on one
//! `MemoryStore` that both always reach (the worst case: a cut-off owner can still
//! write, so only the fence stops it), each store wrapped to log every claim and
//! commit. On each node [`CALLERS_PER_NODE`] callers call [`ACTORS`] counters one
//! after another, each call with a [`CALL_MS`] deadline, through the whole run. After
//! [`WARM_MS`], node-1 is cut from etcd only (not from node-2, not from the store) for
//! [`CUT_MS`], twice the lease TTL: its lease is lost, node-2 takes its actors over;
//! after the heal node-1 rejoins and serves again; the callers run [`AFTER_HEAL_MS`]
//! more. Checked from the log and the replies: a fence claimed by one node only, each
//! count committed once and the committed counts of each actor exactly 1..=its final
//! count, newer counts never under older fences, no count acknowledged twice, every
//! acknowledged count in the final state, no call resolved after its deadline, node-1
//! rejoined once and acknowledged calls after the heal.
//!
//! Run with `CARGO_TARGET_DIR=target/madsim RUSTFLAGS="--cfg madsim" cargo nextest run
//! -p troupe-cluster --test cluster_rejoin_traffic_sim`.
#![cfg(madsim)]

#[path = "support/sim_etcd.rs"]
mod sim_etcd;
#[path = "support/counter.rs"]
mod support;

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use madsim::net::NetSim;
use madsim::runtime::Handle;
use sim_etcd::start_sim_etcd;
use support::{check_distinct_acks, counter, counter_runtime, parse_reply, LoggingStore, StoreLog};
use tokio::time::Instant;
use troupe_cluster::{ClusterNode, ClusterStats};
use troupe_core::{ActorId, InvokeError};
use troupe_etcd::{EtcdConfig, NodeId};
use troupe_runtime::MemoryStore;

const ETCD_ADDRESS: &str = "10.0.0.1:2379";
/// The nodes' transport port.
const NODE_PORT: u16 = 7100;
const NODE_NAMES: [&str; 2] = ["node-1", "node-2"];
/// Lease TTL, in seconds.
const SIM_LEASE_TTL_S: u64 = 3;
/// etcd request timeout, in milliseconds.
const SIM_REQUEST_TIMEOUT_MS: u64 = 500;
/// Concurrent callers on each node.
const CALLERS_PER_NODE: usize = 3;
/// Actors the callers call.
const ACTORS: usize = 6;
/// Deadline of every call, in milliseconds.
const CALL_MS: u64 = 2_000;
/// How late a call may resolve after its deadline, in milliseconds (timer rounding).
const DEADLINE_TOLERANCE_MS: u64 = 1;
/// Traffic before the cut, in milliseconds.
const WARM_MS: u64 = 3_000;
/// How long node-1 is cut from etcd, in milliseconds: twice the lease TTL.
const CUT_MS: u64 = 2 * SIM_LEASE_TTL_S * 1_000;
/// Traffic after the heal, in milliseconds: the rejoin (a few attempts every
/// `REJOIN_RETRY_PAUSE_MS`, 500 ms) and serving again.
const AFTER_HEAL_MS: u64 = 8_000;

fn node_ip(index: usize) -> IpAddr {
    format!("10.0.1.{}", index + 1).parse().expect("an IP address")
}

/// One acknowledged call: the actor, the node whose counter answered, the count, when
/// (after the scenario began, in milliseconds), and the node it was made through.
type Ack = (ActorId, String, u64, u64, &'static str);

/// What the callers and the test share.
#[derive(Clone)]
struct Shared {
    store: MemoryStore,
    log: StoreLog,
    acks: Arc<Mutex<Vec<Ack>>>,
    /// Errors by node and kind.
    errors: Arc<Mutex<BTreeMap<String, usize>>>,
    late: Arc<Mutex<Vec<String>>>,
    stats: Arc<Mutex<BTreeMap<String, ClusterStats>>>,
    stop: Arc<AtomicBool>,
    start: Instant,
}

fn error_kind(error: &InvokeError) -> &'static str {
    match error {
        InvokeError::Timeout { .. } => "Timeout",
        InvokeError::Unreachable { .. } => "Unreachable",
        InvokeError::StorageFailed { .. } => "StorageFailed",
        InvokeError::Shutdown => "Shutdown",
        InvokeError::Busy { .. } => "Busy",
        _ => "other",
    }
}

/// One node: start (rejoin on for node-1), run the callers until the stop flag, report
/// the stats.
async fn run_node(index: usize, shared: Shared) {
    let name = NODE_NAMES[index];
    let address = SocketAddr::new(node_ip(index), NODE_PORT);
    let config = EtcdConfig::new(
        vec![ETCD_ADDRESS.to_string()],
        "sim",
        NodeId::new(name).expect("a node name"),
        address.to_string(),
    )
    .with_lease_ttl_s(SIM_LEASE_TTL_S)
    .with_request_timeout_ms(SIM_REQUEST_TIMEOUT_MS);
    let store = LoggingStore {
        inner: shared.store.clone(),
        node: name.to_string(),
        log: shared.log.clone(),
    };
    let listen = SocketAddr::new("0.0.0.0".parse().expect("an IP address"), NODE_PORT);
    let node = ClusterNode::start(config, listen, counter_runtime(name), store)
        .await
        .expect("the node starts");
    node.rejoin_after_a_lost_lease(index == 0);
    let client = node.client();
    let callers = (0..CALLERS_PER_NODE).map(|caller| {
        let (shared, client) = (shared.clone(), client.clone());
        async move {
            let mut call = 0_usize;
            while !shared.stop.load(Ordering::SeqCst) {
                call += 1;
                // After the heal node-1's first caller also calls actors nobody has
                // called yet: activated on node-1, under its new lease.
                let healed = shared.start.elapsed() > Duration::from_millis(WARM_MS + CUT_MS);
                let actor = if index == 0 && caller == 0 && healed && call.is_multiple_of(2) {
                    counter(&format!("fresh-{call}"))
                } else {
                    counter(&format!("c{}", (caller * 2 + call * 5 + index) % ACTORS))
                };
                let started = Instant::now();
                let deadline = client.deadline_in(Duration::from_millis(CALL_MS));
                let result = client.invoke(&actor, Bytes::from_static(b"inc"), deadline).await;
                let took = started.elapsed();
                if took > Duration::from_millis(CALL_MS + DEADLINE_TOLERANCE_MS) {
                    shared
                        .late
                        .lock()
                        .expect("late")
                        .push(format!("{name} → {actor} took {} ms", took.as_millis()));
                }
                match result {
                    Ok(reply) => {
                        let (served_by, count) = parse_reply(&reply);
                        let at = u64::try_from(shared.start.elapsed().as_millis()).expect("ms");
                        shared
                            .acks
                            .lock()
                            .expect("acks")
                            .push((actor, served_by, count, at, name));
                    }
                    Err(error) => {
                        *shared
                            .errors
                            .lock()
                            .expect("errors")
                            .entry(format!("{name} {}", error_kind(&error)))
                            .or_default() += 1;
                    }
                }
                tokio::time::sleep(Duration::from_millis(20 + (call as u64 * 37) % 60)).await;
            }
        }
    });
    futures::future::join_all(callers).await;
    shared
        .stats
        .lock()
        .expect("stats")
        .insert(name.to_string(), node.stats());
}

/// The scenario of the module documentation; returns the shared record.
async fn rejoin_under_traffic() -> Shared {
    let handle = Handle::current();
    let etcd = start_sim_etcd(&handle, ETCD_ADDRESS).await;
    let shared = Shared {
        store: MemoryStore::new(),
        log: StoreLog::default(),
        acks: Arc::default(),
        errors: Arc::default(),
        late: Arc::default(),
        stats: Arc::default(),
        stop: Arc::default(),
        start: Instant::now(),
    };
    let nodes: Vec<_> = (0..NODE_NAMES.len())
        .map(|index| {
            let shared = shared.clone();
            handle
                .create_node()
                .name(NODE_NAMES[index])
                .ip(node_ip(index))
                .init(move || run_node(index, shared.clone()))
                .build()
        })
        .collect();
    let net = NetSim::current();
    tokio::time::sleep(Duration::from_millis(WARM_MS)).await;
    net.clog_link(nodes[0].id(), etcd.id());
    net.clog_link(etcd.id(), nodes[0].id());
    tokio::time::sleep(Duration::from_millis(CUT_MS)).await;
    net.unclog_link(nodes[0].id(), etcd.id());
    net.unclog_link(etcd.id(), nodes[0].id());
    tokio::time::sleep(Duration::from_millis(AFTER_HEAL_MS)).await;
    shared.stop.store(true, Ordering::SeqCst);
    let stopped = Instant::now();
    while shared.stats.lock().expect("stats").len() < NODE_NAMES.len() {
        assert!(
            stopped.elapsed() < Duration::from_millis(2 * CALL_MS),
            "the callers did not stop within two call deadlines"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shared
}

/// Goal and method: see the module documentation.
#[madsim::test]
async fn a_node_that_rejoins_under_traffic_keeps_one_owner_and_every_acknowledged_count() {
    let shared = rejoin_under_traffic().await;
    let late = shared.late.lock().expect("late").clone();
    assert!(late.is_empty(), "calls resolved after their deadline: {late:?}");
    shared.log.check_single_owner();
    let acks = shared.acks.lock().expect("acks").clone();
    let plain: Vec<_> = acks
        .iter()
        .map(|(actor, node, count, _, _)| (actor.clone(), node.clone(), *count))
        .collect();
    check_distinct_acks(&plain);
    shared
        .log
        .check_committed_counts(
            &shared.store,
            (0..ACTORS).map(|index| counter(&format!("c{index}"))),
            &plain,
        )
        .await;
    let stats = shared.stats.lock().expect("stats").clone();
    assert_eq!(
        stats["node-1"].rejoins, 1,
        "node-1 rejoined once: {:?}",
        stats["node-1"]
    );
    let healed_ms = WARM_MS + CUT_MS;
    let through_node_1: Vec<u64> = acks
        .iter()
        .filter(|(_, _, _, at, via)| *via == "node-1" && *at > healed_ms)
        .map(|(_, _, _, at, _)| *at)
        .collect();
    assert!(
        !through_node_1.is_empty(),
        "no call through node-1 was acknowledged after the heal"
    );
    let served_by_node_1 = acks
        .iter()
        .filter(|(_, node, _, at, _)| node == "node-1" && *at > healed_ms)
        .count();
    assert!(served_by_node_1 > 0, "node-1 served no actor itself after it rejoined");
    let cut_ms = WARM_MS..healed_ms;
    let during_cut = acks.iter().filter(|(_, _, _, at, _)| cut_ms.contains(at)).count();
    let errors = shared.errors.lock().expect("errors").clone();
    eprintln!(
        "{} calls acknowledged ({during_cut} during the cut, {served_by_node_1} served by node-1 after the heal); \
         the first call through node-1 acknowledged {} ms after the heal; errors: {errors:?}; \
         node-1: {} rejoin(s), {} reroutes; node-2: {} reroutes",
        acks.len(),
        through_node_1.iter().min().copied().unwrap_or(0) - healed_ms,
        stats["node-1"].rejoins,
        stats["node-1"].reroutes,
        stats["node-2"].reroutes,
    );
}
