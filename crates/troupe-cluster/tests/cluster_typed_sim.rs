//! Typed actors calling typed actors across a simulated cluster: a `till` on node-1 asks
//! (`ActorRef::ask_from`) and tells (`ActorRef::tell_from`) a `ledger` placed on node-2,
//! from inside its turn. On a cluster node a turn's calls go through the node's turn
//! router, so the typed message and reply cross as bincode bytes over the transport and
//! come back typed; the call rules hold across the nodes (the ledger runs at depth 1
//! with the till in its chain, and a call back to the till is a refused cycle).
//!
//! Two `ClusterNode`s on madsim's simulated etcd and one shared `MemoryStore`.
//!
//! Run with `CARGO_TARGET_DIR=target/madsim RUSTFLAGS="--cfg madsim" cargo nextest run
//! -p troupe-cluster --test cluster_typed_sim`.
#![cfg(madsim)]

#[path = "support/sim_etcd.rs"]
mod sim_etcd;

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use madsim::runtime::{Handle, NodeHandle};
use serde::{Deserialize, Serialize};
use sim_etcd::start_sim_etcd;
use troupe_cluster::{ClusterClient, ClusterNode, ClusterStats};
use troupe_core::{ActorId, ActorKind, CallRefused, InvokeError};
use troupe_etcd::{EtcdConfig, NodeId};
use troupe_runtime::{ActorError, KindConfig, MemoryStore, RuntimeBuilder, StateStore, Turn, TypedActor};

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
/// The deadline of every root request, in milliseconds.
const CALL_MS: u64 = 5_000;
/// The timeout the till asks for its calls, in milliseconds: its own deadline clips it.
const TILL_CALL_TIMEOUT_MS: u64 = 60_000;

/// What a ledger is asked.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum Entry {
    /// Add this amount; reply with the new balance.
    Add(i64),
    /// Reply with the balance.
    Balance,
    /// Ask the till of the same key for its sale count from this turn (a call back up
    /// the chain: refused).
    CallBack,
}

/// What a ledger answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Booked {
    balance: i64,
    /// The depth and chain keys of the turn that answered.
    depth: u32,
    chain: Vec<String>,
    /// The refusal of a `CallBack`, if it was one.
    refused: Option<InvokeError>,
}

#[derive(Default, Serialize, Deserialize)]
struct Ledger {
    balance: i64,
}

impl TypedActor for Ledger {
    type Message = Entry;
    type Reply = Booked;

    async fn handle(&mut self, turn: &mut Turn, entry: Entry) -> Result<Booked, ActorError> {
        let mut refused = None;
        match entry {
            Entry::Add(amount) => self.balance += amount,
            Entry::Balance => {}
            Entry::CallBack => {
                let till = turn.actor_ref::<Till>(ActorId::new("till", turn.id().key())?)?;
                refused = till
                    .ask_from(turn.caller(), Sale::Count, Duration::from_millis(TILL_CALL_TIMEOUT_MS))
                    .await
                    .err();
            }
        }
        let context = turn.context();
        Ok(Booked {
            balance: self.balance,
            depth: context.depth(),
            chain: context.chain().iter().map(|id| id.key().to_string()).collect(),
            refused,
        })
    }
}

/// What a till is asked.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum Sale {
    /// Book a sale in the ledger of the same key (`ask_from`); reply with what it booked.
    Sell(i64),
    /// Tell the ledger a refund (`tell_from`); reply with the sales so far.
    Refund(i64),
    /// Ask the ledger to call this till back (`ask_from`, refused there).
    Loop,
    /// Reply with the sales so far.
    Count,
}

#[derive(Default, Serialize, Deserialize)]
struct Till {
    sales: u64,
}

impl TypedActor for Till {
    type Message = Sale;
    type Reply = Result<Booked, u64>;

    async fn handle(&mut self, turn: &mut Turn, sale: Sale) -> Result<Self::Reply, ActorError> {
        let ledger = turn.actor_ref::<Ledger>(ActorId::new("ledger", turn.id().key())?)?;
        let timeout = Duration::from_millis(TILL_CALL_TIMEOUT_MS);
        match sale {
            Sale::Sell(amount) => {
                self.sales += 1;
                Ok(Ok(ledger.ask_from(turn.caller(), Entry::Add(amount), timeout).await?))
            }
            Sale::Refund(amount) => {
                ledger.tell_from(turn.caller(), Entry::Add(-amount), timeout).await?;
                Ok(Err(self.sales))
            }
            Sale::Loop => Ok(Ok(ledger.ask_from(turn.caller(), Entry::CallBack, timeout).await?)),
            Sale::Count => Ok(Err(self.sales)),
        }
    }
}

fn runtime() -> RuntimeBuilder {
    troupe_runtime::Runtime::builder()
        .register_typed::<Ledger>(ActorKind::new("ledger").expect("a kind"), KindConfig::default())
        .expect("register the ledger")
        .register_typed::<Till>(ActorKind::new("till").expect("a kind"), KindConfig::default())
        .expect("register the till")
}

fn node_ip(index: usize) -> IpAddr {
    format!("10.0.1.{}", index + 1).parse().expect("an IP address")
}

