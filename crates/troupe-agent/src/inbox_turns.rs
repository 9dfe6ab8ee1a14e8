//! The agent's inbox and outbox turns (see `inbox.rs` for the protocol), and the
//! `delegate_to_agent` and `notify_agent` tools.

use std::sync::{Arc, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use schemars::JsonSchema;
use serde::Deserialize;
use troupe_core::limits::{ACTOR_KEY_LENGTH_MAX, INVOKE_TIMEOUT_MS_MAX};
use troupe_core::{ActorId, CallContext, CallRefused, Deadline, InvokeError};
use troupe_runtime::{ActorError, Turn};

use crate::agent::{agent_id, AgentActor, BoxCounters, Conversation, TurnError};
use crate::inbox::{
    canceled_key, dedupe_slot_key, encode_reply, from_json, inbox_key, outbox_head, outbox_key, own_seen_key,
    pair_in_key, pair_out_key, pair_skip_key, seen_key, seq_of, task_deadline, task_key, task_overdue_at, tasks_in_key,
    to_json, AgentCommand, DueIndex, EnqueueReply, InboxBody, InboxEntry, InboxError, OutboxEntry, PairIn, PairOut,
    PairSeq, PairSkipped, PendingSends, Record, SendReply, TaskState, DELEGATE_TOOL_NAME, NOTIFY_TOOL_NAME,
    TASK_DUE_INDEX, TASK_END_INDEX, TASK_INDEX_CURSOR_KEY, TASK_INDEX_VERSION, TASK_INDEX_VERSION_KEY,
};
use crate::limits::{
    AGENT_DEDUPE_KEYS_KEPT_MAX, AGENT_DELIVERY_ACK_TIMEOUT_MS, AGENT_DELIVERY_OUT_OF_ORDER_RETRY_MS,
    AGENT_DELIVERY_RETRY_MS, AGENT_INBOX_CAPACITY, AGENT_MENTION_ANSWER_ATTEMPTS_MAX, AGENT_MENTION_ANSWER_RETRY_MS,
    AGENT_MENTION_DELIVERY_RETRY_MAX_MS, AGENT_MESSAGE_SIZE_MAX_BYTES, AGENT_RESUME_BATCH,
    AGENT_TASKS_OVERDUE_RESOLVED_PER_PASS, AGENT_TASK_INDEX_MIGRATED_PER_TURN, AGENT_TASK_RECORDS_PRUNED_PER_PASS,
    AGENT_TASK_RECORD_KEPT_MS, AGENT_TASK_RESULT_GRACE_MS, AGENT_TASK_TIMEOUT_MS_DEFAULT,
    AGENT_WAKE_RETRY_ATTEMPTS_MAX,
};
use crate::{tool_parameters_schema, AgentEvent, Spend, Tool, ToolError, ToolExecutionContext};
// The overdue-task wake-ups' module; its types are named here too (the agent's shared
// state and the tests name them through this module).
pub(crate) use crate::overdue_wake::{arm_overdue_wake, disarm_overdue_wake, OverdueWake};

/// How long a self-told wake-up (process, relay, resume) may wait in the mailbox.
pub(crate) const WAKE_TIMEOUT: Duration = Duration::from_millis(INVOKE_TIMEOUT_MS_MAX);

/// Extra time a processing turn gets past its entry's deadline, so that a model loop cut
/// at the deadline still commits the failure (the runtime would roll it back).
pub(crate) const PROCESS_GRACE_MS: u64 = 1_000;

/// The context a task's result is sent under: a root one (the delegator processes it
/// under the context it had when it delegated, see `enqueue`) with the task's trace id,
/// so that its delivery is exported in the task's trace.
fn result_context(task: &CallContext, deadline: troupe_core::Deadline) -> CallContext {
    let context = CallContext::root(deadline);
    match task.trace_id() {
        Some(trace) => context.with_trace_id(trace),
        None => context,
    }
}

/// Whether a resume's wake-up was told: `false` when the agent's own mailbox is full
/// (`Busy`: the resume goes on later), any other refusal an error.
fn told(result: Result<(), InvokeError>) -> Result<bool, ActorError> {
    match result {
        Ok(()) => Ok(true),
        Err(InvokeError::Busy { .. }) => Ok(false),
        Err(error) => Err(wake_failed(error)),
    }
}

/// A wake-up refused: the turn fails with the refusal in its cause, except when the
/// runtime stops, which reaches the caller as the runtime's own typed `Shutdown` (a
/// turn of the shutdown's grace; a caller, such as `troupe serve`, must not take it
/// for the agent's failure).
fn wake_failed(error: InvokeError) -> ActorError {
    match error {
        InvokeError::Shutdown => ActorError::Invoke(InvokeError::Shutdown),
        error => ActorError::failed(format!("could not schedule inbox work: {error}")),
    }
}

/// A key of a [`DueIndex`] that a [`scan_due_keys`] found due.
struct DueKey {
    key: String,
    task_id: String,
    value: Bytes,
}

/// What a [`scan_due_keys`] read.
struct DueScan {
    /// The keys due, earliest first.
    due: Vec<DueKey>,
    /// No key is due before this time (microseconds) once `due` is handled: the first
    /// key read that is not due yet, `u64::MAX` when the scan read every key; `None`
    /// (not known) when it stopped at its limit with every key read due.
    next_due_us: Option<u64>,
}

/// The keys of `index` due by `now_us`, earliest first, at most `limit`, in one scan of
/// the store that stops at the first key not due yet; `None`, reading nothing, when
/// `known_due_us` (no key is due before it, as this activation knows: see
/// [`crate::inbox::RecordMemos`]) is later than `now_us`. Used by the passes that prune
/// ended tasks' records and resolve overdue tasks.
async fn scan_due_keys(
    turn: &mut Turn,
    index: DueIndex,
    now_us: u64,
    known_due_us: Option<u64>,
    limit: usize,
) -> Result<Option<DueScan>, ActorError> {
    if known_due_us.is_some_and(|due| due > now_us) {
        return Ok(None);
    }
    let keys = turn.scan(index.prefix, None, limit).await?;
    // Fewer than the limit: every key was read, none is left due after this pass.
    let mut next_due_us = (keys.len() < limit).then_some(u64::MAX);
    let mut due = Vec::with_capacity(keys.len());
    for (key, value) in keys {
        let (at_us, task_id) = index.parse(&key)?;
        if at_us > now_us {
            next_due_us = Some(at_us);
            break;
        }
        let task_id = task_id.to_string();
        due.push(DueKey { key, task_id, value });
    }
    Ok(Some(DueScan { due, next_due_us }))
}

/// Tells `id` (the agent or conversation whose turn is running) `wake`, the start of the
/// work that turn queued (a delivery). If its mailbox is full (`Busy`), the turn does
/// not fail for it: what it wrote is committed with it, and a task of its own tells
/// `wake` again a moment later ([`wake_later`]). Any other refusal is an error.
///
/// # Errors
/// The refusal, as an [`ActorError`] naming it.
pub(crate) async fn wake_self(
    turn: &Turn,
    shared: &crate::agent::AgentShared,
    id: &ActorId,
    wake: Bytes,
    wake_failed: fn(InvokeError) -> ActorError,
) -> Result<(), ActorError> {
    match turn.caller().tell(id, wake.clone(), WAKE_TIMEOUT).await {
        Ok(()) => Ok(()),
        Err(InvokeError::Busy { .. }) => {
            wake_later(shared, id.clone(), wake);
            Ok(())
        }
        Err(error) => Err(wake_failed(error)),
    }
}

/// Tells `id` `wake` from a task of its own, after a pause of [`AGENT_DELIVERY_RETRY_MS`]
/// that doubles up to [`AGENT_MENTION_DELIVERY_RETRY_MAX_MS`], until it is accepted,
/// refused otherwise (the runtime stopped, the actor owned by another node: logged), or
/// [`AGENT_WAKE_RETRY_ATTEMPTS_MAX`] attempts were refused `Busy`; the work then waits
/// for the next resume.
pub(crate) fn wake_later(shared: &crate::agent::AgentShared, id: ActorId, wake: Bytes) {
    let Some(runtime) = shared.runtime() else {
        return;
    };
    tokio::spawn(async move {
        let mut pause = Duration::from_millis(AGENT_DELIVERY_RETRY_MS);
        for _ in 0..AGENT_WAKE_RETRY_ATTEMPTS_MAX {
            tokio::time::sleep(pause).await;
            pause = pause
                .saturating_mul(2)
                .min(Duration::from_millis(AGENT_MENTION_DELIVERY_RETRY_MAX_MS));
            match runtime.tell(&id, wake.clone(), runtime.deadline_in(WAKE_TIMEOUT)).await {
                Ok(()) => return,
                Err(InvokeError::Busy { .. }) => {}
                Err(error) => {
                    tracing::warn!(actor = %id, %error, "a wake-up could not be sent; the work waits for the next resume");
                    return;
                }
            }
        }
        tracing::warn!(actor = %id, attempts = AGENT_WAKE_RETRY_ATTEMPTS_MAX, "a wake-up was refused busy at every attempt; the work waits for the next resume");
    });
}

impl AgentActor {
    /// Writes open task `task_id`'s `task_due/` key for `due` (its value: the task's
    /// grant), lowers this activation's known earliest due to it, and arms the agent's
    /// wake-up for it ([`arm_overdue_wake`]): what a delegation and the index's migration
    /// both do for each open task.
    fn put_task_due(&mut self, turn: &mut Turn, due: Deadline, task_id: &str, grant: Bytes) -> Result<(), ActorError> {
        turn.put(TASK_DUE_INDEX.key(due, task_id), grant)?;
        let memo = &mut self.memo.tasks_overdue_due_us;
        *memo = memo.map(|known| known.min(due.as_micros()));
        arm_overdue_wake(&self.shared, &self.id, due.as_micros());
        Ok(())
    }

    /// Everything but an ask.
    pub(crate) async fn handle_box(&mut self, turn: &mut Turn, command: AgentCommand) -> Result<Bytes, ActorError> {
        match command {
            AgentCommand::Ask(_) => unreachable!("asks are handled by `handle`"),
            AgentCommand::Enqueue(entry) => self.enqueue(turn, entry).await,
            AgentCommand::Process { seq } => self.process(turn, seq).await.map(|()| Bytes::new()),
            AgentCommand::Relay { seq } => self.relay(turn, seq).await.map(|()| Bytes::new()),
            AgentCommand::Delivered { seq } => self.delivered(turn, seq).await.map(|found| {
                if found {
                    Bytes::from_static(DELIVERED_FOUND)
                } else {
                    Bytes::new()
                }
            }),
            AgentCommand::Undeliverable { seq, cause, state } => {
                self.undeliverable(turn, seq, cause, state).await.map(|()| Bytes::new())
            }
            AgentCommand::Resume {
                inbox_after,
                outbox_after,
            } => self
                .resume(turn, inbox_after, outbox_after)
                .await
                .map(|()| Bytes::new()),
            AgentCommand::Delegate { to, text, timeout_ms } => {
                self.send_from_api(turn, &to, &text, timeout_ms, true).await
            }
            AgentCommand::Notify { to, text, timeout_ms } => {
                self.send_from_api(turn, &to, &text, timeout_ms, false).await
            }
            AgentCommand::Cancel { task_id } => self.cancel(turn, &task_id).await,
            AgentCommand::CancelExternal { task_id } => self.cancel_external(turn, &task_id).await,
            AgentCommand::ForgetExternal { task_id } => self.forget_external(turn, &task_id).await,
            // `handle_command` has resolved the overdue tasks (and armed the next wake-up).
            AgentCommand::ResolveOverdue => Ok(Bytes::new()),
        }
    }

    /// Writes a turn's sends to the outbox (and the delegator's task records) and
    /// schedules their relays, which run after this turn commits.
    pub(crate) async fn flush_sends(&mut self, turn: &mut Turn, mut sends: PendingSends) -> Result<(), ActorError> {
        // The clock is read only for the events of delegations (most turns have none).
        let now = (!sends.tasks.is_empty()).then(|| turn.now());
        if now.is_some() {
            self.prune_ended_tasks(turn).await?;
        }
        self.number_pairs(turn, &mut sends).await?;
        for task in sends.tasks {
            if let Some(at) = now {
                self.shared.emit(&AgentEvent::DelegationStarted {
                    task_id: task.task_id.clone(),
                    from: self.id.clone(),
                    to: task.to.clone(),
                    at,
                });
            }
            self.memo.tasks.put(turn, task_key(&task.task_id), task)?;
            self.state.boxes.tasks_open += 1;
        }
        let seqs: Vec<u64> = sends.entries.iter().map(|(seq, _)| *seq).collect();
        for (seq, entry) in sends.entries {
            if let InboxBody::Task { task_id, .. } = &entry.entry.body {
                // Resolved failed at this time if no result came (`resolve_overdue_tasks`).
                let due = task_overdue_at(entry.entry.context.deadline());
                self.put_task_due(turn, due, task_id, to_json(&entry.entry.budget)?)?;
            }
            self.memo.outbox.put(turn, outbox_key(seq), entry)?;
            self.state.boxes.outbox_len += 1;
        }
        self.state.boxes.outbox_next = self.state.boxes.outbox_next.max(sends.next_seq);
        for seq in seqs {
            let wake = AgentCommand::Relay { seq }.encode();
            wake_self(turn, &self.shared, &self.id, wake, wake_failed).await?;
        }
        Ok(())
    }

    /// Deletes the records of this agent's delegated tasks that ended
    /// [`AGENT_TASK_RECORD_KEPT_MS`] ago or longer (their `task_end/` keys due), at most
    /// [`AGENT_TASK_RECORDS_PRUNED_PER_PASS`], in this turn's commit. Run by the turns
    /// that make a record (a delegation) and that end one (its result), so records go
    /// faster than they come. A result that comes after its record went is still a
    /// duplicate: a result for no record is one (`enqueue`), as every record is written
    /// before its task is sent and only ended ones are deleted.
    async fn prune_ended_tasks(&mut self, turn: &mut Turn) -> Result<(), ActorError> {
        let now = turn.now().as_micros();
        let known = self.memo.tasks_ended_due_us;
        let limit = AGENT_TASK_RECORDS_PRUNED_PER_PASS;
        let Some(scan) = scan_due_keys(turn, TASK_END_INDEX, now, known, limit).await? else {
            return Ok(());
        };
        for due in scan.due {
            let record = task_key(&due.task_id);
            self.memo.tasks.forget(&record);
            turn.delete(record)?;
            turn.delete(due.key)?;
        }
        self.memo.tasks_ended_due_us = scan.next_due_us;
        Ok(())
    }

    /// Gives the task records stored before the `task_end/` and `task_due/` indexes
    /// (3cd28b6, acfd711) the index key they lack, once per agent: an ended record a
    /// `task_end/` key due [`AGENT_TASK_RECORD_KEPT_MS`] from now (when it ended is not
    /// known), an open one its `task_due/` key at its deadline plus
    /// [`AGENT_TASK_RESULT_GRACE_MS`] (if it has none; its grant is not known: the
    /// default, unlimited, as the failure's turn then gets). At most
    /// [`AGENT_TASK_INDEX_MIGRATED_PER_TURN`] records a turn, in key order, after the
    /// last page committed (`task_index_cursor`): a crash resumes there. When every
    /// record is done, writes the `task_index_version` marker; an agent with no task
    /// record writes it at once (with the turn: one empty scan per agent, not one per
    /// activation); an agent with the marker reads one key and nothing more. A record written meanwhile has its key already; one visited
    /// again is harmless (an extra `task_end/` key deletes nothing that is still kept
    /// after its own key is due, and then itself). Run before every command of the
    /// agent, before `resolve_overdue_tasks`.
    pub(crate) async fn migrate_task_index(&mut self, turn: &mut Turn, now: Deadline) -> Result<(), ActorError> {
        if self.memo.task_index_marked {
            return Ok(());
        }
        if turn.get(TASK_INDEX_VERSION_KEY).await?.is_some() {
            self.memo.task_index_marked = true;
            return Ok(());
        }
        let cursor = turn.get(TASK_INDEX_CURSOR_KEY).await?;
        let after = match &cursor {
            Some(bytes) => Some(
                std::str::from_utf8(bytes)
                    .map_err(|_| ActorError::failed(format!("bad {TASK_INDEX_CURSOR_KEY}: not UTF-8")))?
                    .to_string(),
            ),
            None => None,
        };
        let limit = AGENT_TASK_INDEX_MIGRATED_PER_TURN;
        let page = turn.scan("task/", after.as_deref(), limit).await?;
        if page.is_empty() && after.is_none() {
            // No record: nothing to index, ever (every record written from now on has
            // its key). Marked with this turn, so no later activation scans again.
            turn.put(
                TASK_INDEX_VERSION_KEY.to_string(),
                Bytes::from_static(TASK_INDEX_VERSION),
            )?;
            self.memo.task_index_marked = true;
            return Ok(());
        }
        let last = page.last().map(|(key, _)| key.clone());
        for (key, bytes) in &page {
            let record = self.memo.tasks.decode(key, bytes)?;
            if record.state.is_final() {
                let due = Deadline::after(now, Duration::from_millis(AGENT_TASK_RECORD_KEPT_MS));
                turn.put(TASK_END_INDEX.key(due, &record.task_id), Bytes::new())?;
                let memo = &mut self.memo.tasks_ended_due_us;
                *memo = memo.map(|known| known.min(due.as_micros()));
            } else {
                let due = task_overdue_at(record.deadline);
                let index_key = TASK_DUE_INDEX.key(due, &record.task_id);
                if turn.get(&index_key).await?.is_none() {
                    self.put_task_due(turn, due, &record.task_id, to_json(&crate::Budget::default())?)?;
                }
            }
        }
        if page.len() < limit {
            turn.put(
                TASK_INDEX_VERSION_KEY.to_string(),
                Bytes::from_static(TASK_INDEX_VERSION),
            )?;
            if cursor.is_some() {
                turn.delete(TASK_INDEX_CURSOR_KEY.to_string())?;
            }
            self.memo.task_index_marked = true;
        } else if let Some(last) = last {
            turn.put(TASK_INDEX_CURSOR_KEY.to_string(), Bytes::from(last))?;
        }
        Ok(())
    }

    /// Resolves `failed` the tasks this agent delegated that are still open
    /// [`AGENT_TASK_RESULT_GRACE_MS`] past their deadline (their `task_due/` keys due),
    /// at most [`AGENT_TASKS_OVERDUE_RESOLVED_PER_PASS`], in this turn's commit: each as
    /// a result from itself through its own inbox (as an undeliverable task's failure),
    /// so it ends like any other (final record, `DelegationFinished`, its slot among
    /// [`crate::limits::AGENT_TASKS_OPEN_MAX`] counted back, its failure shown to the
    /// model in a turn of its own), and a result that comes later is a duplicate. Its
    /// delegatee accepted it and never answered: removed, or its entry lost. Run before
    /// every command of the agent (`handle_command`): a turn with no task open, or none
    /// due as this activation knows, reads nothing; each result it makes is a turn that
    /// resolves the next ones. The first key it finds not due yet arms the agent's
    /// wake-up for its time ([`arm_overdue_wake`], as each delegation does for its own),
    /// so that a task is resolved at its due time even if nothing else reaches the
    /// agent.
    pub(crate) async fn resolve_overdue_tasks(&mut self, turn: &mut Turn, now: Deadline) -> Result<(), ActorError> {
        if self.state.boxes.tasks_open == 0 {
            return Ok(());
        }
        let now_us = now.as_micros();
        let known = self.memo.tasks_overdue_due_us;
        let limit = AGENT_TASKS_OVERDUE_RESOLVED_PER_PASS;
        let Some(scan) = scan_due_keys(turn, TASK_DUE_INDEX, now_us, known, limit).await? else {
            return Ok(());
        };
        for DueKey {
            key,
            task_id,
            value: grant,
        } in scan.due
        {
            let task_id = task_id.as_str();
            let record_key = task_key(task_id);
            let record = match turn.get(&record_key).await? {
                Some(bytes) => self.memo.tasks.decode(&record_key, &bytes)?,
                None => {
                    turn.delete(key)?; // no record: nothing open
                    continue;
                }
            };
            if record.state.is_final() {
                turn.delete(key)?; // ended meanwhile (its key outlived it)
                continue;
            }
            let grant: crate::Budget = from_json(&key, &grant)?;
            let waited_ms = AGENT_TASK_RESULT_GRACE_MS;
            let entry = InboxEntry {
                msg_id: format!("{task_id}.overdue"),
                from: None,
                body: InboxBody::TaskUpdate {
                    task_id: task_id.to_string(),
                    state: TaskState::Failed,
                    text: format!(
                        "no result by the task's deadline, nor in the {waited_ms} ms after it that a result's \
                         delivery may take: {} did not answer (removed, or its work lost); a result that comes \
                         later is dropped",
                        record.to
                    ),
                },
                context: result_context(&record.context, record.deadline),
                // What the task left of its grant is unknown: nothing (all of it when
                // the grant was unlimited), as for a task whose work failed.
                budget: grant.after(Spend::all_of(grant)),
                pair: None,
            };
            self.enqueue(turn, entry).await?;
        }
        self.memo.tasks_overdue_due_us = scan.next_due_us;
        if let Some(next_due_us) = scan.next_due_us {
            // `None`: more were due than one pass resolves; each result's turn goes on.
            arm_overdue_wake(&self.shared, &self.id, next_due_us);
        }
        Ok(())
    }

    /// Gives each notification and task of `sends` its place in the order of this
    /// agent's entries to its target ([`crate::inbox::PairSeq`]), and records them as
    /// pending (`pair_out/{target}`, written with this turn).
    async fn number_pairs(&mut self, turn: &mut Turn, sends: &mut PendingSends) -> Result<(), ActorError> {
        let mut records: Vec<(ActorId, PairOut)> = Vec::new();
        for (_, out) in &mut sends.entries {
            if !matches!(out.entry.body, InboxBody::Notify { .. } | InboxBody::Task { .. }) {
                continue; // results and cancellations are not ordered
            }
            let index = match records.iter().position(|(target, _)| *target == out.to) {
                Some(index) => index,
                None => {
                    let key = pair_out_key(&out.to);
                    let record = match turn.get(&key).await? {
                        Some(bytes) => self.memo.pair_out.take(&key, &bytes)?,
                        None => PairOut::default(),
                    };
                    records.push((out.to.clone(), record));
                    records.len() - 1
                }
            };
            let record = &mut records[index].1;
            let seq = record.next;
            record.next += 1;
            record.pending.insert(seq);
            out.entry.pair = Some(PairSeq { seq, low: seq });
        }
        for (target, record) in records {
            self.memo.pair_out.put(turn, pair_out_key(&target), record)?;
        }
        Ok(())
    }

    /// Takes an ordered outbox entry to `to` (acknowledged or given up; `pair`, its
    /// place in the order) off its target's pending list.
    async fn release_pair(&mut self, turn: &mut Turn, to: &ActorId, pair: Option<PairSeq>) -> Result<(), ActorError> {
        let Some(pair) = pair else {
            return Ok(());
        };
        let key = pair_out_key(to);
        let Some(bytes) = turn.get(&key).await? else {
            return Ok(());
        };
        let mut record = self.memo.pair_out.take(&key, &bytes)?;
        if record.pending.remove(&pair.seq) {
            self.memo.pair_out.put(turn, key, record)?;
        } else {
            self.memo.pair_out.keep(key, bytes, record);
        }
        Ok(())
    }

    /// Appends `entry` to the inbox, unless it is a duplicate or the inbox is full; the
    /// reply (the acknowledgement) leaves only after the commit.
    async fn enqueue(&mut self, turn: &mut Turn, mut entry: InboxEntry) -> Result<Bytes, ActorError> {
        let now = turn.now();
        // How the entry is deduplicated. A dedupe mark (`seen/{msg_id}`) is read here and
        // written with the entry's acceptance (kept among the newest
        // `AGENT_DEDUPE_KEYS_KEPT_MAX`: `keep_in_window`), except for three kinds:
        // - an id-less message (`AgentClient::notify`): the inbox names it, uniquely for
        //   good (its seq is committed with it); nothing can come again under that name;
        // - a final task result: its task record dedupes it (the first final state wins,
        //   below), as `docs/tla/DelegateInbox.tla` models it;
        // - an ordered entry (an agent's notification or task to an agent, with its
        //   place in its sender's order, `PairSeq`): the order dedupes it. Every number
        //   below the one expected next was either taken or skipped (`PairSkipped`), so
        //   one of them that comes again was taken, unless it was skipped
        //   (`PairOrder.tla`).
        // Marks written before for such entries are left in place, unread.
        let ordered = entry.pair.is_some() && entry.from.is_some();
        let (reads_mark, writes_mark) = if entry.msg_id.is_empty() {
            entry.msg_id = format!("{}.in{}", self.id.key(), self.state.boxes.inbox_next);
            (false, false)
        } else if ordered {
            (false, false)
        } else {
            let marked = !matches!(&entry.body, InboxBody::TaskUpdate { state, .. } if state.is_final());
            (marked, marked)
        };
        let kind = entry.body.kind();
        // A message named outside (a notification with the caller's id, an external
        // task) and one Troupe named keep their marks apart: an outside id may be any
        // text, also one shaped like an agent's own.
        let named_outside = matches!(entry.body, InboxBody::External { .. })
            || (entry.from.is_none() && matches!(entry.body, InboxBody::Notify { .. }));
        let seen = if named_outside {
            seen_key(&entry.msg_id)
        } else {
            own_seen_key(&entry.msg_id)
        };
        let received = |duplicate: bool| AgentEvent::MessageReceived {
            msg_id: entry.msg_id.clone(),
            agent: self.id.clone(),
            kind,
            duplicate,
            at: now,
        };
        let first = match (reads_mark, named_outside) {
            (false, _) => None,
            (true, true) => turn.get(&seen).await?,
            // A mention's mark written before Troupe's names had their own (`seen/`)
            // still counts, so a mention delivered again across the upgrade is not
            // answered twice (an outside id shaped like a mention's,
            // `{conversation}#{n}@{agent}`, is not expected). Other own messages read
            // only their own marks: a cancellation taken twice changes nothing, and an
            // outside id shaped like `{agent}.{n}` must not hide one.
            (true, false) => match turn.get(&seen).await? {
                None if matches!(entry.body, InboxBody::Mention { .. }) => turn.get(&seen_key(&entry.msg_id)).await?,
                first => first,
            },
        };
        if let Some(first) = first {
            self.shared.emit(&received(true));
            if matches!(entry.body, InboxBody::External { .. }) {
                // A resent external task: the id it was given the first time.
                let task_id = String::from_utf8_lossy(&first).into_owned();
                return Ok(encode_reply(&EnqueueReply::Accepted { msg_id: task_id }));
            }
            return Ok(encode_reply(&EnqueueReply::Duplicate));
        }
        if matches!(entry.body, InboxBody::External { .. }) {
            return self.enqueue_external(turn, entry).await;
        }
        // An ordered entry goes in only after its sender's earlier ones (or past those
        // the sender gave up); the new expected seq is written with its acceptance.
        let mut order = None;
        if let (Some(pair), Some(from)) = (entry.pair, &entry.from) {
            let key = pair_in_key(from);
            let mut record: PairIn = match turn.get(&key).await? {
                Some(bytes) => self.memo.pair_in.decode(&key, &bytes)?,
                None => PairIn::default(),
            };
            let expected = record.expected;
            if pair.seq == expected || (pair.seq == pair.low && pair.seq > expected) {
                record.expected = pair.seq + 1;
                // Past a gap: the numbers jumped over were given up by the sender.
                let skipped = (pair.seq > expected).then_some(expected..pair.seq);
                order = Some((from.clone(), key, record, skipped));
            } else if pair.seq < expected {
                // Taken before, or skipped: it comes again (a redelivery, or an attempt
                // sent before the sender gave it up).
                if skipped_of(turn, &pair_skip_key(from)).await?.contains(pair.seq) {
                    return Ok(encode_reply(&EnqueueReply::Stale { expected }));
                }
                self.shared.emit(&received(true));
                return Ok(encode_reply(&EnqueueReply::Duplicate));
            } else {
                return Ok(encode_reply(&EnqueueReply::OutOfOrder { expected }));
            }
        }
        match &entry.body {
            InboxBody::TaskUpdate { task_id, state, text } => {
                // Dedupe by task: the first final state wins; later ones are dropped.
                let key = task_key(task_id);
                let Some(bytes) = turn.get(&key).await? else {
                    self.shared.emit(&received(true));
                    return Ok(encode_reply(&EnqueueReply::Duplicate));
                };
                let mut record = self.memo.tasks.take(&key, &bytes)?;
                if record.state.is_final() {
                    self.memo.tasks.keep(key, bytes, record);
                    if writes_mark {
                        keep_in_window(turn, &mut self.state.boxes, seen).await?;
                        // a non-final update
                    }
                    self.shared.emit(&received(true));
                    return Ok(encode_reply(&EnqueueReply::Duplicate));
                }
                // Its end is no longer due: it has come.
                turn.delete(TASK_DUE_INDEX.key(task_overdue_at(record.deadline), task_id))?;
                record.state = *state;
                record.result = Some(text.clone());
                self.state.boxes.tasks_open = self.state.boxes.tasks_open.saturating_sub(1);
                if self.state.boxes.tasks_open == 0 {
                    disarm_overdue_wake(&self.shared, &self.id);
                }
                self.shared.emit(&AgentEvent::DelegationFinished {
                    task_id: task_id.clone(),
                    from: self.id.clone(),
                    to: record.to.clone(),
                    state: *state,
                    at: now,
                });
                // The result is processed under the chain and depth the delegator had.
                entry.context = record
                    .context
                    .with_deadline(task_deadline(now, Some(AGENT_TASK_TIMEOUT_MS_DEFAULT)));
                self.memo.tasks.put(turn, key, record)?;
                if state.is_final() {
                    let due = Deadline::after(now, Duration::from_millis(AGENT_TASK_RECORD_KEPT_MS));
                    turn.put(TASK_END_INDEX.key(due, task_id), Bytes::new())?;
                    let memo = &mut self.memo.tasks_ended_due_us;
                    *memo = memo.map(|known| known.min(due.as_micros()));
                    self.prune_ended_tasks(turn).await?;
                }
            }
            InboxBody::Cancel { task_id } => {
                keep_in_window(turn, &mut self.state.boxes, seen).await?;
                self.shared.emit(&received(false));
                let index = tasks_in_key(task_id);
                let Some(bytes) = turn.get(&index).await? else {
                    // Not here yet (the cancellation overtook the task), or done: a
                    // tombstone makes a task arriving later resolve canceled at once.
                    // A task is known to have come only by a mark from before tasks
                    // were deduplicated by their order; since, a cancellation that
                    // comes after its task started leaves a tombstone nothing takes,
                    // so tombstones are kept in the window of dedupe keys too. (Only
                    // Troupe's own marks are read: an outside notification may carry
                    // the task's id as its own, and a tombstone too many is harmless.)
                    if turn.get(&own_seen_key(task_id)).await?.is_none() {
                        keep_in_window(turn, &mut self.state.boxes, canceled_key(task_id)).await?;
                    }
                    return Ok(encode_reply(&EnqueueReply::Accepted {
                        msg_id: entry.msg_id.clone(),
                    }));
                };
                {
                    // Not started yet: drop it and tell the delegator.
                    let seq: u64 = from_json(&index, &bytes)?;
                    turn.delete(inbox_key(seq))?;
                    turn.delete(index)?;
                    self.state.boxes.inbox_len = self.state.boxes.inbox_len.saturating_sub(1);
                    self.report_canceled_before_start(turn, &entry, task_id).await?;
                }
                return Ok(encode_reply(&EnqueueReply::Accepted {
                    msg_id: entry.msg_id.clone(),
                }));
            }
            InboxBody::Task { task_id, .. } if turn.get(&canceled_key(task_id)).await?.is_some() => {
                turn.delete(canceled_key(task_id))?;
                if writes_mark {
                    keep_in_window(turn, &mut self.state.boxes, seen).await?; // a task from before the order
                }
                if let Some((from, key, record, skipped)) = order {
                    self.memo.pair_in.put(turn, key, record)?;
                    record_skipped(turn, &from, skipped).await?;
                }
                self.shared.emit(&received(false));
                self.report_canceled_before_start(turn, &entry, task_id).await?;
                return Ok(encode_reply(&EnqueueReply::Accepted {
                    msg_id: entry.msg_id.clone(),
                }));
            }
            InboxBody::Notify { .. }
            | InboxBody::Task { .. }
            | InboxBody::Mention { .. }
            | InboxBody::External { .. } => {
                if self.state.boxes.inbox_len >= AGENT_INBOX_CAPACITY {
                    return Ok(encode_reply(&EnqueueReply::Full {
                        capacity: AGENT_INBOX_CAPACITY,
                    }));
                }
            }
        }
        if let Some((from, key, mut record, skipped)) = order {
            record.unprocessed.insert(self.state.boxes.inbox_next); // its inbox seq
            self.memo.pair_in.put(turn, key, record)?;
            record_skipped(turn, &from, skipped).await?;
        }
        if writes_mark {
            keep_in_window(turn, &mut self.state.boxes, seen).await?;
        }
        self.append(turn, entry, None).await
    }

    /// Appends `entry` (checked: not seen, room left) to the inbox under the next seq
    /// and schedules its processing; writes its dedupe mark `seen` (key and value), if
    /// it has one.
    pub(crate) async fn append(
        &mut self,
        turn: &mut Turn,
        entry: InboxEntry,
        seen: Option<(String, Bytes)>,
    ) -> Result<Bytes, ActorError> {
        let now = turn.now();
        let seq = self.state.boxes.inbox_next;
        let key = inbox_key(seq);
        let bytes = entry.encode()?;
        turn.put(key.clone(), bytes.clone())?;
        if let Some((seen, seen_value)) = seen {
            turn.put(seen, seen_value)?;
        }
        if let InboxBody::Task { task_id, .. } = &entry.body {
            turn.put(tasks_in_key(task_id), to_json(&seq)?)?;
        }
        self.state.boxes.inbox_next += 1;
        self.state.boxes.inbox_len += 1;
        self.shared.emit(&AgentEvent::MessageReceived {
            msg_id: entry.msg_id.clone(),
            agent: self.id.clone(),
            kind: entry.body.kind(),
            duplicate: false,
            at: now,
        });
        // Its own mailbox full, the entry is accepted all the same (committed with this
        // turn) and scheduled by a resume from a task of its own: failing the append for
        // it answered the sender an error for a message the inbox had room for.
        if !told(self.try_schedule_process(turn, seq, &entry.context).await)? {
            self.resume_inbox_later(seq);
        }
        let reply = encode_reply(&EnqueueReply::Accepted {
            msg_id: entry.msg_id.clone(),
        });
        self.memo.inbox.keep(key, bytes, entry);
        Ok(reply)
    }

    /// Tells the delegator of the task in `entry` (if it has one) that the task was
    /// canceled before it started, through the outbox of this turn.
    async fn report_canceled_before_start(
        &mut self,
        turn: &mut Turn,
        entry: &InboxEntry,
        task_id: &str,
    ) -> Result<(), ActorError> {
        let Some(to) = entry.from.clone() else {
            return Ok(());
        };
        let mut sends = self.pending_sends();
        let body = InboxBody::TaskUpdate {
            task_id: task_id.to_string(),
            state: TaskState::Canceled,
            text: "canceled before it started".to_string(),
        };
        sends.push_raw(to, body, result_context(&entry.context, entry.context.deadline()));
        self.flush_sends(turn, sends).await
    }

    pub(crate) fn pending_sends(&self) -> PendingSends {
        let boxes = self.state.boxes;
        PendingSends::new(self.id.clone(), boxes.outbox_next, boxes.outbox_len, boxes.tasks_open)
    }

    /// Tells itself to process inbox entry `seq` under the entry's context (plus the
    /// grace that lets a timed-out model loop commit its failure), with the runtime's
    /// refusal as it is (`Busy`: the mailbox is full).
    async fn try_schedule_process(&mut self, turn: &Turn, seq: u64, context: &CallContext) -> Result<(), InvokeError> {
        // An entry already past its deadline is still scheduled (now + grace): its turn
        // resolves it as failed instead of leaving it to the next resume.
        let latest = context.deadline().max(turn.now());
        let deadline = troupe_core::Deadline::after(latest, Duration::from_millis(PROCESS_GRACE_MS));
        turn.caller()
            .tell_self_in(AgentCommand::Process { seq }.encode(), context.with_deadline(deadline))
            .await?;
        self.process_told.insert(seq, deadline);
        Ok(())
    }

    /// Whether a `Process` of `seq` told by this activation may still run (see
    /// [`AgentActor::process_told`]).
    fn process_queued(&self, seq: u64, now: troupe_core::Deadline) -> bool {
        self.process_told
            .get(&seq)
            .is_some_and(|deadline| !deadline.has_passed(now))
    }

    /// Tries inbox entry `seq` (a mention whose answer could not be posted) again from a
    /// task of this process, unless one already does: it tells the agent to process it
    /// after [`AGENT_MENTION_ANSWER_RETRY_MS`], doubling the pause, until the entry is
    /// gone from the store (answered), [`AGENT_MENTION_ANSWER_ATTEMPTS_MAX`] attempts
    /// were made, or the tell is refused (past the entry's `deadline` plus
    /// [`PROCESS_GRACE_MS`], or the agent is owned by another node now); then the entry
    /// waits for the next resume, as before. A task of its own: the failing turn's calls
    /// end with it, and the agent is rebuilt after a failed turn.
    fn process_again_later(&self, seq: u64, deadline: troupe_core::Deadline) {
        let Some(runtime) = self.shared.runtime() else {
            return;
        };
        let entry = (self.id.clone(), seq);
        if !self
            .shared
            .mention_retries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(entry.clone())
        {
            return;
        }
        let shared = Arc::clone(&self.shared);
        let until = troupe_core::Deadline::after(deadline, Duration::from_millis(PROCESS_GRACE_MS));
        tokio::spawn(async move {
            let (id, seq) = &entry;
            let key = inbox_key(*seq);
            let mut pause = Duration::from_millis(AGENT_MENTION_ANSWER_RETRY_MS);
            for _ in 0..AGENT_MENTION_ANSWER_ATTEMPTS_MAX {
                tokio::time::sleep(pause).await;
                pause = pause.saturating_mul(2);
                if matches!(runtime.store().get(id, &key).await, Ok(None)) {
                    break; // answered (or resumed and answered) meanwhile
                }
                if let Err(error) = runtime
                    .tell(id, AgentCommand::Process { seq: *seq }.encode(), until)
                    .await
                {
                    tracing::warn!(agent = %id, seq, %error, "could not try a mention's answer again; the next resume will");
                    break;
                }
            }
            shared
                .mention_retries
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&entry);
        });
    }

    /// For an ordered entry (`seq`, from its sender's `pair_in` record): whether every
    /// earlier entry of its sender in the inbox has been processed; if so, it is taken
    /// off the record (written with this turn). If not, the earliest one is scheduled
    /// and `seq` is told again behind it, and this turn does nothing more (a processing
    /// turn that failed leaves its entry for the actor's next resume: the later ones of
    /// its sender wait for it, not overtake it).
    async fn earlier_of_its_sender_done(
        &mut self,
        turn: &mut Turn,
        seq: u64,
        entry: &InboxEntry,
    ) -> Result<bool, ActorError> {
        let (Some(_), Some(from)) = (entry.pair, &entry.from) else {
            return Ok(true);
        };
        let key = pair_in_key(from);
        let Some(bytes) = turn.get(&key).await? else {
            return Ok(true);
        };
        let mut record = self.memo.pair_in.take(&key, &bytes)?;
        while let Some(&first) = record.unprocessed.first() {
            if first >= seq {
                break;
            }
            let first_key = inbox_key(first);
            let Some(bytes) = turn.get(&first_key).await? else {
                // Gone without being processed here (a task canceled before it
                // started): nothing to wait for.
                record.unprocessed.remove(&first);
                continue;
            };
            let context = match self.memo.inbox.get(&first_key, &bytes) {
                Some(earlier) => earlier.context.clone(),
                None => InboxEntry::decode(&first_key, &bytes)?.context,
            };
            self.memo.pair_in.put(turn, key, record)?;
            // Its own mailbox full, a resume from a task of its own schedules `first`
            // and the entries after it, `seq` among them (see `resume_inbox_later`).
            if !told(self.try_schedule_process(turn, first, &context).await)? {
                self.resume_inbox_later(first);
                return Ok(false);
            }
            let again = AgentCommand::Process { seq }.encode();
            if !told(turn.caller().tell_self_in(again, turn.context().clone()).await)? {
                self.resume_inbox_later(seq);
            }
            return Ok(false);
        }
        record.unprocessed.remove(&seq);
        self.memo.pair_in.put(turn, key, record)?;
        Ok(true)
    }

    /// Processes inbox entry `seq` once: the entry's deletion commits with the model's
    /// turn and with whatever it sends, or with the failure it reports.
    async fn process(&mut self, turn: &mut Turn, seq: u64) -> Result<(), ActorError> {
        // Whatever this turn does, the message told for it has run.
        self.process_told.remove(&seq);
        let entry_seq = seq;
        let key = inbox_key(seq);
        let Some(bytes) = turn.get(&key).await? else {
            return Ok(()); // processed already (a duplicate wake-up)
        };
        let entry = self.memo.inbox.take(&key, &bytes)?;
        if !self.earlier_of_its_sender_done(turn, seq, &entry).await? {
            self.memo.inbox.keep(key, bytes, entry);
            return Ok(());
        }
        turn.delete(key)?;
        self.state.boxes.inbox_len = self.state.boxes.inbox_len.saturating_sub(1);
        let from = entry.from.as_ref().map_or_else(
            || "outside".to_string(),
            |from| crate::org_prompt::sender_label(&self.shared, self.id.key(), from.key()),
        );
        let deadline = entry.context.deadline();
        let expired = deadline.has_passed(turn.now());
        if self.draining {
            return self.drain_entry(turn, entry).await;
        }
        match entry.body {
            InboxBody::Notify { text } => {
                if !expired {
                    let content = format!("[notification {} from {from}] {text}", entry.msg_id);
                    let conversation = Conversation {
                        content,
                        call: None,
                        deadline,
                        budget: entry.budget,
                        history: None,
                        allowed_ms: Some(0),
                    };
                    match self.converse(turn, conversation).await {
                        Ok(reply) if reply.exhausted.is_none() => {}
                        Ok(reply) => {
                            let error = reply.exhausted.map(|error| error.to_string()).unwrap_or_default();
                            tracing::warn!(agent = %self.id, msg = %entry.msg_id, %error, "processing a notification failed");
                        }
                        // Stale (or the store refused): the turn fails whole; the entry
                        // stays for the current owner.
                        Err(TurnError::Refused(error)) => return Err(error),
                        Err(error) => {
                            tracing::warn!(agent = %self.id, msg = %entry.msg_id, %error, "processing a notification failed");
                        }
                    }
                }
            }
            InboxBody::Mention {
                conversation,
                seq,
                chain,
            } => {
                let mention = InboxEntry {
                    body: InboxBody::Notify { text: String::new() },
                    ..entry
                };
                if let Err(error) = self.answer_mention(turn, &mention, &conversation, seq, &chain).await {
                    // The turn fails and the entry stays; it is tried again shortly,
                    // not only at the next resume.
                    self.process_again_later(entry_seq, deadline);
                    return Err(error);
                }
            }
            InboxBody::Task { task_id, text } => {
                turn.delete(tasks_in_key(&task_id))?;
                let external = entry.from.is_none();
                if external && self.take_external_cancel(&task_id) {
                    let reason = crate::external::CANCELED_BEFORE_START.to_string();
                    return self
                        .finish_external(turn, &task_id, TaskState::Canceled, reason, None)
                        .await;
                }
                let mut meta = None;
                // The result goes back with what the task left of its grant (all of
                // it when the work did not start; nothing when its spend is unknown).
                let (state, result, left) = if expired {
                    let result = "the deadline passed before work started".to_string();
                    (TaskState::Failed, result, entry.budget)
                } else {
                    // A task from outside is shown as is, as an ask from outside is.
                    let content = if external {
                        text
                    } else {
                        format!("[task {task_id} delegated by {from}] {text}")
                    };
                    let conversation = Conversation {
                        content,
                        call: None,
                        deadline,
                        budget: entry.budget,
                        history: None,
                        allowed_ms: Some(0),
                    };
                    let running = external.then(|| self.external_started(&task_id));
                    let conversed = self.converse(turn, conversation).await;
                    drop(running);
                    match conversed {
                        Ok(reply) => {
                            meta = Some(crate::ExternalReply {
                                steps: reply.steps,
                                usage: reply.usage,
                                truncated: reply.truncated,
                            });
                            let left = entry.budget.after(reply.spent);
                            match reply.exhausted {
                                None => (TaskState::Completed, reply.text, left),
                                Some(exhausted) => (TaskState::Failed, exhausted.to_string(), left),
                            }
                        }
                        // Stale (or the store refused): no failed result goes back;
                        // the task stays for the agent's current owner.
                        Err(TurnError::Refused(error)) => return Err(error),
                        Err(error) => (
                            TaskState::Failed,
                            error.to_string(),
                            entry.budget.after(Spend::all_of(entry.budget)),
                        ),
                    }
                };
                if external {
                    let meta = meta.filter(|_| state == TaskState::Completed);
                    return self.finish_external(turn, &task_id, state, result, meta).await;
                }
                if let Some(to) = entry.from {
                    let mut sends = self.pending_sends();
                    let text = troupe_core::truncate_utf8(&result, AGENT_MESSAGE_SIZE_MAX_BYTES).to_string();
                    let body = InboxBody::TaskUpdate { task_id, state, text };
                    sends.push_raw(to, body, result_context(&entry.context, deadline));
                    if let Some((_, out)) = sends.entries.last_mut() {
                        out.entry.budget = left;
                    }
                    self.flush_sends(turn, sends).await?;
                }
            }
            InboxBody::TaskUpdate { task_id, state, text } => {
                let content = format!("[task {task_id} you delegated is {}] {text}", state.as_str());
                let conversation = Conversation {
                    content,
                    call: None,
                    deadline,
                    budget: entry.budget,
                    history: None,
                    allowed_ms: Some(0),
                };
                match self.converse(turn, conversation).await {
                    Ok(reply) if reply.exhausted.is_none() => {}
                    Ok(reply) => {
                        let error = reply.exhausted.map(|error| error.to_string()).unwrap_or_default();
                        tracing::warn!(agent = %self.id, task = %task_id, %error, "processing a task result failed");
                    }
                    Err(TurnError::Refused(error)) => return Err(error),
                    Err(error) => {
                        tracing::warn!(agent = %self.id, task = %task_id, %error, "processing a task result failed");
                    }
                }
            }
            InboxBody::Cancel { .. } | InboxBody::External { .. } => {} // handled at enqueue; never stored
        }
        Ok(())
    }

    /// Ends inbox entry `entry` (taken off the inbox by this turn) of a removed agent
    /// without running a model (see `AgentActor::draining`): a task goes back to its
    /// sender `rejected` with [`removed_before_work`]'s reason (an external one ends so
    /// in its record), in this turn's commit, so once; a notification, mention or task
    /// result has no one to answer and is dropped, logged.
    async fn drain_entry(&mut self, turn: &mut Turn, entry: InboxEntry) -> Result<(), ActorError> {
        let deadline = entry.context.deadline();
        match entry.body {
            InboxBody::Task { task_id, .. } => {
                turn.delete(tasks_in_key(&task_id))?;
                let reason = removed_before_work(self.id.key());
                let Some(to) = entry.from else {
                    return self
                        .finish_external(turn, &task_id, TaskState::Rejected, reason, None)
                        .await;
                };
                let mut sends = self.pending_sends();
                let body = InboxBody::TaskUpdate {
                    task_id,
                    state: TaskState::Rejected,
                    text: reason,
                };
                sends.push_raw(to, body, result_context(&entry.context, deadline));
                if let Some((_, out)) = sends.entries.last_mut() {
                    // Nothing of its grant was spent.
                    out.entry.budget = entry.budget;
                }
                self.flush_sends(turn, sends).await
            }
            body => {
                tracing::warn!(agent = %self.id, msg = %entry.msg_id, kind = ?body.kind(), "dropped an entry of a removed agent");
                Ok(())
            }
        }
    }

    /// Starts delivering outbox entry `seq` to its target's inbox, outside this turn (a
    /// delivery task waits for the acknowledgement, so this agent's mailbox never waits
    /// on another agent's): `Delivered` deletes it once acknowledged; a transient failure
    /// is retried; at its deadline or on a permanent refusal, `Undeliverable` gives it
    /// up, except results, which are retried until acknowledged.
    async fn relay(&mut self, turn: &mut Turn, seq: u64) -> Result<(), ActorError> {
        let key = outbox_key(seq);
        if self.relaying.contains(&seq) {
            return Ok(()); // a delivery task of this activation has it
        }
        let Some(bytes) = turn.get(&key).await? else {
            return Ok(()); // delivered already
        };
        let out = self.memo.outbox.decode(&key, &bytes)?;
        let Some(runtime) = self.shared.runtime() else {
            return Err(ActorError::failed("the agent system has not started, or has stopped"));
        };
        self.relaying.insert(seq);
        let shared = std::sync::Arc::clone(&self.shared);
        let sender = self.id.clone();
        let span = delivery_span(&sender, &out.to, &out.entry);
        self.shared.spawn_delivery(tracing::Instrument::instrument(
            deliver(runtime, shared, sender, seq, out),
            span,
        ));
        Ok(())
    }

    /// The delivery task's report: outbox entry `seq` was acknowledged.
    async fn delivered(&mut self, turn: &mut Turn, seq: u64) -> Result<bool, ActorError> {
        self.relaying.remove(&seq);
        let key = outbox_key(seq);
        let Some(bytes) = turn.get(&key).await? else {
            return Ok(false);
        };
        let (to, pair) = match self.memo.outbox.get(&key, &bytes) {
            Some(out) => (out.to.clone(), out.entry.pair),
            None => outbox_head(&key, &bytes)?,
        };
        self.memo.outbox.forget(&key);
        self.release_pair(turn, &to, pair).await?;
        turn.delete(key)?;
        self.state.boxes.outbox_len = self.state.boxes.outbox_len.saturating_sub(1);
        Ok(true)
    }

    /// The delivery task's report: outbox entry `seq` cannot be delivered. It is
    /// dropped; a task resolves at once (its delegator is this agent) and its failure is
    /// processed as a new turn.
    async fn undeliverable(
        &mut self,
        turn: &mut Turn,
        seq: u64,
        cause: String,
        state: TaskState,
    ) -> Result<(), ActorError> {
        self.relaying.remove(&seq);
        let key = outbox_key(seq);
        let Some(bytes) = turn.get(&key).await? else {
            return Ok(());
        };
        let out = self.memo.outbox.take(&key, &bytes)?;
        tracing::warn!(agent = %self.id, msg = %out.entry.msg_id, to = %out.to, %cause, "giving up a delivery");
        self.release_pair(turn, &out.to, out.entry.pair).await?;
        turn.delete(key)?;
        self.state.boxes.outbox_len = self.state.boxes.outbox_len.saturating_sub(1);
        let InboxBody::Task { task_id, .. } = &out.entry.body else {
            return Ok(());
        };
        // Deliver the failure to itself, through its own inbox (deduplicated by task).
        let entry = InboxEntry {
            msg_id: format!("{task_id}.undeliverable"),
            from: None,
            body: InboxBody::TaskUpdate {
                task_id: task_id.clone(),
                state,
                text: cause,
            },
            context: result_context(&out.entry.context, out.entry.context.deadline()),
            budget: out.entry.budget,
            pair: None,
        };
        self.enqueue(turn, entry).await.map(|_| ())
    }

    /// On this activation's first request: if the snapshot it was created from counts
    /// pending inbox or outbox entries, tells itself a fresh `Resume` (unless the request
    /// is one). Wake-ups are in-memory self-tells, so an activation that replaced one on
    /// a node that died (or lost its lease) would otherwise never process or deliver
    /// them; resuming is idempotent, so a second `Resume` (from `resume_pending` at a
    /// node's start) is harmless.
    pub(crate) async fn resume_at_activation(
        &mut self,
        turn: &mut Turn,
        command: &AgentCommand,
    ) -> Result<(), ActorError> {
        if self.resumed {
            return Ok(());
        }
        self.resumed = true;
        if matches!(command, AgentCommand::Resume { .. }) {
            return Ok(());
        }
        let boxes = &self.state.boxes;
        if boxes.inbox_len == 0 && boxes.outbox_len == 0 {
            return Ok(());
        }
        let resume = AgentCommand::Resume {
            inbox_after: None,
            outbox_after: None,
        };
        // Not this request's failure: with its mailbox full (the wake-up refused
        // `Busy`) the request goes on, and the next one tries again.
        if let Err(error) = turn.caller().tell(&self.id, resume.encode(), WAKE_TIMEOUT).await {
            tracing::debug!(agent = %self.id, %error, "could not resume pending entries; trying again at the next request");
            self.resumed = false;
        }
        Ok(())
    }

    /// Re-schedules pending entries (after a restart): up to [`AGENT_RESUME_BATCH`] of
    /// each box, then continues in a later turn.
    async fn resume(
        &mut self,
        turn: &mut Turn,
        inbox_after: Option<u64>,
        outbox_after: Option<u64>,
    ) -> Result<(), ActorError> {
        if inbox_after.is_none() && outbox_after.is_none() {
            // A fresh resume re-sends every delivery, also those this activation believes
            // in flight (a delivery task whose report was lost would otherwise hold its
            // seq here until the activation ends; a second delivery is deduplicated).
            self.relaying.clear();
            let now = turn.now();
            self.process_told.retain(|_, deadline| !deadline.has_passed(now));
        }
        // Its own mailbox full (a wake-up refused `Busy`), a resume stops where it got
        // to and goes on shortly from outside the turn: failing the turn instead would
        // rebuild the actor, whose next request resumes again into the same full mailbox
        // (seen under the simulator: a loop at one virtual instant, each round spawning
        // delivery tasks again, until memory ran out).
        let after = inbox_after.map(inbox_key);
        let inbox = turn.scan("inbox/", after.as_deref(), AGENT_RESUME_BATCH).await?;
        let mut next_inbox = inbox_after;
        for (key, bytes) in &inbox {
            let entry = InboxEntry::decode(key, bytes)?;
            let seq = seq_of(key).ok_or_else(|| ActorError::failed(format!("bad inbox key {key}")))?;
            // Told already and still queued: a second would be a turn that finds the
            // entry gone (on a slow disk the sweep's rounds piled them up).
            if self.process_queued(seq, turn.now()) {
                next_inbox = Some(seq);
                continue;
            }
            if !told(self.try_schedule_process(turn, seq, &entry.context).await)? {
                self.resume_later(next_inbox, outbox_after);
                return Ok(());
            }
            next_inbox = Some(seq);
        }
        let more_inbox = inbox.len() == AGENT_RESUME_BATCH;
        let inbox_rest = if more_inbox { next_inbox } else { Some(u64::MAX) };
        let after = outbox_after.map(outbox_key);
        let outbox = turn.scan("outbox/", after.as_deref(), AGENT_RESUME_BATCH).await?;
        let mut next_outbox = outbox_after;
        for (key, _) in &outbox {
            let seq = seq_of(key).ok_or_else(|| ActorError::failed(format!("bad outbox key {key}")))?;
            let relay = AgentCommand::Relay { seq }.encode();
            if !told(turn.caller().tell(&self.id, relay, WAKE_TIMEOUT).await)? {
                self.resume_later(inbox_rest, next_outbox);
                return Ok(());
            }
            next_outbox = Some(seq);
        }
        let more_outbox = outbox.len() == AGENT_RESUME_BATCH;
        if more_inbox || more_outbox {
            let outbox_rest = if more_outbox { next_outbox } else { Some(u64::MAX) };
            let next = AgentCommand::Resume {
                inbox_after: inbox_rest,
                outbox_after: outbox_rest,
            };
            if !told(turn.caller().tell(&self.id, next.encode(), WAKE_TIMEOUT).await)? {
                self.resume_later(inbox_rest, outbox_rest);
            }
        }
        Ok(())
    }

    /// Schedules inbox entries from `seq` on through a `Resume` told from a task of its
    /// own ([`wake_later`]), for a turn whose wake-up of `seq` was refused `Busy` (its own
    /// mailbox full): the turn commits what it wrote instead of failing for it. Entries
    /// whose `Process` is still queued are skipped by the resume.
    fn resume_inbox_later(&self, seq: u64) {
        let resume = AgentCommand::Resume {
            inbox_after: seq.checked_sub(1),
            // Past every outbox entry: this resume is about the inbox only.
            outbox_after: Some(u64::MAX),
        };
        wake_later(&self.shared, self.id.clone(), resume.encode());
    }

    /// Tells this agent, from a task outside any turn, to `Resume` after `inbox_after`
    /// and `outbox_after` in [`AGENT_DELIVERY_RETRY_MS`] (a few tries while its mailbox
    /// stays full; then the next activation, start or sweep resumes).
    fn resume_later(&self, inbox_after: Option<u64>, outbox_after: Option<u64>) {
        let Some(runtime) = self.shared.runtime() else {
            return;
        };
        let id = self.id.clone();
        let resume = AgentCommand::Resume {
            inbox_after,
            outbox_after,
        }
        .encode();
        tokio::spawn(async move {
            for _ in 0..REPORT_ATTEMPTS {
                tokio::time::sleep(Duration::from_millis(AGENT_DELIVERY_RETRY_MS)).await;
                match runtime
                    .tell(&id, resume.clone(), runtime.deadline_in(WAKE_TIMEOUT))
                    .await
                {
                    Ok(()) | Err(InvokeError::Shutdown) => return,
                    Err(_busy) => {}
                }
            }
            tracing::warn!(agent = %id, "could not go on resuming pending entries; the next resume will");
        });
    }

    /// `AgentClient::delegate` and `AgentClient::notify_as`: this agent sends, with the
    /// same admission as its tools.
    async fn send_from_api(
        &mut self,
        turn: &mut Turn,
        to: &str,
        text: &str,
        timeout_ms: Option<u64>,
        task: bool,
    ) -> Result<Bytes, ActorError> {
        let clock = turn.clock();
        // The send's own deadline, not this command's: an approval it needs is waited
        // for (in the outbox) until then.
        let deadline = task_deadline(clock.now(), timeout_ms);
        let admitted = crate::org_store::admit_send(&self.shared, &clock, &self.id, to, text, deadline, task).await;
        let approval = match admitted {
            Ok(approval) => approval,
            Err(InboxError::NotPermitted(refused)) => return Ok(encode_reply(&SendReply::NotPermitted(refused))),
            Err(other) => return Err(ActorError::failed(other.to_string())),
        };
        let mut sends = self.pending_sends();
        let queued = queue_send(
            turn.caller(),
            &self.shared,
            &mut sends,
            to,
            text,
            deadline,
            task,
            approval,
        );
        if let (Err(_), Some(id)) = (&queued, approval) {
            crate::org_store::withdraw_approval(&self.shared, &clock, id).await;
        }
        let reply = match queued {
            Ok(id) => {
                self.flush_sends(turn, sends).await?;
                SendReply::Sent(id)
            }
            Err(InboxError::Refused(refused)) => SendReply::Refused(refused),
            Err(InboxError::OutboxFull { limit, .. }) => SendReply::OutboxFull { limit },
            Err(InboxError::InvalidAgentId { agent_id, cause }) => SendReply::InvalidAgentId { agent_id, cause },
            Err(other) => return Err(ActorError::failed(other.to_string())),
        };
        Ok(encode_reply(&reply))
    }

    /// Cancels a task this agent delegated: queues a cancellation to its delegatee. The
    /// task resolves when the delegatee answers: canceled if it had not started, else
    /// with its result.
    async fn cancel(&mut self, turn: &mut Turn, task_id: &str) -> Result<Bytes, ActorError> {
        if task_id.len() > crate::limits::AGENT_TASK_ID_LENGTH_MAX_BYTES {
            // No delegation has such an id (and its key would not fit in the store's).
            return Ok(encode_reply(&SendReply::UnknownTask));
        }
        let key = task_key(task_id);
        let Some(bytes) = turn.get(&key).await? else {
            return Ok(encode_reply(&SendReply::UnknownTask));
        };
        let record = self.memo.tasks.decode(&key, &bytes)?;
        if record.state.is_final() {
            return Ok(encode_reply(&SendReply::AlreadyFinal(record.state)));
        }
        let mut sends = self.pending_sends();
        let body = InboxBody::Cancel {
            task_id: task_id.to_string(),
        };
        sends.push_raw(record.to.clone(), body, CallContext::root(record.deadline));
        self.flush_sends(turn, sends).await?;
        Ok(encode_reply(&SendReply::CancelSent))
    }
}

