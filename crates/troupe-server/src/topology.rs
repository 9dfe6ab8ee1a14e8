//! The topology: `GET /v1/topology` (agents, links and live counts),
//! `GET /v1/topology/agents/{id}/call-tree` (the call tree of the last request that
//! touched an agent), and the page that draws them, `GET /` (also `/ui`) with its
//! script and style sheet.
//!
//! # What is counted, and since when
//! A task started with the router reads the agent event stream
//! ([`AgentClient::subscribe`]) and keeps, **since the server started**: per agent, calls
//! made and received, messages (notifications, tasks, task updates, cancellations) sent
//! and received, whether an activation is live and how many turns run; per ordered pair
//! of agents, the calls and messages that passed (an *observed* link); and the last
//! [`TOPOLOGY_CALLS_KEPT`] calls, from which call trees are built by their `parent`.
//! Nothing is read back from before the server started, so an agent active then shows
//! as inactive until its next activation. If the task falls behind the broadcast, the
//! events it missed are counted in `events_missed`. Every map is bounded (see
//! [`crate::limits`]).
//!
//! # Links
//! A link is an ordered pair of agents with `"source"`: `"configured"` (a link of the
//! organisation, [`AgentClient::links`], with its `direction`, `relationship` and
//! `enabled` under `"configured"`), `"observed"` (no configured link, but calls or
//! messages passed since the server started) or `"configured+observed"` (both).
//! [`links_json`] is the one place that joins them.
//!
//! # The page and the token
//! The page's three files are compiled into the binary (`include_str!`), written by
//! hand with no framework and nothing loaded from elsewhere, and served with a strict
//! `Content-Security-Policy` (only this origin's script, style and connections; no
//! inline script or style; no frames). They hold no data, so they are served without
//! the bearer token; everything they show comes from the API, which needs it. With a
//! token configured, the page asks for it once, keeps it in `sessionStorage` (gone when
//! the tab closes) and sends it as `Authorization: Bearer` on every request, the event
//! stream included: the page reads `/v1/events` with a streaming `fetch` instead of
//! `EventSource` (which cannot send headers), so the token never goes into a URL.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use axum::extract::{Path, State};
use axum::http::{header, HeaderValue, Method};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Json, Router};
use serde_json::{json, Value};
use tokio::sync::broadcast::error::RecvError;
use troupe_agent::{AgentClient, AgentEvent, CallOutcome, Link};
use troupe_core::{ActorId, CallRefused};

use crate::agents::known;
use crate::error::ApiError;
use crate::events::event_json;
use crate::limits::{
    TOPOLOGY_AGENTS_LISTED_MAX, TOPOLOGY_AGENTS_TRACKED_MAX, TOPOLOGY_CALLS_KEPT, TOPOLOGY_LAST_ROOTS_MAX,
    TOPOLOGY_LINKS_MAX,
};
use crate::server::AppState;

/// The page's HTML.
const PAGE_HTML: &str = include_str!("../assets/topology.html");
/// The page's script.
const PAGE_JS: &str = include_str!("../assets/topology.js");
/// The page's style sheet.
const PAGE_CSS: &str = include_str!("../assets/topology.css");

/// The `Content-Security-Policy` of the page and its files: nothing from elsewhere,
/// no inline script or style, no plugins, no frames, no form posts.
pub(crate) const PAGE_CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The paths of the page and its files (served without the bearer token).
const PAGE_PATHS: [&str; 4] = ["/", "/ui", "/ui/topology.js", "/ui/topology.css"];

/// Whether `method path` is the page or one of its files, which need no token: they
/// hold no data (everything shown comes from the API, which does).
pub(crate) fn is_page(method: &Method, path: &str) -> bool {
    *method == Method::GET && PAGE_PATHS.contains(&path)
}

/// The topology routes, with the observer of `client`'s events (started now if a tokio
/// runtime is running, else at the first request).
pub(crate) fn routes(client: &AgentClient) -> Router<Arc<AppState>> {
    let tracker = Arc::new(Tracker::new(client.clone()));
    tracker.start();
    Router::new()
        .route("/", get(page))
        .route("/ui", get(page))
        .route("/ui/topology.js", get(script))
        .route("/ui/topology.css", get(style))
        .route("/v1/topology", get(topology))
        .route("/v1/topology/agents/{id}/call-tree", get(call_tree))
        .layer(Extension(tracker))
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(PAGE_CSP));
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

async fn page() -> Response {
    asset("text/html; charset=utf-8", PAGE_HTML)
}

async fn script() -> Response {
    asset("text/javascript; charset=utf-8", PAGE_JS)
}

