//! One activation of one actor: the task that loads its state, runs its turns one at a
//! time, commits each turn atomically, and deactivates it when the dispatcher agrees.
//!
//! ```text
//! load state ─► factory.create ─► on_activate ─► Activated
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
//! the entry, and callers of the queued requests see `ActorFailed`.

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::task::Poll;

use bytes::Bytes;
use tokio::sync::mpsc;
use troupe_core::{ActorId, InvokeError};

use crate::control::Control;
use crate::envelope::{Envelope, MailboxReceiver, Payload, Reply, ReplyTo};
use crate::handle::{Counters, Shared};
use crate::wait_for_graph::CallId;
use crate::{
    Actor, ActorError, Claimed, Fence, RuntimeEvent, RuntimeHandle, StateChange, StateStore, StoreError, Turn,
    TurnCommit,
};

pub(crate) struct ActivationStart {
    pub(crate) id: ActorId,
    pub(crate) generation: u64,
    pub(crate) receiver: MailboxReceiver,
    pub(crate) handle: RuntimeHandle,
}

/// Reports `Crashed` unless disarmed: runs when the task unwinds from a panic.
struct CrashGuard {
    control: mpsc::UnboundedSender<Control>,
    id: ActorId,
    generation: u64,
    armed: bool,
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
            });
        }
    }
}

/// Spawns the activation's task; the handle lets the dispatcher abort it at shutdown.
pub(crate) fn spawn(start: ActivationStart) -> tokio::task::AbortHandle {
    tokio::spawn(run(start)).abort_handle()
}

/// The actor as it runs, with what it needs to roll back.
struct Live {
    id: ActorId,
    actor: Box<dyn Actor>,
    /// The last committed snapshot: what the store holds for this actor.
    committed: Option<Bytes>,
    /// The fence this activation claimed; every commit is made under it.
    fence: Fence,
    /// The refusal of a commit under `fence`, once the store has refused one: the actor
    /// was claimed since, so this activation is stale and every later turn fails with it.
    fenced: Option<Box<StoreError>>,
}

impl Live {
    /// Rebuilds the actor from the last committed snapshot.
    ///
    /// # Panics
    /// If the factory cannot rebuild from a snapshot the actor itself produced; the
    /// crash guard then ends the activation.
    fn roll_back(&mut self, shared: &Shared) {
        let kind = shared
            .kinds
            .get(self.id.kind())
            .expect("activations are spawned for registered kinds only");
        match kind.factory.create(&self.id, self.committed.clone()) {
            Ok(actor) => self.actor = actor,
            Err(error) => panic!("{} cannot be rebuilt from its own committed snapshot: {error}", self.id),
        }
    }
}

async fn run(start: ActivationStart) {
    let ActivationStart {
        id,
        generation,
        mut receiver,
        handle,
    } = start;
    // The task's own state is what an idle actor costs for as long as it stays active,
    // so it holds each thing once, and the sub-futures of starting, turns and stopping
    // are boxed (one allocation per turn) instead of being inlined into it.
    let guard = CrashGuard {
        control: handle.shared.control.clone(),
        id,
        generation,
        armed: true,
    };
    let mut live = match Box::pin(start_actor(&guard.id, &handle)).await {
        Ok(live) => live,
        Err(error) => {
            receiver.close();
            while let Some(envelope) = receiver.recv().await {
                respond(
                    &handle.shared,
                    envelope.call,
                    envelope.edge,
                    envelope.reply,
                    Err(error.clone()),
                );
            }
            let id = guard.id.clone();
            guard.finish(Control::ActivationFailed { id, generation });
            return;
        }
    };
    let _ = guard.control.send(Control::Activated {
        id: guard.id.clone(),
        generation,
    });

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
    loop {
        let envelope = tokio::select! {
            biased;
            envelope = receiver.recv() => match envelope {
                Some(envelope) => envelope,
                None => break,
            },
            () = &mut idle_timer => {
                if received == received_at_last_check {
                    // If the dispatcher refuses (something was routed meanwhile, or
                    // calls are in flight), the actor asks again after another period.
                    let id = guard.id.clone();
                    let _ = guard.control.send(Control::IdleCheck { id, generation, received });
                }
                received_at_last_check = received;
                idle_timer.as_mut().reset(tokio::time::Instant::now() + idle_timeout);
                continue;
            }
        };
        received += 1;
        let was_fenced = live.fenced.is_some();
        Box::pin(run_turn(&mut live, &handle, *envelope)).await;
        if !was_fenced && live.fenced.is_some() {
            // Another activation claimed this actor since (another runtime on the same
            // store): this one is stale. Ask to be deactivated at once rather than when
            // idle, so the next request activates the actor afresh from the newest state.
            let id = guard.id.clone();
            let _ = guard.control.send(Control::Fenced { id, generation });
        }
    }

    // The dispatcher closed the mailbox: deactivate.
    Box::pin(deactivate(&mut live, &handle.shared)).await;
    let id = guard.id.clone();
    guard.finish(Control::Deactivated { id, generation });
}

