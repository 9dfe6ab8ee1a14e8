//! The runtime's shared core and the handle callers use: [`RuntimeHandle`] (invoke,
//! tell, deactivate, stats), the route map of open mailboxes and its fast path, the
//! counters, and the caller's wait for a reply. The dispatcher and the activations import
//! from here; nothing here imports the dispatcher or the builder ([`crate::Runtime`],
//! `runtime.rs`), so the arrows go one way.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};
use troupe_core::limits::{AGENT_CALL_DEPTH_MAX, DISPATCHER_QUEUE_CAPACITY, INVOKE_TIMEOUT_MS_MAX};
use troupe_core::{ActorId, ActorKind, CallContext, CallRefused, Deadline, InvokeError};

use crate::caller::CallerInner;
use crate::control::{Command, Control};
use crate::envelope::{Envelope, EnvelopeContext, EnvelopeSpan, Payload, Reply, ReplyTo};
use crate::fast_hash::IdMap;
use crate::idempotency::IdempotencyKey;
use crate::mailbox::{Delivery, Mailbox};
use crate::reply_cell::{ReplyReceiver, TryRecvError};
use crate::wait_for_graph::{CallId, EdgeRefused};
use crate::{ActorFactory, Clock, KindConfig, RuntimeEvent, RuntimeObserver, StateStore};

thread_local! {
    /// Whether the current thread is polling an actor's turn right now: set around every
    /// poll of a turn's handler ([`InTurn`]), so a root invocation from inside a turn can
    /// be refused. A plain flag: the check sits on the hot path.
    pub(crate) static IN_TURN: Cell<bool> = const { Cell::new(false) };
}

/// Polls a turn's handler with [`IN_TURN`] set.
pub(crate) struct InTurn<F>(pub(crate) F);

impl<F: Future + Unpin> Future for InTurn<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        /// Restores the flag even if the handler panics.
        struct Restore(bool);
        impl Drop for Restore {
            fn drop(&mut self) {
                IN_TURN.set(self.0);
            }
        }
        let _restore = Restore(IN_TURN.replace(true));
        Pin::new(&mut self.0).poll(cx)
    }
}

/// A registered actor kind: its factory and configuration.
pub(crate) struct KindEntry {
    pub(crate) factory: Arc<dyn ActorFactory>,
    pub(crate) config: KindConfig,
    /// The [`crate::TypedActor`] type of a typed kind, with its name.
    pub(crate) typed: Option<(std::any::TypeId, &'static str)>,
}

/// Counters of what the runtime did, for tests, the simulator and metrics.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) activations_started: AtomicU64,
    pub(crate) deactivations_finished: AtomicU64,
    pub(crate) turns_run: AtomicU64,
    pub(crate) turns_failed: AtomicU64,
    pub(crate) expired_dropped: AtomicU64,
    pub(crate) busy_refused: AtomicU64,
    pub(crate) deadlocks_refused: AtomicU64,
    pub(crate) deactivation_saves_failed: AtomicU64,
    pub(crate) turns_abandoned: AtomicU64,
    pub(crate) activations_aborted: AtomicU64,
    pub(crate) dispatcher_busy_refused: AtomicU64,
    pub(crate) store_retries: AtomicU64,
    pub(crate) told_lost: AtomicU64,
}

impl Counters {
    pub(crate) fn add(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// A snapshot of the runtime's counters since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RuntimeCounters {
    /// Activations spawned (first messages to inactive actors).
    pub activations_started: u64,
    /// Activations that finished deactivating.
    pub deactivations_finished: u64,
    /// Turns that ran to completion (successfully or not).
    pub turns_run: u64,
    /// Turns that failed, timed out or whose commit failed.
    pub turns_failed: u64,
    /// Requests and messages dropped unrun when dequeued: their deadline had passed, or
    /// (a request) its caller had stopped waiting (timed out, or went away) before it
    /// started.
    pub expired_dropped: u64,
    /// Requests refused with `Busy`.
    pub busy_refused: u64,
    /// Calls refused with `DeadlockDetected`.
    pub deadlocks_refused: u64,
    /// Deactivation saves that failed, or were skipped because `on_deactivate` failed
    /// (the last turn's state was already committed).
    pub deactivation_saves_failed: u64,
    /// Turns cancelled and rolled back because their caller stopped waiting (timed out,
    /// was cancelled, or its own turn ended).
    pub turns_abandoned: u64,
    /// Activations stopped at once because the shutdown grace period ended or the
    /// runtime was dropped (a running turn among them was cancelled: nothing of it was
    /// committed unless its commit was already in flight).
    pub activations_aborted: u64,
    /// Requests refused with `DispatcherBusy` (the dispatcher's queue was full).
    pub dispatcher_busy_refused: u64,
    /// Store operations tried again after the store failed for a moment
    /// (`StoreError::Unavailable`), one per try after the first: the runtime's claims,
    /// commits, saves at deactivation and a turn's reads, and those made through
    /// [`RuntimeHandle::retry_store`].
    pub store_retries: u64,
    /// Fire-and-forget messages accepted (their sender was answered `Ok`) and then not
    /// run, for a reason other than their deadline (counted in `expired_dropped`):
    /// queued or held when the shutdown grace ended, carried over crashes in a row past
    /// `CARRIED_OVER_MAX_MAILBOXES` mailboxes' worth, or kept after a fence (queued in an
    /// activation whose commit another runtime on the same store fenced off: kept for
    /// the next activation here, which they do not start) when the shutdown began
    /// before a new message started one, or past `ACTIVATIONS_MAX` actors with kept
    /// messages. Not counted: those in a mailbox whose task the end of the grace
    /// dropped, and those lost with the process.
    pub told_lost: u64,
}

/// The dispatcher's tables at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DispatcherStats {
    /// Entries in the activation table (any live state).
    pub activations: usize,
    /// Of those, how many have a closed mailbox: deactivating, or closed while still
    /// starting (they deactivate once started). New messages for them are held.
    pub deactivating: usize,
    /// Messages held for actors whose previous activation is still deactivating, and
    /// told messages kept for the next activation of actors whose activation was found
    /// stale (fenced by another runtime on the same store), which start none.
    pub held_messages: usize,
    /// Live calls in the wait-for graph.
    pub wait_for_edges: usize,
}

/// The open mailbox of one live activation, in the route map. Removing it from the map
/// (dropping it) closes the mailbox: that is the dispatcher's order to deactivate.
/// Typed refs' caches hold the mailbox itself, never the route, so they keep no mailbox
/// open.
pub(crate) struct Route(Arc<Mailbox>);

impl Route {
    /// A route for a new activation's mailbox.
    pub(crate) fn open(mailbox: Arc<Mailbox>) -> Self {
        Self(mailbox)
    }

