//! A2A protocol v1.0 (JSON-RPC binding) for every agent, as the official `a2a-sdk`
//! 1.3.0 client speaks it:
//!
//! - `GET /a2a/{agent}/.well-known/agent-card.json`: the agent's card (no token
//!   needed: it says how to authenticate), whose one interface is `POST /a2a/{agent}`.
//! - `POST /a2a/{agent}`: JSON-RPC 2.0 with `SendMessage`, `SendStreamingMessage`
//!   (SSE), `GetTask`, `ListTasks`, `CancelTask` and `SubscribeToTask` (SSE).
//!
//! A message becomes an A2A task of the server ([`crate::a2a_tasks`], stored durably)
//! whose turn is a Troupe task in the agent's durable inbox
//! ([`troupe_agent::AgentClient::delegate_external`]); the task states are Troupe's. Troupe's call chain and depth
//! travel in `metadata.troupe` (`chain`: the agent ids the call came through, `depth`:
//! the depth it arrives at) and are checked on arrival: a chain that already holds the
//! agent is a cycle, a depth over `AGENT_CALL_DEPTH_MAX` is too deep; both make a
//! `rejected` task. Otherwise the agent's turn continues that chain and depth
//! (the external task carries them) until the caller's deadline
//! (`timeout_ms`, clipped to the server's maximum), so its own calls are checked
//! against them: a cycle across servers is refused. Without `metadata.troupe` the
//! message is an ask from outside (depth 0).
//!
//! Errors are JSON-RPC error objects with A2A's codes, in a 200 answer, except a busy
//! agent (429, `Retry-After`) and a full server (503, `Retry-After`): the client may
//! retry those. A notification (a request without `id`) is run but never answered in
//! JSON-RPC: 202 Accepted with no body ([`notified`]).

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt as _;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use tokio::sync::{watch, OwnedSemaphorePermit};
use tracing::Instrument as _;
use troupe_agent::{TaskState, TroupeCallMetadata};
use troupe_core::limits::AGENT_CALL_DEPTH_MAX;
use troupe_core::{StoreError, TraceId};

use crate::a2a_tasks::{
    message_id, AdmitError, CancelOutcome, Created, Forgotten, Lane, LaneTurn, ListPlace, TaskCall, TaskRecord,
    TaskRegistry, TaskStart, TaskStore,
};
use crate::agents::known;
use crate::error::ApiError;
use crate::limits::{
    A2A_BLOCKING_HEADROOM_MS, A2A_FORWARD_CONNECT_TIMEOUT_MS, A2A_FORWARD_TIMEOUT_MS, A2A_LIST_TASKS_PAGE_DEFAULT,
    A2A_LIST_TASKS_PAGE_MAX, A2A_MESSAGE_FIELDS_SIZE_MAX_BYTES, A2A_TASK_NUMBER_RESERVATIONS_PER_SEND_MAX,
    A2A_TASK_OUTCOME_GRACE_MS, A2A_TASK_POLL_MS, SERVER_MESSAGE_SIZE_MAX_BYTES, SERVER_MESSAGE_TIMEOUT_MS_MAX,
    SERVER_RETRY_AFTER_S,
};
use crate::server::AppState;

/// The A2A protocol version served.
pub(crate) const A2A_PROTOCOL_VERSION: &str = "1.0";
/// The header a client names its protocol version in.
const A2A_VERSION_HEADER: &str = "a2a-version";
/// The header of an A2A request one cluster node forwarded to another (the forwarding
/// node's name): the node it reaches answers it, and never forwards it again.
pub(crate) const FORWARDED_BY_HEADER: &str = "x-troupe-forwarded-by";
/// The header of an answer a cluster node got from the node it forwarded the request
/// to (that node's name).
pub(crate) const FORWARDED_TO_HEADER: &str = "x-troupe-forwarded-to";
/// The agent card's path under an agent's A2A base URL.
const AGENT_CARD_PATH: &str = "/.well-known/agent-card.json";
/// The prefix of the message id an A2A task is handed to its agent with
/// (`a2a:{task id}`), which the agent dedupes by: reserved, a REST notification's
/// `msg_id` may not start with it (`agents::check_message_id`), so that neither can be
/// taken for the other.
pub(crate) const A2A_MESSAGE_ID_PREFIX: &str = "a2a:";

/// A2A's JSON-RPC error codes (the SDK's `JSON_RPC_ERROR_CODE_MAP`).
pub(crate) mod code {
    /// The body is not JSON.
    pub(crate) const PARSE_ERROR: i64 = -32700;
    /// Not a JSON-RPC 2.0 request object.
    pub(crate) const INVALID_REQUEST: i64 = -32600;
    /// No such method.
    pub(crate) const METHOD_NOT_FOUND: i64 = -32601;
    /// The params are not valid for the method.
    pub(crate) const INVALID_PARAMS: i64 = -32602;
    /// The server failed.
    pub(crate) const INTERNAL_ERROR: i64 = -32603;
    /// No such task.
    pub(crate) const TASK_NOT_FOUND: i64 = -32001;
    /// The task is running or has ended.
    pub(crate) const TASK_NOT_CANCELABLE: i64 = -32002;
    /// Push notifications are not supported.
    pub(crate) const PUSH_NOTIFICATION_NOT_SUPPORTED: i64 = -32003;
    /// The operation is not supported.
    pub(crate) const UNSUPPORTED_OPERATION: i64 = -32004;
    /// A part or an output mode that is not text.
    pub(crate) const CONTENT_TYPE_NOT_SUPPORTED: i64 = -32005;
    /// No extended agent card.
    pub(crate) const EXTENDED_AGENT_CARD_NOT_CONFIGURED: i64 = -32007;
    /// The client's `A2A-Version` is not served.
    pub(crate) const VERSION_NOT_SUPPORTED: i64 = -32009;
    /// The agent is busy or the server full: retry after `Retry-After` seconds
    /// (JSON-RPC's implementation-defined server error range).
    pub(crate) const BUSY: i64 = -32000;
}

/// What the A2A routes share.
pub(crate) struct A2a {
    app: Arc<AppState>,
    tasks: TaskRegistry,
    /// Where the records are kept.
    store: TaskStore,
    /// Set once the stored records have been read back (at the first request). A
    /// single server reads every agent's at its start; a cluster node reads none then:
    /// see `held`.
    loaded: tokio::sync::OnceCell<()>,
    /// On a cluster node, per agent: set once this node holds the agent's A2A records
    /// and has read them back (see [`hold`]). Reset when a write finds another node
    /// holding them.
    held: Mutex<HashMap<String, Arc<tokio::sync::OnceCell<()>>>>,
    /// The client that forwards requests to the node holding an agent's records (made
    /// at the first forward).
    forwarder: std::sync::OnceLock<reqwest::Client>,
}

type Shared = State<Arc<A2a>>;

/// The A2A routes over `app`, to merge into the server's router.
pub(crate) fn routes<S>(app: Arc<AppState>) -> Router<S> {
    let store = TaskStore::new(app.client.runtime().clone(), app.config.node.clone());
    let a2a = Arc::new(A2a {
        tasks: TaskRegistry::new(app.config.a2a_tasks_kept, app.config.node.clone()),
        app,
        store,
        loaded: tokio::sync::OnceCell::new(),
        held: Mutex::default(),
        forwarder: std::sync::OnceLock::new(),
    });
    // The server's other routes reach it through a weak reference (it holds the state
    // they share): the agent routes tell it of a deleted agent, `/metrics` reads its size.
    let _ = a2a.app.a2a.set(Arc::downgrade(&a2a));
    // Read the stored tasks back now (and resume those that had not ended), not only at
    // the first A2A request. A cluster node reads an agent's when it takes them over
    // (`ready` reads nothing there).
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        let a2a = Arc::clone(&a2a);
        runtime.spawn(async move { ready(&a2a).await });
    }
    Router::new()
        .route("/a2a/{agent}/.well-known/agent-card.json", get(card))
        .route("/a2a/{agent}", post(rpc))
        .with_state(a2a)
}

/// Lets everything the A2A layer keeps of the deleted agent `agent` go: its tasks (in
/// memory and their stored records), its lane, and on a cluster node its hold. Streams
/// of its tasks end; an agent made again under its id starts with none. Called by
/// `DELETE /v1/agents/{id}`, and by an A2A request that finds the agent gone (deleted
/// by another process sharing the store). A failure to delete the stored records is
/// logged: they are read back at the next start only if an agent of that id is defined
/// then.
pub(crate) async fn forget_agent(app: &AppState, agent: &str) {
    let Some(a2a) = app.a2a.get().and_then(std::sync::Weak::upgrade) else {
        return; // a router without its A2A routes, or one being dropped
    };
    forget(&a2a, agent).await;
}

async fn forget(a2a: &A2a, agent: &str) {
    let forgotten = a2a.tasks.forget_agent(agent);
    a2a.held.lock().unwrap_or_else(PoisonError::into_inner).remove(agent);
    let deadline = a2a.store.deadline_in(blocking_wait(a2a));
    if let Err(error) = a2a.store.forget_agent(agent, &forgotten, deadline).await {
        tracing::warn!(%agent, records = forgotten.len(), %error, "could not delete a deleted agent's stored A2A tasks");
    }
}

/// How much the A2A layer keeps, for `/metrics`: the tasks it holds, and the agents it
/// keeps anything of (tasks, a lane, a hold, a store writer's fence).
pub(crate) async fn sizes(app: &AppState) -> (usize, usize) {
    let Some(a2a) = app.a2a.get().and_then(std::sync::Weak::upgrade) else {
        return (0, 0);
    };
    let (tasks, mut agents) = a2a.tasks.sizes();
    agents.extend(a2a.held.lock().unwrap_or_else(PoisonError::into_inner).keys().cloned());
    agents.extend(a2a.store.agents_fenced().await);
    agents.sort_unstable();
    agents.dedup();
    (tasks, agents.len())
}

/// Whether `path` is served without a token: the agent cards, which say how to
/// authenticate.
pub(crate) fn is_public(method: &Method, path: &str) -> bool {
    method == Method::GET && path.starts_with("/a2a/") && path.ends_with(AGENT_CARD_PATH)
}

