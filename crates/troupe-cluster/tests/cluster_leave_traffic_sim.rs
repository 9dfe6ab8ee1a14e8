//! Goal: a node that leaves (gracefully: `ClusterNode::leave`) under steady unkeyed
//! traffic from another node fails none of those calls `Unreachable`: a request the
//! leaving node never read (written as its transport stopped) was never run, so the
//! caller's node sends it to the actor's next owner. Before protocol version 7 the
//! leaving node closed its connections without saying which requests it had read; the
//! caller saw the connection close under requests it had written (`MaybeSent`) and, as
//! they were unkeyed, ended them `Unreachable` (the last lost call of the loopback
//! rolling-restart probe, 'connection reset by peer').
//!
//! Method: the simulated etcd and two nodes on one `MemoryStore`. In each of [`ROUNDS`]
//! rounds node-2 starts, places [`ACTORS`] fresh counters on itself (one call each
//! through itself), serves [`CALLERS`] callers of node-1 that call them one call after
//! another for [`TRAFFIC_MS`], and leaves; node-1's callers go on calling the round's
//! counters until the next round is ready (served by node-1 once node-2 has left). The
//! simulated network's latency keeps requests in flight when node-2's transport stops.
//! Checked: no call ended with an error (`Unreachable` in particular), none resolved
//! past its deadline, and no count was acknowledged twice.
//!
//! Run with `CARGO_TARGET_DIR=target/madsim RUSTFLAGS="--cfg madsim" cargo nextest run
//! -p troupe-cluster --test cluster_leave_traffic_sim`.
#![cfg(madsim)]

#[path = "support/sim_etcd.rs"]
mod sim_etcd;
#[path = "support/counter.rs"]
#[allow(dead_code)] // the logging store is not used here
mod support;

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use madsim::runtime::Handle;
use sim_etcd::start_sim_etcd;
use support::{check_distinct_acks, counter, counter_runtime, parse_reply};
use tokio::time::Instant;
use troupe_cluster::ClusterNode;
use troupe_core::{ActorId, InvokeError};
use troupe_etcd::{EtcdConfig, NodeId};
use troupe_runtime::MemoryStore;

const ETCD_ADDRESS: &str = "10.0.0.1:2379";
/// The nodes' transport port.
const NODE_PORT: u16 = 7100;
/// Lease TTL, in seconds.
const SIM_LEASE_TTL_S: u64 = 3;
/// etcd request timeout, in milliseconds.
const SIM_REQUEST_TIMEOUT_MS: u64 = 500;
/// Times node-2 starts, serves and leaves.
const ROUNDS: usize = 6;
/// Counters placed on node-2 in each round.
const ACTORS: usize = 4;
/// node-1's concurrent callers.
const CALLERS: usize = 8;
/// How long node-2 serves node-1's callers in a round before it leaves, in ms.
const TRAFFIC_MS: u64 = 400;
/// How long node-2 stays away after a leave, in milliseconds: node-1's callers are
/// served by node-1 meanwhile.
const AWAY_MS: u64 = 300;
/// Deadline of every call, in milliseconds.
const CALL_MS: u64 = 2_000;
/// Pause between two calls of one caller, in milliseconds.
const CALL_PAUSE_MS: u64 = 1;
/// How late a call may resolve after its deadline, in milliseconds (timer rounding).
const DEADLINE_TOLERANCE_MS: u64 = 1;
/// Longest the test waits for node-1 to join, in milliseconds.
const JOIN_MS: u64 = 1_000;

fn node_ip(index: usize) -> IpAddr {
    format!("10.0.1.{}", index + 1).parse().expect("an IP address")
}

fn config(index: usize) -> EtcdConfig {
    let name = format!("node-{}", index + 1);
    EtcdConfig::new(
        vec![ETCD_ADDRESS.to_string()],
        "sim-leave",
        NodeId::new(&name).expect("a node name"),
        SocketAddr::new(node_ip(index), NODE_PORT).to_string(),
    )
    .with_lease_ttl_s(SIM_LEASE_TTL_S)
    .with_request_timeout_ms(SIM_REQUEST_TIMEOUT_MS)
}

fn listen() -> SocketAddr {
    SocketAddr::new("0.0.0.0".parse().expect("an IP address"), NODE_PORT)
}

fn round_actor(round: usize, index: usize) -> ActorId {
    counter(&format!("r{round}-c{index}"))
}

/// What the nodes and the test share.
#[derive(Clone, Default)]
struct Shared {
    store: MemoryStore,
    /// The round whose counters node-2 has placed (0: none yet).
    ready: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    acks: Arc<Mutex<Vec<(ActorId, String, u64)>>>,
    /// Errors by kind, with one cause each.
    errors: Arc<Mutex<BTreeMap<String, (usize, String)>>>,
    late: Arc<Mutex<Vec<String>>>,
    calls_to_node_2: Arc<AtomicUsize>,
}

