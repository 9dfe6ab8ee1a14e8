//! Building a runtime and talking to it: [`RuntimeBuilder`], [`Runtime`], [`RuntimeHandle`].

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};
use troupe_core::limits::{DISPATCHER_QUEUE_CAPACITY, INVOKE_TIMEOUT_MS_MAX};
use troupe_core::{ActorId, ActorKind, CallContext, Deadline, InvokeError};

use crate::dispatcher::Dispatcher;
use crate::envelope::{CallEdge, Command, Control, Envelope, MailboxSender};
use crate::fast_hash::FastMap;
use crate::{ActorFactory, Clock, ConfigError, KindConfig, MemoryStore, StateStore};

/// A registered actor kind: its factory and configuration.
pub(crate) struct KindEntry {
    pub(crate) factory: Arc<dyn ActorFactory>,
    pub(crate) config: KindConfig,
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
    /// Requests dropped unrun because their deadline had passed.
    pub expired_dropped: u64,
    /// Requests refused with `Busy`.
    pub busy_refused: u64,
    /// Calls refused with `DeadlockDetected`.
    pub deadlocks_refused: u64,
    /// Deactivation saves that failed (the last turn's state was already committed).
    pub deactivation_saves_failed: u64,
}

/// The dispatcher's tables at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DispatcherStats {
    /// Entries in the activation table (any live state).
    pub activations: usize,
    /// Of those, how many are deactivating.
    pub deactivating: usize,
    /// Messages held for actors whose previous activation is still deactivating.
    pub held_messages: usize,
    /// Live calls in the wait-for graph.
    pub wait_for_edges: usize,
}

/// The open mailbox of one live activation, with the count of messages put into it.
pub(crate) struct Route {
    pub(crate) mailbox: MailboxSender,
    pub(crate) delivered: u64,
}

/// Open mailboxes by actor id, shared by the dispatcher and the callers' fast path.
///
/// Only the dispatcher inserts and removes routes (it alone activates and deactivates);
/// a caller without a wait-for edge may put a message into an open mailbox directly,
/// under the lock, which keeps `delivered` exact for the idle handshake. Removing a
/// route drops the only sender, which closes the mailbox.
#[derive(Default)]
pub(crate) struct Routes(Mutex<FastMap<ActorId, Route>>);

impl Routes {
    pub(crate) fn lock(&self) -> MutexGuard<'_, FastMap<ActorId, Route>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
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
    next_call: AtomicU64,
}

impl Shared {
    /// Delivers straight into an open mailbox, skipping the dispatcher's queue.
    fn fast_path(&self, target: &ActorId, envelope: Box<Envelope>) -> FastPath {
        let mut routes = self.routes.lock();
        let Some(route) = routes.get_mut(target) else {
            return FastPath::ToDispatcher(envelope);
        };
        match route.mailbox.try_send(envelope) {
            Ok(()) => {
                route.delivered += 1;
                FastPath::Delivered
            }
            Err(mpsc::error::TrySendError::Full(_)) => {
                Counters::add(&self.counters.busy_refused);
                let capacity = route.mailbox.max_capacity();
                FastPath::Refused(InvokeError::Busy {
                    target: target.clone(),
                    capacity,
                })
            }
            // The activation ended; the dispatcher knows what to do next.
            Err(mpsc::error::TrySendError::Closed(envelope)) => FastPath::ToDispatcher(envelope),
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

/// Stops waiting on a call: tells the dispatcher to drop the wait-for edge. Declared
/// before the reply receiver so the receiver is dropped first; the dispatcher then sees
/// a closed reply if it routes the call after the release.
struct ReleaseOnDrop<'a> {
    control: &'a mpsc::UnboundedSender<Control>,
    call: u64,
}

impl Drop for ReleaseOnDrop<'_> {
    fn drop(&mut self) {
        // The dispatcher may already be gone at shutdown; nothing to release then.
        let _ = self.control.send(Control::ReleaseCall { call: self.call });
    }
}

impl RuntimeHandle {
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

