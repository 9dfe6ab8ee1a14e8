//! The A2A tasks the server holds: one record per `SendMessage`, with its state in
//! Troupe's task states (which are A2A's), the message that started it, and the agent's
//! reply or the reason it ended otherwise.
//!
//! Each agent has a lane: its A2A tasks run one at a time, in the order they came
//! (the agent takes one turn at a time anyway). A task waits in its lane as
//! `submitted`, and can be canceled until it starts; once `working`, its turn runs to
//! its end (Troupe does not stop a running turn). Watchers see every change through a
//! `watch` channel per task.
//!
//! Durable: every record is written to the store ([`TaskStore`], key space
//! `troupe-a2a/{agent}`, `task/{seq:020}`, or `task/{node}/{seq:020}` on a cluster
//! node) before the client hears of it, and again
//! when it ends; a task's turn is a Troupe external task in the agent's durable inbox
//! (`AgentClient::delegate_external`, deduplicated by the A2A task id). After a
//! restart on the same store the records are read back; one that had not ended goes
//! back in its lane and is handed to the agent again, which finds the task it already
//! holds (running, resumed, or done) instead of a second one.
//!
//! A task id is never given twice to one agent id, by this server or by any other
//! sharing its store (two `troupe serve` processes on one SQLite file, say). The
//! agent's inbox keeps its record of every task it was handed (by id) beyond the A2A
//! records: past a delete of the agent (which deletes the records) and, when forgetting
//! it fails, past the record's end. A task numbered as another one, here or by another
//! server, would be answered with that task's outcome, and run nothing (and overwrite
//! its record). So a task's number is reserved in the store before it is given: an
//! agent's tasks are numbered on their own (`{agent}-task-{n}`), and `seq_next` in its
//! key space (`seq_next/{node}` on a cluster node, which numbers in its own space; one
//! key per agent id, kept when the agent is deleted) is the number below which every
//! number has been reserved by some server. A server reserves
//! [`A2A_TASK_NUMBERS_RESERVED`] numbers at a time ([`TaskStore::reserve_numbers`]):
//! it reads `seq_next` and commits it raised by the block under the key space's fence.
//! The store has no compare-and-swap, but its fence is a conditional write: a commit
//! is refused ([`StoreError::Fenced`]) if anyone claimed the key space after the fence
//! it is made under, and every writer of it claims before it writes, so a commit that
//! succeeds had no other write between its read and itself: two servers never reserve
//! the same numbers (one fenced out reads again under a new claim). The block is then
//! given to the agent's tasks from memory ([`TaskRegistry::create`]): one store write
//! per block, none per task beyond the task's own record, where a reservation per task
//! would add a read and a write, and under two servers a claim, to every send. The
//! cost: the numbers left of a block when the server stops, when the agent is deleted,
//! or when a newer block replaces it are never given (ids have gaps). A server of a
//! version before this wrote `seq_next` with every record, from its own count: mixed
//! with this one on a store it can lower it and give numbers again.
//!
//! A message sent again (the same `messageId` to the same agent, with the same parts)
//! is the task it started, while the server keeps that task: a client that retries a
//! send after a lost answer gets the first task, and the agent runs once. The same id
//! with other parts is refused. A task that ended with a refusal to retry (`busy`: the
//! agent was busy, or the task could not be stored) is not reused: its message sent
//! again starts a new task.
//!
//! A store down for a moment ([`StoreError::Unavailable`]: PostgreSQL restarting, a
//! connection refused, SQLite's file locked) is tried again, as the runtime tries its
//! own operations ([`troupe_runtime::RuntimeHandle::retry_store`]), within the deadline
//! of the request each operation serves (the caller's: [`TaskStore`]'s methods take it),
//! or [`A2A_STORE_RETRY_BACKGROUND_MS_MAX`] for those that serve none. Reads and claims
//! are made again as they are; a commit only as the same commit, under the same fence,
//! with the same absolute writes (a record's whole JSON, a delete, `seq_next`'s new
//! value): one the store applied unseen is then applied again to the same effect, or
//! refused `Fenced` because another writer claimed since, after which the write claims
//! again as before. So a number block is never given twice: a reservation applied
//! unseen and then fenced out is read again under a new claim (its numbers are a gap).
//! The writer's lock is held across a write's tries; a write waiting for it waits no
//! longer than its own deadline (then it fails `Unavailable`, the store being what held
//! the write before it).
//!
//! Each record keeps when its task entered its state ([`TaskRecord::state_since_micros`],
//! by the runtime's clock, which is anchored on the wall clock): A2A's
//! `status.timestamp`. `working` is not stored, so a task read back that had not ended
//! shows `submitted` with the time it was submitted; records stored before the time was
//! kept have none.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use axum::body::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::watch;
use troupe_agent::TaskState;
use troupe_core::{ActorId, Deadline, StoreError, StoreOperation};
use troupe_runtime::{Fence, RuntimeHandle, StateChange, StateStore, TurnCommit, TURN_WRITES_MAX};

use crate::limits::{
    A2A_TASKS_WAITING_PER_AGENT_MAX, A2A_TASK_NUMBERS_RESERVED, A2A_TASK_NUMBERS_RESERVE_ATTEMPTS_MAX,
};

/// The kind of the server's A2A key spaces (one per agent: `troupe-a2a/{agent}`), which
/// no runtime registers: the server writes them directly, fenced, one writer at a time.
pub(crate) const A2A_STORE_KIND: &str = "troupe-a2a";
/// Records one store scan reads when the server loads its tasks.
const A2A_LOAD_PAGE: usize = 256;
/// How long a store operation of the A2A records that serves no request is tried
/// again while the store is unavailable, in milliseconds from its start: the read of
/// every record when the server starts, and a task's record stored when it ends in its
/// agent's lane (a cancel is stored by its request, within that request's deadline). 10 s rides out a restart of PostgreSQL (1–5 s) and
/// bounds what waits behind it: the lane the ended task still holds (the agent's next
/// task starts after its record is stored) and the other A2A writes (one writer at a
/// time). A record not stored is read back as not ended at the next start and handed to
/// its agent again, which answers with the outcome it holds.
pub(crate) const A2A_STORE_RETRY_BACKGROUND_MS_MAX: u64 = 10_000;

const _: () = assert!(A2A_STORE_RETRY_BACKGROUND_MS_MAX >= troupe_runtime::STORE_RETRY_PAUSE_MS_MAX);

/// The key of the number below which every task number of an agent has been reserved
/// (see the module's doc), in the agent's key space: `seq_next`, or `seq_next/{node}` on
/// a cluster node (its tasks are numbered in its own space, see [`TaskRecord::node`]).
/// Not under `task/`: the records' scan does not read it, and deleting an agent's
/// records leaves it.
fn seq_next_key(node: Option<&str>) -> String {
    match node {
        Some(node) => format!("seq_next/{node}"),
        None => "seq_next".to_string(),
    }
}