/// The agent's A2A base URL as the client reached this server, the agent's id escaped
/// as one path segment: an id may hold `?`, `#`, `%` or spaces, which as they are would
/// send the client's requests to another path (another agent, or none).
fn base_url(headers: &HeaderMap, agent: &str) -> String {
    let host = headers
        .get(header::HOST)
        .and_then(|value| value.to_str().ok())
        .unwrap_or("127.0.0.1");
    format!("http://{host}/a2a/{}", path_segment(agent))
}

/// `text` as one URL path segment: every byte but RFC 3986's unreserved characters
/// (`A-Z a-z 0-9 - . _ ~`) percent-encoded.
fn path_segment(text: &str) -> String {
    let mut segment = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            segment.push(char::from(byte));
        } else {
            segment.push_str(&format!("%{byte:02X}"));
        }
    }
    segment
}

/// `GET /a2a/{agent}/.well-known/agent-card.json`.
async fn card(State(a2a): Shared, Path(agent): Path<String>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    let spec = known(&a2a.app, &agent).await?;
    let description = if spec.role.is_empty() {
        format!("Troupe agent {}", spec.id)
    } else {
        spec.role.clone()
    };
    let mut card = json!({
        "name": spec.name,
        "description": description,
        "supportedInterfaces": [{
            "url": base_url(&headers, &agent),
            "protocolBinding": "JSONRPC",
            "protocolVersion": A2A_PROTOCOL_VERSION,
        }],
        "version": env!("CARGO_PKG_VERSION"),
        "capabilities": {"streaming": true, "pushNotifications": false, "extendedAgentCard": false},
        "defaultInputModes": ["text/plain"],
        "defaultOutputModes": ["text/plain"],
        "skills": [{
            "id": spec.id,
            "name": spec.name,
            "description": description,
            "tags": ["troupe"],
        }],
    });
    if a2a.app.config.token.is_some() {
        card["securitySchemes"] = json!({
            "bearer": {"httpAuthSecurityScheme": {
                "scheme": "Bearer",
                "description": "the token given to troupe serve (--token or TROUPE_TOKEN)",
            }},
        });
        card["securityRequirements"] = json!([{"schemes": {"bearer": {"list": []}}}]);
    }
    Ok(Json(card))
}

/// A JSON-RPC error to answer.
#[derive(Debug)]
struct RpcError {
    code: i64,
    message: String,
    /// Set for the retryable errors: 429 or 503 with `Retry-After`.
    status: StatusCode,
    /// The server's error code of a retryable error (`busy`, `overloaded`,
    /// `storage_unavailable`): the `code` a notification's refusal is answered with
    /// ([`notified`]). Empty for the others.
    refusal: &'static str,
}

impl RpcError {
    fn new(code: i64, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            status: StatusCode::OK,
            refusal: "",
        }
    }

    fn params(message: impl Into<String>) -> Self {
        Self::new(code::INVALID_PARAMS, message)
    }

    fn task_not_found(agent: &str, id: &str) -> Self {
        Self::new(code::TASK_NOT_FOUND, format!("agent {agent:?} has no task {id:?}"))
    }

    /// A refusal the client may retry: 429 `busy` or 503 `overloaded`.
    fn retry(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            code: code::BUSY,
            message: message.into(),
            status,
            refusal: if status == StatusCode::TOO_MANY_REQUESTS {
                "busy"
            } else {
                "overloaded"
            },
        }
    }

    /// The server's retryable `error` (with `Retry-After`) as A2A answers it: its
    /// status (429 or 503) and the JSON-RPC code [`code::BUSY`], as every retryable
    /// refusal; a notification's refusal carries its code.
    fn refusal(error: ApiError) -> Self {
        Self {
            code: code::BUSY,
            message: error.message,
            status: error.status,
            refusal: error.code,
        }
    }

    /// A store that failed with `error`, said as `message`: 503 `storage_unavailable`
    /// if it failed for a moment ([`StoreError::is_transient`]), as every route of the
    /// server says it; 503 `overloaded` otherwise, as before 2026-12-07. Both may be
    /// retried.
    fn store(error: &StoreError, message: String) -> Self {
        if error.is_transient() {
            Self::refusal(ApiError::storage_unavailable(message))
        } else {
            Self::retry(StatusCode::SERVICE_UNAVAILABLE, message)
        }
    }

    fn answer(self, id: &Value) -> Response {
        let body = json!({
            "jsonrpc": "2.0",
            "id": id,
            "error": {"code": self.code, "message": self.message},
        });
        let mut response = (self.status, Json(body)).into_response();
        if self.status != StatusCode::OK {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(SERVER_RETRY_AFTER_S));
        }
        response
    }
}

fn success(id: &Value, result: Value) -> Response {
    Json(json!({"jsonrpc": "2.0", "id": id, "result": result})).into_response()
}

/// Reads the stored records back, once: those that had not ended wait in their lanes
/// again and are handed to their agents (which find the task they already hold). A
/// cluster node reads none here: it reads an agent's when it takes them over ([`hold`]).
async fn ready(a2a: &Arc<A2a>) {
    if a2a.app.config.node.is_some() {
        return;
    }
    a2a.loaded
        .get_or_init(|| async {
            // The stored directory, not only the agents this system was built with: an
            // agent defined over REST by an earlier run is read from the store (at the
            // server's start nothing has read it yet), and its tasks are resumed too.
            let agents: Vec<String> = a2a
                .app
                .client
                .current_directory()
                .await
                .list()
                .into_iter()
                .map(|spec| spec.id)
                .collect();
            match a2a.store.load(&agents, a2a.store.background_deadline()).await {
                Ok(records) => resume(a2a, records),
                Err(error) => {
                    tracing::error!(%error, "the stored A2A tasks cannot be read; they are not resumed");
                }
            }
        })
        .await;
}

/// Takes `records` (read from the store, oldest first) into the registry: those that had
/// not ended wait in their lanes again and are handed to their agents. A record the
/// registry already has is left as it is.
fn resume(a2a: &Arc<A2a>, records: Vec<TaskRecord>) {
    for record in records {
        let ask = Ask::of(&record);
        let (id, agent) = (record.id.clone(), record.agent.clone());
        if let Some(lane) = a2a.tasks.restore(record) {
            spawn_run(a2a, id, agent, ask, lane);
        }
    }
}

/// On a cluster node, makes sure this node holds `agent`'s A2A records before it serves
/// anything of them: the first time, it claims their key space (`troupe-a2a/{agent}`,
/// which places it on this node in etcd, and is refused while another live node holds
/// it) and reads every stored task of the agent back, whichever node numbered it, so a
/// node that takes over after another's death serves the dead node's tasks (`GetTask`,
/// `ListTasks`) and resumes those that had not ended. Refused as retryable (503) while
/// another node holds them, naming it. A single server holds every agent's (read at its
/// start): nothing to do.
async fn hold(a2a: &Arc<A2a>, agent: &str) -> Result<(), Refused> {
    if a2a.app.config.node.is_none() {
        return Ok(());
    }
    let cell = {
        let mut held = a2a.held.lock().unwrap_or_else(PoisonError::into_inner);
        match held.get(agent) {
            Some(cell) => Arc::clone(cell),
            None => Arc::clone(held.entry(agent.to_string()).or_default()),
        }
    };
    let taken = cell
        .get_or_try_init(|| async {
            let deadline = a2a.store.deadline_in(blocking_wait(a2a));
            a2a.store.claim(agent, deadline).await?;
            let records = a2a.store.load(&[agent.to_string()], deadline).await?;
            tracing::info!(%agent, records = records.len(), "this node holds the agent's A2A tasks");
            resume(a2a, records);
            Ok::<(), StoreError>(())
        })
        .await;
    taken.map(|_| ()).map_err(|error| match error {
        StoreError::NotOwner {
            owner: Some(ref owner), ..
        } => Refused {
            holder: Some(owner.clone()),
            error: RpcError::retry(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "agent {agent:?}'s A2A tasks are held by node {owner}: send this request through that node's \
                     server, or retry once it is gone ({error})"
                ),
            ),
        },
        other => Refused {
            holder: None,
            error: RpcError::store(
                &other,
                format!("agent {agent:?}'s A2A tasks cannot be served by this node now: {other}"),
            ),
        },
    })
}

/// Why this node does not serve an agent's A2A tasks now.
struct Refused {
    /// The node that holds them, if another does.
    holder: Option<String>,
    /// The answer to give when the request is not forwarded there.
    error: RpcError,
}

