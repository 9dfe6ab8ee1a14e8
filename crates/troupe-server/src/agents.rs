//! The agent routes: definitions (list, get, create, update, delete), messages (a reply,
//! or the turn's events and the reply over SSE), history pages, notifications and
//! delegated tasks.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use troupe_agent::{AgentReply, AgentSpec, AskOptions, DelegateOptions, DirectoryError, NotifyOptions, TaskStatus};
use troupe_core::TraceId;

use crate::error::{page_limit, ApiError, ApiJson, ApiQuery};
use crate::limits::{
    SERVER_HISTORY_PAGE_DEFAULT, SERVER_HISTORY_PAGE_MAX, SERVER_MESSAGE_ID_LENGTH_MAX_BYTES,
    SERVER_MESSAGE_SIZE_MAX_BYTES, SERVER_MESSAGE_TIMEOUT_MS_MAX, SERVER_TASK_ID_LENGTH_MAX_BYTES,
};
use crate::server::AppState;

type Shared = State<Arc<AppState>>;

/// An agent definition as JSON.
fn agent_json(spec: &AgentSpec) -> Value {
    json!({
        "id": spec.id,
        "name": spec.name,
        "role": spec.role,
        "system_prompt": spec.system_prompt,
        "model": spec.model.model,
        "max_steps": spec.model.max_steps,
        "history": spec.history,
        "call_approval": spec.call_approval,
    })
}

/// A reply as JSON.
pub(crate) fn reply_json(agent: &str, reply: &AgentReply) -> Value {
    json!({
        "agent": agent,
        "text": reply.text,
        "truncated": reply.truncated,
        "steps": reply.steps,
        "usage": reply.usage,
    })
}

fn task_json(status: &TaskStatus) -> Value {
    json!({
        "task_id": status.task_id,
        "to": status.to.key(),
        "state": status.state.as_str(),
        "result": status.result,
        "deadline_us": status.deadline.as_micros(),
    })
}

/// The agent's definition, or 404.
pub(crate) async fn known(state: &AppState, agent: &str) -> Result<AgentSpec, ApiError> {
    // Read again once a refresh period old: another process sharing the store may have
    // defined, replaced or removed it.
    state
        .client
        .current_directory()
        .await
        .get(agent)
        .ok_or_else(|| ApiError::agent_not_found(agent))
}

/// `text` checked against the message limits: 422 if empty or too long.
pub(crate) fn check_text(text: &str) -> Result<(), ApiError> {
    if text.is_empty() {
        return Err(ApiError::unprocessable("empty_message", "the message text is empty"));
    }
    if text.len() > SERVER_MESSAGE_SIZE_MAX_BYTES {
        return Err(ApiError::unprocessable(
            "message_too_long",
            format!(
                "the message is {} bytes, more than the limit of {SERVER_MESSAGE_SIZE_MAX_BYTES}",
                text.len()
            ),
        ));
    }
    Ok(())
}

/// A notification's `msg_id` checked: 422 `invalid_message_id` if it is longer than
/// [`SERVER_MESSAGE_ID_LENGTH_MAX_BYTES`] (the agent's store could not key it), or if it
/// starts with [`crate::a2a::A2A_MESSAGE_ID_PREFIX`], reserved for the messages of A2A
/// tasks: the agent dedupes both kinds by their id in one namespace, so until 2026-12-06
/// a notification `a2a:{task id}` was taken for that A2A task's message (or the other way
/// round: the task, coming second, was never worked). An empty one is the agent's to
/// refuse (the same code).
pub(crate) fn check_message_id(msg_id: Option<&str>) -> Result<(), ApiError> {
    use crate::a2a::A2A_MESSAGE_ID_PREFIX;
    match msg_id {
        Some(id) if id.starts_with(A2A_MESSAGE_ID_PREFIX) => Err(ApiError::unprocessable(
            "invalid_message_id",
            format!(
                "msg_id {id:?} starts with {A2A_MESSAGE_ID_PREFIX:?}, reserved for the messages of A2A tasks \
                 (send those through /a2a/{{agent}}); use another id (a UUID fits)"
            ),
        )),
        Some(id) if id.len() > SERVER_MESSAGE_ID_LENGTH_MAX_BYTES => Err(ApiError::unprocessable(
            "invalid_message_id",
            format!(
                "msg_id is {} bytes, more than the limit of {SERVER_MESSAGE_ID_LENGTH_MAX_BYTES}; use a shorter id \
                 (a UUID fits)",
                id.len()
            ),
        )),
        _ => Ok(()),
    }
}