/// One A2A task as the server knows it (and stores it, as JSON).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct TaskRecord {
    /// `{agent}-task-{n}`, or `{agent}-task-{node}-{n}` on a cluster node.
    pub(crate) id: String,
    /// Its number among its agent's tasks (in its node's space on a cluster node),
    /// reserved in the store for the server that gave it: the order the agent's tasks
    /// were created in here (which tasks are let go first; `ListTasks` lists by
    /// [`TaskRecord::list_place`]).
    pub(crate) seq: u64,
    /// The agent doing it.
    pub(crate) agent: String,
    /// The A2A context id: the client's, or `{agent}-context-{n}`.
    pub(crate) context_id: String,
    /// Its state (changed with [`TaskRecord::enter`], which keeps `state_since_micros`).
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
    /// Whether it ended with a refusal to retry (the agent was busy, or the task could
    /// not be stored): a blocking send answers it as a retryable error, and its message
    /// sent again starts a new task.
    pub(crate) busy: bool,
    /// The server's refusal a `busy` task ended with (its status, code and
    /// `Retry-After`): a blocking send answers with it. In this process only (not
    /// stored): a record read back answers a busy end 429, as all did until 2026-12-07.
    #[serde(skip)]
    pub(crate) refusal: Option<crate::error::ApiError>,
    /// The trace id its agent's turn runs under (32 lowercase hex digits). Empty in
    /// tasks stored before trace ids crossed servers.
    #[serde(default)]
    pub(crate) trace_id: String,
    /// The id of the agent's external task that ran it, once it ended with an outcome
    /// (forgotten with it). None before, or in tasks stored before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) inner: Option<String>,
    /// The cluster node that numbered it (`None` on a single server). Its id and its
    /// store key carry the node's name: each node numbers its tasks itself, so without
    /// it a node that takes over an agent's A2A records after another's death would
    /// number a new task as one of the dead node's, overwrite that task's record, and
    /// be answered by the agent with that task's outcome (its inbox deduplicates
    /// external tasks by id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) node: Option<String>,
    /// When it entered its state, in microseconds since the Unix epoch by the runtime's
    /// clock ([`Deadline::as_micros`]): A2A's `status.timestamp`. None in tasks stored
    /// before it was kept (served without one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) state_since_micros: Option<u64>,
}

/// A place in `ListTasks`' order, which is the `a2a-sdk`'s (its task stores'
/// `_list_sort_key` and `ListTasksCursor`): `(has a status time, the status time or 0,
/// the task id)`, listed greatest first. So the task whose state changed last comes
/// first; tasks without a status time (stored before it was kept) come last; tasks with
/// the same time (or none) are listed by id, greatest first, the ids compared as strings
/// (by code point, as Python compares them: `echo-task-9` before `echo-task-10`). The
/// SDK compares nanoseconds; a status time here is whole microseconds and is served with
/// all six digits, so the order is the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct ListPlace<'a> {
    // The field order is the comparison's (the derived `Ord`).
    timed: bool,
    micros: u64,
    id: &'a str,
}

impl<'a> ListPlace<'a> {
    /// The place of task `id` whose status time is `micros` (None: it has none).
    pub(crate) fn new(micros: Option<u64>, id: &'a str) -> Self {
        Self {
            timed: micros.is_some(),
            micros: micros.unwrap_or(0),
            id,
        }
    }

    /// The status time, in microseconds since the Unix epoch (None: none).
    pub(crate) fn micros(self) -> Option<u64> {
        self.timed.then_some(self.micros)
    }

    /// The task id.
    pub(crate) fn id(self) -> &'a str {
        self.id
    }
}

impl TaskRecord {
    /// Where it stands among the tasks, oldest first: by number, then (for tasks that
    /// two cluster nodes numbered alike) by the node that numbered it.
    pub(crate) fn order(&self) -> (u64, Option<&str>) {
        (self.seq, self.node.as_deref())
    }

    /// Its place in `ListTasks`' order (see [`ListPlace`]).
    pub(crate) fn list_place(&self) -> ListPlace<'_> {
        ListPlace::new(self.state_since_micros, &self.id)
    }

    /// Puts it in `state` as of `now` (the runtime's clock).
    pub(crate) fn enter(&mut self, state: TaskState, now: Deadline) {
        self.state = state;
        self.state_since_micros = Some(now.as_micros());
    }
}

/// An ended task the registry let go to make room: its store record is deleted, and
/// its agent's record of it (`inner`) is forgotten.
#[derive(Debug, Clone)]
pub(crate) struct Forgotten {
    pub(crate) agent: String,
    pub(crate) node: Option<String>,
    pub(crate) seq: u64,
    pub(crate) inner: Option<String>,
}

/// The server's A2A records in the store.
pub(crate) struct TaskStore {
    /// The runtime whose store holds the records, and which tries them again.
    runtime: RuntimeHandle,
    store: Arc<dyn StateStore>,
    /// The cluster node the server runs on (`ServerConfig::node`): whose `seq_next`
    /// it writes and reads.
    node: Option<String>,
    /// One claim-and-commit at a time (a claim fences out the previous one). It holds
    /// the fence of each agent's key space this server claimed last: its writes commit
    /// under it until the store refuses it (another writer claimed since), and only then
    /// claim again. (On a cluster node a claim places the key space in etcd; claiming
    /// at every write would release and place it each time, leaving a moment in which
    /// another node could take it over.)
    writer: tokio::sync::Mutex<HashMap<String, troupe_runtime::Fence>>,
}

/// A task's store key: `task/{seq:020}`, or `task/{node}/{seq:020}` for a task numbered
/// by a cluster node (see [`TaskRecord::node`]).
fn task_key(node: Option<&str>, seq: u64) -> String {
    match node {
        Some(node) => format!("task/{node}/{seq:020}"),
        None => format!("task/{seq:020}"),
    }
}

fn store_id(agent: &str) -> Result<ActorId, StoreError> {
    ActorId::new(A2A_STORE_KIND, agent).map_err(|error| StoreError::Backend {
        operation: troupe_core::StoreOperation::Decode,
        cause: error.to_string(),
    })
}

impl TaskStore {
    /// The records in `runtime`'s store, of the tasks numbered in `node`'s space
    /// (`None`: a single server).
    pub(crate) fn new(runtime: RuntimeHandle, node: Option<String>) -> Self {
        Self {
            store: Arc::clone(runtime.store()),
            runtime,
            node,
            writer: tokio::sync::Mutex::new(HashMap::new()),
        }
    }

    /// The deadline `wait` from now: that of a request that waits `wait` at most.
    pub(crate) fn deadline_in(&self, wait: std::time::Duration) -> Deadline {
        self.runtime.deadline_in(wait)
    }

    /// The deadline of a store operation that serves no request
    /// ([`A2A_STORE_RETRY_BACKGROUND_MS_MAX`] from now).
    pub(crate) fn background_deadline(&self) -> Deadline {
        self.deadline_in(std::time::Duration::from_millis(A2A_STORE_RETRY_BACKGROUND_MS_MAX))
    }