/// Answers one request: releases its wait-for edge first, so that no call made after
/// the caller has its reply can meet the edge, then replies (a caller that is gone is
/// ignored).
fn respond(shared: &Shared, call: CallId, edge: bool, reply: ReplyTo, result: Reply) {
    if edge {
        let _ = shared.control.send(Control::ReleaseCall { call });
    }
    reply.send(result);
}

async fn start_actor(id: &ActorId, handle: &RuntimeHandle) -> Result<Live, InvokeError> {
    let shared = &handle.shared;
    let kind = shared
        .kinds
        .get(id.kind())
        .expect("activations are spawned for registered kinds only");
    let Claimed { fence, state: saved } =
        shared
            .store
            .claim(id)
            .await
            .map_err(|source| InvokeError::StorageFailed {
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
        id: id.clone(),
        actor,
        committed: saved,
        fence,
        fenced: None,
    })
}

async fn deactivate(live: &mut Live, shared: &Shared) {
    let id = &live.id;
    if let Err(error) = live.actor.on_deactivate(id).await {
        // Its state may be half-way through whatever on_deactivate was doing: keep the
        // last committed turn's state instead.
        Counters::add(&shared.counters.deactivation_saves_failed);
        tracing::warn!(actor = %id, %error, "on_deactivate failed; nothing saved, the last turn's state stays committed");
        return;
    }
    let saved = match live.actor.snapshot() {
        Ok(snapshot) => {
            let commit = TurnCommit {
                state: StateChange::between(live.committed.as_ref(), snapshot),
                writes: Vec::new(),
            };
            if commit.is_empty() {
                Ok(())
            } else {
                shared
                    .store
                    .commit(id, live.fence, commit)
                    .await
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

/// A turn's handler: for bytes or for an in-process value.
enum Handler<'a> {
    Bytes(BoxedTurn<'a, Bytes>),
    Value(BoxedTurn<'a, Box<dyn Any + Send>>),
}

/// The future of one [`Actor`] handler, as `async_trait` boxes it.
type BoxedTurn<'a, T> = Pin<Box<dyn Future<Output = Result<T, ActorError>> + Send + 'a>>;

impl Future for Handler<'_> {
    type Output = Result<Payload, ActorError>;

    fn poll(self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Self::Output> {
        match self.get_mut() {
            Self::Bytes(future) => future.as_mut().poll(cx).map(|done| done.map(Payload::Bytes)),
            Self::Value(future) => future.as_mut().poll(cx).map(|done| done.map(Payload::Value)),
        }
    }
}

/// What the race between a turn and its caller produced.
enum Raced<T> {
    Finished(T),
    /// The caller stopped waiting.
    Abandoned,
}

async fn run_turn(live: &mut Live, handle: &RuntimeHandle, envelope: Envelope) {
    let shared = &*handle.shared;
    let Envelope {
        payload,
        context,
        mut reply,
        call,
        edge,
        span,
    } = envelope;
    // Abandoned (its caller timed out, or gave up): never run it. No clock read for a
    // request with a caller: its wait ends at its deadline, which closes the reply
    // channel, so an expired request is an abandoned one. (Between the deadline and the
    // moment the caller's timer is handled, a request may still start; its caller then
    // takes the reply if it arrives first, or the turn is cancelled.) A fire-and-forget
    // message has no caller to close anything: its deadline is read here.
    let expired = || !reply.has_caller() && context.deadline().has_passed(shared.clock.now());
    if reply.is_closed() || expired() {
        Counters::add(&shared.counters.expired_dropped);
        let error = InvokeError::Timeout {
            target: live.id.clone(),
            timeout_ms: 0,
        };
        respond(shared, call, edge, reply, Err(error));
        return;
    }
    if let Some(fenced) = &live.fenced {
        // A stale activation answers nothing from its stale state, not even reads: the
        // requests still in its mailbox fail with the fence; later ones are held for the
        // next activation.
        let error = InvokeError::StorageFailed {
            target: live.id.clone(),
            source: (**fenced).clone(),
        };
        respond(shared, call, edge, reply, Err(error));
        return;
    }
    let deadline = context.deadline();
    let span = tracing::info_span!(
        parent: &span,
        "turn",
        actor = %live.id,
        depth = context.depth(),
        chain = ?context.chain(),
        trace_id = context.trace_id().map(tracing::field::display),
    );
    let mut turn = Turn::new(live.id.clone(), context, handle.clone());
    #[cfg(feature = "planted-bugs")]
    let watch_caller = !shared.planted_commit_after_abandon && reply.has_caller();
    #[cfg(not(feature = "planted-bugs"))]
    // A fire-and-forget message has nobody to watch: its turn is timed by its own timer.
    let watch_caller = reply.has_caller();
    // Whether the turn's handler had to wait at least once.
    let mut waited = false;
    let raced = {
        // Marks the task as running this actor's turn, so that a root invocation from
        // inside it (through a captured handle) is refused.
        let mut handler = crate::handle::InTurn(match payload {
            Payload::Bytes(bytes) => Handler::Bytes(live.actor.handle(&mut turn, bytes)),
            Payload::Value(value) => Handler::Value(live.actor.handle_value(&mut turn, value)),
        });
        if watch_caller {
            // No timer of its own: the caller's wait ends at the deadline (its timer is
            // armed at the deadline's instant), which closes the reply channel, which
            // cancels the turn here. One timer per call instead of two.
            std::future::poll_fn(|cx| {
                // The caller is checked before every poll of the handler, so a turn
                // whose caller has gone makes no further progress; its waker is only
                // registered with the reply channel once the turn has to wait.
                if reply.is_closed() {
                    return Poll::Ready(Raced::Abandoned);
                }
                let entered = span.enter();
                let polled = Pin::new(&mut handler).poll(cx);
                drop(entered);
                if let Poll::Ready(outcome) = polled {
                    return Poll::Ready(Raced::Finished(Ok(outcome)));
                }
                waited = true;
                match reply.poll_closed(cx) {
                    Poll::Ready(()) => Poll::Ready(Raced::Abandoned),
                    Poll::Pending => Poll::Pending,
                }
            })
            .await
        } else {
            // Nobody waits (a fire-and-forget message): the turn times itself, with the
            // timer armed only if the handler does not finish in its first poll.
            let mut timer: Option<Pin<Box<tokio::time::Sleep>>> = None;
            std::future::poll_fn(|cx| {
                let entered = span.enter();
                let polled = Pin::new(&mut handler).poll(cx);
                drop(entered);
                if let Poll::Ready(outcome) = polled {
                    return Poll::Ready(Raced::Finished(Ok(outcome)));
                }
                waited = true;
                let timer =
                    timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(shared.clock.instant_of(deadline))));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Raced::Finished(Err(()))),
                    Poll::Pending => Poll::Pending,
                }
            })
            .await
        }
    };
    // The turn has ended: calls still in flight from tasks it spawned are cancelled.
    turn.end();
    Counters::add(&shared.counters.turns_run);
    // The caller puts the time it allowed into the error.
    let timed_out = || {
        Err(InvokeError::Timeout {
            target: live.id.clone(),
            timeout_ms: 0,
        })
    };
    let result = match raced {
        Raced::Abandoned => return abandon(live, shared, call, edge, reply),
        Raced::Finished(Err(_elapsed)) => timed_out(),
        // A turn that ends at or after its deadline may finish before its caller's timer
        // is handled: it must not commit what the caller will never see acknowledged.
        // A turn that never waited ran straight after the deadline check at dequeue, so
        // only one that waited reads the clock again.
        Raced::Finished(Ok(_)) if waited && deadline.has_passed(shared.clock.now()) => timed_out(),
        #[cfg(feature = "planted-bugs")]
        Raced::Finished(Ok(Err(error))) if shared.planted_commit_failed_turn => {
            shared.emit(|| RuntimeEvent::TurnCommitting {
                actor: live.id.clone(),
                request: call,
            });
            let _ = commit(live, shared.store.as_ref(), turn).await;
            Err(actor_error(&live.id, error))
        }
        Raced::Finished(Ok(Err(error))) => Err(actor_error(&live.id, error)),
        // The commit decision: only while the caller still waits.
        Raced::Finished(Ok(Ok(_))) if watch_caller && reply.is_closed() => {
            return abandon(live, shared, call, edge, reply)
        }
        Raced::Finished(Ok(Ok(answer))) => {
            shared.emit(|| RuntimeEvent::TurnCommitting {
                actor: live.id.clone(),
                request: call,
            });
            commit(live, shared.store.as_ref(), turn).await.map(|()| answer)
        }
    };
    if result.is_err() {
        Counters::add(&shared.counters.turns_failed);
        live.roll_back(shared);
    }
    respond(shared, call, edge, reply, result);
}

/// Rolls back a turn whose caller stopped waiting; it commits nothing.
fn abandon(live: &mut Live, shared: &Shared, call: CallId, edge: bool, reply: ReplyTo) {
    Counters::add(&shared.counters.turns_abandoned);
    live.roll_back(shared);
    shared.emit(|| RuntimeEvent::TurnAbandoned {
        actor: live.id.clone(),
        request: call,
    });
    let error = InvokeError::Cancelled {
        target: live.id.clone(),
    };
    respond(shared, call, edge, reply, Err(error));
}

/// Commits the turn's state change and writes atomically under the activation's fence;
/// skips the store when nothing changed. A refusal for a newer claim marks the
/// activation fenced: `run_turn` then answers every later request with it, unrun.
async fn commit(live: &mut Live, store: &dyn StateStore, turn: Turn) -> Result<(), InvokeError> {
    let snapshot = live.actor.snapshot().map_err(|error| actor_error(&live.id, error))?;
    let commit = TurnCommit {
        state: StateChange::between(live.committed.as_ref(), snapshot),
        writes: turn.into_writes(),
    };
    if commit.is_empty() {
        return Ok(());
    }
    let committed = commit.state.applied_to(live.committed.clone());
    match store.commit(&live.id, live.fence, commit).await {
        Ok(()) => {
            live.committed = committed;
            Ok(())
        }
        Err(source) => {
            // Fenced: another activation claimed the actor since. NotOwner: a cluster
            // node lost the actor's placement (its lease). Either way this one is stale.
            if matches!(source, StoreError::Fenced { .. } | StoreError::NotOwner { .. }) {
                live.fenced = Some(Box::new(source.clone()));
            }
            Err(InvokeError::StorageFailed {
                target: live.id.clone(),
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
