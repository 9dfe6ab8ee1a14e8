//! External tasks: Troupe tasks handed to an agent from outside the system (an A2A
//! client of `troupe serve`), with no delegating agent.
//!
//! The task goes through the receiver's durable inbox like a delegation: the append
//! commits, in the receiver's key space and in one turn,
//!
//! ```text
//! ext/{seq:020}       the task's record (ExternalTask): state, result, origin, attachment
//! ext_id/{task_id}    → seq (task ids are `{agent}-task-{seq}`, unique for good)
//! inbox/{seq:020}     the task to run (a `Task` with no delegator)
//! tasks_in/{task_id}  → seq, while it has not started (for cancel)
//! seen/{msg_id}       → task id: a resent task (same caller-given id) is stored once
//! ```
//!
//! and the task runs in its own turn, once, as every inbox entry does (a restart resumes
//! it: the entry stays in the inbox until the turn that runs it commits). That turn
//! commits the outcome into `ext/{seq}` instead of sending it to a delegator. `working`
//! is not stored: the record reads `working` while its turn runs in this process.
//!
//! Cancel: a task not yet started is dropped from the inbox and recorded `canceled`. The
//! cancel command waits in the agent's mailbox like any message; so that a task whose
//! processing is queued ahead of it does not start meanwhile, the client first marks it
//! in memory, and the processing turn that finds the mark commits `canceled` instead of
//! running it. A running turn is never stopped.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use troupe_core::{ActorId, CallContext, Deadline, InvokeError};
use troupe_runtime::{ActorError, StateStore, StoreError, Turn};

use crate::agent::{agent_id, AgentActor, AgentShared};
use crate::inbox::{
    decode_reply, encode_reply, from_json, inbox_key, seen_key, task_deadline, tasks_in_key, to_json, AgentCommand,
    EnqueueReply, InboxBody, InboxEntry, InboxError, SendReply, TaskState,
};
use crate::limits::{
    AGENT_DELIVERY_ACK_TIMEOUT_MS, AGENT_EXTERNAL_TASKS_OPEN_MAX, AGENT_EXTERNAL_TASKS_PAGE_MAX, AGENT_INBOX_CAPACITY,
    AGENT_MESSAGE_SIZE_MAX_BYTES,
};
use crate::remote::ChainFault;
use crate::{AgentClient, AgentEvent, Budget, TokenUsage};

/// The result of a task canceled before it started.
pub(crate) const CANCELED_BEFORE_START: &str = "canceled before it started";

/// What an outside caller hands an agent ([`AgentClient::delegate_external`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExternalTaskRequest {
    /// Who sent it (e.g. `a2a`): recorded, not interpreted.
    pub origin: String,
    /// The caller's id for this message: resending the same id returns the first
    /// task's id and stores nothing new. Empty: no deduplication.
    pub msg_id: String,
    /// The task.
    pub text: String,
    /// Its deadline, in milliseconds from now (default and cap as for delegations:
    /// [`crate::limits::AGENT_TASK_TIMEOUT_MS_DEFAULT`], `..._MAX`).
    pub timeout_ms: Option<u64>,
    /// The call chain it arrives through (agent ids; empty: from outside).
    pub chain: Vec<String>,
    /// The depth it arrives at (0: from outside): at least the chain's length.
    pub depth: u32,
    /// Opaque data of the caller, stored with the task and returned as is.
    pub attachment: String,
    /// Record it as `rejected` at once with this reason (nothing runs).
    pub rejected: Option<String>,
    /// The trace id of the request it belongs to: its turn (and every call it makes)
    /// runs under it. None: no trace id.
    pub trace_id: Option<troupe_core::TraceId>,
}

/// The reply's steps and token usage, for a completed task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExternalReply {
    /// Model steps of the task's turn.
    pub steps: u32,
    /// Tokens the turn used.
    pub usage: TokenUsage,
    /// Whether the reply was cut to fit.
    pub truncated: bool,
}

