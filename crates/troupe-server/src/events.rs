//! [`AgentEvent`]s as JSON, and `GET /v1/events`: every event as it happens, over SSE.
//!
//! Each SSE message has the event's `type` as its SSE `event:` name and the JSON of
//! [`event_json`] as its data. A subscriber that falls behind the broadcast
//! ([`troupe_agent::limits::AGENT_EVENT_STREAM_CAPACITY`] events) gets one `lagged`
//! message with the number missed and continues; agents are never slowed by a reader.
//! At most [`SERVER_EVENT_STREAMS_MAX`] streams are open at once; the streams end when
//! the server shuts down.

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::Stream;
use serde_json::{json, Value};
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::{broadcast, watch, OwnedSemaphorePermit};
use troupe_agent::{AgentEvent, CallOutcome};

use crate::error::ApiError;
use crate::limits::SERVER_EVENT_STREAMS_MAX;
use crate::server::AppState;

/// `event` as a JSON object: `type` (snake_case variant name), its fields, agents and
/// actors as their ids (`agent/NAME`), times `at_us` in microseconds since the Unix
/// epoch on the runtime's clock (anchored on the wall clock when the runtime started,
/// monotonic from there).
pub fn event_json(event: &AgentEvent) -> Value {
    match event {
        AgentEvent::MessageSent {
            msg_id,
            from,
            to,
            kind,
            at,
        } => json!({"type": "message_sent", "msg_id": msg_id, "from": from.as_ref().map(ToString::to_string),
                    "to": to.to_string(), "kind": format!("{kind:?}"), "at_us": at.as_micros()}),
        AgentEvent::MessageReceived {
            msg_id,
            agent,
            kind,
            duplicate,
            at,
        } => json!({"type": "message_received", "msg_id": msg_id, "agent": agent.to_string(),
                    "kind": format!("{kind:?}"), "duplicate": duplicate, "at_us": at.as_micros()}),
        AgentEvent::DelegationStarted { task_id, from, to, at } => {
            json!({"type": "delegation_started", "task_id": task_id, "from": from.to_string(),
                   "to": to.to_string(), "at_us": at.as_micros()})
        }
        AgentEvent::DelegationFinished {
            task_id,
            from,
            to,
            state,
            at,
        } => json!({"type": "delegation_finished", "task_id": task_id, "from": from.to_string(),
                    "to": to.to_string(), "state": state.as_str(), "at_us": at.as_micros()}),
        AgentEvent::CallStarted {
            call,
            parent,
            caller,
            target,
            depth,
            at,
        } => json!({"type": "call_started", "call": call, "parent": parent,
                    "caller": caller.as_ref().map(ToString::to_string), "target": target.to_string(),
                    "depth": depth, "at_us": at.as_micros()}),
        AgentEvent::CallFinished { call, outcome, at } => {
            let detail = match outcome {
                CallOutcome::Replied { bytes } => json!({"bytes": bytes}),
                CallOutcome::Refused(refused) => json!({"cause": refused.to_string()}),
                CallOutcome::Failed(error) => json!({"cause": error.to_string()}),
                CallOutcome::Other { cause } => json!({"cause": cause}),
                CallOutcome::SentAsTask { task_id } => json!({"task_id": task_id}),
                CallOutcome::Cancelled => json!({}),
                CallOutcome::NotPermitted(refused) => json!({"cause": refused.to_string()}),
            };
            json!({"type": "call_finished", "call": call, "outcome": outcome.label(), "detail": detail,
                   "at_us": at.as_micros()})
        }
        AgentEvent::TurnStarted {
            agent,
            call,
            depth,
            chain,
            deadline,
            trace_id,
            at,
        } => json!({"type": "turn_started", "agent": agent.to_string(), "call": call, "depth": depth,
                    "chain": chain.iter().map(ToString::to_string).collect::<Vec<_>>(),
                    "deadline_us": deadline.as_micros(), "trace_id": trace_id.map(|trace| trace.to_string()),
                    "at_us": at.as_micros()}),
        AgentEvent::ModelResponded {
            agent,
            call,
            step,
            usage,
            tool_calls,
            tool_calls_dropped,
            at,
        } => json!({"type": "model_responded", "agent": agent.to_string(), "call": call, "step": step,
                    "usage": usage, "tool_calls": tool_calls, "tool_calls_dropped": tool_calls_dropped,
                    "at_us": at.as_micros()}),
        AgentEvent::ToolFinished { agent, tool, ok, at } => {
            json!({"type": "tool_finished", "agent": agent.to_string(), "tool": tool, "ok": ok,
                   "at_us": at.as_micros()})
        }
        AgentEvent::TurnEnded {
            agent,
            call,
            ok,
            steps,
            usage,
            at,
        } => json!({"type": "turn_ended", "agent": agent.to_string(), "call": call, "ok": ok,
                    "steps": steps, "usage": usage, "at_us": at.as_micros()}),
        AgentEvent::Activated { agent, at } => {
            json!({"type": "activated", "agent": agent.to_string(), "at_us": at.as_micros()})
        }
        AgentEvent::Deactivated { agent, at } => {
            json!({"type": "deactivated", "agent": agent.to_string(), "at_us": at.as_micros()})
        }
        AgentEvent::ContactDecided {
            from,
            to,
            kind,
            org_version,
            permitted,
            at,
        } => json!({"type": "contact_decided", "from": from.to_string(), "to": to.to_string(), "kind": kind,
                    "org_version": org_version, "permitted": permitted, "at_us": at.as_micros()}),
        AgentEvent::ApprovalRequested { id, from, to, kind, at } => {
            json!({"type": "approval_requested", "id": id, "from": from.to_string(), "to": to.to_string(),
                   "kind": kind, "at_us": at.as_micros()})
        }
        AgentEvent::ApprovalResolved { approval, at } => {
            // As the other events name agents: their actor ids (`agent/NAME`).
            let actor = |key: &str| troupe_agent::agent_id(key).map_or_else(|_| key.to_string(), |id| id.to_string());
            json!({"type": "approval_resolved", "id": approval.id, "from": actor(&approval.from),
                   "to": actor(&approval.to),
                   "kind": approval.kind, "state": approval.state, "at_us": at.as_micros()})
        }
        AgentEvent::OrgChanged { version, at } => {
            json!({"type": "org_changed", "version": version, "at_us": at.as_micros()})
        }
        other => json!({"type": "other", "debug": format!("{other:?}")}),
    }
}

