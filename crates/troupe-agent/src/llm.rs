//! The language-model boundary: [`LlmClient`] and the chat types it speaks.
//!
//! Everything the agent layer needs from a model goes through this trait, so the
//! simulator and tests use a scripted, deterministic client while production uses an
//! HTTP client; HTTP never runs inside simulated code.

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use troupe_core::{ActorId, Deadline};

/// Who wrote a chat message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    /// Instructions that frame the conversation.
    System,
    /// The input the agent answers (a person or another agent).
    User,
    /// The model's own output.
    Assistant,
    /// The result of a tool call the model asked for.
    Tool,
}

/// One tool call the model asked for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The model's id for this call; the tool result refers to it.
    pub id: String,
    /// The tool's name.
    pub name: String,
    /// The arguments, a JSON object that is validated against the tool's schema.
    pub arguments: serde_json::Value,
}

/// One message of a chat.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// Who wrote it.
    pub role: Role,
    /// Its text (may be empty for an assistant message that only calls tools).
    pub content: String,
    /// Tool calls requested (assistant messages only).
    pub tool_calls: Vec<ToolCall>,
    /// The call this message answers (tool messages only).
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A message with `role` and `content` and nothing else.
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }

    /// The result of tool call `tool_call_id`.
    pub fn tool_result(tool_call_id: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: Role::Tool,
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: Some(tool_call_id.into()),
        }
    }
}

/// A tool as the model sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    /// Its name, as the model will call it.
    pub name: String,
    /// What it does, for the model.
    pub description: String,
    /// A JSON schema of its arguments (an object schema).
    pub parameters: serde_json::Value,
}

/// The messages of a model request, in order: shared, not copied.
///
/// An agent's prompt is its system message, its history window and the turn's new
/// messages, and every step of every turn shows mostly the same ones. A `Prompt` is a
/// list of shared, immutable parts (`Arc<[ChatMessage]>`), so building the next step's
/// prompt, cloning a request or keeping it costs a pointer per part, not a copy of
/// each message. Read it in order with [`Prompt::iter`] (or `for message in
/// &request.messages`); [`Prompt::last`], [`Prompt::len`] and indexing work as on a
/// slice. A client that wants the parts as they were shared (to cache work per part)
/// has [`Prompt::parts`].
///
/// # Examples
/// ```
/// use troupe_agent::{ChatMessage, Prompt, Role};
/// let mut prompt = Prompt::from(vec![ChatMessage::new(Role::System, "be brief")]);
/// prompt.push(ChatMessage::new(Role::User, "hi"));
/// let roles: Vec<Role> = prompt.iter().map(|message| message.role).collect();
/// assert_eq!(roles, [Role::System, Role::User]);
/// assert_eq!(prompt.last().unwrap().content, "hi");
/// assert_eq!(prompt[0].content, "be brief");
/// ```
#[derive(Clone, Default)]
pub struct Prompt {
    /// In order; together, never empty parts.
    segments: Vec<Segment>,
    /// The messages in all parts.
    len: usize,
}

/// A run of a [`Prompt`]'s parts: one part, or a shared list of parts (an agent's
/// window), so that the next step's prompt costs one pointer for the whole window rather
/// than one per part (each an atomic increment, and another to drop it: perf,
/// 2026-11-25, several percent of a `call_agent` round trip with a 64-message window).
#[derive(Clone)]
enum Segment {
    Part(Arc<[ChatMessage]>),
    List(Arc<Vec<Arc<[ChatMessage]>>>),
}

impl Segment {
    fn parts(&self) -> std::slice::Iter<'_, Arc<[ChatMessage]>> {
        match self {
            Self::Part(part) => std::slice::from_ref(part).iter(),
            Self::List(parts) => parts.iter(),
        }
    }
}

/// A segment's parts, as [`Prompt::parts`] flattens them.
type SegmentParts<'a> = fn(&'a Segment) -> std::slice::Iter<'a, Arc<[ChatMessage]>>;

/// The shared parts of a [`Prompt`] in order (from either end); see [`Prompt::parts`].
#[derive(Clone)]
pub struct PromptParts<'a> {
    parts:
        std::iter::FlatMap<std::slice::Iter<'a, Segment>, std::slice::Iter<'a, Arc<[ChatMessage]>>, SegmentParts<'a>>,
}

