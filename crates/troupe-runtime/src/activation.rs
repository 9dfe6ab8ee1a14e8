//! One activation of one actor: the task that loads its state, runs its turns one at a
//! time, commits each turn atomically, and deactivates it when the dispatcher agrees.
//!
//! ```text
//! load state ─► factory.create ─► on_activate ─► (started: no notice; see note_started)
//!     │ error: fail every queued request, ActivationFailed
//!     ▼
//! loop { next message (or idle check after idle_timeout of silence)
//!        deadline passed or caller gone? → drop it unrun (Timeout)
//!        handle(turn) under the deadline, while watching the caller
//!        ok and the caller still waits → snapshot; commit state + writes atomically if
//!          anything changed; release the wait-for edge; reply
//!        error / timeout / commit failure / caller gone → rebuild the actor from the last
//!          committed snapshot (the in-memory state never runs ahead of the store);
//!          release the edge; reply the error }
//! mailbox closed by the dispatcher ─► on_deactivate ─► save if changed ─► Deactivated
//! abort (shutdown grace over, or the runtime dropped): the dispatcher aborts the task at
//!   its next `.await`: the turn is dropped (nothing more is committed), the mailbox with
//!   it (callers see `Shutdown`), and the crash guard reports `Crashed`; no on_deactivate
//! ```
//!
//! **A caller that gives up cancels its callee** (NoCommitAfterAbandon in the
//! simulator): the turn is raced against its reply channel closing. When the caller
//! stops waiting (timeout, its future dropped, its own turn ended), the turn future is
//! dropped at its next `.await`: it makes no further model, tool or actor calls (its own
//! calls' waits are dropped with it, which cancels their callees in turn), and it
//! commits nothing. The commit decision is the last check: a turn whose caller is still
//! waiting when it finishes commits, even if the caller gives up while the commit is in
//! flight.
//!
//! **Rollback** rebuilds the actor with its factory from the last committed snapshot. A
//! rebuild is not a new activation: `on_activate` and `on_deactivate` do not run for it.
//!
//! A panic in the actor ends the task; a guard reports `Crashed` so the dispatcher frees
//! the entry. The turn that panicked fails its caller (`ActorFailed`, "ended before it
//! replied"); the requests still queued never started, and go to the next activation
//! with the notice (those of a task that panicked while starting fail as that one).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;

use bytes::Bytes;
use tokio::sync::mpsc;
use troupe_core::limits::INVOKE_TIMEOUT_MS_MAX;
use troupe_core::{ActorId, Deadline, InvokeError};

use crate::actor::{BytesTurn, ValueTurn};
use crate::control::Control;
use crate::envelope::{Envelope, EnvelopeContext, EnvelopeSpan, Payload, Reply, ReplyTo};
use crate::handle::{Counters, Shared};
use crate::mailbox::{Mailbox, MailboxReceiver};
use crate::store_retry::{retry, RetryBounds, STORE_RETRY_DEACTIVATION_MS_MAX};
use crate::wait_for_graph::CallId;
use crate::{
    turn::{TurnHome, TurnWrites},
    ActorBox, ActorError, Claimed, Fence, RuntimeEvent, RuntimeHandle, StateChange, StoreError, Turn, TurnCommit,
};

pub(crate) struct ActivationStart {
    pub(crate) id: ActorId,
    pub(crate) generation: u64,
    pub(crate) receiver: MailboxReceiver,
    pub(crate) handle: RuntimeHandle,
}

/// Reports `Crashed` unless disarmed: runs when the task's future is dropped unfinished
/// (after a panic, or aborted). It holds the task's mailbox receiver, so that the crash
/// notice carries the messages still queued, which never started: the dispatcher hands
/// them to the next activation instead of failing them.
///
/// (Before, the receiver was dropped with the task, and its queued messages failed
/// `ActorFailed` "ended before it replied". Among them, a request sent right after the
/// crashing turn's caller had its failure: the panic's unwinding drops that caller's
/// reply before the task's future, and its mailbox, go. Its caller's next request then
/// failed in 6 of 12 runs, `panics_in_default_or_serialize_fail_the_caller_and_nothing_else`
/// in tests/typed_probes.rs.)
struct CrashGuard {
    control: mpsc::UnboundedSender<Control>,
    id: ActorId,
    generation: u64,
    armed: bool,
    /// Whether the actor started (its claim, factory and `on_activate` succeeded): only
    /// then are the unrun messages handed on. A task that panics while starting fails
    /// them instead ("ended before it replied"), or the next activation would meet the
    /// same panic with the same messages, again and again.
    started: bool,
    receiver: MailboxReceiver,
}

impl CrashGuard {
    fn finish(mut self, notice: Control) {
        self.armed = false;
        let _ = self.control.send(notice);
    }
}

impl Drop for CrashGuard {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.control.send(Control::Crashed {
                id: self.id.clone(),
                generation: self.generation,
                unrun: if self.started {
                    self.receiver.take_unrun()
                } else {
                    Vec::new()
                },
            });
        }
    }
}

/// Spawns the activation's task; the handle lets the dispatcher abort it at shutdown.
pub(crate) fn spawn(start: ActivationStart) -> tokio::task::AbortHandle {
    let ActivationStart {
        id,
        generation,
        receiver,
        handle,
    } = start;
    // Armed before the task exists: a task aborted before its first poll (shutdown right
    // after the spawn) drops it unpolled, and its guard still reports the end.
    let guard = CrashGuard {
        control: handle.shared.control.clone(),
        id,
        generation,
        armed: true,
        started: false,
        receiver,
    };
    // Boxed: the task's future (528 bytes) is then one pointer in tokio's task cell.
    // Spawned unboxed, `tokio::spawn` and the cell's stages copied the whole future ten
    // times per activation (into the spawn, the cell, its box; out at the end), about
    // 870 instructions of `memcpy` of a cold activation's 15,060. Boxed: one copy, and a
    // malloc and a free (cold 15,062 → 14,514 instructions, the `cold` bench run alone
    // 2.17x–2.43x → 2.04x–2.17x of a spawn, 16 bytes more per idle actor; the
    // per-message paths gain one pointer to follow per poll: invoke 2,878 → 2,896).
    tokio::spawn(Box::pin(run(guard, handle))).abort_handle()
}

/// The actor as it runs, with what it needs to roll back.
struct Live {
    /// The actor's id and the runtime, lent to each turn while it runs (moved into the
    /// `Turn` and back, so a turn costs no reference count) and here between turns.
    home: Option<Arc<TurnHome>>,
    actor: ActorBox,
    /// The last committed snapshot: what the store holds for this actor.
    committed: Option<Bytes>,
    /// The fence this activation claimed; every commit is made under it.
    fence: Fence,
    /// The refusal of a commit under `fence`, once the store has refused one: the actor
    /// was claimed since, so this activation is stale and every later turn fails with it.
    fenced: Option<Box<StoreError>>,
}

impl Live {
    fn id(&self) -> &ActorId {
        &self.home.as_ref().expect(HOME_LENT).id
    }

    /// Rebuilds the actor from the last committed snapshot.
    ///
    /// The failed instance is dropped before its successor is built, so two instances
    /// of one actor are never alive at once, here as across activations: an actor that
    /// holds something exclusive for as long as its instance lives (a lock, a
    /// registration under its id) is rebuilt. (Built first, the successor met the old
    /// instance still holding it, and the factory's refusal crashed the activation:
    /// `a_rollback_drops_the_failed_instance_before_it_builds_the_next`.)
    ///
    /// # Errors
    /// If the factory cannot rebuild from a snapshot the actor itself produced (or a
    /// typed actor's `migrate`, which runs again until a turn commits, fails this
    /// time): the text of the panic that [`rebuilt`] makes of it once the turn's caller
    /// has its answer; the crash guard then ends the activation and hands its queued
    /// requests to the next one.
    fn roll_back(&mut self, shared: &Shared) -> Result<(), String> {
        let kind = shared
            .kinds
            .get(self.id().kind())
            .expect("activations are spawned for registered kinds only");
        drop(std::mem::replace(&mut self.actor, ActorBox::vacant()));
        match kind.factory.create(self.id(), self.committed.clone()) {
            Ok(actor) => {
                self.actor = actor;
                Ok(())
            }
            Err(error) => Err(format!(
                "{} cannot be rebuilt from its own committed snapshot: {error}",
                self.id()
            )),
        }
    }
}

