//! The dispatcher: one task that owns the activation table and routes every invocation.
//!
//! It never awaits a turn, storage or the network: each loop iteration takes one
//! command or notice, updates its tables and hands messages to mailboxes with
//! `try_send`. Everything slow runs in actor tasks ([`crate::activation`]).
//!
//! Guarantees:
//! - **Single activation** (SingleActivation in `docs/tla/ActorLifecycle.tla`): the table
//!   has at most one entry per actor id, and a new activation is spawned only when the
//!   entry is absent or its previous activation has reported `Deactivated`/`Crashed`.
//!   Messages that arrive while an activation deactivates are held (at most the kind's
//!   mailbox capacity) and delivered to the next activation.
//! - **Backpressure**: a full mailbox answers `Busy` at once; nothing is queued unbounded.
//! - **No deactivation with work in flight** (NoDeactivationWithCallsInFlight): an idle
//!   check is granted only if the activation has taken every message routed to it and
//!   its turn is not waiting on any call.
//! - **Wait-for graph** (WaitForGraphAcyclic): a call from inside a turn adds an edge
//!   (its caller's task does, under the graph's lock, before the message is sent: see
//!   `wait_for_graph.rs`); an edge that would close a cycle is refused with
//!   `DeadlockDetected` before any message is queued. The dispatcher removes the edge of
//!   a call it refuses, before it answers, as a callee does before it replies.
//!
//! It does not retry, reorder or persist messages: a mailbox is memory, and a request
//! is acknowledged only by its reply.

use std::collections::VecDeque;
use std::task::Poll;

use tokio::sync::{mpsc, oneshot};
use troupe_core::limits::{ACTIVATIONS_MAX, INVOKE_TIMEOUT_MS_MAX};
use troupe_core::{ActorId, Deadline, InvokeError, Lifecycle, LifecycleEvent, LifecycleState};

use crate::activation::{self, ActivationStart};
use crate::control::{Command, Control};
use crate::envelope::{Envelope, ReplyTo};
use crate::fast_hash::{FastMap, IdEntry, IdMap, VacantId};
use crate::handle::{Counters, Route, Routes};
use crate::mailbox::{Delivery, Mailbox};
use crate::observer::RuntimeEvent;
use crate::wait_for_graph::EdgeRefused;
use crate::{DispatcherStats, RuntimeHandle};

struct Activation {
    lifecycle: Lifecycle,
    generation: u64,
    /// Whether its mailbox is open (its route is in `Shared::routes`); closed for
    /// deactivation and shutdown.
    open: bool,
    /// Stops the activation's task at once (shutdown grace over, runtime dropped).
    task: tokio::task::AbortHandle,
    /// What only a deactivating activation has; boxed, and made on first use, so that
    /// the table entry of an idle actor stays small (one entry per active actor).
    waiting: Option<Box<Waiting>>,
}

/// Messages and callers waiting for a deactivating activation to end.
#[derive(Default)]
struct Waiting {
    /// Messages for the next activation, held while this one deactivates.
    held: VecDeque<Box<Envelope>>,
    /// Told messages this activation, found stale, gave back unrun (`Control::KeepTold`),
    /// each with the time it may wait until: they came before those held, and go first
    /// to the next activation if one starts when this one ends; else they are kept
    /// (`Dispatcher::keep`).
    kept: VecDeque<(Deadline, Box<Envelope>)>,
    /// Callers of `RuntimeHandle::deactivate` waiting for this activation to end.
    deactivation_waiters: Vec<oneshot::Sender<bool>>,
}

impl Activation {
    /// Records that the activation has started (state loaded, `on_activate` run), on a
    /// notice that only a started activation's task sends: an idle check, or
    /// `Deactivated`. The task sends no notice of its own for it: that was a channel send
    /// and a table lookup per activation, and nothing here waits for it (an idle check
    /// and a deactivation are what need the activation started, and their notices prove
    /// it). A mailbox closed while it was starting (shutdown, fencing, `deactivate`)
    /// starts its deactivation here.
    fn note_started(&mut self) {
        if self.lifecycle.state() == LifecycleState::Activating {
            self.lifecycle.apply(LifecycleEvent::Activated);
            if !self.open {
                self.lifecycle.apply(LifecycleEvent::Deactivate);
            }
        }
    }

    fn held_len(&self) -> usize {
        self.waiting.as_ref().map_or(0, |waiting| waiting.held.len())
    }

    /// Held, and given back by a stale activation (`Waiting::kept`): for the stats.
    fn waiting_len(&self) -> usize {
        self.waiting
            .as_ref()
            .map_or(0, |waiting| waiting.held.len() + waiting.kept.len())
    }

    fn waiting(&mut self) -> &mut Waiting {
        self.waiting.get_or_insert_with(Box::default)
    }
}

