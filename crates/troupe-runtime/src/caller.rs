//! The one checked way to call other actors from inside a turn: [`Caller`].
//!
//! A turn's caller handle is made by the runtime when the turn starts. Its identity
//! (the actor running the turn), chain, depth and deadline come from the request the
//! turn handles and cannot be edited: there are read-only accessors and no public
//! fields. Every call goes through admission (`troupe_core::admit_call`) and then the
//! dispatcher's wait-for graph:
//!
//! ```text
//! Caller::admit(target, known, timeout?)   turn ended? shutting down? cycle in chain?
//!   │                                     depth ≥ 5? unknown? ≥ 10 in flight? no time?
//!   ▼ Admitted (holds an in-flight slot and the child context: depth+1, chain+self,
//!   │           deadline clipped to this turn's)
//! Caller::invoke(admitted, payload)  ──►  wait-for edge self → target (the graph's lock;
//!   │                                      refused with DeadlockDetected if it closes a
//!   │                                      cycle), then the target's mailbox
//!   ▼ reply, or the error; the edge ends when the callee replies or this wait ends
//! ```
//!
//! Cancellation: a call's wait ends when its deadline passes, when its future is
//! dropped, or when the turn that made it ends (a task spawned by the turn may hold a
//! clone of the handle: its calls end with [`InvokeError::Cancelled`] then, and new ones
//! are refused with [`CallRefused::CallerTurnEnded`]). Ending the wait closes the reply
//! channel, and the callee's turn for that call is cancelled at its next `.await` and
//! commits nothing; its own calls end the same way, so a whole subtree stops.
//!
//! Fire-and-forget from a turn: [`Caller::tell`] runs the same admission as a call (to
//! another actor: cycle, depth, known, in-flight cap, deadline clipped to this turn's),
//! then hands the message over and returns once it is accepted (in the mailbox, or held
//! for the next activation); no wait-for edge is recorded and the in-flight slot is
//! freed at acceptance. A turn may tell *itself*: the message runs after this turn,
//! with this turn's chain and depth and its own deadline (nobody waits on it, so the
//! deadline is not clipped to this turn's; it is capped at the longest invoke timeout).
//! [`Caller::tell_self_in`] sends itself a message under a context that is at least as
//! restrictive as this turn's (a persisted one, say). Like [`crate::RuntimeHandle::tell`],
//! told messages live in memory only until they run.
//!
//! The one exception is [`Caller::invoke_as_root`], named as what it is: an independent
//! request that is not part of this turn's chain (no cycle, depth or deadlock check),
//! still bounded by this turn's deadline and cancelled with it.

use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use troupe_core::limits::{AGENT_CALL_DEPTH_MAX, INVOKE_TIMEOUT_MS_MAX};
use troupe_core::{admit_call, ActorId, ActorKind, AdmissionRequest, CallContext, CallRefused, Deadline, InvokeError};

use crate::envelope::{EnvelopeContext, Payload};
use crate::idempotency::IdempotencyKey;
use crate::signal::Signal;
use crate::{ActorRef, ActorRefError, AnyValue, Clock, RuntimeHandle, TypedActor};

/// A turn's handle for calling other actors. Cheap to clone; every clone speaks for the
/// same turn and stops working when the turn ends.
#[derive(Clone)]
pub struct Caller {
    inner: Arc<CallerInner>,
}

pub(crate) struct CallerInner {
    handle: RuntimeHandle,
    id: ActorId,
    context: CallContext,
    /// Calls in flight from this turn. Calls end with their turn, and an actor's turns
    /// run one at a time, so this is also the activation's count.
    in_flight: AtomicU32,
    /// Set once when the turn ends.
    ended: Signal,
}

impl CallerInner {
    /// Resolves when the turn has ended.
    pub(crate) async fn turn_ended(&self) {
        self.ended.wait().await;
    }
}

impl fmt::Debug for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Caller")
            .field("id", &self.inner.id)
            .field("depth", &self.inner.context.depth())
            .field("chain", &self.inner.context.chain())
            .field("deadline", &self.inner.context.deadline())
            .field("calls_in_flight", &self.calls_in_flight())
            .field("turn_ended", &self.turn_ended())
            .finish()
    }
}

