//! The OpenAI-compatible routes, so any OpenAI client can talk to an agent:
//! `POST /v1/chat/completions` (the model is the agent id; the last user message is
//! sent to the agent, the rest of the conversation is ignored: the agent keeps its own)
//! and `GET /v1/models` (every agent as a model).
//!
//! With `"stream": true` the answer comes as OpenAI `chat.completion.chunk` SSE messages
//! once the agent's turn has ended: one with the role, one with the whole reply text,
//! one with `finish_reason: "stop"`, then `data: [DONE]`. The agent does not stream
//! tokens through the client API, so the text is one chunk. A streamed completion holds
//! one of the server's `streams_open_max` stream slots (`server::stream_slot`) from when
//! it is accepted (its request checked, before the agent is asked) until its body ends or
//! its client goes away (while the turn runs or while the body is sent); one over the
//! limit is refused at once, before the agent is asked, in this route's one error shape:
//! 503 `overloaded` with `Retry-After`. With
//! `"stream_options": {"include_usage": true}`, as OpenAI's: a last chunk before
//! `[DONE]` with empty `choices` and the turn's `usage`, every other chunk with
//! `"usage": null`. Errors before the answer keep their HTTP status and the one error
//! shape. `created` is when the turn was asked for, in Unix seconds, on the runtime's
//! clock (anchored on the wall clock when the runtime started); a model's `created` in
//! `/v1/models` is 0 (when an agent was made is not kept).
//!
//! `stream_options` on a request that is not streamed (`stream` false, null or absent)
//! is refused as OpenAI's API refuses it: 400 `invalid_request_error`, before the agent
//! is asked.
//!
//! `usage`, streamed or not, is the agent's turn's real token usage as its model
//! reported it ([`troupe_agent::AgentReply::usage`]: the turn's model calls summed, the
//! turns of agents it called not included; zero for a model that reports none).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use troupe_agent::AskOptions;
use troupe_core::TraceId;

use crate::agents::{check_text, known};
use crate::error::{ApiError, ApiJson};
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

/// `POST /v1/chat/completions`.
pub(crate) async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<ChatCompletionBody>,
) -> Result<Response, ApiError> {
    let trace = crate::agents::request_trace(&state, &headers);
    let result = completion(&state, body, trace).await;
    Ok(crate::agents::with_trace(result, trace))
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
        ));
    }
    Ok(())
}

async fn completion(state: &Arc<AppState>, body: ChatCompletionBody, trace: TraceId) -> Result<Response, ApiError> {
    check_stream_options(&body)?;
    known(state, &body.model).await.map_err(|_| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "model_not_found",
            format!(
                "no agent {:?}: the model is an agent id; GET /v1/models lists them",
                body.model
            ),
        )
    })?;
    let Some(last_user) = body.messages.iter().rev().find(|message| message.role == "user") else {
        return Err(ApiError::unprocessable(
            "no_user_message",
            "messages has no message with role \"user\"; the last one is sent to the agent",
        ));
    };
    let text = content_text(&last_user.content)?;
    check_text(&text)?;
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
    let reply = state.client.ask_with(&body.model, &text, options).await?;
    let id = format!("chatcmpl-troupe-{}", state.completions.fetch_add(1, Ordering::Relaxed));
    let finish_reason = if reply.truncated { "length" } else { "stop" };
    let usage = json!({
        "prompt_tokens": reply.usage.prompt_tokens,
        "completion_tokens": reply.usage.completion_tokens,
        "total_tokens": reply.usage.total_tokens,
    });
    if !streamed {
        return Ok(Json(json!({
            "id": id,
            "object": "chat.completion",
            "created": created,
            "model": body.model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": reply.text},
                "finish_reason": finish_reason,
            }],
            "usage": usage,
        }))
        .into_response());
    }
    let include_usage = body
        .stream_options
        .as_ref()
        .and_then(|options| options.include_usage)
        .unwrap_or(false);
    let chunk = |choices: Value, usage: Option<Value>| {
        let mut chunk = json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": body.model,
            "choices": choices,
        });
        if include_usage {
            chunk["usage"] = usage.unwrap_or(Value::Null);
        }
        Event::default().data(chunk.to_string())
    };
    let choice = |delta: Value, finish: Option<&str>| json!([{"index": 0, "delta": delta, "finish_reason": finish}]);
    let mut events = vec![
        chunk(choice(json!({"role": "assistant", "content": ""}), None), None),
        chunk(choice(json!({"content": reply.text}), None), None),
        chunk(choice(json!({}), Some(finish_reason)), None),
    ];
    if include_usage {
        events.push(chunk(json!([]), Some(usage)));
    }
    events.push(Event::default().data("[DONE]"));
    // The slot goes with the events: dropped once the last one is taken (the body's end)
    // or with the body, when its client goes away.
    let stream = futures::stream::unfold((events.into_iter(), slot), |(mut events, slot)| async move {
        let event = events.next()?;
        Some((Ok::<_, std::convert::Infallible>(event), (events, slot)))
    });
    Ok(Sse::new(stream).into_response())
}

/// `GET /v1/models`: every agent as a model.
pub(crate) async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    let data: Vec<Value> = state
        .client
        .directory()
        .list()
        .iter()
        .map(|spec| json!({"id": spec.id, "object": "model", "created": 0, "owned_by": "troupe"}))
        .collect();
    Json(json!({"object": "list", "data": data}))
}
