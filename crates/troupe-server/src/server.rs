//! The router, its middleware (metrics, auth, concurrency, timeout, body limit) and
//! [`serve`] with graceful shutdown.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures::StreamExt as _;
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tracing::Instrument as _;
use troupe_agent::AgentClient;

use crate::config::{ServeError, ServerConfig};
use crate::error::ApiError;
use crate::limits::{
    SERVER_ACCEPT_RETRY_MS, SERVER_CONNECTIONS_FULL_WARN_MS, SERVER_EVENT_STREAMS_MAX, SERVER_HEADER_READ_MS,
    SERVER_PLAIN_ERROR_TEXT_MAX_BYTES, SERVER_REQUEST_BODY_DRAIN_MAX_BYTES, SERVER_REQUEST_BODY_DRAIN_MS,
    SERVER_REQUEST_BODY_READ_MS, SERVER_REQUEST_BODY_SIZE_MAX_BYTES, SERVER_SHUTDOWN_GRACE_MS,
};
use crate::metrics::Metrics;
use crate::{a2a, agents, conversations, events, openai_compat, org, topology};

/// What every handler shares.
pub(crate) struct AppState {
    pub(crate) client: AgentClient,
    pub(crate) config: ServerConfig,
    pub(crate) metrics: Metrics,
    /// One permit per request being handled.
    pub(crate) requests: Arc<Semaphore>,
    /// One permit per open streamed answer (a streamed message, a streamed chat
    /// completion, an A2A stream): see
    /// [`stream_slot`].
    pub(crate) streams: Arc<Semaphore>,
    /// One permit per open `/v1/events` stream.
    pub(crate) event_streams: Arc<Semaphore>,
    /// Set to `true` when the server shuts down: event streams end.
    pub(crate) shutdown: watch::Sender<bool>,
    /// Serializes the server's changes to one agent's definition (create, update,
    /// delete), by its id, so "create" of an existing id is refused, never an overwrite,
    /// and a replace racing with a delete cannot put the agent back. By id: a delete
    /// waits for the agent's running turn, and a change to another agent must not wait
    /// for it (until 2026-12-06 one lock for all agents made every create, replace and
    /// delete wait for it).
    pub(crate) directory_writes: crate::keyed_lock::KeyedLocks,
    /// Numbers the OpenAI-compatible completions (`chatcmpl-troupe-N`).
    pub(crate) completions: AtomicU64,
    /// Numbers the HTTP requests (the `id` of their `http_request` span), from 1.
    pub(crate) requests_seen: AtomicU64,
    /// The A2A routes' state, set when they are made (weak: it holds this state).
    pub(crate) a2a: std::sync::OnceLock<std::sync::Weak<a2a::A2a>>,
    /// The connections served, when [`serve`] serves this state (a router served
    /// otherwise counts its connections elsewhere, if at all): `/metrics` shows them as
    /// `troupe_http_connections_open`.
    pub(crate) connections: std::sync::OnceLock<Arc<Connections>>,
}

/// The HTTP API over `client`, configured by `config`: every route, with the error
/// shape, auth, limits and metrics. Event streams it serves end only when their client
/// goes away; [`serve`] also ends them at shutdown.
///
/// The configuration is not checked against an address here: [`serve`] does that.
pub fn router(client: AgentClient, config: ServerConfig) -> Router {
    build(client, config).0
}

