//! The agent layer's limits, as named constants with their unit last.
//!
//! The limits of calls between agents (depth, timeouts, concurrency) live in
//! `troupe_core::limits` because admission is decided there; these are the agent's own.

use troupe_core::limits::{AGENT_CALL_TIMEOUT_MS_MAX, INVOKE_TIMEOUT_MS_MAX};

/// Most model steps (LLM calls) in one turn; a turn that still asks for tools after this
/// many steps fails. An agent's own `max_steps` is at most this
/// ([`crate::AgentSpec::validate`]).
pub const AGENT_TURN_STEPS_MAX: u32 = 8;
/// Fewest model steps an agent's turn may be given (its `max_steps`): one, for the
/// answer.
pub const AGENT_TURN_STEPS_MIN: u32 = 1;
/// Largest inbound message an agent accepts, in bytes; longer ones are truncated on a
/// character boundary.
pub const AGENT_MESSAGE_SIZE_MAX_BYTES: usize = 32 * 1024;
/// Largest reply an agent sends, in bytes; longer ones are truncated on a character
/// boundary and marked `truncated`.
pub const AGENT_REPLY_SIZE_MAX_BYTES: usize = 32 * 1024;
/// Largest arguments of one tool call an agent keeps, in bytes of their JSON text, in
/// its log, its history window and the later steps of its turn (the tool runs on them as
/// the model gave them); longer ones are kept as a JSON string of their text cut on a
/// character boundary. Twice [`AGENT_MESSAGE_SIZE_MAX_BYTES`]: a call that sends a
/// message of that size, its text escaped in JSON, is kept whole.
pub const AGENT_TOOL_CALL_ARGUMENTS_SIZE_MAX_BYTES: usize = 2 * AGENT_MESSAGE_SIZE_MAX_BYTES;
/// Largest tool result fed back to the model, in bytes.
pub const AGENT_TOOL_RESULT_SIZE_MAX_BYTES: usize = 16 * 1024;
/// Messages an agent keeps in its private history window by default (the newest of its
/// log, shown to its model at every turn; the full log is in the store). An agent sets
/// its own with [`crate::AgentSpec::history`].
pub const AGENT_HISTORY_WINDOW_DEFAULT: usize = 64;
/// Fewest messages an agent's history window may hold: a question and its answer.
pub const AGENT_HISTORY_WINDOW_MIN: usize = 2;
/// Most messages an agent's history window may hold. The window lives in the idle
/// activation's memory and is read back from the log in one scan after a restart, so it
/// is bounded well under the store's page (`STATE_SCAN_LIMIT_MAX`, 10,000 entries).
pub const AGENT_HISTORY_WINDOW_MAX: usize = 1_000;