impl Activation {
    /// Closes the mailbox, if it is open, by removing its route (the only sender), and
    /// starts deactivating: the running turn and queued requests finish, then the
    /// activation saves and ends. Still activating: `note_started` sees the closed mailbox
    /// and deactivates then.
    fn close(&mut self, id: &ActorId, routes: &mut IdMap<Route>) {
        if !self.open {
            return;
        }
        if let Some(route) = routes.remove(id) {
            route.close();
        }
        self.open = false;
        if self.lifecycle.state() == LifecycleState::Active {
            self.lifecycle.apply(LifecycleEvent::Deactivate);
        }
    }
}

/// What the dispatcher's loop takes next.
enum Next {
    Control(Control),
    Command(Command),
}

/// The most messages a new activation opens with, in mailboxes' worth: after a crash,
/// its mailbox's unrun messages (at most one mailbox's worth) and those held while it
/// ended (at most another) are carried over; requests past the first mailbox's worth are
/// refused `Busy`, accepted told messages are not.
pub(crate) const CARRIED_OVER_MAX_MAILBOXES: usize = 2;

/// The longest a told message given back by a stale activation is kept for this
/// runtime's next activation of its actor, in milliseconds, if its own deadline is
/// later: the longest a turn may take (a told message's turn gets at most that from when
/// it starts, whatever its deadline).
pub(crate) const TOLD_KEPT_MS_MAX: u64 = INVOKE_TIMEOUT_MS_MAX;

/// Told messages a stale activation of an actor gave back (its commit was fenced:
/// another runtime on the same store claimed the actor), kept for this runtime's next
/// activation of that actor: they run first in it if something else starts it (a new
/// message for the actor), and each is dropped as expired at its time (`Kept::tells`)
/// if none does. An actor has kept messages only while it has no activation here: the
/// next one takes them all.
struct Kept {
    /// Oldest first, each with the time it may wait until: its deadline, or
    /// [`TOLD_KEPT_MS_MAX`] from when it was given back if that is sooner.
    tells: VecDeque<(Deadline, Box<Envelope>)>,
    /// Which timer is current: a `Control::KeptExpired` of another epoch is stale.
    epoch: u64,
    /// Sends `KeptExpired` at the earliest time among `tells`.
    timer: tokio::task::AbortHandle,
}

impl Kept {
    /// Stops the timer; the messages.
    fn stop(self) -> VecDeque<(Deadline, Box<Envelope>)> {
        self.timer.abort();
        self.tells
    }
}

pub(crate) struct Dispatcher {
    handle: RuntimeHandle,
    commands: mpsc::Receiver<Command>,
    control: mpsc::UnboundedReceiver<Control>,
    table: IdMap<Activation>,
    next_generation: u64,
    /// Told messages kept for actors with no activation here ([`Kept`]): a cold table,
    /// empty but after a fence. At most [`ACTIVATIONS_MAX`] actors, each at most a
    /// mailbox's worth (what its stale activation's closed mailbox held).
    kept: FastMap<ActorId, Kept>,
    next_kept_epoch: u64,
    shutdown: Option<oneshot::Sender<()>>,
    shutting_down: bool,
}

impl Dispatcher {
    pub(crate) fn new(
        handle: RuntimeHandle,
        commands: mpsc::Receiver<Command>,
        control: mpsc::UnboundedReceiver<Control>,
    ) -> Self {
        Self {
            handle,
            commands,
            control,
            table: IdMap::default(),
            next_generation: 1,
            kept: FastMap::default(),
            next_kept_epoch: 1,
            shutdown: None,
            shutting_down: false,
        }
    }

    pub(crate) async fn run(mut self) {
        loop {
            // Notices first, then commands: a fixed order (runs replay under madsim), as
            // a biased `select!` gave, without that macro's machinery around each wait.
            let (control, commands) = (&mut self.control, &mut self.commands);
            let next = std::future::poll_fn(|cx| {
                let control_closed = match control.poll_recv(cx) {
                    Poll::Ready(Some(control)) => return Poll::Ready(Some(Next::Control(control))),
                    Poll::Ready(None) => true,
                    Poll::Pending => false,
                };
                match commands.poll_recv(cx) {
                    Poll::Ready(Some(command)) => Poll::Ready(Some(Next::Command(command))),
                    Poll::Ready(None) if control_closed => Poll::Ready(None),
                    Poll::Ready(None) | Poll::Pending => Poll::Pending,
                }
            })
            .await;
            match next {
                Some(Next::Control(control)) => self.on_control(control),
                Some(Next::Command(command)) => {
                    // Notices sent before this command (causally) are applied first: an
                    // activation that reported its end before a request was sent is gone
                    // from the table when the request is routed.
                    while let Ok(control) = self.control.try_recv() {
                        self.on_control(control);
                    }
                    self.on_command(command);
                }
                None => break,
            }
            if self.shutting_down && self.table.is_empty() {
                break;
            }
        }
        // Refuse whatever is still queued; later sends fail (the receiver is dropped).
        self.commands.close();
        while let Ok(command) = self.commands.try_recv() {
            self.on_command(command);
        }
        if let Some(done) = self.shutdown.take() {
            let _ = done.send(());
        }
    }

