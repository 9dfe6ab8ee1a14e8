//! A message's turn streamed over SSE: the events of the call tree the message starts
//! (`call_started`, `turn_started`, `model_responded`, `tool_finished`, `call_finished`,
//! `turn_ended`, ... as in `GET /v1/events`), then one `reply` event with the reply's
//! JSON, or one `error` event with the error shape and its HTTP `status`; then the
//! stream ends. It holds one of the server's `streams_open_max` stream slots until then
//! (or until its client goes away).
//!
//! The tree's root is the first call from outside to the agent after the request
//! subscribed: if other clients message the same agent at the same instant, the stream
//! may follow their call instead of its own (the final `reply` is always its own).
//! `tool_finished` carries no call id: it is included for every agent in the tree. The
//! turn runs to its end even if the client goes away.

use std::collections::{HashSet, VecDeque};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use tokio::sync::broadcast::error::{RecvError, TryRecvError};
use tokio::sync::{broadcast, oneshot, OwnedSemaphorePermit};
use troupe_agent::{agent_id, AgentCallError, AgentEvent, AgentReply, AskOptions};
use troupe_core::{ActorId, TraceId};

use crate::agents::reply_json;
use crate::error::ApiError;
use crate::events::{sse_event, sse_lagged};
use crate::server::AppState;

type AskResult = Result<AgentReply, AgentCallError>;

/// Starts the turn in a task of its own and streams it.
pub(crate) fn streamed_turn(
    state: &Arc<AppState>,
    agent: String,
    text: String,
    timeout: Duration,
    trace: TraceId,
    slot: OwnedSemaphorePermit,
) -> Response {
    let events = state.client.subscribe();
    let (sender, reply) = oneshot::channel();
    let client = state.client.clone();
    let asked = agent.clone();
    tokio::spawn(async move {
        let options = AskOptions::default().timeout(timeout).traced(trace);
        let result = client.ask_with(&asked, &text, options).await;
        let _ = sender.send(result);
    });
    let Ok(target) = agent_id(&agent) else {
        return ApiError::bad_request(format!("agent id {agent:?} is not valid")).into_response();
    };
    let follower = TurnFollower {
        agent,
        target,
        events,
        reply: Some(reply),
        root: None,
        calls: HashSet::new(),
        agents: HashSet::new(),
        ready: VecDeque::new(),
        _slot: slot,
    };
    let stream = futures::stream::unfold(follower, |mut follower| async move {
        let event = follower.next().await?;
        Some((Ok::<_, Infallible>(event), follower))
    });
    Sse::new(stream).keep_alive(KeepAlive::default()).into_response()
}

struct TurnFollower {
    agent: String,
    target: ActorId,
    events: broadcast::Receiver<AgentEvent>,
    /// `None` once the reply has been queued in `ready`.
    reply: Option<oneshot::Receiver<AskResult>>,
    root: Option<u64>,
    calls: HashSet<u64>,
    agents: HashSet<ActorId>,
    ready: VecDeque<Event>,
    /// The stream's slot among the open streams (`server::stream_slot`): freed when the
    /// stream ends or its client goes away, both of which drop it.
    _slot: OwnedSemaphorePermit,
}

impl TurnFollower {
    async fn next(&mut self) -> Option<Event> {
        loop {
            if let Some(event) = self.ready.pop_front() {
                return Some(event);
            }
            let reply = self.reply.as_mut()?;
            tokio::select! {
                biased;
                result = reply => {
                    // Every event of the turn was broadcast before its reply: take them.
                    loop {
                        match self.events.try_recv() {
                            Ok(event) => self.keep(&event),
                            Err(TryRecvError::Lagged(missed)) => self.ready.push_back(sse_lagged(missed)),
                            Err(_) => break,
                        }
                    }
                    self.ready.push_back(self.final_event(result));
                    self.reply = None;
                }
                received = self.events.recv() => match received {
                    Ok(event) => self.keep(&event),
                    Err(RecvError::Lagged(missed)) => self.ready.push_back(sse_lagged(missed)),
                    // The system is gone; the reply (an error) follows.
                    Err(RecvError::Closed) => {}
                },
            }
        }
    }

    fn final_event(&self, result: Result<AskResult, oneshot::error::RecvError>) -> Event {
        match result {
            Ok(Ok(reply)) => Event::default()
                .event("reply")
                .data(reply_json(&self.agent, &reply).to_string()),
            Ok(Err(error)) => error_event(&crate::agents::timed_out_says_what_to_do(ApiError::from(error), true)),
            Err(_) => error_event(&ApiError::internal("the turn's task ended without a reply")),
        }
    }

    /// Queues `event` if it belongs to the followed call tree.
    fn keep(&mut self, event: &AgentEvent) {
        let belongs = match event {
            AgentEvent::CallStarted {
                call, parent, target, ..
            } => {
                let starts_tree = parent.is_none() && self.root.is_none() && *target == self.target;
                let in_tree = starts_tree || parent.is_some_and(|parent| self.calls.contains(&parent));
                if starts_tree {
                    self.root = Some(*call);
                }
                if in_tree {
                    self.calls.insert(*call);
                    self.agents.insert(target.clone());
                }
                in_tree
            }
            AgentEvent::CallFinished { call, .. } => self.calls.contains(call),
            AgentEvent::TurnStarted { call, .. }
            | AgentEvent::ModelResponded { call, .. }
            | AgentEvent::TurnEnded { call, .. } => call.is_some_and(|call| self.calls.contains(&call)),
            AgentEvent::ToolFinished { agent, .. } => self.agents.contains(agent),
            AgentEvent::DelegationStarted { from, .. } => self.agents.contains(from),
            _ => false,
        };
        if belongs {
            self.ready.push_back(sse_event(event));
        }
    }
}

fn error_event(error: &ApiError) -> Event {
    Event::default().event("error").data(
        json!({"status": error.status.as_u16(), "error": {"code": error.code, "message": error.message}}).to_string(),
    )
}