fn build(client: AgentClient, config: ServerConfig) -> (Router, Arc<AppState>) {
    let state = Arc::new(AppState {
        client,
        // `serve` refuses more than SERVER_CONCURRENT_REQUESTS_MAX; a router built
        // without it (`router`) must not panic in `Semaphore::new` either, and no server
        // reaches tokio's bound of permits (2^61) in requests at once.
        requests: Arc::new(Semaphore::new(
            config.concurrent_requests_max.min(Semaphore::MAX_PERMITS),
        )),
        // As for `requests`: `serve` refuses more than SERVER_STREAMS_OPEN_MAX.
        streams: Arc::new(Semaphore::new(config.streams_open_max.min(Semaphore::MAX_PERMITS))),
        config,
        metrics: Metrics::default(),
        event_streams: Arc::new(Semaphore::new(SERVER_EVENT_STREAMS_MAX)),
        shutdown: watch::channel(false).0,
        directory_writes: crate::keyed_lock::KeyedLocks::default(),
        completions: AtomicU64::new(0),
        requests_seen: AtomicU64::new(0),
        a2a: std::sync::OnceLock::new(),
        connections: std::sync::OnceLock::new(),
    });
    let api = Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/agents", get(agents::list).post(agents::create))
        .route(
            "/v1/agents/{id}",
            get(agents::get_one).put(agents::update).delete(agents::delete),
        )
        .route("/v1/agents/{id}/messages", post(agents::message))
        .route("/v1/agents/{id}/history", get(agents::history))
        .route("/v1/agents/{id}/notify", post(agents::notify))
        .route("/v1/agents/{id}/tasks", post(agents::delegate))
        .route("/v1/agents/{id}/tasks/{task}", get(agents::task))
        .route("/v1/agents/{id}/tasks/{task}/cancel", post(agents::cancel))
        .route("/v1/agents/{id}/conversations", get(conversations::of_agent))
        .route("/v1/conversations", post(conversations::create))
        .route("/v1/conversations/{id}", get(conversations::definition))
        .route(
            "/v1/conversations/{id}/messages",
            get(conversations::messages).post(conversations::post),
        )
        .route("/v1/events", get(events::events))
        .route("/v1/chat/completions", post(openai_compat::chat_completions))
        .route("/v1/models", get(openai_compat::models))
        .route("/v1/models/{model}", get(openai_compat::retrieve_model))
        .merge(org::routes())
        .merge(a2a::routes(Arc::clone(&state)))
        .merge(topology::routes(&state.client))
        .fallback(not_found)
        // Layers run outside in: the last added runs first.
        .layer(middleware::from_fn(read_body))
        .layer(middleware::from_fn_with_state(Arc::clone(&state), limit))
        .layer(middleware::from_fn_with_state(Arc::clone(&state), authenticate))
        .layer(middleware::from_fn_with_state(Arc::clone(&state), observe))
        .with_state(Arc::clone(&state));
    (api, state)
}

/// Serves `client` on `listener` until `shutdown` completes; then accepts no new
/// connection, lets the requests in flight finish for up to
/// [`SERVER_SHUTDOWN_GRACE_MS`] (event streams end at once) and returns. The agent
/// system is left running: the caller shuts it down afterwards.
///
/// # Errors
/// [`ServeError`] if the configuration does not allow this address
/// ([`ServerConfig::check_bind`]) or serving fails.
#[allow(
    clippy::disallowed_methods,
    reason = "this crate is empty under the simulator (lib.rs), so its watch waiters' order cannot touch seed replay"
)]
pub async fn serve(
    listener: TcpListener,
    client: AgentClient,
    config: ServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    config.check_bind(listener.local_addr()?)?;
    let connections = Arc::new(Connections::new(config.connections_max));
    let (app, state) = build(client, config);
    let _ = state.connections.set(Arc::clone(&connections));
    let mut stopping = state.shutdown.subscribe();
    let stopped = async move {
        // `changed` fails only if the sender is gone, which `state` prevents.
        let _ = stopping.wait_for(|stop| *stop).await;
    };
    let server = serve_connections(listener, app, stopped, connections);
    let trigger = async {
        shutdown.await;
        tracing::info!("shutting down: no new connections; requests in flight may finish");
        state.shutdown.send_replace(true);
        tokio::time::sleep(Duration::from_millis(SERVER_SHUTDOWN_GRACE_MS)).await;
    };
    tokio::select! {
        biased;
        served = server => served?,
        () = trigger => tracing::warn!(grace_ms = SERVER_SHUTDOWN_GRACE_MS, "requests still in flight at the end of the shutdown grace were cut"),
    }
    Ok(())
}