/// An agent's committed record of an external task (`ext/{seq}` in its key space).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExternalTask {
    /// `{agent}-task-{seq}`.
    pub task_id: String,
    /// The agent's inbox seq at its arrival: arrival order, unique for good.
    pub seq: u64,
    /// The agent doing it.
    pub agent: String,
    /// [`ExternalTaskRequest::origin`].
    pub origin: String,
    /// Its state (`working` only while its turn runs in this process).
    pub state: TaskState,
    /// The agent's answer (completed) or the reason (failed, canceled, rejected).
    pub result: Option<String>,
    /// The reply's steps and usage, when completed.
    pub reply: Option<ExternalReply>,
    /// When it must be done.
    pub deadline: Deadline,
    /// [`ExternalTaskRequest::chain`].
    pub chain: Vec<String>,
    /// [`ExternalTaskRequest::depth`].
    pub depth: u32,
    /// [`ExternalTaskRequest::attachment`].
    pub attachment: String,
    /// The message id it arrived with ([`ExternalTaskRequest::msg_id`], or the one it
    /// was given), whose dedupe mark is deleted with it when it is forgotten. Empty in
    /// records written before it was kept.
    #[serde(default)]
    pub msg_id: String,
}

/// What [`AgentClient::forget_external`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExternalForget {
    /// It had ended: its record and its dedupe mark are deleted (committed).
    Forgotten,
    /// It has not ended: nothing was deleted.
    NotEnded,
}

/// What [`AgentClient::cancel_external`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExternalCancel {
    /// It had not started: it is now canceled (committed).
    Canceled(ExternalTask),
    /// Its turn runs: it cannot be canceled.
    Running(ExternalTask),
    /// It had already ended.
    Ended(ExternalTask),
}

pub(crate) fn ext_key(seq: u64) -> String {
    crate::agent::seq_key("ext/", seq)
}

pub(crate) fn ext_id_key(task_id: &str) -> String {
    format!("ext_id/{task_id}")
}

/// Marks an external task as running in this process while it lives.
pub(crate) struct Running {
    shared: Arc<AgentShared>,
    task_id: String,
}

impl Drop for Running {
    fn drop(&mut self) {
        lock(&self.shared.external_running).remove(&self.task_id);
    }
}

fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl AgentActor {
    /// Appends an external task: its record, its index and (unless rejected) its inbox
    /// entry; replies `Accepted` with the task id, or `Full`.
    pub(crate) async fn enqueue_external(&mut self, turn: &mut Turn, entry: InboxEntry) -> Result<Bytes, ActorError> {
        let InboxBody::External {
            text,
            origin,
            attachment,
            rejected,
        } = entry.body.clone()
        else {
            return Err(ActorError::failed("not an external task"));
        };
        let boxes = self.state.boxes;
        if rejected.is_none() {
            if boxes.external_open >= AGENT_EXTERNAL_TASKS_OPEN_MAX {
                return Ok(encode_reply(&EnqueueReply::Full {
                    capacity: AGENT_EXTERNAL_TASKS_OPEN_MAX,
                }));
            }
            if boxes.inbox_len >= AGENT_INBOX_CAPACITY {
                return Ok(encode_reply(&EnqueueReply::Full {
                    capacity: AGENT_INBOX_CAPACITY,
                }));
            }
        }
        let seq = boxes.inbox_next;
        let task_id = format!("{}-task-{seq}", self.id.key());
        let record = ExternalTask {
            task_id: task_id.clone(),
            seq,
            agent: self.id.key().to_string(),
            origin,
            state: if rejected.is_some() {
                TaskState::Rejected
            } else {
                TaskState::Submitted
            },
            result: rejected.clone(),
            reply: None,
            deadline: entry.context.deadline(),
            chain: entry.context.chain().iter().map(|id| id.key().to_string()).collect(),
            depth: entry.context.depth(),
            attachment,
            msg_id: entry.msg_id.clone(),
        };
        turn.put(ext_key(seq), to_json(&record)?)?;
        turn.put(ext_id_key(&task_id), to_json(&seq)?)?;
        let seen = seen_key(&entry.msg_id);
        let seen_value = Bytes::from(task_id.clone());
        if rejected.is_some() {
            // Nothing to run; its seq is used up all the same (ids stay unique).
            self.state.boxes.inbox_next += 1;
            turn.put(seen, seen_value)?;
            self.shared.emit(&AgentEvent::MessageReceived {
                msg_id: entry.msg_id.clone(),
                agent: self.id.clone(),
                kind: entry.body.kind(),
                duplicate: false,
                at: turn.now(),
            });
        } else {
            self.state.boxes.external_open += 1;
            let task = InboxEntry {
                body: InboxBody::Task {
                    task_id: task_id.clone(),
                    text,
                },
                ..entry
            };
            self.append(turn, task, Some((seen, seen_value))).await?;
        }
        Ok(encode_reply(&EnqueueReply::Accepted { msg_id: task_id }))
    }

    /// Commits the outcome of external task `task_id` (no-op if it has no record or has
    /// ended already).
    pub(crate) async fn finish_external(
        &mut self,
        turn: &mut Turn,
        task_id: &str,
        state: TaskState,
        result: String,
        reply: Option<ExternalReply>,
    ) -> Result<(), ActorError> {
        let Some((key, mut record)) = external_record_in(turn, task_id).await? else {
            return Ok(());
        };
        if record.state.is_final() {
            return Ok(());
        }
        record.state = state;
        record.result = Some(troupe_core::truncate_utf8(&result, AGENT_MESSAGE_SIZE_MAX_BYTES).to_string());
        record.reply = reply;
        turn.put(key, to_json(&record)?)?;
        self.state.boxes.external_open = self.state.boxes.external_open.saturating_sub(1);
        Ok(())
    }

    /// Whether a caller asked to cancel external task `task_id` (the mark is taken).
    pub(crate) fn take_external_cancel(&self, task_id: &str) -> bool {
        lock(&self.shared.external_cancels).remove(task_id)
    }

    /// Marks external task `task_id` as running until the guard drops.
    pub(crate) fn external_started(&self, task_id: &str) -> Running {
        lock(&self.shared.external_running).insert(task_id.to_string());
        Running {
            shared: Arc::clone(&self.shared),
            task_id: task_id.to_string(),
        }
    }

    /// Cancels external task `task_id` if it has not started.
    pub(crate) async fn cancel_external(&mut self, turn: &mut Turn, task_id: &str) -> Result<Bytes, ActorError> {
        let Some((_, record)) = external_record_in(turn, task_id).await? else {
            return Ok(encode_reply(&SendReply::UnknownTask));
        };
        if record.state.is_final() {
            return Ok(encode_reply(&SendReply::AlreadyFinal(record.state)));
        }
        let waiting = tasks_in_key(task_id);
        let Some(bytes) = turn.get(&waiting).await? else {
            return Ok(encode_reply(&SendReply::Running));
        };
        let inbox_seq: u64 = from_json(&waiting, &bytes)?;
        turn.delete(inbox_key(inbox_seq))?;
        turn.delete(waiting)?;
        self.state.boxes.inbox_len = self.state.boxes.inbox_len.saturating_sub(1);
        self.take_external_cancel(task_id);
        self.finish_external(
            turn,
            task_id,
            TaskState::Canceled,
            CANCELED_BEFORE_START.to_string(),
            None,
        )
        .await?;
        Ok(encode_reply(&SendReply::CancelSent))
    }

    /// Forgets ended external task `task_id`: deletes its record, its index and its
    /// dedupe mark (so its message id sent again starts a new task). A task not ended
    /// is kept (`Running`).
    pub(crate) async fn forget_external(&mut self, turn: &mut Turn, task_id: &str) -> Result<Bytes, ActorError> {
        let Some((key, record)) = external_record_in(turn, task_id).await? else {
            return Ok(encode_reply(&SendReply::UnknownTask));
        };
        if !record.state.is_final() {
            return Ok(encode_reply(&SendReply::Running));
        }
        turn.delete(key)?;
        turn.delete(ext_id_key(task_id))?;
        if !record.msg_id.is_empty() {
            turn.delete(seen_key(&record.msg_id))?;
        }
        Ok(encode_reply(&SendReply::Forgotten))
    }
}