/// Admission, then queues a notification or task from the turn of `caller`, due by
/// `deadline` (waiting in the outbox for pending approval `approval`, if given, until
/// then); returns the message (task) id.
#[allow(clippy::too_many_arguments)]
fn queue_send(
    caller: &troupe_runtime::Caller,
    shared: &crate::agent::AgentShared,
    sends: &mut PendingSends,
    to: &str,
    text: &str,
    deadline: troupe_core::Deadline,
    task: bool,
    approval: Option<u64>,
) -> Result<String, InboxError> {
    let target = agent_id(to).map_err(|error| InboxError::InvalidAgentId {
        agent_id: to.to_string(),
        cause: error.to_string(),
    })?;
    // The call rules (cycle, depth, known agent, in-flight cap, time left) give the
    // chain and depth the target will work under; the slot is not held: nothing waits.
    let admitted = caller.admit(&target, shared.directory.contains(to), None)?;
    let child = admitted.child().with_deadline(deadline);
    drop(admitted);
    sends.push(target, text, task, child, caller.context(), approval)
}

/// What a send from a tool queued.
pub(crate) struct Queued {
    /// The message (task) id.
    pub(crate) id: String,
    /// The pending approval it waits for in the outbox, if any.
    pub(crate) approval: Option<u64>,
}