/// Serves `app` over HTTP/1.1 on `listener` until `shutdown` completes; then accepts no
/// new connection, asks every open one to close after its request in flight
/// (keep-alive off) and returns once all are closed. As `axum::serve(..)
/// .with_graceful_shutdown(..)`, with hyper's header read timeout in force (axum's
/// `serve` sets no timer, so it never applied): a connection that has not sent a whole
/// request head within [`SERVER_HEADER_READ_MS`], or stays idle that long between two
/// requests, is closed. Until 2026-12-06 such a connection was held for good, and
/// enough of them would exhaust the process's file descriptors.
///
/// At most `connections_max` connections (at least one) are served at once: past it no
/// new connection is accepted until one closes, and the connections asking wait in the
/// kernel's listen backlog, unanswered (an idle one closes within
/// [`SERVER_HEADER_READ_MS`]); a `warn` line says so, at most every
/// [`SERVER_CONNECTIONS_FULL_WARN_MS`]. Until 2026-12-07 every connection was accepted,
/// and a flood of idle ones used up the process's file descriptors, which its store,
/// etcd and model clients need too.
///
/// Public so that another HTTP API (`troupe node`'s) is served by the same rules.
///
/// # Errors
/// None so far: a failed accept (out of file descriptors, ...) is logged and tried
/// again [`SERVER_ACCEPT_RETRY_MS`] later, as axum does; the `Result` is axum's.
pub async fn serve_http(
    listener: TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
    connections_max: usize,
) -> std::io::Result<()> {
    let connections = Arc::new(Connections::new(connections_max));
    // `/metrics` of a [`router`] in `app` finds the count here (`troupe node`'s; until
    // 2026-12-07 it showed no `troupe_http_connections_open`).
    let app = app.layer(axum::Extension(Arc::clone(&connections)));
    serve_connections(listener, app, shutdown, connections).await
}

/// The connections [`serve_http`] serves: a slot each, at most as many as it allows.
pub(crate) struct Connections {
    /// One permit per connection served (and one held by the accept loop while it waits
    /// for the next connection).
    slots: Arc<Semaphore>,
    /// The connections open.
    open: AtomicU64,
}

impl Connections {
    /// Room for `max` connections (at least one).
    fn new(max: usize) -> Self {
        Self {
            slots: Arc::new(Semaphore::new(max.clamp(1, Semaphore::MAX_PERMITS))),
            open: AtomicU64::new(0),
        }
    }

    /// The connections open now.
    pub(crate) fn open(&self) -> u64 {
        self.open.load(Ordering::Relaxed)
    }
}

/// One connection's place among the [`Connections`]: given back when dropped.
struct ConnectionSlot {
    _permit: OwnedSemaphorePermit,
    connections: Arc<Connections>,
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.connections.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// [`serve_http`] with a slot of `connections` per connection served.
#[allow(
    clippy::disallowed_methods,
    reason = "this crate is empty under the simulator (lib.rs), so its clock cannot touch seed replay"
)]
async fn serve_connections(
    listener: TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
    connections: Arc<Connections>,
) -> std::io::Result<()> {
    // Every connection's task holds a sender: once all are dropped, all are closed.
    let (open, mut all_closed) = tokio::sync::mpsc::channel::<()>(1);
    let closing = Arc::new(Closing::default());
    let mut shutdown = std::pin::pin!(shutdown);
    let mut warned: Option<tokio::time::Instant> = None;
    loop {
        // Room for one more connection first: at the cap, the next waits in the backlog.
        let permit = match Arc::clone(&connections.slots).try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                let warn_every = Duration::from_millis(SERVER_CONNECTIONS_FULL_WARN_MS);
                if warned.is_none_or(|at| at.elapsed() >= warn_every) {
                    warned = Some(tokio::time::Instant::now());
                    tracing::warn!(
                        "serving as many connections as allowed (connections_max, troupe serve \
                         --max-connections): new connections wait until one closes"
                    );
                }
                tokio::select! {
                    biased;
                    () = &mut shutdown => break,
                    permit = Arc::clone(&connections.slots).acquire_owned() => match permit {
                        Ok(permit) => permit,
                        // Never closed: nothing more to serve.
                        Err(_) => break,
                    },
                }
            }
        };
        let accepted = tokio::select! {
            biased;
            () = &mut shutdown => break,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            // The connection was gone before it was accepted: nothing to do.
            Err(error) if is_connection_error(&error) => continue,
            Err(error) => {
                tracing::error!(%error, "accepting a connection failed; trying again");
                tokio::time::sleep(Duration::from_millis(SERVER_ACCEPT_RETRY_MS)).await;
                continue;
            }
        };
        connections.open.fetch_add(1, Ordering::Relaxed);
        let slot = ConnectionSlot {
            _permit: permit,
            connections: Arc::clone(&connections),
        };
        tokio::spawn(serve_connection(
            stream,
            app.clone(),
            Arc::clone(&closing),
            open.clone(),
            slot,
        ));
    }
    drop(listener);
    closing.start();
    drop(open);
    let _ = all_closed.recv().await;
    Ok(())
}

