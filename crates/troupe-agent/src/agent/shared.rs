//! What every agent of one system shares: the directory, the model, the tools, the
//! observers and the runtime once started.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use troupe_core::Deadline;
use troupe_runtime::{Clock, RuntimeHandle, WeakRuntimeHandle};

use crate::conversation::PostRequest;
use crate::{AgentDirectory, AgentEvent, AgentObserver, AgentSpec, LlmClient, ToolRegistry};

/// What every agent of one system shares.
pub(crate) struct AgentShared {
    pub(crate) directory: AgentDirectory,
    /// The default model client: agents that name no provider use it.
    pub(crate) llm: Arc<dyn LlmClient>,
    /// The named model providers, by name.
    pub(crate) providers: BTreeMap<String, Arc<dyn LlmClient>>,
    /// Its offered specs are shared by every model request until an attached MCP
    /// server's list changes (`ToolRegistry::offered_specs`).
    pub(crate) tools: ToolRegistry,
    pub(crate) observers: Vec<Arc<dyn AgentObserver>>,
    /// The organisation: links, permissions, approvals (`org_store.rs`).
    pub(crate) org: crate::org_store::OrgStore,
    /// The agents defined through the API, stored (`directory_store.rs`).
    pub(crate) defined: crate::directory_store::DirectoryStore,
    /// The remote agents, by local id (`remote.rs`).
    pub(crate) remotes: crate::remote::RemoteDirectory,
    /// The broadcast event stream ([`crate::AgentClient::subscribe`]).
    pub(crate) stream: tokio::sync::broadcast::Sender<AgentEvent>,
    next_call: AtomicU64,
    /// Counts the ids this process made (`AgentShared::fresh_id`: trace ids, remote
    /// calls' message ids).
    pub(crate) next_trace: AtomicU64,
    /// The runtime's clock, set once the runtime has started (before any agent can
    /// activate): the time of the events the hooks report, which have no turn at hand.
    clock: OnceLock<Clock>,
    /// The runtime, set once it has started: delivery tasks invoke through it. Weak:
    /// the runtime owns this (through the agent and conversation factories), so a
    /// strong handle here would be a cycle that keeps a dropped system, its store and
    /// everything in them alive for as long as the process lives.
    runtime: OnceLock<WeakRuntimeHandle>,
    /// The direct conversations `call_record.rs` created or found in this process, by
    /// the pair's names in order (as `direct_conversation_id` orders them): found by the
    /// two names as they are, without writing the conversation's id for each record.
    direct_conversations: std::sync::Mutex<BTreeMap<String, BTreeMap<String, troupe_core::ActorId>>>,
    /// External tasks (`external.rs`) whose turn runs now in this process: they read
    /// `working` (the store says `submitted` until the turn commits its outcome).
    pub(crate) external_running: std::sync::Mutex<std::collections::BTreeSet<String>>,
    /// External tasks a caller asked to cancel in this process: a processing turn that
    /// finds its task here resolves it canceled instead of running it.
    pub(crate) external_cancels: std::sync::Mutex<std::collections::BTreeSet<String>>,
    /// Inbox entries (agent, seq) of mentions whose answer could not be posted, which a
    /// task of this process tries again (`inbox_turns.rs`): one task per entry, however
    /// often its turn fails (a failed turn rebuilds the agent, so the agent cannot keep
    /// this itself).
    pub(crate) mention_retries: std::sync::Mutex<std::collections::BTreeSet<(troupe_core::ActorId, u64)>>,
    /// Recorded `call_agent` exchanges waiting for their direct conversation's next
    /// `FlushRecords` turn (`call_record.rs`), by conversation actor. An entry stays once
    /// made (one per direct conversation used in this process, as
    /// `direct_conversations`): a read through the API asks the conversation to store
    /// its waiting records first only when it has one.
    call_records: std::sync::Mutex<BTreeMap<troupe_core::ActorId, PendingRecords>>,
    /// Mentions (conversation, seq, agent) a delivery task of this process delivers: one
    /// task per mention, however many activations of the conversation resumed it (an
    /// activation's own set is lost when it is rebuilt or moves, while its tasks go on).
    mention_deliveries: std::sync::Mutex<std::collections::BTreeSet<(troupe_core::ActorId, u64, String)>>,
    /// The wake-up armed for each agent with a delegated task due to be resolved
    /// overdue (`inbox_turns.rs`, `arm_overdue_wake`): the time its one timer task of
    /// this process sleeps until, the earliest due that the agent's turns armed. The
    /// task takes its entry out when it fires (a turn then arms the next due).
    pub(crate) overdue_wakes: std::sync::Mutex<BTreeMap<troupe_core::ActorId, Arc<crate::inbox_turns::OverdueWake>>>,
    /// The delivery tasks of this process still running (outbox entries' and
    /// mentions', `AgentShared::spawn_delivery`), and the wake-up for who waits for
    /// them to end ([`crate::AgentSystem::shutdown`]).
    deliveries_live: std::sync::atomic::AtomicUsize,
    deliveries_ended: tokio::sync::Notify,
    /// Set (and `deliveries_stop` woken) by [`crate::AgentSystem::shutdown`] once the
    /// runtime stopped: every delivery task ends at once, wherever it waits (an
    /// approval, a pause between attempts), instead of at its next attempt, which may
    /// be its entry's deadline, minutes later. What it had not delivered is stored, and
    /// the next start delivers it.
    deliveries_stopped: std::sync::atomic::AtomicBool,
    deliveries_stop: tokio::sync::Notify,
}

