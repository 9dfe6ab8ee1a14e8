//! Two of the embedder probes of `embedder_probes.rs` in the simulator, where the
//! nodes are separate simulated machines (their own IPs, killed and restarted by the
//! test) on madsim's simulated etcd and one shared `MemoryStore`: a second node under a
//! live node's name, and a node dropped while its client is still held.
//!
//! Run with `CARGO_TARGET_DIR=target/madsim RUSTFLAGS="--cfg madsim" cargo nextest run
//! -p troupe-cluster --test embedder_probes_sim`.
#![cfg(madsim)]

#[path = "support/sim_etcd.rs"]
mod sim_etcd;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use madsim::runtime::{Handle, NodeHandle};
use sim_etcd::start_sim_etcd;
use tokio::sync::mpsc;
use tokio::time::Instant;
use troupe_cluster::{ClusterClient, ClusterError, ClusterNode};
use troupe_core::{ActorId, ActorKind, InvokeError};
use troupe_etcd::{EtcdConfig, NodeId};
use troupe_runtime::{Actor, ActorBox, ActorError, KindConfig, MemoryStore, RuntimeBuilder, Turn};

const ETCD_ADDRESS: &str = "10.0.0.1:2379";
/// The nodes' transport port.
const NODE_PORT: u16 = 7100;
/// Lease TTL, in seconds.
const SIM_LEASE_TTL_S: u64 = 3;
/// etcd request timeout, in milliseconds.
const SIM_REQUEST_TIMEOUT_MS: u64 = 500;
/// The deadline of every call, in milliseconds.
const CALL_MS: u64 = 2_000;
/// Pause between two attempts of a call that waits for a takeover, in milliseconds.
const RETRY_PAUSE_MS: u64 = 50;
/// Allowance on top of a lease TTL the tests check, in milliseconds (simulated time).
const TAKEOVER_ALLOWANCE_MS: u64 = 2_000;

/// Counts its calls; each reply is `node:count`.
struct Probe {
    node: String,
    count: u64,
}

impl Actor for Probe {
    async fn handle(&mut self, _turn: &mut Turn, _payload: Bytes) -> Result<Bytes, ActorError> {
        self.count += 1;
        Ok(Bytes::from(format!("{}:{}", self.node, self.count)))
    }

    fn snapshot(&self) -> Result<Option<Bytes>, ActorError> {
        Ok(Some(Bytes::from(self.count.to_string())))
    }
}

fn runtime(machine: &str) -> RuntimeBuilder {
    let machine = machine.to_string();
    troupe_runtime::Runtime::builder()
        .register(
            ActorKind::new("probe").expect("a kind name"),
            move |_id: &ActorId, saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
                let count = saved
                    .and_then(|bytes| std::str::from_utf8(&bytes).ok().and_then(|text| text.parse().ok()))
                    .unwrap_or(0);
                Ok(ActorBox::new(Probe {
                    node: machine.clone(),
                    count,
                }))
            },
            KindConfig::default(),
        )
        .expect("register the probe kind")
}

fn probe(key: &str) -> ActorId {
    ActorId::new("probe", key).expect("an actor id")
}

fn machine_ip(index: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 0, 1, index))
}

/// What a simulated machine reports after its start.
type Started = Result<ClusterClient, String>;

