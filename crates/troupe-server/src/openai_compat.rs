//! The OpenAI-compatible routes, so any OpenAI client can talk to an agent:
//! `POST /v1/chat/completions` (the model is the agent id; the last user message is
//! sent to the agent, the rest of the conversation is ignored: the agent keeps its own)
//! and `GET /v1/models` (every agent as a model).
//!
//! With `"stream": true` the answer is OpenAI `chat.completion.chunk` SSE messages,
//! sent while the agent's turn runs:
//!
//! ```text
//! checked (404/422/400) ─► stream slot (503) ─► turn asked, waited for ≤ 200 ms
//!   ├─ ended: an error ─► its HTTP status (429 busy, 503, 500 ...), as without streaming
//!   ├─ ended: a reply  ─► 200, every chunk at once
//!   └─ running         ─► 200, headers + role chunk ─► ":" every 15 s ─┬─► content, finish, [usage], [DONE]
//!                                                                      └─► one error event, end
//! ```
//!
//! - The request is checked first (unknown model 404 `model_not_found`, no user message
//!   422, `stream_options` without streaming 400), then it takes one of the server's
//!   `streams_open_max` stream slots (`server::stream_slot`; over the limit: 503
//!   `overloaded` with `Retry-After`, before the agent is asked), all answered with HTTP
//!   statuses in the route's one error shape.
//! - The turn is asked for, and the handler waits for it for
//!   [`OPENAI_STREAM_HEADERS_WAIT_MS`] (at most half the request timeout). The client API
//!   tells nothing between "asked" and "answered" (`AgentClient::ask_with` returns the
//!   reply or the error), so the wait is a bound, not an admission signal: an error known
//!   as the turn is asked for (a full mailbox, 429 `busy` with `Retry-After`; the agent
//!   deleted meanwhile, 404; a full dispatcher or a shutdown, 503) comes well within it
//!   and keeps its HTTP status, as without streaming; so does a turn that fails that
//!   soon. A turn that ends that soon is streamed whole at once.
//! - Past the wait the headers go out with the role chunk (`delta: {"role": "assistant",
//!   "content": ""}`), and the request leaves the concurrent-request limit and its
//!   timeout (which bound the time to the headers: a long turn is no 504). While the turn
//!   runs, an SSE comment every [`OPENAI_STREAM_KEEP_ALIVE_MS`] keeps the connection (the
//!   OpenAI clients skip comments). When it ends: one chunk with the whole reply text
//!   (the agent does not stream tokens through the client API), one with `finish_reason`
//!   (`"stop"`, or `"length"` for a cut reply), then `data: [DONE]`.
//! - An error after the headers is one `data:` event whose JSON is the route's HTTP error
//!   body, `{"error": {"code", "message"}}` (the same code as the HTTP answer of the same
//!   error; no status: the headers said 200), as OpenAI sends one; then the stream ends,
//!   without `[DONE]`. OpenAI's Python package raises it as `openai.APIError` (`code`
//!   and `message` set).
//! - The stream's slot is held from before the turn until the body ends or its client
//!   goes away. The turn is polled by the response body: a client that goes away drops
//!   the body and with it the ask, so the runtime cancels the turn (it commits nothing,
//!   unless its commit had started; `RuntimeCounters::turns_abandoned` counts it), as it
//!   does when the client of a completion that is not streamed goes away.
//!
//! With `"stream_options": {"include_usage": true}`, as OpenAI's: a last chunk before
//! `[DONE]` with empty `choices` and the turn's `usage`, every other chunk with
//! `"usage": null`. `created` is when the turn was asked for, in Unix seconds, on the
//! runtime's clock (anchored on the wall clock when the runtime started); every chunk of
//! a stream has the same `id` and `created`. A model's `created` in `/v1/models` is when
//! its agent was defined, in Unix seconds on the runtime's clock
//! (`AgentSpec::defined_at_us`): for an agent the system was built with (in code or its
//! config file), when this system started, as such an agent is defined anew at every
//! start; for one defined through the API (`POST`/`PUT /v1/agents`), when it was
//! defined or last replaced, stored with its definition. 0 for a definition stored by
//! an older Troupe, which carries no time.
//!
//! `stream_options` on a request that is not streamed (`stream` false, null or absent)
//! is refused as OpenAI's API refuses it: 400 `invalid_request_error`, before the agent
//! is asked.
//!
//! `usage`, streamed or not, is the agent's turn's real token usage as its model
//! reported it ([`troupe_agent::AgentReply::usage`]: the turn's model calls summed, the
//! turns of agents it called not included; zero for a model that reports none).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::OwnedSemaphorePermit;
use tracing::Instrument as _;

