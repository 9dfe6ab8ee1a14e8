//! First-class conversations: 1:1 and group, durable, with @mentions that trigger
//! turns.
//!
//! Each conversation is a virtual actor of kind [`CONVERSATION_KIND`] whose key space
//! holds:
//!
//! ```text
//! msg/{seq:020}          the messages, append-only, seq 0, 1, 2, ... (gap-free); an
//!                        entry holds message `seq` (a JSON object), or a recorded
//!                        exchange's messages ending at `seq` (a JSON array)
//! id/{client_msg_id}     → seq: one per posted message id (a retried post is a no-op)
//! relay/{seq:020}/{agent} a mention to deliver to an agent's inbox, until acknowledged
//! ```
//!
//! and in its snapshot its participants, kind and next seq. A post is one turn: the
//! message, its system notes and its relays commit together. The actor is single
//! activation, so concurrent posts are serialized and the sequence stays gap-free.
//!
//! ```text
//! post (human or agent) ─► conversation turn: validate, append msg/{s}; for each @agent:
//!     cycle (in the chain or the sender) / depth (chain ≥ AGENT_CALL_DEPTH_MAX) /
//!     organisation (Notify from the sending agent) refused → a system note msg/{s+k}
//!     needs approval → a pending approval recorded, then relay/{s}/{agent} naming it
//!     else relay/{s}/{agent}                              all committed together
//! Relay{s, agent}: a delivery task waits for the relay's approval, if it names one
//!     (denied, refused or not approved by the deadline → Refused: a NotPermitted note),
//!     then appends Mention{conv, s, chain} to the agent's inbox
//!     (message id {conv}#{s}@{agent}: deduplicated), retries until the deadline
//!     (none at or past it: Undeliverable, an Undeliverable note)
//! agent Process: reads the last messages up to s from the store (role-relative view),
//!     runs its model, posts its reply (message id answer:{s}@{agent}) or a failure note
//!     with the same id: exactly one answer per (conversation, seq, agent)
//! ```
//!
//! The index actor (`conversation/_index`) records which conversations exist and who
//! takes part, so an agent's conversations can be listed and pending relays resumed.
//! An agent may take part in many conversations; its turns stay serialized per agent
//! (one activation handles one message at a time, whatever the conversation).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use troupe_core::limits::{AGENT_CALL_DEPTH_MAX, INVOKE_TIMEOUT_MS_MAX};
use troupe_core::{truncate_utf8, ActorId, CallContext, CallRefused, Deadline, InvokeError, TraceId};
use troupe_runtime::{Actor, ActorBox, ActorError, ActorFactory, AnyValue, StoreError, Turn};

use crate::agent::{agent_id, AgentActor, AgentShared, Conversation, MentionDelivery};
use crate::inbox::{from_json, to_json, AgentCommand, EnqueueReply, InboxBody, InboxEntry};
use crate::limits::{
    AGENT_DELIVERY_ACK_TIMEOUT_MS, AGENT_DELIVERY_RETRY_MS, AGENT_MENTION_DELIVERY_RETRY_MAX_MS,
    AGENT_MESSAGE_SIZE_MAX_BYTES, AGENT_RESUME_BATCH, AGENT_TASK_TIMEOUT_MS_DEFAULT,
};
use crate::{Budget, ChatMessage, ContactKind, Permitted, Role};

/// The actor kind of conversations.
pub const CONVERSATION_KIND: &str = "conversation";
/// Most participants of one conversation.
pub const CONVERSATION_PARTICIPANTS_MAX: usize = 64;
/// Most messages one conversation holds; a post past it is refused.
pub const CONVERSATION_MESSAGES_MAX: u64 = 1_000_000;
/// Most distinct @mentions in one message.
pub const CONVERSATION_MENTIONS_MAX: usize = 8;
/// Most messages one page of [`crate::AgentClient::read_messages`] returns.
pub const CONVERSATION_PAGE_MAX: usize = 500;
/// Most messages an agent's prompt shows of a conversation (its window).
pub const CONVERSATION_WINDOW_MESSAGES_MAX: usize = 32;
/// Most approximate tokens (bytes / [`CONVERSATION_BYTES_PER_TOKEN`]) of the window.
pub const CONVERSATION_WINDOW_TOKENS_MAX: usize = 8_000;
/// The bytes counted as one token when the window is measured.
pub const CONVERSATION_BYTES_PER_TOKEN: usize = 4;
/// Longest conversation id, participant name or client message id, in bytes.
pub const CONVERSATION_NAME_LENGTH_MAX_BYTES: usize = 200;
/// How long a mention has, from its post, to be delivered and answered: its relay's
/// deadline, the mentioned agent's turn's, and the time a note of its timeout names.
pub(crate) const CONVERSATION_MENTION_TIMEOUT_MS: u64 = AGENT_TASK_TIMEOUT_MS_DEFAULT;
/// Most conversations [`crate::AgentClient::conversations_of`] lists.
pub const CONVERSATIONS_LISTED_MAX: usize = 1_000;

/// The key of the index actor (ids starting with `_` are reserved).
const INDEX_KEY: &str = "_index";
/// How long a self-told wake-up may wait in the mailbox.
const WAKE_TIMEOUT: Duration = Duration::from_millis(INVOKE_TIMEOUT_MS_MAX);
/// How often a delivery task tries to report its outcome.
const REPORT_ATTEMPTS: u32 = 10;

/// One participant of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Participant {
    /// An agent of the directory, by id: a mention triggers its turn.
    Agent(String),
    /// A human, by name: reads and posts through the API; a mention triggers nothing.
    Human(String),
}

impl Participant {
    /// The id or name.
    pub fn name(&self) -> &str {
        match self {
            Self::Agent(name) | Self::Human(name) => name,
        }
    }
}

/// Who wrote a message.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Sender {
    /// An agent (its reply to a mention, or a post through the API).
    Agent(String),
    /// A human participant.
    Human(String),
    /// The system: a note about a mention that was refused or failed.
    System,
}

/// Direct (two participants) or group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ConversationKind {
    /// Exactly two participants; the id of a pair's direct conversation is
    /// [`direct_conversation_id_of`] ([`direct_conversation_id`] for two agents).
    Direct,
    /// Two or more participants.
    Group,
}

/// A conversation's definition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConversationInfo {
    /// Its id.
    pub id: String,
    /// Who takes part.
    pub participants: Vec<Participant>,
    /// Direct or group.
    pub kind: ConversationKind,
}

/// Why a system note was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum NoteKind {
    /// The mentioned agent is already in the mention chain (or is the sender).
    Cycle,
    /// The mention chain is at the system's depth limit.
    DepthLimit,
    /// The organisation refused the contact, or the approval it needed was denied or
    /// not given by the mention's deadline.
    NotPermitted,
    /// The mentioned name is not a participant (in an agent's reply).
    UnknownMention,
    /// The mentioned participant is not an agent of the directory.
    NotAnAgent,
    /// The mention could not be delivered before its deadline.
    Undeliverable,
    /// The agent's turn failed (model error, steps, budget, deadline).
    Failed,
}

/// A system note's subject: which mentioned agent, and why.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Note {
    /// The mentioned agent (or name).
    pub agent: String,
    /// Why.
    pub kind: NoteKind,
}

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConversationMessage {
    /// Its position: 0, 1, 2, ... without gaps.
    pub seq: u64,
    /// Who wrote it.
    pub sender: Sender,
    /// Its text.
    pub text: String,
    /// The participants it mentions (`@name`), in order of first appearance.
    pub mentions: Vec<String>,
    /// The message it answers (an agent's reply to a mention, or a note about one).
    pub reply_to: Option<u64>,
    /// The agents whose mention turns led to it, oldest first (its sender last, for a
    /// reply): a mention of one of them is a cycle; its length is the depth.
    pub chain: Vec<String>,
    /// For a system note: about whom, and why.
    pub note: Option<Note>,
}

/// The outcome of a post.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Posted {
    /// The message's seq.
    pub seq: u64,
    /// Whether this message id was posted before (nothing new was appended).
    pub duplicate: bool,
}

