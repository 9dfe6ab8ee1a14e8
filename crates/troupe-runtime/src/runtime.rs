//! Building and stopping a runtime: [`RuntimeBuilder`], [`Runtime`] (the handle callers use is in `handle.rs`).

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use troupe_core::limits::DISPATCHER_QUEUE_CAPACITY;
use troupe_core::ActorKind;

use crate::control::Control;
use crate::dispatcher::Dispatcher;
use crate::handle::{Counters, KindEntry, Routes, Shared};
use crate::{ActorFactory, Clock, ConfigError, KindConfig, MemoryStore, RuntimeHandle, RuntimeObserver, StateStore};

/// How long [`Runtime::shutdown`] lets running turns and queued requests finish by
/// default, in milliseconds, before it cancels what is left.
pub const SHUTDOWN_GRACE_MS_DEFAULT: u64 = 5_000;
/// The longest shutdown grace period a runtime accepts, in milliseconds.
pub const SHUTDOWN_GRACE_MS_MAX: u64 = 300_000;
/// How long [`Runtime::shutdown`] waits, after the grace period, for cancelled
/// activations to report that they have ended, in milliseconds. An actor blocked in
/// synchronous code (not at an `.await`) cannot be cancelled; shutdown returns anyway.
pub const SHUTDOWN_ABORT_WAIT_MS: u64 = 1_000;
const _: () = assert!(SHUTDOWN_GRACE_MS_DEFAULT <= SHUTDOWN_GRACE_MS_MAX);

/// A running runtime. Dereferences to its [`RuntimeHandle`].
///
/// Stop it with [`Runtime::shutdown`]. Dropping it without a shutdown stops it too, at
/// once and without a grace period: the dispatcher refuses everything from then on,
/// running turns are cancelled at their next `.await` and rolled back, queued and held
/// requests are answered with [`InvokeError::Shutdown`](troupe_core::InvokeError::Shutdown), `on_deactivate` does not run,
/// and nothing is saved beyond each actor's last committed turn: a turn that reaches its
/// commit after the drop commits nothing (a commit already inside the store completes).
/// Every task the runtime spawned ends (an actor blocked in synchronous code ends when
/// it next yields).
pub struct Runtime {
    handle: RuntimeHandle,
    dispatcher: Option<tokio::task::JoinHandle<()>>,
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

    /// Stops the runtime within a bounded time.
    ///
    /// 1. At once: new requests, and calls made by running turns, are refused with
    ///    [`InvokeError::Shutdown`](troupe_core::InvokeError::Shutdown); every mailbox is closed.
    /// 2. For the grace period ([`RuntimeBuilder::shutdown_grace`], default
    ///    [`SHUTDOWN_GRACE_MS_DEFAULT`] ms): running turns and the requests already in
    ///    mailboxes finish, as do those held for the next activation of an actor that
    ///    was deactivating (they run in one more activation, closed at once); each actor
    ///    then runs `on_deactivate` and saves.
    /// 3. When the grace period ends: whatever still runs is cancelled and rolled back;
    ///    its caller, and every request still queued, gets [`InvokeError::Shutdown`](troupe_core::InvokeError::Shutdown);
    ///    `on_deactivate` does not run for those actors.
    ///
    /// Returns when every activation has ended, or [`SHUTDOWN_ABORT_WAIT_MS`] after the
    /// grace period at the latest.
    pub async fn shutdown(mut self) {
        let shared = Arc::clone(&self.handle.shared);
        let (reply, done) = oneshot::channel();
        let _ = shared.control.send(Control::Shutdown { reply: Some(reply) });
        let mut done = std::pin::pin!(done);
        if tokio::time::timeout(shared.shutdown_grace, &mut done).await.is_err() {
            let _ = shared.control.send(Control::Abort);
            let _ = tokio::time::timeout(Duration::from_millis(SHUTDOWN_ABORT_WAIT_MS), &mut done).await;
        }
        if let Some(dispatcher) = self.dispatcher.take() {
            // It has ended, or ends as soon as the last stuck activation yields.
            if !dispatcher.is_finished() {
                return;
            }
            let _ = dispatcher.await;
        }
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        if self.dispatcher.is_none() {
            return; // shut down already
        }
        let shared = &self.handle.shared;
        // Aborted from this instant, not from when the dispatcher next runs: a turn of
        // this runtime that reaches its commit after the drop commits nothing (a
        // process that dies commits nothing after its death either).
        shared.abort.store(true, std::sync::atomic::Ordering::Release);
        let _ = shared.control.send(Control::Shutdown { reply: None });
        let _ = shared.control.send(Control::Abort);
    }
}