/// Queues a send from a tool of the running turn; one that needs approval is queued
/// with its pending approval (the turn does not wait for it).
pub(crate) async fn tool_send(
    context: &ToolExecutionContext,
    to: &str,
    text: &str,
    timeout_ms: Option<u64>,
    task: bool,
) -> Result<Queued, InboxError> {
    let clock = context.clock();
    // The send's own deadline, not the turn's: an approval it needs is waited for (in
    // the outbox, after the turn) until then.
    let deadline = task_deadline(clock.now(), timeout_ms);
    let approval =
        crate::org_store::admit_send(context.shared(), &clock, context.agent_id(), to, text, deadline, task).await?;
    let queued = queue_tool_send(context, to, text, deadline, task, approval);
    if let (Err(_), Some(id)) = (&queued, approval) {
        // Recorded but not queued (the outbox full, the budget spent, a call rule):
        // nobody saw it and nothing will wait for it.
        crate::org_store::withdraw_approval(context.shared(), &clock, id).await;
    }
    queued.map(|id| Queued { id, approval })
}

/// The checks and the queueing of [`tool_send`] after admission, charging the send's
/// budget grant when it is queued.
fn queue_tool_send(
    context: &ToolExecutionContext,
    to: &str,
    text: &str,
    deadline: troupe_core::Deadline,
    task: bool,
    approval: Option<u64>,
) -> Result<String, InboxError> {
    let Some(sends) = context.sends() else {
        return Err(InboxError::Invoke(InvokeError::Rejected {
            target: context.agent_id().clone(),
            reason: "this turn cannot send messages".to_string(),
        }));
    };
    // Its turn runs later, after this one has replied: the grant is charged whole.
    let grant = context.budget().grant_for_send()?;
    let mut sends = sends.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let queued = queue_send(
        context.caller(),
        context.shared(),
        &mut sends,
        to,
        text,
        deadline,
        task,
        approval,
    );
    if queued.is_ok() {
        if let Some((_, out)) = sends.entries.last_mut() {
            out.entry.budget = grant;
        }
        context.budget().settle(grant, Spend::all_of(grant));
    } else {
        context.budget().settle(grant, Spend::default());
    }
    queued
}

