//! Hooks for a cluster layer: calls from a turn to actors on other nodes, and the
//! wait-for edges those calls add to this runtime's graph.
//!
//! ```text
//! Caller::invoke ──► router installed? ──no──► local call (local edge, then the
//!                        │                      target's mailbox or the dispatcher)
//!                        │ yes
//!                        ▼
//!      TurnCallRouter::call(TurnCall { caller, target, payload, context, key })
//!        target here ──► RuntimeHandle::invoke_for_turn (the local path above;
//!                        invoke_for_turn_keyed for a keyed call)
//!        target elsewhere ──► RuntimeHandle::begin_remote_wait (edge caller → target,
//!                             marked remote, refused with DeadlockDetected if it closes
//!                             a cycle of this graph) ── send ── RemoteWait dropped
//!                             when the call ends (the edge is released)
//! ```
//!
//! A keyed call (`Caller::invoke_keyed`) goes to the router with its key in
//! [`TurnCall::key`], if the router says it carries keys
//! ([`TurnCallRouter::carries_idempotency_keys`]; else it is refused, nothing sent): the
//! router runs it keyed wherever the target lives ([`RuntimeHandle::invoke_for_turn_keyed`]
//! here, the transport's keyed request elsewhere), so a retry with the same key lands
//! the target's effect once whichever node it goes through.
//!
//! Root requests (from outside any turn) have a router of their own,
//! [`RootCallRouter`]: [`RuntimeHandle::invoke_routed`] and `Caller::invoke_as_root`
//! go through it when one is installed, so an embedder (the agent layer) reaches an
//! actor wherever a cluster placed it; [`RuntimeHandle::invoke`] stays local. A keyed
//! root request, [`RuntimeHandle::invoke_routed_keyed`], goes through
//! [`RootCallRouter::invoke_root_keyed`].
//!
//! A turn's `tell` to another actor goes to [`TurnCallRouter::tell`] the same way (no
//! wait-for edge: nobody waits); a router that does not route tells hands them back
//! ([`TellRoute::Local`]) and the runtime delivers them locally.
//!
//! The router runs inside the calling turn's task; the caller wraps its future so that
//! the call still ends with `Cancelled` when the turn ends. Whenever the dispatcher
//! records an edge whose path of waits reaches an edge marked remote, it tells the
//! router ([`TurnCallRouter::path_leaves_node`]), which may then chase the path across
//! nodes (the cluster's probes).

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::oneshot;
use troupe_core::limits::INVOKE_TIMEOUT_MS_MAX;
use troupe_core::{ActorId, CallContext, CallRefused, Deadline, InvokeError};

use crate::control::Command;
use crate::handle::Counters;
use crate::{IdempotencyKey, RuntimeHandle};

/// One call made by a turn, as handed to a [`TurnCallRouter`]: admission already ran
/// (the context is the callee's: depth + 1, chain + caller, deadline clipped).
#[derive(Debug, Clone)]
pub struct TurnCall {
    /// The actor whose turn waits for the reply.
    pub caller: ActorId,
    /// The actor called.
    pub target: ActorId,
    /// The request.
    pub payload: Bytes,
    /// The callee's context.
    pub context: CallContext,
    /// The call's idempotency key, for a keyed call (`Caller::invoke_keyed`) or a keyed
    /// tell (`Caller::tell_keyed`): the router must run it keyed
    /// ([`RuntimeHandle::invoke_for_turn_keyed`] or [`RuntimeHandle::tell_for_turn_keyed`]
    /// locally). Only a router whose [`TurnCallRouter::carries_idempotency_keys`] says so
    /// gets one; `None` for unkeyed calls and tells.
    pub key: Option<IdempotencyKey>,
}

/// A wait-for edge of this runtime's graph: `waiter`'s turn waits on the reply of call
/// `call` to `target`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WaitEdge {
    /// The waiting actor.
    pub waiter: ActorId,
    /// The call's id, unique in this runtime.
    pub call: u64,
    /// The actor waited on.
    pub target: ActorId,
    /// Whether the target runs on another node (recorded by [`RuntimeHandle::begin_remote_wait`]).
    pub remote: bool,
}

/// What a [`TurnCallRouter`] did with a turn's `tell`.
#[derive(Debug)]
pub enum TellRoute {
    /// The router delivered it (or failed to): the message was accepted by the target's
    /// runtime, wherever that is, or this is why not.
    Sent(Result<(), InvokeError>),
    /// The router does not route tells: the runtime delivers this one locally.
    Local(TurnCall),
}