/// Counts one delivery task while it lives (dropped when it ends, or is dropped with its
/// runtime).
struct DeliveryLive(Arc<AgentShared>);

impl Drop for DeliveryLive {
    fn drop(&mut self) {
        if self.0.deliveries_live.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.deliveries_ended.notify_waiters();
        }
    }
}

/// A mention's delivery task of this process, taken by
/// [`AgentShared::start_mention_delivery`]; dropping it (the task ended, or was dropped
/// with its runtime) lets the next resume start another.
pub(crate) struct MentionDelivery {
    shared: Arc<AgentShared>,
    mention: (troupe_core::ActorId, u64, String),
}

impl Drop for MentionDelivery {
    fn drop(&mut self) {
        self.shared
            .mention_deliveries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.mention);
    }
}

/// One direct conversation's recorded exchanges not yet stored (question, answer).
#[derive(Default)]
struct PendingRecords {
    exchanges: Vec<(PostRequest, PostRequest)>,
    /// Whether a wake-up of the conversation is on its way (a timer task, then a tell):
    /// set by the record that finds none, cleared when the conversation takes the
    /// records, or when the wake-up could not be sent.
    wake_scheduled: bool,
}

impl PendingRecords {
    fn queue(&mut self, question: PostRequest, answer: PostRequest) -> RecordQueued {
        if self.exchanges.len() >= crate::limits::CALL_RECORDS_PENDING_MAX {
            return RecordQueued::Dropped;
        }
        self.exchanges.push((question, answer));
        if self.wake_scheduled {
            return RecordQueued::Queued;
        }
        self.wake_scheduled = true;
        RecordQueued::WakeConversation
    }

    fn take(&mut self) -> Vec<(PostRequest, PostRequest)> {
        self.wake_scheduled = false;
        std::mem::take(&mut self.exchanges)
    }
}

/// What [`AgentShared::queue_call_record`] did with an exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RecordQueued {
    /// Queued, and no wake-up of the conversation was on its way: the caller schedules one.
    WakeConversation,
    /// Queued behind a wake-up already on its way.
    Queued,
    /// Not queued: [`crate::limits::CALL_RECORDS_PENDING_MAX`] are already waiting.
    Dropped,
}