async fn style() -> Response {
    asset("text/css; charset=utf-8", PAGE_CSS)
}

/// `GET /v1/topology`.
async fn topology(State(state): State<Arc<AppState>>, Extension(tracker): Extension<Arc<Tracker>>) -> Response {
    tracker.start();
    let mut specs = state.client.current_directory().await.list();
    specs.sort_by(|a, b| a.id.cmp(&b.id));
    let truncated = specs.len() > TOPOLOGY_AGENTS_LISTED_MAX;
    specs.truncate(TOPOLOGY_AGENTS_LISTED_MAX);
    let mut pending = Vec::with_capacity(specs.len());
    for spec in &specs {
        // A store error leaves the counts out rather than failing the whole view.
        pending.push(state.client.pending(&spec.id).await.ok());
    }
    // A store error leaves the configured links out rather than failing the whole view.
    let configured = state.client.links().await.unwrap_or_default();
    let observed = tracker.observed.lock().expect("the topology lock is never poisoned");
    let agents: Vec<Value> = specs
        .iter()
        .zip(pending)
        .map(|(spec, pending)| {
            let seen = observed.agents.get(&spec.id).cloned().unwrap_or_default();
            json!({
                "id": spec.id,
                "name": spec.name,
                "description": spec.role,
                "active": seen.active,
                "turns_running": seen.turns_running(),
                "inbox": pending.map(|(inbox, _)| inbox),
                "outbox": pending.map(|(_, outbox)| outbox),
                "calls_made": seen.calls_made,
                "calls_received": seen.calls_received,
                "calls_from_outside": seen.calls_from_outside,
                "messages_sent": seen.messages_sent,
                "messages_received": seen.messages_received,
            })
        })
        .collect();
    Json(json!({
        "agents": agents,
        "agents_truncated": truncated,
        "links": links_json(&configured, &observed),
        "events_missed": observed.events_missed,
    }))
    .into_response()
}

/// What is known of one pair of agents: its configured link, its observed traffic.
type LinkSources<'a> = (Option<&'a Link>, Option<&'a LinkSeen>);

/// The links: the organisation's configured links and the pairs observed since the
/// server started, joined by `(from, to)`.
fn links_json(configured: &[Link], observed: &Observed) -> Vec<Value> {
    let mut pairs: BTreeMap<(&str, &str), LinkSources<'_>> = BTreeMap::new();
    for link in configured {
        pairs.entry((&link.from, &link.to)).or_default().0 = Some(link);
    }
    for ((from, to), seen) in &observed.links {
        pairs.entry((from, to)).or_default().1 = Some(seen);
    }
    pairs
        .into_iter()
        .map(|((from, to), (link, seen))| {
            let source = match (link, seen) {
                (Some(_), Some(_)) => "configured+observed",
                (Some(_), None) => "configured",
                _ => "observed",
            };
            let seen = seen.cloned().unwrap_or_default();
            json!({
                "from": from,
                "to": to,
                "source": source,
                "configured": link.map(|link| json!({
                    "direction": link.direction,
                    "relationship": link.relationship,
                    "enabled": link.enabled,
                })),
                "calls": seen.calls,
                "calls_refused": seen.refused,
                "messages": seen.messages,
                "last_at_us": seen.last_at_us,
            })
        })
        .collect()
}

/// `GET /v1/topology/agents/{id}/call-tree`: `{agent, root}`, `root` the tree of the
/// last request (a call from outside and everything it caused) that touched the agent,
/// or `null` if none was seen (or it is no longer kept).
async fn call_tree(
    State(state): State<Arc<AppState>>,
    Extension(tracker): Extension<Arc<Tracker>>,
    Path(agent): Path<String>,
) -> Result<Json<Value>, ApiError> {
    tracker.start();
    known(&state, &agent).await?;
    let observed = tracker.observed.lock().expect("the topology lock is never poisoned");
    let root = observed
        .last_root
        .get(&agent)
        .filter(|root| observed.calls.contains_key(root))
        .map(|root| observed.tree(*root));
    Ok(Json(json!({"agent": agent, "root": root})))
}

/// Reads the event stream into [`Observed`].
struct Tracker {
    client: AgentClient,
    started: AtomicBool,
    observed: Arc<Mutex<Observed>>,
}

impl Tracker {
    fn new(client: AgentClient) -> Self {
        Self {
            client,
            started: AtomicBool::new(false),
            observed: Arc::new(Mutex::new(Observed::default())),
        }
    }