    /// Delivers into the mailbox (the caller holds the route map's lock).
    pub(crate) fn deliver(&self, envelope: Envelope) -> Delivery {
        self.0.deliver(envelope)
    }

    /// Whether exactly `received` messages were put into the mailbox; if so, closes it
    /// in the same critical section (the mailbox's lock, which every delivery holds).
    /// The caller holds the map's lock and removes the route afterwards.
    pub(crate) fn close_if_delivered(&self, received: u64) -> bool {
        self.0.close_if_delivered(received)
    }

    /// Closes the mailbox of a route just removed from the map (as dropping it does).
    pub(crate) fn close(self) {}

    /// The mailbox, for a typed ref's cache.
    fn share(&self) -> Arc<Mailbox> {
        Arc::clone(&self.0)
    }
}

impl Drop for Route {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// A typed ref's cached mailbox of its actor's activation.
///
/// The first mailbox the ref delivered to is kept without a lock (`first`): a message
/// to it reads one pointer, where a lock is two atomic read-modify-writes per message,
/// about a tenth of a told message's time (perf, "Thirtieth pass" in
/// docs/architecture.md). Once that mailbox has closed (its activation ended), the ref
/// keeps the current one under a lock (`later`), empty until it delivers through the
/// route map again. Which mailbox is tried is only a guess either way: a delivery takes
/// the mailbox's own lock and is refused by a closed one, so the idle handshake's count
/// stays exact.
///
/// The cost: a ref that outlives its first activation keeps that activation's closed
/// mailbox (its lock and counters, about 100 bytes: the receiver's drop took its queue)
/// until the ref is dropped.
#[derive(Default)]
pub(crate) struct RouteCache {
    first: OnceLock<Arc<Mailbox>>,
    /// Set once `first` refused a delivery as closed: it is not tried again.
    first_closed: AtomicBool,
    later: Mutex<Option<Arc<Mailbox>>>,
}

/// Open mailboxes by actor id, shared by the dispatcher and the callers' fast path.
///
/// Only the dispatcher inserts and removes routes (it alone activates and deactivates);
/// a caller without a wait-for edge may put a message into an open mailbox directly,
/// found under this lock or in a typed ref's cache. Every delivery counts itself under
/// the mailbox's own lock, which the idle handshake's compare-and-close takes too, so
/// the count it compares is exact. Lock order: a ref's cache, then this map, then a
/// mailbox's lock.
#[derive(Default)]
pub(crate) struct Routes(Mutex<IdMap<Route>>);

impl Routes {
    pub(crate) fn lock(&self) -> MutexGuard<'_, IdMap<Route>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Where a fire-and-forget message went ([`RuntimeHandle::start_tell`]).
pub(crate) enum Told {
    /// Into the open mailbox: accepted.
    Accepted,
    /// To the dispatcher, which answers whether it accepted it.
    ToDispatcher(oneshot::Receiver<Result<(), InvokeError>>),
}

/// What the fast path did with a message.
enum FastPath {
    /// Put into the open mailbox.
    Delivered,
    /// Refused at once (full mailbox).
    Refused(InvokeError),
    /// No open mailbox: the dispatcher must route it (and maybe activate).
    ToDispatcher(Box<Envelope>),
}

pub(crate) struct Shared {
    pub(crate) commands: mpsc::Sender<Command>,
    pub(crate) control: mpsc::UnboundedSender<Control>,
    pub(crate) clock: Clock,
    pub(crate) kinds: BTreeMap<ActorKind, KindEntry>,
    pub(crate) store: Arc<dyn StateStore>,
    pub(crate) counters: Counters,
    pub(crate) routes: Routes,
    /// The wait-for graph of the calls made by this runtime's turns (and the cluster
    /// layer's remote waits).
    pub(crate) waits: crate::wait_for_graph::SharedWaits,
    pub(crate) observer: Option<Arc<dyn RuntimeObserver>>,
    /// Set once when running turns must stop at once: the shutdown grace period ended,
    /// or the `Runtime` was dropped. Every activation watches it.
    pub(crate) abort: AtomicBool,
    pub(crate) shutdown_grace: Duration,
    pub(crate) next_call: AtomicU64,
    /// Where calls made by turns go, when a cluster layer installed a router.
    pub(crate) router: std::sync::OnceLock<Arc<dyn crate::TurnCallRouter>>,
    /// Where root requests made through [`RuntimeHandle::invoke_routed`] and
    /// `Caller::invoke_as_root` go, when a cluster layer installed a router.
    pub(crate) root_router: std::sync::OnceLock<Arc<dyn crate::RootCallRouter>>,
    /// Planted bug (simulator only): turns ignore that their caller gave up.
    #[cfg(feature = "planted-bugs")]
    pub(crate) planted_commit_after_abandon: bool,
    /// Planted bug (simulator only): a turn whose handler failed commits anyway.
    #[cfg(feature = "planted-bugs")]
    pub(crate) planted_commit_failed_turn: bool,
    /// Planted bug (simulator only): the transport does not check arrivals again.
    #[cfg(feature = "planted-bugs")]
    pub(crate) planted_no_arrival_checks: bool,
}

impl Shared {
    /// Tells the observer, if there is one.
    pub(crate) fn emit(&self, event: impl FnOnce() -> RuntimeEvent) {
        if let Some(observer) = &self.observer {
            observer.on_event(&event());
        }
    }

    /// Whether the runtime was aborted (dropped without a shutdown, or its shutdown
    /// grace is over): nothing more is committed or admitted.
    pub(crate) fn aborted(&self) -> bool {
        self.abort.load(Ordering::Acquire)
    }

    /// A fresh request id.
    pub(crate) fn next_call(&self) -> u64 {
        self.next_call.fetch_add(1, Ordering::Relaxed)
    }

    /// Delivers straight into an open mailbox, skipping the dispatcher's queue: through
    /// `cache` (a typed ref's) if it holds an open route, else through the route map
    /// (and then remembers the route in `cache`).
    fn fast_path(&self, target: &ActorId, envelope: Envelope, cache: Option<&RouteCache>) -> FastPath {
        let Some(cache) = cache else {
            let routes = self.routes.lock();
            let Some(route) = routes.get(target) else {
                drop(routes);
                return FastPath::ToDispatcher(Box::new(envelope));
            };
            return self.delivered(target, route.deliver(envelope));
        };
        let mut envelope = envelope;
        if let Some(mailbox) = cache.first.get() {
            if !cache.first_closed.load(Ordering::Relaxed) {
                match mailbox.deliver(envelope) {
                    Delivery::Closed(back) => {
                        cache.first_closed.store(true, Ordering::Relaxed);
                        envelope = *back;
                    }
                    delivery => return self.delivered(target, delivery),
                }
            }
        }
        let mut cached = cache.later.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(mailbox) = cached.as_ref() {
            match mailbox.deliver(envelope) {
                Delivery::Closed(back) => {
                    // That activation is ending or gone: look for the next one.
                    *cached = None;
                    envelope = *back;
                }
                delivery => return self.delivered(target, delivery),
            }
        }
        let routes = self.routes.lock();
        let Some(route) = routes.get(target) else {
            drop(routes);
            return FastPath::ToDispatcher(Box::new(envelope));
        };
        let delivery = route.deliver(envelope);
        if !matches!(delivery, Delivery::Closed(_)) {
            // (Under `later`'s lock: two senders through one ref set `first` one at a
            // time, and the second finds it set.)
            if cache.first.get().is_none() {
                let _ = cache.first.set(route.share());
            } else {
                *cached = Some(route.share());
            }
        }
        self.delivered(target, delivery)
    }