fn error_kind(error: &InvokeError) -> &'static str {
    match error {
        InvokeError::Timeout { .. } => "Timeout",
        InvokeError::Unreachable { .. } => "Unreachable",
        InvokeError::Shutdown => "Shutdown",
        _ => "other",
    }
}

/// node-2: [`ROUNDS`] times, start, place the round's counters, serve, leave.
async fn run_node_2(shared: Shared) {
    for round in 1..=ROUNDS {
        let node = ClusterNode::start(config(1), listen(), counter_runtime("node-2"), shared.store.clone())
            .await
            .expect("node-2 starts");
        let client = node.client();
        for index in 0..ACTORS {
            let deadline = client.deadline_in(Duration::from_millis(CALL_MS));
            let reply = client
                .invoke(&round_actor(round, index), Bytes::from_static(b"inc"), deadline)
                .await
                .expect("node-2 places the round's counter");
            let (served_by, count) = parse_reply(&reply);
            assert_eq!((served_by.as_str(), count), ("node-2", 1), "placed on node-2");
            shared
                .acks
                .lock()
                .expect("acks")
                .push((round_actor(round, index), served_by, count));
        }
        shared.ready.store(round, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(TRAFFIC_MS)).await;
        node.leave().await.expect("node-2 leaves");
        tokio::time::sleep(Duration::from_millis(AWAY_MS)).await;
    }
    shared.stop.store(true, Ordering::SeqCst);
}

/// node-1: callers calling the ready round's counters until the stop.
async fn run_node_1(shared: Shared) {
    let node = ClusterNode::start(config(0), listen(), counter_runtime("node-1"), shared.store.clone())
        .await
        .expect("node-1 starts");
    let client = node.client();
    let callers = (0..CALLERS).map(|caller| {
        let (shared, client) = (shared.clone(), client.clone());
        async move {
            let mut call = 0_usize;
            while !shared.stop.load(Ordering::SeqCst) {
                let round = shared.ready.load(Ordering::SeqCst);
                if round == 0 {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
                call += 1;
                let actor = round_actor(round, (caller + call) % ACTORS);
                let started = Instant::now();
                let deadline = client.deadline_in(Duration::from_millis(CALL_MS));
                let result = client.invoke(&actor, Bytes::from_static(b"inc"), deadline).await;
                let took = started.elapsed();
                if took > Duration::from_millis(CALL_MS + DEADLINE_TOLERANCE_MS) {
                    let late = format!("{actor} took {} ms", took.as_millis());
                    shared.late.lock().expect("late").push(late);
                }
                match result {
                    Ok(reply) => {
                        let (served_by, count) = parse_reply(&reply);
                        if served_by == "node-2" {
                            shared.calls_to_node_2.fetch_add(1, Ordering::SeqCst);
                        }
                        shared.acks.lock().expect("acks").push((actor, served_by, count));
                    }
                    Err(error) => {
                        let mut errors = shared.errors.lock().expect("errors");
                        let entry = errors
                            .entry(error_kind(&error).to_string())
                            .or_insert_with(|| (0, error.to_string()));
                        entry.0 += 1;
                    }
                }
                tokio::time::sleep(Duration::from_millis(CALL_PAUSE_MS)).await;
            }
        }
    });
    futures::future::join_all(callers).await;
    let stats = node.stats();
    eprintln!("node-1: {stats:?}");
    node.leave().await.ok();
}

#[madsim::test]
async fn a_node_that_leaves_under_traffic_fails_no_call_unreachable() {
    let handle = Handle::current();
    let _etcd = start_sim_etcd(&handle, ETCD_ADDRESS).await;
    let shared = Shared::default();
    let node_1 = handle.create_node().name("node-1").ip(node_ip(0)).build();
    let node_2 = handle.create_node().name("node-2").ip(node_ip(1)).build();
    let callers = node_1.spawn(run_node_1(shared.clone()));
    tokio::time::sleep(Duration::from_millis(JOIN_MS)).await;
    node_2.spawn(run_node_2(shared.clone())).await.expect("node-2's rounds");
    callers.await.expect("node-1's callers");
    let errors = shared.errors.lock().expect("errors").clone();
    let late = shared.late.lock().expect("late").clone();
    let acks = shared.acks.lock().expect("acks").clone();
    eprintln!(
        "{} calls acknowledged, {} served by node-2 through node-1; errors {errors:?}",
        acks.len(),
        shared.calls_to_node_2.load(Ordering::SeqCst)
    );
    assert!(late.is_empty(), "calls resolved after their deadline: {late:?}");
    assert!(
        shared.calls_to_node_2.load(Ordering::SeqCst) > 0,
        "node-1's calls reached node-2"
    );
    assert!(errors.is_empty(), "no call fails while node-2 leaves: {errors:?}");
    check_distinct_acks(&acks);
}