    /// Starts the reading task once, if a tokio runtime is running. It ends when the
    /// event stream closes or the routes are dropped.
    fn start(&self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.started.swap(true, Ordering::AcqRel) {
            return;
        }
        let mut events = self.client.subscribe();
        let observed: Weak<Mutex<Observed>> = Arc::downgrade(&self.observed);
        runtime.spawn(async move {
            loop {
                let received = events.recv().await;
                let Some(observed) = observed.upgrade() else {
                    return;
                };
                let mut observed = observed.lock().expect("the topology lock is never poisoned");
                match received {
                    Ok(event) => observed.record(&event),
                    Err(RecvError::Lagged(missed)) => observed.events_missed += missed,
                    Err(RecvError::Closed) => return,
                }
            }
        });
    }
}

/// One agent's counts since the server started.
#[derive(Debug, Clone, Default)]
struct AgentSeen {
    active: bool,
    /// Calls whose turn on this agent has started and not ended.
    turns_on_calls: u32,
    /// Turns not serving a call (inbox turns) that have started and not ended.
    turns_other: u32,
    calls_made: u64,
    calls_received: u64,
    calls_from_outside: u64,
    messages_sent: u64,
    messages_received: u64,
}

impl AgentSeen {
    fn turns_running(&self) -> u32 {
        self.turns_on_calls + self.turns_other
    }

    /// Whether nothing was counted for this agent (what a call to an id that names no
    /// agent leaves once taken back).
    fn counts_nothing(&self) -> bool {
        !self.active
            && self.turns_running() == 0
            && self.calls_made == 0
            && self.calls_received == 0
            && self.calls_from_outside == 0
            && self.messages_sent == 0
            && self.messages_received == 0
    }
}

/// An observed link's counts.
#[derive(Debug, Clone, Default)]
struct LinkSeen {
    calls: u64,
    refused: u64,
    messages: u64,
    last_at_us: u64,
}

/// One kept call.
#[derive(Debug, Clone)]
struct CallSeen {
    parent: Option<u64>,
    root: u64,
    caller: Option<String>,
    target: String,
    depth: u32,
    started_us: u64,
    finished: Option<(u64, &'static str, Value)>,
    /// Whether the target's turn for this call started and has not ended.
    turn_running: bool,
    children: Vec<u64>,
}

/// What the event stream showed since the server started.
#[derive(Debug, Default)]
struct Observed {
    agents: HashMap<String, AgentSeen>,
    links: BTreeMap<(String, String), LinkSeen>,
    calls: HashMap<u64, CallSeen>,
    /// The kept calls, oldest first.
    order: VecDeque<u64>,
    /// Per agent, the root call of the last request that touched it (bounded:
    /// [`TOPOLOGY_LAST_ROOTS_MAX`]).
    last_root: HashMap<String, u64>,
    events_missed: u64,
}

/// An agent's name, or `None` for an actor that is not an agent.
fn agent_name(id: &ActorId) -> Option<String> {
    (id.kind().to_string() == "agent").then(|| id.key().to_string())
}

impl Observed {
    /// The counts of `agent`, or `None` once [`TOPOLOGY_AGENTS_TRACKED_MAX`] others are
    /// tracked.
    fn agent(&mut self, agent: &str) -> Option<&mut AgentSeen> {
        if !self.agents.contains_key(agent) && self.agents.len() >= TOPOLOGY_AGENTS_TRACKED_MAX {
            return None;
        }
        Some(self.agents.entry(agent.to_string()).or_default())
    }

    /// The counts of the link `from -> to`, or `None` once [`TOPOLOGY_LINKS_MAX`] others
    /// are tracked.
    fn link(&mut self, from: &str, to: &str) -> Option<&mut LinkSeen> {
        let key = (from.to_string(), to.to_string());
        if !self.links.contains_key(&key) && self.links.len() >= TOPOLOGY_LINKS_MAX {
            return None;
        }
        Some(self.links.entry(key).or_default())
    }