    fn on_command(&mut self, command: Command) {
        match command {
            Command::Invoke { envelope, .. } if self.shutting_down => {
                // A new request, or a call made by a turn still finishing: refused at
                // once, never left to wait out its deadline.
                self.refuse(*envelope, InvokeError::Shutdown);
            }
            Command::Invoke { target, envelope } => self.route(target, envelope),
            Command::AddRemoteEdge { reply, .. } if self.shutting_down => {
                let _ = reply.send(Err(InvokeError::Shutdown));
            }
            Command::AddRemoteEdge {
                call,
                caller,
                target,
                reply,
            } => {
                // Checked under the graph's lock: a `RemoteWait` dropped meanwhile closes
                // its answer before it removes its edge under that lock, so either this
                // sees it closed and adds nothing, or the removal comes after the add.
                let mut waits = self.handle.shared.waits.lock();
                if reply.is_closed() {
                    // The caller gave up before the edge was recorded: recording it now
                    // would leak it.
                    return;
                }
                let added = waits.try_add_remote(call, &caller, &target);
                drop(waits);
                let result = match added {
                    Ok(()) => Ok(()),
                    Err(EdgeRefused::Cycle(cycle)) => {
                        Counters::add(&self.handle.shared.counters.deadlocks_refused);
                        Err(InvokeError::DeadlockDetected { cycle })
                    }
                    Err(EdgeRefused::Full) => Err(InvokeError::Rejected {
                        target,
                        reason: "the wait-for graph is full".to_string(),
                    }),
                };
                let _ = reply.send(result);
            }
            Command::Waits { actor, reply } => {
                let _ = reply.send(self.handle.shared.waits.lock().edges_of(&actor));
            }
            Command::Stats { reply } => {
                let _ = reply.send(self.stats());
            }
            Command::Deactivate { target, reply } => self.deactivate(target, reply),
        }
    }

    /// Closes `target`'s mailbox as the idle handshake does, without waiting for it to
    /// be idle; `reply` is answered when the activation has ended.
    fn deactivate(&mut self, target: ActorId, reply: oneshot::Sender<bool>) {
        let Some(activation) = self.table.get_mut(&target) else {
            let _ = reply.send(false);
            return;
        };
        activation.waiting().deactivation_waiters.push(reply);
        self.close(&target);
    }

    /// Closes `target`'s mailbox (if it is open) and starts its deactivation: the running
    /// turn and queued requests finish, then the activation saves and ends; later
    /// requests are held for the next activation.
    fn close(&mut self, target: &ActorId) {
        if let Some(activation) = self.table.get_mut(target) {
            activation.close(target, &mut self.handle.shared.routes.lock());
        }
    }

    fn stats(&self) -> DispatcherStats {
        DispatcherStats {
            activations: self.table.len(),
            // Closed: deactivating, or about to once it has started.
            deactivating: self.table.values().filter(|a| !a.open).count(),
            held_messages: self.table.values().map(Activation::waiting_len).sum::<usize>()
                + self.kept.values().map(|kept| kept.tells.len()).sum::<usize>(),
            wait_for_edges: self.handle.shared.waits.lock().len(),
        }
    }

    /// Answers `envelope` with `error`, removing its wait-for edge first (a call from a
    /// turn: its caller added the edge when it sent it, and takes no release once it
    /// has a reply).
    fn refuse(&self, envelope: Envelope, error: InvokeError) {
        if envelope.edge {
            self.handle.shared.waits.remove(envelope.call);
        }
        envelope.reply.send(Err(error));
    }

    /// As [`Dispatcher::refuse`], for a message held for a next activation that will not
    /// run it: a told one among them was accepted (its sender answered `Ok`), so it is
    /// counted in `told_lost`. Kept apart from `refuse`, which the routing inlines.
    #[cold]
    #[inline(never)]
    fn refuse_held(&self, envelope: Envelope, error: InvokeError) {
        if matches!(envelope.reply, ReplyTo::Nobody) {
            Counters::add(&self.handle.shared.counters.told_lost);
        }
        self.refuse(envelope, error);
    }