impl std::fmt::Debug for PromptParts<'_> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.debug_struct("PromptParts").finish_non_exhaustive()
    }
}

impl<'a> Iterator for PromptParts<'a> {
    type Item = &'a Arc<[ChatMessage]>;

    fn next(&mut self) -> Option<Self::Item> {
        self.parts.next()
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.parts.size_hint()
    }
}

impl DoubleEndedIterator for PromptParts<'_> {
    fn next_back(&mut self) -> Option<Self::Item> {
        self.parts.next_back()
    }
}

impl std::iter::FusedIterator for PromptParts<'_> {}

impl Prompt {
    /// An empty prompt.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `part`, shared (an empty part is not kept).
    pub fn push_part(&mut self, part: Arc<[ChatMessage]>) {
        if !part.is_empty() {
            self.len += part.len();
            self.segments.push(Segment::Part(part));
        }
    }

    /// Appends every part of `other`, shared.
    pub fn extend_shared(&mut self, other: &Prompt) {
        self.segments.extend(other.segments.iter().cloned());
        self.len += other.len;
    }

    /// Appends `message` as a part of its own.
    pub fn push(&mut self, message: ChatMessage) {
        self.push_part(Arc::new([message]));
    }

    /// How many messages it holds.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no message.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first message.
    pub fn first(&self) -> Option<&ChatMessage> {
        self.parts().next().and_then(|part| part.first())
    }

    /// The last message.
    pub fn last(&self) -> Option<&ChatMessage> {
        self.parts().next_back().and_then(|part| part.last())
    }

    /// Message `index`, counted from the first.
    pub fn get(&self, index: usize) -> Option<&ChatMessage> {
        let mut rest = index;
        for part in self.parts() {
            if rest < part.len() {
                return Some(&part[rest]);
            }
            rest -= part.len();
        }
        None
    }

    /// The messages in order.
    pub fn iter(&self) -> PromptIter<'_> {
        let part_messages: PartMessages<'_> = |part| part.iter();
        PromptIter {
            messages: self.parts().flat_map(part_messages),
            len: self.len,
        }
    }

    /// The shared parts in order, none empty; together they are [`Prompt::iter`]'s
    /// messages. The same part (`Arc::ptr_eq`) in two prompts holds the same messages.
    pub fn parts(&self) -> PromptParts<'_> {
        let segment_parts: SegmentParts<'_> = Segment::parts;
        PromptParts {
            parts: self.segments.iter().flat_map(segment_parts),
        }
    }

    /// The parts in order, as runs of consecutive parts (a run is a segment: one part,
    /// or a shared list): [`Prompt::parts`] without the flattening, for a loop that
    /// visits every part of a long prompt.
    pub(crate) fn part_runs(&self) -> impl Iterator<Item = &[Arc<[ChatMessage]>]> {
        self.segments.iter().map(|segment| segment.parts().as_slice())
    }

    /// The messages, copied.
    pub fn to_vec(&self) -> Vec<ChatMessage> {
        self.iter().cloned().collect()
    }

    /// The parts as one shared list, to be edited in place: an agent's window keeps this
    /// form, so each step's prompt shares it with one pointer. The list is copied (its
    /// pointers, not the messages) only when another prompt still shares it.
    fn list_mut(&mut self) -> &mut Vec<Arc<[ChatMessage]>> {
        if !matches!(self.segments.as_slice(), [Segment::List(_)]) {
            let parts: Vec<Arc<[ChatMessage]>> = self.parts().cloned().collect();
            self.segments = vec![Segment::List(Arc::new(parts))];
        }
        match &mut self.segments[0] {
            Segment::List(parts) => Arc::make_mut(parts),
            Segment::Part(_) => unreachable!("made a list above"),
        }
    }

    /// Appends every part of `other`, shared, into this prompt's one shared list (see
    /// [`Prompt::list_mut`]).
    pub(crate) fn extend_listed(&mut self, other: &Prompt) {
        self.list_mut().extend(other.parts().cloned());
        self.len += other.len;
    }

    /// Removes the first `count` messages (all when there are fewer): whole parts are
    /// dropped, and a part cut in two is replaced by a copy of its kept messages. The
    /// parts are left as one shared list (see [`Prompt::list_mut`]).
    pub(crate) fn remove_first(&mut self, count: usize) {
        let mut rest = count.min(self.len);
        self.len -= rest;
        let parts = self.list_mut();
        let whole = parts
            .iter()
            .take_while(|part| {
                let dropped = part.len() <= rest;
                if dropped {
                    rest -= part.len();
                }
                dropped
            })
            .count();
        parts.drain(..whole);
        if rest > 0 {
            parts[0] = parts[0][rest..].into();
        }
    }
}