/// 404 `task_not_found` for task `task_id` of agent `agent`.
fn task_not_found(agent: &str, task_id: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "task_not_found",
        format!("agent {agent:?} has no task {task_id:?}"),
    )
}

/// 404 `task_not_found` for a task id longer than [`SERVER_TASK_ID_LENGTH_MAX_BYTES`]:
/// no agent gives a task such an id (and the store could not key it).
fn check_task_id(agent: &str, task_id: &str) -> Result<(), ApiError> {
    if task_id.len() > SERVER_TASK_ID_LENGTH_MAX_BYTES {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "task_not_found",
            format!(
                "agent {agent:?} has no task whose id is {} bytes: task ids are at most \
                 {SERVER_TASK_ID_LENGTH_MAX_BYTES} bytes; use the task_id the delegation answered",
                task_id.len()
            ),
        ));
    }
    Ok(())
}

/// `timeout_ms` checked: 422 unless 1..=[`SERVER_MESSAGE_TIMEOUT_MS_MAX`].
pub(crate) fn check_timeout(timeout_ms: Option<u64>) -> Result<Option<u64>, ApiError> {
    match timeout_ms {
        Some(ms) if ms == 0 || ms > SERVER_MESSAGE_TIMEOUT_MS_MAX => Err(ApiError::unprocessable(
            "invalid_timeout",
            format!("timeout_ms must be between 1 and {SERVER_MESSAGE_TIMEOUT_MS_MAX}, got {ms}"),
        )),
        other => Ok(other),
    }
}

/// `GET /v1/agents`.
pub(crate) async fn list(State(state): Shared) -> Json<Value> {
    let agents: Vec<Value> = state
        .client
        .current_directory()
        .await
        .list()
        .iter()
        .map(agent_json)
        .collect();
    Json(json!({ "agents": agents }))
}

/// `GET /v1/agents/{id}`: the definition and the committed inbox and outbox lengths.
pub(crate) async fn get_one(State(state): Shared, Path(agent): Path<String>) -> Result<Json<Value>, ApiError> {
    let spec = known(&state, &agent).await?;
    let (inbox, outbox) = state.client.pending(&agent).await?;
    let mut value = agent_json(&spec);
    value["inbox"] = json!(inbox);
    value["outbox"] = json!(outbox);
    Ok(Json(value))
}

/// The body of `POST /v1/agents` and `PUT /v1/agents/{id}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AgentBody {
    id: Option<String>,
    name: Option<String>,
    #[serde(default)]
    role: String,
    #[serde(default)]
    system_prompt: String,
    #[serde(default)]
    model: String,
    max_steps: Option<u32>,
    /// Its history window in messages (`AgentSpec::history`); default
    /// `AGENT_HISTORY_WINDOW_DEFAULT`.
    history: Option<usize>,
    /// What its `call_agent` does when a call needs approval: `wait_in_turn` (default) or
    /// `delegate` (`AgentSpec::call_approval`).
    #[serde(default)]
    call_approval: troupe_agent::CallApproval,
}

impl AgentBody {
    fn into_spec(self, id: String) -> Result<AgentSpec, ApiError> {
        let mut spec = AgentSpec::new(id)
            .role(self.role)
            .system_prompt(self.system_prompt)
            .model(self.model)
            .call_approval(self.call_approval);
        if let Some(name) = self.name {
            spec = spec.name(name);
        }
        // Checked by `validate` below, with the other limits (`AgentSpec::check_max_steps`).
        if let Some(steps) = self.max_steps {
            spec = spec.max_steps(steps);
        }
        if let Some(history) = self.history {
            spec = spec.history(history);
        }
        spec.validate()
            .map_err(|error| ApiError::unprocessable("invalid_agent", error.to_string()))?;
        Ok(spec)
    }
}