use troupe_agent::{AgentCallError, AgentReply, AskOptions};
use troupe_core::TraceId;

use crate::agents::{check_text, known};
use crate::error::{ApiError, OpenAiJson};
use crate::limits::{
    OPENAI_CHOICES_MAX, OPENAI_ERROR_BODY_MAX_BYTES, OPENAI_STREAM_HEADERS_WAIT_MS, OPENAI_STREAM_KEEP_ALIVE_MS,
};
use crate::server::AppState;

/// One message of a chat-completions request; other fields (name, tool_calls, ...) are
/// ignored. A null or absent `content` (OpenAI's assistant messages with tool calls) is
/// `Value::Null`: refused only on the last user message, the one sent to the agent.
#[derive(Debug, Deserialize)]
pub(crate) struct ChatMessageBody {
    role: String,
    #[serde(default)]
    content: Value,
}

/// A chat-completions request; fields other than these (temperature, max_tokens, user,
/// ...) are ignored, whatever their value, null included.
///
/// OpenAI types every optional field as nullable: null is the field absent. `stream` is
/// an `Option` for that (null or absent: not streamed); a `bool` with a default refused
/// null as 422 `invalid_body`, and clients other than OpenAI's Python one send nulls.
#[derive(Debug, Deserialize)]
pub(crate) struct ChatCompletionBody {
    model: String,
    messages: Vec<ChatMessageBody>,
    #[serde(default)]
    stream: Option<bool>,
    /// Only with `"stream": true` (a plain answer always has its `usage`): a non-null
    /// value on a request that is not streamed is refused, as OpenAI refuses it.
    #[serde(default)]
    stream_options: Option<StreamOptionsBody>,
    /// How many choices: only [`OPENAI_CHOICES_MAX`] (null or absent: one); another
    /// value is refused (`check_choices`).
    #[serde(default)]
    n: Option<i64>,
}

/// A chat-completions request's `stream_options`; null fields are absent.
#[derive(Debug, Deserialize)]
pub(crate) struct StreamOptionsBody {
    /// Whether a streamed answer ends with a chunk carrying the turn's token usage.
    #[serde(default)]
    include_usage: Option<bool>,
}

/// The text of a message's `content`: a string, or the `text` parts of an array.
fn content_text(content: &Value) -> Result<String, ApiError> {
    match content {
        Value::String(text) => Ok(text.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for part in parts {
                match (part["type"].as_str(), part["text"].as_str()) {
                    (Some("text"), Some(piece)) => text.push_str(piece),
                    _ => {
                        return Err(ApiError::unprocessable(
                            "unsupported_content",
                            "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported",
                        ))
                    }
                }
            }
            Ok(text)
        }
        _ => Err(ApiError::unprocessable(
            "unsupported_content",
            "a message's content must be a string or an array of text parts",
        )),
    }
}

/// Whether `route` (a matched route's template) is one of the OpenAI-compatible routes,
/// whose every error is in OpenAI's shape ([`in_openai_shape`]).
pub(crate) fn is_route(route: &str) -> bool {
    matches!(route, "/v1/chat/completions" | "/v1/models" | "/v1/models/{model}")
}

/// An error answered on an OpenAI-compatible route in OpenAI's shape: one made before
/// the route's code ran (401 `unauthorized`, 503 `overloaded`, 413 `body_too_large`, 408
/// `body_timeout`, ...) is in the REST routes' shape `{"error": {"code", "message"}}`;
/// it gets `type` (`invalid_request_error` for a 4xx, `server_error` for a 5xx) and
/// `param` (null), its status and headers (`Retry-After`, `WWW-Authenticate`) kept. One
/// with a `type` already, or that is not such a JSON body, is left as it is. Until
/// 2026-12-06 those errors had neither `type` nor `param` on these routes.
pub(crate) async fn in_openai_shape(response: Response) -> Response {
    let (mut parts, body) = response.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, OPENAI_ERROR_BODY_MAX_BYTES).await else {
        // Longer than any error body this server makes: not one of them.
        return ApiError::internal("an error body longer than OPENAI_ERROR_BODY_MAX_BYTES")
            .openai()
            .into_response();
    };
    let reshaped = serde_json::from_slice::<Value>(&bytes).ok().and_then(|mut body| {
        let error = body.get_mut("error")?.as_object_mut()?;
        if error.contains_key("type") || !error.contains_key("code") {
            return None;
        }
        let kind = if parts.status.is_client_error() {
            "invalid_request_error"
        } else {
            "server_error"
        };
        error.insert("type".to_string(), json!(kind));
        error.insert("param".to_string(), Value::Null);
        // As `ApiError::openai`: an invalid request is 400 in OpenAI's API.
        if parts.status == axum::http::StatusCode::UNPROCESSABLE_ENTITY {
            parts.status = axum::http::StatusCode::BAD_REQUEST;
        }
        serde_json::to_vec(&body).ok()
    });
    match reshaped {
        Some(reshaped) => {
            parts.headers.remove(axum::http::header::CONTENT_LENGTH);
            Response::from_parts(parts, axum::body::Body::from(reshaped))
        }
        None => Response::from_parts(parts, axum::body::Body::from(bytes)),
    }
}

