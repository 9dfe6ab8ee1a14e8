//! The simulated deployment: server nodes running the real runtime with probe actors,
//! each with a disk that outlives it, and the client side that routes requests.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use troupe_agent::{AgentClient, AgentSystem};
use troupe_core::{ActorId, CallContext, InvokeError};
use troupe_runtime::{Clock, KindConfig, MemoryStore, Runtime, RuntimeHandle, TransportClient, TransportServer};

use crate::agents::{AgentSetup, FaultyLlm, LlmFaults, TraceObserver, AGENT_NODE};
use crate::probe::{node_address, owner_of, probe_kind, AdmissionMode, ProbeConfig, ProbeFactory, Router};
use crate::runtime_observer::TraceRuntimeObserver;
use crate::stores::{StoreMode, SyncingStore};
use crate::trace::{Event, Trace};

/// A server node's number, 1-based.
pub type NodeId = u32;

/// Where the nodes keep their state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Disk {
    /// Each node has its own disk (each actor lives on its owner's).
    #[default]
    PerNode,
    /// One store shared by every node (a networked database); it does not crash with a
    /// node.
    Shared,
}

/// Which node hosts an actor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Placement {
    /// A fixed owner per actor: FNV hash of its key modulo the node count.
    #[default]
    Owner,
    /// Planted bug: every request goes to a node picked at random, as a placement that
    /// ignores the directory would; two nodes host one actor (SingleActivation).
    BugSplitBrain,
}

/// How clients treat failures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ClientMode {
    /// One attempt per request, bounded by its deadline.
    #[default]
    Honest,
    /// Planted bug: a transient failure is retried every 5 ms with a fresh budget,
    /// ignoring the request's deadline (EveryCallResolves).
    BugRetryIgnoresDeadline,
}

/// What a node publishes once its runtime is up.
#[derive(Clone)]
struct Published {
    runtime: RuntimeHandle,
    agents: Option<AgentClient>,
}

struct Node {
    madsim_id: madsim::task::NodeId,
    disk: MemoryStore,
    handle: Arc<Mutex<Option<Published>>>,
    alive: bool,
}

/// What a cluster is built from.
#[derive(Clone)]
pub(crate) struct ClusterConfig {
    pub(crate) nodes: u32,
    pub(crate) disk: Disk,
    pub(crate) store: StoreMode,
    pub(crate) admission: AdmissionMode,
    pub(crate) placement: Placement,
    pub(crate) plant_commit_after_abandon: bool,
    pub(crate) plant_commit_failed_turn: bool,
    pub(crate) kind: KindConfig,
    pub(crate) agents: Option<AgentSetup>,
    pub(crate) llm_faults: LlmFaults,
}