/// Why a conversation request failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum ConversationError {
    /// An id, name or message id is empty, too long, reserved or has control characters.
    #[error("{what} {value:?} is not valid: {reason}")]
    InvalidName {
        /// What it names.
        what: String,
        /// The value given.
        value: String,
        /// Why, and what to do.
        reason: String,
    },
    /// The participants do not fit the kind, repeat, or are too many.
    #[error("invalid participants: {reason}")]
    InvalidParticipants {
        /// Why.
        reason: String,
    },
    /// A participant agent is not in the directory.
    #[error("agent {agent:?} is not in the directory; add it first")]
    UnknownAgent {
        /// The id.
        agent: String,
    },
    /// A conversation with this id exists with other participants or kind.
    #[error("conversation {id:?} already exists with other participants or kind")]
    Conflict {
        /// The id.
        id: String,
    },
    /// No conversation with this id.
    #[error("no conversation {id:?}; create it first")]
    NotFound {
        /// The id.
        id: String,
    },
    /// The sender does not take part.
    #[error("{sender:?} is not a participant of conversation {id:?}")]
    NotParticipant {
        /// The conversation.
        id: String,
        /// The sender.
        sender: Sender,
    },
    /// A mention names nobody in the conversation.
    #[error("@{name} is not a participant of conversation {id:?}; mention one of its participants")]
    UnknownMention {
        /// The conversation.
        id: String,
        /// The name after `@`.
        name: String,
    },
    /// More than [`CONVERSATION_MENTIONS_MAX`] distinct mentions.
    #[error("a message mentions {count} participants; at most {max} are allowed")]
    TooManyMentions {
        /// How many.
        count: usize,
        /// [`CONVERSATION_MENTIONS_MAX`].
        max: usize,
    },
    /// The text is empty or longer than [`AGENT_MESSAGE_SIZE_MAX_BYTES`].
    #[error("a message must have 1 to {max} bytes of text; got {len}")]
    BadText {
        /// Its length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The conversation holds [`CONVERSATION_MESSAGES_MAX`] messages.
    #[error("conversation {id:?} is full ({max} messages)")]
    Full {
        /// The conversation.
        id: String,
        /// The limit.
        max: u64,
    },
    /// The request failed in the runtime or the store; retrying with the same message
    /// id is safe.
    #[error("{cause}")]
    Unavailable {
        /// What failed.
        cause: String,
        /// Whether the cause is a store that failed for a moment
        /// ([`troupe_runtime::StoreError::is_transient`], directly or as the
        /// `StorageFailed` of a call): an HTTP server answers it 503
        /// `storage_unavailable` rather than `overloaded`. Not in this type's own
        /// (bincode) encoding, which is the one before the flag: a conversation's reply
        /// carries it after the reply ([`CONV_REPLY_STORE_UNAVAILABLE_TRAILER`], see
        /// [`encode_conv_reply`]), so it crosses nodes and a node built before it still
        /// decodes the reply (reading `false`).
        #[serde(skip)]
        store_unavailable: bool,
    },
}

impl ConversationError {
    /// [`ConversationError::Unavailable`] for `cause`, not a store that failed for a
    /// moment.
    pub fn unavailable(cause: impl Into<String>) -> Self {
        Self::Unavailable {
            cause: cause.into(),
            store_unavailable: false,
        }
    }
}

impl From<InvokeError> for ConversationError {
    fn from(error: InvokeError) -> Self {
        let store_unavailable = matches!(&error, InvokeError::StorageFailed { source, .. } if source.is_transient());
        Self::Unavailable {
            cause: error.to_string(),
            store_unavailable,
        }
    }
}

impl From<troupe_runtime::StoreError> for ConversationError {
    fn from(error: troupe_runtime::StoreError) -> Self {
        Self::Unavailable {
            cause: error.to_string(),
            store_unavailable: error.is_transient(),
        }
    }
}

/// The id of the direct conversation of two agents: the same for either order, and
/// another for every other pair. `dm:{first}|{second}`, with a `|` or `\` inside a
/// name escaped by a `\` (names without either, the usual ones, are as they were
/// before escaping): `a` with `b|c` is `dm:a|b\|c`, `a|b` with `c` is `dm:a\|b|c`.
/// Before, both were `dm:a|b|c`: the second pair's exchanges went to the first pair's
/// conversation (refused as a conflicting definition, so never recorded) and the index
/// listed that conversation for the second pair's agents.
///
/// A pair with a human has another id, [`direct_conversation_id_of`]; this one, from
/// the names alone, is what `call_agent`'s records use, and what stored agent pairs'
/// conversations are under.
pub fn direct_conversation_id(a: &str, b: &str) -> String {
    let (first, second) = if a <= b { (a, b) } else { (b, a) };
    let mut id = String::with_capacity("dm:|".len() + first.len() + second.len());
    id.push_str("dm:");
    push_escaped(&mut id, first);
    id.push('|');
    push_escaped(&mut id, second);
    id
}

/// What marks a human's name in the id of a direct conversation
/// ([`direct_conversation_id_of`]): a `\` followed by a character the escaping of names
/// never puts after one (only `|` and `\`), so no agent pair's id holds it.
const DIRECT_HUMAN_MARK: &str = "\\h";

/// The id of the direct conversation of participants `a` and `b` (what
/// [`crate::AgentClient::direct_conversation`] uses): the same for either order, and
/// another for every other pair, kinds included. Two agents get
/// [`direct_conversation_id`] of their names, unchanged; a human's name is marked with
/// `\h` before it (after the escaping of `|` and `\`), so human `alice` with agent `bob`
/// is `dm:\halice|bob` (the two names ordered as their marked forms), never `dm:alice|bob`,
/// agents `alice` and `bob`'s id. Before 2026-12-06 a pair with a human had the agents'
/// form too: human `alice` with agent `bob` and agents `alice` and `bob` shared
/// `dm:alice|bob`, and whichever pair came second was refused `Conflict` (an exchange of
/// the agents, recorded there, was lost).
pub fn direct_conversation_id_of(a: &Participant, b: &Participant) -> String {
    if !matches!((a, b), (Participant::Human(_), _) | (_, Participant::Human(_))) {
        return direct_conversation_id(a.name(), b.name());
    }
    let marked = |participant: &Participant| {
        let mut token = String::with_capacity(DIRECT_HUMAN_MARK.len() + participant.name().len());
        if let Participant::Human(_) = participant {
            token.push_str(DIRECT_HUMAN_MARK);
        }
        push_escaped(&mut token, participant.name());
        token
    };
    let (a, b) = (marked(a), marked(b));
    let (first, second) = if a <= b { (a, b) } else { (b, a) };
    format!("dm:{first}|{second}")
}

/// `name` onto `id`, each `|` and `\` in it after a `\`.
fn push_escaped(id: &mut String, name: &str) {
    for c in name.chars() {
        if c == '|' || c == '\\' {
            id.push('\\');
        }
        id.push(c);
    }
}

/// The `@name` tokens of `text`, in order of first appearance, each once. A mention
/// starts at `@` at the start or after a character that cannot be part of a name (so
/// `a@b.c` is no mention); a name is ASCII letters, digits, `_`, `-` and `.`, without a
/// trailing `.` (the end of a sentence).
pub fn parse_mentions(text: &str) -> Vec<String> {
    let is_name = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.';
    let mut found: Vec<String> = Vec::new();
    let mut previous: Option<char> = None;
    let mut chars = text.char_indices().peekable();
    while let Some((at, c)) = chars.next() {
        if c == '@' && !previous.is_some_and(is_name) {
            let start = at + 1;
            let mut end = start;
            while let Some(&(index, next)) = chars.peek() {
                if !is_name(next) {
                    break;
                }
                end = index + next.len_utf8();
                chars.next();
            }
            let name = text[start..end].trim_end_matches('.');
            if !name.is_empty() && !found.iter().any(|seen| seen == name) {
                found.push(name.to_string());
            }
            previous = text[..end].chars().next_back();
            continue;
        }
        previous = Some(c);
    }
    found
}

/// The role-relative view of `messages` for agent `me`: its own messages as
/// `assistant`, everyone else's as `user` prefixed with the sender's name. Keeps the
/// newest messages within [`CONVERSATION_WINDOW_MESSAGES_MAX`] and
/// [`CONVERSATION_WINDOW_TOKENS_MAX`] (the newest is always kept).
pub fn conversation_window(me: &str, messages: &[ConversationMessage]) -> Vec<ChatMessage> {
    conversation_window_within(me, messages, crate::ContextWindow::default())
}

/// [`conversation_window`] within an agent's own window (its [`crate::AgentSpec::window`]):
/// the newest `window.messages` messages, at most `window.tokens` approximate tokens
/// (the newest is always kept).
pub fn conversation_window_within(
    me: &str,
    messages: &[ConversationMessage],
    window: crate::ContextWindow,
) -> Vec<ChatMessage> {
    let mut kept: Vec<ChatMessage> = Vec::new();
    let mut tokens = 0;
    for message in messages.iter().rev().take(window.messages) {
        let view = match &message.sender {
            Sender::Agent(agent) if agent == me => ChatMessage::new(Role::Assistant, message.text.clone()),
            Sender::Agent(name) | Sender::Human(name) => {
                ChatMessage::new(Role::User, format!("{name}: {}", message.text))
            }
            Sender::System => ChatMessage::new(Role::User, format!("system: {}", message.text)),
        };
        let cost = view.content.len().div_ceil(CONVERSATION_BYTES_PER_TOKEN);
        if !kept.is_empty() && tokens + cost > window.tokens {
            break;
        }
        tokens += cost;
        kept.push(view);
    }
    kept.reverse();
    kept
}

pub(crate) fn conversation_actor(id: &str) -> Result<ActorId, ConversationError> {
    ActorId::new(CONVERSATION_KIND, id).map_err(|error| ConversationError::InvalidName {
        what: "conversation id".to_string(),
        value: id.to_string(),
        reason: error.to_string(),
    })
}

pub(crate) fn index_actor() -> ActorId {
    ActorId::new(CONVERSATION_KIND, INDEX_KEY).expect("the index id is valid")
}

pub(crate) fn message_key(seq: u64) -> String {
    crate::agent::seq_key("msg/", seq)
}

pub(crate) fn member_prefix(agent: &str) -> String {
    format!("member/{agent}/")
}

fn relay_key(seq: u64, agent: &str) -> String {
    let mut key = crate::agent::seq_key("relay/", seq);
    key.push('/');
    key.push_str(agent);
    key
}

fn relay_of(key: &str) -> Option<(u64, String)> {
    let rest = key.strip_prefix("relay/")?;
    let (seq, agent) = rest.split_once('/')?;
    Some((seq.parse().ok()?, agent.to_string()))
}