    /// The writer's lock, waited for until `deadline` at most.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when the deadline comes first: the write holding it
    /// is being tried again while the store is unavailable.
    async fn writer(
        &self,
        deadline: Deadline,
    ) -> Result<tokio::sync::MutexGuard<'_, HashMap<String, Fence>>, StoreError> {
        if let Ok(fences) = self.writer.try_lock() {
            return Ok(fences);
        }
        let left_us = deadline.as_micros().saturating_sub(self.runtime.now().as_micros());
        tokio::time::timeout(std::time::Duration::from_micros(left_us), self.writer.lock())
            .await
            .map_err(|_| StoreError::Unavailable {
                operation: StoreOperation::Commit,
                cause: "another write of the A2A task records held the writer past this request's deadline, the store \
                        being unavailable meanwhile"
                    .to_string(),
            })
    }

    /// A claim of key space `id`, made again while the store is unavailable, until
    /// `deadline` (a claim applied unseen costs only a fence).
    async fn claim_retried(&self, id: &ActorId, deadline: Deadline) -> Result<Fence, StoreError> {
        let claimed = self
            .runtime
            .retry_store(deadline, "a2a claim", id, || self.store.claim(id))
            .await?;
        Ok(claimed.fence)
    }

    /// Commits `writes` to key space `id` under `fence`, made again while the store is
    /// unavailable, until `deadline`: the same commit each time (see the module's doc).
    async fn commit_retried(
        &self,
        id: &ActorId,
        fence: Fence,
        writes: &[(String, Option<Bytes>)],
        deadline: Deadline,
    ) -> Result<(), StoreError> {
        self.runtime
            .retry_store(deadline, "a2a commit", id, || {
                let commit = TurnCommit {
                    state: StateChange::Unchanged,
                    writes: writes.to_vec(),
                };
                self.store.commit(id, fence, commit)
            })
            .await
    }

    /// Writes `writes` to `agent`'s key space, `fences` (the writer's lock) held, the
    /// store tried again until `deadline`.
    async fn write(
        &self,
        fences: &mut HashMap<String, Fence>,
        agent: &str,
        writes: Vec<(String, Option<Bytes>)>,
        deadline: Deadline,
    ) -> Result<(), StoreError> {
        let id = store_id(agent)?;
        if let Some(fence) = fences.get(agent).copied() {
            match self.commit_retried(&id, fence, &writes, deadline).await {
                Err(StoreError::Fenced { .. }) => {
                    // Claimed by another writer since: claim it back, below.
                    fences.remove(agent);
                }
                Err(error @ StoreError::NotOwner { .. }) => {
                    fences.remove(agent);
                    return Err(error);
                }
                other => return other,
            }
        }
        let fence = self.claim_retried(&id, deadline).await?;
        fences.insert(agent.to_string(), fence);
        self.commit_retried(&id, fence, &writes, deadline).await
    }

    /// Claims `agent`'s key space, writing nothing: on a cluster node this places it
    /// here, and is refused ([`StoreError::NotOwner`]) while another node holds it. The
    /// store is tried again until `deadline`.
    pub(crate) async fn claim(&self, agent: &str, deadline: Deadline) -> Result<(), StoreError> {
        let id = store_id(agent)?;
        let mut fences = self.writer(deadline).await?;
        let fence = self.claim_retried(&id, deadline).await?;
        fences.insert(agent.to_string(), fence);
        Ok(())
    }

    /// Deletes `forgotten` (records the registry let go), then writes `record` if
    /// `registry` still holds it. Checked under the writer's lock: a record whose agent
    /// was deleted meanwhile ([`TaskStore::forget_agent`], which takes the lock after
    /// the registry let the agent's tasks go) is not written back. The store is tried
    /// again until `deadline`.
    pub(crate) async fn save(
        &self,
        registry: &TaskRegistry,
        record: &TaskRecord,
        forgotten: &[Forgotten],
        deadline: Deadline,
    ) -> Result<(), StoreError> {
        let bytes = serde_json::to_vec(record).map_err(|error| StoreError::Backend {
            operation: troupe_core::StoreOperation::Decode,
            cause: error.to_string(),
        })?;
        let mut fences = self.writer(deadline).await?;
        for forgotten in forgotten {
            let key = task_key(forgotten.node.as_deref(), forgotten.seq);
            self.write(&mut fences, &forgotten.agent, vec![(key, None)], deadline)
                .await?;
        }
        if !registry.holds(&record.id) {
            return Ok(());
        }
        let writes = vec![(task_key(record.node.as_deref(), record.seq), Some(Bytes::from(bytes)))];
        self.write(&mut fences, &record.agent, writes, deadline).await
    }

    /// Reserves the next [`A2A_TASK_NUMBERS_RESERVED`] task numbers of `agent` for this
    /// server and gives them to `registry` ([`TaskRegistry::give_numbers`]); see the
    /// module's doc. Under the key space's fence (the one this server holds, else a new
    /// claim) it reads `seq_next` and commits it raised by the block; a commit fenced out
    /// by another writer is made again under a new claim after a new read, at most
    /// [`A2A_TASK_NUMBERS_RESERVE_ATTEMPTS_MAX`] times in all. A block also starts past
    /// every task of the agent the registry holds ([`TaskRegistry::numbered_past`]:
    /// records from before `seq_next` was kept, and on a cluster node the tasks of other
    /// nodes it took over, so that its new tasks are listed after them). Given under the
    /// writer's lock, so blocks reach the registry in the order they were reserved, each
    /// above the one before. The store is tried again until `deadline` (the commit as
    /// the same commit under the same fence: one applied unseen and then fenced out
    /// leaves its block unused).
    ///
    /// # Errors
    /// The store's ([`StoreError::Fenced`] after the last attempt, [`StoreError::NotOwner`]
    /// on a cluster node that no longer holds the agent's records); [`StoreError::Backend`]
    /// (`Decode`) if `seq_next` is not a number, (`Commit`) if the numbers ran out.
    pub(crate) async fn reserve_numbers(
        &self,
        registry: &TaskRegistry,
        agent: &str,
        deadline: Deadline,
    ) -> Result<(), StoreError> {
        let id = store_id(agent)?;
        let key = seq_next_key(self.node.as_deref());
        let mut fences = self.writer(deadline).await?;
        let mut attempt = 1;
        loop {
            let fence = match fences.get(agent).copied() {
                Some(fence) => fence,
                None => {
                    let fence = self.claim_retried(&id, deadline).await?;
                    fences.insert(agent.to_string(), fence);
                    fence
                }
            };
            // Read after the fence was issued: the commit below succeeds only if nobody
            // claimed the key space since, and so only if nobody wrote it since.
            let from = self
                .read_seq_next(&id, &key, agent, deadline)
                .await?
                .max(registry.numbered_past(agent));
            let to = from
                .checked_add(A2A_TASK_NUMBERS_RESERVED)
                .ok_or_else(|| StoreError::Backend {
                    operation: troupe_core::StoreOperation::Commit,
                    cause: format!("agent {agent:?}'s A2A task numbers are used up ({key} is {from})"),
                })?;
            let writes = [(key.clone(), Some(Bytes::from(to.to_string())))];
            match self.commit_retried(&id, fence, &writes, deadline).await {
                Ok(()) => {
                    registry.give_numbers(agent, from..to);
                    return Ok(());
                }
                Err(StoreError::Fenced { .. }) if attempt < A2A_TASK_NUMBERS_RESERVE_ATTEMPTS_MAX => {
                    // Another writer claimed since: claim again and read again.
                    fences.remove(agent);
                    attempt += 1;
                }
                Err(error) => {
                    if matches!(error, StoreError::Fenced { .. } | StoreError::NotOwner { .. }) {
                        fences.remove(agent);
                    }
                    return Err(error);
                }
            }
        }
    }

    /// `seq_next` (`key`) in `agent`'s key space `id`: 0 if it never had a task. The
    /// store is tried again until `deadline`.
    ///
    /// # Errors
    /// The store's, or [`StoreError::Backend`] (`Decode`) if the value is not a number.
    async fn read_seq_next(&self, id: &ActorId, key: &str, agent: &str, deadline: Deadline) -> Result<u64, StoreError> {
        let read = self
            .runtime
            .retry_store(deadline, "a2a get", id, || self.store.get(id, key))
            .await?;
        let Some(bytes) = read else {
            return Ok(0);
        };
        std::str::from_utf8(&bytes)
            .ok()
            .and_then(|text| text.parse().ok())
            .ok_or_else(|| StoreError::Backend {
                operation: troupe_core::StoreOperation::Decode,
                cause: format!("{key} of agent {agent:?}'s A2A tasks is not a number: {bytes:?}"),
            })
    }

    /// Deletes the records of the deleted agent `agent` that the registry let go
    /// (`forgotten`, from [`TaskRegistry::forget_agent`]), and forgets the fence of its
    /// key space. The store is tried again until `deadline`.
    pub(crate) async fn forget_agent(
        &self,
        agent: &str,
        forgotten: &[Forgotten],
        deadline: Deadline,
    ) -> Result<(), StoreError> {
        let mut fences = self.writer(deadline).await?;
        let mut deleted = Ok(());
        for chunk in forgotten.chunks(TURN_WRITES_MAX) {
            let writes = chunk
                .iter()
                .map(|forgotten| (task_key(forgotten.node.as_deref(), forgotten.seq), None))
                .collect();
            deleted = self.write(&mut fences, agent, writes, deadline).await;
            if deleted.is_err() {
                break;
            }
        }
        fences.remove(agent);
        deleted
    }

    /// Agents whose key space this server holds a fence of (the writer's lock taken).
    pub(crate) async fn agents_fenced(&self) -> Vec<String> {
        self.writer.lock().await.keys().cloned().collect()
    }

    /// Every stored record of `agents`, oldest first (by [`TaskRecord::order`]). The
    /// store is tried again until `deadline`.
    pub(crate) async fn load(&self, agents: &[String], deadline: Deadline) -> Result<Vec<TaskRecord>, StoreError> {
        let mut records = Vec::new();
        for agent in agents {
            let id = store_id(agent)?;
            let mut after: Option<String> = None;
            loop {
                let page = self
                    .runtime
                    .retry_store(deadline, "a2a scan", &id, || {
                        self.store.scan(&id, "task/", after.as_deref(), A2A_LOAD_PAGE)
                    })
                    .await?;
                let Some((last, _)) = page.last() else { break };
                after = Some(last.clone());
                for (key, bytes) in &page {
                    match serde_json::from_slice::<TaskRecord>(bytes) {
                        Ok(record) => records.push(record),
                        Err(error) => tracing::warn!(%agent, %key, %error, "an A2A task record cannot be read"),
                    }
                }
            }
        }
        records.sort_by(|a, b| a.order().cmp(&b.order()));
        Ok(records)
    }
}