/// Routes the calls turns make to wherever their targets live (a cluster node).
#[async_trait]
pub trait TurnCallRouter: Send + Sync + 'static {
    /// Runs `call` and returns the reply, by the context's deadline. A call with a
    /// [`TurnCall::key`] runs keyed (see [`TurnCallRouter::carries_idempotency_keys`]).
    ///
    /// # Errors
    /// Whatever the callee or the route returned.
    async fn call(&self, call: TurnCall) -> Result<Bytes, InvokeError>;

    /// Delivers a turn's fire-and-forget message (`Caller::tell` or `Caller::tell_keyed`
    /// to another actor; admission already ran, the context is the target's) wherever its
    /// target lives, and returns once the target's runtime accepted it, by the context's
    /// deadline; one with a [`TurnCall::key`] keyed. The default hands it back for local
    /// delivery ([`TellRoute::Local`]), which keeps its key.
    async fn tell(&self, call: TurnCall) -> TellRoute {
        TellRoute::Local(call)
    }

    /// Whether [`TurnCallRouter::call`] and [`TurnCallRouter::tell`] run a call or a tell
    /// with a [`TurnCall::key`] keyed, wherever its target lives. The default is `false`:
    /// a keyed call or tell from a turn is then refused `Rejected` with nothing sent, so a
    /// router written before keys existed cannot run one unkeyed (and apply its effect
    /// twice on a retry).
    fn carries_idempotency_keys(&self) -> bool {
        false
    }

    /// A wait-for edge was just recorded and the path of waits from its target reaches
    /// these edges marked remote. Called from the calling turn's task, just after the
    /// edge was added (not under the graph's lock): must not block.
    fn path_leaves_node(&self, remote_edges: Vec<WaitEdge>);
}

/// Routes root requests (from outside any turn, or a turn's `invoke_as_root`) to the
/// node that owns their target (a cluster node installs one).
#[async_trait]
pub trait RootCallRouter: Send + Sync + 'static {
    /// Runs `payload` on `target` wherever it lives, as a root request, by `deadline`
    /// (on this runtime's clock). The local path must not refuse a request made from
    /// inside a turn: use [`RuntimeHandle::invoke_root_for_router`].
    ///
    /// # Errors
    /// Whatever the owner or the route returned.
    async fn invoke_root(&self, target: &ActorId, payload: Bytes, deadline: Deadline) -> Result<Bytes, InvokeError>;

    /// As [`RootCallRouter::invoke_root`], for a request from outside any turn that
    /// comes with its own context ([`RuntimeHandle::invoke_routed_in`]): the target's
    /// turn runs under `context` (its deadline, depth, chain and trace id) wherever it
    /// lives. The local path is [`RuntimeHandle::invoke_in`].
    ///
    /// The default runs [`RootCallRouter::invoke_root`] with `context`'s deadline only
    /// (its trace id, depth and chain are not carried); a router that can carry them
    /// overrides it.
    ///
    /// # Errors
    /// Whatever the owner or the route returned.
    async fn invoke_root_in(
        &self,
        target: &ActorId,
        payload: Bytes,
        context: CallContext,
    ) -> Result<Bytes, InvokeError> {
        self.invoke_root(target, payload, context.deadline()).await
    }

    /// As [`RootCallRouter::invoke_root`], for one attempt of the keyed request `key`
    /// names ([`RuntimeHandle::invoke_routed_keyed`]): it must run keyed wherever `target`
    /// lives. The local path is [`RuntimeHandle::invoke_root_keyed_for_router`].
    ///
    /// The default refuses it `Rejected`, with nothing sent: a router that does not
    /// carry keys must not run a keyed request unkeyed.
    ///
    /// # Errors
    /// Whatever the owner or the route returned.
    async fn invoke_root_keyed(
        &self,
        target: &ActorId,
        key: &IdempotencyKey,
        payload: Bytes,
        deadline: Deadline,
    ) -> Result<Bytes, InvokeError> {
        let _ = (key, payload, deadline);
        Err(InvokeError::Rejected {
            target: target.clone(),
            reason: "this runtime's root call router does not carry idempotency keys \
                     (RootCallRouter::invoke_root_keyed): send the request unkeyed with \
                     RuntimeHandle::invoke_routed, or install a router that carries keys"
                .to_string(),
        })
    }

    /// Whether `target` is placed on another node right now: that node's activation
    /// runs it, and an activation started here would be refused its claim. Asked without
    /// activating `target` anywhere (the agent layer's resumes ask it before waking an
    /// actor with a local tell: [`RuntimeHandle::placed_elsewhere`]). `false` when it is
    /// placed here or nowhere (a local activation claims it here).
    ///
    /// The default, for a router that cannot tell (it knows of no other node), is
    /// `Ok(false)`: the actor is resumed here.
    ///
    /// # Errors
    /// Whatever prevented the router from finding out (for a cluster node: its placement
    /// store did not answer): the caller does not know, and should neither assume the
    /// actor free nor placed.
    async fn placed_elsewhere(&self, target: &ActorId) -> Result<bool, InvokeError> {
        let _ = target;
        Ok(false)
    }
}