/// Whether a failed accept concerns that connection only (as axum tells them apart).
fn is_connection_error(error: &std::io::Error) -> bool {
    matches!(
        error.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
    )
}

/// The shutdown of [`serve_http`], seen by every connection.
#[derive(Default)]
struct Closing {
    started: std::sync::atomic::AtomicBool,
    notify: tokio::sync::Notify,
}

impl Closing {
    fn start(&self) {
        self.started.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    /// Completes once the shutdown has started.
    async fn started(&self) {
        loop {
            let notified = self.notify.notified();
            if self.started.load(Ordering::SeqCst) {
                return;
            }
            notified.await;
        }
    }
}

/// One connection of [`serve_http`]: HTTP/1.1 with the header read timeout, asked to
/// close gracefully once the shutdown starts; `_open` and `_slot` (its place among the
/// connections served) are dropped when it is closed.
async fn serve_connection(
    stream: tokio::net::TcpStream,
    app: Router,
    closing: Arc<Closing>,
    _open: tokio::sync::mpsc::Sender<()>,
    _slot: ConnectionSlot,
) {
    let service = hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
        let mut app = app.clone();
        // A router is always ready: no poll_ready needed before `call`.
        tower::Service::call(&mut app, request.map(Body::new))
    });
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(Duration::from_millis(SERVER_HEADER_READ_MS));
    let connection = http.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
    let mut connection = std::pin::pin!(connection);
    let mut asked_to_close = false;
    loop {
        tokio::select! {
            biased;
            served = connection.as_mut() => {
                if let Err(error) = served {
                    tracing::debug!(%error, "a connection ended with an error");
                }
                return;
            }
            () = closing.started(), if !asked_to_close => {
                asked_to_close = true;
                connection.as_mut().graceful_shutdown();
            }
        }
    }
}

/// Counts every answer by route and status, gives every error the one JSON shape
/// (errors made outside the handlers, such as axum's 405, come as
/// plain text), and runs the request in an `info` span `http_request` (`id`, `method`,
/// `route`, then `status` and `latency_us` once answered): the runtime's `invoke` →
/// `turn` → `model_call`/`tool_call` spans of the request are its descendants. The
/// latency is to the response headers (a streamed body goes on after it).
async fn observe(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let method = request.method().clone();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |path| path.as_str().to_string());
    let id = state.requests_seen.fetch_add(1, Ordering::Relaxed) + 1;
    let span = tracing::info_span!(
        "http_request",
        id,
        method = %method,
        route = %route,
        status = tracing::field::Empty,
        latency_us = tracing::field::Empty,
    );
    // Exported, the request's trace continues the caller's W3C `traceparent`, whose
    // trace id is also the one the request's turns run under (docs/serve.md, "Trace ids").
    #[cfg(feature = "otel")]
    crate::otel::continue_callers_trace(&span, request.headers());
    let started = tokio::time::Instant::now();
    let mut response = next.run(request).instrument(span.clone()).await;
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|value| value.as_bytes().starts_with(b"application/json"));
    if (status.is_client_error() || status.is_server_error()) && !is_json {
        response = plain_error(response, method.as_str(), &route).await;
    }
    if (status.is_client_error() || status.is_server_error()) && openai_compat::is_route(&route) {
        response = openai_compat::in_openai_shape(response).await;
    }
    let status = response.status().as_u16();
    let latency_us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
    span.record("status", status);
    span.record("latency_us", latency_us);
    state.metrics.record(method_label(&method), &route, status);
    response
}

/// The method as the metrics name it: a standard method by its name, any other (HTTP
/// allows any token, and a client may invent one per request) as `other`, so that the
/// series stay bounded by the routes.
fn method_label(method: &Method) -> &'static str {
    const STANDARD: [&str; 9] = [
        "GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "CONNECT", "TRACE",
    ];
    STANDARD
        .into_iter()
        .find(|standard| *standard == method.as_str())
        .unwrap_or("other")
}