impl From<DirectoryError> for ApiError {
    fn from(error: DirectoryError) -> Self {
        let message = error.to_string();
        match &error {
            DirectoryError::AgentExists { id } => Self::new(
                StatusCode::CONFLICT,
                "agent_exists",
                format!("agent {id:?} already exists; PUT /v1/agents/{id} replaces it"),
            ),
            DirectoryError::NoSuchAgent { id } => Self::agent_not_found(id),
            DirectoryError::Invalid(_) => Self::unprocessable("invalid_agent", message),
            DirectoryError::Store(store) => Self::storage(store, message),
            DirectoryError::Decode { .. } => {
                Self::new(StatusCode::INTERNAL_SERVER_ERROR, "directory_unreadable", message)
            }
        }
    }
}

/// `POST /v1/agents`: 201 with the definition; 409 if the id exists (decided on the
/// stored directory: also across processes sharing the store).
pub(crate) async fn create(State(state): Shared, ApiJson(body): ApiJson<AgentBody>) -> Result<Response, ApiError> {
    let Some(id) = body.id.clone() else {
        return Err(ApiError::unprocessable("invalid_agent", "the agent needs an \"id\""));
    };
    let spec = body.into_spec(id)?;
    let _writes = state.directory_writes.lock(&spec.id).await;
    state.client.define_agent(spec.clone()).await?;
    Ok((StatusCode::CREATED, Json(agent_json(&spec))).into_response())
}

/// `PUT /v1/agents/{id}`: replaces an existing definition (its next turn uses it and
/// keeps its history); 404 if there is none.
pub(crate) async fn update(
    State(state): Shared,
    Path(agent): Path<String>,
    ApiJson(body): ApiJson<AgentBody>,
) -> Result<Json<Value>, ApiError> {
    if let Some(id) = &body.id {
        if *id != agent {
            return Err(ApiError::unprocessable(
                "invalid_agent",
                format!("the body's id {id:?} differs from the path's {agent:?}; an agent cannot be renamed"),
            ));
        }
    }
    let spec = body.into_spec(agent.clone())?;
    let _writes = state.directory_writes.lock(&agent).await;
    state.client.replace_agent(spec.clone()).await?;
    Ok(Json(agent_json(&spec)))
}

/// `DELETE /v1/agents/{id}`: 204; the agent leaves the directory and its activation
/// deactivates after its running and queued requests; its stored conversation is kept.
/// Its A2A tasks are let go, in memory and in the store (`a2a::forget_agent`).
pub(crate) async fn delete(State(state): Shared, Path(agent): Path<String>) -> Result<StatusCode, ApiError> {
    // Held across the deactivation (which may wait for a running turn) so that a PUT
    // racing with the delete cannot put the agent back; the agent's own lock only, so
    // that changes to other agents do not wait for its turn.
    let _writes = state.directory_writes.lock(&agent).await;
    match state.client.remove_agent(&agent).await {
        Ok(Some(_)) => {
            crate::a2a::forget_agent(&state, &agent).await;
            Ok(StatusCode::NO_CONTENT)
        }
        Ok(None) => Err(ApiError::agent_not_found(&agent)),
        Err(error) => Err((&error).into()),
    }
}

/// The body of `POST /v1/agents/{id}/messages`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct MessageBody {
    text: String,
    timeout_ms: Option<u64>,
}

/// The query of `POST /v1/agents/{id}/messages`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct MessageQuery {
    #[serde(default)]
    stream: bool,
}