/// Ends the activation (a crash) if its rollback failed. Called after the failed turn's
/// caller is answered: before, the rollback panicked first, the unwinding dropped the
/// reply, and the caller saw "the actor's activation ended before it replied" instead
/// of its turn's own error (`a_flaky_migration_under_concurrent_callers_never_loses_the_stored_state`).
fn rebuilt(rolled_back: Result<(), String>) {
    if let Err(message) = rolled_back {
        panic!("{message}");
    }
}

/// Why the activation's home is always back when it is asked for: it is lent to a turn
/// in `begin`, and given back by `Turn::finish` before the turn is settled.
const HOME_LENT: &str = "the home is lent to a turn only between begin and settle";

/// The activation's task. Not an `async fn`: one moves each argument into a local of its
/// own at its start and keeps both in its state (104 bytes more here, which a box of the
/// arguments used to avoid at the price of a malloc and a free per activation); an
/// `async move` block uses what it captured in place.
#[allow(clippy::manual_async_fn)] // on purpose: see above
fn run(mut guard: CrashGuard, handle: RuntimeHandle) -> impl Future<Output = ()> {
    async move {
        let generation = guard.generation;
        // The task's own state is what an idle actor costs for as long as it stays
        // active, so it holds each thing once, and the sub-futures of failing to start,
        // stopping, a turn that has to wait and a commit that goes to the store are boxed
        // instead of being inlined into it (a turn that finishes in its first poll with
        // nothing to store allocates nothing here). Starting is boxed too, although the
        // box is a malloc and a free per activation: inlined, its 128-byte future is laid
        // out after the loop's locals, and since the twenty-ninth pass (a message taken
        // apart in `begin`) rustc keeps the turn's locals where they no longer share room
        // with it, so the state was 624 bytes against 528 boxed (`-Zprint-type-sizes`,
        // rustc 1.95), and tokio's task cell, aligned to 128 bytes, grew by 128 per idle
        // actor. Boxed, a cold activation counts about 230 instructions more and runs
        // about 4 % faster (the smaller task). Since the task's whole future is boxed
        // (`spawn`), the box has no 128-byte steps, but inlining the start still costs
        // more than its box: the larger future is copied into its box once more per
        // activation (cold 14,514 → 14,905 instructions, 2026-12-05).
        // (A labelled block rather than a `match` whose arm awaits: that would keep the
        // start's result, and the error, in the task's state for as long as it runs.)
        let mut live = 'started: {
            let error = match Box::pin(start_actor(&guard.id, &handle, &mut guard.receiver)).await {
                Ok(live) => {
                    guard.started = true;
                    break 'started live;
                }
                Err(error) => error,
            };
            Box::pin(fail_queued(&mut guard.receiver, &handle.shared, error)).await;
            let id = guard.id.clone();
            guard.finish(Control::ActivationFailed { id, generation });
            return;
        };
        // No notice that it started: the dispatcher learns it from the next notice this
        // task sends, which only a started activation sends (see `note_started` in
        // dispatcher.rs).

        let idle_timeout = handle
            .shared
            .kinds
            .get(guard.id.kind())
            .expect("activations are spawned for registered kinds only")
            .config
            .idle_timeout;
        let mut received: u64 = 0;
        // The timer is never touched per message (that would cost a clock read and a timer
        // update per turn). When it fires, it checks whether any message came in during the
        // last period: if none, the actor has been idle for a whole period and asks to be
        // deactivated; otherwise it waits another period. So an actor is deactivated between
        // one and two idle timeouts after its last message.
        let mut received_at_last_check: u64 = 0;
        let idle_timer = tokio::time::sleep(idle_timeout);
        tokio::pin!(idle_timer);
        // Whether the timer holds the task's waker (see `NextEvent`).
        let mut idle_timer_registered = false;
        let mut task_waker: Option<std::task::Waker> = None;
        // The clock as read once in this wake-up of the task, for the expiry check of
        // fire-and-forget messages at dequeue: forgotten whenever the task waits (its mailbox
        // empty, a turn that waits, a commit that goes to the store), so a batch of messages
        // handled in one poll reads the clock once, not once each. See "The clock of a
        // wake-up" in docs/architecture.md.
        let mut now = WakeClock::UNREAD;
        'messages: loop {
            let next = NextEvent {
                receiver: &mut guard.receiver,
                idle_timer: idle_timer.as_mut(),
                idle_timer_registered: &mut idle_timer_registered,
                now: &mut now,
            };
            match next.await {
                Next::Message => {}
                Next::Closed => break,
                Next::IdleTimerFired => {
                    if received == received_at_last_check {
                        // If the dispatcher refuses (something was routed meanwhile, or
                        // calls are in flight), the actor asks again after another period.
                        let id = guard.id.clone();
                        let _ = guard.control.send(Control::IdleCheck {
                            id,
                            generation,
                            received,
                        });
                    }
                    received_at_last_check = received;
                    // Once a period, not per message: a burst's room goes back.
                    guard.receiver.trim_idle();
                    idle_timer.as_mut().reset(tokio::time::Instant::now() + idle_timeout);
                    idle_timer_registered = false;
                    continue;
                }
            };
            received += 1;
            // The turn's fast path: its first poll runs here, inline, in the activation's own
            // task, and a turn that finishes in it with nothing to store is answered at once.
            // Only a turn that has to wait (the same handler future goes on in a box), or a
            // commit that has to reach the store, is boxed; see "The turn's fast path" in
            // docs/architecture.md. The shapes below keep the task small: nothing bigger than
            // a pointer is alive across an await except the turn itself, and that only while
            // its handler waits, where it shares space with what the other awaits hold (a
            // `match` or `if let` whose arm awaits would keep its scrutinee instead).
            //
            // The task's waker, for the first poll (this await holds nothing: the message
            // is still in the mailbox's batch, taken out by `begin` below). It is kept
            // across messages and cloned again only if the task's waker changed: a clone
            // and its drop are an atomic operation each on the task's reference count, per
            // message (perf, 2026-11-25).
            std::future::poll_fn(|cx| {
                if !task_waker.as_ref().is_some_and(|waker| waker.will_wake(cx.waker())) {
                    task_waker = Some(cx.waker().clone());
                }
                Poll::Ready(())
            })
            .await;
            let waker = task_waker.as_ref().expect("set just above");
            {
                let store_commit = 'settled: {
                    let Some((context, payload, begun)) =
                        begin(&live, &handle.shared, generation, &mut guard.receiver, &mut now)
                    else {
                        // Refused unrun (abandoned, expired or fenced): answered already.
                        continue 'messages;
                    };
                    // Built here, where it stays, rather than in `begin` and moved out.
                    let mut turn = Turn::new(live.home.take().expect(HOME_LENT), context);
                    let (raced, ends) = 'turn: {
                        let slow = match begun {
                            // A told message with nobody to answer, no edge and no span: its
                            // ends are made only if its turn does not simply succeed.
                            Begun::Told { call, deadline } => 'told: {
                                match told_first_poll(
                                    &mut live.actor,
                                    &mut turn,
                                    payload,
                                    call,
                                    deadline,
                                    &handle.shared,
                                    waker,
                                ) {
                                    Ok(Told::Answered) => {}
                                    Ok(Told::Raced(finished)) => break 'turn *finished,
                                    Err(slow) => break 'told slow,
                                }
                                let (home, writes) = turn.finish();
                                live.home = Some(home);
                                break 'settled settle_told(
                                    &mut live,
                                    &handle.shared,
                                    generation,
                                    guard.receiver.mailbox(),
                                    writes,
                                    call,
                                    deadline,
                                );
                            }
                            Begun::Full {
                                reply,
                                call,
                                edge,
                                deadline,
                                watch_caller,
                                parent,
                            } => {
                                let ends = TurnEnds {
                                    _spans: TurnSpans::of(&turn, parent),
                                    reply,
                                    call,
                                    edge,
                                    deadline,
                                    watch_caller,
                                    waited: false,
                                };
                                match first_poll(&mut live.actor, &mut turn, payload, ends, &handle.shared, waker) {
                                    Ok(finished) => break 'turn finished,
                                    Err(slow) => slow,
                                }
                            }
                        };
                        now = WakeClock::UNREAD;
                        slow.await
                    };
                    // The turn has ended: calls still in flight from tasks it spawned are
                    // cancelled, and its home comes back with its writes.
                    let (home, writes) = turn.finish();
                    live.home = Some(home);
                    settle(
                        &mut live,
                        &handle.shared,
                        generation,
                        guard.receiver.mailbox(),
                        writes,
                        raced,
                        ends,
                    )
                };
                if let Some(store_commit) = store_commit {
                    now = WakeClock::UNREAD;
                    store_commit.await;
                }
            }
        }

        // The dispatcher closed the mailbox: deactivate.
        Box::pin(deactivate(&mut live, &handle.shared)).await;
        // The actor instance goes before the dispatcher hears of it: once it has, the next
        // message may build the next instance at once, on another thread, and the two must
        // not overlap (an actor that holds a resource until dropped would see them do so).
        drop(live);
        let id = guard.id.clone();
        guard.finish(Control::Deactivated { id, generation });
    }
}