    fn record(&mut self, event: &AgentEvent) {
        match event {
            AgentEvent::CallStarted {
                call,
                parent,
                caller,
                target,
                depth,
                at,
            } => {
                let (Some(target), caller) = (agent_name(target), caller.as_ref().and_then(agent_name)) else {
                    return;
                };
                let at_us = at.as_micros();
                let root = parent
                    .and_then(|parent| self.calls.get(&parent))
                    .map_or(*call, |parent| parent.root);
                if let Some(parent) = parent.and_then(|parent| self.calls.get_mut(&parent)) {
                    parent.children.push(*call);
                }
                if let Some(seen) = self.agent(&target) {
                    seen.calls_received += 1;
                    if caller.is_none() {
                        seen.calls_from_outside += 1;
                    }
                }
                if let Some(caller) = &caller {
                    if let Some(seen) = self.agent(caller) {
                        seen.calls_made += 1;
                    }
                    if let Some(link) = self.link(caller, &target) {
                        link.calls += 1;
                        link.last_at_us = at_us;
                    }
                    self.remember_root(caller.clone(), root);
                }
                self.remember_root(target.clone(), root);
                self.keep(
                    *call,
                    CallSeen {
                        parent: *parent,
                        root,
                        caller,
                        target,
                        depth: *depth,
                        started_us: at_us,
                        finished: None,
                        turn_running: false,
                        children: Vec::new(),
                    },
                );
            }
            AgentEvent::CallFinished { call, outcome, at } => {
                let Some(seen) = self.calls.get_mut(call) else {
                    return;
                };
                let detail = event_json(event)["detail"].take();
                seen.finished = Some((at.as_micros(), outcome.label(), detail));
                // A turn cut by its deadline or its caller reports no end: its call's end
                // ends it here.
                let turn_was_running = std::mem::take(&mut seen.turn_running);
                let (caller, target) = (seen.caller.clone(), seen.target.clone());
                if turn_was_running {
                    if let Some(agent) = self.agents.get_mut(&target) {
                        agent.turns_on_calls = agent.turns_on_calls.saturating_sub(1);
                    }
                }
                if let CallOutcome::Refused(CallRefused::AgentNotFound { .. }) = outcome {
                    // The target names no agent: its start counted it as one (the start
                    // comes before the lookup); take that back, so ids a model or a
                    // client invents do not fill the agents and links (the call itself
                    // stays in its tree, and in its caller's calls made).
                    let root = seen.root;
                    self.forget_not_found(caller, &target, root);
                } else if matches!(outcome, CallOutcome::Refused(_) | CallOutcome::NotPermitted(_)) {
                    if let Some(link) = caller.and_then(|caller| self.links.get_mut(&(caller, target))) {
                        link.refused += 1;
                    }
                }
            }
            AgentEvent::TurnStarted { agent, call, .. } => {
                let Some(name) = agent_name(agent) else { return };
                let on_call = match call.and_then(|call| self.calls.get_mut(&call)) {
                    Some(seen) if !seen.turn_running => {
                        seen.turn_running = true;
                        true
                    }
                    _ => false,
                };
                if let Some(seen) = self.agent(&name) {
                    if on_call {
                        seen.turns_on_calls += 1;
                    } else {
                        seen.turns_other += 1;
                    }
                }
            }
            AgentEvent::TurnEnded { agent, call, .. } => {
                let Some(name) = agent_name(agent) else { return };
                // A kept call's turn was counted on the call (and may have been ended by
                // the call's end already); any other turn was counted as `turns_other`.
                let counted = match call.and_then(|call| self.calls.get_mut(&call)) {
                    Some(seen) => std::mem::take(&mut seen.turn_running).then_some(true),
                    None => Some(false),
                };
                if let (Some(on_call), Some(seen)) = (counted, self.agents.get_mut(&name)) {
                    if on_call {
                        seen.turns_on_calls = seen.turns_on_calls.saturating_sub(1);
                    } else {
                        seen.turns_other = seen.turns_other.saturating_sub(1);
                    }
                }
            }
            AgentEvent::MessageSent { from, to, at, .. } => {
                let Some(to) = agent_name(to) else { return };
                if let Some(from) = from.as_ref().and_then(agent_name) {
                    if let Some(seen) = self.agent(&from) {
                        seen.messages_sent += 1;
                    }
                    if let Some(link) = self.link(&from, &to) {
                        link.messages += 1;
                        link.last_at_us = at.as_micros();
                    }
                }
            }
            AgentEvent::MessageReceived {
                agent,
                duplicate: false,
                ..
            } => {
                if let Some(seen) = agent_name(agent).and_then(|name| self.agent(&name)) {
                    seen.messages_received += 1;
                }
            }
            AgentEvent::Activated { agent, .. } => {
                if let Some(seen) = agent_name(agent).and_then(|name| self.agent(&name)) {
                    seen.active = true;
                }
            }
            AgentEvent::Deactivated { agent, .. } => {
                if let Some(seen) = agent_name(agent).and_then(|name| self.agent(&name)) {
                    seen.active = false;
                    seen.turns_other = 0;
                }
            }
            _ => {}
        }
    }