/// The message id of the one answer (reply or note) to the mention of `agent` in `seq`.
fn answer_id(seq: u64, agent: &str) -> String {
    format!("answer:{seq}@{agent}")
}

/// Checks a name: non-empty, at most [`CONVERSATION_NAME_LENGTH_MAX_BYTES`], no control
/// characters.
pub(crate) fn check_name(what: &str, value: &str) -> Result<(), ConversationError> {
    let invalid = |reason: &str| ConversationError::InvalidName {
        what: what.to_string(),
        value: value.to_string(),
        reason: reason.to_string(),
    };
    if value.is_empty() {
        return Err(invalid("it must not be empty"));
    }
    if value.len() > CONVERSATION_NAME_LENGTH_MAX_BYTES {
        return Err(invalid(&format!(
            "it must be at most {CONVERSATION_NAME_LENGTH_MAX_BYTES} bytes"
        )));
    }
    if value.chars().any(char::is_control) {
        return Err(invalid("it must not contain control characters"));
    }
    Ok(())
}

/// Everything a conversation actor handles (bincode).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum ConvCommand {
    Create {
        participants: Vec<Participant>,
        kind: ConversationKind,
    },
    /// To the index: record a conversation and its agents.
    Register {
        conversation: String,
        agents: Vec<String>,
    },
    Post(PostRequest),
    Relay {
        seq: u64,
        agent: String,
    },
    Delivered {
        seq: u64,
        agent: String,
    },
    Undeliverable {
        seq: u64,
        agent: String,
        cause: String,
    },
    Resume {
        after: Option<String>,
    },
    /// A recorded `call_agent` exchange (`call_record.rs`), in one turn: `question`,
    /// then `answer` replying to it (its `reply_to` is set here). Replies the
    /// question's [`ConvReply::Posted`], or the first error.
    Exchange {
        question: PostRequest,
        answer: PostRequest,
    },
    /// Store the `call_agent` exchanges this process recorded for this conversation and
    /// that wait in its memory (`call_record.rs`), each as an `Exchange` would, in one
    /// turn. Replies `Done`.
    FlushRecords,
    /// The approval the relay `seq`/`agent` waited for was denied, or not given by its
    /// deadline (or the organisation refused the contact by then): the relay is
    /// dropped with a [`NoteKind::NotPermitted`] note. Last of the variants, so that a
    /// command encoded before it existed decodes as it did.
    Refused {
        seq: u64,
        agent: String,
        cause: String,
    },
    /// To the index: `agents` do not take part in `conversation` (a creation that named
    /// them was refused `Conflict`, after `Register` had recorded them): their entries
    /// are deleted, the conversation's own is kept. Replies `Done`. Last of the
    /// variants, so that a command encoded before it existed decodes as it did.
    Unregister {
        conversation: String,
        agents: Vec<String>,
    },
}

/// A message to append.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct PostRequest {
    pub(crate) sender: Sender,
    pub(crate) client_id: String,
    pub(crate) text: String,
    pub(crate) reply_to: Option<u64>,
    pub(crate) chain: Vec<String>,
    pub(crate) note: Option<Note>,
    /// From the API: bad mentions and text are errors. From an agent's reply: they are
    /// cut or noted, never refused (the answer must land).
    pub(crate) strict: bool,
    /// A record of a `call_agent` exchange (`call_record.rs`): stored as it is, its
    /// `@mentions` are neither parsed nor delivered (the exchange already happened).
    /// It is posted once and never retried, so `client_id` is not used: a record is
    /// not deduplicated and leaves no `id/` entry.
    pub(crate) record: bool,
}

impl ConvCommand {
    pub(crate) fn encode(&self) -> Bytes {
        Bytes::from(bincode::serialize(self).expect("a conversation command always serializes"))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum ConvReply {
    Created(ConversationInfo),
    Posted(Posted),
    Done,
    Error(ConversationError),
}

/// The byte after a [`ConvReply`]'s bincode when it is an
/// [`ConversationError::Unavailable`] whose cause is a store down for a moment (its
/// `store_unavailable`, which the bincode of the error leaves out).
///
/// Why a trailer and not a field: bincode has no optional fields, so a field (or a new
/// variant) would make a reply from a node built after it undecodable on one built
/// before it, and the other way round. `bincode::deserialize` ignores trailing bytes,
/// so a node built before the trailer decodes the reply as it always did (the flag
/// `false`, as before), and a reply without one (from such a node) decodes here with the
/// flag `false`. (Nodes of another transport protocol version do not talk at all; this
/// keeps the reply readable by any build that speaks the same one.)
pub(crate) const CONV_REPLY_STORE_UNAVAILABLE_TRAILER: u8 = 1;

/// A conversation's reply as bytes: its bincode, then
/// [`CONV_REPLY_STORE_UNAVAILABLE_TRAILER`] if it is an error of a store down for a
/// moment.
pub(crate) fn encode_conv_reply(reply: &ConvReply) -> Bytes {
    let mut bytes = bincode::serialize(reply).expect("a conversation reply always serializes");
    if matches!(
        reply,
        ConvReply::Error(ConversationError::Unavailable {
            store_unavailable: true,
            ..
        })
    ) {
        bytes.push(CONV_REPLY_STORE_UNAVAILABLE_TRAILER);
    }
    Bytes::from(bytes)
}

/// A reply [`encode_conv_reply`] wrote (or a node built before the trailer: then an
/// `Unavailable` reads `store_unavailable: false`). Bytes after the reply other than the
/// trailer are ignored, as `bincode::deserialize` always did.
pub(crate) fn decode_conv_reply(bytes: &[u8]) -> Result<ConvReply, ConversationError> {
    let malformed = |error: bincode::Error| ConversationError::Unavailable {
        store_unavailable: false,
        cause: format!("malformed reply: {error}"),
    };
    let mut reply: ConvReply = bincode::deserialize(bytes).map_err(malformed)?;
    if matches!(reply, ConvReply::Error(ConversationError::Unavailable { .. })) {
        // The reply's own length: bincode's (fixed-width) encoding of what was decoded
        // is the bytes it was decoded from.
        let length = usize::try_from(bincode::serialized_size(&reply).map_err(malformed)?).unwrap_or(usize::MAX);
        let trailer = bytes.get(length..).unwrap_or_default();
        if let ConvReply::Error(ConversationError::Unavailable { store_unavailable, .. }) = &mut reply {
            *store_unavailable = trailer.first() == Some(&CONV_REPLY_STORE_UNAVAILABLE_TRAILER);
        }
    }
    Ok(reply)
}

/// A mention waiting to be delivered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct RelayRecord {
    from: Option<String>,
    chain: Vec<String>,
    deadline: Deadline,
    /// The pending approval the delivery waits for first (the organisation's record,
    /// see `org_store.rs`), when the contact needs one. Absent in relays stored before
    /// mentions waited for approval, and left out when none is needed, so such a relay
    /// reads as before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    approval: Option<u64>,
    /// The trace of the post that made the mention (its turn's trace id), which its
    /// delivery and the mentioned agent's turn run under. Absent when the post named
    /// none, and in relays stored before mentions carried a trace: such a delivery
    /// starts a trace of its own, as before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    trace_id: Option<TraceId>,
}

/// Why a mention of an agent is refused: the kind of its system note, and its text.
type MentionRefusal = (NoteKind, String);

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct ConvState {
    info: Option<ConversationInfo>,
    next_seq: u64,
}

/// The definition a conversation's snapshot holds (none before its creation's turn).
pub(crate) fn decode_definition(snapshot: &[u8]) -> Result<Option<ConversationInfo>, String> {
    serde_json::from_slice::<ConvState>(snapshot)
        .map(|state| state.info)
        .map_err(|error| error.to_string())
}

/// `info` (a conversation's definition, or none yet) as JSON: what [`encode_state`]
/// copies into every snapshot.
fn info_json(info: &Option<impl Serialize>) -> Result<Vec<u8>, ActorError> {
    serde_json::to_vec(info).map_err(|error| ActorError::failed(error.to_string()))
}

/// A [`ConvState`] as `serde_json` writes it, byte for byte, from its definition's JSON
/// ([`info_json`]) and its next seq: the conversation's snapshot, taken after each of its
/// turns, without encoding the participants again each time (a recorded `call_agent`
/// exchange is one such turn).
fn encode_state(info_json: &[u8], next_seq: u64) -> Bytes {
    const HEAD: &[u8] = b"{\"info\":";
    const SEQ: &[u8] = b",\"next_seq\":";
    let mut digits = itoa::Buffer::new();
    let digits = digits.format(next_seq).as_bytes();
    let mut out = Vec::with_capacity(HEAD.len() + info_json.len() + SEQ.len() + digits.len() + 1);
    out.extend_from_slice(HEAD);
    out.extend_from_slice(info_json);
    out.extend_from_slice(SEQ);
    out.extend_from_slice(digits);
    out.push(b'}');
    Bytes::from(out)
}

pub(crate) struct ConversationFactory {
    pub(crate) shared: Arc<AgentShared>,
}

impl ActorFactory for ConversationFactory {
    fn create(&self, id: &ActorId, saved: Option<Bytes>) -> Result<ActorBox, ActorError> {
        self.shared.require_attached(id)?;
        let state = match saved {
            Some(bytes) => from_json(&format!("the state of {id}"), &bytes)?,
            None => ConvState::default(),
        };
        Ok(ActorBox::new(ConversationActor {
            id: id.clone(),
            info_json: info_json(&state.info)?,
            state,
            shared: Arc::clone(&self.shared),
            resumed: false,
            grouped: None,
        }))
    }
}

struct ConversationActor {
    id: ActorId,
    state: ConvState,
    /// `state.info` as JSON, kept with it: the snapshot after each turn (which changes
    /// only `next_seq` once the conversation exists) copies it instead of encoding the
    /// participants again (see [`encode_state`]).
    info_json: Vec<u8>,
    shared: Arc<AgentShared>,
    /// Whether this activation has looked for relays left pending by an earlier one
    /// (see [`ConversationActor::resume_at_activation`]).
    resumed: bool,
    /// While a recorded exchange is posted: its messages so far (a JSON array after
    /// its `[`), how many, and the last one's seq, written as one entry at its end.
    grouped: Option<(Vec<u8>, usize, u64)>,
}

/// A wake-up refused: the turn fails with the refusal in its cause, except when the
/// runtime stops, which reaches the caller as the runtime's own typed `Shutdown` (a
/// turn of the shutdown's grace; a caller, such as `troupe serve`, must not take it
/// for the agent's failure).
fn wake_failed(error: InvokeError) -> ActorError {
    match error {
        InvokeError::Shutdown => ActorError::Invoke(InvokeError::Shutdown),
        error => ActorError::failed(format!("could not schedule a mention delivery: {error}")),
    }
}

/// Whether a wake-up was told: `false` when the conversation's own mailbox is full
/// (`Busy`: the work goes on later), any other refusal an error.
fn told(result: Result<(), InvokeError>) -> Result<bool, ActorError> {
    match result {
        Ok(()) => Ok(true),
        Err(InvokeError::Busy { .. }) => Ok(false),
        Err(error) => Err(wake_failed(error)),
    }
}

impl Actor for ConversationActor {
    /// Its turns' futures are kilobytes: kept, not allocated at each turn (see
    /// [`crate::limits::AGENT_TURN_FUTURE_KEPT_BYTES_MAX`]).
    const TURN_FUTURE_KEPT_BYTES_MAX: usize = crate::limits::AGENT_TURN_FUTURE_KEPT_BYTES_MAX;

    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        let command: ConvCommand = bincode::deserialize(&payload)
            .map_err(|cause| ActorError::rejected(format!("not a conversation command: {cause}")))?;
        self.handle_command(turn, command)
            .await
            .map(|reply| encode_conv_reply(&reply))
    }