/// Forwards a request for `agent`'s A2A tasks to `holder`, the node that holds them, at
/// the address [`crate::ServerConfig::peers`] gives: its answer is this request's
/// (streamed as it comes, for SSE). Once only: a forwarded request carries
/// [`FORWARDED_BY_HEADER`] and is never forwarded again. `None` when there is no address
/// for it or it cannot be reached: the caller gives the refusal naming it instead.
///
/// `slot`, given for a streaming method, is this node's slot among its open streams
/// (`server::stream_slot`): a streamed answer holds it in its body until it ends or its
/// client goes away, as a stream this node serves itself does; any other answer lets it
/// go at once.
async fn forward(
    a2a: &A2a,
    holder: &str,
    agent: &str,
    headers: &HeaderMap,
    body: Bytes,
    slot: Option<OwnedSemaphorePermit>,
) -> Option<Response> {
    let node = a2a.app.config.node.as_deref()?;
    let address = a2a.app.config.peers.as_ref()?.http_address(holder).await?;
    let client = match a2a.forwarder.get() {
        Some(client) => client,
        None => {
            troupe_agent::ensure_tls_provider();
            let built = reqwest::Client::builder()
                .connect_timeout(Duration::from_millis(A2A_FORWARD_CONNECT_TIMEOUT_MS))
                .timeout(Duration::from_millis(A2A_FORWARD_TIMEOUT_MS))
                .build();
            match built {
                Ok(client) => a2a.forwarder.get_or_init(|| client),
                Err(error) => {
                    tracing::warn!(%error, "the A2A forwarding client could not be built");
                    return None;
                }
            }
        }
    };
    // The agent's id as one path segment (escaped: an id may hold `?`, `#` or spaces).
    let mut url = match reqwest::Url::parse(&format!("http://{address}/")) {
        Ok(url) if !url.cannot_be_a_base() => url,
        _ => {
            tracing::warn!(%holder, %address, "a node's published HTTP address is not host:port; not forwarded");
            return None;
        }
    };
    url.path_segments_mut().ok()?.extend(["a2a", agent]);
    let mut request = client.post(url).header(FORWARDED_BY_HEADER, node).body(body);
    for name in [
        header::AUTHORIZATION.as_str(),
        header::CONTENT_TYPE.as_str(),
        A2A_VERSION_HEADER,
        "traceparent",
    ] {
        if let Some(value) = headers.get(name) {
            request = request.header(name, value.as_bytes());
        }
    }
    let answer = match request.send().await {
        Ok(answer) => answer,
        Err(error) => {
            tracing::warn!(%agent, %holder, %address, %error, "forwarding an A2A request failed");
            return None;
        }
    };
    let mut response = Response::builder().status(answer.status().as_u16());
    for name in [header::CONTENT_TYPE, header::RETRY_AFTER, header::CACHE_CONTROL] {
        if let Some(value) = answer.headers().get(name.as_str()) {
            response = response.header(name, value.as_bytes());
        }
    }
    let response = response.header(FORWARDED_TO_HEADER, holder);
    let streamed = answer
        .headers()
        .get(header::CONTENT_TYPE.as_str())
        .is_some_and(|value| value.as_bytes().starts_with(b"text/event-stream"));
    let body = if streamed {
        // SSE: each event as it comes, the slot held as long as the body is.
        let events = answer.bytes_stream().map(move |event| {
            let _held = &slot;
            event
        });
        axum::body::Body::from_stream(events)
    } else {
        match answer.bytes().await {
            Ok(bytes) => axum::body::Body::from(bytes),
            Err(error) => {
                tracing::warn!(%agent, %holder, %address, %error, "reading a forwarded A2A answer failed");
                return None;
            }
        }
    };
    response.body(body).ok()
}

/// After a write of `agent`'s records failed with `error`: if another node holds them
/// now, this node no longer does, and checks again at the agent's next request.
fn lost_hold(a2a: &A2a, agent: &str, error: &StoreError) {
    if matches!(error, StoreError::NotOwner { .. }) && a2a.app.config.node.is_some() {
        a2a.held.lock().unwrap_or_else(PoisonError::into_inner).remove(agent);
    }
}

/// `POST /a2a/{agent}`: one JSON-RPC request.
async fn rpc(State(a2a): Shared, Path(agent): Path<String>, headers: HeaderMap, body: Bytes) -> Response {
    // Exported, the request's spans go in the trace its message names, if it names one:
    // decided before anything of the request opens a span of its own.
    #[cfg(feature = "otel")]
    crate::otel::start_in_requested_trace(&headers, &body);
    if let Err(error) = known(&a2a.app, &agent).await {
        // Deleted by another process sharing the store: let its tasks go here too.
        if a2a.tasks.tracks(&agent)
            || a2a
                .held
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .contains_key(&agent)
        {
            forget(&a2a, &agent).await;
        }
        return error.into_response();
    }
    ready(&a2a).await;
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        return RpcError::new(code::PARSE_ERROR, "the body is not JSON").answer(&Value::Null);
    };
    let id = request.get("id").cloned().unwrap_or(Value::Null);
    // A request object without an `id` member is a notification, which JSON-RPC 2.0
    // (4.1) forbids any reply to (one with `"id": null` is a request, answered under
    // `null`).
    let notification = request.as_object().is_some_and(|object| !object.contains_key("id"));
    let (method, params) = match envelope(&request) {
        Ok(parts) => parts,
        // An Invalid Request is answered with the id `null` (JSON-RPC 2.0, 5.1: its id
        // may be the broken part), a notification's too (it is no valid request, so no
        // notification either: 5.1's own example); params that are not an object come
        // from a request whose id was read, and are answered under it, as every other
        // error is.
        Err(error) if error.code == code::INVALID_REQUEST => return error.answer(&Value::Null),
        Err(error) if notification => return notified(method_of(&request), Err(error)),
        Err(error) => return error.answer(&id),
    };
    if let Some(version) = headers.get(A2A_VERSION_HEADER).and_then(|value| value.to_str().ok()) {
        if !version_served(version) {
            let error = RpcError::new(
                code::VERSION_NOT_SUPPORTED,
                format!("A2A-Version {version:?} is not served; this server speaks {A2A_PROTOCOL_VERSION}"),
            );
            if notification {
                return notified(method, Err(error));
            }
            return error.answer(&id);
        }
    }
    if notification {
        return notify(&a2a, &agent, method, params, &headers, body).await;
    }
    let tasks_method = matches!(
        method,
        "SendMessage" | "SendStreamingMessage" | "GetTask" | "ListTasks" | "CancelTask" | "SubscribeToTask"
    );
    if tasks_method {
        if let Err(refused) = hold(&a2a, &agent).await {
            if let Some(holder) = refused.holder.as_deref() {
                if !headers.contains_key(FORWARDED_BY_HEADER) {
                    // A stream forwarded is open here too: one over this node's limit is
                    // refused before it is forwarded, as one served here is.
                    let slot = match method {
                        "SendStreamingMessage" | "SubscribeToTask" => match stream_slot(&a2a) {
                            Ok(slot) => Some(slot),
                            Err(error) => return error.answer(&id),
                        },
                        _ => None,
                    };
                    if let Some(response) = forward(&a2a, holder, &agent, &headers, body.clone(), slot).await {
                        return response;
                    }
                }
            }
            return refused.error.answer(&id);
        }
    }
    let answered = match method {
        "SendMessage" => send_message(&a2a, &agent, params, &id, &headers).await,
        "SendStreamingMessage" => send_streaming(&a2a, &agent, params, &id, &headers).await,
        "GetTask" => get_task(&a2a, &agent, params).map(|task| success(&id, task)),
        "ListTasks" => list_tasks(&a2a, &agent, params).map(|list| success(&id, list)),
        "CancelTask" => cancel_task(&a2a, &agent, params).await.map(|task| success(&id, task)),
        "SubscribeToTask" => subscribe(&a2a, &agent, params, &id),
        "CreateTaskPushNotificationConfig"
        | "GetTaskPushNotificationConfig"
        | "ListTaskPushNotificationConfigs"
        | "DeleteTaskPushNotificationConfig" => Err(RpcError::new(
            code::PUSH_NOTIFICATION_NOT_SUPPORTED,
            "push notifications are not supported; stream (SendStreamingMessage, SubscribeToTask) or poll (GetTask)",
        )),
        "GetExtendedAgentCard" => Err(RpcError::new(
            code::EXTENDED_AGENT_CARD_NOT_CONFIGURED,
            "there is no extended agent card; the public card is all",
        )),
        other => Err(RpcError::new(
            code::METHOD_NOT_FOUND,
            format!("no method {other:?}; see docs/serve.md for the A2A methods served"),
        )),
    };
    answered.unwrap_or_else(|error| error.answer(&id))
}

/// A notification (a request without `id`) of `method`: run as the same request would
/// be, its answer never sent (JSON-RPC 2.0, 4.1: the server MUST NOT reply to a
/// notification). `SendMessage` and `SendStreamingMessage` start their task and are
/// not waited for (nobody reads the task's outcome or a stream); `CancelTask` cancels.
/// The other methods only answer, so nothing is run for them. Held by another cluster
/// node, it is forwarded there as a request is, and its answer is that node's.
/// Answered as [`notified`] says.
async fn notify(
    a2a: &Arc<A2a>,
    agent: &str,
    method: &str,
    params: &Map<String, Value>,
    headers: &HeaderMap,
    body: Bytes,
) -> Response {
    if !matches!(method, "SendMessage" | "SendStreamingMessage" | "CancelTask") {
        return notified(method, Ok(()));
    }
    if let Err(refused) = hold(a2a, agent).await {
        if let Some(holder) = refused.holder.as_deref() {
            if !headers.contains_key(FORWARDED_BY_HEADER) {
                // No stream: nothing takes a stream slot.
                if let Some(response) = forward(a2a, holder, agent, headers, body, None).await {
                    return response;
                }
            }
        }
        return notified(method, Err(refused.error));
    }
    let outcome = match method {
        "CancelTask" => cancel_task(a2a, agent, params).await.map(drop),
        _ => match accept(a2a, agent, params, headers) {
            Ok(accepted) => start(a2a, agent, &accepted).await.map(drop),
            Err(error) => Err(error),
        },
    };
    notified(method, outcome)
}

/// The HTTP answer to a notification of `method` that ended with `outcome`: never a
/// JSON-RPC response. 202 Accepted with no body, whatever it did (a notification's
/// errors are not told, JSON-RPC 2.0 4.1; they are logged at `debug`), except a refusal
/// the client may retry (a busy agent, a full server): that is an HTTP refusal, 429 or
/// 503 with `Retry-After`, in the server's error shape (`{"error": {"code", "message"}}`,
/// no JSON-RPC member), so that a client that sends notifications can still hold back.
/// The official Python server (`a2a-python`'s JSON-RPC app, its 0.3 line as read on
/// 2026-12-07) answers a request without `id` with a JSON-RPC error instead (-32602: its
/// request models require the `id`); A2A itself says nothing of notifications.
fn notified(method: &str, outcome: Result<(), RpcError>) -> Response {
    match outcome {
        Ok(()) => StatusCode::ACCEPTED.into_response(),
        Err(error) if error.status == StatusCode::OK => {
            tracing::debug!(
                method,
                code = error.code,
                message = %error.message,
                "an A2A notification failed; no reply is sent to a notification"
            );
            StatusCode::ACCEPTED.into_response()
        }
        Err(error) => ApiError::new(error.status, error.refusal, error.message)
            .retry_after()
            .into_response(),
    }
}

/// The `method` of a request object, if it is a string (for the log of a notification
/// refused before its method was read).
fn method_of(request: &Value) -> &str {
    request.get("method").and_then(Value::as_str).unwrap_or("")
}