/// A remote wait-for edge of this runtime's graph, held while the call is open; dropping
/// it releases the edge.
#[derive(Debug)]
pub struct RemoteWait {
    handle: RuntimeHandle,
    call: u64,
    answer: Option<oneshot::Receiver<Result<(), InvokeError>>>,
}

impl RemoteWait {
    /// The call's id (the edge's), unique in this runtime.
    pub fn call_id(&self) -> u64 {
        self.call
    }
}

impl Drop for RemoteWait {
    fn drop(&mut self) {
        // Close the answer first: a dispatcher that has not added the edge yet sees the
        // closed channel (it looks under the graph's lock) and never adds it; one that
        // has, added it before this removal takes the lock.
        drop(self.answer.take());
        self.handle.shared.waits.remove(self.call);
    }
}

impl RuntimeHandle {
    /// Installs the router for calls made by turns; a second router is refused (the
    /// first one stays).
    ///
    /// # Errors
    /// Gives `router` back if one is installed already.
    pub fn set_turn_call_router(
        &self,
        router: std::sync::Arc<dyn TurnCallRouter>,
    ) -> Result<(), std::sync::Arc<dyn TurnCallRouter>> {
        self.shared.router.set(router)
    }

    /// Installs the router for root requests ([`RuntimeHandle::invoke_routed`],
    /// `Caller::invoke_as_root`); a second router is refused (the first one stays).
    ///
    /// # Errors
    /// Gives `router` back if one is installed already.
    pub fn set_root_call_router(
        &self,
        router: std::sync::Arc<dyn RootCallRouter>,
    ) -> Result<(), std::sync::Arc<dyn RootCallRouter>> {
        self.shared.root_router.set(router)
    }

    /// Whether a [`RootCallRouter`] is installed (the runtime runs in a cluster node).
    pub fn has_root_call_router(&self) -> bool {
        self.shared.root_router.get().is_some()
    }

    /// Whether `target` is placed on another node right now, asked of the installed
    /// [`RootCallRouter`] ([`RootCallRouter::placed_elsewhere`]) without activating it:
    /// a local activation of it would then be refused its claim. `Ok(false)` at once,
    /// with nothing looked up, when no router is installed (a single process owns every
    /// actor it runs).
    ///
    /// # Errors
    /// Whatever the router returned: where `target` is placed is not known (for a
    /// cluster node: etcd did not answer).
    pub async fn placed_elsewhere(&self, target: &ActorId) -> Result<bool, InvokeError> {
        match self.shared.root_router.get() {
            Some(router) => router.placed_elsewhere(target).await,
            None => Ok(false),
        }
    }

    /// As [`RuntimeHandle::invoke`], but through the installed [`RootCallRouter`] when
    /// there is one: the request runs on the node that owns `target`, not necessarily
    /// here. Without a router it is [`RuntimeHandle::invoke`].
    ///
    /// # Errors
    /// As [`RuntimeHandle::invoke`], and whatever the router returns (for a cluster
    /// node: `Unreachable`, `Timeout` while the owner cannot be found).
    pub async fn invoke_routed(
        &self,
        target: &ActorId,
        payload: Bytes,
        deadline: Deadline,
    ) -> Result<Bytes, InvokeError> {
        if crate::handle::IN_TURN.get() {
            return Err(CallRefused::RootInvokeInsideTurn.into());
        }
        self.invoke_root_routed(target, None, payload, deadline).await
    }