/// The simulated server nodes and the client node. Cheap to clone; clones share the
/// nodes.
///
/// Clients run on their own node (`client`, 10.0.1.1) and reach the servers only over
/// the real transport (madsim's simulated TCP), so network faults hit the real code;
/// probes reach probes on other nodes the same way. Node 0 in network faults means the
/// client node.
#[derive(Clone)]
pub struct SimCluster {
    nodes: Arc<Mutex<Vec<Node>>>,
    client_node: madsim::runtime::NodeHandle,
    clients: Arc<Vec<TransportClient>>,
    client_clock: Clock,
    config: ClusterConfig,
    trace: Trace,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl SimCluster {
    /// Creates and starts the server nodes; returns once every runtime is up.
    pub(crate) async fn start(config: ClusterConfig, trace: Trace) -> Self {
        assert!(config.nodes >= 1, "a cluster needs a node");
        let handle = madsim::runtime::Handle::current();
        let shared_disk = MemoryStore::new();
        let mut nodes = Vec::new();
        for number in 1..=config.nodes {
            let disk = match config.disk {
                Disk::PerNode => MemoryStore::new(),
                Disk::Shared => shared_disk.clone(),
            };
            let slot: Arc<Mutex<Option<Published>>> = Arc::default();
            let (init_disk, init_slot, init_trace) = (disk.clone(), Arc::clone(&slot), trace.clone());
            let init_config = config.clone();
            let ip = node_address(number).ip();
            let node = handle
                .create_node()
                .name(format!("node-{number}"))
                .ip(ip)
                .init(move || {
                    let (disk, slot, trace) = (init_disk.clone(), Arc::clone(&init_slot), init_trace.clone());
                    let config = init_config.clone();
                    async move { serve(number, config, disk, slot, trace).await }
                })
                .build();
            nodes.push(Node {
                madsim_id: node.id(),
                disk,
                handle: slot,
                alive: true,
            });
        }
        let client_node = handle
            .create_node()
            .name("client")
            .ip(IpAddr::V4(Ipv4Addr::new(10, 0, 1, 1)))
            .build();
        let client_clock = Clock::new();
        let clients = (1..=config.nodes)
            .map(|node| TransportClient::new(node_address(node), client_clock))
            .collect();
        let cluster = Self {
            nodes: Arc::new(Mutex::new(nodes)),
            client_node,
            clients: Arc::new(clients),
            client_clock,
            config: config.clone(),
            trace,
        };
        for number in 1..=config.nodes {
            cluster.wait_up(number).await;
        }
        cluster
    }

    async fn wait_up(&self, node: NodeId) {
        loop {
            if lock(&self.nodes)[node as usize - 1]
                .handle
                .lock()
                .map(|h| h.is_some())
                .unwrap_or(false)
            {
                return;
            }
            tokio::time::sleep(Duration::from_micros(10)).await;
        }
    }

    /// How many server nodes there are.
    pub fn len(&self) -> u32 {
        self.config.nodes
    }

    /// Whether there are no nodes (never: a cluster has at least one).
    pub fn is_empty(&self) -> bool {
        self.config.nodes == 0
    }

    /// The owner of actor `key` under [`Placement::Owner`].
    pub fn owner(&self, key: &str) -> NodeId {
        owner_of(key, self.config.nodes)
    }

    /// The madsim id of `node`, or of the client node for 0.
    pub fn network_id(&self, node: NodeId) -> madsim::task::NodeId {
        if node == 0 {
            self.client_node.id()
        } else {
            self.madsim_id(node)
        }
    }

    /// Runs `future` on the client node (where client requests must run: it is the
    /// node with the client's network address).
    pub fn spawn_on_client<F>(&self, future: F) -> madsim::task::JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.client_node.spawn(future)
    }

    /// The disk of `node` (the shared one under [`Disk::Shared`]).
    pub fn disk(&self, node: NodeId) -> MemoryStore {
        lock(&self.nodes)[node as usize - 1].disk.clone()
    }

    /// The live runtime of `node`, if it is up.
    pub fn runtime(&self, node: NodeId) -> Option<RuntimeHandle> {
        self.published(node).map(|published| published.runtime)
    }

    /// The agent client of the agent node's live system, if it is up and has agents.
    pub fn agent_client(&self) -> Option<AgentClient> {
        self.published(AGENT_NODE).and_then(|published| published.agents)
    }

    fn published(&self, node: NodeId) -> Option<Published> {
        let nodes = lock(&self.nodes);
        let slot = &nodes[node as usize - 1];
        if !slot.alive {
            return None;
        }
        let published = lock(&slot.handle).clone();
        published
    }

    /// Whether `node` is up.
    pub fn is_alive(&self, node: NodeId) -> bool {
        lock(&self.nodes)[node as usize - 1].alive
    }

    /// The madsim id of `node`, for network faults.
    pub fn madsim_id(&self, node: NodeId) -> madsim::task::NodeId {
        lock(&self.nodes)[node as usize - 1].madsim_id
    }

    /// Kills `node`: every task on it dies at once (runtime, dispatcher, actors), its
    /// memory is gone. Its disk survives; with `crash_disk`, it loses what it had not
    /// flushed, as after a power loss.
    pub fn kill(&self, node: NodeId, crash_disk: bool) {
        let mut nodes = lock(&self.nodes);
        let slot = &mut nodes[node as usize - 1];
        if !slot.alive {
            return;
        }
        slot.alive = false;
        *lock(&slot.handle) = None;
        madsim::runtime::Handle::current().kill(slot.madsim_id);
        let disk = slot.disk.clone();
        drop(nodes);
        self.trace.record(Event::NodeKilled { node });
        if crash_disk {
            disk.crash();
            self.trace.record(Event::DiskCrashed { node });
        }
    }