/// `1.0`, `1.0.x`: the major and minor served.
fn version_served(version: &str) -> bool {
    let mut parts = version.trim().split('.');
    parts.next() == Some("1") && parts.next() == Some("0")
}

/// The method and params of a JSON-RPC 2.0 request object.
fn envelope(request: &Value) -> Result<(&str, &Map<String, Value>), RpcError> {
    let invalid = |what: &str| RpcError::new(code::INVALID_REQUEST, format!("not a JSON-RPC 2.0 request: {what}"));
    let Some(object) = request.as_object() else {
        return Err(invalid("the body must be one request object (batches are not served)"));
    };
    if object.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return Err(invalid("\"jsonrpc\" must be \"2.0\""));
    }
    if !matches!(
        object.get("id"),
        None | Some(Value::String(_) | Value::Number(_) | Value::Null)
    ) {
        return Err(invalid("\"id\" must be a string, a number or null"));
    }
    let Some(method) = object.get("method").and_then(Value::as_str) else {
        return Err(invalid("\"method\" must be a string"));
    };
    static EMPTY: std::sync::OnceLock<Map<String, Value>> = std::sync::OnceLock::new();
    match object.get("params") {
        None => Ok((method, EMPTY.get_or_init(Map::new))),
        Some(Value::Object(params)) => Ok((method, params)),
        Some(_) => Err(RpcError::params("\"params\" must be an object")),
    }
}