/// A call that admission let through: it holds one of the caller's in-flight slots
/// until it is invoked and answered, or dropped. Only [`Caller::admit`] makes one.
#[derive(Debug)]
#[must_use = "an admitted call holds an in-flight slot until it is invoked or dropped"]
pub struct Admitted {
    target: ActorId,
    child: CallContext,
    timeout: Duration,
    /// Whose admission this is, so it cannot be spent by another turn's caller.
    caller: ActorId,
    _slot: InFlightSlot,
}

impl Admitted {
    /// The actor to call.
    pub fn target(&self) -> &ActorId {
        &self.target
    }

    /// The context the callee will run under: depth + 1, chain + caller, deadline
    /// clipped to the caller's.
    pub fn child(&self) -> &CallContext {
        &self.child
    }

    /// How long the caller will wait: the child's deadline minus the time of admission.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
}

/// One of a turn's in-flight call slots; freed on drop.
struct InFlightSlot(Arc<CallerInner>);

impl fmt::Debug for InFlightSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("InFlightSlot").field(&self.0.id).finish()
    }
}

impl Drop for InFlightSlot {
    fn drop(&mut self) {
        let before = self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
        assert!(before >= 1, "in-flight call count underflow");
    }
}

impl Caller {
    pub(crate) fn new(handle: RuntimeHandle, id: ActorId, context: CallContext) -> Self {
        Self {
            inner: Arc::new(CallerInner {
                handle,
                id,
                context,
                in_flight: AtomicU32::new(0),
                ended: Signal::default(),
            }),
        }
    }

    /// Marks the turn as ended: calls in flight from any clone end with `Cancelled`
    /// (their callees are cancelled), new ones are refused.
    pub(crate) fn end_turn(&self) {
        self.inner.ended.set();
    }

    /// The actor whose turn this is.
    pub fn id(&self) -> &ActorId {
        &self.inner.id
    }

    /// Depth, chain and deadline of the request the turn handles.
    pub fn context(&self) -> &CallContext {
        &self.inner.context
    }

    /// How many calls between actors lead to this turn (0 when asked from outside).
    pub fn depth(&self) -> u32 {
        self.inner.context.depth()
    }

    /// The actors waiting on this turn, outermost first (this actor not included).
    pub fn chain(&self) -> &[ActorId] {
        self.inner.context.chain()
    }

    /// When the turn must have replied.
    pub fn deadline(&self) -> Deadline {
        self.inner.context.deadline()
    }

    /// The runtime's clock.
    pub fn clock(&self) -> Clock {
        self.inner.handle.clock()
    }

    /// The current time on the runtime's clock.
    pub fn now(&self) -> Deadline {
        self.inner.handle.now()
    }

    /// Whether actors of `kind` can be called in this runtime.
    pub fn is_registered(&self, kind: &ActorKind) -> bool {
        self.inner.handle.is_registered(kind)
    }

    /// Calls this actor's activation has in flight now.
    pub fn calls_in_flight(&self) -> u32 {
        self.inner.in_flight.load(Ordering::SeqCst)
    }

    /// Whether the turn has ended; calls are refused from then on.
    pub fn turn_ended(&self) -> bool {
        self.inner.ended.is_set()
    }

    /// Decides whether this turn may call `target` (see the module documentation for
    /// the rules and their order) and takes an in-flight slot if so. `target_known`
    /// says whether the target exists for the layer above (an agent directory, say);
    /// an actor kind that is not registered is unknown whatever it says.
    /// `requested_timeout_ms` of `None` means the default call timeout.
    ///
    /// # Errors
    /// [`CallRefused`]: `CallerTurnEnded`, `ShuttingDown`, `CycleDetected`,
    /// `DepthExceeded`, `AgentNotFound`, `TooManyCalls`, `InvalidTimeout`,
    /// `DeadlineExpired`. Nothing was sent.
    pub fn admit(
        &self,
        target: &ActorId,
        target_known: bool,
        requested_timeout_ms: Option<u64>,
    ) -> Result<Admitted, CallRefused> {
        let inner = &*self.inner;
        if self.turn_ended() {
            return Err(CallRefused::CallerTurnEnded {
                caller: inner.id.clone(),
            });
        }
        if inner.handle.shared.commands.is_closed() || inner.handle.shared.aborted() {
            return Err(CallRefused::ShuttingDown);
        }
        let before = inner.in_flight.fetch_add(1, Ordering::SeqCst);
        let slot = InFlightSlot(Arc::clone(&self.inner));
        let admitted = admit_call(AdmissionRequest {
            caller: &inner.id,
            context: &inner.context,
            target,
            target_known: target_known && inner.handle.is_registered(target.kind()),
            calls_in_flight: before,
            requested_timeout_ms,
            now: inner.handle.now(),
        })?;
        Ok(Admitted {
            target: target.clone(),
            child: admitted.child,
            timeout: admitted.timeout,
            caller: inner.id.clone(),
            _slot: slot,
        })
    }