/// Bytes of a turn's future that an agent's or a conversation's activation keeps from
/// one turn to the next (`troupe_runtime::Actor::TURN_FUTURE_KEPT_BYTES_MAX`, whose
/// default is 1,024 B). Their futures are kilobytes (measured 2026-11-30: an agent's
/// about 4,700 B, a conversation's about 3,300 B): within this, a turn reuses its
/// activation's block instead of a `malloc` and a `free` of that much (2,473
/// instructions of a `call_agent` round trip's 95,536, 892 of an agent step's 22,958),
/// and an idle activation holds the block, beside a window of (by default)
/// [`AGENT_HISTORY_WINDOW_DEFAULT`] messages.
pub const AGENT_TURN_FUTURE_KEPT_BYTES_MAX: usize = 8 * 1024;
/// Bytes at which an entry of an agent's log is closed: a turn's messages are written
/// as one entry (a JSON array; a single message alone, as an object) until it holds
/// this many bytes, then the next message starts another. An entry is at most this plus
/// one message.
pub const AGENT_LOG_ENTRY_CLOSE_BYTES: usize = 256 * 1024;
/// Most tool calls of one model step that are executed and kept (in the turn's later
/// steps, its log and its history window); the rest are neither, and the last kept
/// call's result says how many were skipped.
pub const AGENT_TOOL_CALLS_PER_STEP_MAX: usize = 16;
/// Largest tool-call id an agent keeps, in bytes (the call and its result keep the same
/// id). OpenAI's chat completions refuse a longer one in a request ("expected a string
/// with maximum length 40"); its own ids are 29 bytes (`call_` and 24). A longer id is
/// cut on a character boundary and ends in `~{the call's index in its step}`, so the
/// kept ids of one message stay as distinct as the model made them.
pub const AGENT_TOOL_CALL_ID_SIZE_MAX_BYTES: usize = 40;
/// Largest tool name of a call an agent keeps, in bytes, cut on a character boundary:
/// OpenAI's limit on a function's name (64 characters of `[a-zA-Z0-9_-]`), so a longer
/// one names no tool a model can be offered.
pub const AGENT_TOOL_NAME_SIZE_MAX_BYTES: usize = 64;
/// Default time an outside caller waits for an agent's reply, in milliseconds.
pub const AGENT_ASK_TIMEOUT_MS_DEFAULT: u64 = 120_000;
/// Most peers listed in an agent's system message (the directory may hold many more;
/// `call_agent` reaches any of them).
pub const AGENT_PEERS_LISTED_MAX: usize = 32;
/// Most requests and answers a [`crate::ScriptedLlm`] keeps for inspection; older ones are
/// dropped first.
pub const SCRIPTED_LLM_RECORDED_MAX: usize = 100_000;
/// Most agents whose last prompt a [`crate::ScriptedLlm`] keeps counted, so the next
/// one counts only its new parts; past it, the counts start over.
pub const SCRIPTED_LLM_COUNTED_AGENTS_MAX: usize = 1_024;
/// Longest system prompt an agent may have, in bytes.
pub const AGENT_SYSTEM_PROMPT_SIZE_MAX_BYTES: usize = 16 * 1024;
/// Longest role an agent (local or remote) may have, in bytes. A role is listed in the
/// system message of every agent that may contact it (up to [`AGENT_PEERS_LISTED_MAX`]
/// of them), so this bounds what one definition adds to each of theirs.
pub const AGENT_ROLE_SIZE_MAX_BYTES: usize = 1_024;
/// Longest display name an agent may have, in bytes (it is in its own system message).
pub const AGENT_NAME_SIZE_MAX_BYTES: usize = 256;
/// Longest model name an agent may have, in bytes: it goes into every request to the
/// agent's model provider (names such as `gpt-4o-mini-2024-07-18`, a fine-tune's
/// `ft:...` or an `organisation/model` path are well under it).
pub const AGENT_MODEL_NAME_SIZE_MAX_BYTES: usize = 256;

const _: () = assert!(AGENT_TURN_STEPS_MIN >= 1);
const _: () = assert!(AGENT_TURN_STEPS_MIN <= AGENT_TURN_STEPS_MAX);
const _: () = assert!(AGENT_HISTORY_WINDOW_MIN >= 2);
const _: () = assert!(AGENT_HISTORY_WINDOW_MIN <= AGENT_HISTORY_WINDOW_DEFAULT);
const _: () = assert!(AGENT_HISTORY_WINDOW_DEFAULT <= AGENT_HISTORY_WINDOW_MAX);
const _: () = assert!(AGENT_HISTORY_WINDOW_MAX <= troupe_runtime::STATE_SCAN_LIMIT_MAX);
const _: () = assert!(AGENT_ASK_TIMEOUT_MS_DEFAULT <= INVOKE_TIMEOUT_MS_MAX);
const _: () = assert!(AGENT_CALL_TIMEOUT_MS_MAX <= INVOKE_TIMEOUT_MS_MAX);
// A message that fits must also fit as a tool result's worth of reply, and a reply must
// fit into the next agent's inbound message.
const _: () = assert!(AGENT_REPLY_SIZE_MAX_BYTES <= AGENT_MESSAGE_SIZE_MAX_BYTES);
const _: () = assert!(AGENT_TOOL_CALLS_PER_STEP_MAX as u32 > troupe_core::limits::AGENT_CONCURRENT_CALLS_MAX);
// A cut tool-call id keeps room for its suffix (`~` and the call's index in its step).
const _: () = assert!(AGENT_TOOL_CALLS_PER_STEP_MAX <= 1_000);
const _: () = assert!(AGENT_TOOL_CALL_ID_SIZE_MAX_BYTES >= 2 * "~999".len());