fn parse<T: serde::de::DeserializeOwned>(params: &Map<String, Value>) -> Result<T, RpcError> {
    serde_json::from_value(Value::Object(params.clone())).map_err(|error| RpcError::params(error.to_string()))
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SendParams {
    message: Option<Value>,
    #[serde(default)]
    configuration: SendConfiguration,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SendConfiguration {
    #[serde(default)]
    accepted_output_modes: Vec<String>,
    task_push_notification_config: Option<Value>,
    history_length: Option<i64>,
    #[serde(default)]
    return_immediately: bool,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct InMessage {
    message_id: String,
    context_id: Option<String>,
    task_id: Option<String>,
    role: Value,
    parts: Vec<InPart>,
    metadata: Option<Map<String, Value>>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct InPart {
    text: Option<String>,
    media_type: Option<String>,
}

/// A checked message: its text, how long to wait, and where it stands in a chain.
struct Accepted {
    text: String,
    context_id: Option<String>,
    request: Value,
    /// Troupe's call context, when the message carries one (`metadata.troupe`).
    troupe: Option<TroupeCallMetadata>,
    timeout: Duration,
    history_length: Option<i64>,
    blocking: bool,
    /// The request's trace id: `metadata.troupe.trace_id` when it is one, else the
    /// `traceparent` header's, else a new one.
    trace: TraceId,
}

fn accept(a2a: &A2a, agent: &str, params: &Map<String, Value>, headers: &HeaderMap) -> Result<Accepted, RpcError> {
    let send: SendParams = parse(params)?;
    let Some(raw) = send.message else {
        return Err(RpcError::params("\"message\" is required"));
    };
    let message: InMessage =
        serde_json::from_value(raw.clone()).map_err(|error| RpcError::params(error.to_string()))?;
    if message.message_id.is_empty() {
        return Err(RpcError::params("\"message.messageId\" must not be empty"));
    }
    if !matches!(&message.role, Value::String(role) if role == "ROLE_USER") && message.role != json!(1) {
        return Err(RpcError::params(format!(
            "\"message.role\" must be \"ROLE_USER\", got {}",
            message.role
        )));
    }
    if send.configuration.task_push_notification_config.is_some() {
        return Err(RpcError::new(
            code::PUSH_NOTIFICATION_NOT_SUPPORTED,
            "push notifications are not supported",
        ));
    }
    let modes = &send.configuration.accepted_output_modes;
    if !modes.is_empty()
        && !modes
            .iter()
            .any(|mode| matches!(mode.as_str(), "text/plain" | "text/*" | "*/*" | "text"))
    {
        return Err(RpcError::new(
            code::CONTENT_TYPE_NOT_SUPPORTED,
            format!("the agents answer text/plain only; acceptedOutputModes was {modes:?}"),
        ));
    }
    if let Some(task_id) = &message.task_id {
        if a2a.tasks.get(agent, task_id).is_none() {
            return Err(RpcError::task_not_found(agent, task_id));
        }
        return Err(RpcError::new(
            code::UNSUPPORTED_OPERATION,
            format!("task {task_id:?} takes no further input; send a new message without taskId"),
        ));
    }
    let mut texts = Vec::with_capacity(message.parts.len());
    for part in &message.parts {
        let Some(text) = &part.text else {
            return Err(RpcError::new(
                code::CONTENT_TYPE_NOT_SUPPORTED,
                "only text parts are supported (no raw, url or data parts)",
            ));
        };
        if part
            .media_type
            .as_deref()
            .is_some_and(|media| !media.is_empty() && !media.starts_with("text/"))
        {
            return Err(RpcError::new(
                code::CONTENT_TYPE_NOT_SUPPORTED,
                format!("a text part's mediaType must be text/*, got {:?}", part.media_type),
            ));
        }
        texts.push(text.as_str());
    }
    let text = texts.join("\n");
    if text.is_empty() {
        return Err(RpcError::params("the message has no text"));
    }
    if text.len() > SERVER_MESSAGE_SIZE_MAX_BYTES {
        return Err(RpcError::params(format!(
            "the message is {} bytes, more than the limit of {SERVER_MESSAGE_SIZE_MAX_BYTES}",
            text.len()
        )));
    }
    let fields = fields_size(&raw);
    if fields > A2A_MESSAGE_FIELDS_SIZE_MAX_BYTES {
        return Err(RpcError::params(format!(
            "the message's fields besides its text (ids, metadata, extensions) are {fields} bytes of JSON, more than \
             the limit of {A2A_MESSAGE_FIELDS_SIZE_MAX_BYTES}; send less metadata"
        )));
    }
    let troupe = TroupeCallMetadata::from_metadata(message.metadata.as_ref()).map_err(RpcError::params)?;
    // The caller's remaining time, never more than this server allows a message.
    let timeout_ms = troupe
        .as_ref()
        .and_then(|troupe| troupe.timeout_ms)
        .map_or(troupe_agent::limits::AGENT_ASK_TIMEOUT_MS_DEFAULT, |ms| {
            ms.min(SERVER_MESSAGE_TIMEOUT_MS_MAX)
        });
    if send.configuration.history_length.is_some_and(|length| length < 0) {
        return Err(RpcError::params("\"configuration.historyLength\" must not be negative"));
    }
    Ok(Accepted {
        text,
        context_id: message.context_id.filter(|context| !context.is_empty()),
        request: raw,
        timeout: Duration::from_millis(timeout_ms),
        history_length: send.configuration.history_length,
        blocking: !send.configuration.return_immediately,
        trace: troupe
            .as_ref()
            .and_then(TroupeCallMetadata::trace)
            .unwrap_or_else(|| crate::agents::request_trace(&a2a.app, headers)),
        troupe,
    })
}

/// The size of `message` as JSON without its parts' text, in bytes: what it holds besides
/// the text (bounded by [`A2A_MESSAGE_FIELDS_SIZE_MAX_BYTES`]).
fn fields_size(message: &Value) -> usize {
    let mut fields = message.clone();
    if let Some(parts) = fields.get_mut("parts").and_then(Value::as_array_mut) {
        for part in parts {
            if let Some(text) = part.get_mut("text") {
                *text = Value::String(String::new());
            }
        }
    }
    fields.to_string().len()
}

/// Why Troupe's call rules refuse the message, if they do.
fn refusal(agent: &str, troupe: &TroupeCallMetadata) -> Option<String> {
    if troupe.chain.iter().any(|link| link == agent) {
        return Some(format!(
            "refused: a cycle: the chain {:?} already holds agent {agent:?}",
            troupe.chain
        ));
    }
    if troupe.depth > AGENT_CALL_DEPTH_MAX {
        return Some(format!(
            "refused: the call would be at depth {}, deeper than the limit of {AGENT_CALL_DEPTH_MAX}",
            troupe.depth
        ));
    }
    None
}

/// Makes the task, stores it and, unless it is rejected at once, puts it in its
/// agent's lane. Its number is one reserved in the store for this server (a block is
/// reserved when the agent has none left here: see [`crate::a2a_tasks`]), so no server
/// on the store gives its id again, nor this one after a delete of the agent (whose
/// inbox knows the old ids) or a restart.
async fn start(a2a: &Arc<A2a>, agent: &str, accepted: &Accepted) -> Result<TaskRecord, RpcError> {
    let troupe = accepted.troupe.clone().unwrap_or_default();
    let rejected = refusal(agent, &troupe);
    // The store is tried again until the request's deadline: its caller's time, within
    // what the server gives a request.
    let deadline = a2a.store.deadline_in(accepted.timeout.min(blocking_wait(a2a)));
    let mut reservations = 0;
    let created = loop {
        let created = a2a.tasks.create(
            agent,
            accepted.context_id.clone(),
            accepted.request.clone(),
            TaskCall {
                chain: troupe.chain.clone(),
                depth: troupe.depth,
                timeout_ms: u64::try_from(accepted.timeout.as_millis()).unwrap_or(u64::MAX),
                trace_id: accepted.trace.to_string(),
            },
            rejected.clone(),
            a2a.app.client.runtime().now(),
        );
        // Other sends to the agent may use a new block up before this one numbers its
        // task: reserve again, a bounded number of times.
        if !matches!(created, Err(AdmitError::NoNumbers)) || reservations == A2A_TASK_NUMBER_RESERVATIONS_PER_SEND_MAX {
            break created;
        }
        reservations += 1;
        if let Err(error) = a2a.store.reserve_numbers(&a2a.tasks, agent, deadline).await {
            lost_hold(a2a, agent, &error);
            return Err(RpcError::store(
                &error,
                format!("agent {agent:?}'s A2A task numbers cannot be reserved now; retry later: {error}"),
            ));
        }
    };
    let created = created.map_err(|error| match error {
            AdmitError::LaneFull => RpcError::retry(
                StatusCode::TOO_MANY_REQUESTS,
                format!("agent {agent:?} has too many A2A tasks waiting; retry later"),
            ),
            AdmitError::Full => RpcError::retry(
                StatusCode::SERVICE_UNAVAILABLE,
                "the server holds as many running A2A tasks as it can; retry later",
            ),
            AdmitError::MessageIdReused(first) => RpcError::params(format!(
                "\"message.messageId\" {:?} was sent to agent {agent:?} before with other parts (task {first}); \
                 give each new message its own messageId",
                message_id(&accepted.request)
            )),
            AdmitError::NoNumbers => RpcError::retry(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "agent {agent:?}'s A2A task numbers were used up by other sends {A2A_TASK_NUMBER_RESERVATIONS_PER_SEND_MAX} \
                     times over while this one waited; retry later"
                ),
            ),
        })?;
    let (record, lane, forgotten) = match created {
        // Sent again: the task it started, which runs (or ran) once.
        Created::Resent(first) => return Ok(first),
        Created::New(record, lane, forgotten) => (record, lane, forgotten),
    };
    // Stored before the client hears of it.
    let saved = a2a.store.save(&a2a.tasks, &record, &forgotten, deadline).await;
    // Let go from memory either way: their agents forget them too.
    for forgotten in forgotten {
        forget_inner(&a2a.app, forgotten);
    }
    if let Err(error) = saved {
        lost_hold(a2a, agent, &error);
        let reason = format!("the task could not be stored: {error}");
        let refused = RpcError::store(&error, reason.clone());
        let now = a2a.app.client.runtime().now();
        a2a.tasks.update(&record.id, |task| {
            task.enter(TaskState::Failed, now);
            task.reason = Some(reason.clone());
            // The client is told to retry: its message sent again starts a new task.
            task.busy = true;
            true
        });
        if let Some(lane) = lane {
            lane.waiting.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        }
        return Err(refused);
    }
    if let Some(lane) = lane {
        // A call with Troupe's context runs until the caller's deadline, counted from
        // its arrival (its wait in the lane included).
        let deadline = accepted
            .troupe
            .is_some()
            .then(|| a2a.app.client.runtime().deadline_in(accepted.timeout));
        let ask = Ask {
            text: accepted.text.clone(),
            timeout_ms: record.timeout_ms,
            deadline,
            chain: troupe.chain,
            depth: troupe.depth,
            trace: Some(accepted.trace),
        };
        spawn_run(a2a, record.id.clone(), agent.to_string(), ask, lane);
    }
    Ok(record)
}

/// What a task asks its agent.
struct Ask {
    text: String,
    /// The task's deadline, in milliseconds from when its turn is handed over...
    timeout_ms: u64,
    /// ...unless it carries the caller's deadline (a call with Troupe's context, made
    /// in this process): then what is left of it.
    deadline: Option<troupe_core::Deadline>,
    /// Troupe's call chain and depth it arrived with: the agent's turn continues them.
    chain: Vec<String>,
    depth: u32,
    /// The trace id its turn runs under.
    trace: Option<TraceId>,
}

impl Ask {
    /// The ask of a stored record (its text from the message it keeps).
    fn of(record: &TaskRecord) -> Self {
        let text = record.request["parts"]
            .as_array()
            .map(|parts| {
                parts
                    .iter()
                    .filter_map(|part| part["text"].as_str())
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .unwrap_or_default();
        Self {
            text,
            timeout_ms: record.timeout_ms,
            deadline: None,
            chain: record.chain.clone(),
            depth: record.depth,
            trace: TraceId::parse_hex(&record.trace_id),
        }
    }
}

/// Takes task `id`'s place in its agent's lane now (see [`Lane::queue`]), then runs it
/// in the background: the one way a task is started, so tasks run in the order they
/// were created or read back.
///
/// The task runs in a span of its own, `a2a_task`: a root, not a child of the request's
/// `http_request` (whose span would then stay open until the task ends). Exported, it
/// is started in the trace the task names (`Ask::trace`), so the task's calls and turns
/// are in that trace, beside the request's span.
fn spawn_run(a2a: &Arc<A2a>, id: String, agent: String, ask: Ask, lane: Arc<Lane>) {
    let turn = lane.queue();
    let span = tracing::info_span!(parent: None, "a2a_task", task = %id, agent = %agent);
    #[cfg(feature = "otel")]
    if let Some(trace) = ask.trace {
        crate::otel::start_in_trace(&span, trace);
    }
    tokio::spawn(run(Arc::clone(a2a), id, agent, ask, lane, turn).instrument(span));
}

/// Runs task `id` in its agent's lane: waits its `turn` (taken by [`spawn_run`]), then
/// hands it to the agent as a Troupe task (durable in the agent's inbox, once: the A2A
/// task id deduplicates it), unless it was canceled meanwhile, and waits for its
/// outcome; the ended record is stored. At shutdown it stops waiting: the next start
/// resumes it.
async fn run(a2a: Arc<A2a>, id: String, agent: String, ask: Ask, lane: Arc<Lane>, turn: LaneTurn) {
    let _turn = turn.await;
    lane.waiting.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    if stopping(&a2a) {
        // Its turn came as the server stops (the task before it gave up waiting): it
        // stays `submitted` in the store, and the next start resumes it.
        return;
    }
    loop {
        match a2a.tasks.start(&id, a2a.app.client.runtime().now()) {
            TaskStart::Started => break,
            // Canceled while it waited (the cancel was stored before it read so), or
            // its agent was deleted: nothing to run or store.
            TaskStart::NotStarted => return,
            // A cancel of it is being stored (within its request's deadline): it runs
            // only if that cancel could not be stored.
            TaskStart::Wait(cancel) => drop(cancel.lock().await),
        }
    }
    let Some(outcome) = outcome(&a2a, &id, &agent, &ask).await else {
        return; // shutting down: resumed at the next start
    };
    let now = a2a.app.client.runtime().now();
    let record = a2a.tasks.update(&id, |task| {
        match outcome {
            Ok(done) => {
                // The error codes of the REST API: a task that failed at or past its
                // deadline timed out; otherwise the agent failed.
                let code = if done.deadline.has_passed(now) {
                    "timeout"
                } else {
                    "agent_failed"
                };
                task.enter(done.state, now);
                task.inner = Some(done.task_id);
                let result = done.result.unwrap_or_default();
                if done.state == TaskState::Completed {
                    task.reply_meta = done
                        .reply
                        .map(|reply| json!({"steps": reply.steps, "usage": reply.usage, "truncated": reply.truncated}));
                    task.reply = Some(result);
                } else if code == "timeout" {
                    // Named by the time its caller gave (`timeout_ms`, clipped to the
                    // server's maximum), as the runtime's own texts are: the agent's
                    // text says only that the deadline passed, and the deadline the
                    // agent got was counted from a later clock reading (until
                    // 2026-12-06 the text named no time).
                    task.reason = Some(format!(
                        "timeout: timed out after {} ms, the timeout its caller gave: {result}",
                        ask.timeout_ms
                    ));
                } else {
                    task.reason = Some(format!("{code}: {result}"));
                }
            }
            Err(error) => not_handed_over(task, &error, now),
        }
        true
    });
    if let Some(record) = record {
        let deadline = a2a.store.background_deadline();
        if let Err(error) = a2a.store.save(&a2a.tasks, &record, &[], deadline).await {
            lost_hold(&a2a, &agent, &error);
            tracing::warn!(task = %id, %error, "could not store an ended A2A task");
        }
    }
}

/// Ends `task`, which its agent did not take (or whose outcome could not be read), with
/// the server's `error`: `rejected` if the agent refused it or does not exist,
/// `failed` otherwise. An error the client may retry (`Retry-After`) makes it end
/// `busy`, keeping the refusal, which a blocking send answers as the server does (a
/// busy agent 429 `busy`, a store down for a moment 503 `storage_unavailable`; until
/// 2026-12-07 every one was 429).
fn not_handed_over(task: &mut TaskRecord, error: &ApiError, now: troupe_core::Deadline) {
    let state = if matches!(error.code, "refused" | "agent_not_found") {
        TaskState::Rejected
    } else {
        TaskState::Failed
    };
    task.enter(state, now);
    task.busy = error.retry_after_s.is_some();
    task.reason = Some(format!("{}: {}", error.code, error.message));
    task.refusal = task.busy.then(|| error.clone());
}

/// Whether the server is shutting down (`serve`'s shutdown began): A2A tasks stop being
/// handed to their agents, and those not ended are resumed at the next start.
fn stopping(a2a: &A2a) -> bool {
    *a2a.app.shutdown.borrow()
}

/// Forgets the agent's record of a task the registry let go (in the background: it
/// waits behind the agent's running turn). A failure leaves the agent's record in
/// place, logged.
fn forget_inner(app: &Arc<AppState>, forgotten: Forgotten) {
    let Some(inner) = forgotten.inner else {
        return; // it ended before its agent had it (rejected, busy, not stored)
    };
    let client = app.client.clone();
    tokio::spawn(async move {
        match client.forget_external(&forgotten.agent, &inner).await {
            Ok(troupe_agent::ExternalForget::Forgotten) => {}
            Ok(troupe_agent::ExternalForget::NotEnded) => {
                tracing::warn!(agent = %forgotten.agent, task = %inner, "an A2A task let go had not ended in its agent");
            }
            Err(error) => {
                tracing::warn!(agent = %forgotten.agent, task = %inner, %error, "could not forget an agent's record of an A2A task");
            }
        }
    });
}

/// Hands task `id` to its agent and waits for the Troupe task to end; `None` if the
/// server shuts down first.
#[allow(
    clippy::disallowed_methods,
    reason = "this crate is empty under the simulator (lib.rs), so its watch waiters' order cannot touch seed replay"
)]
async fn outcome(a2a: &A2a, id: &str, agent: &str, ask: &Ask) -> Option<Result<troupe_agent::ExternalTask, ApiError>> {
    let client = &a2a.app.client;
    let timeout_ms = ask.deadline.map_or(ask.timeout_ms, |deadline| {
        deadline.remaining_ms(client.runtime().now()).max(1)
    });
    let request = troupe_agent::ExternalTaskRequest {
        origin: "a2a".to_string(),
        msg_id: format!("{A2A_MESSAGE_ID_PREFIX}{id}"),
        text: ask.text.clone(),
        timeout_ms: Some(timeout_ms),
        chain: ask.chain.clone(),
        depth: ask.depth,
        attachment: id.to_string(),
        rejected: None,
        trace_id: ask.trace,
    };
    let inner = match client.delegate_external(agent, request).await {
        Ok(inner) => inner,
        // The agent system stopping under the hand-over fails it ("could not schedule
        // inbox work: the runtime has shut down"): not the task's outcome. Until
        // 2026-12-06 it was stored as the task's failure, and a task answered
        // `submitted` came back `failed` after a graceful restart.
        Err(_) if stopping(a2a) => return None,
        Err(error) => return Some(Err(ApiError::from(error))),
    };
    let mut shutdown = a2a.app.shutdown.subscribe();
    let give_up = client.runtime().deadline_in(Duration::from_millis(
        timeout_ms.saturating_add(A2A_TASK_OUTCOME_GRACE_MS),
    ));
    loop {
        match client.external_task(agent, &inner).await {
            Ok(Some(task)) if task.state.is_final() => return Some(Ok(task)),
            Ok(Some(_)) => {}
            Ok(None) => return Some(Err(ApiError::internal(format!("agent {agent:?} lost task {inner:?}")))),
            Err(error) => tracing::warn!(task = %id, %error, "could not read a task's outcome; retrying"),
        }
        if give_up.has_passed(client.runtime().now()) {
            return Some(Err(ApiError::internal(format!(
                "task {inner:?} of agent {agent:?} had no outcome in time"
            ))));
        }
        tokio::select! {
            biased;
            _ = shutdown.wait_for(|stop| *stop) => return None,
            () = tokio::time::sleep(Duration::from_millis(A2A_TASK_POLL_MS)) => {}
        }
    }
}

/// The A2A name of a state.
fn state_name(state: TaskState) -> &'static str {
    match state {
        TaskState::Submitted => "TASK_STATE_SUBMITTED",
        TaskState::Working => "TASK_STATE_WORKING",
        TaskState::InputRequired => "TASK_STATE_INPUT_REQUIRED",
        TaskState::Completed => "TASK_STATE_COMPLETED",
        TaskState::Failed => "TASK_STATE_FAILED",
        TaskState::Canceled => "TASK_STATE_CANCELED",
        TaskState::Rejected => "TASK_STATE_REJECTED",
    }
}

fn agent_message(task: &TaskRecord, suffix: &str, text: &str) -> Value {
    json!({
        "messageId": format!("{}-{suffix}", task.id),
        "contextId": task.context_id,
        "taskId": task.id,
        "role": "ROLE_AGENT",
        "parts": [{"text": text}],
    })
}

/// A time by the runtime's clock (microseconds since the Unix epoch) as A2A writes a
/// status time: RFC 3339 in UTC with six fractional digits, `2026-12-06T06:41:29.123456Z`
/// (protobuf's JSON form of a `Timestamp`, as the `a2a-sdk` reads it), so it reads back
/// to the same microsecond. None past the year 9999, which RFC 3339 cannot write.
fn timestamp_json(micros: u64) -> Option<String> {
    let at = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(micros) * 1_000).ok()?;
    Some(format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:06}Z",
        at.year(),
        u8::from(at.month()),
        at.day(),
        at.hour(),
        at.minute(),
        at.second(),
        at.microsecond()
    ))
}