    /// A command from an agent's turn in this process (a recorded `call_agent`
    /// exchange), passed as the [`ConvCommand`] itself and answered with the
    /// [`ConvReply`] itself: [`Actor::handle`]'s turn without the encoding and decoding.
    async fn handle_value(&mut self, turn: &mut Turn, message: AnyValue) -> Result<AnyValue, ActorError> {
        let command = message
            .downcast::<ConvCommand>()
            .map_err(|_| ActorError::rejected("a conversation takes a ConvCommand as a value"))?;
        self.handle_command(turn, command).await.map(AnyValue::new)
    }

    fn snapshot(&self) -> Result<Option<Bytes>, ActorError> {
        Ok(Some(encode_state(&self.info_json, self.state.next_seq)))
    }
}

impl ConversationActor {
    /// One command's turn, however it arrived (encoded, or as a value).
    async fn handle_command(&mut self, turn: &mut Turn, command: ConvCommand) -> Result<ConvReply, ActorError> {
        self.resume_at_activation(turn, &command).await;
        let reply = match command {
            ConvCommand::Create { participants, kind } => self.create(participants, kind),
            ConvCommand::Register { conversation, agents } => {
                turn.put(format!("c/{conversation}"), Bytes::new())?;
                for agent in agents {
                    turn.put(format!("{}{conversation}", member_prefix(&agent)), Bytes::new())?;
                }
                ConvReply::Done
            }
            ConvCommand::Unregister { conversation, agents } => {
                for agent in agents {
                    turn.delete(format!("{}{conversation}", member_prefix(&agent)))?;
                }
                ConvReply::Done
            }
            ConvCommand::Post(request) => self.post(turn, request).await?,
            ConvCommand::Exchange { question, answer } => self.record_exchange(turn, question, answer).await?,
            ConvCommand::FlushRecords => {
                for (question, answer) in self.shared.take_call_records(&self.id) {
                    self.record_exchange(turn, question, answer).await?;
                }
                ConvReply::Done
            }
            ConvCommand::Relay { seq, agent } => {
                self.relay(turn, seq, agent).await?;
                ConvReply::Done
            }
            ConvCommand::Delivered { seq, agent } => {
                turn.delete(relay_key(seq, &agent))?;
                ConvReply::Done
            }
            ConvCommand::Undeliverable { seq, agent, cause } => {
                let text = format!("the mention of @{agent} in #{seq} could not be delivered: {cause}");
                self.drop_relay(turn, seq, agent, NoteKind::Undeliverable, text).await?;
                ConvReply::Done
            }
            ConvCommand::Refused { seq, agent, cause } => {
                let text = format!("@{agent} was not asked to answer #{seq}: {cause}");
                self.drop_relay(turn, seq, agent, NoteKind::NotPermitted, text).await?;
                ConvReply::Done
            }
            ConvCommand::Resume { after } => {
                let page = turn.scan("relay/", after.as_deref(), AGENT_RESUME_BATCH).await?;
                // Its own mailbox full (a wake-up refused `Busy`), the resume stops where
                // it got to and goes on from a task of its own (`wake_later`): failing
                // the turn instead left the rest of the page unwoken until the next
                // request rebuilt the resume.
                let mut woken = after;
                for (key, _) in &page {
                    // A mention a task of this process delivers needs no wake-up: its
                    // turn would find the task and do nothing, after a place in the
                    // mailbox ahead of the posts.
                    let pending =
                        relay_of(key).filter(|(seq, agent)| !self.shared.delivers_mention(&self.id, *seq, agent));
                    if let Some((seq, agent)) = pending {
                        let wake = ConvCommand::Relay { seq, agent }.encode();
                        if !told(turn.caller().tell(&self.id, wake, WAKE_TIMEOUT).await)? {
                            self.resume_later(woken);
                            return Ok(ConvReply::Done);
                        }
                    }
                    woken = Some(key.clone());
                }
                if page.len() == AGENT_RESUME_BATCH {
                    let next = ConvCommand::Resume { after: woken.clone() };
                    if !told(turn.caller().tell(&self.id, next.encode(), WAKE_TIMEOUT).await)? {
                        self.resume_later(woken);
                    }
                }
                ConvReply::Done
            }
        };
        Ok(reply)
    }

    /// Drops the relay `seq`/`agent`, if it is still there, with a system note of `kind`
    /// saying `text` (under the mention's answer id: at most one per mention).
    async fn drop_relay(
        &mut self,
        turn: &mut Turn,
        seq: u64,
        agent: String,
        kind: NoteKind,
        text: String,
    ) -> Result<(), ActorError> {
        let key = relay_key(seq, &agent);
        if turn.get(&key).await?.is_none() {
            return Ok(());
        }
        turn.delete(key)?;
        let note = PostRequest {
            sender: Sender::System,
            client_id: answer_id(seq, &agent),
            text,
            reply_to: Some(seq),
            chain: Vec::new(),
            note: Some(Note { agent, kind }),
            strict: false,
            record: false,
        };
        self.post(turn, note).await.map(drop)
    }

    /// Posts a recorded exchange: `question`, then `answer` replying to it, both in one
    /// entry keyed by the last seq. Replies the question's [`ConvReply::Posted`], or the
    /// first error.
    async fn record_exchange(
        &mut self,
        turn: &mut Turn,
        question: PostRequest,
        mut answer: PostRequest,
    ) -> Result<ConvReply, ActorError> {
        let room = |request: &PostRequest| {
            1 + crate::json_text::conversation_message_room(&request.sender, &request.text, &[], &request.chain)
        };
        self.grouped = Some((Vec::with_capacity(1 + room(&question) + room(&answer)), 0, 0));
        let posted = match self.post(turn, question).await {
            Ok(ConvReply::Posted(asked)) => {
                answer.reply_to = Some(asked.seq);
                match self.post(turn, answer).await {
                    Ok(ConvReply::Posted(_)) => Ok(ConvReply::Posted(asked)),
                    other => other,
                }
            }
            other => other,
        };
        if let Some((entry, count, last)) = self.grouped.take() {
            if count > 0 {
                turn.put(message_key(last), crate::agent::close_log_entry(entry, count))?;
            }
        }
        posted
    }

    /// Writes `message` as its own entry, or adds it to the exchange being recorded.
    fn append_message(&mut self, turn: &mut Turn, message: &ConversationMessage) -> Result<(), StoreError> {
        match &mut self.grouped {
            Some((entry, count, last)) => {
                entry.push(if *count == 0 { b'[' } else { b',' });
                crate::json_text::push_conversation_message(entry, message);
                *count += 1;
                *last = message.seq;
                Ok(())
            }
            None => turn.put(
                message_key(message.seq),
                Bytes::from(crate::json_text::conversation_message(message)),
            ),
        }
    }

