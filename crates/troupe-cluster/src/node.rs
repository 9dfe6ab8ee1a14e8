//! [`ClusterNode`]: one runtime in a cluster, reachable by the others over the transport.

use rustc_hash::FxHashMap as HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use troupe_core::{ActorId, CallContext, Deadline, InvokeError, StoreError};
use troupe_etcd::{EtcdConfig, EtcdPlacement, LeaseLostReason, NodeId, Placement, PlacementError};
use troupe_runtime::{
    FencedClaim, IdempotencyKey, RequestFailure, RequestKind, Runtime, RuntimeBuilder, RuntimeHandle, TransportClient,
    TransportServer, TurnCall,
};

use crate::placed_store::{Ownership, PlacedStore, ReleaseObserver};
use crate::probes::{Hooks, ProbeChannel, RemoteWaitEntry, PROBE_QUEUE_CAPACITY};

/// Pause before a call looks its target's owner up again after a "not owner" refusal
/// or a failed lookup, in milliseconds (the first re-lookup after a refusal is at once).
pub const ROUTE_RETRY_DELAY_MS: u64 = 50;
/// Most times a call is sent again, to the owner looked up anew, after the transport
/// said the request was never sent (its connection was refused, or had closed before the
/// request was queued on it: a route to a node that left or crashed), in attempts. Past
/// it the call ends `Unreachable`; never past its deadline.
pub const NOT_SENT_RETRIES_MAX: u32 = 4;
/// Pause before each of those attempts, in milliseconds: a leaving node closes its
/// port a moment before its lease is revoked, and etcd names it until then.
pub const NOT_SENT_RETRY_PAUSE_MS: u64 = 50;
/// Pause between two attempts of a node to take a new lease after its lease was lost,
/// when it rejoins by itself ([`ClusterNode::rejoin_after_a_lost_lease`]), in
/// milliseconds: while etcd does not answer, each attempt ends within the etcd request
/// timeout and the next one starts this long after.
pub const REJOIN_RETRY_PAUSE_MS: u64 = 500;
/// Most attempts to take a new lease after a lost one, in attempts (with
/// [`REJOIN_RETRY_PAUSE_MS`], at least 5 minutes); past it the node stops trying and
/// [`ClusterNode::fenced_off`] resolves.
pub const REJOIN_ATTEMPTS_MAX: u32 = 600;
/// Most actors whose owner a node remembers, in actors; past it the cache is emptied.
pub const ROUTE_CACHE_ENTRIES_MAX: usize = 65_536;

/// How long a starting node tries to connect to the address another node published
/// under its name, to learn whether that node is alive, in milliseconds
/// ([`ClusterError::NodeNameInUse`]). A connection within it means a live node; a
/// refusal or no answer, a node that is gone.
pub const NODE_NAME_CHECK_TIMEOUT_MS: u64 = 1_000;

/// Longest a leaving node waits, after its runtime shut down, for the replies of its
/// last turns to be written to their connections before it closes them, in
/// milliseconds ([`ClusterNode::leave`]).
pub const LEAVE_REPLY_DRAIN_MS_MAX: u64 = 1_000;
/// How often a leaving node looks whether those replies are written, in milliseconds.
pub const LEAVE_REPLY_DRAIN_POLL_MS: u64 = 5;

/// Why a cluster node could not start.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The listen address could not be bound.
    #[error("cannot listen on {address}: {cause}")]
    Listen {
        /// The address asked for.
        address: SocketAddr,
        /// The operating system's error.
        cause: std::io::Error,
    },
    /// Joining the cluster in etcd failed.
    #[error("joining the cluster failed: {0}")]
    Join(#[from] PlacementError),
    /// A live node already serves under this node's name (its membership record names
    /// another address, and a connection there succeeds); nothing was written to etcd.
    /// Two live nodes under one name share one membership record: calls for the first
    /// one's actors would go to the second, which cannot serve them.
    #[error(
        "node name {node} is in use: a live node serves under it at {address}; give this node another \
         name (troupe node: --node), or stop that node first (a node that crashed or lost its lease \
         frees its name when its lease ends, within the lease TTL)"
    )]
    NodeNameInUse {
        /// The name asked for.
        node: NodeId,
        /// Where the live node serves, as its membership record says.
        address: String,
    },
    /// The cluster is bound to another store than this node's
    /// ([`EtcdConfig::store_identity`]): another deployment uses the cluster name on this
    /// etcd. Nothing of this node was written to etcd.
    #[error(
        "cluster {cluster:?} on this etcd keeps its actors in store {recorded:?}, but this node's store is \
         {store:?}: another deployment uses this cluster name on this etcd, and the two would mix their \
         placements. Give this deployment its own cluster name (troupe node: --cluster), or point this node \
         at the cluster's store; if the whole cluster moved to this store, stop every node and delete the \
         etcd key /troupe/{cluster}/store"
    )]
    StoreMismatch {
        /// The cluster's name.
        cluster: String,
        /// The store identity recorded for the cluster in etcd.
        recorded: String,
        /// This node's store identity.
        store: String,
    },
    /// The address this node would publish for the others to dial is not one they can
    /// dial; nothing was bound or sent to etcd.
    #[error(
        "other nodes cannot dial {address:?}: {reason}; set EtcdConfig::address to the ip:port \
         the other nodes reach this node at, or listen on a specific IP (troupe node: --listen)"
    )]
    Address {
        /// The address that would have been published (the listen address when
        /// `EtcdConfig::address` is empty).
        address: String,
        /// What is wrong with it.
        reason: &'static str,
    },
}

/// Checks the address a node publishes in its membership record (`configured`, or the
/// listen address `listen` when that is empty): other nodes parse it as a
/// [`SocketAddr`] and dial it, so it must be one, with a specific IP (`0.0.0.0` or `::`
/// would have every other node dial itself) and a port (a listen port 0 is replaced by
/// the bound one).
fn check_published_address(configured: &str, listen: SocketAddr) -> Result<(), ClusterError> {
    let refused = |address: String, reason: &'static str| Err(ClusterError::Address { address, reason });
    if configured.is_empty() {
        if listen.ip().is_unspecified() {
            return refused(
                listen.to_string(),
                "EtcdConfig::address is empty, so the listen address would be published, and its IP is unspecified",
            );
        }
        return Ok(());
    }
    let Ok(address) = configured.parse::<SocketAddr>() else {
        return refused(
            configured.to_string(),
            "it is not ip:port (host names are not resolved)",
        );
    };
    if address.ip().is_unspecified() {
        return refused(configured.to_string(), "its IP is unspecified");
    }
    if address.port() == 0 {
        return refused(configured.to_string(), "its port is 0");
    }
    Ok(())
}