/// Entries one agent's durable inbox holds; one more notification or task is refused
/// with [`crate::InboxError::Full`] at append time (never dropped). Results of the
/// agent's own delegations are always accepted: [`AGENT_TASKS_OPEN_MAX`] bounds them.
pub const AGENT_INBOX_CAPACITY: u64 = 256;
/// Dedupe keys one agent keeps, the newest ones: the marks (`seen/`) of the messages
/// that need one (a notification with an id from outside, a conversation mention, a
/// cancellation) and the tombstones of cancellations that found no task
/// (`canceled/`). The oldest goes when one more is written, so a copy of a message
/// that comes after this many newer keys is taken again (as the runtime's idempotency
/// keys keep a window of [`troupe_runtime::IDEMPOTENCY_KEYS_KEPT_MAX`]), and a task
/// that comes that late after its cancellation runs. Agents' own notifications, tasks
/// and results need no mark (`inbox.rs`); external tasks keep theirs until forgotten.
pub const AGENT_DEDUPE_KEYS_KEPT_MAX: u64 = 4_096;
/// Delegations one agent may have open (delegated, not yet resolved); one more is
/// refused.
pub const AGENT_TASKS_OPEN_MAX: u64 = 64;
/// The longest id of a task an agent delegated, in bytes: `{delegator}.{seq}`, an agent
/// id of at most `ACTOR_KEY_LENGTH_MAX` bytes, a dot and a `u64` in decimal (20 digits
/// at most). A longer id names no task: [`crate::AgentClient::cancel`] answers
/// [`crate::InboxError::UnknownTask`] and [`crate::AgentClient::task`] `None` for it
/// (its record's key would not fit in the store's).
pub const AGENT_TASK_ID_LENGTH_MAX_BYTES: usize = troupe_core::limits::ACTOR_KEY_LENGTH_MAX + 1 + 20;
/// The longest id a caller may give a message it sends an agent from outside (a
/// notification's `msg_id`, an external task's `msg_id`), in bytes: the agent keeps it
/// in the key of its dedupe mark (`seen/{msg_id}`), which the store limits to
/// `STATE_KEY_LENGTH_MAX` bytes. A longer one is refused with
/// [`crate::InboxError::MessageIdTooLong`] before anything is sent (it failed in the
/// store before, as a storage error that said to retry).
pub const AGENT_MESSAGE_ID_LENGTH_MAX_BYTES: usize = troupe_runtime::STATE_KEY_LENGTH_MAX - "seen/".len();
/// External tasks ([`crate::AgentClient::delegate_external`]) one agent holds not yet
/// ended (waiting or running), at most; one more is refused with
/// [`crate::InboxError::Full`] and nothing is kept.
pub const AGENT_EXTERNAL_TASKS_OPEN_MAX: u64 = 64;
/// External task records one [`crate::AgentClient::external_tasks`] page returns, at most.
pub const AGENT_EXTERNAL_TASKS_PAGE_MAX: usize = 256;
/// Entries one agent's outbox holds (notifications, tasks, results and cancellations
/// not yet acknowledged by their target); one more is refused.
pub const AGENT_OUTBOX_CAPACITY: u64 = 256;
/// How long a delivery waits for the target's acknowledgement (= persisted) of one
/// append, in milliseconds, before it retries: the append queues behind the target's
/// running turn (a model call), so this is as long as a long model turn. Delivery
/// tasks wait outside any turn, so the wait blocks no agent.
pub const AGENT_DELIVERY_ACK_TIMEOUT_MS: u64 = 30_000;
/// How long a recorded `call_agent` exchange waits, in milliseconds, before its direct
/// conversation is woken to store it (`call_record.rs`): every exchange of the pair
/// recorded in that time is stored by one conversation turn and one commit, off the
/// call's path. A read of the conversation through the API stores the waiting ones
/// first; a crash loses at most this much of them (a record is best effort).
pub const CALL_RECORD_FLUSH_DELAY_MS: u64 = 5;
/// Recorded exchanges one direct conversation holds in memory waiting to be stored, at
/// most; one more is dropped with a warning (a record is best effort; the call's answer
/// is not affected).
pub const CALL_RECORDS_PENDING_MAX: usize = 4_096;
/// How long [`crate::AgentSystem::shutdown`] waits, in milliseconds, for each direct
/// conversation to store its waiting records before the runtime stops.
pub const CALL_RECORD_SHUTDOWN_FLUSH_TIMEOUT_MS: u64 = 5_000;
/// How long [`crate::AgentSystem::shutdown`] waits, in milliseconds, after the runtime
/// stopped, for this process's delivery tasks to end (each is ended where it waits,
/// an approval or a pause between attempts among them; this bounds the drop of what
/// it was running).
pub const DELIVERY_TASKS_SHUTDOWN_WAIT_MS: u64 = 1_000;
/// The pause before a failed delivery is retried, in milliseconds.
pub const AGENT_DELIVERY_RETRY_MS: u64 = 100;
/// How many times a wake-up that a turn sent to its own agent or conversation (to
/// deliver what it queued) is tried again from a task of its own when the mailbox
/// refused it `Busy`; the pause starts at [`AGENT_DELIVERY_RETRY_MS`] and doubles up to
/// [`AGENT_MENTION_DELIVERY_RETRY_MAX_MS`] (about 75 s in all). After the last, the work
/// waits for the next resume. The turn itself does not fail for a full mailbox.
pub const AGENT_WAKE_RETRY_ATTEMPTS_MAX: u32 = 20;
/// The longest pause between two attempts of one mention's delivery, in milliseconds:
/// the pause starts at [`AGENT_DELIVERY_RETRY_MS`] and doubles after each refused or
/// failed attempt up to this, so the deliveries waiting for a busy agent (a slow disk, a
/// long turn) do not keep its mailbox full of appends that expire before they commit.
pub const AGENT_MENTION_DELIVERY_RETRY_MAX_MS: u64 = 5_000;
/// The pause before a delivery refused as out of order (an earlier entry from the same
/// sender to the same target is still on its way: `EnqueueReply::OutOfOrder`) is
/// retried, in milliseconds: shorter than [`AGENT_DELIVERY_RETRY_MS`], since the
/// earlier one is usually in a moment later.
pub const AGENT_DELIVERY_OUT_OF_ORDER_RETRY_MS: u64 = 20;
/// The first pause before an agent tries again to answer a mention whose answer could
/// not be posted (the conversation unreachable: on a cluster, its node died and no other
/// has taken it yet), in milliseconds; it doubles at each attempt.
pub const AGENT_MENTION_ANSWER_RETRY_MS: u64 = 500;
/// Attempts after the first to answer such a mention (each runs the model again: the
/// failed turn's answer is not kept); after them, or once the mention's deadline (plus
/// the processing grace) has passed, the entry waits for the agent's next resume. With
/// [`AGENT_MENTION_ANSWER_RETRY_MS`], the attempts span 0.5 + 1 + 2 + 4 + 8 = 15.5 s.
pub const AGENT_MENTION_ANSWER_ATTEMPTS_MAX: u32 = 5;
/// The deadline of a delegated task or a notification when none is given, in
/// milliseconds from when it is sent.
pub const AGENT_TASK_TIMEOUT_MS_DEFAULT: u64 = 120_000;
/// The longest deadline of a delegated task or a notification, in milliseconds.
pub const AGENT_TASK_TIMEOUT_MS_MAX: u64 = 300_000;
/// How long a receiver keeps a range of numbers it skipped in one sender's order
/// (`pair_skip/{sender}`, see `inbox::PairSkipped`), in milliseconds from when the
/// range was recorded: the longest an attempt of a skipped entry can still come. Its
/// sender sent it before the entry taken past it, so its deadline is at most
/// [`AGENT_TASK_TIMEOUT_MS_MAX`] after that; its delivery task makes no attempt past
/// its deadline, and an attempt waits at most [`AGENT_DELIVERY_ACK_TIMEOUT_MS`].
pub const AGENT_PAIR_SKIPPED_KEPT_MS: u64 = AGENT_TASK_TIMEOUT_MS_MAX + AGENT_DELIVERY_ACK_TIMEOUT_MS;
/// Ranges of skipped numbers a receiver keeps for one sender (see
/// [`AGENT_PAIR_SKIPPED_KEPT_MS`]), the newest: a backstop for a sender that gives up
/// entries faster than they age out (about 40 bytes each as stored: 40 KiB at most).
/// A range dropped early changes only the answer to a late attempt of its numbers
/// (`Duplicate` instead of `Stale`), never the order: `inbox::PairSkipped`.
pub const AGENT_PAIR_SKIPPED_RANGES_MAX: usize = 1_024;
/// How long the record of a task an agent delegated (`task/{task_id}`) is kept after
/// the task ended, in milliseconds: [`crate::AgentClient::task`] (and the server's
/// `GET /v1/agents/{id}/tasks/{task}`) reads it until then, and answers `None` after.
/// Its result's dedupe does not end with it: a result of a task with no record is a
/// duplicate (every record is written before its task is sent).
pub const AGENT_TASK_RECORD_KEPT_MS: u64 = 3_600_000;
/// Records of ended delegated tasks one turn deletes, at most (their retention passed,
/// see [`AGENT_TASK_RECORD_KEPT_MS`]): a delegation's turn and a result's turn each
/// delete up to this many, so they are deleted faster than delegations make them.
pub const AGENT_TASK_RECORDS_PRUNED_PER_PASS: usize = 16;
/// How long past a delegated task's deadline its delegator waits for the result before
/// it resolves the task `failed` itself, in milliseconds: the time one result delivery
/// can still take after the deadline (the delegatee's turn commits its failure within
/// `PROCESS_GRACE_MS` of it; one delivery attempt then waits at most
/// [`AGENT_DELIVERY_ACK_TIMEOUT_MS`], and a failed one is tried again after
/// [`AGENT_DELIVERY_RETRY_MS`]). A delegatee that accepted a task and never answers (it
/// was removed, or its entry lost) would otherwise hold one of the delegator's
/// [`AGENT_TASKS_OPEN_MAX`] slots for good; a result that comes later is a duplicate.
pub const AGENT_TASK_RESULT_GRACE_MS: u64 = 60_000;
/// How long past an open task's due time (see [`AGENT_TASK_RESULT_GRACE_MS`]) a cluster
/// node that learnt of the task from the store, not from a turn of its delegator (at its
/// start, or in a resume sweep), waits before it reads the delegator's earliest
/// `task_due/` key again and, only if that key is still due, wakes the delegator
/// wherever it lives, in milliseconds. The node that runs the delegator's turns wakes it
/// at the due time itself and its turn deletes the key, so in the usual case the other
/// nodes find it gone and send nothing; when that node died, the first node to look
/// takes the delegator over and resolves the task this much late.
pub const AGENT_OVERDUE_TAKEOVER_DELAY_MS: u64 = 5_000;
/// Overdue delegated tasks (see [`AGENT_TASK_RESULT_GRACE_MS`]) one turn of their
/// delegator resolves `failed`, at most; each one resolved is a result in its inbox, whose
/// turn resolves the next ones.
pub const AGENT_TASKS_OVERDUE_RESOLVED_PER_PASS: usize = 16;
/// Task records an agent indexes a turn, once, when its store has records from before
/// the `task_end/` and `task_due/` indexes (3cd28b6, acfd711) and no
/// `task_index_version` marker: each gets the index key it lacks, in pages of this many
/// (one scan each), by its next turns of any kind, resumed after a crash where the last
/// committed page ended (`task_index_cursor`).
pub const AGENT_TASK_INDEX_MIGRATED_PER_TURN: usize = 64;
/// Inbox or outbox entries one resume turn re-schedules before it continues in the
/// next turn (it must fit in a mailbox: below `MAILBOX_CAPACITY_DEFAULT`).
pub const AGENT_RESUME_BATCH: usize = 16;
/// Events the broadcast stream ([`crate::AgentClient::subscribe`]) buffers per
/// subscriber; a subscriber that falls further behind sees `Lagged`.
pub const AGENT_EVENT_STREAM_CAPACITY: usize = 1_024;
/// A delegated task or a notification sent from a turn with a budget gets its step's
/// share of what is left divided by this (a number, not a unit): its grant is charged
/// whole and never comes back, so the sending turn keeps the rest for its own steps.
pub const AGENT_SEND_GRANT_DIVISOR: u64 = 2;