    /// As [`RuntimeHandle::invoke_keyed`], through the installed [`RootCallRouter`]'s
    /// [`RootCallRouter::invoke_root_keyed`] when there is one: the request runs keyed on
    /// the node that owns `target`, not necessarily here. Without a router it is
    /// [`RuntimeHandle::invoke_keyed`].
    ///
    /// A request that ended `Timeout` or `Unreachable` may or may not have run: send it
    /// again with the same key (through this node or another) and the target's effect
    /// lands once; the retry gets the first attempt's reply if that one committed. The
    /// key's guarantee is the target's ([`RuntimeHandle::invoke_keyed`]): per actor, for
    /// its last [`crate::IDEMPOTENCY_KEYS_KEPT_MAX`] keys.
    ///
    /// # Errors
    /// As [`RuntimeHandle::invoke_routed`] and [`RuntimeHandle::invoke_keyed`];
    /// `Rejected` (nothing sent) if the installed router does not carry keys.
    ///
    /// # Cancel safety
    /// As [`RuntimeHandle::invoke`]; across nodes, as the transport's invoke (a cancel
    /// follows the request, best effort).
    pub async fn invoke_routed_keyed(
        &self,
        target: &ActorId,
        key: &IdempotencyKey,
        payload: Bytes,
        deadline: Deadline,
    ) -> Result<Bytes, InvokeError> {
        if crate::handle::IN_TURN.get() {
            return Err(CallRefused::RootInvokeInsideTurn.into());
        }
        self.invoke_root_routed(target, Some(key), payload, deadline).await
    }

    /// As [`RuntimeHandle::invoke_routed`], under `context` instead of a root context
    /// with only a deadline (for a request that carries a trace id, or its place in a
    /// call tree from another process): through the installed [`RootCallRouter`]'s
    /// [`RootCallRouter::invoke_root_in`] when there is one, else
    /// [`RuntimeHandle::invoke_in`]. The deadline is capped at [`INVOKE_TIMEOUT_MS_MAX`]
    /// from now.
    ///
    /// # Errors
    /// As [`RuntimeHandle::invoke_routed`].
    pub async fn invoke_routed_in(
        &self,
        target: &ActorId,
        payload: Bytes,
        context: CallContext,
    ) -> Result<Bytes, InvokeError> {
        if crate::handle::IN_TURN.get() {
            return Err(CallRefused::RootInvokeInsideTurn.into());
        }
        match self.shared.root_router.get() {
            Some(router) => {
                let latest = self.deadline_in(std::time::Duration::from_millis(INVOKE_TIMEOUT_MS_MAX));
                let deadline = context.deadline().min(latest);
                let context = context.with_deadline(deadline);
                router.invoke_root_in(target, payload, context).await
            }
            None => self.invoke_in(target, payload, context).await,
        }
    }

    /// As [`RuntimeHandle::invoke_routed_in`], passing `message` to the target as a value
    /// within this process, unserialized: the target's [`crate::Actor::handle_value`] gets
    /// it and its reply comes back as a value. A root request, under `context` (its
    /// deadline capped at [`INVOKE_TIMEOUT_MS_MAX`] from now), with the admission, the
    /// deadline, the cancellation on drop and every error of [`RuntimeHandle::invoke_in`]:
    /// only the payload's form differs.
    ///
    /// Where root requests are routed (a [`RootCallRouter`] is installed: a cluster
    /// node), the target's owner may be another process, where a value cannot go: the
    /// request is refused and nothing is sent. Check
    /// [`RuntimeHandle::has_root_call_router`] first and send bytes there.
    ///
    /// # Errors
    /// As [`RuntimeHandle::invoke_in`] (a context no admission gives is refused
    /// `CycleDetected` or `DepthExceeded`); `Rejected` (nothing sent) where root requests
    /// are routed; and what the target does with a value (an actor that takes bytes only
    /// rejects it).
    pub async fn invoke_value_in(
        &self,
        target: &ActorId,
        message: crate::AnyValue,
        context: CallContext,
    ) -> Result<crate::AnyValue, InvokeError> {
        if crate::handle::IN_TURN.get() {
            return Err(CallRefused::RootInvokeInsideTurn.into());
        }
        if self.has_root_call_router() {
            return Err(InvokeError::Rejected {
                target: target.clone(),
                reason: "this runtime routes its root requests (a cluster node), which carry bytes: send bytes \
                         with RuntimeHandle::invoke_routed_in"
                    .to_string(),
            });
        }
        if let Some(refused) = crate::handle::refusal_of_context(&self.shared, target, &context) {
            return Err(refused);
        }
        let now = self.shared.clock.now();
        let latest = Deadline::after(now, std::time::Duration::from_millis(INVOKE_TIMEOUT_MS_MAX));
        let context = context.with_deadline(context.deadline().min(latest));
        self.send_and_wait_from(
            now,
            target,
            crate::envelope::Payload::Value(message),
            context.into(),
            None,
        )
        .await?
        .into_value(target)
    }