/// The arguments of `delegate_to_agent` and `notify_agent`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SendArguments {
    /// The id of the agent.
    #[schemars(length(min = 1, max = ACTOR_KEY_LENGTH_MAX))]
    pub agent_id: String,
    /// The task or the notification.
    #[schemars(length(max = AGENT_MESSAGE_SIZE_MAX_BYTES))]
    pub message: String,
    /// Its deadline, in milliseconds from now (default 120000, at most 300000).
    #[schemars(range(min = 1))]
    #[serde(
        default,
        deserialize_with = "crate::call_agent::call_agent_timeout_whole_milliseconds"
    )]
    pub timeout_ms: Option<u64>,
}

/// Writes the empty record `key` (a dedupe mark, `seen/`, or a cancellation's
/// tombstone, `canceled/`) into the window of the newest [`AGENT_DEDUPE_KEYS_KEPT_MAX`]
/// such keys, deleting the key whose slot it takes (if still there), in this turn's
/// commit (`boxes` are committed with it too).
async fn keep_in_window(turn: &mut Turn, boxes: &mut BoxCounters, key: String) -> Result<(), ActorError> {
    let slot = dedupe_slot_key(boxes.dedupe_next % AGENT_DEDUPE_KEYS_KEPT_MAX);
    if let Some(evicted) = turn.get(&slot).await? {
        let evicted = String::from_utf8_lossy(&evicted).into_owned();
        if evicted != key {
            turn.delete(evicted)?;
        }
    }
    turn.put(slot, Bytes::from(key.clone()))?;
    turn.put(key, Bytes::new())?;
    boxes.dedupe_next += 1;
    Ok(())
}