    /// The fast path's answer for a delivery attempt.
    fn delivered(&self, target: &ActorId, delivery: Delivery) -> FastPath {
        match delivery {
            Delivery::Delivered => FastPath::Delivered,
            Delivery::Full(_, capacity) => {
                Counters::add(&self.counters.busy_refused);
                FastPath::Refused(InvokeError::Busy {
                    target: target.clone(),
                    capacity,
                })
            }
            // The activation ended; the dispatcher knows what to do next.
            Delivery::Closed(envelope) => FastPath::ToDispatcher(envelope),
        }
    }
}

/// A cheap, cloneable handle to a running runtime: invoke actors, read the clock.
#[derive(Clone)]
pub struct RuntimeHandle {
    pub(crate) shared: Arc<Shared>,
}

impl fmt::Debug for RuntimeHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RuntimeHandle")
            .field("kinds", &self.shared.kinds.keys())
            .finish()
    }
}

/// A handle that does not keep its runtime alive: for what the runtime itself owns
/// (an actor factory, something a factory shares with its actors) and must reach the
/// runtime without holding it. A strong [`RuntimeHandle`] there would be a reference
/// cycle (the runtime owns the factory, the factory the handle), and a runtime in one
/// is never freed, nor anything it holds (its store, its actors' factories), after
/// the last outside handle is dropped.
#[derive(Clone)]
pub struct WeakRuntimeHandle {
    shared: std::sync::Weak<Shared>,
}

impl WeakRuntimeHandle {
    /// The runtime, while anything else still holds it; `None` once it has been
    /// dropped.
    pub fn upgrade(&self) -> Option<RuntimeHandle> {
        self.shared.upgrade().map(|shared| RuntimeHandle { shared })
    }
}

impl fmt::Debug for WeakRuntimeHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WeakRuntimeHandle")
            .field("alive", &(self.shared.strong_count() > 0))
            .finish()
    }
}

/// Why a request from outside any turn under `context` must not run, if it must not:
/// no admission could have given that context. `target` waits up its chain (its turn
/// would wait on itself: `CycleDetected`, the chain with `target` appended), or the
/// context is deeper than [`AGENT_CALL_DEPTH_MAX`] (`DepthExceeded`, with the caller's
/// depth). The transport's arrival check (`serve_connection_request`) refuses the same,
/// and is skipped with it under the planted bug `plant_bug_no_arrival_checks`.
pub(crate) fn refusal_of_context(shared: &Shared, target: &ActorId, context: &CallContext) -> Option<InvokeError> {
    #[cfg(feature = "planted-bugs")]
    if shared.planted_no_arrival_checks {
        return None;
    }
    #[cfg(not(feature = "planted-bugs"))]
    let _ = shared;
    if context.contains(target) {
        let chain = context.chain().iter().chain([target]).cloned().collect();
        return Some(CallRefused::CycleDetected { chain }.into());
    }
    if context.depth() > AGENT_CALL_DEPTH_MAX {
        return Some(
            CallRefused::DepthExceeded {
                depth: context.depth() - 1,
                max: AGENT_CALL_DEPTH_MAX,
            }
            .into(),
        );
    }
    None
}

/// `deadline`, or [`INVOKE_TIMEOUT_MS_MAX`] after `now` if that is earlier: the deadline
/// of a root request sent at `now` with a deadline its caller chose (`invoke`,
/// `invoke_keyed`, `invoke_routed` on this runtime, `invoke_root_for_router`). A request
/// with a caller has no timer but its caller's, so an uncut deadline (the end of time,
/// `Deadline::from_micros(u64::MAX)`) let its turn run unbounded.
#[inline]
fn root_deadline_capped(now: Deadline, deadline: Deadline) -> Deadline {
    deadline.cut_to_longest_invoke(now)
}

/// Owns the reply receiver of one request while its caller waits. When the wait ends
/// without a reply (timeout, the caller's future dropped, its turn ended), dropping the
/// guard closes the receiver first, so the callee's turn sees its caller gone and is
/// cancelled, and the dispatcher never routes the request; then it removes the wait-for
/// edge (the callee may remove it too, when it answers: the second removal finds
/// nothing) and reports the abandonment. A wait that got its reply removes nothing:
/// whoever answers a request with an edge removes the edge before the reply is sent.
pub(crate) struct WaitGuard<'a> {
    shared: &'a Shared,
    target: &'a ActorId,
    call: u64,
    edge: bool,
    answer: Option<ReplyReceiver>,
    answered: bool,
}

impl Drop for WaitGuard<'_> {
    fn drop(&mut self) {
        drop(self.answer.take());
        if self.edge {
            self.shared.waits.remove(self.call);
        }
        if !self.answered {
            self.shared.emit(|| RuntimeEvent::RequestAbandoned {
                target: self.target.clone(),
                request: self.call,
            });
        }
    }
}

impl RuntimeHandle {
    /// A [`WeakRuntimeHandle`] to this runtime, which does not keep it alive.
    pub fn downgrade(&self) -> WeakRuntimeHandle {
        WeakRuntimeHandle {
            shared: Arc::downgrade(&self.shared),
        }
    }

    /// Whether the runtime was aborted: dropped without a shutdown, or its shutdown
    /// grace ran out. Nothing is committed or admitted from then on, and its turns are
    /// being cancelled; code that reacts to a cancelled turn (a guard's `Drop`) should
    /// start no outside work then, as a crashed process would not.
    pub fn is_aborted(&self) -> bool {
        self.shared.aborted()
    }

    /// The runtime's clock.
    pub fn clock(&self) -> Clock {
        self.shared.clock
    }

    /// The current time on the runtime's clock.
    pub fn now(&self) -> Deadline {
        self.shared.clock.now()
    }

    /// The deadline `timeout` from now, capped at [`INVOKE_TIMEOUT_MS_MAX`].
    pub fn deadline_in(&self, timeout: Duration) -> Deadline {
        self.shared
            .clock
            .deadline_in(timeout.min(Duration::from_millis(INVOKE_TIMEOUT_MS_MAX)))
    }