    /// As [`RuntimeHandle::invoke_routed`], with the deadline `timeout` from now (capped
    /// at [`INVOKE_TIMEOUT_MS_MAX`]).
    ///
    /// # Errors
    /// As [`RuntimeHandle::invoke_routed`].
    pub async fn invoke_routed_within(
        &self,
        target: &ActorId,
        payload: Bytes,
        timeout: std::time::Duration,
    ) -> Result<Bytes, InvokeError> {
        if self.shared.root_router.get().is_none() {
            return self.invoke_within(target, payload, timeout).await;
        }
        let timeout = timeout.min(std::time::Duration::from_millis(INVOKE_TIMEOUT_MS_MAX));
        self.invoke_routed(target, payload, self.deadline_in(timeout)).await
    }

    /// A root request, keyed or not, through the router if one is installed, else local;
    /// no inside-a-turn check (for `Caller::invoke_as_root` and its keyed form).
    pub(crate) async fn invoke_root_routed(
        &self,
        target: &ActorId,
        key: Option<&IdempotencyKey>,
        payload: Bytes,
        deadline: Deadline,
    ) -> Result<Bytes, InvokeError> {
        match (self.shared.root_router.get(), key) {
            (Some(router), None) => router.invoke_root(target, payload, deadline).await,
            (Some(router), Some(key)) => router.invoke_root_keyed(target, key, payload, deadline).await,
            (None, None) => self.invoke_root(target, payload, deadline).await,
            (None, Some(key)) => self.invoke_root_keyed(target, key, payload, deadline).await,
        }
    }

    /// Runs a root request on this runtime: the local path of a [`RootCallRouter`].
    /// Unlike [`RuntimeHandle::invoke`] it does not refuse a request made from inside a
    /// turn, since `Caller::invoke_as_root` reaches the router from a turn. For routers
    /// only. The deadline is cut as [`RuntimeHandle::invoke`] cuts it (at most
    /// [`INVOKE_TIMEOUT_MS_MAX`] from now).
    ///
    /// # Errors
    /// As [`RuntimeHandle::invoke`].
    pub async fn invoke_root_for_router(
        &self,
        target: &ActorId,
        payload: Bytes,
        deadline: Deadline,
    ) -> Result<Bytes, InvokeError> {
        self.invoke_root(target, payload, deadline).await
    }

    /// Runs a keyed root request on this runtime: the local path of
    /// [`RootCallRouter::invoke_root_keyed`], as [`RuntimeHandle::invoke_keyed`] without
    /// its inside-a-turn check. For routers only.
    ///
    /// # Errors
    /// As [`RuntimeHandle::invoke_keyed`].
    pub async fn invoke_root_keyed_for_router(
        &self,
        target: &ActorId,
        key: &IdempotencyKey,
        payload: Bytes,
        deadline: Deadline,
    ) -> Result<Bytes, InvokeError> {
        self.invoke_root_keyed(target, key, payload, deadline).await
    }

    pub(crate) fn turn_call_router(&self) -> Option<&std::sync::Arc<dyn TurnCallRouter>> {
        self.shared.router.get()
    }

    /// Runs a turn's call on this runtime: the local path of a [`TurnCallRouter`]. The
    /// wait-for edge `caller → target` is recorded as for any call from a turn. For routers only: `caller` must be the actor whose turn made the call.
    ///
    /// # Errors
    /// As [`crate::Caller::invoke`], without `Cancelled` (the caller adds it).
    pub async fn invoke_for_turn(
        &self,
        caller: &ActorId,
        target: &ActorId,
        payload: Bytes,
        context: CallContext,
    ) -> Result<Bytes, InvokeError> {
        self.invoke_from(caller, target, payload, context, None).await
    }

