//! The conversation API of [`AgentClient`] (see `conversation.rs`).

use std::time::Duration;

use troupe_core::{CallContext, Deadline, TraceId};

use crate::conversation::{
    check_name, conversation_actor, decode_conv_reply, decode_definition, index_actor, member_prefix, read_committed,
    ConvCommand, ConvReply, ConversationError, ConversationInfo, ConversationKind, ConversationMessage, Participant,
    PostRequest, Posted, Sender, CONVERSATIONS_LISTED_MAX, CONVERSATION_PAGE_MAX, CONVERSATION_PARTICIPANTS_MAX,
};
use crate::limits::{AGENT_DELIVERY_ACK_TIMEOUT_MS, CALL_RECORD_SHUTDOWN_FLUSH_TIMEOUT_MS};
use crate::AgentClient;

/// How long a read of the conversations' store made outside a turn
/// ([`AgentClient::read_messages`], [`AgentClient::conversation`],
/// [`AgentClient::conversation_exists`], [`AgentClient::conversations_of_after`],
/// [`AgentClient::resume_conversations`]) is tried again while the store is unavailable
/// (`StoreError::Unavailable`: PostgreSQL restarting, a connection refused, SQLite's
/// file locked), in milliseconds from the call: the API takes no timeout, so none is
/// known. 10 s rides out a restart of PostgreSQL (1–5 s), as a post's turn (its
/// commit tried again within its [`crate::limits::AGENT_DELIVERY_ACK_TIMEOUT_MS`])
/// does; less than that, because a reader waits on a page that changes nothing, and
/// a reader told 503 with `Retry-After` soon may read again (the server's request
/// timeout is far longer: 130 s by default).
pub const CONVERSATION_READ_STORE_WAIT_MS: u64 = 10_000;

const _: () = assert!(CONVERSATION_READ_STORE_WAIT_MS >= troupe_runtime::STORE_RETRY_PAUSE_MS_MAX);
const _: () = assert!(CONVERSATION_READ_STORE_WAIT_MS <= crate::limits::AGENT_DELIVERY_ACK_TIMEOUT_MS);

impl AgentClient {
    /// The deadline of a read of the conversations' store made now
    /// ([`CONVERSATION_READ_STORE_WAIT_MS`] away).
    fn read_deadline(&self) -> Deadline {
        self.runtime
            .deadline_in(Duration::from_millis(CONVERSATION_READ_STORE_WAIT_MS))
    }

    async fn conversation_request(&self, key: &str, command: ConvCommand) -> Result<ConvReply, ConversationError> {
        self.conversation_request_in(key, command, None).await
    }

    /// [`AgentClient::conversation_request`], the conversation's turn under trace id
    /// `trace_id` (if any).
    async fn conversation_request_in(
        &self,
        key: &str,
        command: ConvCommand,
        trace_id: Option<TraceId>,
    ) -> Result<ConvReply, ConversationError> {
        let target = if key.is_empty() {
            index_actor()
        } else {
            conversation_actor(key)?
        };
        let timeout = Duration::from_millis(AGENT_DELIVERY_ACK_TIMEOUT_MS);
        let bytes = match trace_id {
            None => {
                self.runtime
                    .invoke_routed_within(&target, command.encode(), timeout)
                    .await?
            }
            Some(trace) => {
                let context = CallContext::root(self.runtime.deadline_in(timeout)).with_trace_id(trace);
                self.runtime
                    .invoke_routed_in(&target, command.encode(), context)
                    .await
                    .map_err(|error| crate::system::timeout_as_given(error, &target, timeout))?
            }
        };
        match decode_conv_reply(&bytes)? {
            ConvReply::Error(error) => Err(error),
            other => Ok(other),
        }
    }

