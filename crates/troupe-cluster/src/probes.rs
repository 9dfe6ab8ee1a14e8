//! Cross-node deadlock detection by edge chasing (probes).
//!
//! A wait edge is (waiter, call id, target): the waiter's turn waits for the reply of
//! call `call id` to the target. Each node's runtime keeps its own edges in its
//! wait-for graph: local calls (recorded when a turn sends them) and calls to other nodes
//! ([`RuntimeHandle::begin_remote_wait`](troupe_runtime::RuntimeHandle::begin_remote_wait),
//! marked remote). The protocol:
//!
//! - When a remote edge W→T is recorded, this node sends a probe {initiator W,
//!   initiator call id, path [W]} to T's host (the owner the call was sent to). When a
//!   local edge is recorded whose path of waits from its target reaches remote edges
//!   X→Y of this node, a probe is sent from each of those edges (initiator X, its call).
//! - A node receiving a probe for actor X: if X is the initiator (and this node is the
//!   initiator's node) and X still waits on the same call id, the probe went around a
//!   cycle: that call fails at once with `DeadlockDetected` naming the cycle (the
//!   initiator first and last). Else, for each edge X→Y present now: append X to the
//!   path and follow it: locally for a local edge, to Y's host for a remote one. If X
//!   waits on nothing, the probe is dropped.
//! - A path holds at most [`PROBE_PATH_ACTORS_MAX`] actors; a node sends at most
//!   [`PROBES_SENT_PER_SECOND_MAX`] probes a second and queues at most
//!   [`PROBE_QUEUE_CAPACITY`] probe tasks; past those, probes are dropped (a dropped
//!   probe never refuses anything: the cycle then ends by deadlines).
//!
//! Only the initiator's own edge is checked by call id when the probe comes back; see
//! docs/cluster.md for what that guarantees and what it does not.

use rustc_hash::FxHashMap as HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};
use troupe_core::limits::AGENT_CALL_DEPTH_MAX;
use troupe_core::{ActorId, CallContext, InvokeError};
use troupe_etcd::NodeId;
use troupe_runtime::{
    Delivery, Probe, ProbeSink, RequestFailure, RequestKind, TellRoute, TransportClient, TurnCall, TurnCallRouter,
    WaitEdge,
};

use crate::node::Inner;

/// Most actors in a probe's path, in actors. A cycle of independent requests is not
/// bounded by the call depth (each request may be at depth 1), so the bound is a
/// multiple of it: cycles longer than this end by deadlines.
pub const PROBE_PATH_ACTORS_MAX: usize = 4 * (AGENT_CALL_DEPTH_MAX as usize + 1);
/// Most probe tasks (probes to start or to go on with) a node queues, in probes.
pub const PROBE_QUEUE_CAPACITY: usize = 1_024;
/// Most probes a node sends to other nodes in one second, in probes.
pub const PROBES_SENT_PER_SECOND_MAX: u64 = 2_000;
/// Most actors one probe visits on one node before it is dropped, in actors.
pub const PROBE_LOCAL_VISITS_MAX: usize = 64;
/// How long sending one probe may take (connecting included), in milliseconds.
pub const PROBE_SEND_TIMEOUT_MS: u64 = 1_000;
/// Length of the window in which [`PROBES_SENT_PER_SECOND_MAX`] is counted, in ms.
const PROBE_RATE_WINDOW_MS: u64 = 1_000;

/// One open call from a turn of this node to another node.
pub(crate) struct RemoteWaitEntry {
    pub(crate) waiter: ActorId,
    pub(crate) target: ActorId,
    pub(crate) owner: NodeId,
    /// Fails the call with the cycle a probe found.
    pub(crate) deadlock: Option<oneshot::Sender<Vec<ActorId>>>,
}

/// What the probe task does next.
pub(crate) enum ProbeWork {
    /// Send a probe from this node's remote edge `call`.
    Start { call: u64, waiter: ActorId },
    /// A probe arrived from another node.
    Arrived(Probe),
}