    /// Sends `payload` for an admitted call and waits for the reply until the child's
    /// deadline. The runtime records the wait-for edge from this actor to the target
    /// while the call is open and refuses it with `DeadlockDetected` if the edge would
    /// close a cycle of waiting actors.
    ///
    /// # Errors
    /// [`InvokeError`]: `DeadlockDetected`, `Timeout`, `Busy`, `DispatcherBusy`,
    /// `ActorNotFound`, `ActorFailed`, `Rejected`, `StorageFailed`, `Shutdown`, and
    /// `Cancelled` when this turn ends while the call is in flight.
    ///
    /// # Panics
    /// If `admitted` was admitted by another actor's caller (a programmer error).
    ///
    /// # Cancel safety
    /// Dropping the future abandons the call: the callee's turn for it is cancelled and
    /// commits nothing (unless it was already committing), and the slot is freed.
    pub async fn invoke(&self, admitted: Admitted, payload: Bytes) -> Result<Bytes, InvokeError> {
        assert_eq!(
            admitted.caller, self.inner.id,
            "an admission is spent by the caller it was made for"
        );
        let inner = &*self.inner;
        let result = match inner.handle.turn_call_router() {
            // Boxed: a routed call's future (the router's call raced with the turn's end)
            // would otherwise set the size of every call's, local ones included.
            Some(router) => Box::pin(self.routed_call(router.as_ref(), &admitted, payload, None)).await,
            None => {
                inner
                    .handle
                    .invoke_from(
                        &inner.id,
                        &admitted.target,
                        payload,
                        admitted.child.clone(),
                        Some(inner),
                    )
                    .await
            }
        };
        drop(admitted);
        result
    }

    /// An admitted call handed to `router` (with `key`, if keyed), cancelled when this
    /// turn ends first.
    async fn routed_call(
        &self,
        router: &dyn crate::TurnCallRouter,
        admitted: &Admitted,
        payload: Bytes,
        key: Option<IdempotencyKey>,
    ) -> Result<Bytes, InvokeError> {
        let inner = &*self.inner;
        let call = crate::TurnCall {
            caller: inner.id.clone(),
            target: admitted.target.clone(),
            payload,
            context: admitted.child.clone(),
            key,
        };
        tokio::select! {
            biased;
            result = router.call(call) => result,
            () = inner.turn_ended() => Err(InvokeError::Cancelled { target: admitted.target.clone() }),
        }
    }

    /// Whether this runtime hands its turns' calls to a router (a
    /// [`crate::TurnCallRouter`] or a [`crate::RootCallRouter`]: a cluster node): such
    /// calls may cross to another process, so they carry bytes, and
    /// [`Caller::invoke_value`] and [`Caller::invoke_value_as_root`] refuse them.
    pub fn routes_calls(&self) -> bool {
        self.inner.handle.turn_call_router().is_some() || self.inner.handle.has_root_call_router()
    }

    /// As [`Caller::invoke`], passing `message` to the target as a value within this
    /// process, unserialized; the target's [`crate::Actor::handle_value`] gets it and
    /// its reply comes back as a value. The admission, the wait-for edge, the deadline,
    /// cancellation and every error are those of [`Caller::invoke`]: only the payload's
    /// form differs.
    ///
    /// # Errors
    /// As [`Caller::invoke`]; `Rejected` (nothing sent) when this runtime routes its
    /// turns' calls ([`Caller::routes_calls`]), where a value cannot go; and what the
    /// target does with a value (an actor that takes bytes only rejects it).
    ///
    /// # Panics
    /// As [`Caller::invoke`].
    pub async fn invoke_value(&self, admitted: Admitted, message: AnyValue) -> Result<AnyValue, InvokeError> {
        assert_eq!(
            admitted.caller, self.inner.id,
            "an admission is spent by the caller it was made for"
        );
        let inner = &*self.inner;
        if self.routes_calls() {
            return Err(values_are_not_routed(&admitted.target));
        }
        let result = inner
            .handle
            .send_and_wait(
                &admitted.target,
                Payload::Value(message),
                admitted.child.clone().into(),
                Some((&inner.id, Some(inner))),
            )
            .await
            .and_then(|reply| reply.into_value(&admitted.target));
        drop(admitted);
        result
    }