impl From<Vec<ChatMessage>> for Prompt {
    fn from(messages: Vec<ChatMessage>) -> Self {
        let mut prompt = Self::new();
        prompt.push_part(messages.into());
        prompt
    }
}

impl From<Arc<[ChatMessage]>> for Prompt {
    fn from(part: Arc<[ChatMessage]>) -> Self {
        let mut prompt = Self::new();
        prompt.push_part(part);
        prompt
    }
}

impl FromIterator<ChatMessage> for Prompt {
    fn from_iter<I: IntoIterator<Item = ChatMessage>>(messages: I) -> Self {
        Self::from(messages.into_iter().collect::<Vec<_>>())
    }
}

impl std::ops::Index<usize> for Prompt {
    type Output = ChatMessage;

    fn index(&self, index: usize) -> &ChatMessage {
        match self.get(index) {
            Some(message) => message,
            None => panic!("index {index} out of a prompt of {} messages", self.len),
        }
    }
}

impl<'a> IntoIterator for &'a Prompt {
    type Item = &'a ChatMessage;
    type IntoIter = PromptIter<'a>;

    fn into_iter(self) -> PromptIter<'a> {
        self.iter()
    }
}

/// Equal when the messages are, however they are split into parts.
impl PartialEq for Prompt {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.iter().eq(other.iter())
    }
}

impl PartialEq<[ChatMessage]> for Prompt {
    fn eq(&self, other: &[ChatMessage]) -> bool {
        self.len == other.len() && self.iter().eq(other.iter())
    }
}

impl PartialEq<Vec<ChatMessage>> for Prompt {
    fn eq(&self, other: &Vec<ChatMessage>) -> bool {
        *self == **other
    }
}

impl std::fmt::Debug for Prompt {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.debug_list().entries(self.iter()).finish()
    }
}

/// A list of the messages, as a `Vec<ChatMessage>` is written.
impl Serialize for Prompt {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.iter())
    }
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Vec::<ChatMessage>::deserialize(deserializer).map(Self::from)
    }
}

/// A part's messages, as [`PromptIter`] flattens them.
type PartMessages<'a> = fn(&'a Arc<[ChatMessage]>) -> std::slice::Iter<'a, ChatMessage>;

/// The messages of a [`Prompt`] in order (from either end).
#[derive(Debug, Clone)]
pub struct PromptIter<'a> {
    /// The parts' messages, flattened (std's `FlatMap` serves both ends).
    messages: std::iter::FlatMap<PromptParts<'a>, std::slice::Iter<'a, ChatMessage>, PartMessages<'a>>,
    /// Messages not yet returned from either end (for `ExactSizeIterator`).
    len: usize,
}

impl<'a> Iterator for PromptIter<'a> {
    type Item = &'a ChatMessage;

    #[inline]
    fn next(&mut self) -> Option<&'a ChatMessage> {
        let message = self.messages.next()?;
        self.len -= 1;
        Some(message)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.len, Some(self.len))
    }
}

impl DoubleEndedIterator for PromptIter<'_> {
    #[inline]
    fn next_back(&mut self) -> Option<Self::Item> {
        let message = self.messages.next_back()?;
        self.len -= 1;
        Some(message)
    }
}

impl ExactSizeIterator for PromptIter<'_> {}

impl std::iter::FusedIterator for PromptIter<'_> {}