    /// Sends `payload` to `target` from outside any actor and waits for the reply until
    /// `deadline`. Activates the actor if it is inactive.
    ///
    /// # Errors
    /// [`InvokeError`]: `Timeout` when the deadline passes first (the request is then
    /// dropped unrun, or its turn cancelled and rolled back), `Busy` when the mailbox is
    /// full, `ActorNotFound` for an unregistered kind, `ActorFailed`, `Rejected`,
    /// `StorageFailed`, `DispatcherBusy`, `Shutdown`.
    ///
    /// # Cancel safety
    /// Dropping the future abandons the request; if it has not started running it never
    /// will, since its reply channel is closed.
    pub async fn invoke(&self, target: &ActorId, payload: Bytes, deadline: Deadline) -> Result<Bytes, InvokeError> {
        self.send_and_wait(target, payload, CallContext::root(deadline), None)
            .await
    }

    /// Sends `payload` to `target` on behalf of `caller`'s running turn under `context`
    /// (the callee's context: depth, chain and deadline already derived). The dispatcher
    /// records the wait-for edge `caller → target` while this call waits, and refuses the
    /// call at once with `DeadlockDetected` if the edge would close a cycle.
    ///
    /// # Errors
    /// As [`RuntimeHandle::invoke`], plus `DeadlockDetected`.
    pub async fn invoke_from(
        &self,
        caller: &ActorId,
        target: &ActorId,
        payload: Bytes,
        context: CallContext,
    ) -> Result<Bytes, InvokeError> {
        self.send_and_wait(target, payload, context, Some(caller)).await
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
        }
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

    async fn send_and_wait(
        &self,
        target: &ActorId,
        payload: Bytes,
        context: CallContext,
        caller: Option<&ActorId>,
    ) -> Result<Bytes, InvokeError> {
        let clock = self.shared.clock;
        let deadline = context.deadline();
        let timeout_ms = |now: Deadline| {
            let allowed = deadline.remaining(now);
            u64::try_from(allowed.as_millis()).unwrap_or(u64::MAX)
        };
        let now = clock.now();
        if deadline.has_passed(now) {
            return Err(InvokeError::Timeout {
                target: target.clone(),
                timeout_ms: 0,
            });
        }
        let timeout_ms = timeout_ms(now);
        let edge = caller.map(|caller| CallEdge {
            id: self.shared.next_call.fetch_add(1, Ordering::Relaxed),
            caller: caller.clone(),
        });
        let _release = edge.as_ref().map(|edge| ReleaseOnDrop {
            control: &self.shared.control,
            call: edge.id,
        });
        let (reply, answer) = oneshot::channel();
        let mut envelope = Box::new(Envelope {
            payload,
            context,
            reply,
        });
        if edge.is_none() {
            // A call from outside any turn adds no wait-for edge, so it may skip the
            // dispatcher when the target's mailbox is open.
            match self.shared.fast_path(target, envelope) {
                FastPath::Delivered => {
                    return self.await_reply(target, now, deadline, timeout_ms, answer).await;
                }
                FastPath::Refused(error) => return Err(error),
                FastPath::ToDispatcher(back) => envelope = back,
            }
        }
        let command = Command::Invoke {
            target: target.clone(),
            envelope,
            edge,
        };
        let waited = clock
            .run_until_from(now, deadline, async {
                match self.shared.commands.try_send(command) {
                    Ok(()) => {}
                    Err(mpsc::error::TrySendError::Full(command)) => self
                        .shared
                        .commands
                        .send(command)
                        .await
                        .map_err(|_| InvokeError::Shutdown)?,
                    Err(mpsc::error::TrySendError::Closed(_)) => return Err(InvokeError::Shutdown),
                }
                answer.await.map_err(|_| InvokeError::ActorFailed {
                    target: target.clone(),
                    cause: "the actor's activation ended before it replied".to_string(),
                })?
            })
            .await;
        match waited {
            Ok(result) => result,
            Err(_elapsed) => Err(InvokeError::Timeout {
                target: target.clone(),
                timeout_ms,
            }),
        }
    }

