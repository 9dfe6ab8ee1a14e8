//! The conversation routes: an agent's conversations, creating a conversation (direct
//! or group, of agents and humans), posting a message (its `@agent` mentions trigger
//! those agents' turns, whose replies are appended later), and the messages in pages
//! by seq (`?after=SEQ&limit=N`, one ranged store read per page).

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use troupe_agent::{
    ConversationError, ConversationInfo, ConversationKind, ConversationMessage, NoteKind, Participant, Sender,
    CONVERSATIONS_LISTED_MAX,
};

use crate::agents::{known, request_trace, with_trace};
use crate::error::{page_limit, ApiError, ApiJson, ApiQuery};
use crate::limits::{SERVER_CONVERSATION_PAGE_DEFAULT, SERVER_CONVERSATION_PAGE_MAX};
use crate::server::AppState;

type Shared = State<Arc<AppState>>;

impl From<ConversationError> for ApiError {
    fn from(error: ConversationError) -> Self {
        let message = error.to_string();
        match &error {
            ConversationError::InvalidName { .. } => Self::unprocessable("invalid_name", message),
            ConversationError::InvalidParticipants { .. } => Self::unprocessable("invalid_participants", message),
            ConversationError::UnknownAgent { .. } => Self::new(StatusCode::NOT_FOUND, "agent_not_found", message),
            ConversationError::Conflict { .. } => Self::new(StatusCode::CONFLICT, "conversation_conflict", message),
            ConversationError::NotFound { .. } => Self::new(StatusCode::NOT_FOUND, "conversation_not_found", message),
            ConversationError::NotParticipant { .. } => Self::new(StatusCode::FORBIDDEN, "not_participant", message),
            ConversationError::UnknownMention { .. } => Self::unprocessable("unknown_mention", message),
            ConversationError::TooManyMentions { .. } => Self::unprocessable("too_many_mentions", message),
            ConversationError::BadText { .. } => Self::unprocessable("invalid_text", message),
            ConversationError::Full { .. } => Self::new(StatusCode::CONFLICT, "conversation_full", message),
            // A store down for a moment is said as every route says it (until
            // 2026-12-07 it was `overloaded` here); any other cause stays `overloaded`.
            ConversationError::Unavailable {
                store_unavailable: true,
                ..
            } => Self::storage_unavailable(message),
            ConversationError::Unavailable {
                store_unavailable: false,
                ..
            } => Self::overloaded(message),
        }
    }
}

/// A participant or sender in JSON: `{"kind": "agent" | "human", "name": "..."}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PartyBody {
    kind: PartyKind,
    name: String,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
enum PartyKind {
    Agent,
    Human,
}

impl PartyBody {
    fn participant(self) -> Participant {
        match self.kind {
            PartyKind::Agent => Participant::Agent(self.name),
            PartyKind::Human => Participant::Human(self.name),
        }
    }

    fn sender(self) -> Sender {
        match self.kind {
            PartyKind::Agent => Sender::Agent(self.name),
            PartyKind::Human => Sender::Human(self.name),
        }
    }
}

fn participant_json(participant: &Participant) -> Value {
    match participant {
        Participant::Agent(name) => json!({"kind": "agent", "name": name}),
        Participant::Human(name) => json!({"kind": "human", "name": name}),
    }
}

fn sender_json(sender: &Sender) -> Value {
    match sender {
        Sender::Agent(name) => json!({"kind": "agent", "name": name}),
        Sender::Human(name) => json!({"kind": "human", "name": name}),
        Sender::System => json!({"kind": "system"}),
    }
}

fn kind_str(kind: ConversationKind) -> &'static str {
    match kind {
        ConversationKind::Direct => "direct",
        ConversationKind::Group => "group",
    }
}

fn note_kind_str(kind: NoteKind) -> &'static str {
    match kind {
        NoteKind::Cycle => "cycle",
        NoteKind::DepthLimit => "depth_limit",
        NoteKind::NotPermitted => "not_permitted",
        NoteKind::UnknownMention => "unknown_mention",
        NoteKind::NotAnAgent => "not_an_agent",
        NoteKind::Undeliverable => "undeliverable",
        NoteKind::Failed => "failed",
    }
}

fn info_json(info: &ConversationInfo) -> Value {
    json!({
        "id": info.id,
        "kind": kind_str(info.kind),
        "participants": info.participants.iter().map(participant_json).collect::<Vec<_>>(),
    })
}

fn message_json(message: &ConversationMessage) -> Value {
    json!({
        "seq": message.seq,
        "sender": sender_json(&message.sender),
        "text": message.text,
        "mentions": message.mentions,
        "reply_to": message.reply_to,
        "chain": message.chain,
        "note": message.note.as_ref().map(|note| json!({"agent": note.agent, "kind": note_kind_str(note.kind)})),
    })
}