    /// Whether actors of `kind` can be invoked.
    pub fn is_registered(&self, kind: &ActorKind) -> bool {
        self.shared.kinds.contains_key(kind)
    }

    /// The store actors of this runtime commit to.
    pub fn store(&self) -> &Arc<dyn StateStore> {
        &self.shared.store
    }

    /// Makes the store operation `attempt` (code outside any turn going to
    /// [`RuntimeHandle::store`] itself: an API's reads, a server's own records) and,
    /// while it fails for a moment ([`crate::StoreError::Unavailable`]: a server
    /// restarting, a connection refused, a file locked), makes it again as the runtime
    /// makes its own claims, commits and reads again (`store_retry.rs`): after a pause
    /// of [`crate::STORE_RETRY_PAUSE_MS_FIRST`], doubling up to
    /// [`crate::STORE_RETRY_PAUSE_MS_MAX`] and never past half of what is left, each try
    /// after the first counted in [`RuntimeCounters::store_retries`]. `deadline` is
    /// that of the request the operation serves: no try starts after it (the first is
    /// made whatever it is), and a try in flight is not cut. The tries stop too once
    /// the runtime is aborted (dropped, or its shutdown grace over), seen before the
    /// next try. `operation` and `actor` (the key space) name the operation in the log.
    ///
    /// Make again only what may be made twice: a read; a claim (one applied unseen
    /// costs a fence); a commit whose every try is the same commit under the same fence
    /// with the same absolute writes (one applied unseen is applied again to the same
    /// effect, or refused `Fenced` if another claim came since).
    ///
    /// # Errors
    /// The first error that is not transient, at once; the last `Unavailable` when the
    /// deadline or an abort ends the tries.
    ///
    /// # Cancel safety
    /// Dropping the future drops the try in flight, as dropping `attempt`'s future
    /// would, and makes no further one.
    pub async fn retry_store<T, F, Attempt>(
        &self,
        deadline: Deadline,
        operation: &str,
        actor: &ActorId,
        mut attempt: F,
    ) -> Result<T, crate::StoreError>
    where
        F: FnMut() -> Attempt,
        Attempt: Future<Output = Result<T, crate::StoreError>>,
    {
        match attempt().await {
            Err(first) if first.is_transient() => {
                let bounds = crate::store_retry::RetryBounds {
                    shared: &self.shared,
                    deadline,
                    mailbox: None,
                    actor,
                    operation,
                };
                Box::pin(crate::store_retry::retry(bounds, first, attempt)).await
            }
            done => done,
        }
    }

    /// Sends `payload` to `target` from outside any actor and waits for the reply until
    /// `deadline`. Activates the actor if it is inactive. A `deadline` further than
    /// [`INVOKE_TIMEOUT_MS_MAX`] away is cut to that much from now (the request's turn
    /// and the wait end then, with `Timeout`), as [`RuntimeHandle::invoke_within`] cuts a
    /// timeout.
    ///
    /// # Errors
    /// [`InvokeError`]: `Timeout` when the deadline passes first (the request is then
    /// dropped unrun, or its turn cancelled and rolled back), `Busy` when the mailbox is
    /// full, `ActorNotFound` for an unregistered kind, `ActorFailed`, `Rejected`,
    /// `StorageFailed`, `DispatcherBusy` (the dispatcher's queue is full: nothing was
    /// queued), `Shutdown`, and `Refused(RootInvokeInsideTurn)` when called from inside
    /// an actor's turn (through a captured handle): calls from a turn go through its
    /// [`crate::Caller`].
    ///
    /// # Cancel safety
    /// Dropping the future abandons the request: if it has not started running it never
    /// will, and if its turn is running, the turn is cancelled at its next `.await` and
    /// rolled back (a turn already committing keeps its commit).
    pub async fn invoke(&self, target: &ActorId, payload: Bytes, deadline: Deadline) -> Result<Bytes, InvokeError> {
        if IN_TURN.get() {
            return Err(CallRefused::RootInvokeInsideTurn.into());
        }
        self.invoke_root(target, payload, deadline).await
    }

    /// As [`RuntimeHandle::invoke`], for one attempt of the logical request `key` names:
    /// if a turn of `target` with this key has committed, its reply is returned and the
    /// handler does not run again; otherwise the handler runs, and its reply is recorded
    /// under `key` in the same atomic commit as the turn's own writes and state. A turn
    /// that fails, times out, is abandoned or whose commit is refused records nothing, so
    /// a retry runs the handler. Retry a request that timed out with the same key: if the
    /// first attempt was committing when the caller gave up, the retry gets its reply
    /// (the retry's turn starts only once that commit has landed).
    ///
    /// The key is per actor (the same key sent to two actors names two requests), and an
    /// actor keeps the last [`crate::IDEMPOTENCY_KEYS_KEPT_MAX`] keys: a retry that comes
    /// after that many later keyed requests to the same actor runs again. The payload of
    /// a retry is not compared with the first attempt's. A keyed turn always commits (its
    /// record) and reads the store once or three times (a recorded key; a new one), so a
    /// keyed request costs a store commit where an unkeyed read-only one costs none.
    ///
    /// From a turn, [`crate::Caller::call_keyed`] makes the same guarantee for a call.
    /// The deadline is cut as [`RuntimeHandle::invoke`] cuts it.
    ///
    /// Local, as [`RuntimeHandle::invoke`]: the request runs on this runtime. Its routed
    /// form, [`RuntimeHandle::invoke_routed_keyed`], runs it on the node that owns
    /// `target` (the transport carries the key, and the target runs it keyed there). In
    /// a cluster the key is checked against the shared, fenced store, so a retry holds
    /// wherever the actor is active next and through whichever node it is sent.
    ///
    /// # Errors
    /// As [`RuntimeHandle::invoke`]. A turn that writes so much that the record no longer
    /// fits ([`crate::TURN_WRITES_MAX`] less 4) fails with `StorageFailed`
    /// (`TooManyWrites`), as does one whose reply is larger than
    /// [`crate::STATE_VALUE_SIZE_MAX`] (refused by the store at commit).
    ///
    /// # Cancel safety
    /// As [`RuntimeHandle::invoke`].
    pub async fn invoke_keyed(
        &self,
        target: &ActorId,
        key: &IdempotencyKey,
        payload: Bytes,
        deadline: Deadline,
    ) -> Result<Bytes, InvokeError> {
        if IN_TURN.get() {
            return Err(CallRefused::RootInvokeInsideTurn.into());
        }
        self.invoke_root_keyed(target, key, payload, deadline).await
    }

    /// A keyed root request on this runtime, without the inside-a-turn check.
    pub(crate) async fn invoke_root_keyed(
        &self,
        target: &ActorId,
        key: &IdempotencyKey,
        payload: Bytes,
        deadline: Deadline,
    ) -> Result<Bytes, InvokeError> {
        let now = self.shared.clock.now();
        self.send_and_wait_from(
            now,
            target,
            Payload::keyed(key, payload),
            EnvelopeContext::Root(root_deadline_capped(now, deadline)),
            None,
        )
        .await?
        .into_bytes(target)
    }