/// `POST /v1/agents/{id}/messages`: the reply as JSON, or, with `?stream=true` or
/// `Accept: text/event-stream`, the turn's events and then the reply over SSE.
pub(crate) async fn message(
    State(state): Shared,
    Path(agent): Path<String>,
    ApiQuery(query): ApiQuery<MessageQuery>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<MessageBody>,
) -> Result<Response, ApiError> {
    known(&state, &agent).await?;
    check_text(&body.text)?;
    let timeout = Duration::from_millis(
        check_timeout(body.timeout_ms)?.unwrap_or(troupe_agent::limits::AGENT_ASK_TIMEOUT_MS_DEFAULT),
    );
    let wants_stream = query.stream
        || headers
            .get(header::ACCEPT)
            .and_then(|value| value.to_str().ok())
            .is_some_and(|accept| accept.contains("text/event-stream"));
    let trace = request_trace(&state, &headers);
    if wants_stream {
        // Taken before the turn starts: a stream over the limit starts nothing.
        let slot = crate::server::stream_slot(&state).map_err(ApiError::overloaded)?;
        let response = crate::agents_stream::streamed_turn(&state, agent, body.text, timeout, trace, slot);
        return Ok(with_trace(Ok(response), trace));
    }
    let options = AskOptions::default().timeout(timeout).traced(trace);
    let reply = state.client.ask_with(&agent, &body.text, options).await;
    Ok(with_trace(
        reply
            .map(|reply| Json(reply_json(&agent, &reply)).into_response())
            .map_err(|error| timed_out_says_what_to_do(ApiError::from(error), false)),
        trace,
    ))
}

/// A message's 504 `timeout` (its agent did not answer within `timeout_ms`) saying what
/// to do: its turn was abandoned, so the same message may be sent again, with a larger
/// `timeout_ms` or as a stream. Until 2026-12-07 it said only "invocation of agent/a
/// timed out after 100 ms". It carries no `Retry-After`: RFC 9110 gives that header its
/// meaning with 503 (how long the service will be unavailable), and here the request's
/// own budget ran out; no wait makes the same request with the same budget succeed.
/// A `streamed` message's error event says the same, less the advice to stream.
pub(crate) fn timed_out_says_what_to_do(mut error: ApiError, streamed: bool) -> ApiError {
    if error.status == StatusCode::GATEWAY_TIMEOUT && error.code == "timeout" {
        let or_stream = if streamed {
            ""
        } else {
            ", or with ?stream=true to follow the turn"
        };
        error.message = format!(
            "{}; its turn was abandoned: send the message again with a larger timeout_ms (at most \
             {SERVER_MESSAGE_TIMEOUT_MS_MAX} ms){or_stream}",
            error.message
        );
    }
    error
}

/// The response header that names the trace id a request ran under (32 lowercase hex
/// digits), on every response of a route that runs an agent's turn, errors included.
pub const TRACE_ID_HEADER: &str = "x-troupe-trace-id";

/// The trace id of a request that enters the server: the trace-id field of its W3C
/// `traceparent` header when it has a valid one; else, when the spans are exported
/// (feature `otel`), the id of the trace the export started for the request, so that
/// the response names the exported trace; else a new one
/// ([`troupe_agent::AgentClient::new_trace_id`]).
pub(crate) fn request_trace(state: &AppState, headers: &HeaderMap) -> TraceId {
    let exported = || {
        #[cfg(feature = "otel")]
        return crate::otel::exported_trace_id();
        #[cfg(not(feature = "otel"))]
        None
    };
    headers
        .get("traceparent")
        .and_then(|value| value.to_str().ok())
        .and_then(TraceId::from_traceparent)
        .or_else(exported)
        .unwrap_or_else(|| state.client.new_trace_id())
}

/// `result` as a response with the [`TRACE_ID_HEADER`] header.
pub(crate) fn with_trace(result: Result<Response, ApiError>, trace: TraceId) -> Response {
    let mut response = result.unwrap_or_else(IntoResponse::into_response);
    if let Ok(value) = header::HeaderValue::from_str(&trace.to_string()) {
        response.headers_mut().insert(TRACE_ID_HEADER, value);
    }
    response
}

/// The query of `GET /v1/agents/{id}/history`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct HistoryQuery {
    limit: Option<usize>,
    before: Option<usize>,
}