    /// As [`Caller::invoke`], for one attempt of the logical request `key` names, with
    /// the guarantee of [`RuntimeHandle::invoke_keyed`]: if a turn of the target with this
    /// key has committed, its recorded reply comes back and the target's handler does not
    /// run again; otherwise the handler runs and its reply is recorded under `key` in the
    /// same commit as its writes. So a turn that is run again (its caller retried it, or
    /// it failed after this call and was retried) and makes the same call with the same
    /// key does not apply the target's effect twice: derive the key from what names the
    /// work (a request id the turn received, a step number), not from anything that
    /// changes between attempts. The admission, the wait-for edge, the deadline and
    /// cancellation are those of [`Caller::invoke`].
    ///
    /// Where this runtime routes its turns' calls (a [`crate::TurnCallRouter`] is
    /// installed: a cluster node), the call goes to the router with its key
    /// ([`crate::TurnCall::key`]), which runs it keyed wherever the target lives (across
    /// nodes, the transport carries the key); the key is checked against the target's
    /// committed store, so the guarantee holds whichever node runs the target. A router
    /// that does not carry keys ([`crate::TurnCallRouter::carries_idempotency_keys`])
    /// refuses it `Rejected`, with nothing sent.
    ///
    /// # Errors
    /// As [`Caller::invoke`]; `Rejected` (nothing sent) when the installed router does
    /// not carry keys; those of [`RuntimeHandle::invoke_keyed`] (a turn whose writes leave
    /// no room for the record).
    ///
    /// # Panics
    /// As [`Caller::invoke`].
    pub async fn invoke_keyed(
        &self,
        admitted: Admitted,
        key: &IdempotencyKey,
        payload: Bytes,
    ) -> Result<Bytes, InvokeError> {
        assert_eq!(
            admitted.caller, self.inner.id,
            "an admission is spent by the caller it was made for"
        );
        let inner = &*self.inner;
        let result = match inner.handle.turn_call_router() {
            Some(router) if !router.carries_idempotency_keys() => Err(InvokeError::Rejected {
                target: admitted.target.clone(),
                reason: "this runtime routes its turns' calls through a TurnCallRouter that does not carry \
                         idempotency keys (TurnCallRouter::carries_idempotency_keys): call with Caller::invoke \
                         (unkeyed), or install a router that carries keys"
                    .to_string(),
            }),
            Some(router) => {
                self.routed_call(router.as_ref(), &admitted, payload, Some(key.clone()))
                    .await
            }
            None => {
                inner
                    .handle
                    .invoke_keyed_from(
                        &inner.id,
                        &admitted.target,
                        key,
                        payload,
                        admitted.child.clone(),
                        Some(inner),
                    )
                    .await
            }
        };
        drop(admitted);
        result
    }

    /// Admits and invokes under `key` in one step (see [`Caller::invoke_keyed`]): calls
    /// `target` with `payload` and waits at most `timeout` (clipped to this turn's
    /// deadline and to the maximum call timeout).
    ///
    /// # Errors
    /// [`InvokeError::Refused`] with the admission's refusal, or as
    /// [`Caller::invoke_keyed`].
    pub async fn call_keyed(
        &self,
        target: &ActorId,
        key: &IdempotencyKey,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<Bytes, InvokeError> {
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX).max(1);
        let admitted = self.admit(target, true, Some(timeout_ms))?;
        self.invoke_keyed(admitted, key, payload).await
    }

