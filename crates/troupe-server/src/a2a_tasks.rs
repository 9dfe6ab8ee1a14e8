//! The A2A tasks the server holds: one record per `SendMessage`, in memory, with its
//! state in Troupe's task states (which are A2A's), the message that started it, and
//! the agent's reply or the reason it ended otherwise.
//!
//! Each agent has a lane: its A2A tasks run one at a time, in the order they came
//! (the agent takes one turn at a time anyway). A task waits in its lane as
//! `submitted`, and can be canceled until it starts; once `working`, its turn runs to
//! its end (Troupe does not stop a running turn). Watchers see every change through a
//! `watch` channel per task.
//!
//! Tasks are not persisted: they do not survive a restart of the server.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::Value;
use tokio::sync::watch;
use troupe_agent::TaskState;

use crate::limits::{A2A_TASKS_KEPT_MAX, A2A_TASKS_WAITING_PER_AGENT_MAX};

/// One A2A task as the server knows it.
#[derive(Debug, Clone)]
pub(crate) struct TaskRecord {
    /// `{agent}-task-{n}`.
    pub(crate) id: String,
    /// Creation order, across every agent; the `ListTasks` page token.
    pub(crate) seq: u64,
    /// The agent doing it.
    pub(crate) agent: String,
    /// The A2A context id: the client's, or `{agent}-context-{n}`.
    pub(crate) context_id: String,
    /// Its state.
    pub(crate) state: TaskState,
    /// The message that started it, as A2A JSON (with `taskId` and `contextId` set).
    pub(crate) request: Value,
    /// The agent's reply text, once completed.
    pub(crate) reply: Option<String>,
    /// The reply's steps and token usage, once completed.
    pub(crate) reply_meta: Option<Value>,
    /// Why it failed, was rejected or canceled.
    pub(crate) reason: Option<String>,
    /// The chain and depth it arrived with (Troupe's call rules).
    pub(crate) chain: Vec<String>,
    /// See `chain`.
    pub(crate) depth: u32,
    /// How long its agent's turn may take, in milliseconds: the caller's remaining
    /// time when the message carried Troupe's context, clipped to the server's maximum.
    pub(crate) timeout_ms: u64,
    /// Whether the failure was the agent being busy: a blocking send answers it as a
    /// retryable error.
    pub(crate) busy: bool,
}

/// Where a new task's call stands: Troupe's chain and depth it arrived with, and how
/// long its turn may take, in milliseconds.
#[derive(Debug)]
pub(crate) struct TaskCall {
    pub(crate) chain: Vec<String>,
    pub(crate) depth: u32,
    pub(crate) timeout_ms: u64,
}

/// Why a task could not be made.
#[derive(Debug)]
pub(crate) enum AdmitError {
    /// The agent's lane is full.
    LaneFull,
    /// Every kept task is still running.
    Full,
}

/// What a cancel found.
#[derive(Debug)]
pub(crate) enum CancelOutcome {
    /// It was waiting and is now canceled.
    Canceled(TaskRecord),
    /// It is running or has ended: it cannot be canceled.
    NotCancelable(TaskRecord),
    /// No such task for this agent.
    NotFound,
}

/// One agent's lane.
#[derive(Debug, Default)]
pub(crate) struct Lane {
    /// Held while one of the agent's A2A tasks runs.
    pub(crate) turn: tokio::sync::Mutex<()>,
    /// Tasks submitted and not yet started.
    pub(crate) waiting: AtomicUsize,
}

#[derive(Default)]
struct Inner {
    tasks: HashMap<String, watch::Sender<TaskRecord>>,
    /// Task ids, oldest first.
    order: VecDeque<String>,
    lanes: HashMap<String, Arc<Lane>>,
    next: u64,
}

/// Every A2A task of the server.
#[derive(Default)]
pub(crate) struct TaskRegistry {
    inner: Mutex<Inner>,
}