/// The probe task's queue; a full queue drops the probe.
#[derive(Clone)]
pub(crate) struct ProbeChannel {
    sender: mpsc::Sender<ProbeWork>,
    dropped: Arc<std::sync::atomic::AtomicU64>,
    received: Arc<std::sync::atomic::AtomicU64>,
}

impl ProbeChannel {
    pub(crate) fn new(sender: mpsc::Sender<ProbeWork>) -> Self {
        Self {
            sender,
            dropped: Arc::default(),
            received: Arc::default(),
        }
    }

    pub(crate) fn push(&self, work: ProbeWork) {
        if self.sender.try_send(work).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(crate) fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    pub(crate) fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }
}

impl ProbeSink for ProbeChannel {
    fn on_probe(&self, probe: Probe) {
        self.received.fetch_add(1, Ordering::Relaxed);
        self.push(ProbeWork::Arrived(probe));
    }
}

/// The node's hooks in its runtime: calls from turns go through the node's router.
pub(crate) struct Hooks {
    pub(crate) inner: Weak<Inner>,
}

#[async_trait]
impl TurnCallRouter for Hooks {
    async fn call(&self, call: TurnCall) -> Result<Bytes, InvokeError> {
        match self.inner.upgrade() {
            Some(inner) => inner.call_from_turn(call).await,
            None => Err(InvokeError::Shutdown),
        }
    }

    async fn tell(&self, call: TurnCall) -> TellRoute {
        TellRoute::Sent(match self.inner.upgrade() {
            Some(inner) => inner.tell_from_turn(call).await,
            None => Err(InvokeError::Shutdown),
        })
    }

    /// The node runs a keyed call keyed wherever its target lives (the transport
    /// carries the key).
    fn carries_idempotency_keys(&self) -> bool {
        true
    }

    fn path_leaves_node(&self, remote_edges: Vec<WaitEdge>) {
        let Some(inner) = self.inner.upgrade() else { return };
        if inner.probes_disabled() {
            return;
        }
        for edge in remote_edges {
            inner.probes.push(ProbeWork::Start {
                call: edge.call,
                waiter: edge.waiter,
            });
        }
    }
}

#[async_trait]
impl troupe_runtime::RootCallRouter for Hooks {
    async fn invoke_root(
        &self,
        target: &troupe_core::ActorId,
        payload: Bytes,
        deadline: troupe_core::Deadline,
    ) -> Result<Bytes, InvokeError> {
        match self.inner.upgrade() {
            Some(inner) => {
                inner
                    .routed(target, payload, deadline, crate::node::Origin::RoutedRoot { key: None })
                    .await
            }
            None => Err(InvokeError::Shutdown),
        }
    }

    async fn invoke_root_keyed(
        &self,
        target: &troupe_core::ActorId,
        key: &troupe_runtime::IdempotencyKey,
        payload: Bytes,
        deadline: troupe_core::Deadline,
    ) -> Result<Bytes, InvokeError> {
        match self.inner.upgrade() {
            Some(inner) => {
                inner
                    .routed(
                        target,
                        payload,
                        deadline,
                        crate::node::Origin::RoutedRoot { key: Some(key) },
                    )
                    .await
            }
            None => Err(InvokeError::Shutdown),
        }
    }

    async fn invoke_root_in(
        &self,
        target: &troupe_core::ActorId,
        payload: Bytes,
        context: troupe_core::CallContext,
    ) -> Result<Bytes, InvokeError> {
        match self.inner.upgrade() {
            Some(inner) => {
                inner
                    .routed(target, payload, context.deadline(), crate::node::Origin::Root(&context))
                    .await
            }
            None => Err(InvokeError::Shutdown),
        }
    }

    /// An etcd read: [`Inner::placed_elsewhere`].
    async fn placed_elsewhere(&self, target: &troupe_core::ActorId) -> Result<bool, InvokeError> {
        match self.inner.upgrade() {
            Some(inner) => inner.placed_elsewhere(target).await,
            None => Err(InvokeError::Shutdown),
        }
    }
}