/// `POST /v1/chat/completions`.
pub(crate) async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    OpenAiJson(body): OpenAiJson<ChatCompletionBody>,
) -> Result<Response, ApiError> {
    let trace = crate::agents::request_trace(&state, &headers);
    let result = completion(&state, body, trace).await.map_err(ApiError::openai);
    Ok(crate::agents::with_trace(result, trace))
}

/// `n` other than [`OPENAI_CHOICES_MAX`] refused, 400 `invalid_request_error` with
/// `param: "n"`, before the agent is asked. Until 2026-12-06 it was ignored, and a client
/// asking for 3 choices got 1 without a word.
fn check_choices(body: &ChatCompletionBody) -> Result<(), ApiError> {
    match body.n {
        None => Ok(()),
        Some(n) if u64::try_from(n) == Ok(OPENAI_CHOICES_MAX) => Ok(()),
        Some(n) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            format!(
                "n is {n}: this server answers {OPENAI_CHOICES_MAX} choice per request (OPENAI_CHOICES_MAX), as \
                 each choice is a turn of the agent, which changes its state; send n: 1 or leave n out, and send \
                 several requests for several answers"
            ),
        )
        .param("n")),
    }
}

/// The one request field combination refused before anything else: `stream_options`
/// (not null) on a request that is not streamed. OpenAI's API answers it 400
/// `invalid_request_error` with this message (and `param: "stream_options"`); silently
/// ignoring it hid a client's mistake.
fn check_stream_options(body: &ChatCompletionBody) -> Result<(), ApiError> {
    if body.stream_options.is_some() && !body.stream.unwrap_or(false) {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "The 'stream_options' parameter is only allowed when 'stream' is enabled: send \"stream\": true, \
             or leave stream_options out (or null)",
        )
        .param("stream_options"));
    }
    Ok(())
}