    /// Admits and invokes in one step: calls `target` with `payload` and waits at most
    /// `timeout` (clipped to this turn's deadline and to the maximum call timeout).
    /// The timeout counts in whole milliseconds, rounded down, and one under 1 ms (zero
    /// too) is 1 ms: a call that may not wait at all times out at once rather than being
    /// refused (unlike [`Caller::admit`] given `Some(0)`, which refuses it with
    /// `InvalidTimeout`). The other forms that take a `Duration` (`call_keyed`, `tell`,
    /// `tell_value`, the typed `ask_from` and `tell_from`) count it the same way.
    ///
    /// # Errors
    /// [`InvokeError::Refused`] with the admission's refusal, or as [`Caller::invoke`].
    pub async fn call(&self, target: &ActorId, payload: Bytes, timeout: Duration) -> Result<Bytes, InvokeError> {
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX).max(1);
        let admitted = self.admit(target, true, Some(timeout_ms))?;
        self.invoke(admitted, payload).await
    }

    /// Fire-and-forget: sends `payload` to `target` and returns once it is accepted (in
    /// the target's mailbox, or held for its next activation, activating it if needed).
    ///
    /// To another actor: the same admission as [`Caller::admit`] with `timeout` (so the
    /// target runs at depth + 1 with this actor in its chain and a deadline clipped to
    /// this turn's); the in-flight slot is held only until acceptance and no wait-for
    /// edge is recorded. With a [`crate::TurnCallRouter`] installed (a cluster node) the
    /// message goes to wherever the target lives; it returns once that runtime accepted
    /// it, and ends `Cancelled` if this turn ends first. To this actor itself: no cycle or depth check; the message runs
    /// after this turn ends, with this turn's depth and chain, under the deadline
    /// `timeout` from now (capped at the longest invoke timeout, not clipped to this
    /// turn's deadline: nobody waits on it). The reply and errors of its turn go nowhere.
    ///
    /// # Errors
    /// [`InvokeError::Refused`] with the admission's refusal (nothing sent); at
    /// acceptance `Busy`, `DispatcherBusy`, `ActorNotFound`, `Rejected`, `Shutdown`.
    pub async fn tell(&self, target: &ActorId, payload: Bytes, timeout: Duration) -> Result<(), InvokeError> {
        self.tell_with(target, None, payload, timeout).await
    }

    /// As [`Caller::tell`], for one delivery of the message `key` names: a turn of
    /// `target` with this key that committed makes every later delivery a no-op (the
    /// handler does not run again), as for [`crate::RuntimeHandle::tell_keyed`]. For a
    /// turn that may run again (its runtime crashed before it committed, or its own
    /// caller retried it): tell under a key derived from what the turn is doing, and the
    /// message's effect lands once however often the turn runs.
    ///
    /// With a [`crate::TurnCallRouter`] installed (a cluster node), the key goes with the
    /// message ([`crate::TurnCall::key`]) to wherever the target lives; a router that does
    /// not carry keys ([`crate::TurnCallRouter::carries_idempotency_keys`]) refuses it
    /// `Rejected`, with nothing sent. To this actor itself, it runs keyed after this turn.
    ///
    /// # Errors
    /// As [`Caller::tell`]; `Rejected` (nothing sent) when the installed router does not
    /// carry keys.
    pub async fn tell_keyed(
        &self,
        target: &ActorId,
        key: &IdempotencyKey,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<(), InvokeError> {
        self.tell_with(target, Some(key), payload, timeout).await
    }

    /// As [`Caller::tell`], passing `message` to the target as a value within this
    /// process, unserialized (see [`Caller::invoke_value`]): the target's
    /// [`crate::Actor::handle_value`] gets it, and its reply goes nowhere. The admission,
    /// the deadline and every refusal are those of [`Caller::tell`]: only the payload's
    /// form differs. [`crate::ActorRef::tell_from`] is the typed way to use it.
    ///
    /// # Errors
    /// As [`Caller::tell`]; `Rejected` (nothing sent) when this runtime routes its turns'
    /// calls ([`Caller::routes_calls`]) and `target` is another actor (a message to this
    /// actor itself stays in this process).
    pub async fn tell_value(&self, target: &ActorId, message: AnyValue, timeout: Duration) -> Result<(), InvokeError> {
        let inner = &*self.inner;
        if target == &inner.id {
            let context = inner.context.with_deadline(inner.handle.deadline_in(timeout));
            return self.tell_self_payload(Payload::Value(message), context).await;
        }
        if self.routes_calls() {
            return Err(values_are_not_routed(target));
        }
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX).max(1);
        let admitted = self.admit(target, true, Some(timeout_ms))?;
        let result = inner
            .handle
            .send_only(target, Payload::Value(message), admitted.child.clone().into())
            .await;
        drop(admitted);
        result
    }

    /// A typed reference to the actor `id` (as [`RuntimeHandle::actor_ref`]), for calls
    /// from this turn: [`crate::ActorRef::ask_from`] and [`crate::ActorRef::tell_from`].
    ///
    /// # Errors
    /// [`ActorRefError`] if `id`'s kind is not registered, or not for `A`.
    pub fn actor_ref<A: TypedActor>(&self, id: ActorId) -> Result<ActorRef<A>, ActorRefError> {
        self.inner.handle.actor_ref(id)
    }

    /// [`Caller::tell`] and [`Caller::tell_keyed`].
    async fn tell_with(
        &self,
        target: &ActorId,
        key: Option<&IdempotencyKey>,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<(), InvokeError> {
        let inner = &*self.inner;
        let payload_of = |bytes: Bytes| match key {
            None => Payload::Bytes(bytes),
            Some(key) => Payload::keyed(key, bytes),
        };
        if target == &inner.id {
            let context = inner.context.with_deadline(inner.handle.deadline_in(timeout));
            return self.tell_self_payload(payload_of(payload), context).await;
        }
        let router = inner.handle.turn_call_router();
        if let (Some(router), Some(_)) = (&router, key) {
            if !router.carries_idempotency_keys() {
                return Err(InvokeError::Rejected {
                    target: target.clone(),
                    reason: "this runtime routes its turns' messages through a TurnCallRouter that does not \
                             carry idempotency keys (TurnCallRouter::carries_idempotency_keys): tell with \
                             Caller::tell (unkeyed), or install a router that carries keys"
                        .to_string(),
                });
            }
        }
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX).max(1);
        let admitted = self.admit(target, true, Some(timeout_ms))?;
        let local = match router {
            Some(router) => {
                let call = crate::TurnCall {
                    caller: inner.id.clone(),
                    target: target.clone(),
                    payload,
                    context: admitted.child.clone(),
                    key: key.cloned(),
                };
                let routed = tokio::select! {
                    biased;
                    routed = router.tell(call) => routed,
                    () = inner.turn_ended() => crate::TellRoute::Sent(Err(InvokeError::Cancelled { target: target.clone() })),
                };
                match routed {
                    crate::TellRoute::Sent(result) => {
                        drop(admitted);
                        return result;
                    }
                    crate::TellRoute::Local(call) => call.payload,
                }
            }
            None => payload,
        };
        let result = inner
            .handle
            .send_only(target, payload_of(local), admitted.child.clone().into())
            .await;
        drop(admitted);
        result
    }

    /// Sends `payload` to this actor itself, to run after this turn under `context`,
    /// which must be at least as restrictive as this turn's ([`CallContext::extends`]:
    /// its chain starts with this turn's chain, its depth is no smaller and at most the
    /// maximum depth). Its deadline is `context`'s, capped at the longest invoke timeout
    /// from now. For resuming work whose context was persisted, such as an agent's inbox
    /// entry.
    ///
    /// # Errors
    /// [`InvokeError::Refused`] with `CallerTurnEnded` or `ShuttingDown`;
    /// [`InvokeError::Rejected`] if `context` does not extend this turn's; otherwise as
    /// [`Caller::tell`].
    pub async fn tell_self_in(&self, payload: Bytes, context: CallContext) -> Result<(), InvokeError> {
        self.tell_self_payload(Payload::Bytes(payload), context).await
    }

    /// [`Caller::tell_self_in`] for any payload (a keyed one too).
    async fn tell_self_payload(&self, payload: Payload, context: CallContext) -> Result<(), InvokeError> {
        let inner = &*self.inner;
        if self.turn_ended() {
            return Err(CallRefused::CallerTurnEnded {
                caller: inner.id.clone(),
            }
            .into());
        }
        if inner.handle.shared.commands.is_closed() || inner.handle.shared.aborted() {
            return Err(CallRefused::ShuttingDown.into());
        }
        if !context.extends(&inner.context) || context.depth() > AGENT_CALL_DEPTH_MAX {
            return Err(InvokeError::Rejected {
                target: inner.id.clone(),
                reason: format!(
                    "a message to itself must run under a context at least as restrictive as its turn's ({:?}), got {context:?}",
                    inner.context
                ),
            });
        }
        let latest = inner.handle.deadline_in(Duration::from_millis(INVOKE_TIMEOUT_MS_MAX));
        let context = context.with_deadline(context.deadline().min(latest));
        inner.handle.send_only(&inner.id, payload, context.into()).await
    }

    /// Sends `payload` to `target` as an independent root request, not as a call of this
    /// turn: it is not in this turn's chain and adds no wait-for edge, so no cycle,
    /// depth or deadlock check applies to it. Use it only for work that is not part of
    /// answering this request. It is still bounded: its deadline is at most this
    /// turn's, and it is cancelled when this turn ends. With a [`crate::RootCallRouter`]
    /// installed (a cluster node), it goes to the node that owns `target`.
    ///
    /// # Errors
    /// As [`crate::RuntimeHandle::invoke`], plus `Cancelled` when the turn ends first,
    /// and [`InvokeError::Refused`] if the turn has already ended.
    pub async fn invoke_as_root(
        &self,
        target: &ActorId,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<Bytes, InvokeError> {
        self.as_root(target, timeout, |deadline| {
            self.inner.handle.invoke_root_routed(target, None, payload, deadline)
        })
        .await
    }

    /// As [`Caller::invoke_as_root`], for one attempt of the logical request `key` names
    /// (see [`crate::RuntimeHandle::invoke_keyed`]): the target runs it keyed, so a turn
    /// that is run again and sends it again with the same key gets the first reply, and
    /// the effect lands once. With a [`crate::RootCallRouter`] installed (a cluster
    /// node) it runs keyed on the node that owns `target`.
    ///
    /// # Errors
    /// As [`Caller::invoke_as_root`] and [`crate::RuntimeHandle::invoke_keyed`];
    /// `Rejected` (nothing sent) if the installed router does not carry keys.
    pub async fn invoke_as_root_keyed(
        &self,
        target: &ActorId,
        key: &crate::IdempotencyKey,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<Bytes, InvokeError> {
        self.as_root(target, timeout, |deadline| {
            self.inner
                .handle
                .invoke_root_routed(target, Some(key), payload, deadline)
        })
        .await
    }

    /// As [`Caller::invoke_as_root`], passing `message` to the target as a value within
    /// this process (see [`Caller::invoke_value`]).
    ///
    /// # Errors
    /// As [`Caller::invoke_as_root`]; `Rejected` (nothing sent) when this runtime routes
    /// its turns' calls ([`Caller::routes_calls`]); and what the target does with a
    /// value.
    pub async fn invoke_value_as_root(
        &self,
        target: &ActorId,
        message: AnyValue,
        timeout: Duration,
    ) -> Result<AnyValue, InvokeError> {
        self.as_root(target, timeout, |deadline| async move {
            if self.routes_calls() {
                return Err(values_are_not_routed(target));
            }
            let context = EnvelopeContext::Root(deadline);
            let reply = self
                .inner
                .handle
                .send_and_wait(target, Payload::Value(message), context, None)
                .await?;
            reply.into_value(target)
        })
        .await
    }

    /// A root request of this turn (see [`Caller::invoke_as_root`]): refused if the turn
    /// has ended; `send` gets the deadline (at most the turn's) and runs until the turn
    /// ends, when it is dropped and the request ends `Cancelled`.
    async fn as_root<T, F>(
        &self,
        target: &ActorId,
        timeout: Duration,
        send: impl FnOnce(Deadline) -> F,
    ) -> Result<T, InvokeError>
    where
        F: std::future::Future<Output = Result<T, InvokeError>>,
    {
        if self.turn_ended() {
            return Err(CallRefused::CallerTurnEnded {
                caller: self.inner.id.clone(),
            }
            .into());
        }
        let deadline = self.inner.handle.deadline_in(timeout).min(self.deadline());
        tokio::select! {
            biased;
            result = send(deadline) => result,
            () = self.inner.turn_ended() => Err(InvokeError::Cancelled { target: target.clone() }),
        }
    }

    /// Sends `payload` under `child` with no admission at all. For planted-bug tests of
    /// the simulator only (feature `planted-bugs`): it breaks the guarantees admission
    /// gives.
    ///
    /// # Errors
    /// As [`Caller::invoke`].
    #[cfg(feature = "planted-bugs")]
    pub async fn invoke_unchecked(
        &self,
        target: &ActorId,
        payload: Bytes,
        child: CallContext,
    ) -> Result<Bytes, InvokeError> {
        let inner = &*self.inner;
        inner
            .handle
            .invoke_from(&inner.id, target, payload, child, Some(inner))
            .await
    }
}

/// The refusal of a value sent where calls are routed (they may cross processes).
fn values_are_not_routed(target: &ActorId) -> InvokeError {
    InvokeError::Rejected {
        target: target.clone(),
        reason: "this runtime routes its turns' calls (a cluster node), which carry bytes: send bytes with \
                 Caller::invoke or Caller::invoke_as_root"
            .to_string(),
    }
}