/// Reads the request body whole, up to [`SERVER_REQUEST_BODY_SIZE_MAX_BYTES`], before a
/// route sees it (every route takes a JSON body or none). A larger body, declared or
/// chunked, is answered 413 `body_too_large` after the rest of it is read and discarded,
/// up to [`SERVER_REQUEST_BODY_DRAIN_MAX_BYTES`] and for at most
/// [`SERVER_REQUEST_BODY_DRAIN_MS`], so that a client still writing it gets the answer
/// rather than a reset connection. A body declared larger than that is answered at once,
/// unread. A body that breaks off (the client hung up or sent bad chunking) is 400
/// `body_unreadable`. A body that has not arrived whole within
/// [`SERVER_REQUEST_BODY_READ_MS`] is 408 `body_timeout`, its connection closed. Runs
/// after authentication and the concurrency limit: only an admitted request is read.
///
/// Public so that another HTTP API (`troupe node`'s conversation logs) applies the same
/// rule: `router.layer(axum::middleware::from_fn(troupe_server::read_body))`, inside its
/// own concurrency limit. A smaller limit of its own (axum's `DefaultBodyLimit`) still
/// applies to the body read.
pub async fn read_body(request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let declared = declared_length(&parts.headers);
    let limit = SERVER_REQUEST_BODY_SIZE_MAX_BYTES as u64;
    if beyond_drain(declared) {
        return body_too_large();
    }
    let mut frames = body.into_data_stream();
    if declared.is_some_and(|length| length > limit) {
        drain(&mut frames, 0).await;
        return body_too_large();
    }
    let reading = async {
        let mut read: Vec<u8> = Vec::with_capacity(declared.map_or(0, |length| length as usize));
        while let Some(chunk) = frames.next().await {
            let Ok(chunk) = chunk else {
                return BodyRead::Broken;
            };
            if read.len() + chunk.len() > SERVER_REQUEST_BODY_SIZE_MAX_BYTES {
                return BodyRead::TooLarge(read.len() + chunk.len());
            }
            read.extend_from_slice(&chunk);
        }
        BodyRead::Whole(read)
    };
    let read = tokio::time::timeout(Duration::from_millis(SERVER_REQUEST_BODY_READ_MS), reading).await;
    match read {
        Ok(BodyRead::Whole(read)) => next.run(Request::from_parts(parts, Body::from(read))).await,
        Ok(BodyRead::TooLarge(seen)) => {
            drain(&mut frames, seen).await;
            body_too_large()
        }
        Ok(BodyRead::Broken) => ApiError::new(
            StatusCode::BAD_REQUEST,
            "body_unreadable",
            "the request body broke off before its end; send it again",
        )
        .into_response(),
        Err(_) => {
            let mut response = body_timeout().into_response();
            // The rest of the body is not read: the connection cannot carry another
            // request.
            response
                .headers_mut()
                .insert(header::CONNECTION, header::HeaderValue::from_static("close"));
            response
        }
    }
}

/// 408 `body_timeout`: the body did not arrive whole within [`SERVER_REQUEST_BODY_READ_MS`].
fn body_timeout() -> ApiError {
    ApiError::new(
        StatusCode::REQUEST_TIMEOUT,
        "body_timeout",
        format!(
            "the request body did not arrive whole within the server's limit of \
             {SERVER_REQUEST_BODY_READ_MS} ms; send it again, at once"
        ),
    )
}

/// How reading a request body ended (within [`SERVER_REQUEST_BODY_READ_MS`]).
enum BodyRead {
    /// All of it, within the size limit.
    Whole(Vec<u8>),
    /// Over the size limit once this many bytes were seen; the rest is unread.
    TooLarge(usize),
    /// The client hung up or sent bad chunking.
    Broken,
}

/// The body's length as its `Content-Length` declares it, if it does.
fn declared_length(headers: &axum::http::HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok())
}

/// Whether a body declared `declared` bytes long is more than a refusal reads on
/// ([`SERVER_REQUEST_BODY_DRAIN_MAX_BYTES`]): it is then answered at once, unread.
fn beyond_drain(declared: Option<u64>) -> bool {
    declared.is_some_and(|length| length > SERVER_REQUEST_BODY_DRAIN_MAX_BYTES as u64)
}