/// What the activation's loop waits for next.
enum Next {
    /// A message is at the front of the mailbox's batch (`MailboxReceiver::take_ready`).
    Message,
    /// The dispatcher closed the mailbox and it is drained.
    Closed,
    IdleTimerFired,
}

/// The activation's wait for its next message or its idle timer, always the mailbox
/// first, then the timer: a fixed order, so runs replay under madsim (it replaced a
/// biased select, without that macro's machinery).
///
/// The idle timer is polled when the mailbox is empty, until a poll has registered the
/// task's waker with it; after that, only once it has elapsed (a `Sleep`'s poll cost
/// about 118 instructions per round trip). A `Pending` counts as registered only if
/// tokio's cooperative budget had room for the poll: a refused poll registers nothing,
/// and an earlier skip that trusted every `Pending` left an actor that had received a
/// burst of more than 128 messages at once never deactivated (tests/idle_timer_coop.rs).
struct NextEvent<'a> {
    receiver: &'a mut MailboxReceiver,
    idle_timer: Pin<&'a mut tokio::time::Sleep>,
    /// Whether the timer holds the task's waker: its last poll returned `Pending` with
    /// cooperative budget left, so it registered. Cleared by the loop when it arms the
    /// timer again.
    idle_timer_registered: &'a mut bool,
    /// The wake-up's clock reading, forgotten when this wait has to wait.
    now: &'a mut WakeClock,
}

/// The clock as read once in a wake-up of an activation's task, or not yet read: in 8
/// bytes of the task's state (an `Option` would take 16), with unread as a time the
/// clock never reaches.
#[derive(Clone, Copy)]
struct WakeClock(troupe_core::Deadline);

impl WakeClock {
    const UNREAD: Self = Self(troupe_core::Deadline::from_micros(u64::MAX));

    /// The reading, made now if not yet.
    fn read(&mut self, clock: &crate::Clock) -> troupe_core::Deadline {
        if self.0 == Self::UNREAD.0 {
            self.0 = clock.now();
        }
        self.0
    }
}

impl Future for NextEvent<'_> {
    type Output = Next;

    #[inline(always)]
    fn poll(self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Next> {
        let this = self.get_mut();
        match this.receiver.poll_ready(cx) {
            Poll::Ready(true) => return Poll::Ready(Next::Message),
            Poll::Ready(false) => return Poll::Ready(Next::Closed),
            Poll::Pending => {}
        }
        // A timer that holds the task's waker wakes the task when it fires, and is marked
        // elapsed before it does (tokio; madsim compares its clock with the deadline):
        // until then it need not be polled each time the mailbox is empty.
        if *this.idle_timer_registered && !this.idle_timer.is_elapsed() {
            // The task yields: time passes before it runs again.
            *this.now = WakeClock::UNREAD;
            return Poll::Pending;
        }
        this.poll_idle_timer(cx)
    }
}

impl NextEvent<'_> {
    /// Polls the idle timer (the mailbox is empty): after it was armed, or once it has
    /// elapsed. Out of line: the mailbox's path stays small.
    #[inline(never)]
    fn poll_idle_timer(&mut self, cx: &mut std::task::Context<'_>) -> Poll<Next> {
        // A `Pending` proves the registration only if the cooperative budget let the poll
        // through: a refused poll returns `Pending` before the timer registers anything
        // (tests/idle_timer_coop.rs).
        let budget_left = crate::clock::coop_budget_left();
        let timer = self.idle_timer.as_mut().poll(cx);
        if timer.is_pending() {
            *self.idle_timer_registered = budget_left;
            *self.now = WakeClock::UNREAD;
        }
        timer.map(|()| Next::IdleTimerFired)
    }
}

/// Closes the mailbox of an activation that failed to start and fails every request
/// in it with `error`.
async fn fail_queued(receiver: &mut MailboxReceiver, shared: &Shared, error: InvokeError) {
    receiver.close();
    while let Some(envelope) = receiver.recv().await {
        respond(shared, envelope.call, envelope.edge, envelope.reply, Err(error.clone()));
    }
}

/// Answers one request: removes its wait-for edge first, so that no call made after
/// the caller has its reply can meet the edge, then replies (a caller that is gone is
/// ignored).
fn respond(shared: &Shared, call: CallId, edge: bool, reply: ReplyTo, result: Reply) {
    if edge {
        shared.waits.remove(call);
    }
    reply.send(result);
}

/// Claims the actor's state, builds the actor and runs `on_activate`. `receiver` holds
/// the requests the activation was started for: a claim the store fails for a moment is
/// tried again within the oldest one's deadline ([`claim_failed`]). (Borrowed `mut`
/// because a shared borrow of it is not `Send`: its batch is not `Sync`.)
async fn start_actor(
    id: &ActorId,
    handle: &RuntimeHandle,
    receiver: &mut MailboxReceiver,
) -> Result<Live, InvokeError> {
    let shared = &handle.shared;
    let kind = shared
        .kinds
        .get(id.kind())
        .expect("activations are spawned for registered kinds only");
    // At once when the store can (no boxed future for it), else awaited.
    let claimed = match shared.store.claim_now(id) {
        Some(claimed) => claimed,
        None => shared.store.claim(id).await,
    };
    let claimed = match claimed {
        Err(source) if source.is_transient() => {
            let deadline = receiver.first_deadline();
            Box::pin(claim_failed(id, shared, receiver.mailbox(), deadline, source)).await
        }
        claimed => claimed,
    };
    let Claimed { fence, state: saved } = claimed.map_err(|source| InvokeError::StorageFailed {
        target: id.clone(),
        source,
    })?;
    let failed = |error: ActorError| InvokeError::ActorFailed {
        target: id.clone(),
        cause: error.to_string(),
    };
    let mut actor = kind.factory.create(id, saved.clone()).map_err(failed)?;
    actor.on_activate(id).await.map_err(failed)?;
    Ok(Live {
        home: Some(Arc::new(TurnHome {
            id: id.clone(),
            handle: handle.clone(),
            fence,
            fence_refused: std::sync::OnceLock::new(),
        })),
        actor,
        committed: saved,
        fence,
        fenced: None,
    })
}

