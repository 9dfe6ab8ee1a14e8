//! The wake-ups that resolve an agent's overdue delegated tasks at their due time
//! (`task_due/` keys; see `inbox.rs`, "Ended and overdue tasks"), with nothing else sent
//! to the agent: one timer task per agent in the process, which tells the agent
//! [`AgentCommand::ResolveOverdue`] when it fires; the agent's turn resolves what is due
//! (`resolve_overdue_tasks`) and arms the next due time it finds.
//!
//! Two ways to arm one:
//!
//! ```text
//! from a turn of the agent here       arm_overdue_wake    fires at the due time; wakes
//!   (a delegation; each activation's                      the agent (through the cluster
//!   first command, which scans the                        router on a cluster node)
//!   index: so the node that runs the
//!   agent arms it)
//! from the store, by a cluster node   watch_overdue_wake  fires AGENT_OVERDUE_TAKEOVER_DELAY_MS
//!   that may not run the agent                            later; reads the agent's earliest
//!   (`AgentClient::arm_overdue_wakes`                     `task_due/` key again: gone or
//!   at `attach`, in each resume                           not due → sends nothing (re-arms
//!   sweep round)                                          for a later key); still due →
//!                                                         wakes the agent through the router
//! ```
//!
//! In a single process (no router) the store's keys are read at `attach` only and armed
//! as a turn arms them: there is no other process to leave the task to.
//!
//! Guarantees: an agent whose due key is reached is woken by the process that runs its
//! turns at that time, and, on a cluster, by a sweeping node at most the takeover delay
//! (plus a sweep period, for a task delegated after that node's last round) later if
//! that process died. A node that does not run the agent sends nothing while the agent's
//! own node resolves its tasks in time. Wake-ups are never sent to a local activation
//! that another node's placement would refuse: on a cluster node they go through the
//! root call router, to the agent's owner, or here if it has none. A duplicate wake-up
//! is harmless (a turn that finds nothing due); resolving a task is idempotent (its
//! record is final after the first).
//!
//! Not done: nothing is persisted (the keys are the truth; a new process reads them);
//! without a resume sweep, a cluster node learns of another node's open tasks only at
//! its start.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError};

use troupe_core::{ActorId, Deadline, InvokeError, StoreError};
use troupe_runtime::{RuntimeHandle, StateStore};

use crate::agent::AgentShared;
use crate::inbox::{AgentCommand, TASK_DUE_INDEX};
use crate::inbox_turns::{wake_later, WAKE_TIMEOUT};
use crate::limits::AGENT_OVERDUE_TAKEOVER_DELAY_MS;

/// Arms agent `id`'s wake-up for `due_us` (microseconds on the runtime's clock), the
/// time a `task_due/` key of its is due, from a turn of the agent in this process (or
/// from the store in a process with no other node): at that time a task of this process
/// tells it [`AgentCommand::ResolveOverdue`], which activates it if need be, and its turn
/// resolves the overdue tasks (`resolve_overdue_tasks`) and arms the next due time it
/// found. Without it an overdue task was resolved only when something else reached its
/// delegator. One timer per agent in this process ([`AgentShared`]'s `overdue_wakes`):
/// an earlier due moves it earlier, a later one (or `u64::MAX`, none) changes nothing; a
/// watch armed before ([`watch_overdue_wake`]) becomes a turn's wake-up. A wake-up for a
/// key deleted meanwhile, or armed by a turn that was rolled back, is a turn that finds
/// nothing due (and arms the due it finds). The task holds the system weakly: a dropped
/// system's timer ends when it fires, telling nothing.
pub(crate) fn arm_overdue_wake(shared: &Arc<AgentShared>, id: &ActorId, due_us: u64) {
    arm(shared, id, due_us, Arming::Turn);
}