    /// As `invoke_from`, for a keyed call: the target runs it as
    /// [`RuntimeHandle::invoke_keyed`] does.
    pub(crate) async fn invoke_keyed_from(
        &self,
        caller: &ActorId,
        target: &ActorId,
        key: &IdempotencyKey,
        payload: Bytes,
        context: CallContext,
        turn: Option<&CallerInner>,
    ) -> Result<Bytes, InvokeError> {
        self.send_and_wait(
            target,
            Payload::keyed(key, payload),
            context.into(),
            Some((caller, turn)),
        )
        .await?
        .into_bytes(target)
    }

    /// As [`RuntimeHandle::invoke`], with the deadline `timeout` from now (capped at
    /// [`INVOKE_TIMEOUT_MS_MAX`]). Reads the clock once for both the deadline and the
    /// call, where `invoke(target, payload, handle.deadline_in(timeout))` reads it twice.
    ///
    /// # Errors
    /// As [`RuntimeHandle::invoke`].
    pub async fn invoke_within(
        &self,
        target: &ActorId,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<Bytes, InvokeError> {
        if IN_TURN.get() {
            return Err(CallRefused::RootInvokeInsideTurn.into());
        }
        let now = self.shared.clock.now();
        let deadline = Deadline::after(now, timeout.min(Duration::from_millis(INVOKE_TIMEOUT_MS_MAX)));
        self.start_call(
            now,
            target,
            Payload::Bytes(payload),
            EnvelopeContext::Root(deadline),
            None,
            None,
        )?
        .await?
        .into_bytes(target)
    }

    /// As [`RuntimeHandle::invoke`], under `context` instead of a root context: the
    /// target's turn runs at `context`'s depth, with its chain and deadline (capped at
    /// [`INVOKE_TIMEOUT_MS_MAX`] from now), so its own calls are admitted against them.
    /// For calls that arrive from another process with their place in a call tree
    /// ([`CallContext::continued`]). No wait-for edge is recorded (the callers are in
    /// another process).
    ///
    /// A context no admission could have given is refused before anything runs, as the
    /// transport refuses it on arrival: one whose chain holds `target`, and one deeper
    /// than [`AGENT_CALL_DEPTH_MAX`].
    ///
    /// # Errors
    /// As [`RuntimeHandle::invoke`]; `Refused(CycleDetected)` (the chain with `target`
    /// appended) if `target` is in the context's chain, `Refused(DepthExceeded)` (with
    /// the caller's depth, one less than the context's) if the context is deeper than
    /// [`AGENT_CALL_DEPTH_MAX`].
    pub async fn invoke_in(
        &self,
        target: &ActorId,
        payload: Bytes,
        context: CallContext,
    ) -> Result<Bytes, InvokeError> {
        if IN_TURN.get() {
            return Err(CallRefused::RootInvokeInsideTurn.into());
        }
        if let Some(refused) = refusal_of_context(&self.shared, target, &context) {
            return Err(refused);
        }
        let now = self.shared.clock.now();
        let context = context.with_deadline(context.deadline().cut_to_longest_invoke(now));
        self.send_and_wait_from(now, target, Payload::Bytes(payload), context.into(), None)
            .await?
            .into_bytes(target)
    }

    /// A root invocation without the inside-a-turn check: for `Caller::invoke_as_root`.
    /// Always local (see [`RuntimeHandle::invoke_root_routed`]).
    pub(crate) async fn invoke_root(
        &self,
        target: &ActorId,
        payload: Bytes,
        deadline: Deadline,
    ) -> Result<Bytes, InvokeError> {
        let now = self.shared.clock.now();
        let context = EnvelopeContext::Root(root_deadline_capped(now, deadline));
        self.send_and_wait_from(now, target, Payload::Bytes(payload), context, None)
            .await?
            .into_bytes(target)
    }

    /// Sends `payload` to `target` on behalf of `caller`'s running turn under `context`
    /// (the callee's context: depth, chain and deadline already derived by admission).
    /// The wait-for edge `caller → target` is in the runtime's graph from before the
    /// message is sent until the callee replies or the caller stops waiting; the call is
    /// refused at once with `DeadlockDetected` if the edge would close a cycle. The wait also ends, with
    /// `Cancelled`, when `turn_end` reports that the calling turn has ended.
    ///
    /// Only [`crate::Caller`] calls this: identity and context come from the runtime.
    pub(crate) async fn invoke_from(
        &self,
        caller: &ActorId,
        target: &ActorId,
        payload: Bytes,
        context: CallContext,
        turn: Option<&CallerInner>,
    ) -> Result<Bytes, InvokeError> {
        // The request is started here and its wait awaited directly (not through
        // `send_and_wait`'s nested futures): a turn's future holds this one across the
        // call, and a smaller turn future stays in its activation's slot.
        let now = self.shared.clock.now();
        self.start_call(
            now,
            target,
            Payload::Bytes(payload),
            context.into(),
            Some((caller, turn)),
            None,
        )?
        .await?
        .into_bytes(target)
    }

    /// Sends `payload` to `target` from outside any actor without waiting for a reply
    /// (fire-and-forget). Returns once the message is accepted: in the actor's mailbox,
    /// or held for its next activation (activating it if it is inactive). Its turn runs
    /// under `deadline` like any other, with nobody waiting: its reply and its errors
    /// go nowhere (the counters show failed turns). A `deadline` further than
    /// [`INVOKE_TIMEOUT_MS_MAX`] away is cut to that much from the moment the actor
    /// dequeues the message.
    ///
    /// The runtime keeps accepted messages in memory only: they are lost if the process
    /// stops before they run. (Durable delivery is the agent inbox's job.)
    ///
    /// # Errors
    /// The same refusals as [`RuntimeHandle::invoke`], at once: `Timeout` (the deadline
    /// has passed: nothing was sent), `Busy`, `ActorNotFound`, `DispatcherBusy`,
    /// `Rejected`, `Shutdown`, and `Refused(RootInvokeInsideTurn)` inside a turn.
    pub async fn tell(&self, target: &ActorId, payload: Bytes, deadline: Deadline) -> Result<(), InvokeError> {
        if IN_TURN.get() {
            return Err(CallRefused::RootInvokeInsideTurn.into());
        }
        self.send_only(target, Payload::Bytes(payload), EnvelopeContext::Root(deadline))
            .await
    }

    /// As [`RuntimeHandle::tell`], for one delivery of the message `key` names: a turn of
    /// `target` with this key that committed makes every later delivery a no-op (the
    /// handler does not run again), as for [`RuntimeHandle::invoke_keyed`]. For a source
    /// that delivers at least once (a queue that redelivers what it could not see
    /// acknowledged): tell each message under its id, and its effect lands once. A
    /// delivery whose turn fails, times out or is not committed records nothing, so the
    /// next delivery runs.
    ///
    /// Copies queued together run one after another (an actor's turns are one at a
    /// time, each commit landing before the next turn starts), so only the first runs the
    /// handler. A keyed turn always commits (its record), and an actor keeps its last
    /// [`crate::IDEMPOTENCY_KEYS_KEPT_MAX`] keys, told or asked. Local, as `tell`.
    ///
    /// # Errors
    /// As [`RuntimeHandle::tell`].
    pub async fn tell_keyed(
        &self,
        target: &ActorId,
        key: &IdempotencyKey,
        payload: Bytes,
        deadline: Deadline,
    ) -> Result<(), InvokeError> {
        if IN_TURN.get() {
            return Err(CallRefused::RootInvokeInsideTurn.into());
        }
        self.send_only(target, Payload::keyed(key, payload), EnvelopeContext::Root(deadline))
            .await
    }

    /// Fire-and-forget delivery of `payload` (see [`RuntimeHandle::tell`]).
    pub(crate) async fn send_only(
        &self,
        target: &ActorId,
        payload: Payload,
        context: EnvelopeContext,
    ) -> Result<(), InvokeError> {
        self.send_only_from(self.shared.clock.now(), target, payload, context, None)
            .await
    }

    /// As `send_only`, with the clock already read as `now`.
    pub(crate) async fn send_only_from(
        &self,
        now: Deadline,
        target: &ActorId,
        payload: Payload,
        context: EnvelopeContext,
        cache: Option<&RouteCache>,
    ) -> Result<(), InvokeError> {
        match self.start_tell(Some(now), target, payload, context, cache)? {
            Told::Accepted => Ok(()),
            // The dispatcher answers at once (it never waits on anything); it is gone
            // only when the runtime has stopped.
            Told::ToDispatcher(accepted) => accepted.await.unwrap_or(Err(InvokeError::Shutdown)),
        }
    }

    /// Hands a fire-and-forget message over: straight into the open mailbox (accepted
    /// at once), or to the dispatcher, whose acceptance the caller then awaits. Plain,
    /// not `async`: nothing before the dispatcher's answer waits.
    ///
    /// `now` is the clock read for the send, to refuse a deadline that has passed; `None`
    /// for a deadline the sender computed itself ([`crate::ActorRef::tell_by`]): then an
    /// expired one is found later, refused by the dispatcher (an inactive actor) or
    /// dropped when the message is dequeued.
    ///
    /// Always inlined: with three callers the compiler stopped inlining it into
    /// `ActorRef::tell`, which cost about 70 instructions a message there.
    #[inline(always)]
    pub(crate) fn start_tell(
        &self,
        now: Option<Deadline>,
        target: &ActorId,
        payload: Payload,
        context: EnvelopeContext,
        cache: Option<&RouteCache>,
    ) -> Result<Told, InvokeError> {
        let shared = &*self.shared;
        if let Some(now) = now {
            if context.deadline().has_passed(now) {
                return Err(InvokeError::Timeout {
                    target: target.clone(),
                    timeout_ms: 0,
                });
            }
        }
        let call = shared.next_call();
        let span = tracing::info_span!("tell", target = %target, request = call, depth = context.depth());
        let envelope = Envelope {
            payload,
            context,
            reply: ReplyTo::Nobody,
            call,
            edge: false,
            span: EnvelopeSpan::new(span),
        };
        let mut envelope = match shared.fast_path(target, envelope, cache) {
            FastPath::Delivered => return Ok(Told::Accepted),
            FastPath::Refused(error) => return Err(error),
            FastPath::ToDispatcher(back) => back,
        };
        let (acceptance, accepted) = oneshot::channel();
        envelope.reply = ReplyTo::Acceptance(acceptance);
        let command = Command::Invoke {
            target: target.clone(),
            envelope,
        };
        match shared.commands.try_send(command) {
            Ok(()) => Ok(Told::ToDispatcher(accepted)),
            Err(mpsc::error::TrySendError::Full(_)) => {
                Counters::add(&shared.counters.dispatcher_busy_refused);
                Err(InvokeError::DispatcherBusy {
                    capacity: DISPATCHER_QUEUE_CAPACITY,
                })
            }
            Err(mpsc::error::TrySendError::Closed(_)) => Err(InvokeError::Shutdown),
        }
    }

    /// The runtime's counters since it started.
    pub fn counters(&self) -> RuntimeCounters {
        let c = &self.shared.counters;
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        RuntimeCounters {
            activations_started: load(&c.activations_started),
            deactivations_finished: load(&c.deactivations_finished),
            turns_run: load(&c.turns_run),
            turns_failed: load(&c.turns_failed),
            expired_dropped: load(&c.expired_dropped),
            busy_refused: load(&c.busy_refused),
            deadlocks_refused: load(&c.deadlocks_refused),
            deactivation_saves_failed: load(&c.deactivation_saves_failed),
            turns_abandoned: load(&c.turns_abandoned),
            activations_aborted: load(&c.activations_aborted),
            dispatcher_busy_refused: load(&c.dispatcher_busy_refused),
            store_retries: load(&c.store_retries),
            told_lost: load(&c.told_lost),
        }
    }

    /// Deactivates `target` now, whether or not it is idle, and waits until it has.
    ///
    /// The same handshake as idle deactivation: the dispatcher closes the mailbox, so
    /// the running turn (if any) and the requests already queued still run, then
    /// `on_deactivate` runs and the state is saved; requests that arrive meanwhile are
    /// held and start the next activation. Nothing accepted is dropped, and at most one
    /// activation exists throughout.
    ///
    /// Returns whether an activation was live (`false`: nothing to do). A graceful
    /// shutdown that begins while this waits deactivates the activation the same way
    /// (its turn finishes, `on_deactivate` runs, the state is saved), and this returns
    /// `Ok(true)`.
    ///
    /// # Errors
    /// [`InvokeError::Shutdown`] if the runtime has stopped, or is aborted (dropped, or
    /// its shutdown grace over) before the activation has ended.
    pub async fn deactivate(&self, target: &ActorId) -> Result<bool, InvokeError> {
        let (reply, answer) = oneshot::channel();
        let command = Command::Deactivate {
            target: target.clone(),
            reply,
        };
        self.shared
            .commands
            .send(command)
            .await
            .map_err(|_| InvokeError::Shutdown)?;
        answer.await.map_err(|_| InvokeError::Shutdown)
    }

    /// The dispatcher's tables now.
    ///
    /// # Errors
    /// [`InvokeError::Shutdown`] if the dispatcher has stopped.
    pub async fn stats(&self) -> Result<DispatcherStats, InvokeError> {
        let (reply, answer) = oneshot::channel();
        self.shared
            .commands
            .send(Command::Stats { reply })
            .await
            .map_err(|_| InvokeError::Shutdown)?;
        answer.await.map_err(|_| InvokeError::Shutdown)
    }

    pub(crate) async fn send_and_wait(
        &self,
        target: &ActorId,
        payload: Payload,
        context: EnvelopeContext,
        caller: Option<(&ActorId, Option<&CallerInner>)>,
    ) -> Result<Payload, InvokeError> {
        self.send_and_wait_from(self.shared.clock.now(), target, payload, context, caller)
            .await
    }

    /// As `send_and_wait`, with the clock already read as `now`.
    pub(crate) async fn send_and_wait_from(
        &self,
        now: Deadline,
        target: &ActorId,
        payload: Payload,
        context: EnvelopeContext,
        caller: Option<(&ActorId, Option<&CallerInner>)>,
    ) -> Result<Payload, InvokeError> {
        self.start_call(now, target, payload, context, caller, None)?.await
    }

    /// Sends a request and returns the wait for its reply, or the refusal. Everything a
    /// request does before it waits is synchronous (the fast path and the dispatcher's
    /// queue both use `try_send`), so it is a plain function: the hot path builds one
    /// small future, [`ReplyWait`], instead of a chain of nested `async fn` states.
    ///
    /// The request is sent when this returns `Ok`; dropping the [`ReplyWait`] abandons it.
    /// `cache` is a typed ref's cached route (calls from a turn have none). A call from a
    /// turn (`caller`) adds its wait-for edge first (`add_call_edge`), then goes the same
    /// way as any request: into the open mailbox, or through the dispatcher.
    pub(crate) fn start_call<'a>(
        &'a self,
        now: Deadline,
        target: &'a ActorId,
        payload: Payload,
        context: EnvelopeContext,
        caller: Option<(&ActorId, Option<&'a CallerInner>)>,
        cache: Option<&RouteCache>,
    ) -> Result<ReplyWait<'a>, InvokeError> {
        let shared = &*self.shared;
        let deadline = context.deadline();
        if deadline.has_passed(now) {
            return Err(InvokeError::Timeout {
                target: target.clone(),
                timeout_ms: 0,
            });
        }
        let call = shared.next_call();
        let (edge, turn_end) = match caller {
            Some((caller, turn_end)) => (Some(caller), turn_end),
            None => (None, None),
        };
        // A call from a turn adds its wait-for edge now, before the message is anywhere,
        // and is refused if the edge would close a cycle: nothing is queued then.
        if let Some(caller) = edge {
            self.add_call_edge(call, caller, target)?;
        }
        let (reply, answer) = crate::reply_cell::channel();
        // From here on the guard owns the edge: a refusal below, or a wait that ends
        // without a reply, removes it when the guard drops.
        let mut guard = WaitGuard {
            shared,
            target,
            call,
            edge: edge.is_some(),
            answer: Some(answer),
            answered: false,
        };
        // The parent of the callee's turn span: a child of the caller's current span (its
        // own turn's, for a call from a turn), so one request is one tree of spans.
        let span = tracing::info_span!("invoke", target = %target, request = call, depth = context.depth());
        let envelope = Envelope {
            payload,
            context,
            reply: ReplyTo::Caller(reply),
            call,
            edge: edge.is_some(),
            span: EnvelopeSpan::new(span),
        };
        let wait = |guard| ReplyWait {
            guard,
            deadline,
            sent_at: now,
            turn_end,
            yields: 0,
            slow: None,
        };
        // Straight into the target's mailbox when it is open (a call from a turn too:
        // its edge is in the graph already); otherwise through the dispatcher.
        let envelope = match shared.fast_path(target, envelope, cache) {
            FastPath::Delivered => return Ok(wait(guard)),
            FastPath::Refused(error) => {
                guard.answered = true;
                return Err(error);
            }
            FastPath::ToDispatcher(back) => back,
        };
        let command = Command::Invoke {
            target: target.clone(),
            envelope,
        };
        match shared.commands.try_send(command) {
            Ok(()) => Ok(wait(guard)),
            Err(mpsc::error::TrySendError::Full(_)) => {
                // Backpressure at the dispatcher too: refuse at once, never wait in line.
                Counters::add(&shared.counters.dispatcher_busy_refused);
                guard.answered = true;
                Err(InvokeError::DispatcherBusy {
                    capacity: DISPATCHER_QUEUE_CAPACITY,
                })
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                guard.answered = true;
                Err(InvokeError::Shutdown)
            }
        }
    }
}