/// [`start_actor`]'s claim after the store failed it for a moment (`source`): tried
/// again until `deadline`, the oldest queued request's (capped at the longest a turn
/// may run from now, as a fire-and-forget message's is when it starts; none queued,
/// not tried again). A claim the store applied unseen costs only a fence: the next
/// claim issues a newer one.
#[cold]
#[inline(never)]
async fn claim_failed(
    id: &ActorId,
    shared: &Shared,
    mailbox: &Mailbox,
    deadline: Option<Deadline>,
    source: StoreError,
) -> Result<Claimed, StoreError> {
    let now = shared.clock.now();
    let latest = Deadline::from_micros(now.as_micros().saturating_add(TURN_TIMEOUT_US_MAX));
    let Some(deadline) = deadline else {
        return Err(source);
    };
    let bounds = RetryBounds {
        shared,
        deadline: Deadline::min(deadline, latest),
        mailbox: Some(mailbox),
        actor: id,
        operation: "claim",
    };
    retry(bounds, source, || async {
        match shared.store.claim_now(id) {
            Some(claimed) => claimed,
            None => shared.store.claim(id).await,
        }
    })
    .await
}

async fn deactivate(live: &mut Live, shared: &Shared) {
    let id = &live.home.as_ref().expect(HOME_LENT).id;
    if shared.aborted() {
        // The runtime was aborted (dropped, or its shutdown grace is over) while this
        // task ran: the dispatcher closes the mailbox before it aborts the task, and a
        // task running on another worker meanwhile sees the end of its mailbox here. An
        // aborted activation runs no `on_deactivate` and saves nothing, as one the abort
        // reaches at an `.await` does not.
        return;
    }
    if let Err(error) = live.actor.on_deactivate(id).await {
        // Its state may be half-way through whatever on_deactivate was doing: keep the
        // last committed turn's state instead.
        Counters::add(&shared.counters.deactivation_saves_failed);
        tracing::warn!(actor = %id, %error, "on_deactivate failed; nothing saved, the last turn's state stays committed");
        return;
    }
    if live.fenced.as_deref().is_some_and(StoreError::is_transient) {
        // A commit given up on while the store was unavailable may have been applied
        // unseen (`store_commit_failed`): a save made from the rolled-back state could
        // undo it. The next activation claims and reads what the store holds.
        return;
    }
    let saved = match live.actor.state_change(live.committed.as_ref()) {
        Ok(state) => {
            let commit = TurnCommit {
                state,
                writes: Vec::new(),
            };
            if commit.is_empty() || shared.aborted() {
                // An aborted runtime (dropped, or its shutdown grace over) saves
                // nothing beyond each actor's last committed turn.
                Ok(())
            } else {
                match shared.store.commit(id, live.fence, commit.clone()).await {
                    Err(source) if source.is_transient() => {
                        Box::pin(deactivation_save_failed(id, shared, live.fence, commit, source)).await
                    }
                    saved => saved,
                }
                .map_err(|error| error.to_string())
            }
        }
        Err(error) => Err(error.to_string()),
    };
    if let Err(error) = saved {
        Counters::add(&shared.counters.deactivation_saves_failed);
        tracing::warn!(actor = %id, %error, "saving state on deactivation failed; the last turn's state stays committed");
    }
}

/// [`deactivate`]'s save after the store failed it for a moment (`source`): the same
/// commit, under the same fence, tried again for [`STORE_RETRY_DEACTIVATION_MS_MAX`]
/// from now (`store_retry.rs`), or until the runtime is aborted (its shutdown grace
/// over). The mailbox is closed already (that is why the activation deactivates), so
/// it does not stop the tries; the dispatcher holds the actor's next requests until this
/// activation reports `Deactivated`, so no second activation claims the actor while its
/// save is being tried again. A save given up on may have been applied unseen: either
/// way the store holds a whole state (this save's or the last turn's), which the next
/// activation claims and reads.
#[cold]
#[inline(never)]
async fn deactivation_save_failed(
    id: &ActorId,
    shared: &Shared,
    fence: Fence,
    commit: TurnCommit,
    source: StoreError,
) -> Result<(), StoreError> {
    let now = shared.clock.now();
    let bounds = RetryBounds {
        shared,
        deadline: Deadline::from_micros(now.as_micros().saturating_add(STORE_RETRY_DEACTIVATION_MS_MAX * 1_000)),
        mailbox: None,
        actor: id,
        operation: "deactivation save",
    };
    retry(bounds, source, || shared.store.commit(id, fence, commit.clone())).await
}