/// One request to the model.
#[derive(Debug, Clone, PartialEq)]
pub struct LlmRequest {
    /// The agent asking (scripted clients pick their script by it).
    pub agent: ActorId,
    /// The model name from the agent's settings.
    pub model: String,
    /// The chat so far, system prompt first: shared parts, not a copy per request
    /// (`vec![...].into()` makes one).
    pub messages: Prompt,
    /// The tools the model may call: shared, as every step of every turn offers the
    /// same list (`vec![...].into()` makes one).
    pub tools: Arc<[ToolSpec]>,
    /// When the answer must have arrived, on the runtime's clock.
    pub deadline: Deadline,
    /// The most tokens, prompt and completion together, this call may be charged: what
    /// is left of the turn's [`crate::Budget`] (`None`: unlimited). A client must not
    /// bill past it: [`crate::ScriptedLlm`] answers [`LlmError::OverTokenLimit`] instead;
    /// an OpenAI-compatible provider only caps the completion (`max_tokens`), so its
    /// prompt can overshoot and the turn then ends with its budget exhausted.
    pub max_tokens: Option<u64>,
}

/// How many tokens one model call used, as the provider counted them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct TokenUsage {
    /// Tokens of the request (the chat and the tool specs).
    pub prompt_tokens: u64,
    /// Tokens of the answer.
    pub completion_tokens: u64,
    /// Their sum, as reported (not recomputed).
    pub total_tokens: u64,
}

/// The model's answer: text, tool calls, or both.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlmReply {
    /// The assistant message.
    pub message: ChatMessage,
    /// The tokens the call used; `None` when the provider did not say.
    #[serde(default)]
    pub usage: Option<TokenUsage>,
    /// The provider stopped the answer at its token limit (OpenAI's `finish_reason:
    /// "length"`): the text may end mid-sentence. A final answer so cut reaches the
    /// caller with `AgentReply::truncated` set.
    #[serde(default)]
    pub truncated: bool,
}

impl LlmReply {
    /// A reply of `message` with no usage reported.
    pub fn new(message: ChatMessage) -> Self {
        Self {
            message,
            usage: None,
            truncated: false,
        }
    }

    /// This reply, marked as stopped at the provider's token limit.
    #[must_use]
    pub fn cut_at_token_limit(mut self) -> Self {
        self.truncated = true;
        self
    }

    /// This reply with `usage`.
    #[must_use]
    pub fn with_usage(mut self, usage: TokenUsage) -> Self {
        self.usage = Some(usage);
        self
    }
}

/// Why the model gave no answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum LlmError {
    /// No answer before the deadline.
    #[error("the model did not answer within {timeout_ms} ms")]
    Timeout {
        /// The time allowed, in milliseconds.
        timeout_ms: u64,
    },
    /// The provider answered with an error status. Its text says what to check for the
    /// usual statuses (401/403, 404, 408/429, 413, 5xx), the wait the provider asked
    /// for if it did, then the provider's own words.
    #[error(
        "the model provider answered {status}{}{}: {body}",
        provider_status_hint(*status),
        retry_after_text(*retry_after_ms)
    )]
    Provider {
        /// The HTTP status.
        status: u16,
        /// The start of the response body.
        body: String,
        /// How long the provider asked to wait before trying again (its `retry-after-ms`
        /// or `Retry-After` header, in milliseconds, capped at `RETRY_AFTER_MS_MAX`), if
        /// it said; typically with 429 or 503. The client waited as asked between its
        /// own retries; this is what the last answer asked.
        #[serde(default)]
        retry_after_ms: Option<u64>,
    },
    /// The provider could not be reached.
    #[error("the model provider is unreachable (check the base URL and that the provider is up): {cause}")]
    Unreachable {
        /// What failed.
        cause: String,
    },
    /// The answer could not be understood.
    #[error("the model's answer is malformed: {cause}")]
    Malformed {
        /// What was wrong.
        cause: String,
    },
    /// The answer would use more tokens than the call's cap (`LlmRequest::max_tokens`);
    /// nothing was charged. The agent reports it as its budget exhausted.
    #[error("the answer needs {needed} tokens, more than the {max_tokens} this call may use")]
    OverTokenLimit {
        /// Tokens the answer would have used, prompt included.
        needed: u64,
        /// The call's cap.
        max_tokens: u64,
    },
    /// The provider ended the answer early for a reason of its own (its
    /// `finish_reason`): its content filter withheld it, or it failed mid-answer. What
    /// had arrived is not an answer and is not used (before, an empty or partial text
    /// was taken for a complete answer).
    #[error(
        "the model provider stopped the answer early: {reason} (finish_reason {finish_reason:?}); the \
         {partial_bytes} bytes of text that had arrived are not used"
    )]
    StoppedEarly {
        /// Why, as far as the protocol says.
        reason: EarlyStop,
        /// The provider's `finish_reason`, as sent.
        finish_reason: String,
        /// How much text had arrived, in bytes.
        partial_bytes: usize,
    },
    /// A failure injected by a script or the simulator.
    #[error("injected model failure: {cause}")]
    Injected {
        /// What the script said.
        cause: String,
    },
}