impl RuntimeHandle {
    /// Adds the wait-for edge `caller → target` of `call`, or refuses the call:
    /// `DeadlockDetected` with the cycle the edge would close, `Rejected` when the graph
    /// is full. When a path from `target` reaches a call to another node, the installed
    /// router hears of it (after the graph's lock is let go), to probe for a cycle that
    /// crosses nodes.
    fn add_call_edge(&self, call: CallId, caller: &ActorId, target: &ActorId) -> Result<(), InvokeError> {
        let shared = &*self.shared;
        let mut waits = shared.waits.lock();
        match waits.try_add(call, caller, target) {
            Ok(()) => {
                let leaving = if waits.has_remote() && self.turn_call_router().is_some() {
                    waits.remote_edges_reachable(target)
                } else {
                    Vec::new()
                };
                drop(waits);
                if !leaving.is_empty() {
                    if let Some(router) = self.turn_call_router() {
                        router.path_leaves_node(leaving);
                    }
                }
                Ok(())
            }
            Err(EdgeRefused::Cycle(cycle)) => {
                drop(waits);
                Counters::add(&shared.counters.deadlocks_refused);
                Err(InvokeError::DeadlockDetected { cycle })
            }
            Err(EdgeRefused::Full) => Err(InvokeError::Rejected {
                target: target.clone(),
                reason: "the wait-for graph is full".to_string(),
            }),
        }
    }
}