/// Where a new task's call stands: Troupe's chain and depth it arrived with, and how
/// long its turn may take, in milliseconds.
#[derive(Debug)]
pub(crate) struct TaskCall {
    pub(crate) chain: Vec<String>,
    pub(crate) depth: u32,
    pub(crate) timeout_ms: u64,
    pub(crate) trace_id: String,
}

/// What [`TaskRegistry::create`] made of a message.
pub(crate) enum Created {
    /// A new task, the lane it waits in (unless it was rejected at once), and the ended
    /// tasks the registry let go to make room (usually none or one).
    New(TaskRecord, Option<Arc<Lane>>, Vec<Forgotten>),
    /// The message was sent before: the task it started, as it is now.
    Resent(TaskRecord),
}

/// Why a task could not be made.
#[derive(Debug)]
pub(crate) enum AdmitError {
    /// The agent's lane is full.
    LaneFull,
    /// Every kept task is still running.
    Full,
    /// The message's id was sent before, to this agent, with other parts: the task it
    /// started.
    MessageIdReused(String),
    /// No task number of the agent is reserved for this server (none yet, or its block
    /// is used up): reserve some ([`TaskStore::reserve_numbers`]) and create again.
    NoNumbers,
}

/// What a cancel found.
#[derive(Debug)]
pub(crate) enum CancelOutcome {
    /// It was waiting: the cancel is begun, to be stored, then published or given up
    /// ([`TaskRegistry::finish_cancel`]). The task reads as it was until then, and does
    /// not start.
    Begun(CancelBegun),
    /// Another cancel of it is being stored: once `lock()` of this resolves, that
    /// cancel has been published or given up; ask again.
    Pending(Arc<tokio::sync::Mutex<()>>),
    /// It is running or has ended: it cannot be canceled.
    NotCancelable(TaskRecord),
    /// No such task for this agent.
    NotFound,
}

/// A cancel decided and not yet stored ([`TaskRegistry::cancel`]). While it lives, its
/// task reads as it was (`submitted`: watchers are told nothing) and its lane does not
/// start it ([`TaskStart::Wait`]); [`TaskRegistry::finish_cancel`] publishes it once
/// stored, or gives it up, leaving the task as it was. So memory never holds a cancel
/// the store does not (until 2026-12-07 the cancel was published before it was
/// stored: one that could not be stored read canceled all the same, and the same
/// cancel sent again was refused as "already ended"). Dropped without being finished,
/// it is given up (its task may start).
#[derive(Debug)]
pub(crate) struct CancelBegun {
    /// The task as the cancel leaves it (`canceled`, its time and reason): what is
    /// stored, then published.
    pub(crate) record: TaskRecord,
    /// Held until the cancel is finished: what its lane and other cancels wait on.
    _pending: tokio::sync::OwnedMutexGuard<()>,
}

/// What a task's lane found when the task's turn came ([`TaskRegistry::start`]).
#[derive(Debug)]
pub(crate) enum TaskStart {
    /// It was waiting and is now `working`: hand it to its agent.
    Started,
    /// It is not waiting (canceled, and stored so before it read so) or is gone (its
    /// agent was deleted): it does not run.
    NotStarted,
    /// A cancel of it is being stored: once `lock()` of this resolves, that cancel has
    /// been published or given up; ask again.
    Wait(Arc<tokio::sync::Mutex<()>>),
}

/// One agent's lane.
#[derive(Debug, Default)]
pub(crate) struct Lane {
    /// Held while one of the agent's A2A tasks runs.
    turn: Arc<tokio::sync::Mutex<()>>,
    /// Tasks submitted and not yet started.
    pub(crate) waiting: AtomicUsize,
}

/// A task's place in its agent's lane: resolves when its turn comes, and holds the
/// lane until dropped.
pub(crate) type LaneTurn = Pin<Box<dyn Future<Output = tokio::sync::OwnedMutexGuard<()>> + Send>>;

impl Lane {
    /// Takes a place in the lane now, behind every place taken before: tasks run in the
    /// order their places were taken, which is the order they were created (or read
    /// back). tokio's mutex serves waiters in the order they first asked, and a spawned
    /// task's `lock()` asks only when the task is first polled: on a loaded multi-thread
    /// runtime a task spawned later could be polled, and run, first (seen once in CI:
    /// the second of two tasks sent one after the other ran before the first). So the
    /// wait is polled once here, which queues it, and then handed to the task. Dropping
    /// it gives the place up.
    pub(crate) fn queue(&self) -> LaneTurn {
        let mut turn: LaneTurn = Box::pin(Arc::clone(&self.turn).lock_owned());
        match turn.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(guard) => Box::pin(std::future::ready(guard)),
            // Queued: the task's first poll gives the mutex its own waker.
            Poll::Pending => turn,
        }
    }
}

#[derive(Default)]
struct Inner {
    tasks: HashMap<String, watch::Sender<TaskRecord>>,
    /// Task ids, oldest first.
    order: VecDeque<String>,
    lanes: HashMap<String, Arc<Lane>>,
    /// Per agent, the task numbers reserved in the store for this server and not given
    /// yet ([`TaskStore::reserve_numbers`]); its next task takes the first.
    numbers: HashMap<String, std::ops::Range<u64>>,
    /// The task each message started, by agent and `messageId`, for as long as the
    /// task is kept (so at most `TaskRegistry::kept_max` entries).
    by_message: HashMap<(String, String), String>,
    /// How many of `tasks` each agent has (no entry for none).
    per_agent: HashMap<String, usize>,
    /// The tasks a cancel is being stored of ([`CancelBegun`]): each mutex is held until
    /// that cancel is finished.
    canceling: HashMap<String, Arc<tokio::sync::Mutex<()>>>,
}

/// A message's `messageId`, as a task keeps it in its request.
pub(crate) fn message_id(request: &Value) -> &str {
    request["messageId"].as_str().unwrap_or_default()
}

/// Every A2A task of the server.
pub(crate) struct TaskRegistry {
    inner: Mutex<Inner>,
    /// Tasks kept, at most (`ServerConfig::a2a_tasks_kept`).
    kept_max: usize,
    /// The cluster node the server runs on (`ServerConfig::node`), which numbers its
    /// tasks in its own space (see [`TaskRecord::node`]).
    node: Option<String>,
}