/// External task `task_id`'s record in this turn's view, with its key; `None` if it
/// has none.
async fn external_record_in(turn: &mut Turn, task_id: &str) -> Result<Option<(String, ExternalTask)>, ActorError> {
    let index = ext_id_key(task_id);
    let Some(bytes) = turn.get(&index).await? else {
        return Ok(None);
    };
    let seq: u64 = from_json(&index, &bytes)?;
    let key = ext_key(seq);
    let Some(bytes) = turn.get(&key).await? else {
        return Ok(None);
    };
    let record: ExternalTask = from_json(&key, &bytes)?;
    Ok(Some((key, record)))
}

/// The chain request `request` arrives through, as actor ids, once its `chain` and
/// `depth` pass the rules every arrival is checked by
/// ([`crate::remote::arrival_chain`], as [`crate::TroupeCallMetadata::check`] for a call
/// over A2A); an embedder's request reaches here with no A2A server in front.
///
/// # Errors
/// What is wrong and what to give instead.
fn arrival_chain(request: &ExternalTaskRequest) -> Result<Vec<ActorId>, String> {
    crate::remote::arrival_chain(&request.chain, request.depth).map_err(|fault| match fault {
        ChainFault::TooLong { entries, limit } => format!(
            "the request's chain has {entries} entries, more than the limit of {limit}: give the agents \
             whose turns wait on it, outermost first (none from outside)"
        ),
        ChainFault::NotAnAgent { id, cause } => {
            format!("the request's chain holds {id:?}, which is not an agent id: {cause}")
        }
        ChainFault::ShallowerThanChain { depth, entries } => format!(
            "the request's depth is {depth} but its chain has {entries} entries: a call is at least as deep as its \
             chain is long; give a depth of at least {entries} (0 with an empty chain from outside)"
        ),
    })
}

fn decode_error(cause: String) -> StoreError {
    StoreError::Backend {
        operation: troupe_runtime::StoreOperation::Decode,
        cause,
    }
}

impl AgentClient {
    /// Hands agent `to` a task from outside the system (no delegating agent): returns
    /// its id (`{to}-task-{seq}`) once the task is committed to `to`'s inbox, with its
    /// record. The agent works on it in a turn of its own, exactly once, also across
    /// restarts on the same store; the outcome is committed with that turn, where
    /// [`AgentClient::external_task`] reads it. Resending the same non-empty
    /// `msg_id` returns the first task's id and keeps nothing new.
    ///
    /// # Errors
    /// [`InboxError::Full`] (the inbox, or the agent's open external tasks
    /// ([`AGENT_EXTERNAL_TASKS_OPEN_MAX`]), are full: nothing kept, retry later),
    /// [`InboxError::Refused`] (`AgentNotFound`; `InvalidTimeout` for a `timeout_ms` of
    /// 0, nothing sent), [`InboxError::InvalidAgentId`],
    /// [`InboxError::MessageIdTooLong`] (nothing sent),
    /// [`InboxError::Invoke`] with [`InvokeError::Rejected`] (the request's `chain` and
    /// `depth` do not fit together, as [`crate::TroupeCallMetadata::check`] has them:
    /// nothing was kept; fix the request), [`InboxError::Invoke`] otherwise (timeout,
    /// storage, shutdown, a full mailbox: whether it was kept is unknown; retry with the
    /// same `msg_id`).
    pub async fn delegate_external(&self, to: &str, request: ExternalTaskRequest) -> Result<String, InboxError> {
        crate::inbox::check_message_id_length(&request.msg_id)?;
        crate::inbox::check_send_timeout(request.timeout_ms)?;
        let target = self.known_agent(to).await?;
        let chain = arrival_chain(&request).map_err(|reason| {
            InboxError::Invoke(InvokeError::Rejected {
                target: target.clone(),
                reason,
            })
        })?;
        let deadline = task_deadline(self.runtime.now(), request.timeout_ms);
        let mut context = if chain.is_empty() && request.depth == 0 {
            CallContext::root(deadline)
        } else {
            CallContext::continued(request.depth, chain, deadline)
        };
        if let Some(trace) = request.trace_id {
            context = context.with_trace_id(trace);
        }
        let entry = InboxEntry {
            msg_id: request.msg_id,
            from: None,
            body: InboxBody::External {
                text: troupe_core::truncate_utf8(&request.text, AGENT_MESSAGE_SIZE_MAX_BYTES).to_string(),
                origin: request.origin,
                attachment: request.attachment,
                rejected: request.rejected,
            },
            context,
            budget: Budget::UNLIMITED,
            pair: None,
        };
        // The agent may be in a long turn: the append waits for it.
        let ack = Duration::from_millis(AGENT_DELIVERY_ACK_TIMEOUT_MS);
        let reply = self
            .runtime
            .invoke_routed_within(&target, AgentCommand::Enqueue(entry).encode(), ack)
            .await?;
        match decode_reply::<EnqueueReply>(&reply)? {
            EnqueueReply::Accepted { msg_id } => Ok(msg_id),
            EnqueueReply::Full { capacity } => Err(InboxError::Full { target, capacity }),
            EnqueueReply::Duplicate => Err(InboxError::Malformed {
                cause: "an external task was acknowledged without its id".to_string(),
            }),
            EnqueueReply::OutOfOrder { .. } | EnqueueReply::Stale { .. } => Err(InboxError::Malformed {
                cause: "an external task, which has no sender order, was refused as out of order".to_string(),
            }),
        }
    }