/// Runs the node's probe work, one item at a time.
pub(crate) async fn probe_loop(inner: Arc<Inner>, mut work: mpsc::Receiver<ProbeWork>) {
    while let Some(item) = work.recv().await {
        match item {
            ProbeWork::Start { call, waiter } => inner.start_probe(call, &waiter),
            ProbeWork::Arrived(probe) => inner.chase(probe).await,
        }
    }
}

/// Removes a remote wait's entry when its call ends.
struct EntryGuard<'a> {
    inner: &'a Inner,
    call: u64,
}

impl Drop for EntryGuard<'_> {
    fn drop(&mut self) {
        self.inner.remote_waits().remove(&self.call);
    }
}

impl Inner {
    pub(crate) fn remote_waits(&self) -> MutexGuard<'_, HashMap<u64, RemoteWaitEntry>> {
        self.remote_waits.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn probes_disabled(&self) -> bool {
        #[cfg(feature = "planted-bugs")]
        if self.planted_no_probes.load(Ordering::SeqCst) {
            return true;
        }
        false
    }

    /// A turn of `caller` calls `target` on `owner`: records the remote wait-for edge,
    /// sends a probe from it, and waits for the reply or for a probe to come back around
    /// a cycle.
    pub(crate) async fn remote_turn_call(
        &self,
        client: &TransportClient,
        call: crate::node::RemoteTurnCall<'_>,
        payload: Bytes,
        context: CallContext,
    ) -> Result<Bytes, RequestFailure> {
        let crate::node::RemoteTurnCall {
            owner,
            caller,
            target,
            key,
        } = call;
        // Refused here (a cycle in this node's graph, the turn ended): nothing was sent.
        let wait = self
            .handle
            .begin_remote_wait(caller, target)
            .await
            .map_err(|error| RequestFailure {
                error,
                delivery: Delivery::NeverSent,
            })?;
        let call = wait.call_id();
        let (found, mut cycle) = oneshot::channel();
        self.remote_waits().insert(
            call,
            RemoteWaitEntry {
                waiter: caller.clone(),
                target: target.clone(),
                owner: owner.clone(),
                deadlock: Some(found),
            },
        );
        let entry = EntryGuard { inner: self, call };
        if !self.probes_disabled() {
            self.probes.push(ProbeWork::Start {
                call,
                waiter: caller.clone(),
            });
        }
        let result = tokio::select! {
            biased;
            Ok(cycle) = &mut cycle => {
                self.counters.deadlocks_found_by_probes.fetch_add(1, Ordering::Relaxed);
                // The request was sent and its turn may run on until it is cancelled.
                Err(RequestFailure {
                    error: InvokeError::DeadlockDetected { cycle },
                    delivery: Delivery::MaybeSent,
                })
            }
            result = async {
                let kind = match key {
                    None => RequestKind::Invoke,
                    Some(key) => RequestKind::Keyed(key),
                };
                client.attempt(target, payload, context, Some(caller), kind).await
            } => result,
        };
        drop(entry);
        drop(wait);
        result
    }

    /// Sends the first probe of this node's remote edge `call` (if it is still open).
    fn start_probe(self: &Arc<Self>, call: u64, waiter: &ActorId) {
        let next = {
            let waits = self.remote_waits();
            waits
                .get(&call)
                .filter(|entry| entry.waiter == *waiter)
                .map(|entry| (entry.target.clone(), entry.owner.clone()))
        };
        let Some((target, owner)) = next else { return };
        let probe = Probe {
            initiator: waiter.clone(),
            initiator_node: self.node.to_string(),
            initiator_call: call,
            path: vec![waiter.clone()],
            at: target,
        };
        self.send_probe(owner, probe);
    }

