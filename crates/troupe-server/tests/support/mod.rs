//! The harness every server test file shares: a real `troupe_server::serve` on
//! 127.0.0.1:0 over a real `AgentSystem` (on the scripted model), and a reqwest client
//! whose every request is bounded by [`TEST_WAIT_MS_MAX`].
//!
//! Each test file includes it with `mod support;` and uses part of it.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio::sync::oneshot;
use troupe_agent::{AgentSpec, AgentSystem, AgentSystemBuilder, ScriptedLlm};
use troupe_runtime::KindConfig;
use troupe_server::{ServeError, ServerConfig};

/// The longest any wait (and any one HTTP request) of these tests may take, in
/// milliseconds.
pub(crate) const TEST_WAIT_MS_MAX: u64 = 15_000;
/// How often a wait polls, in milliseconds.
pub(crate) const POLL_MS: u64 = 20;

/// A served agent system.
pub(crate) struct Harness {
    /// `http://127.0.0.1:PORT`.
    pub(crate) base: String,
    /// A client with a [`TEST_WAIT_MS_MAX`] timeout.
    pub(crate) http: reqwest::Client,
    /// The token the server requires, if any: [`Harness::send`] sends it.
    token: Option<String>,
    pub(crate) system: Option<AgentSystem>,
    pub(crate) stop: Option<oneshot::Sender<()>>,
    pub(crate) served: Option<tokio::task::JoinHandle<Result<(), ServeError>>>,
}

/// A builder of `agents` (each with the role "the {id} agent") on `llm`, with `kind`.
pub(crate) fn agents(llm: ScriptedLlm, agents: &[&str], kind: KindConfig) -> AgentSystemBuilder {
    let mut builder = AgentSystem::builder().llm(Arc::new(llm)).kind_config(kind);
    for id in agents {
        builder = builder.agent(AgentSpec::new(*id).role(format!("the {id} agent")));
    }
    builder
}

impl Harness {
    /// Starts the system `builder` builds and serves it with `config`.
    pub(crate) async fn start(builder: AgentSystemBuilder, config: ServerConfig) -> Self {
        let system = builder.start().expect("the agent system starts");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr: SocketAddr = listener.local_addr().unwrap();
        let token = config.token.clone();
        let (stop, stopped) = oneshot::channel::<()>();
        let served = tokio::spawn(troupe_server::serve(listener, system.client(), config, async move {
            let _ = stopped.await;
        }));
        let _ = rustls::crypto::ring::default_provider().install_default();
        Self {
            base: format!("http://{addr}"),
            http: reqwest::Client::builder()
                .timeout(Duration::from_millis(TEST_WAIT_MS_MAX))
                .build()
                .unwrap(),
            token,
            system: Some(system),
            stop: Some(stop),
            served: Some(served),
        }
    }

    /// The agent system behind the server.
    pub(crate) fn system(&self) -> &AgentSystem {
        self.system.as_ref().unwrap()
    }

    /// A request to `path`, without the token.
    pub(crate) fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http.request(method, format!("{}{path}", self.base))
    }

    /// Sends a request with the token (if the server has one) and `body` as JSON: the
    /// status and the JSON answer (`Null` for an empty body; panics on non-JSON).
    pub(crate) async fn send(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut request = self.request(method, path);
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        if let Some(body) = body {
            request = request
                .header("content-type", "application/json")
                .body(body.to_string());
        }
        let response = request.send().await.expect("the server answers");
        let status = response.status().as_u16();
        let text = response.text().await.unwrap();
        let value = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or_else(|error| panic!("not JSON ({error}): {text}"))
        };
        (status, value)
    }

    /// `GET path`.
    pub(crate) async fn get(&self, path: &str) -> (u16, Value) {
        self.send(reqwest::Method::GET, path, None).await
    }

    /// `POST path` with `body`.
    pub(crate) async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.send(reqwest::Method::POST, path, Some(body)).await
    }

    /// Polls `GET path` (each answer must be 200) until `done` holds for its body, for
    /// at most [`TEST_WAIT_MS_MAX`]; panics naming `what` if it does not.
    pub(crate) async fn get_when(&self, path: &str, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        let waited = tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
            loop {
                let (status, body) = self.get(path).await;
                assert_eq!(status, 200, "{path}: {body}");
                if done(&body) {
                    return body;
                }
                tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
            }
        })
        .await;
        waited.unwrap_or_else(|_| panic!("{what}: not within {TEST_WAIT_MS_MAX} ms"))
    }

    /// The text of `GET /metrics` (with the token, if the server has one).
    pub(crate) async fn metrics(&self) -> String {
        let mut request = self.request(reqwest::Method::GET, "/metrics");
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        let response = request.send().await.expect("the server answers");
        assert_eq!(response.status().as_u16(), 200, "/metrics");
        response.text().await.unwrap()
    }

    /// Polls the gauge `name` of `/metrics` until it is `expected`, for at most
    /// [`TEST_WAIT_MS_MAX`]; panics naming `what` and the last value if it is not.
    pub(crate) async fn gauge_when(&self, name: &str, expected: u64, what: &str) {
        let mut last = None;
        let waited = tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
            loop {
                let value = gauge(&self.metrics().await, name);
                last = Some(value);
                if value == expected {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
            }
        })
        .await;
        if waited.is_err() {
            let last = last.map_or_else(|| "unread".to_string(), |value| value.to_string());
            panic!("{what}: {name} is {last}, not {expected}, after {TEST_WAIT_MS_MAX} ms");
        }
    }

    /// Stops the server, then the agent system.
    pub(crate) async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.served.take().unwrap().await.unwrap().expect("serve ends cleanly");
        self.system.take().unwrap().shutdown().await;
    }
}

/// The value of the gauge `name` in a `/metrics` text.
pub(crate) fn gauge(metrics: &str, name: &str) -> u64 {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no gauge {name} in /metrics:\n{metrics}"))
        .parse()
        .unwrap()
}

/// The `(event, data)` pairs of an SSE body.
pub(crate) fn parse_sse(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for block in text.split("\n\n") {
        let mut event = String::from("message");
        let mut data = Vec::new();
        for line in block.lines() {
            if let Some(name) = line.strip_prefix("event:") {
                event = name.trim().to_string();
            } else if let Some(value) = line.strip_prefix("data:") {
                data.push(value.trim_start().to_string());
            }
        }
        if !data.is_empty() {
            out.push((event, data.join("\n")));
        }
    }
    out
}

/// The scripted model behind a gate: each model call waits for a permit the test adds,
/// so the turns (and the streams that follow them) stay open until the test says.
pub(crate) struct Gated {
    pub(crate) script: ScriptedLlm,
    pub(crate) gate: Arc<tokio::sync::Semaphore>,
}

#[async_trait::async_trait]
impl troupe_agent::LlmClient for Gated {
    async fn complete(
        &self,
        request: troupe_agent::LlmRequest,
    ) -> Result<troupe_agent::LlmReply, troupe_agent::LlmError> {
        let permit = self.gate.acquire().await.expect("the gate is never closed");
        permit.forget();
        self.script.complete(request).await
    }
}

/// Waits until agent `agent` starts a turn (at most [`TEST_WAIT_MS_MAX`]).
pub(crate) async fn turn_started(events: &mut tokio::sync::broadcast::Receiver<troupe_agent::AgentEvent>, agent: &str) {
    tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
        loop {
            if let Ok(troupe_agent::AgentEvent::TurnStarted { agent: started, .. }) = events.recv().await {
                if started.key() == agent {
                    return;
                }
            }
        }
    })
    .await
    .expect("the turn starts");
}