/// A turn's handler: for bytes or for an in-process value. A keyed request's turn (the
/// check of its key, then the handler for bytes and the record of its reply; see
/// `idempotency.rs`) is a bytes turn in the same slot.
enum Handler<'a> {
    Bytes(BytesTurn<'a>),
    Value(ValueTurn<'a>),
}

impl Future for Handler<'_> {
    type Output = Result<Payload, ActorError>;

    fn poll(self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Self::Output> {
        match self.get_mut() {
            Self::Bytes(future) => Pin::new(future).poll(cx).map(|done| done.map(Payload::Bytes)),
            Self::Value(future) => Pin::new(future).poll(cx).map(|done| done.map(Payload::Value)),
        }
    }
}

/// What the race between a turn and its caller produced.
enum Raced<T> {
    Finished(T),
    /// The caller stopped waiting.
    Abandoned,
}

/// The handler's outcome, or `Err(())` when a fire-and-forget turn's own timer fired.
type Outcome = Result<Result<Payload, ActorError>, ()>;

/// The longest a turn may run, in microseconds ([`INVOKE_TIMEOUT_MS_MAX`]).
const TURN_TIMEOUT_US_MAX: u64 = INVOKE_TIMEOUT_MS_MAX * 1_000;

/// Takes the message the wait found ready out of `receiver`'s batch, checks it at dequeue
/// and answers one that must not run; else hands over what its turn is made of (the turn
/// itself is built by the loop, where it stays: built here and moved out, it cost a copy
/// of its 144 bytes per message). The envelope is taken apart where it is taken out of
/// the batch, not passed in: passed by value, it was copied once more, and read back
/// right after being written (see "Twenty-ninth pass" in docs/architecture.md). `now` is
/// the clock as read in this wake-up of the task, read here if not yet. `generation`:
/// the activation's, for a told message a stale activation gives back ([`stale_message`]).
#[inline(always)]
fn begin(
    live: &Live,
    shared: &Shared,
    generation: u64,
    receiver: &mut MailboxReceiver,
    now: &mut WakeClock,
) -> Option<(EnvelopeContext, Payload, Begun)> {
    // Abandoned (its caller timed out, or gave up): never run it. No clock read for a
    // request with a caller: its wait ends at its deadline, which closes the reply
    // channel, so an expired request is an abandoned one. (Between the deadline and the
    // moment the caller's timer is handled, a request may still start; its caller then
    // takes the reply if it arrives first, or the turn is cancelled.) A fire-and-forget
    // message has no caller to close anything: its deadline is checked against the
    // wake-up's clock.
    let Envelope {
        payload,
        mut context,
        reply,
        call,
        edge,
        span: parent,
    } = receiver.take_ready();
    let mut expired = || !reply.has_caller() && context.deadline().has_passed(now.read(&shared.clock));
    let refusal = if shared.aborted() {
        // The runtime was aborted (dropped, or its shutdown grace is over) while this
        // task was running: it is cancelled at its next `.await`, but until then it
        // would go on taking messages, and a turn that finishes in its first poll never
        // awaits. No turn starts for a runtime that is gone: what is still queued is
        // answered `Shutdown`, unrun, as the abort answers it once the task is dropped.
        Some(refused_unrun(shared, &reply, InvokeError::Shutdown))
    } else if reply.is_closed() || expired() {
        Counters::add(&shared.counters.expired_dropped);
        Some(InvokeError::Timeout {
            target: live.id().clone(),
            timeout_ms: 0,
        })
    } else if live.fenced.is_some() {
        // A stale activation runs nothing from its stale state, not even reads: the
        // requests still in its mailbox fail with the fence, told messages are kept for
        // this runtime's next activation (`stale_message`); later ones are held for it.
        let envelope = Envelope {
            payload,
            context,
            reply,
            call,
            edge,
            span: parent,
        };
        stale_message(live, shared, generation, envelope);
        return None;
    } else {
        None
    };
    if let Some(error) = refusal {
        respond(shared, call, edge, reply, Err(error));
        return None;
    }
    if !reply.has_caller() {
        // A root fire-and-forget message may carry a deadline its sender computed
        // without the runtime's cap (`RuntimeHandle::tell`, `ActorRef::tell_by`): its
        // turn gets at most the cap from now, like every other turn. (The clock was read
        // above for this message; one told within the cap is unchanged.)
        if let crate::envelope::EnvelopeContext::Root(deadline) = &mut context {
            let latest = now.read(&shared.clock).as_micros().saturating_add(TURN_TIMEOUT_US_MAX);
            *deadline = Deadline::min(*deadline, Deadline::from_micros(latest));
        }
    }
    let deadline = context.deadline();
    #[cfg(feature = "planted-bugs")]
    let watch_caller = !shared.planted_commit_after_abandon && reply.has_caller();
    #[cfg(not(feature = "planted-bugs"))]
    // A fire-and-forget message has nobody to watch: its turn is timed by its own timer.
    let watch_caller = reply.has_caller();
    if !edge && matches!(reply, ReplyTo::Nobody) && TurnSpans::none_for(&parent) {
        // `Nobody` and an unrecorded span hold nothing: forgotten rather than dropped.
        std::mem::forget(reply);
        std::mem::forget(parent);
        return Some((context, payload, Begun::Told { call, deadline }));
    }
    Some((
        context,
        payload,
        Begun::Full {
            reply,
            call,
            edge,
            deadline,
            watch_caller,
            parent,
        },
    ))
}

/// A turn whose handler has to wait: the race, boxed, to be awaited by the activation.
type SlowTurn<'a> = Pin<Box<dyn Future<Output = (Raced<Outcome>, TurnEnds)> + Send + 'a>>;

/// Makes the turn's handler future and polls it once with the task's waker: the turn,
/// decided, or the race to go on with.
#[inline(always)]
fn first_poll<'a>(
    actor: &'a mut ActorBox,
    turn: &'a mut Turn,
    payload: Payload,
    ends: TurnEnds,
    shared: &'a Shared,
    waker: &std::task::Waker,
) -> Result<(Raced<Outcome>, TurnEnds), SlowTurn<'a>> {
    let mut race = Race {
        handler: handler(actor, turn, payload),
        ends,
        timer: None,
    };
    match race.poll_turn(shared, &mut std::task::Context::from_waker(waker)) {
        Poll::Ready(raced) => Ok((raced, race.ends)),
        Poll::Pending => Err(Box::pin(race.run_out(shared))),
    }
}

/// The turn's handler future for `payload`, in the actor's slot.
#[inline(always)]
fn handler<'a>(actor: &'a mut ActorBox, turn: &'a mut Turn, payload: Payload) -> crate::handle::InTurn<Handler<'a>> {
    // Marks the task as running this actor's turn, so that a root invocation from inside
    // it (through a captured handle) is refused.
    crate::handle::InTurn(match payload {
        Payload::Bytes(bytes) => Handler::Bytes(actor.handle(turn, bytes)),
        Payload::Value(value) => Handler::Value(actor.handle_value_turn(turn, value)),
        Payload::Keyed(request) => Handler::Bytes(actor.handle_keyed(turn, *request)),
    })
}

/// [`first_poll`] for a told message (see [`Begun::Told`]): the same poll (there is no
/// caller to check, and no span to enter), with the turn's ends made only if the
/// handler does not succeed at once.
#[inline(always)]
fn told_first_poll<'a>(
    actor: &'a mut ActorBox,
    turn: &'a mut Turn,
    payload: Payload,
    call: CallId,
    deadline: troupe_core::Deadline,
    shared: &'a Shared,
    waker: &std::task::Waker,
) -> Result<Told, SlowTurn<'a>> {
    let mut handler = handler(actor, turn, payload);
    let mut cx = std::task::Context::from_waker(waker);
    let polled = Pin::new(&mut handler).poll(&mut cx);
    match polled {
        // Nobody reads a told turn's answer: it is not moved (`_` binds nothing), but
        // dropped where the handler's poll wrote it, at the end of this function, rather
        // than copied to `settle_told` or to a drop call: each copy was read back as soon
        // as it was written (perf, "Thirtieth pass" in docs/architecture.md).
        Poll::Ready(Ok(_)) => Ok(Told::Answered),
        Poll::Ready(Err(error)) => Ok(Told::Raced(Box::new((
            Raced::Finished(Ok(Err(error))),
            TurnEnds::told(call, deadline),
        )))),
        Poll::Pending => {
            let mut race = Race {
                handler,
                ends: TurnEnds::told(call, deadline),
                timer: None,
            };
            match race.after_pending(shared, &mut cx) {
                Poll::Ready(raced) => Ok(Told::Raced(Box::new((raced, race.finish())))),
                Poll::Pending => Err(Box::pin(race.run_out(shared))),
            }
        }
    }
}

/// The turn's span, a child of the caller's; not built when no subscriber wants it.
/// (The fields are read only when a subscriber wants the span: a root turn's context is
/// built for it then, not otherwise.)
fn turn_span(parent: &tracing::Span, turn: &Turn) -> tracing::Span {
    tracing::info_span!(
        parent: parent,
        "turn",
        actor = %turn.id(),
        depth = turn.context().depth(),
        chain = ?turn.context().chain(),
        trace_id = turn.context().trace_id().map(tracing::field::display),
    )
}

/// What a turn needs after its handler is done: whom to answer, and how to judge it.
struct TurnEnds {
    reply: ReplyTo,
    call: CallId,
    edge: bool,
    deadline: troupe_core::Deadline,
    /// Whether the caller is watched (it has one); without, the turn times itself.
    watch_caller: bool,
    /// Whether the turn's handler had to wait at least once.
    waited: bool,
    /// The turn's span and its parent, kept until the turn has answered.
    _spans: TurnSpans,
}

impl TurnEnds {
    /// The ends of a told message's turn (nobody to answer, no edge, no span): made only
    /// when its turn waits or fails (see [`Begun::Told`]).
    fn told(call: CallId, deadline: troupe_core::Deadline) -> Self {
        Self {
            reply: ReplyTo::Nobody,
            call,
            edge: false,
            deadline,
            watch_caller: false,
            waited: false,
            _spans: TurnSpans(None),
        }
    }
}

/// What `begin` hands over with a turn: the ends of a request, or of a told message with
/// nobody to answer (`ReplyTo::Nobody`), no wait-for edge and no span to build, just its
/// call and deadline. Such a turn takes the told fast path ([`told_first_poll`],
/// [`settle_told`]): the same checks in the same order as [`first_poll`] and [`settle`]
/// make for it, without moving its ends between the steps.
enum Begun {
    Told {
        call: CallId,
        deadline: troupe_core::Deadline,
    },
    /// A request's ends, but for its spans, which are built once its turn is.
    Full {
        reply: ReplyTo,
        call: CallId,
        edge: bool,
        deadline: troupe_core::Deadline,
        watch_caller: bool,
        parent: EnvelopeSpan,
    },
}