async fn completion(state: &Arc<AppState>, body: ChatCompletionBody, trace: TraceId) -> Result<Response, ApiError> {
    check_stream_options(&body)?;
    check_choices(&body)?;
    known(state, &body.model)
        .await
        .map_err(|_| model_not_found(&body.model))?;
    let Some(last_user) = body.messages.iter().rev().find(|message| message.role == "user") else {
        return Err(ApiError::unprocessable(
            "no_user_message",
            "messages has no message with role \"user\"; the last one is sent to the agent",
        )
        .param("messages"));
    };
    // The last user message is the one refused: its content names no other field.
    let text = content_text(&last_user.content).map_err(|error| error.param("messages"))?;
    check_text(&text).map_err(|error| error.param("messages"))?;
    let streamed = body.stream.unwrap_or(false);
    // Taken before the turn starts: a stream over the limit starts nothing. Held by the
    // turn's wait (this future), then by the body.
    let slot = if streamed {
        Some(crate::server::stream_slot(state).map_err(ApiError::overloaded)?)
    } else {
        None
    };
    // When the completion was created, in Unix seconds, as OpenAI's `created`: the
    // runtime's clock, anchored on the wall clock, read as the turn is asked for.
    let created = state.client.runtime().now().as_micros() / 1_000_000;
    let timeout = Duration::from_millis(troupe_agent::limits::AGENT_ASK_TIMEOUT_MS_DEFAULT);
    let options = AskOptions::default().timeout(timeout).traced(trace);
    let next_id = || format!("chatcmpl-troupe-{}", state.completions.fetch_add(1, Ordering::Relaxed));
    let Some(slot) = slot else {
        let reply = state.client.ask_with(&body.model, &text, options).await?;
        return Ok(Json(json!({
            "id": next_id(),
            "object": "chat.completion",
            "created": created,
            "model": body.model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": reply.text},
                "finish_reason": finish_reason(&reply),
            }],
            "usage": usage(&reply),
        }))
        .into_response());
    };
    let include_usage = body
        .stream_options
        .as_ref()
        .and_then(|options| options.include_usage)
        .unwrap_or(false);
    let chunks = Chunks {
        id: next_id(),
        created,
        model: body.model.clone(),
        include_usage,
    };
    // The turn: polled here for a short while, then by the response body, which drops
    // it (and so cancels the turn) if its client goes away first. Instrumented with the
    // request's span, so that the turn's spans stay under it whoever polls it.
    let client = state.client.clone();
    let mut turn: Turn = Box::pin(
        async move { client.ask_with(&body.model, &text, options).await }.instrument(tracing::Span::current()),
    );
    // Within the request's timeout, with room to answer.
    let wait = Duration::from_millis(OPENAI_STREAM_HEADERS_WAIT_MS).min(state.config.request_timeout / 2);
    match tokio::time::timeout(wait, &mut turn).await {
        // Known at once (a full mailbox, a refusal, shutdown, ...) or a turn this short:
        // as without streaming, an error keeps its HTTP status.
        Ok(Err(error)) => Err(error.into()),
        Ok(Ok(reply)) => Ok(streamed_answer(chunks, Ended(Ok(reply)), slot)),
        Err(_) => Ok(streamed_answer(chunks, Running(turn), slot)),
    }
}

/// A turn being asked for, boxed so that the response body can go on polling it.
type Turn = Pin<Box<dyn Future<Output = Result<AgentReply, AgentCallError>> + Send>>;

/// Where a streamed completion's turn stands when its headers go out.
enum TurnState {
    /// Still running: the body polls it.
    Running(Turn),
    /// Ended, with this result, not yet sent.
    Ended(Result<AgentReply, AgentCallError>),
    /// Its end is sent (or queued to be).
    Over,
}
use TurnState::{Ended, Over, Running};

/// OpenAI's `finish_reason` for `reply`.
fn finish_reason(reply: &AgentReply) -> &'static str {
    if reply.truncated {
        "length"
    } else {
        "stop"
    }
}

/// OpenAI's `usage` for `reply`.
fn usage(reply: &AgentReply) -> Value {
    json!({
        "prompt_tokens": reply.usage.prompt_tokens,
        "completion_tokens": reply.usage.completion_tokens,
        "total_tokens": reply.usage.total_tokens,
    })
}

/// Makes one streamed completion's `chat.completion.chunk` events.
struct Chunks {
    id: String,
    created: u64,
    model: String,
    /// Whether the chunks carry `usage` (null but on the last one) and a usage chunk
    /// ends them (`stream_options.include_usage`).
    include_usage: bool,
}

impl Chunks {
    fn chunk(&self, choices: Value, usage: Option<Value>) -> Event {
        let mut chunk = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if self.include_usage {
            chunk["usage"] = usage.unwrap_or(Value::Null);
        }
        Event::default().data(chunk.to_string())
    }

    fn choice(&self, delta: Value, finish: Option<&str>) -> Event {
        self.chunk(json!([{"index": 0, "delta": delta, "finish_reason": finish}]), None)
    }

    /// The first chunk: the role, with empty content (as OpenAI's).
    fn role(&self) -> Event {
        self.choice(json!({"role": "assistant", "content": ""}), None)
    }

    /// What follows the role chunk once the turn has ended with `result`: the reply's
    /// text, the finish, the usage if asked for, `[DONE]`; or, for an error, one event
    /// whose JSON is the route's HTTP error body (OpenAI's clients raise it: the Python
    /// package's `APIError`), and then the stream ends, without `[DONE]`.
    fn end(&self, result: Result<AgentReply, AgentCallError>) -> Vec<Event> {
        let reply = match result {
            Ok(reply) => reply,
            Err(error) => {
                // `ApiError`'s body, as `IntoResponse` makes it for this route.
                let body = ApiError::from(error).openai().body();
                return vec![Event::default().data(body.to_string())];
            }
        };
        let mut events = vec![
            self.choice(json!({"content": reply.text}), None),
            self.choice(json!({}), Some(finish_reason(&reply))),
        ];
        if self.include_usage {
            events.push(self.chunk(json!([]), Some(usage(&reply))));
        }
        events.push(Event::default().data("[DONE]"));
        events
    }
}

