//! Simulated cluster nodes that join again after a lost lease, each publishing its
//! current agent client in a slot: the settings they join with, a node's join and
//! rejoin loop, waiting for a node's client, and placing an agent on a node (madsim
//! only).
#![allow(dead_code)]

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use madsim::runtime::{Handle, NodeHandle};
use troupe_agent::{
    AgentClient, AgentSystemBuilder, ConversationMessage, ScriptedLlm, Sender, TaskState, CONVERSATION_KIND,
    CONVERSATION_PAGE_MAX,
};
use troupe_cluster::ClusterNode;
use troupe_core::ActorId;
use troupe_etcd::{EtcdConfig, LeaseLostReason, NodeId};
use troupe_runtime::{FencedClaim, MemoryStore, StateStore};

use crate::agents::{agent_system, Seen};

/// The simulated etcd's address.
pub(crate) const ETCD_ADDRESS: &str = "10.0.0.1:2379";
/// The nodes' transport port.
pub(crate) const NODE_PORT: u16 = 7100;
/// Lease TTL, in seconds.
pub(crate) const SIM_LEASE_TTL_S: u64 = 3;
/// etcd request timeout, in milliseconds.
pub(crate) const SIM_REQUEST_TIMEOUT_MS: u64 = 500;
/// Pause before a node retries joining, in milliseconds.
pub(crate) const REJOIN_DELAY_MS: u64 = 500;

/// Node `index`'s address.
pub(crate) fn node_ip(index: usize) -> IpAddr {
    format!("10.0.1.{}", index + 1).parse().expect("an IP address")
}

/// Each node's current agent client (`None` while it is not joined).
pub(crate) type Slots = Mutex<Vec<Option<AgentClient>>>;

/// Node `index`'s agent client, once the node has joined.
pub(crate) async fn joined_client(slots: &Slots, index: usize) -> AgentClient {
    loop {
        if let Some(client) = slots.lock().expect("slots")[index].clone() {
            return client;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Starts node `index` (named `name`) on the simulated etcd with `store` and the agent
/// system `system` builds, retrying after [`REJOIN_DELAY_MS`] until it joins: the node
/// and its agent client.
pub(crate) async fn join<S: FencedClaim + Clone>(
    index: usize,
    name: &str,
    store: &S,
    system: &impl Fn() -> AgentSystemBuilder,
) -> (ClusterNode, AgentClient) {
    loop {
        let config = EtcdConfig::new(
            vec![ETCD_ADDRESS.to_string()],
            "sim",
            NodeId::new(name).expect("a node name"),
            SocketAddr::new(node_ip(index), NODE_PORT).to_string(),
        )
        .with_lease_ttl_s(SIM_LEASE_TTL_S)
        .with_request_timeout_ms(SIM_REQUEST_TIMEOUT_MS);
        let listen = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), NODE_PORT);
        let (runtime, pending) = system().prepare().expect("the agent system is valid");
        match ClusterNode::start(config, listen, runtime, store.clone()).await {
            Ok(node) => {
                let client = pending
                    .attach(node.handle().clone())
                    .expect("the node's runtime has the agent kinds");
                return (node, client);
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(REJOIN_DELAY_MS)).await,
        }
    }
}

/// Runs node `index` (named `name`) on `store` for ever: it [`join`]s, calls `joined` with its
/// client and publishes the client in `slots`; once its lease is lost and it is fenced
/// off, it clears its slot, hands what `joined` returned and the reason to `lost`,
/// abandons the node, and after [`REJOIN_DELAY_MS`] joins again.
pub(crate) async fn run_rejoining<G, S: FencedClaim + Clone>(
    index: usize,
    name: &str,
    store: S,
    slots: Arc<Slots>,
    system: impl Fn() -> AgentSystemBuilder,
    mut joined: impl FnMut(&AgentClient) -> G,
    mut lost: impl FnMut(G, LeaseLostReason),
) {
    loop {
        let (node, client) = join(index, name, &store, &system).await;
        let guard = joined(&client);
        slots.lock().expect("slots")[index] = Some(client);
        let reason = node.fenced_off().await;
        slots.lock().expect("slots")[index] = None;
        lost(guard, reason);
        node.abandon().await;
        tokio::time::sleep(Duration::from_millis(REJOIN_DELAY_MS)).await;
    }
}

/// Starts a node named after each of `names` (node `index` at [`node_ip`]), each
/// [`run_rejoining`] with the agent system of `support/agents.rs` (`llm`, `seen`) and
/// `store`, and each running a resume sweep every `sweep`, if any, while joined; returns
/// the nodes and their slots once every node has joined.
pub(crate) async fn start_sweeping_nodes(
    names: &'static [&'static str],
    llm: &ScriptedLlm,
    seen: &Seen,
    store: &MemoryStore,
    sweep: Option<Duration>,
) -> (Vec<NodeHandle>, Arc<Slots>) {
    let handle = Handle::current();
    let slots: Arc<Slots> = Arc::new(Mutex::new(vec![None; names.len()]));
    let nodes = (0..names.len())
        .map(|index| {
            let (slots, llm, seen, store) = (Arc::clone(&slots), llm.clone(), seen.clone(), store.clone());
            handle
                .create_node()
                .name(names[index])
                .ip(node_ip(index))
                .init(move || {
                    let (slots, llm, seen, store) = (Arc::clone(&slots), llm.clone(), seen.clone(), store.clone());
                    let system = move || agent_system(&llm, index, &seen);
                    let joined = move |client: &AgentClient| {
                        sweep.map(|every| client.start_resume_sweep(every).expect("the period is in range"))
                    };
                    run_rejoining(index, names[index], store, slots, system, joined, |sweeping, _| {
                        drop(sweeping)
                    })
                })
                .build()
        })
        .collect();
    for index in 0..names.len() {
        joined_client(&slots, index).await;
    }
    (nodes, slots)
}