/// Whether a node listens at `address` (published by another node under this node's
/// name): a connection within [`NODE_NAME_CHECK_TIMEOUT_MS`]. An address that is not
/// `ip:port` is nobody's.
async fn answers(address: String) -> bool {
    let Ok(address) = address.parse::<SocketAddr>() else {
        return false;
    };
    let timeout = Duration::from_millis(NODE_NAME_CHECK_TIMEOUT_MS);
    matches!(
        tokio::time::timeout(timeout, tokio::net::TcpStream::connect(address)).await,
        Ok(Ok(_))
    )
}

/// What a node did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClusterStats {
    /// Calls this node ran on its own runtime (including refused ones).
    pub local_calls: u64,
    /// Calls this node sent to another node.
    pub forwarded_calls: u64,
    /// "Not owner" refusals after which a call looked its target up again.
    pub reroutes: u64,
    /// Keyed requests sent again after their target's owner could not be reached (an
    /// unkeyed one ends `Unreachable` instead: it may have run).
    pub keyed_retries: u64,
    /// Calls sent again, to the owner looked up anew, after the transport said the
    /// request never left this node (at most [`NOT_SENT_RETRIES_MAX`] per call): it
    /// cannot have run, keyed or not.
    pub not_sent_retries: u64,
    /// New leases this node took by itself after it lost one
    /// ([`ClusterNode::rejoin_after_a_lost_lease`]).
    pub rejoins: u64,
    /// Activations that found this node's placement from an earlier activation still in
    /// etcd (its release had not run, or failed) and released it and placed anew.
    pub placements_replaced: u64,
    /// Calls from this node's turns to actors on other nodes.
    pub turn_calls_forwarded: u64,
    /// Tells (fire-and-forget messages) from this node's turns to actors on other nodes.
    pub turn_tells_forwarded: u64,
    /// Deadlock probes this node sent to other nodes.
    pub probes_sent: u64,
    /// Deadlock probes this node received.
    pub probes_received: u64,
    /// Deadlock probes dropped here: queue full, over the rate or path limit, or the
    /// dispatcher busy (a dropped probe never refuses a call: the call then ends by its
    /// deadline, or by a later probe).
    pub probes_dropped: u64,
    /// Calls from this node's turns refused with `DeadlockDetected` because a probe came
    /// back around a cycle.
    pub deadlocks_found_by_probes: u64,
}

#[derive(Default)]
pub(crate) struct Counters {
    local_calls: AtomicU64,
    forwarded_calls: AtomicU64,
    reroutes: AtomicU64,
    keyed_retries: AtomicU64,
    not_sent_retries: AtomicU64,
    rejoins: AtomicU64,
    turn_calls_forwarded: AtomicU64,
    turn_tells_forwarded: AtomicU64,
    pub(crate) probes_sent: AtomicU64,
    pub(crate) probes_dropped: AtomicU64,
    pub(crate) deadlocks_found_by_probes: AtomicU64,
}

pub(crate) struct Inner {
    pub(crate) node: NodeId,
    address: SocketAddr,
    placement: EtcdPlacement,
    ownership: Arc<Ownership>,
    pub(crate) handle: RuntimeHandle,
    routes: Mutex<RouteCache>,
    clients: Mutex<HashMap<NodeId, Arc<TransportClient>>>,
    pub(crate) counters: Counters,
    fenced_off: troupe_runtime::Latch<LeaseLostReason>,
    /// Whether the node takes a new lease by itself once it lost one and every
    /// activation ended ([`ClusterNode::rejoin_after_a_lost_lease`]).
    rejoin: std::sync::atomic::AtomicBool,
    /// This node's open calls to other nodes made by turns, by call id (the wait-for
    /// edge's id in this runtime).
    pub(crate) remote_waits: Mutex<HashMap<u64, RemoteWaitEntry>>,
    /// Work for the probe task.
    pub(crate) probes: ProbeChannel,
    /// The probe rate window: its start and the probes sent in it.
    pub(crate) probe_window: Mutex<(troupe_core::Deadline, u64)>,
    /// Planted bug (feature `planted-bugs`): no probe is ever sent.
    #[cfg(feature = "planted-bugs")]
    pub(crate) planted_no_probes: std::sync::atomic::AtomicBool,
}

/// One member of a Troupe cluster: a [`Runtime`] whose store is a [`PlacedStore`], a
/// [`TransportServer`] other nodes call, and a router for calls.
///
/// [`ClusterNode::invoke`] runs a call wherever its target lives: it finds the owner (a
/// cached route, else [`Placement::lookup`]); if it is this node, or nobody, the local
/// runtime runs it (activation places the actor here and claims it with the fence); else
/// the call goes to the owner's published address. A node that does not own the target
/// (the route was stale: the owner lost the actor, or someone placed it first) refuses
/// with [`StoreError::NotOwner`] before anything runs, and the caller looks the owner up
/// again and retries, until its deadline.
///
/// The node installs two routers in its runtime: a [`troupe_runtime::TurnCallRouter`]
/// for calls made by turns and a [`troupe_runtime::RootCallRouter`] for root requests
/// made through the runtime ([`RuntimeHandle::invoke_routed`], a turn's
/// `invoke_as_root`), so an agent system attached to [`ClusterNode::handle`] reaches
/// its agents wherever they are placed (see docs/cluster.md, "Agents on the cluster").
/// Both carry idempotency keys: a keyed root request
/// ([`RuntimeHandle::invoke_routed_keyed`]) or a turn's keyed call
/// (`Caller::invoke_keyed`) runs keyed on the target's owner, here or across the
/// transport, so an attempt whose outcome its caller did not learn (`Timeout`,
/// `Unreachable`) can be sent again with the same key, through any node, and lands once.
///
/// When the lease is lost, the node refuses every claim and commit at once and
/// deactivates every activation it has; [`ClusterNode::fenced_off`] resolves when that
/// is done. Such a node stays a client (its calls are routed to the new owners) but
/// owns nothing; start a new node (a new lease) to serve again.
pub struct ClusterNode {
    inner: Arc<Inner>,
    runtime: Option<Runtime>,
    server: Option<TransportServer>,
    tasks: Vec<JoinHandle<()>>,
}