    /// At an activation's first request (unless it is a `Resume`), tells itself to
    /// `Resume` if relays are pending: mentions an earlier activation committed but did
    /// not see delivered, on this node or on one that died (or lost its lease). Without
    /// it, such relays waited for `resume_conversations` at a node's `attach`, which
    /// reaches only a conversation no other node has activated since (on a cluster, one
    /// owned elsewhere refuses it `NotOwner`). Costs one store scan of at most one key
    /// per activation. A failed scan or wake is logged and tried again at the next
    /// request; the request itself goes on (resuming is idempotent: a delivery is
    /// deduplicated by the inbox).
    async fn resume_at_activation(&mut self, turn: &mut Turn, command: &ConvCommand) {
        if self.resumed {
            return;
        }
        if matches!(command, ConvCommand::Resume { .. }) {
            self.resumed = true;
            return;
        }
        let pending = match turn.scan("relay/", None, 1).await {
            Ok(page) => !page.is_empty(),
            Err(error) => {
                tracing::warn!(conversation = %self.id, %error, "could not look for pending mentions; trying again at the next request");
                return;
            }
        };
        if pending {
            let resume = ConvCommand::Resume { after: None };
            if let Err(error) = turn.caller().tell(&self.id, resume.encode(), WAKE_TIMEOUT).await {
                tracing::warn!(conversation = %self.id, %error, "could not resume pending mentions; trying again at the next request");
                return;
            }
        }
        self.resumed = true;
    }

    fn create(&mut self, mut participants: Vec<Participant>, kind: ConversationKind) -> ConvReply {
        participants.sort();
        let info = ConversationInfo {
            id: self.id.key().to_string(),
            participants,
            kind,
        };
        match &self.state.info {
            Some(existing) if *existing == info => ConvReply::Created(info),
            Some(_) => ConvReply::Error(ConversationError::Conflict {
                id: self.id.key().to_string(),
            }),
            None => match info_json(&Some(&info)) {
                Ok(json) => {
                    self.state.info = Some(info.clone());
                    self.info_json = json;
                    ConvReply::Created(info)
                }
                Err(error) => ConvReply::Error(ConversationError::Unavailable {
                    store_unavailable: false,
                    cause: error.to_string(),
                }),
            },
        }
    }

    /// Appends one message, its notes and its relays (see the module's diagram).
    async fn post(&mut self, turn: &mut Turn, mut request: PostRequest) -> Result<ConvReply, ActorError> {
        // Borrowed, not copied: a post is a turn of every recorded exchange.
        let conversation = || self.id.key().to_string();
        let Some(info) = &self.state.info else {
            return Ok(ConvReply::Error(ConversationError::NotFound { id: conversation() }));
        };
        // A record is sent once and never again (`call_record.rs`), so it is neither
        // looked up nor indexed by a client id: that is a store read and a write per
        // message of every recorded exchange.
        let id_key = (!request.record).then(|| ["id/", &request.client_id].concat());
        if let Some(id_key) = &id_key {
            if let Some(bytes) = turn.get(id_key).await? {
                let seq: u64 = from_json(id_key, &bytes)?;
                // A post through the API under an id another post used (another sender,
                // or another text) is not its retry: refused, not answered as a
                // duplicate of a message its sender never wrote (which it then never
                // was). Before, a second human's post under an id the first had used
                // was dropped as a "duplicate" (`tests/conversation_probes.rs`). An
                // agent's answer (not strict) is deduplicated by its id alone: a turn
                // run again may word it otherwise, and exactly one must land.
                if request.strict && !posted_as(turn, seq, &request).await? {
                    return Ok(ConvReply::Error(ConversationError::InvalidName {
                        what: "message id".to_string(),
                        value: request.client_id,
                        reason: format!(
                            "it names message #{seq}, posted by another sender or with another text; a retry sends the same sender and text, a new message needs a new id"
                        ),
                    }));
                }
                return Ok(ConvReply::Posted(Posted { seq, duplicate: true }));
            }
        }
        let takes_part = match &request.sender {
            Sender::Agent(name) => info
                .participants
                .iter()
                .any(|p| matches!(p, Participant::Agent(agent) if agent == name)),
            Sender::Human(name) => info
                .participants
                .iter()
                .any(|p| matches!(p, Participant::Human(human) if human == name)),
            Sender::System => true,
        };
        if !takes_part {
            let error = ConversationError::NotParticipant {
                id: conversation(),
                sender: request.sender,
            };
            return Ok(ConvReply::Error(error));
        }
        if request.strict && (request.text.is_empty() || request.text.len() > AGENT_MESSAGE_SIZE_MAX_BYTES) {
            let error = ConversationError::BadText {
                len: request.text.len(),
                max: AGENT_MESSAGE_SIZE_MAX_BYTES,
            };
            return Ok(ConvReply::Error(error));
        }
        let kept = truncate_utf8(&request.text, AGENT_MESSAGE_SIZE_MAX_BYTES).len();
        request.text.truncate(kept);
        let mut mentions = if request.note.is_some() || request.record {
            Vec::new()
        } else {
            parse_mentions(&request.text)
        };
        if mentions.len() > CONVERSATION_MENTIONS_MAX {
            if request.strict {
                let error = ConversationError::TooManyMentions {
                    count: mentions.len(),
                    max: CONVERSATION_MENTIONS_MAX,
                };
                return Ok(ConvReply::Error(error));
            }
            mentions.truncate(CONVERSATION_MENTIONS_MAX);
        }
        let participant = |name: &str| info.participants.iter().find(|p| p.name() == name).cloned();
        if request.strict {
            if let Some(name) = mentions.iter().find(|name| participant(name).is_none()) {
                let error = ConversationError::UnknownMention {
                    id: conversation(),
                    name: name.clone(),
                };
                return Ok(ConvReply::Error(error));
            }
        }
        let appended = 1 + mentions.len() as u64;
        if self.state.next_seq + appended > CONVERSATION_MESSAGES_MAX {
            let error = ConversationError::Full {
                id: conversation(),
                max: CONVERSATION_MESSAGES_MAX,
            };
            return Ok(ConvReply::Error(error));
        }
        let seq = self.state.next_seq;
        // Read only for mentions (their refusals and relays): a post without any, such as
        // every recorded exchange's, copies no name for it.
        let sender_agent = match &request.sender {
            Sender::Agent(name) if !mentions.is_empty() => Some(name.clone()),
            _ => None,
        };
        // Each mention: relayed (after an approval, if the contact needs one), or
        // refused with a note. The clock is read only for relays (a recorded exchange
        // has none): their deadline, which is also their approval's.
        let mut notes = Vec::new();
        let mut relays = Vec::new();
        let mut relay_deadline = None;
        for name in &mentions {
            let Some(Participant::Agent(agent)) = participant(name) else {
                if participant(name).is_none() {
                    notes.push((
                        name.clone(),
                        NoteKind::UnknownMention,
                        format!("@{name} is not a participant"),
                    ));
                }
                continue;
            };
            let needs_approval = match self.admission(&request, sender_agent.as_deref(), &agent).await {
                Ok(needs_approval) => needs_approval,
                Err((kind, text)) => {
                    notes.push((name.clone(), kind, text));
                    continue;
                }
            };
            let deadline = *relay_deadline.get_or_insert_with(|| {
                Deadline::after(turn.now(), Duration::from_millis(CONVERSATION_MENTION_TIMEOUT_MS))
            });
            if !needs_approval {
                relays.push((agent, None));
                continue;
            }
            // Recorded unlisted before this turn commits (as a send's, see `inbox.rs`), and
            // listed by the relay's delivery: a turn that then fails leaves it unlisted
            // and pending until its deadline, with nothing waiting for it.
            match self
                .request_approval(turn, sender_agent.as_deref(), &agent, &request.text, deadline)
                .await
            {
                Ok(id) => relays.push((agent, Some(id))),
                Err(refused) => notes.push((name.clone(), NoteKind::NotPermitted, refused)),
            }
        }
        // The request's fields move into the message; only relays read its chain later.
        let chain = if relays.is_empty() {
            std::mem::take(&mut request.chain)
        } else {
            request.chain.clone()
        };
        let message = ConversationMessage {
            seq,
            sender: request.sender,
            text: request.text,
            mentions,
            reply_to: request.reply_to,
            chain,
            note: request.note,
        };
        self.append_message(turn, &message)?;
        if let Some(id_key) = id_key {
            // A number's JSON is its decimal digits.
            turn.put(
                id_key,
                Bytes::copy_from_slice(itoa::Buffer::new().format(seq).as_bytes()),
            )?;
        }
        let mut next = seq + 1;
        for (agent, kind, text) in notes {
            let note = ConversationMessage {
                seq: next,
                sender: Sender::System,
                text: format!("@{agent} was not asked to answer #{seq}: {text}"),
                mentions: Vec::new(),
                reply_to: Some(seq),
                chain: Vec::new(),
                note: Some(Note { agent, kind }),
            };
            self.append_message(turn, &note)?;
            next += 1;
        }
        self.state.next_seq = next;
        if let Some(deadline) = relay_deadline {
            for (agent, approval) in relays {
                let record = RelayRecord {
                    from: sender_agent.clone(),
                    chain: request.chain.clone(),
                    deadline,
                    approval,
                    trace_id: turn.context().trace_id(),
                };
                turn.put(relay_key(seq, &agent), to_json(&record)?)?;
                let wake = ConvCommand::Relay { seq, agent }.encode();
                crate::inbox_turns::wake_self(turn, &self.shared, &self.id, wake, wake_failed).await?;
            }
        }
        Ok(ConvReply::Posted(Posted { seq, duplicate: false }))
    }