    fn route(&mut self, target: ActorId, envelope: Box<Envelope>) {
        if envelope.reply.is_closed() {
            // The caller stopped waiting before we got here: do not run it (its edge, if
            // any, went with its wait).
            return;
        }
        // (Compared as instants: no reading turned into a `Deadline`, see `Clock::has_passed`.)
        if self.handle.shared.clock.has_passed(envelope.context.deadline()) {
            Counters::add(&self.handle.shared.counters.expired_dropped);
            self.refuse(*envelope, InvokeError::Timeout { target, timeout_ms: 0 });
            return;
        }
        let Some(kind) = self.handle.shared.kinds.get(target.kind()) else {
            let kind = target.kind().to_string();
            self.refuse(*envelope, InvokeError::ActorNotFound { target, kind });
            return;
        };
        let capacity = kind.config.mailbox_capacity;
        let edge = envelope.edge.then_some(envelope.call);
        // A fire-and-forget message is accepted once it is in the mailbox or held.
        let mut envelope = envelope;
        let acceptance = envelope.reply.take_acceptance();
        let table_full = self.table.len() >= ACTIVATIONS_MAX;
        let shutting_down = self.shutting_down;
        let refused = if let Some(activation) = self.table.get_mut(&target) {
            Self::deliver(&self.handle.shared.routes, activation, &target, capacity, envelope)
        } else {
            match self.table.entry(target) {
                IdEntry::Occupied(_) => unreachable!("looked up just above"),
                IdEntry::Vacant(_) if shutting_down => Some((envelope, InvokeError::Shutdown)),
                IdEntry::Vacant(entry) if table_full => {
                    let reason = format!("the runtime holds {ACTIVATIONS_MAX} activations");
                    let target = entry.into_key();
                    Some((envelope, InvokeError::Rejected { target, reason }))
                }
                IdEntry::Vacant(entry) if self.kept.is_empty() => {
                    Self::activate(
                        &self.handle,
                        &mut self.next_generation,
                        entry,
                        capacity,
                        std::iter::once(envelope),
                    );
                    None
                }
                IdEntry::Vacant(entry) => {
                    let kept = self.kept.remove(entry.key()).map(Kept::stop).unwrap_or_default();
                    let messages = Self::after_kept(&self.handle, kept, std::iter::once(envelope));
                    Self::activate(
                        &self.handle,
                        &mut self.next_generation,
                        entry,
                        capacity,
                        messages.into_iter(),
                    );
                    None
                }
            }
        };
        if let Some((envelope, error)) = refused {
            if let Some(call) = edge {
                self.handle.shared.waits.remove(call);
            }
            if matches!(error, InvokeError::Busy { .. }) {
                Counters::add(&self.handle.shared.counters.busy_refused);
            }
            match acceptance {
                Some(acceptance) => {
                    let _ = acceptance.send(Err(error));
                }
                None => envelope.reply.send(Err(error)),
            }
        } else if let Some(acceptance) = acceptance {
            let _ = acceptance.send(Ok(()));
        }
    }

    /// Hands `envelope` to a live activation, or holds it for the next one while this one
    /// ends, or gives it back with the refusal.
    fn deliver(
        routes: &Routes,
        activation: &mut Activation,
        target: &ActorId,
        capacity: usize,
        envelope: Box<Envelope>,
    ) -> Option<(Box<Envelope>, InvokeError)> {
        let envelope = if activation.open {
            let mut routes = routes.lock();
            let route = routes.get(target).expect("an open activation has a route");
            match route.deliver(*envelope) {
                Delivery::Delivered => return None,
                Delivery::Full(envelope, _) => return Some((envelope, Self::busy(target, capacity))),
                Delivery::Closed(envelope) => {
                    // The activation's task closed its mailbox itself (a fenced commit) or
                    // ended (a crash, an abort), and its notice, sent before, was not here
                    // yet when this command's notices were applied. The message never got
                    // in, so it never ran: it waits for the next activation, as one that
                    // comes during a deactivation does, instead of failing `ActorFailed`.
                    // The notice follows and ends this activation (`finish`).
                    activation.close(target, &mut routes);
                    envelope
                }
            }
        } else {
            envelope
        };
        if activation.held_len() < capacity {
            activation.waiting().held.push_back(envelope);
            return None;
        }
        Some((envelope, Self::busy(target, capacity)))
    }

    /// The mailbox capacity of `id`'s kind.
    fn capacity(&self, id: &ActorId) -> usize {
        self.handle
            .shared
            .kinds
            .get(id.kind())
            .expect("activations are of registered kinds only")
            .config
            .mailbox_capacity
    }

    fn busy(target: &ActorId, capacity: usize) -> InvokeError {
        InvokeError::Busy {
            target: target.clone(),
            capacity,
        }
    }