/// An RFC 3339 time (any offset, any number of fractional digits) in nanoseconds since
/// the Unix epoch (negative before it); None if it is not one.
fn timestamp_parse(text: &str) -> Option<i128> {
    time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339)
        .ok()
        .map(time::OffsetDateTime::unix_timestamp_nanos)
}

fn status_json(task: &TaskRecord) -> Value {
    let mut status = json!({"state": state_name(task.state)});
    if let Some(timestamp) = task.state_since_micros.and_then(timestamp_json) {
        status["timestamp"] = Value::String(timestamp);
    }
    if let Some(reply) = &task.reply {
        status["message"] = agent_message(task, "reply", reply);
    } else if let Some(reason) = &task.reason {
        status["message"] = agent_message(task, "status", reason);
    }
    status
}

fn artifact_json(task: &TaskRecord) -> Option<Value> {
    task.reply.as_ref().map(|reply| {
        json!({
            "artifactId": format!("{}-reply", task.id),
            "name": "reply",
            "parts": [{"text": reply}],
        })
    })
}

fn troupe_metadata(task: &TaskRecord) -> Value {
    let mut troupe = json!({
        "agent": task.agent,
        "chain": task.chain,
        "depth": task.depth,
        "timeout_ms": task.timeout_ms,
    });
    if !task.trace_id.is_empty() {
        troupe["trace_id"] = json!(task.trace_id);
    }
    if let Some(meta) = &task.reply_meta {
        troupe["reply"] = meta.clone();
    }
    json!({ "troupe": troupe })
}

/// A task as A2A JSON: the last `history_length` messages of its history (all if
/// `None`), its artifacts if `artifacts`.
fn task_json(task: &TaskRecord, history_length: Option<i64>, artifacts: bool) -> Value {
    let mut history = vec![task.request.clone()];
    if let Some(reply) = &task.reply {
        history.push(agent_message(task, "reply", reply));
    }
    if let Some(keep) = history_length {
        let keep = usize::try_from(keep).unwrap_or(0);
        history.drain(..history.len().saturating_sub(keep));
    }
    let mut value = json!({
        "id": task.id,
        "contextId": task.context_id,
        "status": status_json(task),
        "history": history,
        "metadata": troupe_metadata(task),
    });
    if artifacts {
        value["artifacts"] = json!(artifact_json(task).into_iter().collect::<Vec<_>>());
    }
    value
}

/// How long a blocking send waits for its task to end.
fn blocking_wait(a2a: &A2a) -> Duration {
    a2a.app
        .config
        .request_timeout
        .saturating_sub(Duration::from_millis(A2A_BLOCKING_HEADROOM_MS))
}

/// `SendMessage`: blocking, the task once it has ended (or, if it takes longer than
/// the server's request timeout allows, as it is); with `returnImmediately`, the task
/// as submitted.
#[allow(
    clippy::disallowed_methods,
    reason = "this crate is empty under the simulator (lib.rs), so its watch waiters' order cannot touch seed replay"
)]
async fn send_message(
    a2a: &Arc<A2a>,
    agent: &str,
    params: &Map<String, Value>,
    id: &Value,
    headers: &HeaderMap,
) -> Result<Response, RpcError> {
    let accepted = accept(a2a, agent, params, headers)?;
    let record = start(a2a, agent, &accepted).await?;
    if !accepted.blocking || record.state.is_final() {
        return Ok(success(
            id,
            json!({"task": task_json(&record, accepted.history_length, true)}),
        ));
    }
    let mut watcher = a2a
        .tasks
        .watch(agent, &record.id)
        .ok_or_else(|| RpcError::new(code::INTERNAL_ERROR, "the task was forgotten at once"))?;
    // Timed out (or the registry dropped it), or the server stops: the task as it is
    // now. At a stop its lane no longer follows it (the next start resumes it), so
    // waiting on would only hold the answer until the shutdown grace cuts the
    // connection (until 2026-12-06 it did: no answer, and the server's exit 10 s late).
    let mut stopping = a2a.app.shutdown.subscribe();
    tokio::select! {
        biased;
        _ = tokio::time::timeout(blocking_wait(a2a), watcher.wait_for(|task| task.state.is_final())) => {}
        _ = stopping.wait_for(|stop| *stop) => {}
    }
    let task = watcher.borrow().clone();
    if task.busy {
        return Err(refused_task(task));
    }
    Ok(success(
        id,
        json!({"task": task_json(&task, accepted.history_length, true)}),
    ))
}

/// The answer to a blocking send whose task ended with a refusal to retry
/// ([`TaskRecord::busy`]): the server's refusal it ended with (a busy agent 429, a store
/// down for a moment 503 `storage_unavailable`, each with [`code::BUSY`] and
/// `Retry-After`), or 429 if the record does not keep it.
fn refused_task(task: TaskRecord) -> RpcError {
    match task.refusal {
        Some(refusal) => {
            let mut error = RpcError::refusal(refusal);
            if let Some(reason) = task.reason {
                error.message = reason;
            }
            error
        }
        None => RpcError::retry(
            StatusCode::TOO_MANY_REQUESTS,
            task.reason.unwrap_or_else(|| "busy".to_string()),
        ),
    }
}