impl LlmError {
    /// A short name of what went wrong, for a model or a log to read (a Rust caller
    /// matches the variant): `timeout`; for [`LlmError::Provider`] by its status
    /// `rate_limited` (408, 429), `too_large` (413: a shorter history or fewer tools),
    /// `context_too_long` (a 400 whose body says the context length was exceeded, as
    /// OpenAI's `context_length_exceeded` does), `refused_key` (401, 403), `not_found`
    /// (404), `provider_failed` (5xx) or `provider_error` (any other); `unreachable`,
    /// `malformed`, `over_token_limit`, `stopped_early`, `injected`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Timeout { .. } => "timeout",
            Self::Provider { status: 400, body, .. } if says_context_too_long(body) => "context_too_long",
            Self::Provider { status, .. } => match status {
                408 | 429 => "rate_limited",
                413 => "too_large",
                401 | 403 => "refused_key",
                404 => "not_found",
                500..=599 => "provider_failed",
                _ => "provider_error",
            },
            Self::Unreachable { .. } => "unreachable",
            Self::Malformed { .. } => "malformed",
            Self::OverTokenLimit { .. } => "over_token_limit",
            Self::StoppedEarly { .. } => "stopped_early",
            Self::Injected { .. } => "injected",
        }
    }

    /// The error whose text (`Display`) is `text`: the inverse of its `Display`, so an
    /// error that crossed a boundary as text (an agent's failed turn, whose cause is a
    /// string on the wire) is typed again. `None` for a text no error writes. A
    /// [`LlmError::StoppedEarly`]'s `finish_reason` is read back as written when it is
    /// printable ASCII (`Debug` escapes other characters in ways not all read back).
    pub(crate) fn from_text(text: &str) -> Option<Self> {
        if let Some(rest) = text.strip_prefix("the model did not answer within ") {
            let timeout_ms = rest.strip_suffix(" ms")?.parse().ok()?;
            return Some(Self::Timeout { timeout_ms });
        }
        if let Some(rest) = text.strip_prefix("the model provider answered ") {
            let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
            let status: u16 = rest[..digits].parse().ok()?;
            let rest = rest[digits..].strip_prefix(provider_status_hint(status))?;
            let (retry_after_ms, rest) = match rest.strip_prefix(" (it asked to wait ") {
                Some(wait) => {
                    let (ms, rest) = wait.split_once(" ms before retrying)")?;
                    (Some(ms.parse().ok()?), rest)
                }
                None => (None, rest),
            };
            return Some(Self::Provider {
                status,
                body: rest.strip_prefix(": ")?.to_string(),
                retry_after_ms,
            });
        }
        if let Some(cause) =
            text.strip_prefix("the model provider is unreachable (check the base URL and that the provider is up): ")
        {
            return Some(Self::Unreachable {
                cause: cause.to_string(),
            });
        }
        if let Some(cause) = text.strip_prefix("the model's answer is malformed: ") {
            return Some(Self::Malformed {
                cause: cause.to_string(),
            });
        }
        if let Some(rest) = text.strip_prefix("the model provider stopped the answer early: ") {
            let (reason, rest) = [EarlyStop::ContentFilter, EarlyStop::Error]
                .into_iter()
                .find_map(|reason| Some((reason, rest.strip_prefix(reason.to_string().as_str())?)))?;
            let rest = rest
                .strip_prefix(" (finish_reason ")?
                .strip_suffix(" bytes of text that had arrived are not used")?;
            let (quoted, partial_bytes) = rest.rsplit_once("); the ")?;
            let finish_reason = serde_json::from_str::<String>(quoted).ok()?;
            return Some(Self::StoppedEarly {
                reason,
                finish_reason,
                partial_bytes: partial_bytes.parse().ok()?,
            });
        }
        if let Some(cause) = text.strip_prefix("injected model failure: ") {
            return Some(Self::Injected {
                cause: cause.to_string(),
            });
        }
        let rest = text.strip_prefix("the answer needs ")?;
        let (needed, rest) = rest.split_once(" tokens, more than the ")?;
        let max_tokens = rest.strip_suffix(" this call may use")?;
        Some(Self::OverTokenLimit {
            needed: needed.parse().ok()?,
            max_tokens: max_tokens.parse().ok()?,
        })
    }
}