impl AgentShared {
    pub(crate) fn new(
        directory: AgentDirectory,
        llm: Arc<dyn LlmClient>,
        providers: BTreeMap<String, Arc<dyn LlmClient>>,
        tools: ToolRegistry,
        observers: Vec<Arc<dyn AgentObserver>>,
    ) -> Self {
        Self {
            directory,
            llm,
            providers,
            tools,
            observers,
            org: crate::org_store::OrgStore::new(),
            defined: crate::directory_store::DirectoryStore::new(),
            remotes: crate::remote::RemoteDirectory::default(),
            stream: tokio::sync::broadcast::channel(crate::limits::AGENT_EVENT_STREAM_CAPACITY).0,
            next_call: AtomicU64::new(1),
            next_trace: AtomicU64::new(0),
            clock: OnceLock::new(),
            runtime: OnceLock::new(),
            direct_conversations: std::sync::Mutex::default(),
            external_running: std::sync::Mutex::default(),
            external_cancels: std::sync::Mutex::default(),
            mention_retries: std::sync::Mutex::default(),
            call_records: std::sync::Mutex::default(),
            mention_deliveries: std::sync::Mutex::default(),
            overdue_wakes: std::sync::Mutex::default(),
            deliveries_live: std::sync::atomic::AtomicUsize::new(0),
            deliveries_stopped: std::sync::atomic::AtomicBool::new(false),
            deliveries_stop: tokio::sync::Notify::new(),
            deliveries_ended: tokio::sync::Notify::new(),
        }
    }

    /// Spawns a delivery task (an outbox entry's or a mention's, instrumented with its
    /// `deliver` span), counted while it lives. The task's future, and with it its span,
    /// is dropped before the count goes down: once [`Self::deliveries_ended`] returns,
    /// every ended delivery's span is closed (and handed to an exporter, if any).
    pub(crate) fn spawn_delivery(self: &Arc<Self>, task: impl std::future::Future<Output = ()> + Send + 'static) {
        self.deliveries_live.fetch_add(1, Ordering::AcqRel);
        let live = DeliveryLive(Arc::clone(self));
        tokio::spawn(async move {
            let shared = Arc::clone(&live.0);
            tokio::select! {
                biased;
                () = shared.deliveries_stopped() => {}
                () = task => {}
            }
            drop(live);
        });
    }

    /// Ends every delivery task of this process at once (their futures, and spans, are
    /// dropped; [`Self::deliveries_ended`] then sees them end). Called once the runtime
    /// stopped: a task it ends could have committed nothing more anyway.
    pub(crate) fn stop_deliveries(&self) {
        self.deliveries_stopped.store(true, Ordering::Release);
        self.deliveries_stop.notify_waiters();
    }

    /// Returns once [`Self::stop_deliveries`] was called.
    async fn deliveries_stopped(&self) {
        loop {
            let stop = self.deliveries_stop.notified();
            tokio::pin!(stop);
            stop.as_mut().enable();
            if self.deliveries_stopped.load(Ordering::Acquire) {
                return;
            }
            stop.await;
        }
    }

    /// Waits until no delivery task of this process runs, or `within` has passed;
    /// returns how many still run.
    pub(crate) async fn deliveries_ended(&self, within: std::time::Duration) -> usize {
        let waited = tokio::time::timeout(within, async {
            loop {
                let ended = self.deliveries_ended.notified();
                tokio::pin!(ended);
                ended.as_mut().enable();
                if self.deliveries_live.load(Ordering::Acquire) == 0 {
                    return;
                }
                ended.await;
            }
        })
        .await;
        match waited {
            Ok(()) => 0,
            Err(_) => self.deliveries_live.load(Ordering::Acquire),
        }
    }

    /// Takes the delivery of mention `seq` of `conversation` to `agent` for a task of
    /// this process; `None` if a task of this process already delivers it.
    pub(crate) fn start_mention_delivery(
        self: &Arc<Self>,
        conversation: &troupe_core::ActorId,
        seq: u64,
        agent: &str,
    ) -> Option<MentionDelivery> {
        let mention = (conversation.clone(), seq, agent.to_string());
        let fresh = self
            .mention_deliveries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(mention.clone());
        fresh.then(|| MentionDelivery {
            shared: Arc::clone(self),
            mention,
        })
    }

    /// Whether a task of this process delivers mention `seq` of `conversation` to
    /// `agent` (taken by [`Self::start_mention_delivery`] and not yet ended).
    pub(crate) fn delivers_mention(&self, conversation: &troupe_core::ActorId, seq: u64, agent: &str) -> bool {
        self.mention_deliveries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(&(conversation.clone(), seq, agent.to_string()))
    }