/// A streamed completion's SSE answer: the role chunk at once, then keep-alive comments
/// every [`OPENAI_STREAM_KEEP_ALIVE_MS`] while the turn runs, then its end
/// ([`Chunks::end`]). The body holds the turn and the stream's `slot`: both go when the
/// body ends or is dropped (its client went away), which cancels a turn still running.
fn streamed_answer(chunks: Chunks, turn: TurnState, slot: OwnedSemaphorePermit) -> Response {
    let ready = VecDeque::from([chunks.role()]);
    let answer = StreamedAnswer {
        chunks,
        turn,
        ready,
        _slot: slot,
    };
    let stream = futures::stream::unfold(answer, |mut answer| async move {
        let event = answer.next().await?;
        Some((Ok::<_, Infallible>(event), answer))
    });
    let keep_alive = KeepAlive::new().interval(Duration::from_millis(OPENAI_STREAM_KEEP_ALIVE_MS));
    Sse::new(stream).keep_alive(keep_alive).into_response()
}

/// The state of a streamed completion's body.
struct StreamedAnswer {
    chunks: Chunks,
    turn: TurnState,
    /// Events to send before anything else.
    ready: VecDeque<Event>,
    /// The stream's slot among the open streams (`server::stream_slot`).
    _slot: OwnedSemaphorePermit,
}

impl StreamedAnswer {
    /// The next event; `None` at the stream's end.
    async fn next(&mut self) -> Option<Event> {
        if self.ready.is_empty() {
            let result = match std::mem::replace(&mut self.turn, Over) {
                Running(turn) => turn.await,
                Ended(result) => result,
                Over => return None,
            };
            self.ready.extend(self.chunks.end(result));
        }
        self.ready.pop_front()
    }
}

/// 404 `model_not_found` for `model`, in OpenAI's shape (`param: "model"`).
fn model_not_found(model: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "model_not_found",
        format!("no agent {model:?}: the model is an agent id; GET /v1/models lists them"),
    )
    .param("model")
    .openai()
}

/// One agent as an OpenAI model: `created` is when it was defined, in Unix seconds (0
/// if not known: a definition stored by an older Troupe).
fn model(spec: &troupe_agent::AgentSpec) -> Value {
    let created = spec.defined_at_us().map_or(0, |at| at / 1_000_000);
    json!({"id": spec.id, "object": "model", "created": created, "owned_by": "troupe"})
}