/// Why a provider ended an answer early ([`LlmError::StoppedEarly`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EarlyStop {
    /// Its content filter withheld (part of) the answer (OpenAI's `finish_reason:
    /// "content_filter"`).
    ContentFilter,
    /// It failed while answering (`finish_reason: "error"`, as some gateways send).
    Error,
}

impl std::fmt::Display for EarlyStop {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(match self {
            Self::ContentFilter => {
                "its content filter withheld the answer (rephrase the request, or check the provider's content \
                 policy)"
            }
            Self::Error => "it failed while answering (retry later)",
        })
    }
}

/// Whether a provider's error body says the request's context was too long (OpenAI's
/// code `context_length_exceeded`, its message "maximum context length", and the
/// wording of common local servers).
fn says_context_too_long(body: &str) -> bool {
    let body = body.to_ascii_lowercase();
    [
        "context_length_exceeded",
        "maximum context length",
        "context length",
        "context window",
    ]
    .iter()
    .any(|said| body.contains(said))
}

/// What an [`LlmError::Provider`] says of the wait its provider asked for (empty when
/// it did not).
fn retry_after_text(retry_after_ms: Option<u64>) -> String {
    retry_after_ms.map_or_else(String::new, |ms| format!(" (it asked to wait {ms} ms before retrying)"))
}

/// What an [`LlmError::Provider`] of `status` tells the reader to check (empty for a
/// status without a usual cause).
fn provider_status_hint(status: u16) -> &'static str {
    match status {
        401 | 403 => " (the API key was refused: check it, and that it may use this model)",
        404 => {
            " (no such endpoint or model: check the base URL, which ends before /chat/completions \
             (e.g. https://api.openai.com/v1), and the model name)"
        }
        408 | 429 => " (rate limited or overloaded, also after the client's retries: retry later, or allow more time)",
        413 => " (the request is too large for the provider: a shorter history or fewer tools)",
        500..=599 => " (the provider failed, also after the client's retries: retry later)",
        _ => "",
    }
}

/// A chat-completions model with tool calling.
///
/// # Examples
/// A client reads the request's messages in order from its [`Prompt`]:
/// ```
/// use async_trait::async_trait;
/// use troupe_agent::{ChatMessage, LlmClient, LlmError, LlmReply, LlmRequest, Role};
/// struct Echo;
/// #[async_trait]
/// impl LlmClient for Echo {
///     async fn complete(&self, request: LlmRequest) -> Result<LlmReply, LlmError> {
///         let said: Vec<&str> = request.messages.iter().map(|m| m.content.as_str()).collect();
///         Ok(LlmReply::new(ChatMessage::new(Role::Assistant, said.join(" | "))))
///     }
/// }
/// ```
#[async_trait]
pub trait LlmClient: Send + Sync + 'static {
    /// Asks the model for the next assistant message.
    ///
    /// # Errors
    /// [`LlmError`]; the agent's turn reports it to its caller.
    async fn complete(&self, request: LlmRequest) -> Result<LlmReply, LlmError>;
}