/// Arms agent `id`'s wake-up as a watch, on a cluster node that read the agent's
/// earliest `task_due/` key (due at `due_us`) from the store and may not run the agent:
/// it fires [`AGENT_OVERDUE_TAKEOVER_DELAY_MS`] after `due_us`, reads that key again and
/// wakes the agent only if a key is still due then (see the module doc). A wake-up a
/// turn armed here is left as it is (it fires first, and this process runs the agent);
/// an earlier watch moves a later one earlier.
pub(crate) fn watch_overdue_wake(shared: &Arc<AgentShared>, id: &ActorId, due_us: u64) {
    if due_us == OverdueWake::DISARMED {
        return;
    }
    let fire_us = due_us.saturating_add(AGENT_OVERDUE_TAKEOVER_DELAY_MS * 1_000);
    arm(shared, id, fire_us, Arming::Watch);
}

/// Drops agent `id`'s armed wake-up (its timer ends): it has no open task left. A turn
/// that did it and was rolled back leaves its open tasks to the next activation, whose
/// first turn scans them again and arms the wake-up anew.
pub(crate) fn disarm_overdue_wake(shared: &AgentShared, id: &ActorId) {
    let mut wakes = shared.overdue_wakes.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(armed) = wakes.remove(id) {
        armed.due_us.store(OverdueWake::DISARMED, Ordering::Relaxed);
        armed.changed.notify_one();
    }
}

/// Agent `id`'s earliest `task_due/` time (microseconds), read from `store` (the
/// runtime's, or one that tries it again while unavailable: `store_wait.rs`); `None`
/// when it has no open delegated task (or its key does not parse: logged).
///
/// # Errors
/// [`StoreError`] if the read fails.
pub(crate) async fn earliest_task_due(store: &dyn StateStore, id: &ActorId) -> Result<Option<u64>, StoreError> {
    let first = store.scan(id, TASK_DUE_INDEX.prefix, None, 1).await?;
    let Some((key, _)) = first.first() else {
        return Ok(None);
    };
    match TASK_DUE_INDEX.parse(key) {
        Ok((due_us, _)) => Ok(Some(due_us)),
        Err(error) => {
            tracing::warn!(agent = %id, %error, "an open task's key does not parse");
            Ok(None)
        }
    }
}

/// Who armed a wake-up, which decides what it does when it fires.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Arming {
    /// A turn of the agent here: wake the agent at the time.
    Turn,
    /// A read of the store on a cluster node: look again, then wake it only if due.
    Watch,
}

/// An agent's armed wake-up (see [`arm_overdue_wake`]), shared by its timer task and
/// the map of armed wake-ups; changed only under that map's lock.
pub(crate) struct OverdueWake {
    /// When the timer fires (microseconds), or [`Self::DISARMED`].
    pub(crate) due_us: AtomicU64,
    /// Whether it was armed as a watch ([`watch_overdue_wake`]) and not by a turn since.
    watch: AtomicBool,
    /// Told when `due_us` changes (earlier, or disarmed): wakes the timer, in order
    /// (not a `watch`: see `clippy.toml`).
    changed: tokio::sync::Notify,
}

impl OverdueWake {
    /// The `due_us` of a wake-up that no longer fires: its timer ends.
    const DISARMED: u64 = u64::MAX;
}