    /// Spawns a new activation of the vacant entry's id with `messages` already in its
    /// mailbox, and fills the entry.
    fn activate(
        handle: &RuntimeHandle,
        next_generation: &mut u64,
        entry: VacantId<'_, Activation>,
        capacity: usize,
        messages: impl ExactSizeIterator<Item = Box<Envelope>>,
    ) {
        let generation = *next_generation;
        *next_generation += 1;
        let (mailbox, receiver) = Mailbox::open(capacity, messages);
        let mut lifecycle = Lifecycle::default();
        lifecycle.apply(LifecycleEvent::Activate);
        let id = entry.key();
        // Its notices are handled by this loop, so none can arrive before the entry.
        let task = activation::spawn(ActivationStart {
            id: id.clone(),
            generation,
            receiver,
            handle: handle.clone(),
        });
        let previous = handle.shared.routes.lock().insert(id.clone(), Route::open(mailbox));
        assert!(previous.is_none(), "a route to {id} outlived its activation");
        entry.insert(Activation {
            lifecycle,
            generation,
            open: true,
            task,
            waiting: None,
        });
        Counters::add(&handle.shared.counters.activations_started);
    }

    fn on_control(&mut self, control: Control) {
        match control {
            Control::Shutdown { reply } => self.begin_shutdown(reply),
            Control::Abort => self.abort(),
            Control::Fenced { id, generation } => {
                if self.current(&id, generation).is_some() {
                    self.close(&id);
                }
            }
            Control::KeepTold {
                id,
                generation,
                envelope,
            } => {
                let until = self.kept_until(&envelope);
                let capacity = self.capacity(&id);
                match self.current(&id, generation) {
                    // A mailbox's worth at most (more only from a mailbox that opened with
                    // more, carried over a crash), so that the next activation opens
                    // with at most `CARRIED_OVER_MAX_MAILBOXES` mailboxes' worth.
                    Some(activation) if activation.waiting.as_ref().map_or(0, |w| w.kept.len()) < capacity => {
                        activation.waiting().kept.push_back((until, envelope));
                    }
                    Some(_) => self.refuse_held(*envelope, Self::busy(&id, capacity)),
                    // Not current (its end was applied first: not expected, a task's
                    // notice of its end is its last).
                    None => self.keep(id, VecDeque::from([(until, envelope)])),
                }
            }
            Control::KeptExpired { id, epoch } => self.kept_expired(id, epoch),
            Control::IdleCheck {
                id,
                generation,
                received,
            } => {
                let waiting = self.handle.shared.waits.lock().is_waiting(&id);
                let routes = &self.handle.shared.routes;
                let current = self.table.get_mut(&id).filter(|a| a.generation == generation);
                let Some(activation) = current else { return };
                activation.note_started();
                if activation.lifecycle.state() != LifecycleState::Active || !activation.open || waiting {
                    return;
                }
                let mut routes = routes.lock();
                let route = routes.get(&id).expect("an open activation has a route");
                // Compared and closed under the mailbox's lock, which every delivery
                // holds: nothing can be put in between.
                if route.close_if_delivered(received) {
                    // The closed mailbox is the order to deactivate: the task takes what
                    // it holds, sees its end, runs on_deactivate, saves and reports back.
                    if let Some(route) = routes.remove(&id) {
                        route.close();
                    }
                    activation.open = false;
                    activation.lifecycle.apply(LifecycleEvent::Deactivate);
                }
            }
            Control::Deactivated { id, generation } => {
                self.finish(id, generation, LifecycleEvent::Deactivated, Vec::new());
            }
            Control::ActivationFailed { id, generation } => {
                self.finish(id, generation, LifecycleEvent::ActivationFailed, Vec::new());
            }
            Control::Crashed { id, generation, unrun } => {
                self.finish(id, generation, LifecycleEvent::Crashed, unrun);
            }
        }
    }

    /// The live activation of `id` if it is generation `generation`.
    fn current(&mut self, id: &ActorId, generation: u64) -> Option<&mut Activation> {
        self.table
            .get_mut(id)
            .filter(|activation| activation.generation == generation)
    }