impl ClusterNode {
    /// Binds `listen`, joins the cluster (publishing `etcd.address`, or the bound address
    /// if that is empty) and starts `runtime` with `store` under etcd placement.
    ///
    /// `runtime` is the builder with the actor kinds registered; the node sets its store
    /// and its observer (an observer set before is replaced).
    ///
    /// # Errors
    /// [`ClusterError::Address`] if the address to publish is not one other nodes can
    /// dial (`etcd.address` not `ip:port`, or with an unspecified IP or port 0; or empty
    /// with `listen` on an unspecified IP), before anything is bound;
    /// [`ClusterError::Listen`] if `listen` cannot be bound;
    /// [`ClusterError::NodeNameInUse`] if a live node serves under this node's name at
    /// another address; [`ClusterError::StoreMismatch`] if `etcd.store_identity` is set
    /// and the cluster is bound to another store; [`ClusterError::Join`] if the etcd
    /// configuration is invalid or etcd does not answer.
    pub async fn start<S: FencedClaim>(
        mut etcd: EtcdConfig,
        listen: SocketAddr,
        runtime: RuntimeBuilder,
        store: S,
    ) -> Result<Self, ClusterError> {
        check_published_address(&etcd.address, listen)?;
        let listener = TcpListener::bind(listen)
            .await
            .map_err(|cause| ClusterError::Listen { address: listen, cause })?;
        let address = listener
            .local_addr()
            .map_err(|cause| ClusterError::Listen { address: listen, cause })?;
        if etcd.address.is_empty() {
            etcd.address = address.to_string();
        }
        let node = etcd.node.clone();
        let placement = EtcdPlacement::join_unless_in_use(etcd, answers)
            .await
            .map_err(|error| match error {
                PlacementError::NodeNameInUse { node, address } => ClusterError::NodeNameInUse { node, address },
                PlacementError::StoreMismatch {
                    cluster,
                    recorded,
                    store,
                } => ClusterError::StoreMismatch {
                    cluster,
                    recorded,
                    store,
                },
                other => ClusterError::Join(other),
            })?;
        let (ownership, mut releases) = Ownership::new(placement.clone());
        let shared = runtime.shared_record_kinds().cloned().collect();
        let runtime = runtime
            .store(Arc::new(PlacedStore::new(store, Arc::clone(&ownership), shared)))
            .observer(Arc::new(ReleaseObserver {
                ownership: Arc::clone(&ownership),
            }))
            .start();
        let handle = runtime.handle();
        let (probe_sender, probe_receiver) = tokio::sync::mpsc::channel(PROBE_QUEUE_CAPACITY);
        let probes = ProbeChannel::new(probe_sender);
        let server = TransportServer::serve_with_probes(listener, handle.clone(), Some(Arc::new(probes.clone())))
            .map_err(|cause| ClusterError::Listen { address: listen, cause })?;
        let fenced_off = troupe_runtime::Latch::new();
        let now = handle.now();
        let inner = Arc::new(Inner {
            node,
            address,
            placement,
            ownership,
            handle,
            routes: Mutex::new(RouteCache::default()),
            clients: Mutex::new(HashMap::default()),
            counters: Counters::default(),
            fenced_off,
            rejoin: std::sync::atomic::AtomicBool::new(false),
            remote_waits: Mutex::new(HashMap::default()),
            probes,
            probe_window: Mutex::new((now, 0)),
            #[cfg(feature = "planted-bugs")]
            planted_no_probes: std::sync::atomic::AtomicBool::new(false),
        });
        let hooks = Arc::new(Hooks {
            inner: Arc::downgrade(&inner),
        });
        let turn_router: Arc<dyn troupe_runtime::TurnCallRouter> = Arc::clone(&hooks) as Arc<Hooks>;
        if inner.handle.set_turn_call_router(turn_router).is_err() {
            unreachable!("the node's runtime was just started: no router is installed yet");
        }
        if inner.handle.set_root_call_router(hooks).is_err() {
            unreachable!("the node's runtime was just started: no root router is installed yet");
        }
        let probe_task = tokio::spawn(crate::probes::probe_loop(Arc::clone(&inner), probe_receiver));
        let release_task = tokio::spawn({
            let ownership = Arc::clone(&inner.ownership);
            async move {
                while let Some(actor) = releases.recv().await {
                    ownership.release_if_idle(&actor).await;
                }
            }
        });
        let lease_task = tokio::spawn({
            let inner = Arc::clone(&inner);
            async move {
                loop {
                    let reason = inner.placement.lease_lost().await;
                    inner.drop_activations().await;
                    if !inner.rejoin.load(Ordering::SeqCst) || !inner.rejoin_with_a_new_lease(&reason).await {
                        inner.fenced_off.set(reason);
                        return;
                    }
                }
            }
        });
        Ok(Self {
            inner,
            runtime: Some(runtime),
            server: Some(server),
            tasks: vec![release_task, lease_task, probe_task],
        })
    }

    /// This node's name.
    pub fn node(&self) -> &NodeId {
        &self.inner.node
    }

    /// The address the transport listens on.
    pub fn address(&self) -> SocketAddr {
        self.inner.address
    }

    /// The node's runtime (for deadlines: [`RuntimeHandle::deadline_in`]).
    pub fn handle(&self) -> &RuntimeHandle {
        &self.inner.handle
    }

    /// The node's placement in etcd.
    pub fn placement(&self) -> &EtcdPlacement {
        &self.inner.placement
    }

    /// What the node did so far.
    pub fn stats(&self) -> ClusterStats {
        let counters = &self.inner.counters;
        ClusterStats {
            local_calls: counters.local_calls.load(Ordering::Relaxed),
            forwarded_calls: counters.forwarded_calls.load(Ordering::Relaxed),
            reroutes: counters.reroutes.load(Ordering::Relaxed),
            keyed_retries: counters.keyed_retries.load(Ordering::Relaxed),
            not_sent_retries: counters.not_sent_retries.load(Ordering::Relaxed),
            rejoins: counters.rejoins.load(Ordering::Relaxed),
            placements_replaced: self.inner.ownership.replaced.load(Ordering::Relaxed),
            turn_calls_forwarded: counters.turn_calls_forwarded.load(Ordering::Relaxed),
            turn_tells_forwarded: counters.turn_tells_forwarded.load(Ordering::Relaxed),
            probes_sent: counters.probes_sent.load(Ordering::Relaxed),
            probes_received: self.inner.probes.received(),
            probes_dropped: counters.probes_dropped.load(Ordering::Relaxed) + self.inner.probes.dropped(),
            deadlocks_found_by_probes: counters.deadlocks_found_by_probes.load(Ordering::Relaxed),
        }
    }