/// `GET /v1/models/{model}`: OpenAI's "retrieve model", the agent `model` as one entry
/// of `GET /v1/models`; 404 `model_not_found` in OpenAI's error shape for an unknown one.
/// Until 2026-12-06 the route did not exist (404 `route_not_found`).
pub(crate) async fn retrieve_model(
    State(state): State<Arc<AppState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Json<Value>, ApiError> {
    let spec = known(&state, &id).await.map_err(|_| model_not_found(&id))?;
    Ok(Json(model(&spec)))
}

/// `GET /v1/models`: every agent as a model; `created` is when it was defined, in Unix
/// seconds (0 if not known: a definition stored by an older Troupe).
pub(crate) async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    let data: Vec<Value> = state
        .client
        .current_directory()
        .await
        .list()
        .iter()
        .map(model)
        .collect();
    Json(json!({"object": "list", "data": data}))
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use futures::StreamExt as _;
    use tokio::sync::{oneshot, Semaphore};
    use troupe_agent::{Spend, TokenUsage};

    use super::*;

    fn chunks(include_usage: bool) -> Chunks {
        Chunks {
            id: "chatcmpl-troupe-7".to_string(),
            created: 1_700_000_000,
            model: "a".to_string(),
            include_usage,
        }
    }

    fn reply(text: &str) -> AgentReply {
        AgentReply {
            text: text.to_string(),
            truncated: false,
            steps: 1,
            usage: TokenUsage {
                prompt_tokens: 3,
                completion_tokens: 2,
                total_tokens: 5,
            },
            spent: Spend::default(),
            exhausted: None,
        }
    }

    /// The body's next frame, as text; `None` at its end.
    async fn next_frame(body: &mut axum::body::BodyDataStream) -> Option<String> {
        let frame = body.next().await?.expect("the body reads");
        Some(String::from_utf8(frame.to_vec()).unwrap())
    }

    /// The JSON of one `data:` frame.
    fn data(frame: &str) -> Value {
        let data = frame
            .strip_prefix("data: ")
            .and_then(|rest| rest.strip_suffix("\n\n"))
            .unwrap_or_else(|| panic!("not one data event: {frame:?}"));
        serde_json::from_str(data).unwrap()
    }

    /// Goal: while the turn runs the stream sends the role chunk at once, then a
    /// keep-alive comment every `OPENAI_STREAM_KEEP_ALIVE_MS` and nothing else; when the
    /// turn ends, its content, finish, usage (asked for) and `[DONE]`, and the body ends
    /// and frees its slot. Method: paused time (it advances when everything waits); the
    /// turn is a channel the test answers.
    #[tokio::test(start_paused = true)]
    async fn a_running_turn_sends_the_role_then_keep_alives_then_its_end() {
        let slots = Arc::new(Semaphore::new(1));
        let slot = Arc::clone(&slots).try_acquire_owned().unwrap();
        let (answer, answered) = oneshot::channel();
        let turn: Turn = Box::pin(async move { answered.await.unwrap() });
        let response = streamed_answer(chunks(true), Running(turn), slot);
        assert_eq!(response.headers()["content-type"], "text/event-stream");
        let mut body = Body::into_data_stream(response.into_body());

        let started = tokio::time::Instant::now();
        let role = data(&next_frame(&mut body).await.unwrap());
        assert_eq!(started.elapsed(), Duration::ZERO, "the role chunk at once");
        assert_eq!(
            role,
            json!({"id": "chatcmpl-troupe-7", "object": "chat.completion.chunk", "created": 1_700_000_000,
                   "model": "a", "usage": null,
                   "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]})
        );
        for n in 1..=2 {
            let frame = next_frame(&mut body).await.unwrap();
            assert!(
                frame.starts_with(':') && frame.ends_with("\n\n"),
                "a comment: {frame:?}"
            );
            assert_eq!(
                started.elapsed(),
                Duration::from_millis(n * OPENAI_STREAM_KEEP_ALIVE_MS),
                "keep-alive {n}"
            );
        }
        assert_eq!(slots.available_permits(), 0, "the running stream holds its slot");

        answer.send(Ok(reply("done"))).unwrap();
        let content = data(&next_frame(&mut body).await.unwrap());
        assert_eq!(content["choices"][0]["delta"], json!({"content": "done"}));
        let finish = data(&next_frame(&mut body).await.unwrap());
        assert_eq!(finish["choices"][0]["finish_reason"], "stop");
        let usage = data(&next_frame(&mut body).await.unwrap());
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(
            usage["usage"],
            json!({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5})
        );
        assert_eq!(next_frame(&mut body).await.as_deref(), Some("data: [DONE]\n\n"));
        assert_eq!(next_frame(&mut body).await, None);
        drop(body);
        assert_eq!(slots.available_permits(), 1, "the ended stream's slot is free");
    }

    /// Goal: a turn that fails after the headers ends the stream with one event, the
    /// route's error body (as `ApiError` answers it over HTTP), and no `[DONE]`.
    #[tokio::test(start_paused = true)]
    async fn a_turn_failing_after_the_headers_ends_the_stream_with_the_error_body() {
        let slots = Arc::new(Semaphore::new(1));
        let slot = Arc::clone(&slots).try_acquire_owned().unwrap();
        let error = AgentCallError::Invoke(troupe_core::InvokeError::Shutdown);
        let http = ApiError::from(error.clone());
        let turn: Turn = Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(1)).await;
            Err(error)
        });
        let mut body = Body::into_data_stream(streamed_answer(chunks(false), Running(turn), slot).into_body());
        let role = data(&next_frame(&mut body).await.unwrap());
        assert!(role.get("usage").is_none(), "usage not asked for: {role}");
        let failed = data(&next_frame(&mut body).await.unwrap());
        // The route's HTTP error body, in OpenAI's shape (`type` and `param` since
        // 2026-12-06).
        assert_eq!(
            failed,
            json!({"error": {"code": http.code, "message": http.message, "type": "server_error", "param": null}})
        );
        assert_eq!(failed["error"]["code"], "shutting_down");
        assert_eq!(next_frame(&mut body).await, None, "no [DONE] after an error");
        drop(body);
        assert_eq!(slots.available_permits(), 1);
    }
}