    /// Creates conversation `id` (or returns it, if it exists with the same
    /// participants and kind: retrying is safe). Agents must be in the directory; a
    /// direct conversation has exactly two participants, a group at least two; at most
    /// [`CONVERSATION_PARTICIPANTS_MAX`]. The conversation is recorded in the index
    /// first, so [`AgentClient::conversations_of`] lists it for each agent. An id
    /// taken by another definition is refused `Conflict` before the index records
    /// anything; a creation that loses a race to another definition is refused too, and
    /// takes its agents that are not participants of the winner out of the index again
    /// (best effort: logged if that fails).
    ///
    /// # Errors
    /// [`ConversationError::InvalidName`] (ids starting with `_` are reserved),
    /// [`ConversationError::InvalidParticipants`], [`ConversationError::UnknownAgent`],
    /// [`ConversationError::Conflict`], [`ConversationError::Unavailable`].
    pub async fn create_conversation(
        &self,
        id: &str,
        participants: Vec<Participant>,
        kind: ConversationKind,
    ) -> Result<ConversationInfo, ConversationError> {
        check_name("conversation id", id)?;
        if id.starts_with('_') {
            return Err(ConversationError::InvalidName {
                what: "conversation id".to_string(),
                value: id.to_string(),
                reason: "ids starting with '_' are reserved".to_string(),
            });
        }
        conversation_actor(id)?;
        let invalid = |reason: String| ConversationError::InvalidParticipants { reason };
        let mut sorted = participants.clone();
        sorted.sort();
        sorted.dedup_by(|a, b| a.name() == b.name());
        if sorted.len() != participants.len() {
            return Err(invalid("a name appears twice".to_string()));
        }
        match kind {
            ConversationKind::Direct if participants.len() != 2 => {
                return Err(invalid(format!(
                    "a direct conversation has exactly 2 participants, not {}",
                    participants.len()
                )))
            }
            ConversationKind::Group if participants.len() < 2 => {
                return Err(invalid("a group needs at least 2 participants".to_string()))
            }
            _ if participants.len() > CONVERSATION_PARTICIPANTS_MAX => {
                return Err(invalid(format!(
                    "at most {CONVERSATION_PARTICIPANTS_MAX} participants, not {}",
                    participants.len()
                )))
            }
            _ => {}
        }
        let mut agents = Vec::new();
        for participant in &participants {
            check_name("participant", participant.name())?;
            if let Participant::Agent(agent) = participant {
                if !self.lists_agent(agent).await {
                    return Err(ConversationError::UnknownAgent { agent: agent.clone() });
                }
                agents.push(agent.clone());
            }
        }
        // An id taken by another definition is refused before the index records it for
        // these agents (one snapshot read); a creation that loses a race to another
        // definition takes its agents out of the index again (below). Before, the
        // index kept them: an agent listed a conversation it was not in
        // (`tests/conversation_probes.rs`).
        let conflict = || ConversationError::Conflict { id: id.to_string() };
        if let Some(existing) = self.conversation(id).await? {
            if existing.kind != kind || existing.participants != sorted {
                return Err(conflict());
            }
        }
        let register = ConvCommand::Register {
            conversation: id.to_string(),
            agents: agents.clone(),
        };
        self.conversation_request("", register).await?;
        match self
            .conversation_request(id, ConvCommand::Create { participants, kind })
            .await
        {
            Ok(ConvReply::Created(info)) => Ok(info),
            Err(ConversationError::Conflict { .. }) => {
                self.unregister_outsiders(id, agents).await;
                Err(conflict())
            }
            Err(error) => Err(error),
            Ok(other) => Err(ConversationError::Unavailable {
                store_unavailable: false,
                cause: format!("unexpected reply {other:?}"),
            }),
        }
    }