    /// Plants a bug for the planted-bug tests (feature `planted-bugs`): this node never
    /// sends a deadlock probe, so cycles across nodes end only by deadlines.
    #[cfg(feature = "planted-bugs")]
    pub fn plant_no_probes(&self) {
        self.inner.planted_no_probes.store(true, Ordering::SeqCst);
    }

    /// Makes this node take a new lease by itself after it lost its lease (etcd did not
    /// answer its renewals in time, for instance while etcd restarted), once every
    /// activation it had has ended: it revokes the lost lease (its placements go at
    /// once), joins again under its name and address, and serves again; attempts every
    /// [`REJOIN_RETRY_PAUSE_MS`] while etcd does not answer, at most
    /// [`REJOIN_ATTEMPTS_MAX`]. Off by default: a node that lost its lease then stays
    /// fenced off ([`ClusterNode::fenced_off`]) and a supervisor starts a new one. With
    /// it on, `fenced_off` resolves only when the node gives up (a live node took its
    /// name, or the attempts ran out). Safe for the same reason a restart is: nothing
    /// the node ran under the old lease is active any more, its stale commits meet the
    /// newer fences, and every actor is claimed anew under the new lease.
    pub fn rejoin_after_a_lost_lease(&self, rejoin: bool) {
        self.inner.rejoin.store(rejoin, Ordering::SeqCst);
    }

    /// Resolves once the lease was lost and every activation of this node has ended
    /// (with [`ClusterNode::rejoin_after_a_lost_lease`], only once the node gave up
    /// rejoining).
    pub async fn fenced_off(&self) -> LeaseLostReason {
        self.inner.fenced_off.wait().await
    }

    /// Runs `payload` on `target`, wherever the cluster has it: see
    /// [`ClusterClient::invoke`].
    ///
    /// # Errors
    /// As [`ClusterClient::invoke`].
    pub async fn invoke(&self, target: &ActorId, payload: Bytes, deadline: Deadline) -> Result<Bytes, InvokeError> {
        self.client().invoke(target, payload, deadline).await
    }

    /// A handle that calls through this node; clones share the node's routes and
    /// connections, and may be moved to other tasks.
    pub fn client(&self) -> ClusterClient {
        ClusterClient {
            inner: Arc::clone(&self.inner),
        }
    }

    /// Stops the node as a clean exit: the runtime shuts down (its actors save under
    /// their fences), then the node leaves the cluster (its lease is revoked, which
    /// removes its membership and placements at once).
    ///
    /// # Errors
    /// [`PlacementError::EtcdUnavailable`] if etcd did not answer the revoke; the lease
    /// then ends after its TTL.
    pub async fn leave(mut self) -> Result<(), PlacementError> {
        // The transport keeps serving while the runtime shuts down: a request in flight
        // gets its reply, and one that arrives meanwhile is answered `Shutdown`
        // (nothing ran), on which its caller looks the owner up again. Before, the
        // server went first: calls in flight here ended `Unreachable` ("the connection
        // broke": they may or may not have run). The server goes before the revoke, so
        // that its listener is closed by the time the lease is (a node started again at
        // this address right after can bind it).
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown().await;
        }
        if let Some(server) = self.server.take() {
            // The replies of the turns that just finished are written before the
            // connections close (dropping the server closes them at once).
            let drained_by = tokio::time::Instant::now() + Duration::from_millis(LEAVE_REPLY_DRAIN_MS_MAX);
            loop {
                let stats = server.stats();
                if (stats.requests_running == 0 && stats.bytes_in_flight == 0)
                    || tokio::time::Instant::now() >= drained_by
                {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(LEAVE_REPLY_DRAIN_POLL_MS)).await;
            }
        }
        for task in self.tasks.drain(..) {
            task.abort();
        }
        self.inner.ownership.mark_lost();
        self.inner.placement.leave().await
    }

    /// Stops the node as a crash does, seen from the cluster: it stops serving and
    /// committing at once, and its lease is not revoked but left to expire, so its
    /// actors move to other nodes one lease TTL later.
    pub async fn abandon(mut self) {
        self.inner.ownership.mark_lost();
        self.server.take();
        for task in self.tasks.drain(..) {
            task.abort();
        }
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown().await;
        }
        self.inner.placement.stop_renewing();
    }
}

/// The owner a node last found for each actor: at most [`ROUTE_CACHE_ENTRIES_MAX`]
/// entries, emptied when full.
#[derive(Default)]
struct RouteCache(HashMap<ActorId, NodeId>);

impl RouteCache {
    fn get(&self, actor: &ActorId) -> Option<&NodeId> {
        self.0.get(actor)
    }

    fn remove(&mut self, actor: &ActorId) {
        self.0.remove(actor);
    }

    fn clear(&mut self) {
        self.0.clear();
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.0.len()
    }

    /// Remembers that `owner` served `actor`.
    fn remember(&mut self, actor: &ActorId, owner: NodeId) {
        if self.0.len() >= ROUTE_CACHE_ENTRIES_MAX && !self.0.contains_key(actor) {
            self.0.clear();
        }
        self.0.insert(actor.clone(), owner);
    }

    /// `refused_by` (this node when `None`) refused `actor` as not its owner, naming
    /// `hint` as the owner if it knew one: the route is dropped, and the hint becomes
    /// the next route unless it names the node that refused (under the cap, as
    /// [`RouteCache::remember`]).
    fn reroute(&mut self, actor: &ActorId, refused_by: Option<&NodeId>, hint: Option<NodeId>) {
        self.0.remove(actor);
        if let Some(hint) = hint {
            if Some(&hint) != refused_by {
                self.remember(actor, hint);
            }
        }
    }
}

/// Calls actors through a [`ClusterNode`] (from [`ClusterNode::client`]); cheap to clone.
#[derive(Clone)]
pub struct ClusterClient {
    inner: Arc<Inner>,
}

impl ClusterClient {
    /// The node this client calls through.
    pub fn node(&self) -> &NodeId {
        &self.inner.node
    }

    /// A deadline `timeout` from now on the node's clock.
    pub fn deadline_in(&self, timeout: Duration) -> Deadline {
        self.inner.handle.deadline_in(timeout)
    }

    /// Runs `payload` on `target`, wherever the cluster has it, and returns the reply;
    /// resolves by `deadline` (on this node's clock).
    ///
    /// # Errors
    /// Whatever the owner's runtime returns; [`InvokeError::Unreachable`] if the owner
    /// could not be reached (the request may have run: not retried, as on one node; use
    /// [`ClusterClient::invoke_keyed`] for a request that may be sent again);
    /// [`InvokeError::Timeout`] if the deadline passed, including while the owner could
    /// not be found (etcd unavailable, an owner whose lease has not ended yet).
    pub async fn invoke(&self, target: &ActorId, payload: Bytes, deadline: Deadline) -> Result<Bytes, InvokeError> {
        let context = CallContext::root(deadline);
        self.inner
            .routed(target, payload, deadline, Origin::Root(&context))
            .await
    }