    /// Records `root` as the last request that touched `agent`. At
    /// [`TOPOLOGY_LAST_ROOTS_MAX`] agents, first forgets those whose last request is no
    /// longer kept (their call tree is gone anyway).
    /// Takes back what the start of call `root`'s descendant from `caller` to `target`
    /// counted, the target being no agent: its received calls and the link's call; an
    /// entry left with nothing counted goes, with the target's last request if it is
    /// this call's.
    fn forget_not_found(&mut self, caller: Option<String>, target: &str, root: u64) {
        if let Some(seen) = self.agents.get_mut(target) {
            seen.calls_received = seen.calls_received.saturating_sub(1);
            if caller.is_none() {
                seen.calls_from_outside = seen.calls_from_outside.saturating_sub(1);
            }
            if seen.counts_nothing() {
                self.agents.remove(target);
                if self.last_root.get(target) == Some(&root) {
                    self.last_root.remove(target);
                }
            }
        }
        if let Some(caller) = caller {
            let key = (caller, target.to_string());
            if let Some(link) = self.links.get_mut(&key) {
                link.calls = link.calls.saturating_sub(1);
                if link.calls == 0 && link.refused == 0 && link.messages == 0 {
                    self.links.remove(&key);
                }
            }
        }
    }

    fn remember_root(&mut self, agent: String, root: u64) {
        if self.last_root.len() >= TOPOLOGY_LAST_ROOTS_MAX && !self.last_root.contains_key(&agent) {
            let calls = &self.calls;
            self.last_root.retain(|_, root| calls.contains_key(root));
        }
        self.last_root.insert(agent, root);
    }

    /// Keeps `call`, forgetting the oldest beyond [`TOPOLOGY_CALLS_KEPT`].
    fn keep(&mut self, call: u64, seen: CallSeen) {
        while self.order.len() >= TOPOLOGY_CALLS_KEPT {
            let Some(oldest) = self.order.pop_front() else { break };
            self.calls.remove(&oldest);
        }
        self.order.push_back(call);
        self.calls.insert(call, seen);
    }

    /// The call tree under `call` (kept calls only), as JSON.
    fn tree(&self, call: u64) -> Value {
        let Some(seen) = self.calls.get(&call) else {
            return Value::Null;
        };
        let children: Vec<Value> = seen
            .children
            .iter()
            .filter(|child| self.calls.contains_key(child))
            .map(|child| self.tree(*child))
            .collect();
        let (finished_us, outcome, detail) = match &seen.finished {
            Some((at, label, detail)) => (Some(*at), Some(*label), detail.clone()),
            None => (None, None, Value::Null),
        };
        json!({
            "call": call,
            "parent": seen.parent,
            "caller": seen.caller,
            "target": seen.target,
            "depth": seen.depth,
            "started_us": seen.started_us,
            "finished_us": finished_us,
            "outcome": outcome,
            "detail": detail,
            "children": children,
        })
    }
}

#[cfg(test)]
mod tests {
    use troupe_agent::agent_id;
    use troupe_core::Deadline;

    use super::*;

    fn call_from_outside(call: u64, target: &str) -> AgentEvent {
        AgentEvent::CallStarted {
            call,
            parent: None,
            caller: None,
            target: agent_id(target).unwrap(),
            depth: 0,
            at: Deadline::from_micros(call),
        }
    }

    /// Goal: the per-agent record of the last request (`last_root`, for call trees) stays
    /// bounded however many distinct agents the event stream names: agents created and
    /// deleted over time, or ids a model's `call_agent` names (its `CallStarted` comes
    /// before the target is looked up); before, it kept one entry per agent ever seen.
    /// Method: calls from outside to 3 × `TOPOLOGY_LAST_ROOTS_MAX` distinct agents, one
    /// each; the map never holds more than the limit, and the last agents' trees are
    /// still there.
    #[test]
    fn the_last_request_of_each_agent_is_kept_for_a_bounded_number_of_agents() {
        let mut observed = Observed::default();
        let calls = 3 * TOPOLOGY_LAST_ROOTS_MAX as u64;
        for call in 0..calls {
            observed.record(&call_from_outside(call, &format!("a{call}")));
            assert!(
                observed.last_root.len() <= TOPOLOGY_LAST_ROOTS_MAX,
                "{} agents remembered after {} calls",
                observed.last_root.len(),
                call + 1
            );
        }
        for call in calls - 10..calls {
            let root = observed.last_root.get(&format!("a{call}")).copied();
            assert_eq!(root, Some(call));
            assert_eq!(observed.tree(call)["target"], format!("a{call}"));
        }
    }
}