    /// As [`RuntimeHandle::invoke_for_turn`], for a keyed call ([`TurnCall::key`]): the
    /// local path of a [`TurnCallRouter`] that carries keys. The target runs it as
    /// [`RuntimeHandle::invoke_keyed`] does. For routers only.
    ///
    /// # Errors
    /// As [`crate::Caller::invoke_keyed`], without `Cancelled` (the caller adds it).
    pub async fn invoke_for_turn_keyed(
        &self,
        caller: &ActorId,
        target: &ActorId,
        key: &IdempotencyKey,
        payload: Bytes,
        context: CallContext,
    ) -> Result<Bytes, InvokeError> {
        self.invoke_keyed_from(caller, target, key, payload, context, None)
            .await
    }

    /// Delivers a turn's fire-and-forget message on this runtime: the local path of
    /// [`TurnCallRouter::tell`]. Returns once it is accepted, as `Caller::tell` does.
    /// For routers only: `context` must be the one admission gave the target.
    ///
    /// # Errors
    /// As [`crate::Caller::tell`] at acceptance.
    pub async fn tell_for_turn(
        &self,
        target: &ActorId,
        payload: Bytes,
        context: CallContext,
    ) -> Result<(), InvokeError> {
        self.send_only(target, crate::envelope::Payload::Bytes(payload), context.into())
            .await
    }

    /// As [`RuntimeHandle::tell_for_turn`], for a keyed tell ([`TurnCall::key`]): the
    /// local path of a router that carries keys.
    ///
    /// # Errors
    /// As [`RuntimeHandle::tell_for_turn`].
    pub async fn tell_for_turn_keyed(
        &self,
        target: &ActorId,
        key: &IdempotencyKey,
        payload: Bytes,
        context: CallContext,
    ) -> Result<(), InvokeError> {
        self.send_only(target, crate::envelope::Payload::keyed(key, payload), context.into())
            .await
    }

    /// Records the wait-for edge `caller → target` for a call whose target runs on
    /// another node; the edge lasts until the returned guard is dropped.
    ///
    /// # Errors
    /// [`InvokeError::DeadlockDetected`] if the edge would close a cycle of this
    /// runtime's graph (nothing recorded); [`InvokeError::Rejected`] if the graph is full;
    /// [`InvokeError::DispatcherBusy`] or [`InvokeError::Shutdown`].
    pub async fn begin_remote_wait(&self, caller: &ActorId, target: &ActorId) -> Result<RemoteWait, InvokeError> {
        let shared = &*self.shared;
        let call = shared.next_call();
        let (reply, answer) = oneshot::channel();
        let mut wait = RemoteWait {
            handle: self.clone(),
            call,
            answer: Some(answer),
        };
        let command = Command::AddRemoteEdge {
            call,
            caller: caller.clone(),
            target: target.clone(),
            reply,
        };
        match shared.commands.try_send(command) {
            Ok(()) => {}
            Err(tokio::sync::mpsc::error::TrySendError::Full(_)) => {
                Counters::add(&shared.counters.dispatcher_busy_refused);
                return Err(InvokeError::DispatcherBusy {
                    capacity: troupe_core::limits::DISPATCHER_QUEUE_CAPACITY,
                });
            }
            Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => return Err(InvokeError::Shutdown),
        }
        let answer = wait.answer.as_mut().expect("the answer is taken only on drop");
        match answer.await {
            Ok(Ok(())) => Ok(wait),
            Ok(Err(error)) => Err(error),
            Err(_) => Err(InvokeError::Shutdown),
        }
    }

    /// The wait-for edges whose waiter is `actor`, now.
    ///
    /// # Errors
    /// [`InvokeError::DispatcherBusy`] or [`InvokeError::Shutdown`].
    pub async fn waits_of(&self, actor: &ActorId) -> Result<Vec<WaitEdge>, InvokeError> {
        let (reply, answer) = oneshot::channel();
        let command = Command::Waits {
            actor: actor.clone(),
            reply,
        };
        match self.shared.commands.try_send(command) {
            Ok(()) => {}
            Err(tokio::sync::mpsc::error::TrySendError::Full(_)) => {
                return Err(InvokeError::DispatcherBusy {
                    capacity: troupe_core::limits::DISPATCHER_QUEUE_CAPACITY,
                });
            }
            Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => return Err(InvokeError::Shutdown),
        }
        answer.await.map_err(|_| InvokeError::Shutdown)
    }
}