/// An [`LlmClient`] that sends each agent's requests to the client chosen for it, and
/// every other agent's to a default: per-agent models and providers (a local model for
/// one agent, a hosted one for the rest) while [`crate::AgentSpec`] stays plain data.
/// The agent is `LlmRequest::agent`'s key, the id given to `AgentSpec::new`.
///
/// # Examples
/// ```
/// use std::sync::Arc;
/// use troupe_agent::{LlmRouter, ScriptRule, ScriptedLlm};
/// let cheap = Arc::new(ScriptedLlm::new().rule(ScriptRule::agent("summarizer").reply("short")));
/// let default = Arc::new(ScriptedLlm::new());
/// let llm = LlmRouter::new(default).route("summarizer", cheap);
/// assert_eq!(llm.routed_agents(), vec!["summarizer"]);
/// ```
#[derive(Clone)]
pub struct LlmRouter {
    default: Arc<dyn LlmClient>,
    routes: BTreeMap<String, Arc<dyn LlmClient>>,
}

impl std::fmt::Debug for LlmRouter {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("LlmRouter")
            .field("routed_agents", &self.routed_agents())
            .finish_non_exhaustive()
    }
}

impl LlmRouter {
    /// A router sending every agent to `default`.
    pub fn new(default: Arc<dyn LlmClient>) -> Self {
        Self {
            default,
            routes: BTreeMap::new(),
        }
    }

    /// This router, sending agent `agent_id`'s requests to `client` (a later route for
    /// the same agent replaces an earlier one).
    #[must_use]
    pub fn route(mut self, agent_id: impl Into<String>, client: Arc<dyn LlmClient>) -> Self {
        self.routes.insert(agent_id.into(), client);
        self
    }

    /// The agents with a client of their own, in order.
    pub fn routed_agents(&self) -> Vec<&str> {
        self.routes.keys().map(String::as_str).collect()
    }
}

#[async_trait]
impl LlmClient for LlmRouter {
    async fn complete(&self, request: LlmRequest) -> Result<LlmReply, LlmError> {
        let client = self.routes.get(request.agent.key()).unwrap_or(&self.default);
        client.complete(request).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ScriptRule, ScriptedLlm};

    fn request(agent: &str) -> LlmRequest {
        LlmRequest {
            agent: ActorId::new("agent", agent).unwrap(),
            model: String::new(),
            messages: vec![ChatMessage::new(Role::User, "hi")].into(),
            tools: Vec::new().into(),
            deadline: Deadline::from_micros(u64::MAX),
            max_tokens: None,
        }
    }

    proptest::proptest! {
        /// A prompt made of parts of any sizes reads as the `Vec` of its messages: in
        /// order, from both ends mixed, by index, its length, first and last, and after
        /// its first messages are removed.
        #[test]
        fn a_prompt_reads_as_the_vec_of_its_messages(
            sizes in proptest::collection::vec(0usize..4, 0..8),
            ends in proptest::collection::vec(proptest::bool::ANY, 0..30),
            removed in 0usize..20,
        ) {
            let mut prompt = Prompt::new();
            let mut all = Vec::new();
            for size in sizes {
                let part: Vec<ChatMessage> = (0..size).map(|_| ChatMessage::new(Role::User, all.len().to_string())).collect();
                all.extend(part.iter().cloned());
                prompt.push_part(part.into());
            }
            proptest::prop_assert_eq!(prompt.len(), all.len());
            proptest::prop_assert_eq!(prompt.to_vec(), all.clone());
            proptest::prop_assert_eq!(prompt.first(), all.first());
            proptest::prop_assert_eq!(prompt.last(), all.last());
            for index in 0..=all.len() {
                proptest::prop_assert_eq!(prompt.get(index), all.get(index));
            }
            proptest::prop_assert!(prompt.iter().rev().eq(all.iter().rev()));
            let (mut from_prompt, mut from_vec) = (prompt.iter(), all.iter());
            for from_back in ends {
                proptest::prop_assert_eq!(from_prompt.len(), from_vec.len());
                if from_back {
                    proptest::prop_assert_eq!(from_prompt.next_back(), from_vec.next_back());
                } else {
                    proptest::prop_assert_eq!(from_prompt.next(), from_vec.next());
                }
            }
            prompt.remove_first(removed);
            all.drain(..removed.min(all.len()));
            proptest::prop_assert_eq!(&prompt, &all);
            proptest::prop_assert_eq!(prompt.parts().map(|part| part.len()).sum::<usize>(), all.len());
            proptest::prop_assert!(prompt.parts().all(|part| !part.is_empty()));
            let json = serde_json::to_string(&prompt).unwrap();
            proptest::prop_assert_eq!(&json, &serde_json::to_string(&all).unwrap());
            proptest::prop_assert_eq!(serde_json::from_str::<Prompt>(&json).unwrap(), prompt);
        }
    }