/// Configures and starts a [`Runtime`].
pub struct RuntimeBuilder {
    store: Arc<dyn StateStore>,
    kinds: BTreeMap<ActorKind, KindEntry>,
    /// Kinds of records written straight through the store, never activated.
    shared_records: BTreeSet<ActorKind>,
    observer: Option<Arc<dyn RuntimeObserver>>,
    shutdown_grace: Duration,
    #[cfg(feature = "planted-bugs")]
    planted_commit_after_abandon: bool,
    #[cfg(feature = "planted-bugs")]
    planted_commit_failed_turn: bool,
    #[cfg(feature = "planted-bugs")]
    planted_no_arrival_checks: bool,
}

impl Default for RuntimeBuilder {
    fn default() -> Self {
        Self {
            store: Arc::new(MemoryStore::new()),
            kinds: BTreeMap::new(),
            shared_records: BTreeSet::new(),
            observer: None,
            shutdown_grace: Duration::from_millis(SHUTDOWN_GRACE_MS_DEFAULT),
            #[cfg(feature = "planted-bugs")]
            planted_commit_after_abandon: false,
            #[cfg(feature = "planted-bugs")]
            planted_commit_failed_turn: false,
            #[cfg(feature = "planted-bugs")]
            planted_no_arrival_checks: false,
        }
    }
}

impl RuntimeBuilder {
    /// Uses `store` for actor state (the default is a fresh [`MemoryStore`]).
    pub fn store(mut self, store: Arc<dyn StateStore>) -> Self {
        self.store = store;
        self
    }

    /// Reports the runtime's events (abandoned requests, commits, cancelled turns) to
    /// `observer`, for tests, the simulator and metrics.
    pub fn observer(mut self, observer: Arc<dyn RuntimeObserver>) -> Self {
        self.observer = Some(observer);
        self
    }

    /// How long [`Runtime::shutdown`] lets running turns finish before it cancels them.
    ///
    /// # Errors
    /// [`ConfigError::ShutdownGrace`] if `grace` is longer than [`SHUTDOWN_GRACE_MS_MAX`].
    pub fn shutdown_grace(mut self, grace: Duration) -> Result<Self, ConfigError> {
        if grace > Duration::from_millis(SHUTDOWN_GRACE_MS_MAX) {
            return Err(ConfigError::ShutdownGrace {
                value_ms: grace.as_millis(),
                max_ms: SHUTDOWN_GRACE_MS_MAX,
            });
        }
        self.shutdown_grace = grace;
        Ok(self)
    }

    /// Plants a bug for the simulator's planted-bug tests (feature `planted-bugs`): turns
    /// no longer notice that their caller gave up, so they run on and commit.
    #[cfg(feature = "planted-bugs")]
    pub fn plant_bug_commit_after_abandon(mut self) -> Self {
        self.planted_commit_after_abandon = true;
        self
    }

    /// Plants a bug for trace validation (feature `planted-bugs`): a turn whose handler
    /// returned an error (failed or rejected) still commits its changes, then answers
    /// with the error. No DST invariant sees it when the turn changed nothing that is
    /// read back; the trace spec (`docs/tla/TraceCallPath.tla`) refuses the commit.
    #[cfg(feature = "planted-bugs")]
    pub fn plant_bug_commit_failed_turn(mut self) -> Self {
        self.planted_commit_failed_turn = true;
        self
    }

    /// Plants a bug (feature `planted-bugs`): requests arriving over the transport are
    /// not checked again for a cycle in their chain or a depth over the limit, so a
    /// caller's admission that skipped those checks is not caught on the host either.
    #[cfg(feature = "planted-bugs")]
    pub fn plant_bug_no_arrival_checks(mut self) -> Self {
        self.planted_no_arrival_checks = true;
        self
    }