/// How many times a caller's wait yields (its task wakes itself) before it arms the
/// deadline's timer, in polls. The first yield lets an active callee run: its reply is
/// then there at the next poll. The second lets a request to an actor that was not
/// active go through the dispatcher, which spawns the activation, and then through the
/// activation's first turn. Each later yield would cost a round of the scheduler for
/// every call that really waits, to spare a timer (about 1,400 instructions of a cold
/// activation's 18,000, callgrind) only to calls that finish within it.
pub(crate) const REPLY_WAIT_YIELDS_BEFORE_TIMER: u8 = 2;

/// The wait for one reply, until the request's deadline or until the calling turn
/// ends. Owns the request's [`WaitGuard`]: dropping it abandons the request.
///
/// The timer is armed late. An active actor usually replies within one scheduling round
/// (its task runs as soon as the caller yields), while a timer costs a registration in
/// the timer wheel and, on the multi-thread runtime, often the wake of a parked worker.
/// So the first polls yield without a timer (the task wakes itself, which tokio treats
/// as a yield: it runs again after the tasks already scheduled, the callee's among
/// them), [`REPLY_WAIT_YIELDS_BEFORE_TIMER`] times; only a reply that has not arrived by
/// then arms one, at the deadline's absolute instant, so the wait still ends exactly at
/// the deadline. Safety does not depend on which path is taken: the callee checks the
/// deadline when it dequeues the request, and a turn whose caller stops waiting is
/// cancelled (see `activation.rs`).
///
/// A hand-written future rather than an `async fn`, so that the hot path (reply within
/// the yield) keeps no timer, no turn-end waiter and no nested future states: those are
/// boxed together only when the wait has to wait.
pub(crate) struct ReplyWait<'a> {
    guard: WaitGuard<'a>,
    deadline: Deadline,
    /// When the call was sent: the time the caller allowed, for its `Timeout` error, is
    /// from here to `deadline` (worked out only for that error, not on every call).
    sent_at: Deadline,
    /// The calling turn, for a call from a turn: the wait ends when it ends.
    turn_end: Option<&'a CallerInner>,
    /// How many polls have yielded without a timer (up to
    /// [`REPLY_WAIT_YIELDS_BEFORE_TIMER`]).
    yields: u8,
    /// The calling turn's end and the deadline's timer, raced after the reply; made by
    /// the first poll after the yield that still finds no reply.
    slow: Option<Pin<Box<dyn Future<Output = Waited> + Send + 'a>>>,
}