    /// Whether the mention of `agent` in `request` triggers a turn, by the call rules
    /// (cycle, depth, known agent), then the organisation: `Ok(true)` once approved (the
    /// contact needs approval), `Ok(false)` at once, `Err` with its note if refused.
    async fn admission(
        &self,
        request: &PostRequest,
        sender: Option<&str>,
        agent: &str,
    ) -> Result<bool, MentionRefusal> {
        if !self.shared.directory.contains(agent) {
            return Err((NoteKind::NotAnAgent, "not an agent of the directory".to_string()));
        }
        if sender == Some(agent) || request.chain.iter().any(|a| a == agent) {
            let chain = request.chain.join(" → ");
            return Err((
                NoteKind::Cycle,
                format!("a cycle: already in the mention chain [{chain}]"),
            ));
        }
        if request.chain.len() >= AGENT_CALL_DEPTH_MAX as usize {
            return Err((
                NoteKind::DepthLimit,
                format!("the mention chain is at the depth limit ({AGENT_CALL_DEPTH_MAX})"),
            ));
        }
        let Some(sender) = sender else {
            return Ok(false);
        };
        // Never absent during a turn (the turn holds the runtime); if it were, refuse
        // rather than skip the organisation's check.
        let Some(runtime) = self.shared.runtime() else {
            return Err((
                NoteKind::NotPermitted,
                "the organisation is unavailable: the runtime has stopped".to_string(),
            ));
        };
        let decision = match self
            .shared
            .org
            .current(runtime.store().as_ref(), &runtime.clock())
            .await
        {
            Ok(org) => org.decide(sender, agent, ContactKind::Notify),
            Err(error) => {
                return Err((
                    NoteKind::NotPermitted,
                    format!("the organisation is unavailable: {error}"),
                ))
            }
        };
        match decision {
            Ok(Permitted::NeedsApproval { .. }) => Ok(true),
            Ok(_) => Ok(false),
            Err(refused) => Err((NoteKind::NotPermitted, refused.to_string())),
        }
    }

    /// Records the pending approval the mention of `agent` by `sender` needs (the
    /// message's text, its relay's deadline) and returns its id.
    async fn request_approval(
        &self,
        turn: &Turn,
        sender: Option<&str>,
        agent: &str,
        text: &str,
        deadline: Deadline,
    ) -> Result<u64, String> {
        let from = sender.map(agent_id).ok_or("only an agent's mention needs approval")?;
        let from = from.map_err(|error| error.to_string())?;
        let to = agent_id(agent).map_err(|error| error.to_string())?;
        let contact = crate::org_store::Contact {
            from: &from,
            to: &to,
            kind: ContactKind::Notify,
            message: text,
            deadline,
        };
        let runtime = self
            .shared
            .runtime()
            .ok_or("the organisation is unavailable: the runtime has stopped")?;
        let listing = crate::org_store::Listing::OnDelivery;
        crate::org_store::request_approval(&self.shared, &turn.clock(), &runtime, &contact, listing, None)
            .await
            .map_err(|refused| refused.to_string())
    }

    /// Tells this conversation, from a task of its own, to `Resume` after the relay key
    /// `after` (see [`crate::inbox_turns::wake_later`]).
    fn resume_later(&self, after: Option<String>) {
        let resume = ConvCommand::Resume { after }.encode();
        crate::inbox_turns::wake_later(&self.shared, self.id.clone(), resume);
    }

    /// Starts a delivery task for the relay `seq`/`agent` unless one runs or it is gone.
    async fn relay(&mut self, turn: &mut Turn, seq: u64, agent: String) -> Result<(), ActorError> {
        // A task of this process delivers it already (this activation's or an earlier
        // one's): nothing to read. Checked before the store read, so a wake-up of a
        // mention on its way costs no store operation (on a slow disk the resume sweep's
        // wake-ups, each reading its relay, filled the conversation's mailbox and held
        // its posts up to 15 s: `cluster_conversation_partition_dst.rs`).
        if self.shared.delivers_mention(&self.id, seq, &agent) {
            return Ok(());
        }
        let key = relay_key(seq, &agent);
        let Some(bytes) = turn.get(&key).await? else {
            return Ok(());
        };
        let record: RelayRecord = from_json(&key, &bytes)?;
        let Some(runtime) = self.shared.runtime() else {
            return Err(ActorError::failed("the runtime has not started, or has stopped"));
        };
        // A task of this activation, or of an earlier one in this process, may still
        // deliver it: a second one would double the appends the agent's mailbox takes.
        // The guard lives as long as that task, so a relay whose task ended (its report
        // lost) is delivered again by the next `Relay`, deduplicated by the inbox.
        let Some(delivery) = self.shared.start_mention_delivery(&self.id, seq, &agent) else {
            return Ok(());
        };
        let conversation = self.id.key().to_string();
        let approval = record.approval;
        let entry = InboxEntry {
            msg_id: format!("{conversation}#{seq}@{agent}"),
            from: record.from.as_deref().and_then(|from| agent_id(from).ok()),
            body: InboxBody::Mention {
                conversation,
                seq,
                chain: record.chain,
            },
            context: match record.trace_id {
                Some(trace) => CallContext::root(record.deadline).with_trace_id(trace),
                None => CallContext::root(record.deadline),
            },
            budget: Budget::UNLIMITED,
            pair: None,
        };
        // Started in the post's trace when it named one (see `delivery_span`).
        let span = crate::inbox_turns::delivery_span(&self.id, &agent, &entry);
        let delivering = deliver(
            runtime,
            Arc::clone(&self.shared),
            self.id.clone(),
            Relayed { agent, seq, approval },
            entry,
            delivery,
        );
        self.shared
            .spawn_delivery(tracing::Instrument::instrument(delivering, span));
        Ok(())
    }
}

/// Whether message `seq` was posted by `request`'s sender with its text (`true` if the
/// message cannot be read as one: then the id alone decides, as before).
async fn posted_as(turn: &mut Turn, seq: u64, request: &PostRequest) -> Result<bool, ActorError> {
    let key = message_key(seq);
    let Some(bytes) = turn.get(&key).await? else {
        return Ok(true);
    };
    let Ok(entry) = crate::agent::decode_log_entry::<ConversationMessage>(&bytes) else {
        return Ok(true);
    };
    Ok(entry
        .iter()
        .find(|message| message.seq == seq)
        .is_none_or(|message| message.sender == request.sender && message.text == request.text))
}

/// Which relay a delivery task delivers.
struct Relayed {
    /// The mentioned agent.
    agent: String,
    /// The message that mentions it.
    seq: u64,
    /// The pending approval to wait for first, if the contact needs one.
    approval: Option<u64>,
}

/// Delivers one mention to an agent's inbox from outside any turn: waits for its
/// approval first if it needs one (denied, or not given by the deadline: reported as
/// `Refused`), then retries until acknowledged or its deadline (no attempt starts at
/// or past it: the mention is then reported `Undeliverable`, "the deadline passed
/// before it could be delivered"), and reports to the
/// conversation (a lost report leaves the relay, which the next resume delivers again,
/// deduplicated by the inbox; a resumed delivery waits for the same approval, read
/// from the store).
async fn deliver(
    runtime: troupe_runtime::RuntimeHandle,
    shared: Arc<AgentShared>,
    conversation: ActorId,
    relayed: Relayed,
    entry: InboxEntry,
    _delivery: MentionDelivery,
) {
    let Relayed { agent, seq, approval } = relayed;
    let deadline = entry.context.deadline();
    if let (Some(approval), Some(from)) = (approval, &entry.from) {
        if let Err(refused) = await_mention_approval(&runtime, &shared, from, &agent, deadline, approval).await {
            report_to(
                &runtime,
                &conversation,
                seq,
                ConvCommand::Refused {
                    seq,
                    agent,
                    cause: refused,
                },
            )
            .await;
            return;
        }
    }
    let payload = AgentCommand::Enqueue(entry).encode();
    let mut pause = AGENT_DELIVERY_RETRY_MS;
    // Why the last attempt failed, for the report when the deadline passes.
    let mut last_failure: Option<String> = None;
    let report = loop {
        // No attempt starts at or past the deadline, as in the inbox's delivery
        // (`inbox_turns.rs`): one that passed during the pause (the last pause ends at
        // the deadline), during the approval's wait, or while the process was down is
        // given up here. Before, the pause after the last refused attempt was cut to
        // the deadline and one more attempt was made there (under a millisecond before
        // it on a clock that moves, the pause being cut to whole milliseconds): the
        // agent took the mention and ran a turn that could only post "the deadline
        // passed before it could answer" (`tests/mention_delivery.rs`).
        if deadline.has_passed(runtime.now()) {
            let cause = match &last_failure {
                Some(failure) => format!("the deadline passed before it could be delivered ({failure})"),
                None => "the deadline passed before it could be delivered".to_string(),
            };
            break ConvCommand::Undeliverable { seq, agent, cause };
        }
        // An agent defined or removed through another process counts once this
        // process's copy of the stored directory is read again.
        crate::directory_store::ensure_fresh(&shared).await;
        let target = match agent_id(&agent) {
            Ok(target) if shared.directory.contains(&agent) => target,
            _ => {
                break ConvCommand::Undeliverable {
                    seq,
                    agent,
                    cause: "not an agent of the directory".to_string(),
                }
            }
        };
        let ack = Duration::from_millis(AGENT_DELIVERY_ACK_TIMEOUT_MS);
        let cause = match runtime.invoke_routed_within(&target, payload.clone(), ack).await {
            Ok(reply) => match bincode::deserialize::<EnqueueReply>(&reply) {
                Ok(EnqueueReply::Accepted { .. } | EnqueueReply::Duplicate) => {
                    break ConvCommand::Delivered { seq, agent };
                }
                Ok(EnqueueReply::Full { capacity }) => format!("the inbox is full ({capacity} entries)"),
                // A mention carries no pair order, so these do not come; retried as any
                // refusal would be.
                Ok(EnqueueReply::OutOfOrder { expected } | EnqueueReply::Stale { expected }) => {
                    format!("refused as out of order (expected {expected})")
                }
                Err(error) => format!("malformed acknowledgement: {error}"),
            },
            Err(InvokeError::Shutdown) => return,
            Err(
                error @ (InvokeError::Refused(CallRefused::AgentNotFound { .. })
                | InvokeError::ActorNotFound { .. }
                | InvokeError::Rejected { .. }),
            ) => {
                break ConvCommand::Undeliverable {
                    seq,
                    agent,
                    cause: error.to_string(),
                }
            }
            Err(error) => error.to_string(),
        };
        last_failure = Some(cause);
        // Doubling pauses: a busy agent (a slow disk, a long turn) gets fewer appends,
        // and none that waits so long in its mailbox that it expires before it commits.
        // The last pause ends at the deadline (the time left in whole microseconds, not
        // cut to milliseconds), where the check above records the mention timed out.
        let left = deadline.remaining(runtime.now());
        tokio::time::sleep(Duration::from_millis(pause).min(left)).await;
        pause = (pause * 2).min(AGENT_MENTION_DELIVERY_RETRY_MAX_MS);
    };
    report_to(&runtime, &conversation, seq, report).await;
}