    /// Removes an activation whose task has ended; starts the next one if messages were
    /// held for it, or left unrun in the mailbox of a task that crashed (`unrun`: those
    /// came first, so they go first).
    fn finish(&mut self, id: ActorId, generation: u64, event: LifecycleEvent, unrun: Vec<Envelope>) {
        let Some(activation) = self.current(&id, generation) else {
            // Not current (a task's notice is its last, so not expected): routed anew.
            for envelope in unrun {
                self.route(id.clone(), Box::new(envelope));
            }
            return;
        };
        if event == LifecycleEvent::Deactivated {
            activation.note_started();
        }
        let state = activation.lifecycle.apply(event);
        assert_eq!(state, LifecycleState::Inactive);
        if activation.open {
            // Crashed or failed to start while its mailbox was open.
            if let Some(route) = self.handle.shared.routes.lock().remove(&id) {
                route.close();
            }
        }
        let Some(activation) = self.table.remove(&id) else {
            unreachable!()
        };
        if event == LifecycleEvent::Deactivated {
            Counters::add(&self.handle.shared.counters.deactivations_finished);
        }
        self.handle
            .shared
            .emit(|| RuntimeEvent::ActivationEnded { actor: id.clone() });
        let Waiting {
            held,
            kept,
            deactivation_waiters,
        } = activation.waiting.map(|waiting| *waiting).unwrap_or_default();
        for waiter in deactivation_waiters {
            let _ = waiter.send(true);
        }
        let mut held: VecDeque<Box<Envelope>> = unrun
            .into_iter()
            .map(Box::new)
            .chain(held)
            .filter(|envelope| !envelope.reply.is_closed())
            .collect();
        if held.is_empty() {
            // Nothing new for the actor: the told messages a stale activation gave back
            // start nothing by themselves (`keep`).
            if !kept.is_empty() {
                self.keep(id, kept);
            }
            return;
        }
        if self.handle.shared.aborted() {
            // The grace period is over (or the runtime dropped): nothing more runs.
            for envelope in kept.into_iter().map(|(_, envelope)| envelope).chain(held) {
                self.refuse_held(*envelope, InvokeError::Shutdown);
            }
            return;
        }
        let capacity = self.capacity(&id);
        // A crashed mailbox's unrun messages and those held since: up to a mailbox's worth
        // go to the next activation. Of the rest, a request is refused as a full mailbox
        // refuses it (its caller sees `Busy`); a told message was accepted already (its
        // sender was answered `Ok`), so it goes too, up to
        // `CARRIED_OVER_MAX_MAILBOXES` mailboxes' worth in all: the crashed mailbox held
        // at most one and the hold at most another. Before, accepted told messages past
        // the first mailbox's worth were dropped without a word.
        // (Told messages a stale activation gave back come on top, first: they and a
        // crashed mailbox's unrun messages came from one mailbox, closed at the fence.)
        if held.len() > capacity {
            let carried_max = capacity
                .saturating_mul(CARRIED_OVER_MAX_MAILBOXES)
                .saturating_sub(kept.len());
            for envelope in held.split_off(capacity) {
                if envelope.reply.has_caller() {
                    self.refuse(*envelope, Self::busy(&id, capacity));
                } else if held.len() < carried_max {
                    held.push_back(envelope);
                } else {
                    // Only after crashes in a row, each with a mailbox and a hold full of
                    // told messages: bounded, and said.
                    tracing::warn!(
                        actor = %id,
                        carried_max,
                        "an accepted told message dropped: more than {CARRIED_OVER_MAX_MAILBOXES} mailboxes' worth carried over to the next activation"
                    );
                    self.refuse_held(*envelope, Self::busy(&id, capacity));
                }
            }
        }
        if !kept.is_empty() {
            // Something new starts the next activation: what the stale one gave back was
            // taken from its mailbox before the rest, so it goes first.
            debug_assert!(!self.kept.contains_key(&id), "kept twice for {id}");
            held = Self::after_kept(&self.handle, kept, held);
        }
        let IdEntry::Vacant(entry) = self.table.entry(id.clone()) else {
            unreachable!("the entry was removed above")
        };
        Self::activate(
            &self.handle,
            &mut self.next_generation,
            entry,
            capacity,
            held.into_iter(),
        );
        if self.shutting_down {
            // Accepted before the shutdown began (held, or in a mailbox that crashed):
            // they run within the grace period as the requests in open mailboxes do
            // (`Runtime::shutdown`, step 2), in an activation closed at once, which
            // deactivates and saves once it has run them. Before, they were refused
            // `Shutdown`, and an accepted told message was dropped without a word.
            self.close(&id);
        }
    }

    /// Stops every activation at once (the shutdown grace period is over, or the
    /// runtime was dropped): each task is aborted at its next `.await`; its crash guard
    /// reports `Crashed`, which frees its entry. Callers whose requests die with it see
    /// `Shutdown` (their reply channel closes while the runtime aborts).
    fn abort(&mut self) {
        self.handle
            .shared
            .abort
            .store(true, std::sync::atomic::Ordering::Release);
        if !self.shutting_down {
            self.begin_shutdown(None);
        }
        let mut held = Vec::new();
        for (_, activation) in self.table.iter_mut() {
            activation.task.abort();
            Counters::add(&self.handle.shared.counters.activations_aborted);
            if let Some(waiting) = &mut activation.waiting {
                held.extend(waiting.kept.drain(..).map(|(_, envelope)| envelope));
                held.extend(waiting.held.drain(..));
            }
        }
        held.extend(self.take_kept());
        // Messages held for a next activation that will not come: refused at once, not
        // when the aborted task next yields.
        for envelope in held {
            self.refuse_held(*envelope, InvokeError::Shutdown);
        }
    }