/// The sweep simulations' cluster: nodes started by [`start_sweeping_nodes`] on one
/// `MemoryStore`, with what their agents' turns recorded. Each test file adds its own
/// reads in an `impl SweepCluster` block of its own.
pub(crate) struct SweepCluster {
    pub(crate) nodes: Vec<NodeHandle>,
    pub(crate) slots: Arc<Slots>,
    pub(crate) seen: Seen,
    /// The store every node reaches (a test may read keys in it directly).
    pub(crate) store: MemoryStore,
    names: &'static [&'static str],
    /// How long placing an agent (its first ask) may take.
    ask_timeout: Duration,
}

impl SweepCluster {
    /// Nodes named after `names` with the agents of `support/agents.rs` scripted by
    /// `llm`, each running a resume sweep every `sweep`, if any; returns once every node
    /// has joined (the simulated etcd must be running).
    pub(crate) async fn start(
        names: &'static [&'static str],
        llm: &ScriptedLlm,
        sweep: Option<Duration>,
        ask_timeout: Duration,
    ) -> Self {
        let (seen, store) = (Seen::default(), MemoryStore::new());
        let (nodes, slots) = start_sweeping_nodes(names, llm, &seen, &store, sweep).await;
        Self {
            nodes,
            slots,
            seen,
            store,
            names,
            ask_timeout,
        }
    }

    /// Node `index`'s agent client once it has joined.
    pub(crate) async fn client(&self, index: usize) -> AgentClient {
        joined_client(&self.slots, index).await
    }

    /// Places `agent` on node `index`: its first turn runs there.
    pub(crate) async fn place(&self, index: usize, agent: &str) {
        let client = self.client(index).await;
        let node = (index, self.names[index]);
        place_on(&self.nodes[index], client, &self.seen, node, agent, self.ask_timeout).await;
    }

    /// Runs `read` with node-1's client on node-1 (never faulted).
    pub(crate) async fn on_node_1<T: Send + 'static, F: std::future::Future<Output = T> + Send + 'static>(
        &self,
        read: impl FnOnce(AgentClient) -> F,
    ) -> T {
        let client = self.client(0).await;
        self.nodes[0].spawn(read(client)).await.expect("node-1's task")
    }

    /// `agent`'s pending (inbox, outbox) entries, read through node-1.
    pub(crate) async fn pending(&self, agent: &'static str) -> (u64, u64) {
        self.on_node_1(move |client| async move { client.pending(agent).await })
            .await
            .expect("the counters read")
    }

    /// The state of task `id` that `a` delegated, read through node-1.
    pub(crate) async fn task_state(&self, id: &str) -> TaskState {
        let id = id.to_string();
        self.on_node_1(|client| async move { client.task("a", &id).await })
            .await
            .expect("the task reads")
            .expect("an acknowledged task has a record")
            .state
    }

    /// Conversation `room`'s committed messages, read through node-1.
    pub(crate) async fn room(&self, room: &'static str) -> Vec<ConversationMessage> {
        self.on_node_1(move |client| async move { client.read_messages(room, None, CONVERSATION_PAGE_MAX).await })
            .await
            .expect("the room reads")
    }

    /// Conversation `room`'s stored relay keys (mentions committed, not yet seen
    /// delivered).
    pub(crate) async fn relays(&self, room: &str) -> Vec<String> {
        let room = ActorId::new(CONVERSATION_KIND, room).expect("the room's actor id");
        self.store
            .scan(&room, "relay/", None, CONVERSATION_PAGE_MAX)
            .await
            .expect("the store scans")
            .into_iter()
            .map(|(key, _)| key)
            .collect()
    }
}

/// `b`'s answers to the mention in message `seq` among `messages`: its reply, or a
/// system note about it.
pub(crate) fn answers_of_b(messages: &[ConversationMessage], seq: u64) -> Vec<ConversationMessage> {
    messages
        .iter()
        .filter(|message| {
            message.reply_to == Some(seq)
                && (message.sender == Sender::Agent("b".into())
                    || message.note.as_ref().is_some_and(|note| note.agent == "b"))
        })
        .cloned()
        .collect()
}

/// Places `agent` on `node` (node `index`, named `name`) by asking it `ping` through
/// that node's `client` within `timeout`: its first turn runs there, which `seen` shows.
pub(crate) async fn place_on(
    node: &NodeHandle,
    client: AgentClient,
    seen: &Seen,
    (index, name): (usize, &str),
    agent: &str,
    timeout: Duration,
) {
    let agent_name = agent.to_string();
    let reply = node
        .spawn(async move { client.ask_with_timeout(&agent_name, "ping", timeout).await })
        .await
        .expect("the ask's task");
    assert_eq!(reply.expect("a ping").text, "pong", "{agent} answers a ping");
    let last = seen.turns_of(agent).pop().expect("a turn");
    assert_eq!(last.0, index, "{agent} placed on {name}");
}