/// One SSE message for `event`.
pub(crate) fn sse_event(event: &AgentEvent) -> Event {
    let value = event_json(event);
    let name = value["type"].as_str().unwrap_or("other").to_string();
    Event::default().event(name).data(value.to_string())
}

/// The SSE message that tells a reader it missed `missed` events.
pub(crate) fn sse_lagged(missed: u64) -> Event {
    Event::default()
        .event("lagged")
        .data(json!({"type": "lagged", "missed": missed}).to_string())
}

/// `GET /v1/events`.
pub(crate) async fn events(State(state): State<Arc<AppState>>) -> Response {
    let Ok(permit) = Arc::clone(&state.event_streams).try_acquire_owned() else {
        return ApiError::overloaded(format!(
            "{SERVER_EVENT_STREAMS_MAX} event streams are open, the most at once; close one or retry later"
        ))
        .into_response();
    };
    let stream = event_stream(state.client.subscribe(), state.shutdown.subscribe(), permit);
    Sse::new(stream).keep_alive(KeepAlive::default()).into_response()
}

#[allow(
    clippy::disallowed_methods,
    reason = "this crate is empty under the simulator (lib.rs), so its watch waiters' order cannot touch seed replay"
)]
fn event_stream(
    events: broadcast::Receiver<AgentEvent>,
    shutdown: watch::Receiver<bool>,
    permit: OwnedSemaphorePermit,
) -> impl Stream<Item = Result<Event, Infallible>> {
    futures::stream::unfold(
        (events, shutdown, permit),
        |(mut events, mut shutdown, permit)| async move {
            if *shutdown.borrow() {
                return None;
            }
            let item = tokio::select! {
                biased;
                _ = shutdown.changed() => return None,
                received = events.recv() => match received {
                    Ok(event) => sse_event(&event),
                    Err(RecvError::Lagged(missed)) => sse_lagged(missed),
                    Err(RecvError::Closed) => return None,
                },
            };
            Some((Ok(item), (events, shutdown, permit)))
        },
    )
}

#[cfg(test)]
mod tests {
    use troupe_agent::agent_id;
    use troupe_core::Deadline;

    use super::*;

    /// Goal: a `model_responded` event's JSON (in `/v1/events` and a streamed message)
    /// shows the tool calls dropped past the step's limit beside those kept. Method: the
    /// JSON of an event whose model asked for 10,000 calls, 16 kept.
    #[test]
    fn model_responded_shows_the_tool_calls_kept_and_dropped() {
        let event = AgentEvent::ModelResponded {
            agent: agent_id("a").unwrap(),
            call: Some(7),
            step: 1,
            usage: None,
            tool_calls: 16,
            tool_calls_dropped: 9_984,
            at: Deadline::from_micros(5),
        };
        let json = event_json(&event);
        assert_eq!(json["type"], "model_responded", "{json}");
        assert_eq!(json["tool_calls"], 16, "{json}");
        assert_eq!(json["tool_calls_dropped"], 9_984, "{json}");
    }
}