    /// As [`ClusterClient::invoke`], for one attempt of the logical request `key` names
    /// ([`RuntimeHandle::invoke_routed_keyed`]): the owner runs it keyed, so its effect
    /// lands once however often it is sent with that key, through whichever node. For
    /// the same reason the node sends it again by itself when the owner could not be
    /// reached, every [`ROUTE_RETRY_DELAY_MS`] with the owner looked up again, until
    /// the deadline (an owner that died is replaced once its lease ends); see
    /// [`ClusterStats::keyed_retries`].
    ///
    /// # Errors
    /// As [`ClusterClient::invoke`], except that `Unreachable` comes only when the
    /// deadline passed with the owner still unreachable (its last error);
    /// `Refused(RootInvokeInsideTurn)` inside a turn (a turn uses
    /// [`troupe_runtime::Caller::call_keyed`]).
    pub async fn invoke_keyed(
        &self,
        target: &ActorId,
        key: &IdempotencyKey,
        payload: Bytes,
        deadline: Deadline,
    ) -> Result<Bytes, InvokeError> {
        self.inner
            .handle
            .invoke_routed_keyed(target, key, payload, deadline)
            .await
    }

    /// Fire-and-forget: sends `payload` to `target`, wherever the cluster has it, and
    /// returns once the owner's runtime accepted it (in the target's mailbox, or held for
    /// its activation), by `deadline` (on this node's clock). Its turn then runs on its
    /// own under that deadline; its reply and errors go nowhere. As `RuntimeHandle::tell`
    /// on one node, the accepted message is in memory only (durable delivery is the agent
    /// inbox's job).
    ///
    /// # Errors
    /// The owner's refusals at acceptance (`Busy`, `ActorNotFound`, `Rejected`,
    /// `Shutdown`, ...); [`InvokeError::Unreachable`] if the owner could not be reached
    /// (it may have been accepted: not sent again; use [`ClusterClient::tell_keyed`] for
    /// a message that may be sent again); [`InvokeError::Timeout`] if the deadline passed.
    pub async fn tell(&self, target: &ActorId, payload: Bytes, deadline: Deadline) -> Result<(), InvokeError> {
        self.inner
            .routed(target, payload, deadline, Origin::RootTell { key: None })
            .await
            .map(|_| ())
    }

    /// As [`ClusterClient::tell`], for one delivery of the message `key` names
    /// (`RuntimeHandle::tell_keyed` on the owner): a turn of `target` with this key that
    /// committed makes every later delivery a no-op, so the message lands once however
    /// often it is sent with that key, through whichever node. For the same reason the
    /// node sends it again by itself while the owner cannot be reached, until the
    /// deadline, as [`ClusterClient::invoke_keyed`] does.
    ///
    /// # Errors
    /// As [`ClusterClient::tell`], except that `Unreachable` comes only when the deadline
    /// passed with the owner still unreachable (its last error).
    pub async fn tell_keyed(
        &self,
        target: &ActorId,
        key: &IdempotencyKey,
        payload: Bytes,
        deadline: Deadline,
    ) -> Result<(), InvokeError> {
        self.inner
            .routed(target, payload, deadline, Origin::RootTell { key: Some(key) })
            .await
            .map(|_| ())
    }

    /// As [`ClusterClient::invoke`], under `context` instead of a root context with only
    /// a deadline: the target's turn runs at its depth, with its chain, deadline and
    /// trace id, wherever the target lives (on another node the transport carries them;
    /// see [`CallContext::with_trace_id`]). The turns the call leads to, on any node,
    /// see the same trace id.
    ///
    /// # Errors
    /// As [`ClusterClient::invoke`].
    pub async fn invoke_in(
        &self,
        target: &ActorId,
        payload: Bytes,
        context: CallContext,
    ) -> Result<Bytes, InvokeError> {
        let deadline = context.deadline();
        self.inner
            .routed(target, payload, deadline, Origin::Root(&context))
            .await
    }
}

/// A fire-and-forget message on its way (a client's or a turn's), keyed or not: one
/// attempt of [`Inner::routed`], sent to the owner's node or delivered here.
struct Tell<'a> {
    target: &'a ActorId,
    key: Option<&'a IdempotencyKey>,
    payload: Bytes,
    /// The context the target runs under.
    context: CallContext,
}

impl Tell<'_> {
    /// Sends it over `client` (from `caller`'s turn, if any); the reply is empty.
    async fn over(self, client: &TransportClient, caller: Option<&ActorId>) -> Result<Bytes, RequestFailure> {
        let Tell {
            target,
            key,
            payload,
            context,
        } = self;
        let kind = match key {
            None => RequestKind::Tell,
            Some(key) => RequestKind::KeyedTell(key),
        };
        client
            .attempt(target, payload, context, caller, kind)
            .await
            .map(|_| Bytes::new())
    }

    /// Delivers it on this node's runtime; the reply is empty.
    async fn here(self, handle: &RuntimeHandle) -> Result<Bytes, InvokeError> {
        let Tell {
            target,
            key,
            payload,
            context,
        } = self;
        let told = match key {
            None => handle.tell_for_turn(target, payload, context).await,
            Some(key) => handle.tell_for_turn_keyed(target, key, payload, context).await,
        };
        told.map(|()| Bytes::new())
    }
}

/// A turn's call to an actor on another node, as [`Inner::remote_turn_call`] sends it.
pub(crate) struct RemoteTurnCall<'a> {
    /// The node that owns the target.
    pub(crate) owner: &'a NodeId,
    /// The actor whose turn waits.
    pub(crate) caller: &'a ActorId,
    /// The actor called.
    pub(crate) target: &'a ActorId,
    /// The call's idempotency key, for a keyed call.
    pub(crate) key: Option<&'a IdempotencyKey>,
}