    /// Takes `agents`, recorded in the index for conversation `id` by a creation that
    /// was then refused `Conflict`, out of the index again, except those that take part
    /// in the conversation as it was created. Best effort (logged): an entry left
    /// lists a conversation whose definition does not name the agent, as before.
    async fn unregister_outsiders(&self, id: &str, agents: Vec<String>) {
        let existing = match self.conversation(id).await {
            Ok(Some(existing)) => existing,
            Ok(None) => return,
            Err(error) => {
                tracing::warn!(conversation = %id, %error, "could not read the conversation to take a refused creation's agents out of the index");
                return;
            }
        };
        let outsiders: Vec<String> = agents
            .into_iter()
            .filter(|agent| !existing.participants.contains(&Participant::Agent(agent.clone())))
            .collect();
        if outsiders.is_empty() {
            return;
        }
        let unregister = ConvCommand::Unregister {
            conversation: id.to_string(),
            agents: outsiders,
        };
        if let Err(error) = self.conversation_request("", unregister).await {
            tracing::warn!(conversation = %id, %error, "could not take a refused creation's agents out of the index");
        }
    }

    /// The direct conversation of participants `a` and `b`, created on first use; its id
    /// is [`crate::direct_conversation_id_of`] of the pair, the same either way round
    /// (of two agents, [`crate::direct_conversation_id`] of their ids, where their
    /// `call_agent` exchanges are recorded).
    ///
    /// A pair with a human: before 2026-12-06 its id was the one two agents of the same
    /// names have (human `alice` with agent `bob`: `dm:alice|bob`). A conversation stored
    /// there by an older version is still this pair's: when the pair's id names no
    /// conversation yet and the old one holds a direct conversation of exactly this pair
    /// (the same names and kinds), that one is returned, and none is made under the new
    /// id. When the old id holds another pair's (agents `alice` and `bob`, whose id it
    /// is), the pair gets its own under the new id. Only the other way round is not
    /// repaired: agents `alice` and `bob`, whose id holds human `alice`'s old
    /// conversation with `bob`, cannot have theirs there (their creation is refused
    /// `Conflict`, and their exchanges are not recorded) until that conversation is
    /// moved.
    ///
    /// # Errors
    /// As [`AgentClient::create_conversation`].
    pub async fn direct_conversation(
        &self,
        a: Participant,
        b: Participant,
    ) -> Result<ConversationInfo, ConversationError> {
        let id = crate::direct_conversation_id_of(&a, &b);
        let old = crate::direct_conversation_id(a.name(), b.name());
        if old != id && self.conversation(&id).await?.is_none() {
            if let Some(stored) = self.conversation(&old).await? {
                let mut pair = vec![a.clone(), b.clone()];
                pair.sort();
                if stored.kind == ConversationKind::Direct && stored.participants == pair {
                    return Ok(stored);
                }
            }
        }
        self.create_conversation(&id, vec![a, b], ConversationKind::Direct)
            .await
    }

    /// Posts `text` to conversation `id` as `sender` (a participant) under the
    /// caller-chosen `msg_id`: a retry with the same id returns the first post's seq and
    /// appends nothing. Each `@agent` mention triggers one turn of that agent, delivered
    /// through its durable inbox; its reply is appended to the conversation. A mention
    /// the call rules or the organisation refuse is recorded as a system note instead.
    ///
    /// # Errors
    /// [`ConversationError::InvalidName`] (empty `msg_id`), [`ConversationError::NotFound`],
    /// [`ConversationError::NotParticipant`], [`ConversationError::UnknownMention`],
    /// [`ConversationError::TooManyMentions`], [`ConversationError::BadText`],
    /// [`ConversationError::Full`], [`ConversationError::Unavailable`] (retry with the
    /// same `msg_id`).
    pub async fn post_message(
        &self,
        id: &str,
        sender: Sender,
        msg_id: &str,
        text: &str,
    ) -> Result<Posted, ConversationError> {
        self.post_message_in(id, sender, msg_id, text, None).await
    }