/// `GET /v1/agents/{id}/history?limit&before`: a page of the conversation log, oldest
/// first, ending before index `before` (default: the end); `next_before` pages back.
pub(crate) async fn history(
    State(state): Shared,
    Path(agent): Path<String>,
    ApiQuery(query): ApiQuery<HistoryQuery>,
) -> Result<Json<Value>, ApiError> {
    known(&state, &agent).await?;
    let limit = page_limit(query.limit, SERVER_HISTORY_PAGE_DEFAULT, SERVER_HISTORY_PAGE_MAX)?;
    // Only the page's entries are read: the log grows with the agent's age.
    let before = query.before.map(|before| u64::try_from(before).unwrap_or(u64::MAX));
    let page = state.client.conversation_log_page(&agent, before, limit).await?;
    let (total, start) = (page.total, page.start);
    let messages: Vec<Value> = page
        .messages
        .iter()
        .zip(start..)
        .map(|(message, index)| {
            json!({
                "index": index,
                "role": format!("{:?}", message.role).to_lowercase(),
                "content": message.content,
                "tool_calls": message.tool_calls,
                "tool_call_id": message.tool_call_id,
            })
        })
        .collect();
    Ok(Json(json!({
        "agent": agent,
        "total": total,
        "messages": messages,
        "next_before": if start > 0 { Some(start) } else { None },
    })))
}

/// The body of `POST /v1/agents/{id}/notify`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct NotifyBody {
    text: String,
    msg_id: Option<String>,
    timeout_ms: Option<u64>,
}

/// `POST /v1/agents/{id}/notify`: 202 once the notification is persisted in the agent's
/// inbox. With `msg_id`, retrying never makes a second entry. The turn that processes
/// it runs under the request's trace id, which the response names.
pub(crate) async fn notify(
    State(state): Shared,
    Path(agent): Path<String>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<NotifyBody>,
) -> Result<Response, ApiError> {
    known(&state, &agent).await?;
    check_text(&body.text)?;
    check_message_id(body.msg_id.as_deref())?;
    let timeout_ms = check_timeout(body.timeout_ms)?;
    let trace = request_trace(&state, &headers);
    let options = NotifyOptions {
        msg_id: body.msg_id,
        timeout_ms,
        trace_id: Some(trace),
    };
    let sent = state.client.notify_with(&agent, &body.text, options).await;
    Ok(with_trace(
        sent.map(|msg_id| (StatusCode::ACCEPTED, Json(json!({ "msg_id": msg_id }))).into_response())
            .map_err(ApiError::from),
        trace,
    ))
}

/// The body of `POST /v1/agents/{id}/tasks`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct DelegateBody {
    to: String,
    text: String,
    timeout_ms: Option<u64>,
}

/// `POST /v1/agents/{id}/tasks`: agent `id` delegates `text` to agent `to`; 202 with the
/// task id once the task is committed to its outbox. The delegation runs under the
/// request's trace id (the delegating turn, the task's turn, the turn that takes the
/// result back), which the response names.
pub(crate) async fn delegate(
    State(state): Shared,
    Path(agent): Path<String>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<DelegateBody>,
) -> Result<Response, ApiError> {
    known(&state, &agent).await?;
    check_text(&body.text)?;
    let timeout_ms = check_timeout(body.timeout_ms)?;
    let trace = request_trace(&state, &headers);
    let options = DelegateOptions {
        timeout_ms,
        trace_id: Some(trace),
    };
    let sent = state.client.delegate_with(&agent, &body.to, &body.text, options).await;
    Ok(with_trace(
        sent.map(|task_id| (StatusCode::ACCEPTED, Json(json!({ "task_id": task_id }))).into_response())
            .map_err(ApiError::from),
        trace,
    ))
}

/// `GET /v1/agents/{id}/tasks/{task}`: the delegator's committed record of the task.
pub(crate) async fn task(
    State(state): Shared,
    Path((agent, task_id)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    known(&state, &agent).await?;
    check_task_id(&agent, &task_id)?;
    match state.client.task(&agent, &task_id).await? {
        Some(status) => Ok(Json(task_json(&status))),
        None => Err(task_not_found(&agent, &task_id)),
    }
}

/// `POST /v1/agents/{id}/tasks/{task}/cancel`: 202 `cancel_queued`, or 200 with the
/// final state if the task had already ended.
pub(crate) async fn cancel(
    State(state): Shared,
    Path((agent, task_id)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    known(&state, &agent).await?;
    check_task_id(&agent, &task_id)?;
    match state.client.cancel(&agent, &task_id).await? {
        None => Ok((
            StatusCode::ACCEPTED,
            Json(json!({"task_id": task_id, "cancel": "queued"})),
        )
            .into_response()),
        Some(final_state) => Ok(Json(json!({"task_id": task_id, "state": final_state.as_str()})).into_response()),
    }
}