impl TaskRegistry {
    /// Keeps at most `kept_max` tasks (at least 1), numbered in `node`'s space on a
    /// cluster node.
    pub(crate) fn new(kept_max: usize, node: Option<String>) -> Self {
        Self {
            inner: Mutex::default(),
            kept_max: kept_max.max(1),
            node,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain data behind: keep going.
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A new task for `agent`, `submitted` if `queued` (it takes a place in the
    /// agent's lane, returned) or else in `state` at once (e.g. `rejected`), as of `now`,
    /// numbered with the first of the agent's reserved numbers ([`AdmitError::NoNumbers`]
    /// if none is left: nothing changed).
    pub(crate) fn create(
        &self,
        agent: &str,
        context_id: Option<String>,
        mut request: Value,
        call: TaskCall,
        rejected: Option<String>,
        now: Deadline,
    ) -> Result<Created, AdmitError> {
        let TaskCall {
            chain,
            depth,
            timeout_ms,
            trace_id,
        } = call;
        let mut inner = self.lock();
        let message = (agent.to_string(), message_id(&request).to_string());
        if let Some(first) = inner
            .by_message
            .get(&message)
            .and_then(|id| inner.tasks.get(id))
            .map(|sender| sender.borrow().clone())
            .filter(|first| !first.busy)
        {
            return if first.request["parts"] == request["parts"] {
                Ok(Created::Resent(first))
            } else {
                Err(AdmitError::MessageIdReused(first.id))
            };
        }
        let lane = if rejected.is_none() {
            let lane = Arc::clone(inner.lanes.entry(agent.to_string()).or_default());
            if lane.waiting.load(Ordering::SeqCst) >= A2A_TASKS_WAITING_PER_AGENT_MAX {
                return Err(AdmitError::LaneFull);
            }
            Some(lane)
        } else {
            None
        };
        // Room for one more: as many of the oldest ended tasks as it takes go (more than
        // one only after a restart with a smaller `kept_max`), or none if too few ended.
        let excess = (inner.tasks.len() + 1).saturating_sub(self.kept_max);
        let oldest_ended = inner.oldest_ended(excess);
        if oldest_ended.len() < excess {
            return Err(AdmitError::Full);
        }
        let Some(numbers) = inner.numbers.get_mut(agent).filter(|numbers| !numbers.is_empty()) else {
            return Err(AdmitError::NoNumbers);
        };
        let seq = numbers.start;
        numbers.start += 1;
        let forgotten = oldest_ended.iter().filter_map(|id| inner.forget(id)).collect();
        let (id, context_id) = match &self.node {
            Some(node) => (
                format!("{agent}-task-{node}-{seq}"),
                context_id.unwrap_or_else(|| format!("{agent}-context-{node}-{seq}")),
            ),
            None => (
                format!("{agent}-task-{seq}"),
                context_id.unwrap_or_else(|| format!("{agent}-context-{seq}")),
            ),
        };
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
            refusal: None,
            trace_id,
            inner: None,
            node: self.node.clone(),
            state_since_micros: Some(now.as_micros()),
        };
        if let Some(lane) = &lane {
            lane.waiting.fetch_add(1, Ordering::SeqCst);
        }
        inner.tasks.insert(id.clone(), watch::channel(record.clone()).0);
        inner.order.push_back(id.clone());
        inner.by_message.insert(message, id);
        *inner.per_agent.entry(agent.to_string()).or_default() += 1;
        Ok(Created::New(record, lane, forgotten))
    }

    /// Takes back a stored record (at start, or when a cluster node takes its agent's
    /// records over; oldest first): one that had not ended waits in its agent's lane
    /// again, `submitted` (returned with the lane), keeping the time it was stored with
    /// (`working` is not stored, so that is when it was submitted). A task it already
    /// has is left as it is (`None`).
    pub(crate) fn restore(&self, mut record: TaskRecord) -> Option<Arc<Lane>> {
        let mut inner = self.lock();
        if inner.tasks.contains_key(&record.id) {
            return None;
        }
        let lane = if record.state.is_final() {
            None
        } else {
            record.state = TaskState::Submitted;
            let lane = Arc::clone(inner.lanes.entry(record.agent.clone()).or_default());
            lane.waiting.fetch_add(1, Ordering::SeqCst);
            Some(lane)
        };
        let id = record.id.clone();
        // Oldest first: a message sent again (after a busy end) maps to its newest task.
        let message = (record.agent.clone(), message_id(&record.request).to_string());
        inner.by_message.insert(message, id.clone());
        // In order among the tasks held (at the back, unless a node took another's
        // records over after numbering tasks of its own).
        let tasks = &inner.tasks;
        let position = inner
            .order
            .iter()
            .rposition(|kept| {
                tasks
                    .get(kept)
                    .is_some_and(|sender| sender.borrow().order() <= record.order())
            })
            .map_or(0, |before| before + 1);
        *inner.per_agent.entry(record.agent.clone()).or_default() += 1;
        inner.tasks.insert(id.clone(), watch::channel(record).0);
        inner.order.insert(position, id);
        lane
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

    /// Begins a cancel of task `id` of `agent` if it has not started, as of `now`: the
    /// canceled record, to be stored and then published ([`TaskRegistry::finish_cancel`]).
    /// Decided under the registry's lock, as the lane's start is ([`TaskRegistry::start`]):
    /// a cancel begun before the start wins (the task waits for it to be stored, and runs
    /// only if it could not be), a start before the cancel makes it not cancelable.
    pub(crate) fn cancel(&self, agent: &str, id: &str, now: Deadline) -> CancelOutcome {
        let mut inner = self.lock();
        let Some(task) = inner
            .tasks
            .get(id)
            .map(|sender| sender.borrow().clone())
            .filter(|task| task.agent == agent)
        else {
            return CancelOutcome::NotFound;
        };
        if let Some(pending) = inner.canceling.get(id) {
            return CancelOutcome::Pending(Arc::clone(pending));
        }
        if task.state != TaskState::Submitted {
            return CancelOutcome::NotCancelable(task);
        }
        let mut record = task;
        record.enter(TaskState::Canceled, now);
        record.reason = Some("canceled by the client before it started".to_string());
        let pending = Arc::new(tokio::sync::Mutex::new(()));
        let Ok(guard) = Arc::clone(&pending).try_lock_owned() else {
            unreachable!("a mutex made here is not locked");
        };
        inner.canceling.insert(id.to_string(), pending);
        CancelOutcome::Begun(CancelBegun {
            record,
            _pending: guard,
        })
    }

    /// Finishes the cancel `begun`: published (the task reads canceled, its watchers are
    /// told) if it was `stored`, else given up (the task is left as it was, and may
    /// start). Returns the canceled record.
    pub(crate) fn finish_cancel(&self, begun: CancelBegun, stored: bool) -> TaskRecord {
        let mut inner = self.lock();
        inner.canceling.remove(&begun.record.id);
        if stored {
            if let Some(sender) = inner.tasks.get(&begun.record.id) {
                sender.send_if_modified(|task| {
                    // Still waiting: nothing starts it while a cancel is being stored.
                    let waiting = task.state == TaskState::Submitted;
                    if waiting {
                        task.state = begun.record.state;
                        task.state_since_micros = begun.record.state_since_micros;
                        task.reason.clone_from(&begun.record.reason);
                    }
                    waiting
                });
            }
        }
        drop(inner);
        // Dropping `begun` after the lock wakes what waits on the cancel.
        begun.record
    }

    /// Starts task `id` (its lane's turn came), as of `now`: `working` if it is still
    /// waiting and no cancel of it is being stored (see [`TaskRegistry::cancel`]).
    pub(crate) fn start(&self, id: &str, now: Deadline) -> TaskStart {
        let inner = self.lock();
        if let Some(pending) = inner.canceling.get(id) {
            return TaskStart::Wait(Arc::clone(pending));
        }
        let Some(sender) = inner.tasks.get(id) else {
            return TaskStart::NotStarted;
        };
        let started = sender.send_if_modified(|task| {
            let waiting = task.state == TaskState::Submitted;
            if waiting {
                task.enter(TaskState::Working, now);
            }
            waiting
        });
        if started {
            TaskStart::Started
        } else {
            TaskStart::NotStarted
        }
    }

    /// The number past every task of `agent` it holds, whichever node numbered it (a
    /// new task is listed after them): 0 if it holds none.
    pub(crate) fn numbered_past(&self, agent: &str) -> u64 {
        let inner = self.lock();
        inner
            .tasks
            .values()
            .filter_map(|sender| {
                let task = sender.borrow();
                (task.agent == agent).then(|| task.seq.saturating_add(1))
            })
            .max()
            .unwrap_or(0)
    }

    /// Gives `agent`'s next tasks the numbers `numbers`, reserved for this server in the
    /// store ([`TaskStore::reserve_numbers`]); any left of the block before are dropped.
    pub(crate) fn give_numbers(&self, agent: &str, numbers: std::ops::Range<u64>) {
        self.lock().numbers.insert(agent.to_string(), numbers);
    }

    /// Whether it holds task `id`.
    pub(crate) fn holds(&self, id: &str) -> bool {
        self.lock().tasks.contains_key(id)
    }

    /// Whether it holds anything of `agent`: a task, a lane or reserved numbers.
    pub(crate) fn tracks(&self, agent: &str) -> bool {
        let inner = self.lock();
        inner.per_agent.contains_key(agent) || inner.lanes.contains_key(agent) || inner.numbers.contains_key(agent)
    }

    /// Lets every task of the deleted agent `agent` go, its lane and its reserved
    /// numbers (an agent made again under its id reserves new ones): what is left to
    /// delete from the store. Watchers of its tasks see their channel close (their
    /// streams end); a task still waiting in the lane finds itself gone when its turn
    /// comes and does not run; one running is not stored when it ends.
    pub(crate) fn forget_agent(&self, agent: &str) -> Vec<Forgotten> {
        let mut inner = self.lock();
        inner.lanes.remove(agent);
        inner.numbers.remove(agent);
        if inner.per_agent.remove(agent).is_none() {
            return Vec::new();
        }
        let Inner {
            tasks,
            order,
            by_message,
            ..
        } = &mut *inner;
        let mut forgotten = Vec::new();
        order.retain(|id| {
            if tasks.get(id).is_none_or(|sender| sender.borrow().agent != agent) {
                return true;
            }
            if let Some(sender) = tasks.remove(id) {
                forgotten.push(let_go(by_message, id, &sender.borrow()));
            }
            false
        });
        forgotten
    }

    /// The tasks it holds, and the agents it holds a task, a lane or numbers of.
    pub(crate) fn sizes(&self) -> (usize, Vec<String>) {
        let inner = self.lock();
        let mut agents: Vec<String> = inner
            .per_agent
            .keys()
            .chain(inner.lanes.keys())
            .chain(inner.numbers.keys())
            .cloned()
            .collect();
        agents.sort_unstable();
        agents.dedup();
        (inner.tasks.len(), agents)
    }

    /// The tasks of `agent` that `keep` keeps, in `ListTasks`' order (greatest
    /// [`TaskRecord::list_place`] first: the task whose state changed last first).
    pub(crate) fn list(&self, agent: &str, keep: impl Fn(&TaskRecord) -> bool) -> Vec<TaskRecord> {
        let mut tasks: Vec<TaskRecord> = {
            let inner = self.lock();
            inner
                .tasks
                .values()
                .filter(|sender| {
                    let task = sender.borrow();
                    task.agent == agent && keep(&task)
                })
                .map(|sender| sender.borrow().clone())
                .collect()
        };
        tasks.sort_unstable_by(|a, b| b.list_place().cmp(&a.list_place()));
        tasks
    }
}

impl Inner {
    /// The ids of the `count` oldest tasks that have ended (fewer if fewer have).
    fn oldest_ended(&self, count: usize) -> Vec<String> {
        let tasks = &self.tasks;
        self.order
            .iter()
            .filter(|id| tasks.get(*id).is_none_or(|sender| sender.borrow().state.is_final()))
            .take(count)
            .cloned()
            .collect()
    }

    /// Forgets task `id` here: what is left to forget elsewhere (its store record, its
    /// agent's record); `None` if it is unknown.
    fn forget(&mut self, id: &str) -> Option<Forgotten> {
        let position = self.order.iter().position(|kept| kept == id)?;
        let id = self.order.remove(position)?;
        let sender = self.tasks.remove(&id)?;
        let record = sender.borrow();
        if let Some(count) = self.per_agent.get_mut(&record.agent) {
            *count -= 1;
            if *count == 0 {
                self.per_agent.remove(&record.agent);
            }
        }
        Some(let_go(&mut self.by_message, &id, &record))
    }
}

/// Task `id` (`record`), taken out of the tasks: its message's entry goes too (if it is
/// still this task's), and what is left to forget elsewhere.
fn let_go(by_message: &mut HashMap<(String, String), String>, id: &str, record: &TaskRecord) -> Forgotten {
    let message = (record.agent.clone(), message_id(&record.request).to_string());
    if by_message.get(&message).is_some_and(|kept| kept == id) {
        by_message.remove(&message);
    }
    Forgotten {
        agent: record.agent.clone(),
        node: record.node.clone(),
        seq: record.seq,
        inner: record.inner.clone(),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    /// How a [`Flaky`] store fails one commit.
    #[derive(Clone, Copy, Debug)]
    enum CommitFailure {
        /// `Unavailable`, the commit applied all the same (its answer lost).
        AppliedUnseen,
        /// As `AppliedUnseen`, and another writer claims the key space before the
        /// answer (so a try under the old fence is refused `Fenced`).
        AppliedUnseenThenClaimed,
    }

    /// A `MemoryStore` whose next commits fail as planned, or every operation while
    /// `down`; it counts the commits asked.
    #[derive(Default)]
    struct Flaky {
        inner: troupe_runtime::MemoryStore,
        commits: Mutex<VecDeque<CommitFailure>>,
        down: std::sync::atomic::AtomicBool,
        commits_asked: AtomicUsize,
    }

    impl Flaky {
        fn unavailable(&self, operation: StoreOperation) -> Result<(), StoreError> {
            if self.down.load(Ordering::SeqCst) {
                return Err(StoreError::Unavailable {
                    operation,
                    cause: "connection refused".to_string(),
                });
            }
            Ok(())
        }
    }

    #[async_trait::async_trait]
    impl StateStore for Flaky {
        async fn claim(&self, actor: &ActorId) -> Result<troupe_runtime::Claimed, StoreError> {
            self.unavailable(StoreOperation::Claim)?;
            self.inner.claim(actor).await
        }

        async fn load(&self, actor: &ActorId) -> Result<Option<Bytes>, StoreError> {
            self.unavailable(StoreOperation::Load)?;
            self.inner.load(actor).await
        }

        async fn commit(&self, actor: &ActorId, fence: Fence, commit: TurnCommit) -> Result<(), StoreError> {
            self.commits_asked.fetch_add(1, Ordering::SeqCst);
            self.unavailable(StoreOperation::Commit)?;
            self.inner.commit(actor, fence, commit).await?;
            // Planned failures fall on applied commits only.
            let failure = self.commits.lock().unwrap().pop_front();
            match failure {
                None => return Ok(()),
                Some(CommitFailure::AppliedUnseen) => {}
                Some(CommitFailure::AppliedUnseenThenClaimed) => {
                    self.inner.claim(actor).await?;
                }
            }
            Err(StoreError::Unavailable {
                operation: StoreOperation::Commit,
                cause: "connection reset while committing".to_string(),
            })
        }

        async fn get(&self, actor: &ActorId, key: &str) -> Result<Option<Bytes>, StoreError> {
            self.unavailable(StoreOperation::Get)?;
            self.inner.get(actor, key).await
        }

        async fn scan(
            &self,
            actor: &ActorId,
            prefix: &str,
            after: Option<&str>,
            limit: usize,
        ) -> Result<Vec<(String, Bytes)>, StoreError> {
            self.unavailable(StoreOperation::Scan)?;
            self.inner.scan(actor, prefix, after, limit).await
        }
    }

    /// A runtime on `store`, and a server's A2A records on it.
    fn task_store_on(store: &Arc<Flaky>) -> (troupe_runtime::Runtime, TaskStore) {
        let runtime = troupe_runtime::Runtime::builder()
            .store(Arc::clone(store) as Arc<dyn StateStore>)
            .start();
        let tasks = TaskStore::new(runtime.handle(), None);
        (runtime, tasks)
    }

    /// The numbers `registry` holds for `echo`'s next tasks.
    fn numbers(registry: &TaskRegistry) -> Option<std::ops::Range<u64>> {
        registry.lock().numbers.get("echo").cloned()
    }

    /// `seq_next` of `echo` as stored.
    async fn seq_next(store: &Flaky) -> u64 {
        let id = store_id("echo").unwrap();
        let bytes = store.inner.get(&id, &seq_next_key(None)).await.unwrap().unwrap();
        std::str::from_utf8(&bytes).unwrap().parse().unwrap()
    }

    /// Goal: a reservation of task numbers whose commit the store applied but answered
    /// `Unavailable` is made again as the same commit, under the same fence, and
    /// succeeds: the block is given once, and another server's next block starts past
    /// it. One applied unseen and then fenced out (another writer claimed meanwhile) is
    /// read again under a new claim: its block is a gap, the next one is given. Before
    /// the store was tried again, the reservation failed `Unavailable` at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reservation_applied_unseen_is_given_once_and_one_fenced_out_meanwhile_is_a_gap() {
        let block = A2A_TASK_NUMBERS_RESERVED;
        let store = Arc::new(Flaky::default());
        let (runtime, tasks) = task_store_on(&store);
        let registry = TaskRegistry::new(8, None);
        let deadline = runtime.handle().deadline_in(std::time::Duration::from_secs(5));
        store.commits.lock().unwrap().push_back(CommitFailure::AppliedUnseen);
        tasks.reserve_numbers(&registry, "echo", deadline).await.unwrap();
        assert_eq!(numbers(&registry), Some(0..block));
        assert_eq!(seq_next(&store).await, block);
        assert_eq!(
            store.commits_asked.load(Ordering::SeqCst),
            2,
            "the same commit, made again"
        );
        assert_eq!(runtime.handle().counters().store_retries, 1);

        // Another server on the store: its block follows.
        let (_other_runtime, other) = task_store_on(&store);
        let other_registry = TaskRegistry::new(8, None);
        other.reserve_numbers(&other_registry, "echo", deadline).await.unwrap();
        assert_eq!(numbers(&other_registry), Some(block..2 * block));

        // Applied unseen, then another claim: the try under the old fence is refused,
        // and the reservation is made again from what the store holds.
        store
            .commits
            .lock()
            .unwrap()
            .push_back(CommitFailure::AppliedUnseenThenClaimed);
        tasks.reserve_numbers(&registry, "echo", deadline).await.unwrap();
        assert_eq!(
            numbers(&registry),
            Some(3 * block..4 * block),
            "the block applied unseen (2 to 3 blocks) is a gap"
        );
        assert_eq!(seq_next(&store).await, 4 * block);
    }

    /// Goal: a task's record is written while the store fails for a moment, and one
    /// past the deadline fails `Unavailable` by it; a write waiting for the writer's
    /// lock behind one being tried again waits no longer than its own deadline. Method:
    /// the store down; a save with a 5 s deadline (it holds the writer's lock), then a
    /// save with a 300 ms one; the store healed 1 s in.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_save_waits_out_a_short_outage_and_one_behind_it_no_longer_than_its_deadline() {
        let store = Arc::new(Flaky::default());
        let (runtime, tasks) = task_store_on(&store);
        let tasks = Arc::new(tasks);
        let registry = Arc::new(TaskRegistry::new(8, None));
        registry.restore(record(0, TaskState::Completed));
        registry.restore(record(1, TaskState::Completed));
        let handle = runtime.handle();
        store.down.store(true, Ordering::SeqCst);
        let first = tokio::spawn({
            let (tasks, registry, handle) = (Arc::clone(&tasks), Arc::clone(&registry), handle.clone());
            async move {
                let deadline = handle.deadline_in(std::time::Duration::from_secs(5));
                tasks
                    .save(&registry, &record(0, TaskState::Completed), &[], deadline)
                    .await
            }
        });
        // The first save holds the writer's lock, being tried again.
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        let asked = tokio::time::Instant::now();
        let deadline = handle.deadline_in(std::time::Duration::from_millis(300));
        let second = tasks
            .save(&registry, &record(1, TaskState::Completed), &[], deadline)
            .await;
        let took = asked.elapsed();
        assert!(matches!(second, Err(StoreError::Unavailable { .. })), "{second:?}");
        assert!(
            took < std::time::Duration::from_millis(300 + 100),
            "the second save waited {took:?}, past its 300 ms deadline"
        );
        tokio::time::sleep(std::time::Duration::from_millis(900)).await;
        assert!(!first.is_finished(), "the first save is still being tried");
        store.down.store(false, Ordering::SeqCst);
        first.await.unwrap().unwrap();
        let id = store_id("echo").unwrap();
        let stored = store.inner.get(&id, &task_key(None, 0)).await.unwrap();
        let stored: TaskRecord = serde_json::from_slice(&stored.expect("the record is stored")).unwrap();
        assert_eq!(stored.id, "echo-task-0");
        assert!(handle.counters().store_retries > 0);
    }

    /// Goal: a lane serves its tasks in the order their places were taken, whatever
    /// order the tasks are first polled in (the A2A test of a waiting task failed once
    /// in CI when the later of two tasks, both spawned, was polled first and took the
    /// lane). Method: three places taken 1, 2, 3; their tasks spawned 3, 2, 1 on worker
    /// threads, each holding the lane across a yield; the order they held it in. With a
    /// `lock()` made in the task instead, the order follows the polls (checked: 3, 2, 1).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lane_serves_places_in_the_order_they_were_taken_not_polled() {
        let lane = Lane::default();
        let places: Vec<LaneTurn> = (0..3).map(|_| lane.queue()).collect();
        let held = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (number, place) in places.into_iter().enumerate().rev() {
            let held = Arc::clone(&held);
            tasks.push(tokio::spawn(async move {
                let _turn = place.await;
                held.lock().unwrap().push(number + 1);
                tokio::task::yield_now().await;
            }));
            // Each spawned task gets time to run (and, if it could, take the lane).
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        for task in tasks {
            task.await.unwrap();
        }
        assert_eq!(*held.lock().unwrap(), vec![1, 2, 3]);
    }

    /// Task `seq` of agent `echo` in `state`, as the tests here and in `a2a.rs` build it.
    pub(crate) fn record(seq: u64, state: TaskState) -> TaskRecord {
        TaskRecord {
            id: format!("echo-task-{seq}"),
            seq,
            agent: "echo".to_string(),
            context_id: format!("echo-context-{seq}"),
            state,
            request: json!({"messageId": format!("m{seq}"), "parts": [{"text": "hi"}]}),
            reply: None,
            reply_meta: None,
            reason: None,
            chain: Vec::new(),
            depth: 0,
            timeout_ms: 1_000,
            busy: false,
            refusal: None,
            trace_id: String::new(),
            inner: Some(format!("echo-inner-{seq}")),
            node: None,
            state_since_micros: None,
        }
    }

    fn call() -> TaskCall {
        TaskCall {
            chain: Vec::new(),
            depth: 0,
            timeout_ms: 1_000,
            trace_id: String::new(),
        }
    }

    fn create(registry: &TaskRegistry, message: &str) -> Result<Created, AdmitError> {
        let request = json!({"messageId": message, "parts": [{"text": "new"}]});
        registry.create("echo", None, request, call(), None, Deadline::from_micros(1))
    }

    /// Goal: on a cluster node, tasks are numbered in the node's own space: the id, the
    /// context id and the store key carry the node's name, so a task another node
    /// numbered (restored from the store) never shares either with one of this node's,
    /// and a task let go is deleted under the key it was stored at. On a single server
    /// they are as before.
    #[test]
    fn a_cluster_node_numbers_its_tasks_in_its_own_space() {
        let registry = TaskRegistry::new(1, Some("n2".to_string()));
        let mut theirs = record(0, TaskState::Completed);
        theirs.node = Some("n1".to_string());
        theirs.id = "echo-task-n1-0".to_string();
        registry.restore(theirs);
        assert!(
            matches!(create(&registry, "new-1"), Err(AdmitError::NoNumbers)),
            "no number reserved yet"
        );
        assert_eq!(registry.numbered_past("echo"), 1, "past the other node's task too");
        registry.give_numbers("echo", 1..3);
        let Ok(Created::New(mine, _, forgotten)) = create(&registry, "new-1") else {
            panic!("room was made");
        };
        assert_eq!(mine.id, "echo-task-n2-1");
        assert_eq!(mine.context_id, "echo-context-n2-1");
        assert_eq!(mine.request["taskId"], "echo-task-n2-1");
        assert_eq!(mine.node.as_deref(), Some("n2"));
        assert_eq!(task_key(mine.node.as_deref(), mine.seq), "task/n2/00000000000000000001");
        assert_eq!(forgotten.len(), 1);
        assert_eq!(
            task_key(forgotten[0].node.as_deref(), forgotten[0].seq),
            "task/n1/00000000000000000000",
            "the other node's task is deleted under its own key"
        );
        let stored: TaskRecord = serde_json::from_value(serde_json::to_value(&mine).unwrap()).unwrap();
        assert_eq!(stored.node.as_deref(), Some("n2"));

        let single = TaskRegistry::new(1, None);
        single.give_numbers("echo", 0..1);
        let Ok(Created::New(plain, _, _)) = create(&single, "new-1") else {
            panic!("a task");
        };
        assert_eq!((plain.id.as_str(), plain.node.as_deref()), ("echo-task-0", None));
        assert_eq!(task_key(None, plain.seq), "task/00000000000000000000");
        let json = serde_json::to_value(&plain).unwrap();
        assert!(
            json.get("node").is_none(),
            "a single server's records are stored as before: {json}"
        );
    }

    /// Goal: a registry holding more tasks than it keeps (after a restart with a
    /// smaller `kept_max`) lets as many of the oldest ended tasks go as it takes to
    /// make room, oldest first, each with its agent's record; with too few ended it
    /// refuses (`Full`) and lets none go.
    #[test]
    fn room_is_made_from_the_oldest_ended_tasks_and_only_if_enough_ended() {
        let registry = TaskRegistry::new(3, None);
        registry.restore(record(0, TaskState::Completed));
        registry.restore(record(1, TaskState::Submitted));
        registry.restore(record(2, TaskState::Failed));
        registry.restore(record(3, TaskState::Completed));
        registry.restore(record(4, TaskState::Submitted));
        assert_eq!(registry.numbered_past("echo"), 5);
        registry.give_numbers("echo", 5..69);
        // 5 kept, 3 allowed: 3 must go, and only 3 have ended.
        let Ok(Created::New(_, _, forgotten)) = create(&registry, "new-1") else {
            panic!("room was made");
        };
        let seqs: Vec<u64> = forgotten.iter().map(|forgotten| forgotten.seq).collect();
        assert_eq!(seqs, [0, 2, 3], "the ended ones, oldest first");
        assert_eq!(forgotten[0].inner.as_deref(), Some("echo-inner-0"));
        assert!(registry.watch("echo", "echo-task-0").is_none());
        assert!(registry.watch("echo", "echo-task-1").is_some(), "an open task stays");
        // Now 3 kept (two open, the new one submitted): none has ended.
        assert!(matches!(create(&registry, "new-2"), Err(AdmitError::Full)));
        assert!(registry.watch("echo", "echo-task-1").is_some());
        assert!(registry.watch("echo", "echo-task-4").is_some());
    }

    /// How long the cancel test below holds a cancel "being stored" while the lane's turn
    /// has come, in milliseconds: time enough for the lane, on another worker, to start
    /// the task if it could.
    const CANCEL_BEING_STORED_MS: u64 = 100;

    /// Goal: a task whose cancel is being stored neither reads canceled nor starts: its
    /// watchers are told nothing and its lane waits; once the cancel is finished, the
    /// task is canceled (and never starts) if it was stored, and starts as if never
    /// canceled if it could not be. Another cancel meanwhile waits for the first
    /// (`Pending`); one after it finds the task not cancelable either way (canceled, or
    /// working). On worker threads: the lane's start runs on a spawned task, racing the
    /// cancel's finish.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_task_whose_cancel_is_being_stored_starts_only_if_the_cancel_could_not_be_stored() {
        let registry = Arc::new(TaskRegistry::new(16, None));
        registry.give_numbers("echo", 0..2);
        let now = Deadline::from_micros(2);
        for (stored, message) in [(false, "cancel-not-stored"), (true, "cancel-stored")] {
            let Ok(Created::New(task, _, _)) = create(&registry, message) else {
                panic!("a task is created");
            };
            let mut watcher = registry.watch("echo", &task.id).expect("the task is held");
            let CancelOutcome::Begun(begun) = registry.cancel("echo", &task.id, now) else {
                panic!("a waiting task's cancel begins");
            };
            assert_eq!(begun.record.state, TaskState::Canceled);
            assert!(matches!(
                registry.cancel("echo", &task.id, now),
                CancelOutcome::Pending(_)
            ));
            let lane = {
                let registry = Arc::clone(&registry);
                let id = task.id.clone();
                tokio::spawn(async move {
                    loop {
                        match registry.start(&id, now) {
                            TaskStart::Started => return true,
                            TaskStart::NotStarted => return false,
                            TaskStart::Wait(cancel) => drop(cancel.lock().await),
                        }
                    }
                })
            };
            tokio::time::sleep(std::time::Duration::from_millis(CANCEL_BEING_STORED_MS)).await;
            assert!(!lane.is_finished(), "the lane waits while the cancel is being stored");
            let read = registry.get("echo", &task.id).expect("held");
            assert_eq!(
                read.state,
                TaskState::Submitted,
                "a cancel not stored yet does not show"
            );
            assert!(!watcher.has_changed().unwrap(), "its watchers are told nothing yet");

            let answered = registry.finish_cancel(begun, stored);
            assert_eq!(answered.state, TaskState::Canceled);
            let started = tokio::time::timeout(std::time::Duration::from_secs(5), lane)
                .await
                .expect("the lane goes on once the cancel is finished")
                .unwrap();
            assert_eq!(started, !stored, "stored: {stored}");
            let expected = if stored {
                TaskState::Canceled
            } else {
                TaskState::Working
            };
            assert_eq!(registry.get("echo", &task.id).expect("held").state, expected);
            assert!(watcher.has_changed().unwrap());
            assert_eq!(
                watcher.borrow_and_update().state,
                expected,
                "watchers see what is stored"
            );
            assert!(matches!(
                registry.cancel("echo", &task.id, now),
                CancelOutcome::NotCancelable(_)
            ));
        }
    }
}