/// A simulated machine at `machine_ip(index)` that starts a node named `name` once
/// (again at each restart) and reports the outcome on `started`; the node runs until
/// the returned sender sends (then it is dropped, its client kept) or is dropped, or
/// the machine is killed.
fn machine(
    handle: &Handle,
    index: u8,
    name: &'static str,
    store: MemoryStore,
    started: mpsc::UnboundedSender<Started>,
) -> (NodeHandle, mpsc::UnboundedSender<()>) {
    let (drop_sender, drop_receiver) = mpsc::unbounded_channel::<()>();
    let drop_receiver = Arc::new(tokio::sync::Mutex::new(drop_receiver));
    let machine = format!("machine-{index}");
    let node = handle
        .create_node()
        .name(machine.clone())
        .ip(machine_ip(index))
        .init(move || {
            let (store, started, drop_receiver, machine) = (
                store.clone(),
                started.clone(),
                Arc::clone(&drop_receiver),
                machine.clone(),
            );
            async move {
                let config = EtcdConfig::new(
                    vec![ETCD_ADDRESS.to_string()],
                    "sim",
                    NodeId::new(name).expect("a node name"),
                    SocketAddr::new(machine_ip(index), NODE_PORT).to_string(),
                )
                .with_lease_ttl_s(SIM_LEASE_TTL_S)
                .with_request_timeout_ms(SIM_REQUEST_TIMEOUT_MS);
                let listen = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), NODE_PORT);
                match ClusterNode::start(config, listen, runtime(&machine), store).await {
                    Ok(node) => {
                        let client = node.client();
                        let _ = started.send(Ok(client.clone()));
                        let _ = drop_receiver.lock().await.recv().await;
                        drop(node);
                        // The client is kept, as an embedder's task may keep one.
                        std::future::pending::<()>().await;
                        drop(client);
                    }
                    Err(error) => {
                        let refused = match &error {
                            ClusterError::NodeNameInUse { address, .. } => format!("name in use at {address}"),
                            other => other.to_string(),
                        };
                        let _ = started.send(Err(refused));
                        std::future::pending::<()>().await;
                    }
                }
            }
        })
        .build();
    (node, drop_sender)
}

/// Calls `target` through `client`, from inside the machine `on` (its network).
async fn call(on: &NodeHandle, client: &ClusterClient, target: &ActorId) -> Result<String, InvokeError> {
    let (client, target) = (client.clone(), target.clone());
    on.spawn(async move {
        let deadline = client.deadline_in(Duration::from_millis(CALL_MS));
        client
            .invoke(&target, Bytes::from_static(b"inc"), deadline)
            .await
            .map(|reply| String::from_utf8(reply.to_vec()).expect("text"))
    })
    .await
    .expect("the call's task")
}

/// Calls until served, only transient errors meanwhile; returns the reply and when.
async fn call_until_served(on: &NodeHandle, client: &ClusterClient, target: &ActorId, bound: Duration) -> String {
    let started = Instant::now();
    loop {
        match call(on, client, target).await {
            Ok(reply) => return reply,
            Err(error) => {
                assert!(error.is_transient(), "{target}: {error}");
                assert!(
                    started.elapsed() < bound,
                    "{target} not served within {bound:?}: {error}"
                );
                tokio::time::sleep(Duration::from_millis(RETRY_PAUSE_MS)).await;
            }
        }
    }
}

async fn next_start(started: &mut mpsc::UnboundedReceiver<Started>) -> Started {
    tokio::time::timeout(Duration::from_secs(10), started.recv())
        .await
        .expect("a machine reported its start")
        .expect("the channel")
}

/// Goal (simulated): a second machine starting a node under a live node's name is
/// refused `NodeNameInUse` naming the live node's address; once that machine is killed,
/// a node under the name starts on another machine and serves the actor with its count
/// after the old lease ends. Method: machine 1 runs node-a and serves x; machine 2
/// starts node-a; machines 1 and 2 are killed; machine 3 starts node-a.
#[madsim::test]
async fn a_second_machine_under_a_live_nodes_name_is_refused_until_that_one_dies() {
    let handle = Handle::current();
    let _etcd = start_sim_etcd(&handle, ETCD_ADDRESS).await;
    let store = MemoryStore::new();
    let (started_sender, mut started) = mpsc::unbounded_channel();
    let (first, _keep_first) = machine(&handle, 1, "node-a", store.clone(), started_sender.clone());
    let first_client = next_start(&mut started).await.expect("node-a starts on machine 1");
    let x = probe("x");
    assert_eq!(call(&first, &first_client, &x).await.expect("x"), "machine-1:1");

    let (second, _keep_second) = machine(&handle, 2, "node-a", store.clone(), started_sender.clone());
    assert_eq!(
        next_start(&mut started).await.err(),
        Some(format!("name in use at {}", SocketAddr::new(machine_ip(1), NODE_PORT))),
        "a second node-a while machine 1 serves"
    );

    handle.kill(first.id());
    handle.kill(second.id());
    let killed_at = Instant::now();
    let (third, _keep_third) = machine(&handle, 3, "node-a", store.clone(), started_sender.clone());
    let third_client = next_start(&mut started)
        .await
        .expect("node-a starts on machine 3 once machine 1 is dead");
    let bound = Duration::from_millis(SIM_LEASE_TTL_S * 1_000 + TAKEOVER_ALLOWANCE_MS);
    assert_eq!(call_until_served(&third, &third_client, &x, bound).await, "machine-3:2");
    eprintln!(
        "x served on machine 3 {} ms after machine 1 died",
        killed_at.elapsed().as_millis()
    );
}