/// Answers `refusal` to a request refused before its body was read (401, 503), once its
/// body has been read and discarded as a refused large one is ([`drain`]: bounded in
/// bytes and time; a body declared larger than that is left unread). Otherwise the
/// connection would close with the body unread, and a client still writing a body
/// larger than the sockets' buffers would get a reset instead of the answer.
async fn refuse_after_reading(request: Request, refusal: Response) -> Response {
    let (parts, body) = request.into_parts();
    if !beyond_drain(declared_length(&parts.headers)) {
        drain(&mut body.into_data_stream(), 0).await;
    }
    refusal
}

/// Reads and discards the rest of a refused body (of which `seen` bytes are read), up to
/// [`SERVER_REQUEST_BODY_DRAIN_MAX_BYTES`] in all and for at most
/// [`SERVER_REQUEST_BODY_DRAIN_MS`]; stops early at its end or at a read error.
async fn drain(frames: &mut axum::body::BodyDataStream, mut seen: usize) {
    let reading = async {
        while seen <= SERVER_REQUEST_BODY_DRAIN_MAX_BYTES {
            match frames.next().await {
                Some(Ok(chunk)) => seen += chunk.len(),
                Some(Err(_)) | None => return,
            }
        }
    };
    // Running out of time only leaves the rest unread: the answer is the same 413.
    let _ = tokio::time::timeout(Duration::from_millis(SERVER_REQUEST_BODY_DRAIN_MS), reading).await;
}

fn body_too_large() -> Response {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "body_too_large",
        format!("the request body is larger than the limit of {SERVER_REQUEST_BODY_SIZE_MAX_BYTES} bytes"),
    )
    .into_response()
}

/// An error answered outside the handlers' error shape (axum's own: a 405, or a path
/// segment its `Path` extractor refused, such as `%FF`, which is no UTF-8) in the one
/// JSON shape, its text (what was wrong, at most [`SERVER_PLAIN_ERROR_TEXT_MAX_BYTES`])
/// kept as the message: a 400 is `bad_request`.
async fn plain_error(response: Response, method: &str, route: &str) -> Response {
    let status = response.status();
    let text = axum::body::to_bytes(response.into_body(), SERVER_PLAIN_ERROR_TEXT_MAX_BYTES)
        .await
        .map(|bytes| String::from_utf8_lossy(&bytes).trim().to_string())
        .unwrap_or_default();
    let (code, message) = match status {
        StatusCode::METHOD_NOT_ALLOWED => ("method_not_allowed", format!("{method} is not allowed on {route}")),
        StatusCode::BAD_REQUEST if !text.is_empty() => ("bad_request", text),
        other if !text.is_empty() => ("http_error", format!("the request failed with status {other}: {text}")),
        other => ("http_error", format!("the request failed with status {other}")),
    };
    ApiError::new(status, code, message).into_response()
}

/// Requires `Authorization: Bearer TOKEN` when a token is configured, except on
/// `GET /health` and the topology page's files (they hold no data).
async fn authenticate(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let Some(token) = &state.config.token else {
        return next.run(request).await;
    };
    // HEAD is GET without the body (RFC 9110 9.3.2), and every GET route answers it: a
    // public GET is public as HEAD too, as a load balancer's `HEAD /health` expects.
    // Until 2026-12-07 a HEAD of them was 401 with a token configured.
    let method = if request.method() == Method::HEAD {
        Method::GET
    } else {
        request.method().clone()
    };
    if (method == Method::GET && request.uri().path() == "/health")
        || a2a::is_public(&method, request.uri().path())
        || topology::is_page(&method, request.uri().path())
    {
        return next.run(request).await;
    }
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(bearer_credential);
    let refusal = match given {
        Some(given) if same_secret(given.as_bytes(), token.as_bytes()) => return next.run(request).await,
        Some(_) => unauthorized("the bearer token is not valid"),
        None => unauthorized("this server needs Authorization: Bearer TOKEN (the token given to troupe serve)"),
    };
    refuse_after_reading(request, refusal).await
}

/// The credential of an `Authorization: Bearer TOKEN` value: the scheme matched in any
/// case (HTTP's authentication schemes are case-insensitive, RFC 9110 11.1).
///
/// Public so that another HTTP API (`troupe node`'s conversation logs) takes the token
/// by the same rule, with [`same_secret`].
pub fn bearer_credential(value: &str) -> Option<&str> {
    let (scheme, credential) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("Bearer").then_some(credential)
}