    /// Agent `agent`'s record of external task `task_id`, as committed (`working` while
    /// its turn runs in this process). A store down for a moment is read again for up to
    /// [`crate::AGENT_API_STORE_WAIT_MS`] (both reads share one deadline).
    ///
    /// # Errors
    /// [`StoreError`] if the store fails or the record cannot be decoded.
    pub async fn external_task(&self, agent: &str, task_id: &str) -> Result<Option<ExternalTask>, StoreError> {
        let id = agent_id(agent).map_err(|error| decode_error(error.to_string()))?;
        let store = self.api_store();
        let Some(bytes) = store.get(&id, &ext_id_key(task_id)).await? else {
            return Ok(None);
        };
        let seq: u64 = serde_json::from_slice(&bytes).map_err(|error| decode_error(error.to_string()))?;
        let Some(bytes) = store.get(&id, &ext_key(seq)).await? else {
            return Ok(None);
        };
        self.external_record(&bytes).map(Some)
    }

    fn external_record(&self, bytes: &[u8]) -> Result<ExternalTask, StoreError> {
        let mut record: ExternalTask =
            serde_json::from_slice(bytes).map_err(|error| decode_error(format!("external task: {error}")))?;
        if record.state == TaskState::Submitted && lock(&self.shared.external_running).contains(&record.task_id) {
            record.state = TaskState::Working;
        }
        Ok(record)
    }