/// Goal (simulated): a node dropped by its embedder while the embedder keeps its client
/// hands its actors over within a lease TTL. Method: machine 1 runs node-a and serves
/// x, then drops the node and keeps its client; machine 2 runs node-b and calls x.
#[madsim::test]
async fn a_node_dropped_while_its_client_is_kept_hands_its_actors_over() {
    let handle = Handle::current();
    let _etcd = start_sim_etcd(&handle, ETCD_ADDRESS).await;
    let store = MemoryStore::new();
    let (started_sender, mut started) = mpsc::unbounded_channel();
    let (first, drop_first) = machine(&handle, 1, "node-a", store.clone(), started_sender.clone());
    let first_client = next_start(&mut started).await.expect("node-a starts");
    let (second, _keep_second) = machine(&handle, 2, "node-b", store.clone(), started_sender.clone());
    let second_client = next_start(&mut started).await.expect("node-b starts");
    let x = probe("x");
    assert_eq!(call(&first, &first_client, &x).await.expect("x"), "machine-1:1");

    drop_first.send(()).expect("machine 1 runs");
    let dropped_at = Instant::now();
    let bound = Duration::from_millis(SIM_LEASE_TTL_S * 1_000 + TAKEOVER_ALLOWANCE_MS);
    assert_eq!(
        call_until_served(&second, &second_client, &x, bound).await,
        "machine-2:2"
    );
    eprintln!(
        "x served by node-b {} ms after node-a was dropped",
        dropped_at.elapsed().as_millis()
    );
}

/// Rounds of the race in `two_machines_starting_one_name_at_once_have_one_winner`.
const SIM_START_RACE_ROUNDS: u8 = 4;

/// Goal (simulated): two machines starting a node under one name at the same moment
/// never both start: exactly one serves, the other is refused `NodeNameInUse` naming
/// the winner's address. Before, both read the name free and both wrote the membership
/// record. Method: 4 rounds of two new machines starting `node-a` at once; the winner
/// serves an actor; both machines are then killed, so the next round meets the dead
/// winner's record (left until its lease ends) and takes it over.
#[madsim::test]
async fn two_machines_starting_one_name_at_once_have_one_winner() {
    let handle = Handle::current();
    let _etcd = start_sim_etcd(&handle, ETCD_ADDRESS).await;
    let store = MemoryStore::new();
    let (started_sender, mut started) = mpsc::unbounded_channel();
    for round in 0..SIM_START_RACE_ROUNDS {
        let indices = [2 * round + 1, 2 * round + 2];
        let machines = indices.map(|index| machine(&handle, index, "node-a", store.clone(), started_sender.clone()));
        let outcomes = [next_start(&mut started).await, next_start(&mut started).await];
        let won: Vec<&ClusterClient> = outcomes.iter().filter_map(|outcome| outcome.as_ref().ok()).collect();
        let refused: Vec<&String> = outcomes.iter().filter_map(|outcome| outcome.as_ref().err()).collect();
        assert_eq!(
            (won.len(), refused.len()),
            (1, 1),
            "round {round}: {} starts won, refusals {refused:?}",
            won.len()
        );
        let winner = won[0].clone();
        // The winner's runtime runs the call: its reply names its machine.
        let target = probe(&format!("r{round}"));
        let reply = call(&machines[0].0, &winner, &target).await.expect("the winner serves");
        let winner_index = indices
            .into_iter()
            .find(|index| reply == format!("machine-{index}:1"))
            .unwrap_or_else(|| panic!("round {round}: the reply {reply:?} names neither machine"));
        assert_eq!(
            refused[0],
            &format!(
                "name in use at {}",
                SocketAddr::new(machine_ip(winner_index), NODE_PORT)
            ),
            "round {round}: the refusal names the winner, machine {winner_index}"
        );
        for (machine, _) in &machines {
            handle.kill(machine.id());
        }
    }
}