    /// The time a told message given back by a stale activation now may wait until: its
    /// deadline, or [`TOLD_KEPT_MS_MAX`] from now if sooner.
    fn kept_until(&self, envelope: &Envelope) -> Deadline {
        let now = self.handle.shared.clock.now();
        let latest = Deadline::from_micros(now.as_micros().saturating_add(TOLD_KEPT_MS_MAX * 1_000));
        Deadline::min(envelope.context.deadline(), latest)
    }

    /// Keeps `tells`, told messages a stale activation of `id` gave back unrun, for this
    /// runtime's next activation of `id`, which they do not start: they run first in it
    /// if a new message starts it (`route`), and each is dropped as expired at its time
    /// if none does (`kept_expired`).
    ///
    /// Why not start that activation at once, as for messages held during a
    /// deactivation: the activation was stale because another runtime on the same store
    /// claimed the actor, and an activation started here claims it back and fences that
    /// one, whose queued told messages would then start one there, and so on while told
    /// messages keep coming (6f09540 did so; troupe-agent's two processes on one file
    /// then failed 5 of 16 runs, every delegation fenced). A new message from outside is
    /// what starts an activation here anyway, kept messages or not: they add no claim.
    ///
    /// Bounded: an actor's kept messages came from its stale activation's mailbox, closed
    /// when the fence was met (at most its capacity), and at most [`ACTIVATIONS_MAX`]
    /// actors have kept messages; past that, they are refused, counted in `told_lost`.
    #[cold]
    #[inline(never)]
    fn keep(&mut self, id: ActorId, tells: VecDeque<(Deadline, Box<Envelope>)>) {
        if self.shutting_down || self.handle.shared.aborted() {
            // No new message comes now to start an activation.
            for (_, envelope) in tells {
                self.refuse_held(*envelope, InvokeError::Shutdown);
            }
            return;
        }
        let mut tells = match self.kept.remove(&id) {
            // Not expected (an actor's kept messages go with its next activation): merged.
            Some(kept) => kept.stop().into_iter().chain(tells).collect(),
            None => tells,
        };
        let capacity = self.capacity(&id);
        if tells.len() > capacity {
            // Not expected either (a closed mailbox gave them back): a mailbox's worth at
            // most, so that the next activation opens with room for its new message.
            for (_, envelope) in tells.split_off(capacity) {
                self.refuse_held(*envelope, Self::busy(&id, capacity));
            }
        }
        if self.kept.len() >= ACTIVATIONS_MAX {
            tracing::warn!(
                actor = %id,
                kept = tells.len(),
                "told messages accepted by this runtime were not run: another runtime on the same store took the actor over, and {ACTIVATIONS_MAX} actors already have told messages kept here; send them again"
            );
            let reason = format!("{ACTIVATIONS_MAX} actors already have told messages kept");
            for (_, envelope) in tells {
                let error = InvokeError::Rejected {
                    target: id.clone(),
                    reason: reason.clone(),
                };
                self.refuse_held(*envelope, error);
            }
            return;
        }
        self.drop_expired(&mut tells);
        let Some(first) = tells.iter().map(|(until, _)| *until).min() else {
            return;
        };
        tracing::info!(
            actor = %id,
            kept = tells.len(),
            "told messages accepted by this runtime were not run by its stale activation (another runtime on the same store took the actor over): kept until their deadlines for this runtime's next activation of the actor, which they do not start"
        );
        let epoch = self.next_kept_epoch;
        self.next_kept_epoch += 1;
        let timer = self.kept_timer(id.clone(), epoch, first);
        self.kept.insert(id, Kept { tells, epoch, timer });
    }

    /// A timer that sends `KeptExpired { id, epoch }` at `at`.
    fn kept_timer(&self, id: ActorId, epoch: u64, at: Deadline) -> tokio::task::AbortHandle {
        let control = self.handle.shared.control.clone();
        let instant = self.handle.shared.clock.instant_of(at);
        tokio::spawn(async move {
            tokio::time::sleep_until(instant).await;
            let _ = control.send(Control::KeptExpired { id, epoch });
        })
        .abort_handle()
    }

    /// Drops the told messages among `tells` whose time has passed, as expired.
    fn drop_expired(&self, tells: &mut VecDeque<(Deadline, Box<Envelope>)>) {
        let clock = &self.handle.shared.clock;
        tells.retain(|(until, _)| {
            let passed = clock.has_passed(*until);
            if passed {
                Counters::add(&self.handle.shared.counters.expired_dropped);
            }
            !passed
        });
    }

    /// The timer of `id`'s kept messages fired: drops those whose time has passed, and
    /// arms it again for the rest.
    #[cold]
    #[inline(never)]
    fn kept_expired(&mut self, id: ActorId, epoch: u64) {
        let Some(mut kept) = self.kept.remove(&id) else {
            return;
        };
        if kept.epoch != epoch {
            // A timer aborted after it fired: the current one is another.
            self.kept.insert(id, kept);
            return;
        }
        self.drop_expired(&mut kept.tells);
        let Some(next) = kept.tells.iter().map(|(until, _)| *until).min() else {
            return;
        };
        kept.epoch = self.next_kept_epoch;
        self.next_kept_epoch += 1;
        kept.timer = self.kept_timer(id.clone(), kept.epoch, next);
        self.kept.insert(id, kept);
    }