    /// [`AgentClient::post_message`] under trace id `trace_id` (if any): the
    /// conversation's turn on the post runs under it, and so does the delivery of each
    /// mention it triggers, with the mentioned agent's turn and model calls (its
    /// `deliver` span starts in that trace when the spans are exported; see
    /// `troupe_agent::set_trace_starter`). The agent's reply, posted from that turn,
    /// carries the trace on to the mentions it makes.
    ///
    /// # Errors
    /// As [`AgentClient::post_message`].
    pub async fn post_message_in(
        &self,
        id: &str,
        sender: Sender,
        msg_id: &str,
        text: &str,
        trace_id: Option<TraceId>,
    ) -> Result<Posted, ConversationError> {
        check_name("message id", msg_id)?;
        if msg_id.starts_with("answer:") {
            return Err(ConversationError::InvalidName {
                what: "message id".to_string(),
                value: msg_id.to_string(),
                reason: "ids starting with 'answer:' are reserved for agents' answers".to_string(),
            });
        }
        if sender == Sender::System {
            return Err(ConversationError::NotParticipant {
                id: id.to_string(),
                sender,
            });
        }
        let request = PostRequest {
            sender,
            client_id: msg_id.to_string(),
            text: text.to_string(),
            reply_to: None,
            chain: Vec::new(),
            note: None,
            strict: true,
            record: false,
        };
        match self
            .conversation_request_in(id, ConvCommand::Post(request), trace_id)
            .await?
        {
            ConvReply::Posted(posted) => Ok(posted),
            other => Err(ConversationError::Unavailable {
                store_unavailable: false,
                cause: format!("unexpected reply {other:?}"),
            }),
        }
    }