/// `SendStreamingMessage`: SSE of the task, its status updates, its reply artifact,
/// and its final status; then the stream ends.
async fn send_streaming(
    a2a: &Arc<A2a>,
    agent: &str,
    params: &Map<String, Value>,
    id: &Value,
    headers: &HeaderMap,
) -> Result<Response, RpcError> {
    let accepted = accept(a2a, agent, params, headers)?;
    // Taken before the task is made: a stream over the limit starts nothing.
    let slot = stream_slot(a2a)?;
    let record = start(a2a, agent, &accepted).await?;
    let watcher = a2a
        .tasks
        .watch(agent, &record.id)
        .ok_or_else(|| RpcError::new(code::INTERNAL_ERROR, "the task was forgotten at once"))?;
    Ok(task_stream(a2a, watcher, record, id.clone(), slot))
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct TaskIdParams {
    id: String,
    history_length: Option<i64>,
}

/// `GetTask`.
fn get_task(a2a: &A2a, agent: &str, params: &Map<String, Value>) -> Result<Value, RpcError> {
    let params: TaskIdParams = parse(params)?;
    if params.history_length.is_some_and(|length| length < 0) {
        return Err(RpcError::params("\"historyLength\" must not be negative"));
    }
    let task = a2a
        .tasks
        .get(agent, &params.id)
        .ok_or_else(|| RpcError::task_not_found(agent, &params.id))?;
    Ok(task_json(&task, params.history_length, true))
}

/// `CancelTask`: a task still waiting for its turn is canceled; one that runs or has
/// ended is not cancelable. A cancel that cannot be stored is answered as every method
/// answers a store failure ([`RpcError::store`]: a store down for a moment is 503
/// `storage_unavailable` with `Retry-After`; until 2026-12-07 it was -32603).
///
/// Stored before it is published ([`TaskRegistry::cancel`]): until it is stored the
/// task reads as it was, its watchers are told nothing, and its lane does not start it.
/// A cancel that could not be stored did not happen: the task is left waiting (and
/// runs when its turn comes, unless canceled again), so the same `CancelTask` sent
/// again once the store is back cancels it and is answered as a first cancel is (until
/// 2026-12-07 the cancel was published first: after the 503 the task read canceled
/// while the store did not have it, and the cancel sent again was refused -32002).
/// Only a waiting task is canceled, never handed to its agent: there is no turn to
/// stop, so nothing the agent did is lost or hidden by the answer. The store write and
/// its publication run in a task of their own: a client that hangs up meanwhile does
/// not leave a cancel stored and not published (or the reverse).
async fn cancel_task(a2a: &Arc<A2a>, agent: &str, params: &Map<String, Value>) -> Result<Value, RpcError> {
    let params: TaskIdParams = parse(params)?;
    let deadline = a2a.store.deadline_in(blocking_wait(a2a));
    loop {
        let begun = match a2a.tasks.cancel(agent, &params.id, a2a.app.client.runtime().now()) {
            CancelOutcome::Begun(begun) => begun,
            // Another cancel of it is being stored (within its own request's deadline,
            // no later than this one's): ask again once it is finished.
            CancelOutcome::Pending(other) => {
                drop(other.lock().await);
                continue;
            }
            CancelOutcome::NotCancelable(task) => return Err(not_cancelable(&task)),
            CancelOutcome::NotFound => return Err(RpcError::task_not_found(agent, &params.id)),
        };
        let a2a = Arc::clone(a2a);
        let agent = agent.to_string();
        let stored = tokio::spawn(async move {
            let saved = a2a.store.save(&a2a.tasks, &begun.record, &[], deadline).await;
            if let Err(error) = &saved {
                lost_hold(&a2a, &agent, error);
            }
            let task = a2a.tasks.finish_cancel(begun, saved.is_ok());
            saved.map(|()| task)
        })
        .await
        .map_err(|error| RpcError::new(code::INTERNAL_ERROR, format!("the cancel's store write ended: {error}")))?;
        let task = stored.map_err(|error| {
            RpcError::store(
                &error,
                format!(
                    "the cancel could not be stored, so the task was not canceled (it still waits for its turn); send \
                     CancelTask again: {error}"
                ),
            )
        })?;
        return Ok(task_json(&task, None, true));
    }
}

/// The refusal of a cancel of `task`, which runs or has ended.
fn not_cancelable(task: &TaskRecord) -> RpcError {
    RpcError::new(
        code::TASK_NOT_CANCELABLE,
        if task.state.is_final() {
            format!("task {:?} has already ended ({})", task.id, task.state.as_str())
        } else {
            format!(
                "task {:?} is working: its turn runs to its end (Troupe does not stop a running turn)",
                task.id
            )
        },
    )
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ListParams {
    context_id: Option<String>,
    status: Option<Value>,
    page_size: Option<i64>,
    page_token: Option<String>,
    history_length: Option<i64>,
    include_artifacts: Option<bool>,
    status_timestamp_after: Option<Value>,
}

/// The first character of a `ListTasks` page token. A token of a version before
/// 2026-12-06 (a task number, `{seq}` or `{seq}.{node}`) begins with a digit.
const PAGE_TOKEN_TAG: char = 'c';

/// The `ListTasks` page token after `place` (the last task of a page): a keyset cursor,
/// `c{micros}.{id}` (`c.{id}` for a task without a status time), the id in lowercase
/// hex (an agent id may hold any character but `/` and control characters).
fn page_token(place: ListPlace<'_>) -> String {
    use std::fmt::Write as _;
    let mut token = String::from(PAGE_TOKEN_TAG);
    if let Some(micros) = place.micros() {
        let _ = write!(token, "{micros}");
    }
    token.push('.');
    for byte in place.id().bytes() {
        let _ = write!(token, "{byte:02x}");
    }
    token
}

/// The cursor a page token holds: the status time (None: the task had none) and the id
/// of the last task of the page before. Only a token [`page_token`] writes is read
/// (anything else is invalid params naming it); a number, the token of a version before
/// 2026-12-06 (which listed by task number), is refused saying so.
fn page_cursor(token: &str) -> Result<(Option<u64>, String), RpcError> {
    let refused = || RpcError::params(format!("\"pageToken\" {token:?} is not one this server gave"));
    let number = token.split('.').next().unwrap_or_default();
    if !number.is_empty() && number.bytes().all(|byte| byte.is_ascii_digit()) {
        return Err(RpcError::params(format!(
            "\"pageToken\" {token:?} is not one this server gave: it is a task number, the page token of a \
             Troupe server before 2026-12-06; tasks are now listed by status time, most recent first \
             (as the a2a-sdk lists them): list again from the first page, without a pageToken"
        )));
    }
    let (micros, id) = token
        .strip_prefix(PAGE_TOKEN_TAG)
        .and_then(|rest| rest.split_once('.'))
        .ok_or_else(refused)?;
    let micros = match micros {
        "" => None,
        digits => Some(digits.parse::<u64>().map_err(|_| refused())?),
    };
    if id.is_empty() || id.len() % 2 != 0 || !id.bytes().all(|byte| byte.is_ascii_hexdigit()) {
        return Err(refused());
    }
    let bytes = (0..id.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(&id[at..at + 2], 16))
        .collect::<Result<Vec<u8>, _>>()
        .map_err(|_| refused())?;
    let id = String::from_utf8(bytes).map_err(|_| refused())?;
    // One spelling only: what `page_token` writes (no leading zeros, lowercase hex).
    if page_token(ListPlace::new(micros, &id)) != token {
        return Err(refused());
    }
    Ok((micros, id))
}

/// `ListTasks`: the agent's tasks a page at a time, in the `a2a-sdk`'s order
/// ([`ListPlace`]): the task whose state changed last first, tasks without a status
/// time (stored by a version before it was kept) last, ties by task id, greatest first.
/// The page token is a keyset cursor, the place of the page's last task: the next page
/// holds the tasks strictly after it, wherever that task is now. So while the agent's
/// tasks keep their places a walk through the pages lists each once, in order; a task
/// whose state changes during the walk moves to the front (a new status time): listed
/// before the change, it is not listed again; not listed yet, it is skipped (a
/// `statusTimestampAfter` query finds it). A task whose place moves back (a task read
/// back after a restart that was `working`, listed at its `submitted` time) may be
/// listed twice. With `statusTimestampAfter`, only those whose status time is at or
/// after it (as the `a2a-sdk`'s own task stores compare); a task without one is left
/// out.
fn list_tasks(a2a: &A2a, agent: &str, params: &Map<String, Value>) -> Result<Value, RpcError> {
    let params: ListParams = parse(params)?;
    let since_nanos = match &params.status_timestamp_after {
        None => None,
        Some(Value::String(text)) => Some(timestamp_parse(text).ok_or_else(|| {
            RpcError::params(format!(
                "\"statusTimestampAfter\" {text:?} is not an RFC 3339 time (e.g. \"2026-12-06T06:41:29.123Z\")"
            ))
        })?),
        Some(other) => {
            return Err(RpcError::params(format!(
                "\"statusTimestampAfter\" must be an RFC 3339 time string, got {other}"
            )))
        }
    };
    let page_size = match params.page_size {
        None => A2A_LIST_TASKS_PAGE_DEFAULT,
        Some(size) => match usize::try_from(size) {
            Ok(size) if (1..=A2A_LIST_TASKS_PAGE_MAX).contains(&size) => size,
            _ => {
                return Err(RpcError::params(format!(
                    "\"pageSize\" must be between 1 and {A2A_LIST_TASKS_PAGE_MAX}, got {size}"
                )))
            }
        },
    };
    if params.history_length.is_some_and(|length| length < 0) {
        return Err(RpcError::params("\"historyLength\" must not be negative"));
    }
    let status = match &params.status {
        None => None,
        Some(Value::String(name)) if name == "TASK_STATE_UNSPECIFIED" => None,
        Some(Value::String(name)) => Some(
            [
                TaskState::Submitted,
                TaskState::Working,
                TaskState::InputRequired,
                TaskState::Completed,
                TaskState::Failed,
                TaskState::Canceled,
                TaskState::Rejected,
            ]
            .into_iter()
            .find(|state| state_name(*state) == name)
            .ok_or_else(|| RpcError::params(format!("\"status\" {name:?} is not a task state")))?,
        ),
        Some(other) => {
            return Err(RpcError::params(format!(
                "\"status\" must be a state name, got {other}"
            )))
        }
    };
    let after = match params.page_token.as_deref() {
        None | Some("") => None,
        Some(token) => Some(page_cursor(token)?),
    };
    let matching = a2a.tasks.list(agent, |task| {
        params
            .context_id
            .as_deref()
            .is_none_or(|context| context.is_empty() || task.context_id == context)
            && status.is_none_or(|state| task.state == state)
            && since_nanos.is_none_or(|since| {
                task.state_since_micros
                    .is_some_and(|micros| i128::from(micros) * 1_000 >= since)
            })
    });
    let total = matching.len();
    let start = match &after {
        None => 0,
        Some((micros, id)) => {
            let after = ListPlace::new(*micros, id);
            matching
                .iter()
                .position(|task| task.list_place() < after)
                .unwrap_or(total)
        }
    };
    let end = start.saturating_add(page_size).min(total);
    let page = &matching[start..end];
    let next = match page.last() {
        Some(last) if end < total => page_token(last.list_place()),
        _ => String::new(),
    };
    let artifacts = params.include_artifacts.unwrap_or(false);
    let tasks: Vec<Value> = page
        .iter()
        .map(|task| task_json(task, params.history_length, artifacts))
        .collect();
    Ok(json!({
        "tasks": tasks,
        "nextPageToken": next,
        "pageSize": page_size,
        "totalSize": total,
    }))
}

/// `SubscribeToTask`: SSE of a task that has not ended: the task as it is, then its
/// updates until it ends.
fn subscribe(a2a: &Arc<A2a>, agent: &str, params: &Map<String, Value>, id: &Value) -> Result<Response, RpcError> {
    let params: TaskIdParams = parse(params)?;
    let watcher = a2a
        .tasks
        .watch(agent, &params.id)
        .ok_or_else(|| RpcError::task_not_found(agent, &params.id))?;
    let record = watcher.borrow().clone();
    if record.state.is_final() {
        return Err(RpcError::new(
            code::UNSUPPORTED_OPERATION,
            format!(
                "task {:?} has ended ({}): nothing more to stream; GetTask reads it",
                record.id,
                record.state.as_str()
            ),
        ));
    }
    let slot = stream_slot(a2a)?;
    Ok(task_stream(a2a, watcher, record, id.clone(), slot))
}

/// A slot among the server's open streams (`server::stream_slot`), or the retryable
/// 503 refusal.
fn stream_slot(a2a: &A2a) -> Result<OwnedSemaphorePermit, RpcError> {
    crate::server::stream_slot(&a2a.app).map_err(|message| RpcError::retry(StatusCode::SERVICE_UNAVAILABLE, message))
}

/// What a task stream follows.
struct Follower {
    id: Value,
    watcher: watch::Receiver<TaskRecord>,
    shutdown: watch::Receiver<bool>,
    last: TaskState,
    ready: VecDeque<Value>,
    done: bool,
    /// The stream's slot among the open streams: freed when the stream ends or its
    /// client goes away, both of which drop it.
    _slot: OwnedSemaphorePermit,
}

impl Follower {
    fn event(&self, result: Value) -> Event {
        Event::default().data(json!({"jsonrpc": "2.0", "id": self.id, "result": result}).to_string())
    }

    /// Queues what changed since the last state sent.
    fn changed(&mut self, task: &TaskRecord) {
        if task.state == self.last {
            return;
        }
        self.last = task.state;
        if task.state.is_final() {
            if let Some(artifact) = artifact_json(task) {
                self.ready.push_back(json!({"artifactUpdate": {
                    "taskId": task.id,
                    "contextId": task.context_id,
                    "artifact": artifact,
                    "lastChunk": true,
                }}));
            }
            self.done = true;
        }
        self.ready.push_back(json!({"statusUpdate": {
            "taskId": task.id,
            "contextId": task.context_id,
            "status": status_json(task),
            "metadata": troupe_metadata(task),
        }}));
    }

    #[allow(
        clippy::disallowed_methods,
        reason = "this crate is empty under the simulator (lib.rs), so its watch waiters' order cannot touch seed replay"
    )]
    async fn next(&mut self) -> Option<Event> {
        loop {
            if let Some(result) = self.ready.pop_front() {
                return Some(self.event(result));
            }
            if self.done {
                return None;
            }
            let changed = tokio::select! {
                biased;
                changed = self.watcher.changed() => changed,
                _ = self.shutdown.wait_for(|stop| *stop) => return None,
            };
            changed.ok()?;
            let task = self.watcher.borrow_and_update().clone();
            self.changed(&task);
        }
    }
}