    /// The messages a new activation opens with: the kept ones still in time (`kept`,
    /// oldest first), then `then`.
    #[cold]
    #[inline(never)]
    fn after_kept(
        handle: &RuntimeHandle,
        kept: VecDeque<(Deadline, Box<Envelope>)>,
        then: impl IntoIterator<Item = Box<Envelope>>,
    ) -> VecDeque<Box<Envelope>> {
        let mut messages = VecDeque::with_capacity(kept.len() + 1);
        for (until, envelope) in kept {
            if handle.shared.clock.has_passed(until) {
                Counters::add(&handle.shared.counters.expired_dropped);
            } else {
                messages.push_back(envelope);
            }
        }
        messages.extend(then);
        messages
    }

    /// Every kept message, their timers stopped.
    fn take_kept(&mut self) -> VecDeque<Box<Envelope>> {
        let mut taken = VecDeque::new();
        for (_, kept) in std::mem::take(&mut self.kept) {
            taken.extend(kept.stop().into_iter().map(|(_, envelope)| envelope));
        }
        taken
    }

    fn begin_shutdown(&mut self, reply: Option<oneshot::Sender<()>>) {
        self.shutting_down = true;
        if let Some(reply) = reply {
            self.shutdown = Some(reply);
        }
        // Messages held for a next activation stay held: they were accepted before the
        // shutdown and run within its grace period (`finish` starts that activation
        // closed); the grace over, `abort` refuses them. Told messages kept for actors
        // with no activation here start none (`keep`): nothing new comes now, so they
        // are lost, counted.
        for envelope in self.take_kept() {
            self.refuse_held(*envelope, InvokeError::Shutdown);
        }
        let mut routes = self.handle.shared.routes.lock();
        for (id, activation) in self.table.iter_mut() {
            activation.close(id, &mut routes);
        }
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use troupe_core::{CallContext, Deadline};

    use super::*;
    use crate::envelope::{EnvelopeSpan, Payload, ReplyTo};

    fn envelope(call: u64) -> Box<Envelope> {
        Box::new(Envelope {
            payload: Payload::Bytes(Bytes::new()),
            context: CallContext::root(Deadline::from_micros(u64::MAX)).into(),
            reply: ReplyTo::Nobody,
            call,
            edge: false,
            span: EnvelopeSpan::new(tracing::Span::none()),
        })
    }

    /// Goal: a request the dispatcher routes to an activation it still takes for open,
    /// whose task has closed the mailbox itself (a fenced commit) or ended (a crash, an
    /// abort) and whose notice the dispatcher has not applied yet, is held for the next
    /// activation (it never got in, so it never ran), and the activation is closed: the
    /// window docs/architecture.md named under "A commit refused for a newer claim".
    /// Before, it was refused `ActorFailed` ("the activation ended before the message
    /// was delivered"). Method: an activation whose mailbox's receiver is dropped (as a
    /// task's end drops it), its route still in the map.
    #[tokio::test]
    async fn a_request_that_meets_a_mailbox_its_task_closed_is_held_for_the_next_activation() {
        let target = ActorId::new("worker", "w").unwrap();
        let routes = Routes::default();
        let (mailbox, receiver) = Mailbox::open(2, std::iter::empty());
        routes.lock().insert(target.clone(), Route::open(mailbox));
        drop(receiver);
        let mut lifecycle = Lifecycle::default();
        lifecycle.apply(LifecycleEvent::Activate);
        lifecycle.apply(LifecycleEvent::Activated);
        let mut activation = Activation {
            lifecycle,
            generation: 0,
            open: true,
            task: tokio::spawn(async {}).abort_handle(),
            waiting: None,
        };
        let refused = Dispatcher::deliver(&routes, &mut activation, &target, 2, envelope(1));
        assert!(refused.is_none(), "refused: {:?}", refused.map(|(_, error)| error));
        assert_eq!(activation.held_len(), 1, "held for the next activation");
        assert!(!activation.open, "the activation is closed");
        assert!(routes.lock().get(&target).is_none(), "its route is gone");
        assert_eq!(activation.lifecycle.state(), LifecycleState::Deactivating);
        // The hold is bounded by the mailbox's capacity, as during a deactivation.
        assert!(Dispatcher::deliver(&routes, &mut activation, &target, 2, envelope(2)).is_none());
        let full = Dispatcher::deliver(&routes, &mut activation, &target, 2, envelope(3));
        assert!(matches!(full, Some((_, InvokeError::Busy { capacity: 2, .. }))));
    }
}