const _: () = assert!(AGENT_SEND_GRANT_DIVISOR >= 1);
// A task's record (`task/{id}`) fits in the store's key.
const _: () = assert!("task/".len() + AGENT_TASK_ID_LENGTH_MAX_BYTES <= troupe_runtime::STATE_KEY_LENGTH_MAX);
const _: () = assert!(AGENT_TASKS_OPEN_MAX <= AGENT_OUTBOX_CAPACITY);
// An ended task's record outlives every attempt its delegatee's delivery can still make
// within the task's deadline (the longest deadline and the longest wait of one attempt).
const _: () = assert!(AGENT_TASK_RECORD_KEPT_MS >= AGENT_TASK_TIMEOUT_MS_MAX + INVOKE_TIMEOUT_MS_MAX);
const _: () = assert!(AGENT_TASK_RECORDS_PRUNED_PER_PASS >= 2);
// The key of an ended task (`task_end/{at_us:020}/{task_id}`) fits in the store's key.
const _: () =
    assert!("task_end/".len() + 20 + 1 + AGENT_TASK_ID_LENGTH_MAX_BYTES <= troupe_runtime::STATE_KEY_LENGTH_MAX);
// An overdue task waits past its deadline for its delegatee's failure to commit and for
// one delivery attempt of it, and one retry.
const _: () = assert!(
    AGENT_TASK_RESULT_GRACE_MS
        >= crate::inbox_turns::PROCESS_GRACE_MS + AGENT_DELIVERY_ACK_TIMEOUT_MS + AGENT_DELIVERY_RETRY_MS
);
const _: () = assert!(AGENT_TASKS_OVERDUE_RESOLVED_PER_PASS >= 1);
// A takeover waits for the owner's own wake-up and turn, and is not later than the
// overdue task's grace is long.
const _: () = assert!(AGENT_OVERDUE_TAKEOVER_DELAY_MS >= 1);
const _: () = assert!(AGENT_OVERDUE_TAKEOVER_DELAY_MS <= AGENT_TASK_RESULT_GRACE_MS);
const _: () = assert!(AGENT_TASK_INDEX_MIGRATED_PER_TURN >= 1);
const _: () = assert!(AGENT_TASK_INDEX_MIGRATED_PER_TURN <= troupe_runtime::STATE_SCAN_LIMIT_MAX);
// The key of an open task (`task_due/{at_us:020}/{task_id}`) fits in the store's key.
const _: () =
    assert!("task_due/".len() + 20 + 1 + AGENT_TASK_ID_LENGTH_MAX_BYTES <= troupe_runtime::STATE_KEY_LENGTH_MAX);
