//! A resume sweep: [`AgentClient::resume_pending`], `AgentClient::arm_overdue_wakes`
//! and [`AgentClient::resume_conversations`] run again every period, for as long as the
//! [`ResumeSweep`] is kept.
//!
//! Why: on a cluster, an agent with pending inbox or outbox entries whose node died is
//! resumed by the next node that activates it, and an activation starts only on a
//! request or at a node's start (`attach` resumes what is free). A delegatee whose node
//! died after it acknowledged a task, with no later request to it and no node starting,
//! kept the task unresolved. A sweep on every living node finds such an agent once the
//! dead node's lease has ended (before that the agent is still placed there, and the
//! sweep leaves it alone), claims it and lets its activation process the entries.
//! Resuming is idempotent, so a sweep that meets an agent already at work changes
//! nothing.
//!
//! An agent (or conversation) with pending entries that another node owns is not woken
//! here: on a cluster node `resume_pending` and `resume_conversations` first ask where
//! it is placed (`RuntimeHandle::placed_elsewhere`, an etcd read through the node's
//! router, never its route cache, which may name a dead owner). Its owner's activation
//! processes its entries; if that owner dies, its lease ends, its placement goes with
//! it, and the next round wakes the agent here, which claims it. Waking it locally
//! anyway, as before, started an activation whose claim the placement refused
//! `NotOwner` (an etcd transaction and a failed activation per such agent per node per
//! round, seen by nobody); routing the wake-up to the owner instead would send it a
//! redundant `Resume` from every node every round. When the lookup fails (etcd does not
//! answer) the agent is skipped for the round, logged at debug, rather than claimed
//! blindly: the next round looks again.
//!
//! Each round also arms, for every agent with an open delegated task, the wake-up that
//! resolves it once overdue (`AgentClient::arm_overdue_wakes`; on a cluster node a watch
//! that wakes the agent only if its own node has not resolved the task shortly after its
//! due time: `overdue_wake.rs`). Without it, a task delegated after a node's start by an
//! agent whose node then died stayed `submitted` past its due time until something
//! reached the agent: the wake-up its delegation armed died with its node, and the
//! other nodes had read the open tasks only at their start.
//!
//! Cost: each round reads three keys per agent of the directory and, for the
//! conversations, one page of the index per `CONVERSATIONS_LISTED_MAX` conversations and
//! one key each; on a cluster node, one etcd read more per agent and per conversation
//! that has pending entries (none for the others), and a local activation only for one
//! placed here or nowhere. A single process does not need a sweep: `attach` and each
//! activation resume and arm (with no router installed nothing is looked up).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::limits::{AGENT_RESUME_SWEEP_MS_MAX, AGENT_RESUME_SWEEP_MS_MIN};
use crate::AgentClient;

/// Why a resume sweep was not started.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResumeSweepError {
    /// The period is outside [`AGENT_RESUME_SWEEP_MS_MIN`]..=[`AGENT_RESUME_SWEEP_MS_MAX`].
    #[error("a resume sweep's period must be {min_ms}..={max_ms} ms, got {every_ms} ms")]
    PeriodOutOfRange {
        /// The period asked for, in whole milliseconds.
        every_ms: u64,
        /// [`AGENT_RESUME_SWEEP_MS_MIN`].
        min_ms: u64,
        /// [`AGENT_RESUME_SWEEP_MS_MAX`].
        max_ms: u64,
    },
}

/// A running resume sweep (see the module doc); dropping it stops the sweep.
#[derive(Debug)]
pub struct ResumeSweep {
    task: tokio::task::JoinHandle<()>,
    rounds: Arc<AtomicU64>,
}

impl ResumeSweep {
    /// Rounds completed so far (each ran both resumes and armed the overdue wake-ups,
    /// whatever they found).
    pub fn rounds(&self) -> u64 {
        self.rounds.load(Ordering::Relaxed)
    }

    /// Stops the sweep; a round under way is dropped where it waits (a wake-up already
    /// sent stays sent).
    pub fn stop(self) {}
}

impl Drop for ResumeSweep {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl AgentClient {
    /// Runs [`AgentClient::resume_pending`], `arm_overdue_wakes` and
    /// [`AgentClient::resume_conversations`] every `every`, the first time `every` from
    /// now (`attach` has just run them), on
    /// the current runtime, until the returned [`ResumeSweep`] is dropped. A round that
    /// fails (the store) is logged and the next one runs on time. Meant for cluster
    /// nodes (module doc of `resume_sweep.rs`); `troupe node` runs one every
    /// [`crate::limits::AGENT_RESUME_SWEEP_MS_DEFAULT`].
    ///
    /// # Errors
    /// [`ResumeSweepError::PeriodOutOfRange`] if `every` is under
    /// [`AGENT_RESUME_SWEEP_MS_MIN`] or over [`AGENT_RESUME_SWEEP_MS_MAX`]; nothing is
    /// started.
    ///
    /// # Panics
    /// Outside a tokio (or madsim) runtime.
    pub fn start_resume_sweep(&self, every: Duration) -> Result<ResumeSweep, ResumeSweepError> {
        let every_ms = u64::try_from(every.as_millis()).unwrap_or(u64::MAX);
        let whole = Duration::from_millis(every_ms) == every;
        if !whole || !(AGENT_RESUME_SWEEP_MS_MIN..=AGENT_RESUME_SWEEP_MS_MAX).contains(&every_ms) {
            return Err(ResumeSweepError::PeriodOutOfRange {
                every_ms,
                min_ms: AGENT_RESUME_SWEEP_MS_MIN,
                max_ms: AGENT_RESUME_SWEEP_MS_MAX,
            });
        }
        let rounds = Arc::new(AtomicU64::new(0));
        let client = self.clone();
        let counted = Arc::clone(&rounds);
        let task = tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                match client.resume_pending().await {
                    Ok(woken) if woken > 0 => tracing::debug!(woken, "resume sweep: agents with pending entries"),
                    Ok(_) => {}
                    Err(error) => tracing::warn!(%error, "resume sweep: reading pending entries failed"),
                }
                match client.arm_overdue_wakes().await {
                    Ok(_) => {}
                    Err(error) => tracing::warn!(%error, "resume sweep: reading open delegated tasks failed"),
                }
                match client.resume_conversations().await {
                    Ok(woken) if woken > 0 => {
                        tracing::debug!(woken, "resume sweep: conversations with pending relays");
                    }
                    Ok(_) => {}
                    Err(error) => tracing::warn!(%error, "resume sweep: reading pending relays failed"),
                }
                counted.fetch_add(1, Ordering::Relaxed);
            }
        });
        Ok(ResumeSweep { task, rounds })
    }
}