/// A told turn after its first poll: its handler succeeded (its answer, which nobody
/// reads, already dropped), or the race decided otherwise (it failed, or its own timer
/// fired), to be settled as any turn is. The second is boxed, so that the first, the
/// common one, moves nothing (a failed turn allocates already: its rollback rebuilds the
/// actor).
enum Told {
    Answered,
    Raced(Box<(Raced<Outcome>, TurnEnds)>),
}

/// A turn's span and its parent's, kept until the turn has answered: boxed, and only
/// when a subscriber records either, so that a turn without tracing carries one word
/// where two spans take 80 bytes, moved with the turn's ends at each step.
struct TurnSpans(Option<Box<(tracing::Span, tracing::Span)>>);

impl TurnSpans {
    /// The spans of `turn`, a child of its sender's span `parent`. Without a parent and
    /// with no subscriber that records `info` spans at all (the global maximum level,
    /// one atomic load), no span is built: neither could be recorded (about 40
    /// instructions a turn, callgrind, 2026-11-30).
    #[inline(always)]
    fn of(turn: &Turn, parent: EnvelopeSpan) -> Self {
        if Self::none_for(&parent) {
            // An unrecorded span holds nothing: forgotten rather than dropped, which the
            // compiler left as a call to its drop glue.
            std::mem::forget(parent);
            return Self(None);
        }
        let parent = parent.into_span();
        let span = turn_span(&parent, turn);
        Self::new(span, parent)
    }

    /// Whether a turn whose sender's span is `parent` builds no span ([`TurnSpans::of`]).
    #[inline(always)]
    fn none_for(parent: &EnvelopeSpan) -> bool {
        parent.is_none() && !tracing::level_enabled!(tracing::Level::INFO)
    }

    fn new(span: tracing::Span, parent: tracing::Span) -> Self {
        if span.is_none() && parent.is_none() {
            Self(None)
        } else {
            Self(Some(Box::new((span, parent))))
        }
    }

    /// Drops the spans, if any were built: the common case (none) is a test inline, where
    /// the drop glue was a call per turn.
    #[inline(always)]
    fn close(self) {
        if let Some(spans) = self.0 {
            drop_spans(spans);
        }
    }

    /// Enters the turn's span, if it is recorded, until the guard drops.
    fn enter(&self) -> Option<tracing::span::Entered<'_>> {
        self.0.as_ref().map(|spans| spans.0.enter())
    }
}

#[cold]
#[inline(never)]
fn drop_spans(spans: Box<(tracing::Span, tracing::Span)>) {
    drop(spans);
}

/// A turn's handler raced against its caller giving up (or, with no caller, against
/// its own deadline).
struct Race<'a> {
    handler: crate::handle::InTurn<Handler<'a>>,
    ends: TurnEnds,
    /// A fire-and-forget turn's own timer, armed only if it does not finish in its
    /// first poll.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Race<'_> {
    /// One poll of the race. The first one runs inline in the activation's task; the
    /// rest, if the handler has to wait, in [`Race::run_out`].
    fn poll_turn(&mut self, shared: &Shared, cx: &mut std::task::Context<'_>) -> Poll<Raced<Outcome>> {
        let ends = &mut self.ends;
        // With a caller, the turn has no timer of its own: the caller's wait ends at the
        // deadline (its timer is armed at the deadline's instant), which closes the reply
        // channel, which cancels the turn here. One timer per call instead of two.
        //
        // The caller is checked before every poll of the handler, so a turn whose caller
        // has gone makes no further progress; its waker is only registered with the reply
        // channel once the turn has to wait.
        if ends.watch_caller && ends.reply.is_closed() {
            return Poll::Ready(Raced::Abandoned);
        }
        let entered = ends._spans.enter();
        let polled = Pin::new(&mut self.handler).poll(cx);
        drop(entered);
        if let Poll::Ready(outcome) = polled {
            return Poll::Ready(Raced::Finished(Ok(outcome)));
        }
        self.after_pending(shared, cx)
    }

    /// The rest of a poll of the race whose handler returned `Pending`: the turn has
    /// waited; its caller, or its own timer, is watched.
    #[inline(always)]
    fn after_pending(&mut self, shared: &Shared, cx: &mut std::task::Context<'_>) -> Poll<Raced<Outcome>> {
        let ends = &mut self.ends;
        ends.waited = true;
        if ends.watch_caller {
            match ends.reply.poll_closed(cx) {
                Poll::Ready(()) => Poll::Ready(Raced::Abandoned),
                Poll::Pending => Poll::Pending,
            }
        } else {
            // Nobody waits (a fire-and-forget message): the turn times itself, with the
            // timer armed only if the handler does not finish in its first poll.
            let deadline = ends.deadline;
            let timer = self
                .timer
                .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(shared.clock.instant_of(deadline))));
            match timer.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Raced::Finished(Err(()))),
                Poll::Pending => Poll::Pending,
            }
        }
    }

    /// The race's ends, once it is decided; its handler is dropped, and its timer, if it
    /// was armed (tested inline: its drop glue was a call per turn).
    #[inline(always)]
    fn finish(self) -> TurnEnds {
        let Self { handler, ends, timer } = self;
        drop(handler);
        if let Some(timer) = timer {
            drop_timer(timer);
        }
        ends
    }

    /// Polls the race to its end (boxed by the caller: only a turn that waits gets
    /// here); the handler and the timer are dropped with it.
    async fn run_out(mut self, shared: &Shared) -> (Raced<Outcome>, TurnEnds) {
        let raced = std::future::poll_fn(|cx| self.poll_turn(shared, cx)).await;
        (raced, self.ends)
    }
}

#[cold]
#[inline(never)]
fn drop_timer(timer: Pin<Box<tokio::time::Sleep>>) {
    drop(timer);
}