/// Who makes a routed call.
#[derive(Clone, Copy)]
pub(crate) enum Origin<'a> {
    /// A request from outside any turn, under this context (a root one, unless the
    /// request arrived with its place in a call tree).
    Root(&'a CallContext),
    /// A root request that came through the runtime's root router
    /// ([`troupe_runtime::RootCallRouter`]): from outside any turn, or from a turn's
    /// `invoke_as_root` (so its local path does not refuse a request made in a turn).
    /// With a key, one attempt of a keyed request (`RuntimeHandle::invoke_routed_keyed`):
    /// it runs keyed wherever the target lives.
    RoutedRoot { key: Option<&'a IdempotencyKey> },
    /// A turn of `caller`; the callee runs under `context` (admission already ran). With
    /// a key, a keyed call (`Caller::invoke_keyed`): it runs keyed wherever the target
    /// lives.
    Turn {
        caller: &'a ActorId,
        context: &'a CallContext,
        key: Option<&'a IdempotencyKey>,
    },
    /// A fire-and-forget message from outside any turn (`ClusterClient::tell`), for the
    /// target's runtime to accept (the reply is empty), under a root context with the
    /// deadline. With a key (`ClusterClient::tell_keyed`), delivered keyed wherever the
    /// target lives.
    RootTell { key: Option<&'a IdempotencyKey> },
    /// A fire-and-forget message from a turn of `caller`, for the target's runtime to
    /// accept (the reply is empty); the target runs under `context` (admission already
    /// ran). No wait-for edge: nobody waits. With a key, a keyed tell
    /// (`Caller::tell_keyed`): it is delivered keyed wherever the target lives.
    TellFromTurn {
        caller: &'a ActorId,
        context: &'a CallContext,
        key: Option<&'a IdempotencyKey>,
    },
}

impl Origin<'_> {
    /// Whether the call is one attempt of a keyed request: sent again, it lands once.
    fn is_keyed(&self) -> bool {
        matches!(
            self,
            Origin::RoutedRoot { key: Some(_) }
                | Origin::Turn { key: Some(_), .. }
                | Origin::TellFromTurn { key: Some(_), .. }
                | Origin::RootTell { key: Some(_) }
        )
    }
}

impl Drop for ClusterNode {
    /// A node dropped without [`ClusterNode::leave`] or [`ClusterNode::abandon`] ends
    /// as an abandoned one: it stops committing, and its lease is no longer renewed, so
    /// its actors move to other nodes one lease TTL later. What the embedder may still
    /// hold of it (a [`ClusterClient`], a [`RuntimeHandle`] clone, an agent client
    /// attached to it) keeps the etcd client for lookups, not the lease: before, the
    /// lease task lived as long as any of those, renewing the lease of a node that
    /// served nothing, so its actors were unreachable for as long.
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
        // After `leave` or `abandon` (or one of them cancelled half-way) this is done
        // already, or finishes what they started.
        self.inner.ownership.mark_lost();
        self.inner.placement.stop_renewing();
    }
}