    /// Agent `agent`'s external tasks in arrival order, after seq `after` (from the
    /// first if `None`), at most `limit` (capped at [`AGENT_EXTERNAL_TASKS_PAGE_MAX`]). A
    /// store down for a moment is read again for up to
    /// [`crate::AGENT_API_STORE_WAIT_MS`].
    ///
    /// # Errors
    /// As [`AgentClient::external_task`].
    pub async fn external_tasks(
        &self,
        agent: &str,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<ExternalTask>, StoreError> {
        let id = agent_id(agent).map_err(|error| decode_error(error.to_string()))?;
        let after = after.map(ext_key);
        let page = self
            .api_store()
            .scan(&id, "ext/", after.as_deref(), limit.min(AGENT_EXTERNAL_TASKS_PAGE_MAX))
            .await?;
        page.iter().map(|(_, bytes)| self.external_record(bytes)).collect()
    }

    /// Cancels agent `agent`'s external task `task_id` if it has not started. A task
    /// whose turn runs now answers `Running` at once; otherwise this waits for the
    /// agent's mailbox (behind a running turn), and a task whose processing was queued
    /// ahead of the cancel is canceled by that processing instead of running.
    ///
    /// # Errors
    /// [`InboxError::UnknownTask`], [`InboxError::InvalidAgentId`],
    /// [`InboxError::Refused`], [`InboxError::Invoke`].
    pub async fn cancel_external(&self, agent: &str, task_id: &str) -> Result<ExternalCancel, InboxError> {
        let target = self.known_agent(agent).await?;
        let unknown = || InboxError::UnknownTask {
            agent: target.clone(),
            task_id: task_id.to_string(),
        };
        let read = |error: StoreError| InboxError::Malformed {
            cause: error.to_string(),
        };
        let record = self
            .external_task(agent, task_id)
            .await
            .map_err(read)?
            .ok_or_else(unknown)?;
        if record.state.is_final() {
            return Ok(ExternalCancel::Ended(record));
        }
        if record.state == TaskState::Working {
            return Ok(ExternalCancel::Running(record));
        }
        lock(&self.shared.external_cancels).insert(task_id.to_string());
        let command = AgentCommand::CancelExternal {
            task_id: task_id.to_string(),
        };
        let reply = self.command(&target, command).await;
        // Still marked: no processing took it (canceled by the command, or it ran).
        let mark_taken = !lock(&self.shared.external_cancels).remove(task_id);
        let reply = reply?;
        let record = self
            .external_task(agent, task_id)
            .await
            .map_err(read)?
            .ok_or_else(unknown)?;
        match reply {
            SendReply::CancelSent => Ok(ExternalCancel::Canceled(record)),
            SendReply::AlreadyFinal(TaskState::Canceled) if mark_taken => Ok(ExternalCancel::Canceled(record)),
            SendReply::AlreadyFinal(_) => Ok(ExternalCancel::Ended(record)),
            SendReply::Running => Ok(ExternalCancel::Running(record)),
            SendReply::UnknownTask => Err(unknown()),
            other => Err(InboxError::Malformed {
                cause: format!("unexpected reply {other:?}"),
            }),
        }
    }

    /// Forgets agent `agent`'s external task `task_id` if it has ended: deletes its
    /// record and the mark that made its `msg_id` sent again return it, so that message
    /// sent again starts a new task. A task that has not ended is kept
    /// ([`ExternalForget::NotEnded`]). Records are otherwise kept for good: a server
    /// that hands agents external tasks forgets the ones it no longer keeps itself.
    ///
    /// # Errors
    /// [`InboxError::UnknownTask`] (no such task, or forgotten already),
    /// [`InboxError::InvalidAgentId`], [`InboxError::Refused`], [`InboxError::Invoke`].
    pub async fn forget_external(&self, agent: &str, task_id: &str) -> Result<ExternalForget, InboxError> {
        let target = self.known_agent(agent).await?;
        let unknown = || InboxError::UnknownTask {
            agent: target.clone(),
            task_id: task_id.to_string(),
        };
        // Answered from the committed record when it has not ended, rather than behind
        // the agent's running turn (which may be this task's); the agent's own turn
        // checks again before it deletes anything.
        let record = self
            .external_task(agent, task_id)
            .await
            .map_err(|error| InboxError::Malformed {
                cause: error.to_string(),
            })?
            .ok_or_else(unknown)?;
        if !record.state.is_final() {
            return Ok(ExternalForget::NotEnded);
        }
        let command = AgentCommand::ForgetExternal {
            task_id: task_id.to_string(),
        };
        match self.command(&target, command).await? {
            SendReply::Forgotten => Ok(ExternalForget::Forgotten),
            SendReply::Running => Ok(ExternalForget::NotEnded),
            SendReply::UnknownTask => Err(unknown()),
            other => Err(InboxError::Malformed {
                cause: format!("unexpected reply {other:?}"),
            }),
        }
    }
}