    /// Declares `kind` a kind of shared record: state that code writes straight through
    /// the store ([`crate::StateStore::claim`], then [`crate::StateStore::commit`] under
    /// that claim's fence, again on [`troupe_core::StoreError::Fenced`]), from any
    /// process, and that no actor activates. The runtime does nothing with it; an
    /// embedder that places actors (a cluster node, troupe-cluster's `PlacedStore`) lets
    /// every process write such records instead of placing them like actors. The agent
    /// layer declares its organisation record so.
    ///
    /// # Errors
    /// [`ConfigError::DuplicateKind`] if `kind` is registered as an actor kind.
    pub fn shared_record_kind(mut self, kind: ActorKind) -> Result<Self, ConfigError> {
        if self.kinds.contains_key(&kind) {
            return Err(ConfigError::DuplicateKind { kind: kind.to_string() });
        }
        self.shared_records.insert(kind);
        Ok(self)
    }

    /// The kinds declared with [`RuntimeBuilder::shared_record_kind`], in order.
    pub fn shared_record_kinds(&self) -> impl Iterator<Item = &ActorKind> {
        self.shared_records.iter()
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
        if self.kinds.contains_key(&kind) || self.shared_records.contains(&kind) {
            return Err(ConfigError::DuplicateKind { kind: kind.to_string() });
        }
        self.kinds.insert(
            kind,
            KindEntry {
                factory: Arc::new(factory),
                config,
                typed: None,
            },
        );
        Ok(self)
    }

    /// Registers a kind of typed actor `A` (see [`crate::TypedActor`]): built with
    /// `Default` the first time, from its last committed state afterwards, and reached
    /// with [`RuntimeHandle::actor_ref`].
    ///
    /// # Errors
    /// As [`RuntimeBuilder::register`].
    pub fn register_typed<A: crate::TypedActor>(
        self,
        kind: ActorKind,
        config: KindConfig,
    ) -> Result<Self, ConfigError> {
        let mut builder = self.register(kind.clone(), crate::typed::typed_factory::<A>(), config)?;
        if let Some(entry) = builder.kinds.get_mut(&kind) {
            entry.typed = Some(crate::typed::type_of::<A>());
        }
        Ok(builder)
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
            waits: crate::wait_for_graph::SharedWaits::default(),
            observer: self.observer,
            abort: AtomicBool::new(false),
            shutdown_grace: self.shutdown_grace,
            next_call: AtomicU64::new(1),
            router: std::sync::OnceLock::new(),
            root_router: std::sync::OnceLock::new(),
            #[cfg(feature = "planted-bugs")]
            planted_commit_after_abandon: self.planted_commit_after_abandon,
            #[cfg(feature = "planted-bugs")]
            planted_commit_failed_turn: self.planted_commit_failed_turn,
            #[cfg(feature = "planted-bugs")]
            planted_no_arrival_checks: self.planted_no_arrival_checks,
        });
        let handle = RuntimeHandle { shared };
        let dispatcher = Dispatcher::new(handle.clone(), command_queue, control_queue);
        let dispatcher = tokio::spawn(dispatcher.run());
        Runtime {
            handle,
            dispatcher: Some(dispatcher),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Actor, ActorBox, ActorError, Turn};
    use bytes::Bytes;
    use troupe_core::ActorId;

    struct Quiet;

    impl Actor for Quiet {
        async fn handle(&mut self, _turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
            Ok(payload)
        }
    }

    fn quiet(_: &ActorId, _: Option<Bytes>) -> Result<ActorBox, ActorError> {
        Ok(ActorBox::new(Quiet))
    }

    #[test]
    fn a_kind_is_an_actor_kind_or_a_shared_record_kind_never_both() {
        let (actors, records) = (ActorKind::new("worker").unwrap(), ActorKind::new("ledger").unwrap());
        let builder = Runtime::builder()
            .register(actors.clone(), quiet, KindConfig::default())
            .unwrap()
            .shared_record_kind(records.clone())
            .unwrap();
        assert_eq!(builder.shared_record_kinds().collect::<Vec<_>>(), vec![&records]);
        let Err(error) = builder.register(records, quiet, KindConfig::default()) else {
            panic!("a shared record kind was registered as an actor kind");
        };
        assert_eq!(error.to_string(), "actor kind \"ledger\" is already registered");
        let Err(error) = Runtime::builder()
            .register(actors.clone(), quiet, KindConfig::default())
            .unwrap()
            .shared_record_kind(actors)
        else {
            panic!("an actor kind was declared a shared record kind");
        };
        assert!(matches!(error, ConfigError::DuplicateKind { .. }), "{error}");
    }
}