/// A commit on its way to the store, boxed, to be awaited by the activation; the turn is
/// answered after it.
type Committing<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// Decides a finished (or abandoned) turn: answers it at once when no store commit is
/// needed, else returns the commit, which answers once made. `mailbox` is the
/// activation's, which a commit refused for a newer claim closes.
#[inline(always)]
fn settle<'a>(
    live: &'a mut Live,
    shared: &'a Shared,
    generation: u64,
    mailbox: &'a Mailbox,
    writes: TurnWrites,
    raced: Raced<Outcome>,
    ends: TurnEnds,
) -> Option<Committing<'a>> {
    Counters::add(&shared.counters.turns_run);
    let TurnEnds {
        reply,
        call,
        edge,
        deadline,
        watch_caller,
        waited,
        _spans: spans,
    } = ends;
    // The caller puts the time it allowed into the error.
    let timed_out = || {
        Err(InvokeError::Timeout {
            target: live.id().clone(),
            timeout_ms: 0,
        })
    };
    let result = match raced {
        Raced::Abandoned => {
            abandon(live, shared, call, edge, reply);
            return None;
        }
        Raced::Finished(Err(())) => timed_out(),
        // A turn that ends at or after its deadline may finish before its caller's timer
        // is handled: it must not commit what the caller will never see acknowledged.
        // A turn that never waited ran straight after the deadline check at dequeue, so
        // only one that waited reads the clock again.
        Raced::Finished(Ok(_)) if waited && shared.clock.has_passed(deadline) => timed_out(),
        #[cfg(feature = "planted-bugs")]
        Raced::Finished(Ok(Err(error))) if shared.planted_commit_failed_turn => {
            shared.emit(|| RuntimeEvent::TurnCommitting {
                actor: live.id().clone(),
                request: call,
            });
            let result = Err(actor_error(live.id(), error));
            return match prepare_commit(live, writes) {
                Ok(Some(commit)) => Some(Box::pin(
                    StoreCommit {
                        commit,
                        answer: result,
                        reply,
                        call,
                        edge,
                        generation,
                        deadline,
                        ignore_commit: true,
                        _spans: spans,
                    }
                    .run(live, shared, mailbox),
                )),
                Ok(None) | Err(_) => {
                    fail(live, shared, call, edge, reply, result);
                    None
                }
            };
        }
        Raced::Finished(Ok(Err(error))) => {
            close_if_fence_refused(live, shared, generation, mailbox);
            Err(actor_error(live.id(), error))
        }
        // The commit decision: only while the caller still waits.
        Raced::Finished(Ok(Ok(_))) if watch_caller && reply.is_closed() => {
            abandon(live, shared, call, edge, reply);
            return None;
        }
        Raced::Finished(Ok(Ok(answer))) => {
            shared.emit(|| RuntimeEvent::TurnCommitting {
                actor: live.id().clone(),
                request: call,
            });
            match prepare_commit(live, writes) {
                // An accepted fire-and-forget message whose turn stored nothing: nobody
                // to answer and no edge to release, so the answer is dropped here rather
                // than moved through `respond` (about 60 instructions a told message,
                // callgrind, 2026-11-30).
                Ok(None) if !edge && matches!(reply, ReplyTo::Nobody) => {
                    // `Nobody` holds nothing: forgotten rather than dropped, which the
                    // compiler left as a call to its drop glue (13 instructions a message).
                    std::mem::forget(reply);
                    spans.close();
                    return None;
                }
                Ok(None) => Ok(answer),
                Ok(Some(commit)) => {
                    let store_commit = StoreCommit {
                        commit,
                        answer: Ok(answer),
                        reply,
                        call,
                        edge,
                        generation,
                        deadline,
                        #[cfg(feature = "planted-bugs")]
                        ignore_commit: false,
                        _spans: spans,
                    };
                    return Some(Box::pin(store_commit.run(live, shared, mailbox)));
                }
                Err(error) => Err(error),
            }
        }
    };
    if result.is_err() {
        fail(live, shared, call, edge, reply, result);
    } else {
        respond(shared, call, edge, reply, result);
    }
    // Kept until the turn has answered.
    spans.close();
    None
}

/// [`settle`] for a told message (see [`Begun::Told`]) whose handler succeeded in its
/// first poll: the same steps for it (it never waited, and nobody is watched), so its
/// state change is still checked and a change committed.
#[inline(always)]
fn settle_told<'a>(
    live: &'a mut Live,
    shared: &'a Shared,
    generation: u64,
    mailbox: &'a Mailbox,
    writes: TurnWrites,
    call: CallId,
    deadline: Deadline,
) -> Option<Committing<'a>> {
    Counters::add(&shared.counters.turns_run);
    shared.emit(|| RuntimeEvent::TurnCommitting {
        actor: live.id().clone(),
        request: call,
    });
    match prepare_commit(live, writes) {
        // Nobody to answer and no edge to release.
        Ok(None) => None,
        Ok(Some(commit)) => {
            let store_commit = StoreCommit {
                commit,
                // What the commit's success is answered with, to nobody: the turn's own
                // answer was dropped when the handler returned it.
                answer: Ok(Payload::Bytes(Bytes::new())),
                reply: ReplyTo::Nobody,
                call,
                edge: false,
                generation,
                deadline,
                #[cfg(feature = "planted-bugs")]
                ignore_commit: false,
                _spans: TurnSpans(None),
            };
            Some(Box::pin(store_commit.run(live, shared, mailbox)))
        }
        Err(error) => {
            fail(live, shared, call, false, ReplyTo::Nobody, Err(error));
            None
        }
    }
}

/// Counts a failed turn, rolls the actor back and answers the error.
fn fail(live: &mut Live, shared: &Shared, call: CallId, edge: bool, reply: ReplyTo, result: Reply) {
    Counters::add(&shared.counters.turns_failed);
    let rolled_back = live.roll_back(shared);
    respond(shared, call, edge, reply, result);
    rebuilt(rolled_back);
}

/// A turn's commit that has to reach the store before the turn is answered.
struct StoreCommit {
    commit: TurnCommit,
    /// The answer once the commit is made (an error already, for a planted-bug commit
    /// of a failed turn).
    answer: Reply,
    reply: ReplyTo,
    call: CallId,
    edge: bool,
    /// The activation's generation, for the dispatcher's notice if the store fences it.
    generation: u64,
    /// The deadline of the turn's request: a commit that fails for a moment is tried
    /// again until it (`store_retry.rs`).
    deadline: Deadline,
    /// Planted bug: the commit of a failed turn, whose outcome does not matter.
    #[cfg(feature = "planted-bugs")]
    ignore_commit: bool,
    _spans: TurnSpans,
}

impl StoreCommit {
    async fn run(self, live: &mut Live, shared: &Shared, mailbox: &Mailbox) {
        let was_fenced = live.fenced.is_some();
        let committed = store_commit(live, shared, self.commit, self.deadline, mailbox).await;
        if !was_fenced && live.fenced.is_some() {
            close_fenced(live, shared, self.generation, mailbox);
        }
        #[cfg(feature = "planted-bugs")]
        let committed = if self.ignore_commit { Ok(()) } else { committed };
        let result = committed.and(self.answer);
        if result.is_err() {
            fail(live, shared, self.call, self.edge, self.reply, result);
        } else {
            respond(shared, self.call, self.edge, self.reply, result);
        }
    }
}

/// Closes an activation found stale (`live.fenced` just set): another activation claimed
/// this actor since (another runtime on the same store). Asks to be deactivated at once
/// rather than when idle, so the next request activates the actor afresh from the newest
/// state. Called before the refusal is answered: the dispatcher applies its notices
/// before any command sent after the caller has its answer, so a caller that then asks
/// the dispatcher (a request through it, `stats`) finds this activation closed, never
/// still open for another stale turn.
#[cold]
#[inline(never)]
fn close_fenced(live: &Live, shared: &Shared, generation: u64, mailbox: &Mailbox) {
    let id = live.id().clone();
    let _ = shared.control.send(Control::Fenced { id, generation });
    // And the mailbox is closed here, before the answer too: a request from outside
    // goes straight into an open mailbox, without the dispatcher, and the dispatcher may
    // not have applied the notice yet, so the caller's next request found this stale
    // mailbox still open and was refused with the fence again (13 of 40 such requests on
    // worker threads, `the_request_after_a_fenced_refusal_is_served_by_a_fresh_activation`).
    // Closed, it is handed to the dispatcher, which has the notice by then and holds the
    // request for the next activation. What is queued runs nothing: requests fail with
    // the fence, told messages are kept for this runtime's next activation
    // (`stale_message`). (Closed after the notice is sent, so the dispatcher meets this closed mailbox as
    // still open only with a command whose notices it drained just before the notice was
    // sent, and delivers just after the close: that request fails `ActorFailed`, as one
    // meeting a crashed activation.)
    mailbox.close();
}

/// After a failed turn: if the turn met its fence refused ([`Turn::check_fence`]), the
/// activation is stale, and is closed as after a refused commit (a failed turn commits
/// nothing, so no commit would ever tell it). Only failed turns look: the hot path of a
/// turn that succeeds reads nothing more (its commit, if any, meets the refusal itself).
#[cold]
#[inline(never)]
fn close_if_fence_refused(live: &mut Live, shared: &Shared, generation: u64, mailbox: &Mailbox) {
    if live.fenced.is_some() {
        return;
    }
    let Some(refused) = live.home.as_ref().and_then(|home| home.fence_refused.get()) else {
        return;
    };
    live.fenced = Some(Box::new(refused.clone()));
    close_fenced(live, shared, generation, mailbox);
}