/// Adds the numbers `skipped` (jumped over by an ordered entry from `from` taken
/// past a gap) to `from`'s skipped numbers, in this turn's commit, dropping the ranges
/// that no longer matter (see [`PairSkipped`]).
async fn record_skipped(
    turn: &mut Turn,
    from: &ActorId,
    skipped: Option<std::ops::Range<u64>>,
) -> Result<(), ActorError> {
    let Some(skipped) = skipped else {
        return Ok(());
    };
    let key = pair_skip_key(from);
    let mut record = skipped_of(turn, &key).await?;
    record.add(skipped, turn.now());
    turn.put(key, to_json(&record)?)?;
    Ok(())
}

/// The skipped numbers stored at `key` (`pair_skip/{sender}`; none if nothing is).
async fn skipped_of(turn: &mut Turn, key: &str) -> Result<PairSkipped, ActorError> {
    Ok(match turn.get(key).await? {
        Some(bytes) => from_json(key, &bytes)?,
        None => PairSkipped::default(),
    })
}

/// The tool error for a task or notification to `to` when it names a remote agent (and
/// no local one): a remote A2A agent can only be asked, with `call_agent`; without
/// this the model read "agent not found" for an agent its prompt lists.
fn remote_send_refusal(context: &ToolExecutionContext, tool: &str, to: &str) -> Option<ToolError> {
    let shared = context.shared();
    (!shared.directory.contains(to) && shared.remotes.get(to).is_some()).then(|| {
        ToolError::failed(
            tool,
            format!(
                "{to} is an agent on another server: it can only be asked, with call_agent \
                 (a remote agent cannot be sent a task or a notification); nothing was sent"
            ),
        )
    })
}