/// Waits for the approval of the mention of `agent` by `from` until the mention's
/// deadline; the refusal's text if it is not given.
async fn await_mention_approval(
    runtime: &troupe_runtime::RuntimeHandle,
    shared: &AgentShared,
    from: &ActorId,
    agent: &str,
    deadline: Deadline,
    approval: u64,
) -> Result<(), String> {
    let to = agent_id(agent).map_err(|error| error.to_string())?;
    let contact = crate::org_store::Contact {
        from,
        to: &to,
        kind: ContactKind::Notify,
        message: "",
        deadline,
    };
    crate::org_store::await_approval_outside_turn(runtime, shared, &contact, approval)
        .await
        .map_err(|refused| refused.to_string())
}

/// Reports a delivery's outcome to its conversation (a few attempts; if all fail, the
/// relay stays and the next resume delivers it again).
async fn report_to(runtime: &troupe_runtime::RuntimeHandle, conversation: &ActorId, seq: u64, report: ConvCommand) {
    // Routed: on a cluster the conversation may have moved to another node meanwhile
    // (a local `tell` there was refused `NotOwner`, and the relay waited for a resume).
    let payload = report.encode();
    let ack = Duration::from_millis(AGENT_DELIVERY_ACK_TIMEOUT_MS);
    for _ in 0..REPORT_ATTEMPTS {
        match runtime.invoke_routed_within(conversation, payload.clone(), ack).await {
            Ok(_) | Err(InvokeError::Shutdown) => return,
            Err(_) => tokio::time::sleep(Duration::from_millis(AGENT_DELIVERY_RETRY_MS)).await,
        }
    }
    tracing::warn!(%conversation, seq, "could not report a mention delivery; the next resume delivers it again");
}

/// Reads the messages `from..=upto` of `conversation` from the store (committed), the
/// store tried again while unavailable until `deadline`.
pub(crate) async fn read_committed(
    shared: &AgentShared,
    conversation: &ActorId,
    after: Option<u64>,
    limit: usize,
    deadline: Deadline,
) -> Result<Vec<ConversationMessage>, ConversationError> {
    let Some(runtime) = shared.runtime() else {
        return Err(ConversationError::Unavailable {
            store_unavailable: false,
            cause: "the runtime has not started, or has stopped".to_string(),
        });
    };
    let after_seq = after;
    let after = after.map(message_key);
    // Tried again while the store is unavailable, until `deadline` (`retry_store`).
    let page = runtime
        .retry_store(deadline, "scan", conversation, || {
            runtime.store().scan(conversation, "msg/", after.as_deref(), limit)
        })
        .await?;
    // An entry holds at least one message: as many entries as messages is enough. A
    // recorded exchange's entry may begin at or before `after`, and end past `limit`.
    let mut messages = Vec::new();
    for (key, bytes) in page {
        let entry: Vec<ConversationMessage> =
            crate::agent::decode_log_entry(&bytes).map_err(|error| ConversationError::Unavailable {
                store_unavailable: false,
                cause: format!("{key} cannot be decoded: {error}"),
            })?;
        messages.extend(
            entry
                .into_iter()
                .filter(|message| after_seq.is_none_or(|after| message.seq > after)),
        );
    }
    messages.truncate(limit);
    Ok(messages)
}