impl TaskRegistry {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain data behind: keep going.
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A new task for `agent`, `submitted` if `queued` (it takes a place in the
    /// agent's lane, returned) or else in `state` at once (e.g. `rejected`).
    pub(crate) fn create(
        &self,
        agent: &str,
        context_id: Option<String>,
        mut request: Value,
        call: TaskCall,
        rejected: Option<String>,
    ) -> Result<(TaskRecord, Option<Arc<Lane>>), AdmitError> {
        let TaskCall {
            chain,
            depth,
            timeout_ms,
        } = call;
        let mut inner = self.lock();
        let lane = if rejected.is_none() {
            let lane = Arc::clone(inner.lanes.entry(agent.to_string()).or_default());
            if lane.waiting.load(Ordering::SeqCst) >= A2A_TASKS_WAITING_PER_AGENT_MAX {
                return Err(AdmitError::LaneFull);
            }
            Some(lane)
        } else {
            None
        };
        if inner.tasks.len() >= A2A_TASKS_KEPT_MAX && !inner.forget_oldest_ended() {
            return Err(AdmitError::Full);
        }
        let seq = inner.next;
        inner.next += 1;
        let id = format!("{agent}-task-{seq}");
        let context_id = context_id.unwrap_or_else(|| format!("{agent}-context-{seq}"));
        request["taskId"] = Value::String(id.clone());
        request["contextId"] = Value::String(context_id.clone());
        let record = TaskRecord {
            id: id.clone(),
            seq,
            agent: agent.to_string(),
            context_id,
            state: if rejected.is_some() {
                TaskState::Rejected
            } else {
                TaskState::Submitted
            },
            request,
            reply: None,
            reply_meta: None,
            reason: rejected,
            chain,
            depth,
            timeout_ms,
            busy: false,
        };
        if let Some(lane) = &lane {
            lane.waiting.fetch_add(1, Ordering::SeqCst);
        }
        inner.tasks.insert(id.clone(), watch::channel(record.clone()).0);
        inner.order.push_back(id);
        Ok((record, lane))
    }

    /// A watcher of task `id` of `agent`.
    pub(crate) fn watch(&self, agent: &str, id: &str) -> Option<watch::Receiver<TaskRecord>> {
        let inner = self.lock();
        let sender = inner.tasks.get(id)?;
        let same_agent = sender.borrow().agent == agent;
        same_agent.then(|| sender.subscribe())
    }

    /// Task `id` of `agent`, as it is now.
    pub(crate) fn get(&self, agent: &str, id: &str) -> Option<TaskRecord> {
        self.watch(agent, id).map(|receiver| receiver.borrow().clone())
    }

    /// Changes task `id` with `change`, which returns whether it changed anything.
    pub(crate) fn update(&self, id: &str, change: impl FnOnce(&mut TaskRecord) -> bool) -> Option<TaskRecord> {
        let inner = self.lock();
        let sender = inner.tasks.get(id)?;
        sender.send_if_modified(change);
        let record = sender.borrow().clone();
        Some(record)
    }

    /// Cancels task `id` of `agent` if it has not started.
    pub(crate) fn cancel(&self, agent: &str, id: &str) -> CancelOutcome {
        if self.get(agent, id).is_none() {
            return CancelOutcome::NotFound;
        }
        let mut canceled = false;
        let record = self.update(id, |task| {
            if task.state == TaskState::Submitted {
                task.state = TaskState::Canceled;
                task.reason = Some("canceled by the client before it started".to_string());
                canceled = true;
            }
            canceled
        });
        match record {
            Some(record) if canceled => CancelOutcome::Canceled(record),
            Some(record) => CancelOutcome::NotCancelable(record),
            None => CancelOutcome::NotFound,
        }
    }

    /// The tasks of `agent`, newest first, that `keep` keeps.
    pub(crate) fn list(&self, agent: &str, keep: impl Fn(&TaskRecord) -> bool) -> Vec<TaskRecord> {
        let inner = self.lock();
        inner
            .order
            .iter()
            .rev()
            .filter_map(|id| inner.tasks.get(id))
            .map(|sender| sender.borrow().clone())
            .filter(|task| task.agent == agent && keep(task))
            .collect()
    }
}

impl Inner {
    /// Forgets the oldest task that has ended; false if none has.
    fn forget_oldest_ended(&mut self) -> bool {
        let tasks = &self.tasks;
        let Some(position) = self
            .order
            .iter()
            .position(|id| tasks.get(id).is_none_or(|sender| sender.borrow().state.is_final()))
        else {
            return false;
        };
        if let Some(id) = self.order.remove(position) {
            self.tasks.remove(&id);
        }
        true
    }
}