    /// Goes on with a probe that arrived for an actor of this node: see the module
    /// documentation.
    pub(crate) async fn chase(self: &Arc<Self>, probe: Probe) {
        let mut stack = vec![(probe.at.clone(), probe.path.clone())];
        let mut visits = 0;
        while let Some((actor, path)) = stack.pop() {
            if actor == probe.initiator {
                if probe.initiator_node == self.node.as_str() {
                    self.cycle_found(probe.initiator_call, &actor, path);
                }
                // Never past the initiator: another node's call ids mean nothing here.
                continue;
            }
            visits += 1;
            if path.len() >= PROBE_PATH_ACTORS_MAX || visits > PROBE_LOCAL_VISITS_MAX {
                self.counters.probes_dropped.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let edges = match self.handle.waits_of(&actor).await {
                Ok(edges) => edges,
                Err(_) => {
                    self.counters.probes_dropped.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            };
            let mut next_path = path;
            next_path.push(actor);
            for edge in edges {
                if !edge.remote {
                    stack.push((edge.target, next_path.clone()));
                    continue;
                }
                let owner = self.remote_waits().get(&edge.call).map(|entry| entry.owner.clone());
                if let Some(owner) = owner {
                    let next = Probe {
                        initiator: probe.initiator.clone(),
                        initiator_node: probe.initiator_node.clone(),
                        initiator_call: probe.initiator_call,
                        path: next_path.clone(),
                        at: edge.target,
                    };
                    self.send_probe(owner, next);
                }
            }
        }
    }

    /// A probe came back to its initiator `waiter` along `path`: if the initiator still
    /// waits on the same call, that call fails with the cycle.
    fn cycle_found(&self, call: u64, waiter: &ActorId, path: Vec<ActorId>) {
        let sender = {
            let mut waits = self.remote_waits();
            waits
                .get_mut(&call)
                .filter(|entry| entry.waiter == *waiter)
                .and_then(|entry| entry.deadlock.take())
        };
        if let Some(sender) = sender {
            let mut cycle = path;
            cycle.push(waiter.clone());
            tracing::info!(node = %self.node, ?cycle, "a deadlock probe came back: refusing the call");
            let _ = sender.send(cycle);
        }
    }

    /// Whether one more probe fits this second's budget (and counts it).
    fn probe_allowed(&self) -> bool {
        let now = self.handle.now();
        let mut window = self.probe_window.lock().unwrap_or_else(PoisonError::into_inner);
        if now.as_micros().saturating_sub(window.0.as_micros()) >= PROBE_RATE_WINDOW_MS * 1_000 {
            *window = (now, 0);
        }
        if window.1 >= PROBES_SENT_PER_SECOND_MAX {
            return false;
        }
        window.1 += 1;
        true
    }

    /// Sends `probe` to `owner` in a task of its own, bounded by [`PROBE_SEND_TIMEOUT_MS`].
    fn send_probe(self: &Arc<Self>, owner: NodeId, probe: Probe) {
        if self.probes_disabled() {
            return;
        }
        if owner == self.node {
            // The target moved here meanwhile (or the route was stale): go on locally.
            self.probes.push(ProbeWork::Arrived(probe));
            return;
        }
        if !self.probe_allowed() {
            self.counters.probes_dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let inner = Arc::clone(self);
        tokio::spawn(async move {
            let deadline = inner.handle.deadline_in(Duration::from_millis(PROBE_SEND_TIMEOUT_MS));
            let Some(client) = inner.client(&owner, deadline).await else {
                inner.counters.probes_dropped.fetch_add(1, Ordering::Relaxed);
                return;
            };
            match client.send_probe(probe, deadline).await {
                Ok(()) => {
                    inner.counters.probes_sent.fetch_add(1, Ordering::Relaxed);
                }
                Err(error) => {
                    if matches!(error, InvokeError::Unreachable { .. }) {
                        inner.forget_client(&owner, &client);
                    }
                    tracing::debug!(node = %owner, %error, "a deadlock probe could not be sent");
                    inner.counters.probes_dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
    }
}