impl Inner {
    /// Runs a call wherever `target` lives (see [`ClusterClient::invoke`]).
    pub(crate) async fn routed(
        self: &Arc<Self>,
        target: &ActorId,
        payload: Bytes,
        deadline: Deadline,
        origin: Origin<'_>,
    ) -> Result<Bytes, InvokeError> {
        let inner = self;
        let clock = inner.handle.clock();
        // A deadline further than the longest invocation is cut to it, as a root request
        // on one node is (`RuntimeHandle::invoke`): the loop below retries until the
        // deadline while the owner cannot be found, and a far one (the end of time) kept
        // it retrying as long. A turn's call already has a deadline within it.
        let now = clock.now();
        let deadline = deadline.cut_to_longest_invoke(now);
        let capped_context;
        let origin = match origin {
            Origin::Root(context) if context.deadline() > deadline => {
                capped_context = context.with_deadline(deadline);
                Origin::Root(&capped_context)
            }
            other => other,
        };
        let timeout_ms = deadline.remaining_ms(now);
        let timeout = || InvokeError::Timeout {
            target: target.clone(),
            timeout_ms,
        };
        let mut refused_before = false;
        // Attempts sent again because the transport never sent them.
        let mut not_sent_retries = 0_u32;
        // A keyed call's last `Unreachable`, returned if the deadline passes before an
        // attempt gets through.
        let mut unreachable: Option<InvokeError> = None;
        loop {
            if deadline.has_passed(clock.now()) {
                return Err(unreachable.unwrap_or_else(timeout));
            }
            let cached = inner.routes().get(target).cloned();
            let route_was_cached = cached.is_some();
            let owner = match cached {
                Some(owner) => Some(owner),
                None => match clock.run_until(deadline, inner.placement.lookup(target)).await {
                    // The deadline passed while looking the owner up: a keyed call that
                    // met an unreachable owner before says so, as at the loop's top.
                    Err(_) => return Err(unreachable.unwrap_or_else(timeout)),
                    Ok(Ok(found)) => found.map(|record| record.owner),
                    Ok(Err(error)) => {
                        tracing::debug!(%target, %error, "looking up the owner failed; retrying");
                        inner.pause(deadline).await;
                        continue;
                    }
                },
            };
            let result = match &owner {
                Some(owner) if *owner != inner.node => {
                    let Some(client) = inner.client(owner, deadline).await else {
                        // Not a member (any more): its placement ends with its lease.
                        inner.routes().remove(target);
                        inner.pause(deadline).await;
                        continue;
                    };
                    inner.counters.forwarded_calls.fetch_add(1, Ordering::Relaxed);
                    let forwarded = match origin {
                        Origin::Root(context) => {
                            client
                                .attempt(target, payload.clone(), context.clone(), None, RequestKind::Invoke)
                                .await
                        }
                        Origin::RoutedRoot { key: None } => {
                            let context = CallContext::root(deadline);
                            client
                                .attempt(target, payload.clone(), context, None, RequestKind::Invoke)
                                .await
                        }
                        Origin::RoutedRoot { key: Some(key) } => {
                            let context = CallContext::root(deadline);
                            client
                                .attempt(target, payload.clone(), context, None, RequestKind::Keyed(key))
                                .await
                        }
                        Origin::Turn { caller, context, key } => {
                            inner.counters.turn_calls_forwarded.fetch_add(1, Ordering::Relaxed);
                            let call = RemoteTurnCall {
                                owner,
                                caller,
                                target,
                                key,
                            };
                            inner
                                .remote_turn_call(&client, call, payload.clone(), context.clone())
                                .await
                        }
                        Origin::RootTell { key } => {
                            let tell = Tell {
                                target,
                                key,
                                payload: payload.clone(),
                                context: CallContext::root(deadline),
                            };
                            tell.over(&client, None).await
                        }
                        Origin::TellFromTurn { caller, context, key } => {
                            inner.counters.turn_tells_forwarded.fetch_add(1, Ordering::Relaxed);
                            let tell = Tell {
                                target,
                                key,
                                payload: payload.clone(),
                                context: context.clone(),
                            };
                            tell.over(&client, Some(caller)).await
                        }
                    };
                    // Never sent (the owner's port refused the connection, or the
                    // connection had closed before the request was queued): it cannot
                    // have run, so it goes to whoever owns the actor now, keyed or not.
                    // Before, it ended `Unreachable` like a request that may have run.
                    let never_sent = matches!(
                        &forwarded,
                        Err(failure @ RequestFailure { error: InvokeError::Unreachable { .. }, .. })
                            if failure.was_never_sent()
                    );
                    let forwarded = forwarded.map_err(|failure| failure.error);
                    if matches!(forwarded, Err(InvokeError::Unreachable { .. })) {
                        inner.forget_client(owner, &client);
                    }
                    if never_sent && not_sent_retries < NOT_SENT_RETRIES_MAX && !deadline.has_passed(clock.now()) {
                        not_sent_retries += 1;
                        inner.counters.not_sent_retries.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(%target, %owner, ?forwarded, "the request was never sent; looking the owner up again");
                        inner.routes().remove(target);
                        let pause = Duration::from_millis(NOT_SENT_RETRY_PAUSE_MS).min(deadline.remaining(clock.now()));
                        tokio::time::sleep(pause).await;
                        unreachable = forwarded.err();
                        continue;
                    }
                    if matches!(forwarded, Err(InvokeError::Shutdown)) {
                        // The owner is shutting down (leaving): the request did not run
                        // there, or its turn was rolled back. Its placements go when its
                        // lease is revoked; look the owner up again until then.
                        inner.counters.reroutes.fetch_add(1, Ordering::Relaxed);
                        inner.routes().remove(target);
                        inner.pause(deadline).await;
                        continue;
                    }
                    forwarded
                }
                _ => {
                    inner.counters.local_calls.fetch_add(1, Ordering::Relaxed);
                    match origin {
                        Origin::Root(context) => inner.handle.invoke_in(target, payload.clone(), context.clone()).await,
                        Origin::RoutedRoot { key: None } => {
                            inner
                                .handle
                                .invoke_root_for_router(target, payload.clone(), deadline)
                                .await
                        }
                        Origin::RoutedRoot { key: Some(key) } => {
                            inner
                                .handle
                                .invoke_root_keyed_for_router(target, key, payload.clone(), deadline)
                                .await
                        }
                        Origin::Turn {
                            caller,
                            context,
                            key: None,
                        } => {
                            inner
                                .handle
                                .invoke_for_turn(caller, target, payload.clone(), context.clone())
                                .await
                        }
                        Origin::Turn {
                            caller,
                            context,
                            key: Some(key),
                        } => {
                            inner
                                .handle
                                .invoke_for_turn_keyed(caller, target, key, payload.clone(), context.clone())
                                .await
                        }
                        Origin::RootTell { key } => {
                            let tell = Tell {
                                target,
                                key,
                                payload: payload.clone(),
                                context: CallContext::root(deadline),
                            };
                            tell.here(&inner.handle).await
                        }
                        Origin::TellFromTurn { context, key, .. } => {
                            let tell = Tell {
                                target,
                                key,
                                payload: payload.clone(),
                                context: context.clone(),
                            };
                            tell.here(&inner.handle).await
                        }
                    }
                }
            };
            if let Err(InvokeError::StorageFailed {
                source: StoreError::NotOwner { owner: None, .. },
                ..
            }) = &result
            {
                if inner.ownership.is_lost() && owner.as_ref().is_none_or(|owner| *owner == inner.node) {
                    if route_was_cached {
                        // A route to this node cached before the lease was lost (the
                        // routes are emptied only once every activation here ended):
                        // the actor may be placed on another node by now, so etcd is
                        // asked. Before, the call failed here with this non-transient
                        // refusal while the new owner served the actor.
                        inner.routes().remove(target);
                        continue;
                    }
                    // etcd names this node or nobody, and this node refused it because
                    // its lease is lost for good: it will refuse it again until the
                    // deadline (a turn looping here held up the node's own
                    // deactivations, and so its rejoining, for the call's whole
                    // timeout, 30 s in the mention fault scenario). The caller hears
                    // it now.
                    return result;
                }
            }
            match result {
                Err(InvokeError::StorageFailed {
                    source: StoreError::NotOwner { owner: hint, .. },
                    ..
                }) => {
                    inner.counters.reroutes.fetch_add(1, Ordering::Relaxed);
                    let hint = hint.and_then(|hint| NodeId::new(hint).ok());
                    inner.routes().reroute(target, owner.as_ref(), hint);
                    if refused_before {
                        inner.pause(deadline).await;
                    }
                    refused_before = true;
                }
                Err(error @ InvokeError::Unreachable { .. }) => {
                    inner.routes().remove(target);
                    if !origin.is_keyed() {
                        return Err(error);
                    }
                    // A keyed attempt that may have run is safe to send again: the
                    // owner (this one, or the next once its lease ends) answers a key
                    // whose turn committed with the recorded reply, and a commit still
                    // in flight on an owner that lost the actor is refused by the fence
                    // the next one claims (idempotency.rs in troupe-runtime).
                    inner.counters.keyed_retries.fetch_add(1, Ordering::Relaxed);
                    unreachable = Some(error);
                    inner.pause(deadline).await;
                }
                other => {
                    if other.is_ok() {
                        let owner = owner.unwrap_or_else(|| inner.node.clone());
                        inner.remember(target, owner);
                    }
                    return other;
                }
            }
        }
    }

    /// Whether `target` is placed on another node right now (the root router's
    /// [`troupe_runtime::RootCallRouter::placed_elsewhere`], which the agent layer's
    /// resumes ask before waking an actor with a local tell): one etcd read
    /// ([`Placement::lookup`], bounded by the etcd request timeout), nothing activated.
    /// `false` when the placement names this node (under any lease of its name: a claim
    /// here replaces an old one) or there is none.
    ///
    /// The route cache is neither read nor written: a cached route may be stale (its
    /// owner died and its lease ended; the cache learns it only when a call there
    /// fails), and an actor skipped on a stale route would never be taken over by the
    /// node that asks.
    ///
    /// # Errors
    /// `Unreachable` naming `target` if etcd did not answer: where it is placed is not
    /// known.
    pub(crate) async fn placed_elsewhere(&self, target: &ActorId) -> Result<bool, InvokeError> {
        match self.placement.lookup(target).await {
            Ok(record) => Ok(record.is_some_and(|record| record.owner != self.node)),
            Err(error) => Err(InvokeError::Unreachable {
                target: target.clone(),
                cause: format!("looking up its placement failed: {error}"),
            }),
        }
    }