    /// Any text, and printable ASCII (what a provider's `finish_reason` is).
    fn any_error() -> impl proptest::strategy::Strategy<Value = LlmError> {
        use proptest::prelude::*;
        let text = ".{0,40}";
        prop_oneof![
            any::<u64>().prop_map(|timeout_ms| LlmError::Timeout { timeout_ms }),
            (
                prop_oneof![
                    Just(400u16),
                    Just(401),
                    Just(404),
                    Just(413),
                    Just(429),
                    Just(503),
                    100u16..1000
                ],
                text,
                proptest::option::of(any::<u64>())
            )
                .prop_map(|(status, body, retry_after_ms)| LlmError::Provider {
                    status,
                    body,
                    retry_after_ms
                }),
            text.prop_map(|cause| LlmError::Unreachable { cause }),
            text.prop_map(|cause| LlmError::Malformed { cause }),
            (any::<u64>(), any::<u64>())
                .prop_map(|(needed, max_tokens)| LlmError::OverTokenLimit { needed, max_tokens }),
            (any::<bool>(), "[ -~]{0,20}", any::<usize>()).prop_map(|(filter, finish_reason, partial_bytes)| {
                LlmError::StoppedEarly {
                    reason: if filter {
                        EarlyStop::ContentFilter
                    } else {
                        EarlyStop::Error
                    },
                    finish_reason,
                    partial_bytes,
                }
            }),
            text.prop_map(|cause| LlmError::Injected { cause }),
        ]
    }

    #[test]
    fn a_provider_error_is_named_by_its_status_and_a_context_too_long_by_its_body() {
        let provider = |status, body: &str| LlmError::Provider {
            status,
            body: body.to_owned(),
            retry_after_ms: None,
        };
        let openai = r#"{"error": {"message": "This model's maximum context length is 8192 tokens.", "code": "context_length_exceeded"}}"#;
        assert_eq!(provider(400, openai).kind(), "context_too_long");
        assert_eq!(provider(400, "bad request").kind(), "provider_error");
        assert_eq!(provider(429, "").kind(), "rate_limited");
        assert_eq!(provider(413, "").kind(), "too_large");
        assert_eq!(provider(503, "").kind(), "provider_failed");
    }

    proptest::proptest! {
        /// Every model error's text reads back as the error (an agent's failed turn
        /// carries it as text, also across processes), and no other text does.
        #[test]
        fn a_model_errors_text_reads_back_as_the_error(error in any_error(), other in ".{0,40}") {
            proptest::prop_assert_eq!(LlmError::from_text(&error.to_string()), Some(error));
            if let Some(read) = LlmError::from_text(&other) {
                proptest::prop_assert_eq!(read.to_string(), other);
            }
        }
    }

    #[tokio::test]
    async fn each_agent_reaches_its_own_client_and_the_rest_the_default() {
        let local = Arc::new(ScriptedLlm::new().rule(ScriptRule::agent("summarizer").reply("from local")));
        let hosted = Arc::new(ScriptedLlm::new().rule(ScriptRule::agent("planner").reply("from hosted")));
        let router = LlmRouter::new(hosted.clone()).route("summarizer", local.clone());

        let summarizer = router.complete(request("summarizer")).await.unwrap();
        let planner = router.complete(request("planner")).await.unwrap();

        assert_eq!(summarizer.message.content, "from local");
        assert_eq!(planner.message.content, "from hosted");
        assert_eq!(local.requests().len(), 1);
        assert_eq!(hosted.requests().len(), 1);
        assert_eq!(hosted.requests()[0].agent.key(), "planner");
    }
}