    /// Up to `limit` (at most [`CONVERSATION_PAGE_MAX`]) committed messages of
    /// conversation `id` after seq `after` (from the start if `None`), in order. A store
    /// down for a moment is read again for up to [`CONVERSATION_READ_STORE_WAIT_MS`].
    ///
    /// # Errors
    /// [`ConversationError::InvalidName`], [`ConversationError::Unavailable`].
    pub async fn read_messages(
        &self,
        id: &str,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<ConversationMessage>, ConversationError> {
        let target = conversation_actor(id)?;
        let deadline = self.read_deadline();
        // `call_agent` exchanges this process recorded there and that still wait in
        // memory are stored first, so a call's record is read once the call returned.
        let stored = crate::call_record::store_waiting_records(
            &self.shared,
            &self.runtime,
            &target,
            Duration::from_millis(CALL_RECORD_SHUTDOWN_FLUSH_TIMEOUT_MS),
        )
        .await;
        if let Err(error) = stored {
            tracing::warn!(conversation = %target, %error, "could not store the waiting call records before reading; reading what is stored");
        }
        read_committed(&self.shared, &target, after, limit.min(CONVERSATION_PAGE_MAX), deadline).await
    }

    /// Whether conversation `id` is recorded in the index (one key read, not a scan of
    /// its messages): what an API answers "not found" on before reading a page. A store
    /// down for a moment is read again for up to [`CONVERSATION_READ_STORE_WAIT_MS`].
    ///
    /// # Errors
    /// [`ConversationError::InvalidName`], [`ConversationError::Unavailable`].
    pub async fn conversation_exists(&self, id: &str) -> Result<bool, ConversationError> {
        conversation_actor(id)?;
        let (index, key) = (index_actor(), format!("c/{id}"));
        let found = self
            .runtime
            .retry_store(self.read_deadline(), "get", &index, || {
                self.runtime.store().get(&index, &key)
            })
            .await?;
        Ok(found.is_some())
    }

    /// The ids of the conversations agent `agent` takes part in (at most
    /// [`CONVERSATIONS_LISTED_MAX`]), in id order: the first page of
    /// [`AgentClient::conversations_of_after`].
    ///
    /// # Errors
    /// [`ConversationError::InvalidName`] (`agent` cannot be an agent id),
    /// [`ConversationError::Unavailable`].
    pub async fn conversations_of(&self, agent: &str) -> Result<Vec<String>, ConversationError> {
        self.conversations_of_after(agent, None, CONVERSATIONS_LISTED_MAX).await
    }

    /// Up to `limit` (at most [`CONVERSATIONS_LISTED_MAX`]) ids of the conversations agent
    /// `agent` takes part in, after id `after` (from the first if `None`), in id order:
    /// one ranged read of the index. A page shorter than `limit` is the last; otherwise
    /// the next page is the one after its last id. A store down for a moment is read
    /// again for up to [`CONVERSATION_READ_STORE_WAIT_MS`] (the whole page: its reads
    /// share one deadline).
    ///
    /// An id is listed once the index records it, which `create_conversation` does
    /// first: if a creation stopped there, the id is listed but has no definition yet
    /// ([`AgentClient::conversation`] is `None`) until the creation is retried.
    ///
    /// Where the agent's id or a conversation's id holds a `/`, the index's entry
    /// cannot say whose it is (agent `a` in `b/x`, or agent `a/b` in `x`): such an entry
    /// is listed only if the conversation's definition names the agent (one snapshot
    /// read each, so not before its creation completed), and the page goes on reading
    /// the index until it has `limit` ids or the index has no more.
    ///
    /// # Errors
    /// [`ConversationError::InvalidName`] (`agent` cannot be an agent id, or a bad
    /// `after`), [`ConversationError::Unavailable`].
    pub async fn conversations_of_after(
        &self,
        agent: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<String>, ConversationError> {
        // Only an agent id takes part (and its prefix fits in the store's keys).
        crate::agent::agent_id(agent).map_err(|error| ConversationError::InvalidName {
            what: "agent id".to_string(),
            value: agent.to_string(),
            reason: error.to_string(),
        })?;
        let prefix = member_prefix(agent);
        let after_key = match after {
            Some(id) => {
                check_name("conversation id", id)?;
                Some(format!("{prefix}{id}"))
            }
            None => None,
        };
        let limit = limit.min(CONVERSATIONS_LISTED_MAX);
        let deadline = self.read_deadline();
        let index = index_actor();
        let mut listed = Vec::new();
        let mut after_key = after_key;
        while listed.len() < limit {
            let page = self
                .runtime
                .retry_store(deadline, "scan", &index, || {
                    self.runtime.store().scan(&index, &prefix, after_key.as_deref(), limit)
                })
                .await?;
            let last_page = page.len() < limit;
            after_key = page.last().map(|(key, _)| key.clone());
            for (key, _) in page {
                let Some(id) = key.strip_prefix(&prefix) else { continue };
                // `member/{agent}/{conversation}` splits at any `/` when the agent's id
                // or the conversation's holds one: `member/a/b/x` is agent `a` in `b/x`
                // or agent `a/b` in `x`. Such an entry is listed only if the
                // conversation's definition names the agent (one snapshot read); the
                // usual ids, without `/`, are listed as the index holds them. Before,
                // agent `a` listed `b/x` for agent `a/b`'s `x`
                // (`tests/conversation_probes.rs`).
                if (agent.contains('/') || id.contains('/')) && !self.takes_part(agent, id, deadline).await? {
                    continue;
                }
                if listed.len() < limit {
                    listed.push(id.to_string());
                }
            }
            if last_page {
                break;
            }
        }
        Ok(listed)
    }

    /// Whether conversation `id`'s definition names agent `agent` (`false` for an id no
    /// conversation can have, or one without a definition); the store read again until
    /// `deadline` while unavailable.
    async fn takes_part(&self, agent: &str, id: &str, deadline: Deadline) -> Result<bool, ConversationError> {
        if conversation_actor(id).is_err() {
            return Ok(false);
        }
        let participant = Participant::Agent(agent.to_string());
        Ok(self
            .conversation_until(id, deadline)
            .await?
            .is_some_and(|info| info.participants.contains(&participant)))
    }
    /// The definition of conversation `id` (its participants and kind) as committed:
    /// one read of its snapshot, not of its messages. `None` if it has none: never
    /// created, a reserved id (starting with `_`), or a creation that stopped after the
    /// index recorded the id (creating it again with the same definition completes it).
    /// A store down for a moment is read again for up to
    /// [`CONVERSATION_READ_STORE_WAIT_MS`].
    ///
    /// # Errors
    /// [`ConversationError::InvalidName`], [`ConversationError::Unavailable`] (the store
    /// failed, or the snapshot cannot be decoded).
    pub async fn conversation(&self, id: &str) -> Result<Option<ConversationInfo>, ConversationError> {
        self.conversation_until(id, self.read_deadline()).await
    }

    /// [`AgentClient::conversation`], the store read again until `deadline`.
    async fn conversation_until(
        &self,
        id: &str,
        deadline: Deadline,
    ) -> Result<Option<ConversationInfo>, ConversationError> {
        let target = conversation_actor(id)?;
        if id.starts_with('_') {
            // Reserved (the index): never a conversation.
            return Ok(None);
        }
        let store = self.runtime.store();
        match self
            .runtime
            .retry_store(deadline, "load", &target, || store.load(&target))
            .await?
        {
            Some(snapshot) => decode_definition(&snapshot).map_err(|cause| ConversationError::Unavailable {
                store_unavailable: false,
                cause: format!("the state of {target} cannot be decoded: {cause}"),
            }),
            None => Ok(None),
        }
    }

    /// Wakes every conversation with undelivered mentions (the system does it at start).
    /// Returns how many were woken.
    ///
    /// On a cluster node (a root call router installed), a conversation with pending
    /// relays that is placed on another node is not woken: its owner's activation
    /// delivers them. One placement lookup (an etcd read) each; one whose lookup fails
    /// is skipped too, for the next call to look again. One placed here or nowhere is
    /// woken here (which claims it here), as [`AgentClient::resume_pending`] does.
    ///
    /// A store down for a moment is read again for up to
    /// [`CONVERSATION_READ_STORE_WAIT_MS`] (all its reads share one deadline).
    ///
    /// # Errors
    /// [`ConversationError::Unavailable`] if the store fails.
    pub async fn resume_conversations(&self) -> Result<usize, ConversationError> {
        let store = self.runtime.store();
        let deadline = self.read_deadline();
        let index = index_actor();
        let mut after: Option<String> = None;
        let mut woken = 0;
        let mut skipped = crate::system::NotResumedHere::default();
        loop {
            let page = self
                .runtime
                .retry_store(deadline, "scan", &index, || {
                    store.scan(&index, "c/", after.as_deref(), CONVERSATIONS_LISTED_MAX)
                })
                .await?;
            for (key, _) in &page {
                let Some(id) = key.strip_prefix("c/") else { continue };
                let Ok(target) = conversation_actor(id) else { continue };
                let relays = self
                    .runtime
                    .retry_store(deadline, "scan", &target, || store.scan(&target, "relay/", None, 1))
                    .await?;
                if relays.is_empty() {
                    continue;
                }
                if !skipped.resume_here(&self.runtime, &target).await {
                    continue;
                }
                let deadline = self
                    .runtime
                    .deadline_in(Duration::from_millis(troupe_core::limits::INVOKE_TIMEOUT_MS_MAX));
                match self
                    .runtime
                    .tell(&target, ConvCommand::Resume { after: None }.encode(), deadline)
                    .await
                {
                    Ok(()) => woken += 1,
                    Err(error) => tracing::warn!(conversation = %id, %error, "could not resume"),
                }
            }
            if page.len() < CONVERSATIONS_LISTED_MAX {
                skipped.log(woken, "conversations with pending relays");
                return Ok(woken);
            }
            after = page.last().map(|(key, _)| key.clone());
        }
    }
}