    /// Restarts a killed `node` from its disk; returns once its runtime is up.
    pub async fn restart(&self, node: NodeId) {
        {
            let mut nodes = lock(&self.nodes);
            let slot = &mut nodes[node as usize - 1];
            if slot.alive {
                return;
            }
            slot.alive = true;
            madsim::runtime::Handle::current().restart(slot.madsim_id);
        }
        self.wait_up(node).await;
    }

    /// Invokes actor `target` on `node` over the transport, from outside any actor.
    /// Must run on the client node ([`SimCluster::spawn_on_client`]).
    pub(crate) async fn invoke(
        &self,
        node: NodeId,
        target: &ActorId,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<Bytes, InvokeError> {
        let context = CallContext::root(self.client_clock.deadline_in(timeout));
        self.clients[node as usize - 1]
            .invoke(target, payload, context, None)
            .await
    }

    pub(crate) fn placement(&self) -> Placement {
        self.config.placement
    }
}

/// A server node's main task: start the runtime over its disk, publish its handle, and
/// live until the node is killed.
async fn serve(
    node: NodeId,
    config: ClusterConfig,
    disk: MemoryStore,
    slot: Arc<Mutex<Option<Published>>>,
    trace: Trace,
) {
    let store = SyncingStore::new(disk.clone(), config.store);
    let router = Arc::new(OnceLock::new());
    let probes = ProbeFactory::new(ProbeConfig {
        node,
        trace: trace.clone(),
        admission: config.admission,
        router: Arc::clone(&router),
    });
    let mut builder = Runtime::builder()
        .store(store)
        .observer(Arc::new(TraceRuntimeObserver::new(node, trace.clone())))
        .register(probe_kind(), probes, config.kind)
        .expect("the probe kind registers");
    if config.plant_commit_after_abandon {
        builder = builder.plant_bug_commit_after_abandon();
    }
    if config.plant_commit_failed_turn {
        builder = builder.plant_bug_commit_failed_turn();
    }
    // An admission that skips a check skips it everywhere: the host's check of an
    // arriving request would otherwise catch what the planted bug lets through.
    if matches!(
        config.admission,
        AdmissionMode::BugSkipChainCheck | AdmissionMode::BugSkipDepthCheck
    ) {
        builder = builder.plant_bug_no_arrival_checks();
    }
    let (runtime, agents): (Option<Runtime>, Option<AgentSystem>) = match &config.agents {
        Some(setup) if node == AGENT_NODE => {
            let llm = Arc::new(FaultyLlm::new(Arc::clone(&setup.llm), config.llm_faults.clone()));
            let mut system = AgentSystem::builder()
                .runtime(builder)
                .llm(llm)
                .kind_config(config.kind)
                .observer(Arc::new(TraceObserver::new(node, trace.clone())));
            for spec in &setup.agents {
                system = system.agent(spec.clone());
            }
            for tool in &setup.tools {
                system = system.tool(tool.clone());
            }
            for observer in &setup.observers {
                system = system.observer(Arc::clone(observer));
            }
            (None, Some(system.start().expect("the simulated agent system starts")))
        }
        _ => (Some(builder.start()), None),
    };
    let handle = match (&runtime, &agents) {
        (Some(runtime), _) => runtime.handle(),
        (None, Some(system)) => system.client().runtime().clone(),
        (None, None) => unreachable!("a node runs a runtime or an agent system"),
    };
    let _ = router.set(Router::new(node, config.nodes, handle.clock()));
    let server = TransportServer::bind(node_address(node), handle.clone())
        .await
        .expect("the node's transport binds its address");
    if let StoreMode::BugAckBeforeFlush { flush_every_ms } = config.store {
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(flush_every_ms)).await;
                disk.flush();
            }
        });
    }
    trace.record(Event::NodeStarted { node });
    *lock(&slot) = Some(Published {
        runtime: handle,
        agents: agents.as_ref().map(AgentSystem::client),
    });
    std::future::pending::<()>().await;
    drop((server, runtime, agents));
}