    async fn await_reply(
        &self,
        target: &ActorId,
        now: Deadline,
        deadline: Deadline,
        timeout_ms: u64,
        answer: oneshot::Receiver<crate::envelope::Reply>,
    ) -> Result<Bytes, InvokeError> {
        match self.shared.clock.run_until_from(now, deadline, answer).await {
            Ok(Ok(result)) => result,
            Ok(Err(_closed)) => Err(InvokeError::ActorFailed {
                target: target.clone(),
                cause: "the actor's activation ended before it replied".to_string(),
            }),
            Err(_elapsed) => Err(InvokeError::Timeout {
                target: target.clone(),
                timeout_ms,
            }),
        }
    }
}

/// A running runtime. Dereferences to its [`RuntimeHandle`].
pub struct Runtime {
    handle: RuntimeHandle,
    dispatcher: tokio::task::JoinHandle<()>,
}

impl Deref for Runtime {
    type Target = RuntimeHandle;
    fn deref(&self) -> &RuntimeHandle {
        &self.handle
    }
}

impl Runtime {
    /// A builder with no kinds and an in-memory store.
    pub fn builder() -> RuntimeBuilder {
        RuntimeBuilder::default()
    }

    /// A cloneable handle to this runtime.
    pub fn handle(&self) -> RuntimeHandle {
        self.handle.clone()
    }

    /// Deactivates every actor (each runs `on_deactivate` and saves), then stops the
    /// dispatcher. Invocations after this fail with [`InvokeError::Shutdown`].
    pub async fn shutdown(self) {
        let (reply, done) = oneshot::channel();
        if self
            .handle
            .shared
            .commands
            .send(Command::Shutdown { reply })
            .await
            .is_ok()
        {
            let _ = done.await;
        }
        let _ = self.dispatcher.await;
    }
}

/// Configures and starts a [`Runtime`].
pub struct RuntimeBuilder {
    store: Arc<dyn StateStore>,
    kinds: BTreeMap<ActorKind, KindEntry>,
}

impl Default for RuntimeBuilder {
    fn default() -> Self {
        Self {
            store: Arc::new(MemoryStore::new()),
            kinds: BTreeMap::new(),
        }
    }
}

impl RuntimeBuilder {
    /// Uses `store` for actor state (the default is a fresh [`MemoryStore`]).
    pub fn store(mut self, store: Arc<dyn StateStore>) -> Self {
        self.store = store;
        self
    }

    /// Registers a kind of actor with its factory and configuration.
    ///
    /// # Errors
    /// [`ConfigError`] if the configuration is out of range or the kind is already
    /// registered.
    pub fn register(
        mut self,
        kind: ActorKind,
        factory: impl ActorFactory,
        config: KindConfig,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        if self.kinds.contains_key(&kind) {
            return Err(ConfigError::DuplicateKind { kind: kind.to_string() });
        }
        self.kinds.insert(
            kind,
            KindEntry {
                factory: Arc::new(factory),
                config,
            },
        );
        Ok(self)
    }

    /// Starts the dispatcher task.
    ///
    /// # Panics
    /// Outside a tokio (or madsim) runtime.
    pub fn start(self) -> Runtime {
        let (commands, command_queue) = mpsc::channel(DISPATCHER_QUEUE_CAPACITY);
        let (control, control_queue) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            commands,
            control,
            clock: Clock::new(),
            kinds: self.kinds,
            store: self.store,
            counters: Counters::default(),
            routes: Routes::default(),
            next_call: AtomicU64::new(1),
        });
        let handle = RuntimeHandle { shared };
        let dispatcher = Dispatcher::new(handle.clone(), command_queue, control_queue);
        let dispatcher = tokio::spawn(dispatcher.run());
        Runtime { handle, dispatcher }
    }
}