/// The SSE of one task: the task itself first, then its changes until it ends.
fn task_stream(
    a2a: &A2a,
    mut watcher: watch::Receiver<TaskRecord>,
    first: TaskRecord,
    id: Value,
    slot: OwnedSemaphorePermit,
) -> Response {
    watcher.mark_unchanged();
    let mut follower = Follower {
        id,
        watcher,
        shutdown: a2a.app.shutdown.subscribe(),
        last: first.state,
        ready: VecDeque::from([json!({"task": task_json(&first, None, true)})]),
        done: first.state.is_final(),
        _slot: slot,
    };
    // A change between `first` and the watcher's mark would be lost: catch it up.
    let now = follower.watcher.borrow().clone();
    follower.changed(&now);
    let stream = futures::stream::unfold(follower, |mut follower| async move {
        let event = follower.next().await?;
        Some((Ok::<_, Infallible>(event), follower))
    });
    Sse::new(stream).keep_alive(KeepAlive::default()).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: a `ListTasks` page token reads back to the place it was written for, whatever
    /// the task id holds (an agent id may hold spaces, `?`, `#`, `.`, any letter) and with
    /// or without a status time; a token whose id is not UTF-8 is refused, not misread.
    #[test]
    fn a_page_token_reads_back_to_the_place_it_was_written_for() {
        for id in ["echo-task-0", "echo #2?.x-task-h1-7", "éé-task-1", "🤖-task-12"] {
            for micros in [None, Some(0), Some(1_796_000_000_123_456), Some(u64::MAX)] {
                let token = page_token(ListPlace::new(micros, id));
                assert!(token.starts_with(PAGE_TOKEN_TAG), "{token}");
                let (read_micros, read_id) = page_cursor(&token).unwrap_or_else(|_| panic!("{token} is refused"));
                assert_eq!((read_micros, read_id.as_str()), (micros, id), "{token}");
            }
        }
        assert!(page_cursor("c1.ff").is_err(), "not UTF-8");
        assert!(page_cursor("c.").is_err(), "no id");
    }

    /// A task of agent `echo` as `run` holds it when its hand-over is tried.
    fn working_task() -> TaskRecord {
        TaskRecord {
            inner: None,
            ..crate::a2a_tasks::tests::record(1, TaskState::Working)
        }
    }

    /// The status, `Retry-After` and JSON body of `response`.
    async fn read(response: Response) -> (StatusCode, Option<String>, Value) {
        let status = response.status();
        let retry_after = response
            .headers()
            .get(header::RETRY_AFTER)
            .map(|value| value.to_str().unwrap().to_string());
        let body = axum::body::to_bytes(response.into_body(), usize::MAX).await.unwrap();
        (status, retry_after, serde_json::from_slice(&body).unwrap())
    }

    /// Goal: a blocking `SendMessage` whose task could not be handed over because the
    /// store was down for a moment (the agent's inbox write failed with
    /// `StorageFailed { Unavailable }` past the task's deadline) is answered 503 with
    /// JSON-RPC code -32000 and `Retry-After`, as every route answers a store down for a
    /// moment (`storage_unavailable`, the code a notification's refusal carries); a busy
    /// agent stays 429. Until 2026-12-07 both were 429, from the task's busy flag alone.
    /// Method: the server's own error of each `InvokeError` ([`ApiError::from`]) through
    /// the task's end (`not_handed_over`, what `run` does) and the blocking send's
    /// answer (`refused_task`). Below the route: a stopped PostgreSQL cannot be stopped
    /// between a task's save and its hand-over, which use the same store (the save
    /// fails first; that path is tested end to end in
    /// crates/troupe-cli/tests/node_store_unavailable.rs).
    #[tokio::test]
    async fn a_task_not_handed_over_for_a_store_down_for_a_moment_is_answered_503_and_a_busy_agent_429() {
        let target = troupe_core::ActorId::new("agent", "echo").unwrap();
        let unavailable = troupe_core::InvokeError::StorageFailed {
            target: target.clone(),
            source: StoreError::Unavailable {
                operation: troupe_core::StoreOperation::Claim,
                cause: "connection refused".to_string(),
            },
        };
        let busy = troupe_core::InvokeError::Busy { target, capacity: 64 };
        let retry_after = SERVER_RETRY_AFTER_S.to_string();
        for (error, status, refusal) in [
            (unavailable, StatusCode::SERVICE_UNAVAILABLE, "storage_unavailable"),
            (busy, StatusCode::TOO_MANY_REQUESTS, "busy"),
        ] {
            let mut task = working_task();
            not_handed_over(
                &mut task,
                &ApiError::from(&error),
                troupe_core::Deadline::from_micros(1),
            );
            assert!(task.busy, "{error}: a refusal to retry");
            assert_eq!(task.state, TaskState::Failed, "{error}");
            let (answered, header, body) = read(refused_task(task.clone()).answer(&json!(7))).await;
            assert_eq!(
                (answered, header.as_deref()),
                (status, Some(retry_after.as_str())),
                "{error}: {body}"
            );
            assert_eq!(body["id"], 7, "{body}");
            assert_eq!(body["error"]["code"], code::BUSY, "{body}");
            let message = body["error"]["message"].as_str().unwrap();
            assert!(message.starts_with(refusal), "{error}: {message}");
            assert!(message.contains(&error.to_string()), "{error}: {message}");
            // As a notification's refusal: the server's error shape, with the code.
            let (answered, _, body) = read(notified("SendMessage", Err(refused_task(task)))).await;
            assert_eq!((answered, &body["error"]["code"]), (status, &json!(refusal)), "{body}");
        }
    }

    /// Goal: an A2A task that cannot be stored, or whose numbers cannot be reserved,
    /// because the store is down for a moment is refused 503 `storage_unavailable`
    /// (JSON-RPC -32000, `Retry-After`); any other store failure stays 503 `overloaded`
    /// (until 2026-12-07 both were `overloaded`). Method: `RpcError::store` of each
    /// `StoreError`, answered as a notification and as a request.
    #[tokio::test]
    async fn a_task_store_down_for_a_moment_is_refused_storage_unavailable_and_other_store_failures_overloaded() {
        let unavailable = StoreError::Unavailable {
            operation: troupe_core::StoreOperation::Commit,
            cause: "connection refused".to_string(),
        };
        let backend = StoreError::Backend {
            operation: troupe_core::StoreOperation::Commit,
            cause: "relation does not exist".to_string(),
        };
        for (error, refusal) in [(unavailable, "storage_unavailable"), (backend, "overloaded")] {
            let refused = || RpcError::store(&error, format!("the task could not be stored: {error}"));
            let (status, retry_after, body) = read(notified("SendMessage", Err(refused()))).await;
            assert_eq!(
                (status, retry_after.as_deref(), &body["error"]["code"]),
                (StatusCode::SERVICE_UNAVAILABLE, Some("1"), &json!(refusal)),
                "{error}: {body}"
            );
            let (status, _, body) = read(refused().answer(&json!(1))).await;
            assert_eq!(
                (status, &body["error"]["code"]),
                (StatusCode::SERVICE_UNAVAILABLE, &json!(code::BUSY)),
                "{body}"
            );
        }
    }
}