/// The `delegate_to_agent` tool, registered for every agent.
pub(crate) fn delegate_tool() -> Tool {
    Tool::typed::<SendArguments, _, _>(
        DELEGATE_TOOL_NAME,
        "Hand a task to another agent and continue at once: returns a task id; the result \
         (or failure) comes back to you later as a new message. Sent when your turn ends.",
        |context, arguments: SendArguments| async move {
            if let Some(refused) = remote_send_refusal(&context, DELEGATE_TOOL_NAME, &arguments.agent_id) {
                return Err(refused);
            }
            tool_send(
                &context,
                &arguments.agent_id,
                &arguments.message,
                arguments.timeout_ms,
                true,
            )
            .await
            .map(|queued| match queued.approval {
                None => format!(
                    "delegated as task {}; the result will come back as a message",
                    queued.id
                ),
                Some(approval) => format!(
                    "task {} is pending approval {approval}: it is sent once approved; if it is \
                     denied (or not approved in time) the denial comes back as the task's result",
                    queued.id
                ),
            })
            .map_err(|error| ToolError::failed(DELEGATE_TOOL_NAME, error.to_string()))
        },
    )
}

/// The `notify_agent` tool, registered for every agent.
pub(crate) fn notify_tool() -> Tool {
    Tool::typed::<SendArguments, _, _>(
        NOTIFY_TOOL_NAME,
        "Send another agent a notification (no answer comes back). Sent when your turn ends.",
        |context, arguments: SendArguments| async move {
            if let Some(refused) = remote_send_refusal(&context, NOTIFY_TOOL_NAME, &arguments.agent_id) {
                return Err(refused);
            }
            tool_send(
                &context,
                &arguments.agent_id,
                &arguments.message,
                arguments.timeout_ms,
                false,
            )
            .await
            .map(|queued| match queued.approval {
                None => format!("notification {} queued", queued.id),
                Some(approval) => format!(
                    "notification {} is pending approval {approval}: it is sent only once approved",
                    queued.id
                ),
            })
            .map_err(|error| ToolError::failed(NOTIFY_TOOL_NAME, error.to_string()))
        },
    )
}