    fn call_records(&self) -> std::sync::MutexGuard<'_, BTreeMap<troupe_core::ActorId, PendingRecords>> {
        self.call_records
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Queues a recorded exchange for direct conversation `conversation` (see
    /// [`RecordQueued`] for what the caller does next).
    pub(crate) fn queue_call_record(
        &self,
        conversation: &troupe_core::ActorId,
        question: PostRequest,
        answer: PostRequest,
    ) -> RecordQueued {
        let mut records = self.call_records();
        let pending = match records.get_mut(conversation) {
            Some(pending) => pending,
            None => records.entry(conversation.clone()).or_default(),
        };
        pending.queue(question, answer)
    }

    /// The exchanges waiting for `conversation`, in the order recorded, taken (its turn
    /// stores them); the next record schedules a new wake-up.
    pub(crate) fn take_call_records(&self, conversation: &troupe_core::ActorId) -> Vec<(PostRequest, PostRequest)> {
        self.call_records()
            .get_mut(conversation)
            .map(PendingRecords::take)
            .unwrap_or_default()
    }

    /// A wake-up of `conversation` could not be sent: the next record schedules one
    /// (and a read or the system's shutdown stores what waits).
    pub(crate) fn call_record_wake_failed(&self, conversation: &troupe_core::ActorId) {
        if let Some(pending) = self.call_records().get_mut(conversation) {
            pending.wake_scheduled = false;
        }
    }

    /// Whether this process recorded exchanges for `conversation` (stored or waiting).
    pub(crate) fn records_calls_in(&self, conversation: &troupe_core::ActorId) -> bool {
        self.call_records().contains_key(conversation)
    }

    /// The direct conversations with recorded exchanges still waiting to be stored.
    pub(crate) fn conversations_with_waiting_records(&self) -> Vec<troupe_core::ActorId> {
        self.call_records()
            .iter()
            .filter(|(_, pending)| !pending.exchanges.is_empty())
            .map(|(conversation, _)| conversation.clone())
            .collect()
    }

    /// The actor of the direct conversation of agents `a` and `b` (either order) if it
    /// was created (or found) in this process (kept, so a recorded call does not
    /// validate the id again).
    pub(crate) fn known_direct_conversation(&self, a: &str, b: &str) -> Option<troupe_core::ActorId> {
        let (first, second) = if a <= b { (a, b) } else { (b, a) };
        self.direct_conversations
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(first)
            .and_then(|pairs| pairs.get(second))
            .cloned()
    }

    /// Remembers that the direct conversation of agents `a` and `b` (either order)
    /// exists, as actor `actor`.
    pub(crate) fn remember_direct_conversation(&self, a: &str, b: &str, actor: troupe_core::ActorId) {
        let (first, second) = if a <= b { (a, b) } else { (b, a) };
        self.direct_conversations
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(first.to_string())
            .or_default()
            .insert(second.to_string(), actor);
    }

    /// The model client of agent `spec`: its named provider, or the default. `None` if
    /// it names a provider the system does not have (the directory refuses such a
    /// definition, so only a definition kept from an earlier run can).
    pub(crate) fn llm_for(&self, spec: &AgentSpec) -> Option<&Arc<dyn LlmClient>> {
        match &spec.provider {
            None => Some(&self.llm),
            Some(name) => self.providers.get(name),
        }
    }

    /// Records the runtime the agents run in (and its clock); the first call wins.
    pub(crate) fn set_runtime(&self, runtime: RuntimeHandle) {
        let _ = self.clock.set(runtime.clock());
        let _ = self.runtime.set(runtime.downgrade());
    }

    /// Refuses to build actor `id` before the runtime was attached
    /// ([`crate::PendingAgentSystem::attach`]): the agents need its clock and handle.
    pub(crate) fn require_attached(&self, id: &troupe_core::ActorId) -> Result<(), troupe_runtime::ActorError> {
        if self.clock.get().is_some() {
            return Ok(());
        }
        Err(troupe_runtime::ActorError::rejected(format!(
            "{id} cannot activate yet: the agent system is not attached to its runtime (PendingAgentSystem::attach); retry"
        )))
    }

    /// The runtime, once started and while it has not been dropped.
    pub(crate) fn runtime(&self) -> Option<RuntimeHandle> {
        self.runtime.get().and_then(WeakRuntimeHandle::upgrade)
    }

    /// The current time on the runtime's clock.
    ///
    /// # Panics
    /// Before [`AgentShared::set_runtime`]: the system sets it as soon as its runtime
    /// starts, before any agent can be activated.
    pub(crate) fn now(&self) -> Deadline {
        self.clock
            .get()
            .expect("the agent system sets the runtime's clock when it starts")
            .now()
    }

    pub(crate) fn next_call_id(&self) -> u64 {
        self.next_call.fetch_add(1, Ordering::Relaxed)
    }

    /// A new id for something that must not be named alike by another process, nor by
    /// this one after a restart (a trace id, a remote call's A2A message id): made from
    /// a per-process counter, the runtime's clock (anchored on the wall clock) and the
    /// process id, hashed (SipHash with fixed keys), so it draws no randomness: under
    /// simulation the same seed makes the same ids. Not a secret; unique in practice.
    /// Never zero.
    pub(crate) fn fresh_id(&self, now: Deadline) -> u128 {
        use std::hash::{Hash, Hasher};
        let n = self.next_trace.fetch_add(1, Ordering::Relaxed);
        let now = now.as_micros();
        let half = |salt: u8| {
            let mut hasher = std::hash::DefaultHasher::new();
            (salt, n, now, std::process::id()).hash(&mut hasher);
            u128::from(hasher.finish())
        };
        let value = (half(0) << 64) | half(1);
        if value == 0 {
            1
        } else {
            value
        }
    }

    pub(crate) fn emit(&self, event: &AgentEvent) {
        for observer in &self.observers {
            observer.on_event(event);
        }
        if self.stream.receiver_count() > 0 {
            // Never waits: a slow subscriber loses the oldest events and sees `Lagged`.
            let _ = self.stream.send(event.clone());
        }
    }

    /// Whether anyone receives events (an observer or a stream subscriber).
    pub(crate) fn has_listeners(&self) -> bool {
        !self.observers.is_empty() || self.stream.receiver_count() > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conversation::Sender;
    use crate::limits::CALL_RECORDS_PENDING_MAX;

    fn post(text: &str) -> PostRequest {
        PostRequest {
            sender: Sender::Agent("a".to_string()),
            client_id: String::new(),
            text: text.to_string(),
            reply_to: None,
            chain: Vec::new(),
            note: None,
            strict: false,
            record: true,
        }
    }

    /// Goal: the first record of a batch (and only it) schedules a wake-up, taking the
    /// records lets the next one schedule another, and a conversation holds at most
    /// `CALL_RECORDS_PENDING_MAX` waiting exchanges: one more is dropped, not queued.
    #[test]
    fn one_wake_up_per_batch_and_the_waiting_records_are_bounded() {
        let mut pending = PendingRecords::default();
        assert_eq!(pending.queue(post("q0"), post("a0")), RecordQueued::WakeConversation);
        assert_eq!(pending.queue(post("q1"), post("a1")), RecordQueued::Queued);
        let taken = pending.take();
        let texts: Vec<&str> = taken.iter().map(|(question, _)| question.text.as_str()).collect();
        assert_eq!(texts, ["q0", "q1"], "taken in the order recorded");
        assert_eq!(pending.queue(post("q2"), post("a2")), RecordQueued::WakeConversation);
        for n in 1..CALL_RECORDS_PENDING_MAX {
            assert_eq!(pending.queue(post(&n.to_string()), post("a")), RecordQueued::Queued);
        }
        assert_eq!(pending.queue(post("over"), post("a")), RecordQueued::Dropped);
        assert_eq!(pending.take().len(), CALL_RECORDS_PENDING_MAX);
        assert_eq!(pending.queue(post("q"), post("a")), RecordQueued::WakeConversation);
    }
}