    fn routes(&self) -> MutexGuard<'_, RouteCache> {
        self.routes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn remember(&self, actor: &ActorId, owner: NodeId) {
        self.routes().remember(actor, owner);
    }

    async fn pause(&self, deadline: Deadline) {
        let clock = self.handle.clock();
        let delay = Duration::from_millis(ROUTE_RETRY_DELAY_MS).min(deadline.remaining(clock.now()));
        tokio::time::sleep(delay).await;
    }

    /// Runs a turn's call through the router: see [`Inner::routed`].
    pub(crate) async fn call_from_turn(self: &Arc<Self>, call: TurnCall) -> Result<Bytes, InvokeError> {
        let TurnCall {
            caller,
            target,
            payload,
            context,
            key,
        } = call;
        let origin = Origin::Turn {
            caller: &caller,
            context: &context,
            key: key.as_ref(),
        };
        self.routed(&target, payload, context.deadline(), origin).await
    }

    /// Delivers a turn's tell through the router: see [`Inner::routed`]. Returns once
    /// the owner's runtime accepted it.
    pub(crate) async fn tell_from_turn(self: &Arc<Self>, call: TurnCall) -> Result<(), InvokeError> {
        let TurnCall {
            caller,
            target,
            payload,
            context,
            key,
        } = call;
        // With a key (`Caller::tell_keyed`), delivered keyed wherever the target lives,
        // and sent again while its owner is unreachable.
        let origin = Origin::TellFromTurn {
            caller: &caller,
            context: &context,
            key: key.as_ref(),
        };
        self.routed(&target, payload, context.deadline(), origin)
            .await
            .map(|_| ())
    }

    /// The client for `owner`, from its membership record; `None` if it is not a member.
    pub(crate) async fn client(&self, owner: &NodeId, deadline: Deadline) -> Option<Arc<TransportClient>> {
        if let Some(client) = self.clients().get(owner) {
            return Some(Arc::clone(client));
        }
        let clock = self.handle.clock();
        let members = clock.run_until(deadline, self.placement.nodes()).await.ok()?.ok()?;
        let member = members.into_iter().find(|member| member.node == *owner)?;
        let address: SocketAddr = match member.address.parse() {
            Ok(address) => address,
            Err(error) => {
                tracing::warn!(node = %owner, address = %member.address, %error, "a member published an address that is not host:port");
                return None;
            }
        };
        let client = Arc::new(TransportClient::new(address, clock));
        Some(Arc::clone(self.clients().entry(owner.clone()).or_insert(client)))
    }

    /// Forgets `client`, the one for `owner`, after it could not reach `owner`: a node
    /// that starts again under its name may publish another address (a new port, a new
    /// IP), and a node that left should not keep a client here. The next call to `owner`
    /// reads its membership record again. A client put there meanwhile stays.
    pub(crate) fn forget_client(&self, owner: &NodeId, client: &Arc<TransportClient>) {
        let mut clients = self.clients();
        if clients.get(owner).is_some_and(|cached| Arc::ptr_eq(cached, client)) {
            clients.remove(owner);
        }
    }

    fn clients(&self) -> MutexGuard<'_, HashMap<NodeId, Arc<TransportClient>>> {
        self.clients.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The lease is lost: refuse every claim and commit, then end every activation.
    async fn drop_activations(&self) {
        self.ownership.mark_lost();
        tracing::warn!(node = %self.node, "lease lost: dropping every activation");
        let ends: Vec<_> = self
            .ownership
            .live_actors()
            .into_iter()
            .map(|actor| {
                let handle = self.handle.clone();
                tokio::spawn(async move {
                    let _ = handle.deactivate(&actor).await;
                })
            })
            .collect();
        for end in ends {
            let _ = end.await;
        }
        self.routes().clear();
    }

    /// Takes a new lease after `reason` lost the old one (every activation has ended):
    /// `true` once the node serves again, `false` if it gave up.
    async fn rejoin_with_a_new_lease(&self, reason: &LeaseLostReason) -> bool {
        for attempt in 1..=REJOIN_ATTEMPTS_MAX {
            match self.placement.rejoin_unless_in_use(answers).await {
                Ok(()) => {
                    self.ownership.rejoined();
                    self.counters.rejoins.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(node = %self.node, ?reason, attempt, "lease lost, then a new one taken: serving again");
                    return true;
                }
                Err(PlacementError::NodeNameInUse { address, .. }) => {
                    tracing::error!(node = %self.node, %address, "lease lost, and a live node took this name: not rejoining");
                    return false;
                }
                Err(error) => {
                    tracing::debug!(node = %self.node, %error, attempt, "taking a new lease failed; trying again");
                    tokio::time::sleep(Duration::from_millis(REJOIN_RETRY_PAUSE_MS)).await;
                }
            }
        }
        tracing::error!(node = %self.node, "lease lost, and no new one after {REJOIN_ATTEMPTS_MAX} attempts: not rejoining");
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn actor(index: usize) -> ActorId {
        ActorId::new("counter", format!("k{index}")).expect("an actor id")
    }

    fn node(name: &str) -> NodeId {
        NodeId::new(name).expect("a node name")
    }

    /// Goal: the route cache holds at most `ROUTE_CACHE_ENTRIES_MAX` entries whichever
    /// way its routes come in, including the owner named by a "not owner" refusal.
    /// Method: as `routed` does when a looked-up owner refuses and names another, which
    /// then serves: `reroute` with the hint, then `remember` of the hinted owner, for
    /// more distinct actors than the cap.
    #[test]
    fn routes_from_not_owner_hints_stay_within_the_cache_cap() {
        let mut routes = RouteCache::default();
        let (stale, hinted) = (node("node-b"), node("node-c"));
        for index in 0..=ROUTE_CACHE_ENTRIES_MAX {
            let target = actor(index);
            routes.reroute(&target, Some(&stale), Some(hinted.clone()));
            routes.remember(&target, hinted.clone());
            assert!(
                routes.len() <= ROUTE_CACHE_ENTRIES_MAX,
                "{} routes after {} actors, over ROUTE_CACHE_ENTRIES_MAX = {ROUTE_CACHE_ENTRIES_MAX}",
                routes.len(),
                index + 1
            );
            assert_eq!(routes.get(&target), Some(&hinted), "the newest route is kept");
        }
    }
}