fn unauthorized(message: &str) -> Response {
    let mut response = ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", message).into_response();
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

/// Whether `given` is `expected`, compared without an early exit on the first differing
/// byte (a length that differs is answered at once: the length is not the secret).
pub fn same_secret(given: &[u8], expected: &[u8]) -> bool {
    if given.len() != expected.len() {
        return false;
    }
    given.iter().zip(expected).fold(0_u8, |diff, (a, b)| diff | (a ^ b)) == 0
}

/// Admits at most `concurrent_requests_max` requests at once (one more: 503 at once),
/// and answers 504 to one that takes longer than `request_timeout` to its headers.
async fn limit(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let Ok(_permit) = Arc::clone(&state.requests).try_acquire_owned() else {
        let refusal = ApiError::overloaded(format!(
            "the server is handling {} requests, its limit; retry later",
            state.config.concurrent_requests_max
        ))
        .into_response();
        return refuse_after_reading(request, refusal).await;
    };
    match tokio::time::timeout(state.config.request_timeout, next.run(request)).await {
        Ok(response) => response,
        Err(_) => ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "request_timeout",
            format!(
                "the request took longer than the server's limit of {} ms",
                state.config.request_timeout.as_millis()
            ),
        )
        .into_response(),
    }
}

/// A slot for one streamed answer (a streamed message, a streamed chat completion, A2A
/// `SendStreamingMessage` or `SubscribeToTask`, served here or forwarded by this cluster
/// node to the node holding the agent's A2A tasks), taken before the stream starts or
/// forwards anything and held by the stream until it ends or its client goes away (the
/// response body, dropped then, holds it; a chat completion's handler holds it during
/// the turn, before the body exists).
/// The concurrent-request limit counts a stream only until its headers are sent; this
/// one counts it for as long as it is open.
///
/// # Errors
/// With `streams_open_max` streams open, what to tell the client (the caller answers it
/// 503 with `Retry-After`, in its route's error shape).
pub(crate) fn stream_slot(state: &AppState) -> Result<OwnedSemaphorePermit, String> {
    Arc::clone(&state.streams).try_acquire_owned().map_err(|_| {
        format!(
            "the server has {} streamed answers open, its limit (streams_open_max); retry later, or ask without \
             streaming",
            state.config.streams_open_max
        )
    })
}

async fn not_found(request: Request<Body>) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "route_not_found",
        format!(
            "no route {} {}; see docs/serve.md",
            request.method(),
            request.uri().path()
        ),
    )
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    // The agents this process has read, without a store read: a liveness answer must not
    // wait on the store.
    let agents = state.client.directory().list().len();
    axum::Json(json!({"status": "ok", "agents": agents})).into_response()
}

async fn metrics(State(state): State<Arc<AppState>>, served: Option<axum::Extension<Arc<Connections>>>) -> Response {
    let open = SERVER_EVENT_STREAMS_MAX - state.event_streams.available_permits();
    let a2a = a2a::sizes(&state).await;
    let streams = state.config.streams_open_max.min(Semaphore::MAX_PERMITS) - state.streams.available_permits();
    // The agents this process has read (the stored directory is read at the start and
    // by every agent route), without a store read: a scrape must not wait on the store.
    let agents = state.client.directory().list().len();
    let dropped = state.config.log_lines_dropped.as_ref().map(|dropped| dropped());
    // Counted by `serve`, or by `serve_http` for the router it serves.
    let connections = state
        .connections
        .get()
        .map(|connections| connections.open())
        .or_else(|| served.map(|axum::Extension(connections)| connections.open()));
    let text = state
        .metrics
        .render(&state.client, agents, [open, streams], a2a, [dropped, connections]);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: the 408's message reads as one sentence. Until 2026-12-06 its format string
    /// held the next line's indentation ("limit of" followed by 22 spaces).
    #[test]
    fn the_body_timeout_message_is_one_sentence() {
        let error = body_timeout();
        assert_eq!(
            error.message,
            format!(
                "the request body did not arrive whole within the server's limit of {SERVER_REQUEST_BODY_READ_MS} ms; \
                 send it again, at once"
            )
        );
        assert!(!error.message.contains("  "), "{:?}", error.message);
    }
}