/// Two nodes on one store, with each node's client and a way to read its stats.
struct Cluster {
    nodes: Vec<NodeHandle>,
    clients: Vec<ClusterClient>,
    members: Vec<Arc<ClusterNode>>,
    store: MemoryStore,
    _etcd: NodeHandle,
}

async fn start_cluster() -> Cluster {
    let handle = Handle::current();
    let etcd = start_sim_etcd(&handle, ETCD_ADDRESS).await;
    let store = MemoryStore::new();
    type Slots = Vec<Option<Arc<ClusterNode>>>;
    let slots: Arc<Mutex<Slots>> = Arc::new(Mutex::new(vec![None; NODE_NAMES.len()]));
    let nodes = (0..NODE_NAMES.len())
        .map(|index| {
            let (slots, store) = (Arc::clone(&slots), store.clone());
            handle
                .create_node()
                .name(NODE_NAMES[index])
                .ip(node_ip(index))
                .init(move || {
                    let (slots, store) = (Arc::clone(&slots), store.clone());
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
                            match ClusterNode::start(config, listen, runtime(), store.clone()).await {
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
        clients: members.iter().map(|node| node.client()).collect(),
        members,
        store,
        _etcd: etcd,
    }
}

impl Cluster {
    /// Asks `target` `message` (bincode, as a bytes caller does) through node `index`,
    /// from inside that node, and decodes the reply as `R`.
    async fn ask<M: Serialize, R: for<'de> Deserialize<'de> + Send + 'static>(
        &self,
        index: usize,
        target: ActorId,
        message: &M,
    ) -> Result<R, InvokeError> {
        let client = self.clients[index].clone();
        let payload = Bytes::from(bincode::serialize(message).expect("encode the message"));
        self.nodes[index]
            .spawn(async move {
                let deadline = client.deadline_in(Duration::from_millis(CALL_MS));
                let reply = client.invoke(&target, payload, deadline).await?;
                Ok(bincode::deserialize(&reply).expect("decode the reply"))
            })
            .await
            .expect("the request's task")
    }

    fn stats(&self, index: usize) -> ClusterStats {
        self.members[index].stats()
    }
}

fn ledger() -> ActorId {
    ActorId::new("ledger", "shop").expect("an id")
}

fn till() -> ActorId {
    ActorId::new("till", "shop").expect("an id")
}

/// Goal: a typed actor's `ask_from` and `tell_from` reach a typed actor on another node
/// and come back typed, under the call rules. Method: the ledger is placed on node-2 and
/// the till on node-1 (each activated through its node); the till's sale is booked by
/// the ledger at depth 1 with the till in its chain, node-1 counts the call and the tell
/// as forwarded to another node, the refund told lands before a later read, the
/// ledger's state is committed in the shared store, and the ledger's call back to the
/// till is refused as a cycle with the whole chain.
#[madsim::test]
async fn typed_calls_from_a_turn_cross_nodes_and_come_back_typed() {
    let cluster = Arc::new(start_cluster().await);
    let placed: Booked = cluster
        .ask(1, ledger(), &Entry::Balance)
        .await
        .expect("the ledger on node-2");
    assert_eq!((placed.balance, placed.depth), (0, 0));
    let sales: Result<Booked, u64> = cluster.ask(0, till(), &Sale::Count).await.expect("the till on node-1");
    assert_eq!(sales, Err(0));
    let before = cluster.stats(0);

    let booked: Result<Booked, u64> = cluster.ask(0, till(), &Sale::Sell(10)).await.expect("a sale");
    let booked = booked.expect("the ledger's answer");
    assert_eq!(
        (booked.balance, booked.depth, booked.chain),
        (10, 1, vec!["shop".to_string()])
    );
    let after_call = cluster.stats(0);
    assert_eq!(
        after_call.turn_calls_forwarded,
        before.turn_calls_forwarded + 1,
        "the till's call went to node-2: {before:?} → {after_call:?}"
    );

    let refunded: Result<Booked, u64> = cluster.ask(0, till(), &Sale::Refund(3)).await.expect("a refund");
    assert_eq!(refunded, Err(1));
    let after_tell = cluster.stats(0);
    assert_eq!(
        after_tell.turn_tells_forwarded,
        after_call.turn_tells_forwarded + 1,
        "the till's tell went to node-2: {after_call:?} → {after_tell:?}"
    );
    let balance: Booked = cluster.ask(1, ledger(), &Entry::Balance).await.expect("the balance");
    assert_eq!(balance.balance, 7);
    let saved = cluster
        .store
        .load(&ledger())
        .await
        .expect("the store")
        .expect("a saved ledger");
    let saved: Ledger = bincode::deserialize(&saved).expect("a bincode ledger");
    assert_eq!(saved.balance, 7);

    let looped: Result<Booked, u64> = cluster.ask(0, till(), &Sale::Loop).await.expect("the loop's answer");
    let looped = looped.expect("the ledger's answer");
    assert_eq!(
        looped.refused,
        Some(InvokeError::Refused(CallRefused::CycleDetected {
            chain: vec![till(), ledger(), till()],
        }))
    );
}