/// The JSON schema of the `delegate_to_agent` and `notify_agent` arguments.
pub fn send_schema() -> serde_json::Value {
    tool_parameters_schema::<SendArguments>()
}

/// The span of a delivery task (an outbox entry's, or a conversation's mention): a root
/// span (a child would hold the relaying turn's span open until the delivery ends, which
/// may be the entry's deadline), started in the entry's exported trace when it has one
/// (so the turns the delivery leads to, at the target and back at the sender, are
/// exported in the trace of the request that sent the entry), and following from the
/// relaying turn's span.
pub(crate) fn delivery_span(from: &ActorId, to: &dyn std::fmt::Display, entry: &InboxEntry) -> tracing::Span {
    let trace = entry.context.trace_id();
    let span = tracing::info_span!(
        parent: None,
        "deliver",
        from = %from,
        to = %to,
        msg = %entry.msg_id,
        trace_id = trace.map(tracing::field::display),
    );
    span.follows_from(tracing::Span::current());
    if let Some(trace) = trace {
        crate::export_hooks::start_in_trace(&span, trace);
    }
    span
}

/// Delivers one outbox entry from outside any turn: retries until acknowledged, until
/// its deadline (results: forever, while the target exists), or until the runtime stops;
/// then reports to the sender (`Delivered` or `Undeliverable`; if that report is lost,
/// the entry stays in the outbox and the next resume delivers it again, deduplicated).
async fn deliver(
    runtime: troupe_runtime::RuntimeHandle,
    shared: std::sync::Arc<crate::agent::AgentShared>,
    sender: troupe_core::ActorId,
    seq: u64,
    out: OutboxEntry,
) {
    // An ordered entry's payload is encoded at each attempt (with the `low` of that
    // moment), so not here.
    let mut payload = match out.entry.pair {
        None => AgentCommand::Enqueue(out.entry.clone()).encode(),
        Some(_) => Bytes::new(),
    };
    let is_result = matches!(out.entry.body, InboxBody::TaskUpdate { .. });
    if let Some(approval) = out.approval {
        if let Some(refused) = await_send_approval(&runtime, &shared, &sender, seq, &out, approval).await {
            report(&runtime, &sender, seq, refused).await;
            return;
        }
    }
    let report_command = loop {
        let target_known = shared.directory.contains(out.to.key());
        // No attempt starts past the deadline (a result has none of its own): one that
        // passed during the pause, or while the process was down, is given up here, not
        // acknowledged by a target that would only drop it (`MessageSent` told for
        // nothing) or fail it unworked.
        if !is_result && out.entry.context.deadline().has_passed(runtime.now()) {
            break AgentCommand::Undeliverable {
                seq,
                cause: "the deadline passed before it could be delivered".to_string(),
                state: TaskState::Failed,
            };
        }
        // An ordered entry carries, at each attempt, the sender's lowest entry to the
        // target still pending (read from the store: the sender's committed record).
        let mut pause = Duration::from_millis(AGENT_DELIVERY_RETRY_MS);
        if let Some(pair) = out.entry.pair {
            match pending_low(&runtime, &sender, &out.to).await {
                Ok(low) => {
                    let mut entry = out.entry.clone();
                    entry.pair = Some(PairSeq { low, ..pair });
                    payload = AgentCommand::Enqueue(entry).encode();
                }
                Err(error) => {
                    // Ordered entries are notifications and tasks, which have a deadline.
                    if out.entry.context.deadline().has_passed(runtime.now()) {
                        break AgentCommand::Undeliverable {
                            seq,
                            cause: format!("the deadline passed before it could be delivered ({error})"),
                            state: TaskState::Failed,
                        };
                    }
                    tokio::time::sleep(pause).await;
                    continue;
                }
            }
        }
        let result = if target_known {
            runtime
                .invoke_routed_within(
                    &out.to,
                    payload.clone(),
                    Duration::from_millis(AGENT_DELIVERY_ACK_TIMEOUT_MS),
                )
                .await
        } else if shared.defined.was_removed(out.to.key()) {
            // Refused as the removed agent's draining activation refuses an append: the
            // reason says it was removed and what to do, not that it never existed.
            Err(InvokeError::Rejected {
                target: out.to.clone(),
                reason: removed_refusal(out.to.key()),
            })
        } else {
            Err(InvokeError::Refused(CallRefused::AgentNotFound {
                target: out.to.clone(),
            }))
        };
        let permanent = match result {
            Ok(reply) => match bincode::deserialize::<EnqueueReply>(&reply) {
                Ok(EnqueueReply::Accepted { .. } | EnqueueReply::Duplicate) => {
                    break AgentCommand::Delivered { seq };
                }
                Ok(EnqueueReply::Full { .. }) => None,
                Ok(EnqueueReply::OutOfOrder { .. }) => {
                    // An earlier entry is on its way: usually there a moment later.
                    pause = Duration::from_millis(AGENT_DELIVERY_OUT_OF_ORDER_RETRY_MS);
                    None
                }
                Ok(EnqueueReply::Stale { expected }) => Some(format!(
                    "{} already took a later message from {sender} (expected #{expected}): this one was given up",
                    out.to
                )),
                Err(error) => Some(format!("malformed acknowledgement: {error}")),
            },
            Err(InvokeError::Shutdown) => return, // resumed at the next start
            Err(
                error @ (InvokeError::Refused(CallRefused::AgentNotFound { .. })
                | InvokeError::ActorNotFound { .. }
                | InvokeError::Rejected { .. }),
            ) => Some(error.to_string()),
            Err(_transient) => None,
        };
        match permanent {
            Some(cause) if !is_result || !target_known => {
                break AgentCommand::Undeliverable {
                    seq,
                    cause,
                    state: TaskState::Rejected,
                }
            }
            _ if !is_result && out.entry.context.deadline().has_passed(runtime.now()) => {
                break AgentCommand::Undeliverable {
                    seq,
                    cause: "the deadline passed before it could be delivered".to_string(),
                    state: TaskState::Failed,
                }
            }
            _ => tokio::time::sleep(pause).await,
        }
    };
    let delivered = matches!(report_command, AgentCommand::Delivered { .. });
    let reply = report(&runtime, &sender, seq, report_command).await;
    // Told by the report that took the entry off the outbox, not by each acknowledged
    // attempt: another delivery task of the same entry (one a later activation resumed
    // while this one waited), or an attempt of an entry given up meanwhile (answered
    // `Duplicate` by a receiver that no longer knows it skipped it), finds no entry.
    if delivered && reply.as_deref() == Some(DELIVERED_FOUND) {
        shared.emit(&AgentEvent::MessageSent {
            msg_id: out.entry.msg_id.clone(),
            from: Some(sender.clone()),
            to: out.to.clone(),
            kind: out.entry.body.kind(),
            at: runtime.now(),
        });
    }
}