/// Resolves when the calling turn ends (never without one) or at `until`, whichever is
/// first (the turn's end wins a tie).
async fn turn_end_or_deadline(turn_end: Option<&CallerInner>, until: tokio::time::Instant) -> Waited {
    let turn_ended = async {
        match turn_end {
            Some(turn) => turn.turn_ended().await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        biased;
        () = turn_ended => Waited::TurnEnded,
        () = tokio::time::sleep_until(until) => Waited::Elapsed,
    }
}

impl Future for ReplyWait<'_> {
    type Output = Result<Payload, InvokeError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if this.yields == 0 {
            // The first poll comes straight after the send: the callee has not run yet
            // (on a current_thread runtime it cannot have), so the reply channel is not
            // even looked at. The task wakes itself, which tokio treats as a yield, and
            // the next poll, after the callee's task has run, usually finds the reply.
            // The waker is then never registered with the reply channel, and the callee's
            // reply wakes nobody.
            this.yields = 1;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let answer = this.guard.answer.as_mut().expect("a waiting guard holds its receiver");
        // The reply first, always: a reply that has arrived wins over a timer or a turn
        // end that fired in the same round. A reply already there is taken without
        // registering anything (and the cell spends no coop budget); only an empty
        // channel registers the waker and looks again.
        let waited = match answer.try_recv() {
            Ok(reply) => Waited::Reply(reply),
            Err(TryRecvError::Closed) => Waited::Closed,
            Err(TryRecvError::Empty) => match this.wait_more(cx) {
                Poll::Ready(waited) => waited,
                Poll::Pending => return Poll::Pending,
            },
        };
        Poll::Ready(this.finish(waited))
    }
}

impl ReplyWait<'_> {
    /// The reply was not there: yield again without a timer while
    /// [`REPLY_WAIT_YIELDS_BEFORE_TIMER`] allows (a request that went through the
    /// dispatcher to an actor that was not active needs another round: the dispatcher
    /// spawns the activation, which then runs), then register with the reply channel
    /// and race it against the calling turn's end and the deadline's timer. Out of line:
    /// the hot path, a reply there at the second poll, stays small.
    #[inline(never)]
    fn wait_more(&mut self, cx: &mut Context<'_>) -> Poll<Waited> {
        if self.yields < REPLY_WAIT_YIELDS_BEFORE_TIMER {
            self.yields += 1;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let answer = self.guard.answer.as_mut().expect("a waiting guard holds its receiver");
        match answer.poll_recv(cx) {
            Poll::Ready(Ok(reply)) => Poll::Ready(Waited::Reply(reply)),
            Poll::Ready(Err(())) => Poll::Ready(Waited::Closed),
            Poll::Pending => {
                let shared = self.guard.shared;
                let (turn_end, deadline) = (self.turn_end, self.deadline);
                let slow = self
                    .slow
                    .get_or_insert_with(|| Box::pin(turn_end_or_deadline(turn_end, shared.clock.instant_of(deadline))));
                slow.as_mut().poll(cx)
            }
        }
    }

    /// The caller's result for how the wait ended.
    fn finish(&mut self, waited: Waited) -> Result<Payload, InvokeError> {
        let guard = &mut self.guard;
        let target = guard.target;
        match waited {
            Waited::Reply(result) => {
                guard.answered = true;
                // Whoever replied removed the wait-for edge before replying: the callee
                // (`respond` in activation.rs), or the dispatcher (`Dispatcher::refuse`).
                // A second removal from here would take the graph's lock, per call from a
                // turn, to remove nothing.
                guard.edge = false;
                match result {
                    // The callee timed the turn out itself: report the time this caller
                    // allowed, as when the caller's own timer fires.
                    Err(InvokeError::Timeout { target: timed_out, .. }) if timed_out == *target => {
                        Err(InvokeError::Timeout {
                            target: timed_out,
                            timeout_ms: self.deadline.remaining_ms(self.sent_at),
                        })
                    }
                    result => result,
                }
            }
            Waited::Closed => {
                guard.answered = true;
                if guard.shared.aborted() {
                    // The runtime stopped the activation at once (shutdown grace over, or
                    // the runtime dropped).
                    Err(InvokeError::Shutdown)
                } else {
                    Err(InvokeError::ActorFailed {
                        target: target.clone(),
                        cause: "the actor's activation ended before it replied".to_string(),
                    })
                }
            }
            Waited::TurnEnded => Err(InvokeError::Cancelled { target: target.clone() }),
            Waited::Elapsed => Err(InvokeError::Timeout {
                target: target.clone(),
                timeout_ms: self.deadline.remaining_ms(self.sent_at),
            }),
        }
    }
}

/// How a wait for a reply ended.
pub(crate) enum Waited {
    Reply(Reply),
    /// The reply channel closed without a reply: the activation ended.
    Closed,
    TurnEnded,
    Elapsed,
}

#[cfg(test)]
mod tests {
    /// The route map's entry per active actor is one pointer: the mailbox, which holds
    /// the count of messages put into it.
    #[test]
    fn a_route_is_a_pointer_to_its_mailbox() {
        assert_eq!(std::mem::size_of::<super::Route>(), 8);
    }
}