/// The query of `GET /v1/agents/{id}/conversations`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct IdPageQuery {
    /// Conversations whose id sorts after this one; from the first if absent.
    after: Option<String>,
    limit: Option<usize>,
}

/// `GET /v1/agents/{id}/conversations?after=ID&limit=N`: up to `limit` (default and
/// most [`CONVERSATIONS_LISTED_MAX`]) ids of the conversations the agent takes part in,
/// after id `after`, in id order; `next_after` is the cursor of the next page (absent
/// when this page is the last), and `truncated` says the same (more may follow).
pub(crate) async fn of_agent(
    State(state): Shared,
    Path(agent): Path<String>,
    ApiQuery(query): ApiQuery<IdPageQuery>,
) -> Result<Json<Value>, ApiError> {
    let limit = page_limit(query.limit, CONVERSATIONS_LISTED_MAX, CONVERSATIONS_LISTED_MAX)?;
    known(&state, &agent).await?;
    let ids = state
        .client
        .conversations_of_after(&agent, query.after.as_deref(), limit)
        .await?;
    let next_after = if ids.len() == limit { ids.last().cloned() } else { None };
    Ok(Json(json!({
        "agent": agent,
        "truncated": next_after.is_some(),
        "next_after": next_after,
        "conversations": ids,
    })))
}

/// `GET /v1/conversations/{id}`: the conversation's definition, `{id, kind,
/// participants}`, as committed; 404 when it has none (never created, or a creation
/// that stopped half-way: creating it again completes it).
pub(crate) async fn definition(State(state): Shared, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    match state.client.conversation(&id).await? {
        Some(info) => Ok(Json(info_json(&info))),
        None => Err(ConversationError::NotFound { id }.into()),
    }
}

/// The body of `POST /v1/conversations`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct CreateBody {
    id: String,
    kind: KindBody,
    participants: Vec<PartyBody>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
enum KindBody {
    Direct,
    Group,
}

/// `POST /v1/conversations`: creates the conversation, or returns it if it exists with
/// the same participants and kind (a retry is safe); 409 if it exists otherwise.
pub(crate) async fn create(State(state): Shared, ApiJson(body): ApiJson<CreateBody>) -> Result<Json<Value>, ApiError> {
    let kind = match body.kind {
        KindBody::Direct => ConversationKind::Direct,
        KindBody::Group => ConversationKind::Group,
    };
    let participants = body.participants.into_iter().map(PartyBody::participant).collect();
    let info = state.client.create_conversation(&body.id, participants, kind).await?;
    Ok(Json(info_json(&info)))
}

/// The body of `POST /v1/conversations/{id}/messages`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PostBody {
    sender: PartyBody,
    /// The caller's id of this message: a retry with the same id appends nothing.
    msg_id: String,
    text: String,
}

/// `POST /v1/conversations/{id}/messages`: appends the message; each `@agent` mention
/// triggers one turn of that agent, whose reply is appended later (read the messages).
/// The post, the mentions' deliveries and the turns they trigger run under the
/// request's trace id, which the response names.
pub(crate) async fn post(
    State(state): Shared,
    Path(id): Path<String>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<PostBody>,
) -> Response {
    let trace = request_trace(&state, &headers);
    let posted = state
        .client
        .post_message_in(&id, body.sender.sender(), &body.msg_id, &body.text, Some(trace))
        .await;
    let response = posted.map_err(ApiError::from).map(|posted| {
        Json(json!({
            "conversation": id,
            "seq": posted.seq,
            "duplicate": posted.duplicate,
        }))
        .into_response()
    });
    with_trace(response, trace)
}

/// The query of `GET /v1/conversations/{id}/messages`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PageQuery {
    /// Messages with a seq greater than this; from the first message if absent.
    after: Option<u64>,
    limit: Option<usize>,
}

/// `GET /v1/conversations/{id}/messages?after=SEQ&limit=N`: up to `limit` messages
/// after seq `after`, in seq order; `next_after` is the cursor of the next page (absent
/// when this page is the last one so far).
pub(crate) async fn messages(
    State(state): Shared,
    Path(id): Path<String>,
    ApiQuery(query): ApiQuery<PageQuery>,
) -> Result<Json<Value>, ApiError> {
    let limit = page_limit(
        query.limit,
        SERVER_CONVERSATION_PAGE_DEFAULT,
        SERVER_CONVERSATION_PAGE_MAX,
    )?;
    if !state.client.conversation_exists(&id).await? {
        return Err(ConversationError::NotFound { id }.into());
    }
    let page = state.client.read_messages(&id, query.after, limit).await?;
    let next_after = if page.len() == limit {
        page.last().map(|message| message.seq)
    } else {
        None
    };
    Ok(Json(json!({
        "conversation": id,
        "messages": page.iter().map(message_json).collect::<Vec<_>>(),
        "next_after": next_after,
    })))
}