/// The reason a removed agent's unworked task is rejected with.
pub(crate) fn removed_before_work(agent: &str) -> String {
    format!("agent {agent} was removed before it worked this task")
}

/// The reason a request to a removed agent is refused with (an ask, or an entry for its
/// inbox: refused by its draining activation, or by its sender's delivery once the
/// removal is known there), saying what to do.
pub(crate) fn removed_refusal(agent: &str) -> String {
    format!("agent {agent} was removed; define it again to call it")
}

/// The reply to a `Delivered` report that found its outbox entry and took it off (an
/// empty reply: it was gone already).
const DELIVERED_FOUND: &[u8] = &[1];

/// `sender`'s lowest ordered entry to `target` still pending (`u64::MAX` if none: an
/// attempt of an entry given up meanwhile, which the target then refuses as stale).
async fn pending_low(
    runtime: &troupe_runtime::RuntimeHandle,
    sender: &ActorId,
    target: &ActorId,
) -> Result<u64, String> {
    let key = pair_out_key(target);
    let bytes = runtime
        .store()
        .get(sender, &key)
        .await
        .map_err(|error| error.to_string())?;
    let Some(bytes) = bytes else {
        return Ok(u64::MAX);
    };
    let record = PairOut::decode(&key, &bytes).map_err(|error| error.to_string())?;
    Ok(record.pending.first().copied().unwrap_or(u64::MAX))
}

/// Waits (outside any turn) for the approval an outbox entry needs, until the entry's
/// deadline; `None` when it may be delivered, else the `Undeliverable` report: denied or
/// refused by the organisation of that moment → `rejected`; still pending at the
/// deadline → `failed`. The organisation's store being unavailable is retried until the
/// deadline.
async fn await_send_approval(
    runtime: &troupe_runtime::RuntimeHandle,
    shared: &crate::agent::AgentShared,
    sender: &troupe_core::ActorId,
    seq: u64,
    out: &OutboxEntry,
    approval: u64,
) -> Option<AgentCommand> {
    let task = matches!(out.entry.body, InboxBody::Task { .. });
    let message = match &out.entry.body {
        InboxBody::Task { text, .. } | InboxBody::Notify { text } => text.as_str(),
        _ => "",
    };
    let contact = crate::org_store::Contact {
        from: sender,
        to: &out.to,
        kind: crate::org_store::send_kind(task),
        message,
        deadline: out.entry.context.deadline(),
    };
    let refused = crate::org_store::await_approval_outside_turn(runtime, shared, &contact, approval)
        .await
        .err()?;
    let state = match refused.reason {
        crate::NotPermittedReason::ApprovalTimedOut { .. } | crate::NotPermittedReason::Unavailable { .. } => {
            TaskState::Failed
        }
        _ => TaskState::Rejected,
    };
    Some(AgentCommand::Undeliverable {
        seq,
        cause: format!("not permitted: {refused}"),
        state,
    })
}

/// Reports a delivery's outcome to its sender (a few attempts; if all fail, the entry
/// stays in the outbox and the next resume delivers it again, deduplicated). Routed
/// (`invoke_routed`): on a cluster the sender may have moved to another node since
/// this delivery task started. Returns the sender's reply, or `None` if the report did
/// not get through.
async fn report(
    runtime: &troupe_runtime::RuntimeHandle,
    sender: &troupe_core::ActorId,
    seq: u64,
    report: AgentCommand,
) -> Option<Bytes> {
    let deadline = runtime.deadline_in(WAKE_TIMEOUT);
    for _ in 0..REPORT_ATTEMPTS {
        match runtime.invoke_routed(sender, report.encode(), deadline).await {
            Ok(reply) => return Some(reply),
            Err(InvokeError::Shutdown) => return None,
            Err(_busy) => tokio::time::sleep(Duration::from_millis(AGENT_DELIVERY_RETRY_MS)).await,
        }
    }
    tracing::warn!(agent = %sender, seq, "could not report a delivery; the next resume delivers it again");
    None
}

/// How often a delivery task tries to report its outcome to the sender.
const REPORT_ATTEMPTS: u32 = 10;

#[cfg(test)]
#[path = "inbox_order_tests.rs"]
mod order_tests;

#[cfg(test)]
#[path = "inbox_retention_tests.rs"]
mod retention_tests;