/// Arms `id`'s wake-up to fire at `fire_us`, as `arming` says (see the callers).
fn arm(shared: &Arc<AgentShared>, id: &ActorId, fire_us: u64, arming: Arming) {
    if fire_us == OverdueWake::DISARMED {
        return;
    }
    let Some(runtime) = shared.runtime() else {
        return;
    };
    let watch = arming == Arming::Watch;
    let mut wakes = shared.overdue_wakes.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(armed) = wakes.get(id) {
        let armed_watch = armed.watch.load(Ordering::Relaxed);
        if watch && !armed_watch {
            return; // a turn's wake-up here: it wakes the agent first
        }
        if !watch {
            armed.watch.store(false, Ordering::Relaxed);
        }
        if fire_us < armed.due_us.load(Ordering::Relaxed) {
            armed.due_us.store(fire_us, Ordering::Relaxed);
            armed.changed.notify_one();
        }
        return;
    }
    let wake = Arc::new(OverdueWake {
        due_us: AtomicU64::new(fire_us),
        watch: AtomicBool::new(watch),
        changed: tokio::sync::Notify::new(),
    });
    wakes.insert(id.clone(), Arc::clone(&wake));
    drop(wakes);
    let clock = runtime.clock();
    drop(runtime);
    let system = Arc::downgrade(shared);
    let id = id.clone();
    tokio::spawn(async move {
        loop {
            // Before the read: a change made after it leaves a permit, so it is not missed.
            let changed = wake.changed.notified();
            let due_us = wake.due_us.load(Ordering::Relaxed);
            if due_us == OverdueWake::DISARMED {
                return;
            }
            let at = clock.instant_of(Deadline::from_micros(due_us));
            // Biased, as every `select!` here (a random order would differ between seeds'
            // replays); a change first, so a disarm that came with the due time is seen.
            tokio::select! {
                biased;
                () = changed => {}
                () = tokio::time::sleep_until(at) => break,
            }
        }
        let Some(shared) = system.upgrade() else {
            return;
        };
        let watch = {
            let mut wakes = shared.overdue_wakes.lock().unwrap_or_else(PoisonError::into_inner);
            if wake.due_us.load(Ordering::Relaxed) == OverdueWake::DISARMED {
                return; // disarmed as it fired: the entry, if any, is another timer's
            }
            // Out before the tell: a due armed from now on gets a timer of its own.
            wakes.remove(&id);
            wake.watch.load(Ordering::Relaxed)
        };
        let Some(runtime) = shared.runtime() else {
            return;
        };
        if watch && !still_due(&shared, &runtime, &id).await {
            return;
        }
        wake_to_resolve(&shared, &runtime, id).await;
    });
}

/// A watch's look at the store when it fires: whether agent `id` has a `task_due/` key
/// due now. A later one is watched again; none ends the watch. A failed read is logged
/// and ends it (a resume sweep's next round reads it again).
async fn still_due(shared: &Arc<AgentShared>, runtime: &RuntimeHandle, id: &ActorId) -> bool {
    // Not tried again while the store is unavailable: a failed read ends the watch, and
    // the resume sweep's next round reads it again (`arm_overdue_wakes`).
    match earliest_task_due(runtime.store().as_ref(), id).await {
        Ok(Some(due_us)) if due_us > runtime.now().as_micros() => {
            watch_overdue_wake(shared, id, due_us);
            false
        }
        Ok(Some(_)) => true,
        Ok(None) => false,
        Err(error) => {
            tracing::warn!(agent = %id, %error, "reading an agent's open tasks for its overdue wake-up failed");
            false
        }
    }
}

/// Tells agent `id` [`AgentCommand::ResolveOverdue`]. On a cluster node (a root call
/// router installed) through the router, so it reaches the node that runs the agent, or
/// claims it here if none does; a local tell there would start an activation that the
/// owner's placement refuses (`NotOwner`, unseen: a tell's refusal at activation goes to
/// nobody). In a single process a tell, tried again later if the mailbox is full.
async fn wake_to_resolve(shared: &AgentShared, runtime: &RuntimeHandle, id: ActorId) {
    let wake = AgentCommand::ResolveOverdue.encode();
    if !runtime.has_root_call_router() {
        match runtime.tell(&id, wake.clone(), runtime.deadline_in(WAKE_TIMEOUT)).await {
            Ok(()) => {}
            Err(InvokeError::Busy { .. }) => wake_later(shared, id, wake),
            Err(error) => {
                tracing::warn!(agent = %id, %error, "could not wake an agent to resolve its overdue tasks; its next turn will");
            }
        }
        return;
    }
    match runtime.invoke_routed_within(&id, wake, WAKE_TIMEOUT).await {
        Ok(_) => {}
        // Its mailbox is full: each command queued there resolves the overdue tasks
        // before it runs.
        Err(InvokeError::Busy { .. }) => {}
        // Its node died and its lease has not ended yet, or could not be reached: a
        // resume sweep's next round watches the key again.
        Err(error @ (InvokeError::Unreachable { .. } | InvokeError::Timeout { .. })) => {
            tracing::info!(agent = %id, %error, "could not reach an agent to resolve its overdue tasks; the next resume sweep or its next turn will");
        }
        Err(error) => {
            tracing::warn!(agent = %id, %error, "could not wake an agent to resolve its overdue tasks; its next turn will");
        }
    }
}