const _: () = assert!(AGENT_EXTERNAL_TASKS_OPEN_MAX <= AGENT_INBOX_CAPACITY);
const _: () = assert!(AGENT_TASK_TIMEOUT_MS_DEFAULT <= AGENT_TASK_TIMEOUT_MS_MAX);
const _: () = assert!(AGENT_TASK_TIMEOUT_MS_MAX <= troupe_core::limits::INVOKE_TIMEOUT_MS_MAX);
const _: () = assert!(AGENT_RESUME_BATCH * 2 < troupe_core::limits::MAILBOX_CAPACITY_DEFAULT);
/// The shortest period of a resume sweep ([`crate::AgentClient::start_resume_sweep`]),
/// in milliseconds: every round reads three keys per agent and one per conversation.
pub const AGENT_RESUME_SWEEP_MS_MIN: u64 = 100;
/// The longest period of a resume sweep, in milliseconds (an hour).
pub const AGENT_RESUME_SWEEP_MS_MAX: u64 = 3_600_000;
/// The period of the resume sweep a `troupe node` runs, in milliseconds: how long an
/// agent with pending entries whose node died waits, past the dead node's lease, for
/// another node to take it and process them when no request reaches it.
pub const AGENT_RESUME_SWEEP_MS_DEFAULT: u64 = 10_000;
const _: () = assert!(
    AGENT_RESUME_SWEEP_MS_MIN <= AGENT_RESUME_SWEEP_MS_DEFAULT
        && AGENT_RESUME_SWEEP_MS_DEFAULT <= AGENT_RESUME_SWEEP_MS_MAX
);