impl AgentActor {
    /// Answers the mention of this agent in message `seq` of `conversation`: a turn on
    /// the conversation's window, then its reply (or a failure note) posted under the
    /// mention's answer id, so it lands once however often this runs.
    pub(crate) async fn answer_mention(
        &mut self,
        turn: &mut Turn,
        entry: &InboxEntry,
        conversation: &str,
        seq: u64,
        chain: &[String],
    ) -> Result<(), ActorError> {
        let me = self.id.key().to_string();
        let target = conversation_actor(conversation).map_err(|error| ActorError::failed(error.to_string()))?;
        let deadline = entry.context.deadline();
        let outcome = if deadline.has_passed(turn.now()) {
            Err("the deadline passed before it could answer".to_string())
        } else {
            // The agent's own window (validated to 1..=CONVERSATION_WINDOW_MESSAGES_MAX).
            let window = self.state.spec.window;
            let first = seq.saturating_sub(window.messages.max(1) as u64 - 1);
            let after = first.checked_sub(1);
            let span = usize::try_from(seq - first + 1).unwrap_or(window.messages);
            let messages = read_committed(&self.shared, &target, after, span, deadline)
                .await
                .map_err(|error| ActorError::failed(error.to_string()))?;
            let mut history = conversation_window_within(&me, &messages, window);
            let content = history.pop().map(|last| last.content).unwrap_or_default();
            let content = format!("[conversation {conversation}, message #{seq}] {content}");
            let turn_input = Conversation {
                content,
                call: None,
                deadline,
                budget: entry.budget,
                history: Some(history),
                allowed_ms: Some(CONVERSATION_MENTION_TIMEOUT_MS),
            };
            match self.converse(turn, turn_input).await {
                Ok(reply) => match reply.exhausted {
                    None if reply.text.is_empty() => Ok("(no answer)".to_string()),
                    None => Ok(reply.text),
                    Some(exhausted) => Err(exhausted.to_string()),
                },
                // Stale (fenced, or the node lost its lease): no note; the turn fails and
                // the mention stays for the agent's current owner.
                Err(crate::agent::TurnError::Refused(error)) => return Err(error),
                Err(error) => Err(error.to_string()),
            }
        };
        let mut reply_chain = chain.to_vec();
        reply_chain.push(me.clone());
        let request = match outcome {
            Ok(text) => PostRequest {
                sender: Sender::Agent(me.clone()),
                client_id: answer_id(seq, &me),
                text,
                reply_to: Some(seq),
                chain: reply_chain,
                note: None,
                strict: false,
                record: false,
            },
            Err(cause) => PostRequest {
                sender: Sender::System,
                client_id: answer_id(seq, &me),
                text: format!("@{me} could not answer #{seq}: {cause}"),
                reply_to: Some(seq),
                chain: Vec::new(),
                note: Some(Note {
                    agent: me.clone(),
                    kind: NoteKind::Failed,
                }),
                strict: false,
                record: false,
            },
        };
        // A failure here fails the turn: the inbox entry stays and is answered later.
        let timeout = Duration::from_millis(AGENT_DELIVERY_ACK_TIMEOUT_MS);
        let reply = turn
            .invoke(&target, ConvCommand::Post(request).encode(), timeout)
            .await
            .map_err(|error| ActorError::failed(format!("posting the answer failed: {error}")))?;
        match decode_conv_reply(&reply).map_err(|error| ActorError::failed(error.to_string()))? {
            ConvReply::Posted(_) => Ok(()),
            ConvReply::Error(error) => {
                // Permanent (the conversation is gone or full): nothing to retry.
                tracing::warn!(agent = %self.id, %conversation, seq, %error, "the answer was not posted");
                Ok(())
            }
            other => Err(ActorError::failed(format!("unexpected reply {other:?}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: a conversation error says whether its cause is a store down for a moment
    /// (directly, or as the `StorageFailed` of a call), and only that; a conversation's
    /// reply carries the flag across nodes (until 2026-12-07 it decoded `false` on the
    /// receiver, which answered 503 `overloaded`), and stays readable both ways by a
    /// node built before: its bytes decode here with the flag `false`, and it decodes
    /// these (the flag `false`, everything else as sent). A reply without the flag is
    /// the bytes it was before.
    #[test]
    fn a_conversation_error_says_a_store_down_for_a_moment_and_its_reply_carries_it_compatibly() {
        use troupe_runtime::StoreOperation;
        let unavailable = StoreError::Unavailable {
            operation: StoreOperation::Scan,
            cause: "connection refused".to_string(),
        };
        let injected = StoreError::Injected {
            operation: StoreOperation::Scan,
        };
        let target = ActorId::new(CONVERSATION_KIND, "room").unwrap();
        let flag = |error: &ConversationError| match error {
            ConversationError::Unavailable { store_unavailable, .. } => *store_unavailable,
            other => panic!("not Unavailable: {other:?}"),
        };
        assert!(flag(&ConversationError::from(unavailable.clone())));
        assert!(flag(&ConversationError::from(InvokeError::StorageFailed {
            target: target.clone(),
            source: unavailable.clone(),
        })));
        assert!(!flag(&ConversationError::from(injected.clone())));
        assert!(!flag(&ConversationError::from(InvokeError::StorageFailed {
            target: target.clone(),
            source: injected,
        })));
        assert!(!flag(&ConversationError::from(InvokeError::Shutdown)));
        assert!(!flag(&ConversationError::unavailable("the runtime has stopped")));

        /// `ConversationError` as it was derived before the flag.
        #[derive(Serialize, Deserialize, Debug, PartialEq)]
        enum Before {
            InvalidName {
                what: String,
                value: String,
                reason: String,
            },
            InvalidParticipants {
                reason: String,
            },
            UnknownAgent {
                agent: String,
            },
            Conflict {
                id: String,
            },
            NotFound {
                id: String,
            },
            NotParticipant {
                id: String,
                sender: Sender,
            },
            UnknownMention {
                id: String,
                name: String,
            },
            TooManyMentions {
                count: usize,
                max: usize,
            },
            BadText {
                len: usize,
                max: usize,
            },
            Full {
                id: String,
                max: u64,
            },
            Unavailable {
                cause: String,
            },
        }
        /// `ConvReply` as it was derived before the flag crossed nodes.
        #[derive(Serialize, Deserialize, Debug, PartialEq)]
        enum BeforeReply {
            Created(ConversationInfo),
            Posted(Posted),
            Done,
            Error(Before),
        }
        let error = ConversationError::from(unavailable);
        let cause = error.to_string();
        assert_eq!(
            bincode::serialize(&error).unwrap(),
            bincode::serialize(&Before::Unavailable { cause: cause.clone() }).unwrap(),
            "the error's own encoding is the one before the flag"
        );
        let unflagged = ConversationError::Unavailable {
            cause: cause.clone(),
            store_unavailable: false,
        };

        // This build to this build: the flag crosses, set or not.
        let flagged_reply = ConvReply::Error(error.clone());
        let bytes = encode_conv_reply(&flagged_reply);
        assert_eq!(decode_conv_reply(&bytes).unwrap(), flagged_reply);
        let unflagged_reply = ConvReply::Error(unflagged.clone());
        assert_eq!(
            decode_conv_reply(&encode_conv_reply(&unflagged_reply)).unwrap(),
            unflagged_reply
        );

        // A node built before: its reply decodes here with the flag `false`, and it
        // decodes this build's reply, flagged or not, to what it sent (its decoder is
        // `bincode::deserialize`, which ignores the trailer).
        let old_bytes = bincode::serialize(&BeforeReply::Error(Before::Unavailable { cause: cause.clone() })).unwrap();
        assert_eq!(decode_conv_reply(&old_bytes).unwrap(), unflagged_reply);
        assert_eq!(
            encode_conv_reply(&unflagged_reply).as_ref(),
            old_bytes.as_slice(),
            "a reply without the flag is the bytes it was before"
        );
        assert_eq!(
            bincode::deserialize::<BeforeReply>(&bytes).unwrap(),
            BeforeReply::Error(Before::Unavailable { cause: cause.clone() })
        );
        assert_eq!(bincode::deserialize::<ConvReply>(&bytes).unwrap(), unflagged_reply);

        // Other replies are as before, and decode as sent.
        let posted = ConvReply::Posted(Posted {
            seq: 7,
            duplicate: false,
        });
        let posted_bytes = encode_conv_reply(&posted);
        assert_eq!(posted_bytes.as_ref(), bincode::serialize(&posted).unwrap().as_slice());
        assert_eq!(decode_conv_reply(&posted_bytes).unwrap(), posted);
    }

    /// Goal: a relay record keeps its post's trace id; one stored before relays carried
    /// a trace (no field) reads as having none, and one with none is written as before.
    #[test]
    fn a_relay_record_keeps_its_trace_and_reads_old_records() {
        let old = r#"{"from":"a","chain":["a"],"deadline":{"at_us":5}}"#;
        let record: RelayRecord = serde_json::from_str(old).unwrap();
        assert_eq!(record.trace_id, None);
        assert_eq!(serde_json::to_string(&record).unwrap(), old);
        let traced = RelayRecord {
            trace_id: Some(TraceId::new(0xabc)),
            ..record
        };
        let back: RelayRecord = serde_json::from_slice(&to_json(&traced).unwrap()).unwrap();
        assert_eq!(back, traced);
    }

    proptest::proptest! {
        /// The snapshot built from the definition's JSON is serde_json's encoding of the
        /// state, byte for byte, and decodes back to it (names with quotes, escapes and
        /// non-ASCII included; no definition yet too).
        #[test]
        fn a_snapshot_is_the_state_as_serde_json_writes_it(
            defined in proptest::prelude::any::<bool>(),
            id in "\\PC{0,12}",
            agents in proptest::collection::vec("[a-z\"\\\\é\n]{1,8}", 0..4),
            human in proptest::option::of("\\PC{1,6}"),
            group in proptest::prelude::any::<bool>(),
            next_seq in proptest::prelude::any::<u64>(),
        ) {
            let mut participants: Vec<Participant> = agents.into_iter().map(Participant::Agent).collect();
            participants.extend(human.map(Participant::Human));
            let kind = if group { ConversationKind::Group } else { ConversationKind::Direct };
            let state = ConvState {
                info: defined.then_some(ConversationInfo { id, participants, kind }),
                next_seq,
            };
            let encoded = encode_state(&info_json(&state.info).unwrap(), state.next_seq);
            proptest::prop_assert_eq!(&encoded[..], &serde_json::to_vec(&state).unwrap()[..]);
            proptest::prop_assert_eq!(serde_json::from_slice::<ConvState>(&encoded).unwrap(), state);
        }
    }

    #[test]
    fn mentions_are_parsed_once_each_in_order_and_emails_are_not_mentions() {
        assert_eq!(
            parse_mentions("@bob and @carol-2, ask @bob. mail a@b.com or (@dave_x)."),
            ["bob", "carol-2", "dave_x"]
        );
        assert_eq!(parse_mentions("no mentions @ all"), Vec::<String>::new());
        assert_eq!(parse_mentions("@a.b. end"), ["a.b"]);
        assert_eq!(parse_mentions("@héllo"), ["h"]);
    }

    fn message(seq: u64, sender: Sender, text: &str) -> ConversationMessage {
        ConversationMessage {
            seq,
            sender,
            text: text.to_string(),
            mentions: parse_mentions(text),
            reply_to: None,
            chain: Vec::new(),
            note: None,
        }
    }

    #[test]
    fn the_window_is_role_relative_and_bounded() {
        let messages = vec![
            message(0, Sender::Human("ann".into()), "@bob hi"),
            message(1, Sender::Agent("bob".into()), "hello @carol"),
            message(2, Sender::Agent("carol".into()), "hi bob"),
            message(3, Sender::System, "a note"),
        ];
        let view = conversation_window("bob", &messages);
        let roles: Vec<Role> = view.iter().map(|m| m.role).collect();
        assert_eq!(roles, [Role::User, Role::Assistant, Role::User, Role::User]);
        assert_eq!(view[0].content, "ann: @bob hi");
        assert_eq!(view[1].content, "hello @carol");
        assert_eq!(view[2].content, "carol: hi bob");
        assert_eq!(view[3].content, "system: a note");

        let many: Vec<_> = (0..100)
            .map(|seq| message(seq, Sender::Human("ann".into()), &format!("m{seq}")))
            .collect();
        let view = conversation_window("bob", &many);
        assert_eq!(view.len(), CONVERSATION_WINDOW_MESSAGES_MAX);
        assert_eq!(view.last().map(|m| m.content.as_str()), Some("ann: m99"));

        let big = "x".repeat(CONVERSATION_WINDOW_TOKENS_MAX * CONVERSATION_BYTES_PER_TOKEN / 3);
        let large: Vec<_> = (0..10)
            .map(|seq| message(seq, Sender::Human("ann".into()), &big))
            .collect();
        let view = conversation_window("bob", &large);
        assert_eq!(view.len(), 2, "three such messages exceed the token window");
    }

    #[test]
    fn direct_ids_do_not_depend_on_order_and_relay_keys_round_trip() {
        assert_eq!(direct_conversation_id("b", "a"), direct_conversation_id("a", "b"));
        assert_eq!(direct_conversation_id("a", "b"), "dm:a|b");
        // Escaped, so no two pairs share an id.
        assert_eq!(direct_conversation_id("a", "b|c"), r"dm:a|b\|c");
        assert_eq!(direct_conversation_id("a|b", "c"), r"dm:a\|b|c");
        assert_eq!(direct_conversation_id(r"a\", "b"), r"dm:a\\|b");
        assert_ne!(direct_conversation_id(r"a\", "|b"), direct_conversation_id(r"a\|", "b"));
        assert_eq!(relay_of(&relay_key(7, "x/y")), Some((7, "x/y".to_string())));
        assert!(check_name("id", "").is_err());
        assert!(check_name("id", "a\nb").is_err());
        assert_eq!(check_name("id", "ok"), Ok(()));
    }
}