/// `error`, for a message an aborted activation refuses unrun. A told one was accepted
/// (its sender answered `Ok`), so nobody else learns of it: it is counted in
/// `told_lost`. Out of line, so that the inlined `begin` keeps its shape (a cold
/// activation counted 14,578 instructions before `told_lost` and 14,588 with it, in
/// `bash scripts/instr-count cold` from one checkout).
#[cold]
#[inline(never)]
fn refused_unrun(shared: &Shared, reply: &ReplyTo, error: InvokeError) -> InvokeError {
    if matches!(reply, ReplyTo::Nobody) {
        Counters::add(&shared.counters.told_lost);
    }
    error
}

/// A message a stale activation (`live.fenced`: another runtime on the same store
/// claimed the actor since, a cluster node lost its placement, or the store's answer to
/// a commit is unknown) takes from its mailbox: it never runs here. A request fails with
/// the fence (its caller may send it again, and a fresh activation serves it). A told
/// message was accepted (its sender was answered `Ok`) and nobody would see a refusal,
/// so it goes back to the dispatcher, which keeps it for this runtime's next activation
/// of the actor but does not start one for it (`Dispatcher::keep`): handed to a next
/// activation started at once (6f09540, reverted), it claimed the actor back, fenced the
/// other runtime, whose queued tells did the same, and troupe-agent's two processes on
/// one file then failed 5 of 16 runs, every delegation fenced.
#[cold]
#[inline(never)]
fn stale_message(live: &Live, shared: &Shared, generation: u64, envelope: Envelope) {
    if matches!(envelope.reply, ReplyTo::Nobody) {
        let id = live.id().clone();
        let envelope = Box::new(envelope);
        if shared
            .control
            .send(Control::KeepTold {
                id,
                generation,
                envelope,
            })
            .is_err()
        {
            // The dispatcher is gone (the runtime with it): nothing runs any more.
            Counters::add(&shared.counters.told_lost);
        }
        return;
    }
    let source = live
        .fenced
        .as_deref()
        .expect("a stale activation has its refusal")
        .clone();
    let error = InvokeError::StorageFailed {
        target: live.id().clone(),
        source,
    };
    let Envelope { reply, call, edge, .. } = envelope;
    respond(shared, call, edge, reply, Err(error));
}

/// Rolls back a turn whose caller stopped waiting; it commits nothing.
fn abandon(live: &mut Live, shared: &Shared, call: CallId, edge: bool, reply: ReplyTo) {
    Counters::add(&shared.counters.turns_abandoned);
    let rolled_back = live.roll_back(shared);
    shared.emit(|| RuntimeEvent::TurnAbandoned {
        actor: live.id().clone(),
        request: call,
    });
    let error = InvokeError::Cancelled {
        target: live.id().clone(),
    };
    respond(shared, call, edge, reply, Err(error));
    rebuilt(rolled_back);
}

/// The turn's state change and writes, or `None` when nothing changed (the store is
/// skipped then).
fn prepare_commit(live: &Live, writes: TurnWrites) -> Result<Option<TurnCommit>, InvokeError> {
    let state = live
        .actor
        .state_change(live.committed.as_ref())
        .map_err(|error| actor_error(live.id(), error))?;
    // The common turn (state unchanged, nothing written) builds no commit to then find
    // empty.
    if matches!(state, StateChange::Unchanged) && writes.none_made() {
        // No writes hold nothing: forgotten rather than dropped, which the compiler left
        // as a call to their drop glue (15 instructions a turn).
        std::mem::forget(writes);
        return Ok(None);
    }
    let commit = TurnCommit {
        state,
        writes: writes.into_vec(),
    };
    Ok((!commit.is_empty()).then_some(commit))
}

/// Commits a turn's state change and writes atomically under the activation's fence. A
/// refusal for a newer claim marks the activation fenced: every later request is then
/// answered with it, unrun. A commit the store fails for a moment is tried again until
/// `deadline` ([`store_commit_failed`]); the success path is the one try.
async fn store_commit(
    live: &mut Live,
    shared: &Shared,
    commit: TurnCommit,
    deadline: Deadline,
    mailbox: &Mailbox,
) -> Result<(), InvokeError> {
    // The runtime was aborted (dropped, or its shutdown grace is over) while the turn
    // ran: nothing more is committed. The caller gets `Shutdown`, and the turn is rolled
    // back like any failed one. (A commit already inside the store when the abort came
    // completes.)
    if shared.aborted() {
        return Err(InvokeError::Shutdown);
    }
    let committed = commit.state.applied_to(live.committed.clone());
    // What a second try needs and the store takes: the writes (the state change is
    // `committed` against `live.committed` again). Copied only for a store that may
    // fail for a moment; a turn without writes needs no copy.
    let writes = if commit.writes.is_empty() {
        Some(Vec::new())
    } else if shared.store.may_be_unavailable() {
        Some(commit.writes.clone())
    } else {
        None
    };
    match shared.store.commit(live.id(), live.fence, commit).await {
        Ok(()) => {
            live.committed = committed;
            Ok(())
        }
        Err(source) => {
            Box::pin(store_commit_failed(
                live, shared, source, committed, writes, deadline, mailbox,
            ))
            .await
        }
    }
}

/// [`store_commit`] after its first try failed with `source`: tries the same commit
/// again while the store is unavailable ([`StoreError::Unavailable`]), within the
/// request's `deadline` (`store_retry.rs`), if its `writes` were kept. `committed` is the
/// snapshot the commit makes.
///
/// A commit given up on while unavailable may have been applied all the same (its
/// connection failed while its last step was on its way: see
/// [`StoreError::Unavailable`]): the activation no longer knows what the store holds,
/// so it is closed as a fenced one is, and the next activation claims and reads it.
#[cold]
#[inline(never)]
async fn store_commit_failed(
    live: &mut Live,
    shared: &Shared,
    source: StoreError,
    committed: Option<Bytes>,
    writes: Option<Vec<(String, Option<Bytes>)>>,
    deadline: Deadline,
    mailbox: &Mailbox,
) -> Result<(), InvokeError> {
    let result = match writes {
        Some(writes) if source.is_transient() => {
            // The same commit: under the same fence, with the same absolute writes, so a
            // try after one the store applied unseen leaves the store as one would.
            let state = StateChange::between(live.committed.as_ref(), committed.clone());
            let (id, fence) = (live.id(), live.fence);
            let bounds = RetryBounds {
                shared,
                deadline,
                mailbox: Some(mailbox),
                actor: id,
                operation: "commit",
            };
            retry(bounds, source, || {
                let commit = TurnCommit {
                    state: state.clone(),
                    writes: writes.clone(),
                };
                shared.store.commit(id, fence, commit)
            })
            .await
        }
        _ => Err(source),
    };
    match result {
        Ok(()) => {
            live.committed = committed;
            Ok(())
        }
        Err(source) => {
            // Fenced: another activation claimed the actor since. NotOwner: a cluster
            // node lost the actor's placement (its lease). Either way this one is stale.
            // Unavailable: what the store holds is not known (see above).
            if source.is_transient() || matches!(source, StoreError::Fenced { .. } | StoreError::NotOwner { .. }) {
                live.fenced = Some(Box::new(source.clone()));
            }
            Err(InvokeError::StorageFailed {
                target: live.id().clone(),
                source,
            })
        }
    }
}

fn actor_error(id: &ActorId, error: ActorError) -> InvokeError {
    match error {
        ActorError::Failed { cause } => InvokeError::ActorFailed {
            target: id.clone(),
            cause,
        },
        ActorError::Rejected { reason } => InvokeError::Rejected {
            target: id.clone(),
            reason,
        },
        // A failed call passes through unchanged: the root caller sees the real cause
        // (a deadlock, a nested timeout) rather than a string.
        ActorError::Invoke(inner) => inner,
        ActorError::Store(source) => InvokeError::StorageFailed {
            target: id.clone(),
            source,
        },
    }
}
