//! [`OpenAiClient`]: an [`LlmClient`] that speaks the OpenAI-compatible
//! chat-completions protocol over HTTP, with tool calling.
//!
//! It owns the wire format and the time budget of one model call; the agent layer owns
//! everything else (the chat, tool dispatch, schema validation of arguments, retries).
//!
//! ```text
//!  LlmRequest ──► request body (JSON) ──► POST {base_url}/chat/completions
//!                                                    │ (blocking ureq call on a
//!                                                    │  spawn_blocking thread)
//!  LlmReply   ◄── choices[0].message  ◄── response body (at most
//!                                          RESPONSE_BODY_BYTES_MAX bytes)
//! ```
//!
//! # Guarantees and edge behaviour
//! - **Time budget.** Each call gets `min(config.request_timeout, request.deadline -
//!   clock.now())`, read from the [`Clock`] given to [`OpenAiClient::new`] (the
//!   runtime's clock, so the deadline and the budget share one epoch). The budget covers
//!   connecting, sending and reading the whole answer. A deadline that has already
//!   passed fails with [`LlmError::Timeout`] at once, without sending anything.
//! - **Errors.** HTTP status >= 400 → [`LlmError::Provider`] with the start of the body
//!   (at most [`PROVIDER_ERROR_BODY_BYTES_MAX`] bytes, cut on a UTF-8 boundary); no
//!   connection (refused, DNS, TLS, reset) → [`LlmError::Unreachable`]; the budget ran
//!   out → [`LlmError::Timeout`]; an answer that is not the protocol (bad JSON, no
//!   choices, tool-call arguments that are not JSON, a body over
//!   [`RESPONSE_BODY_BYTES_MAX`]) → [`LlmError::Malformed`].
//! - **Model.** `request.model` is sent when it is not empty; otherwise
//!   [`OpenAiConfig::model`].
//! - **Messages.** An assistant message with tool calls and empty text is sent with
//!   `content: null`, as the protocol expects; tool-call arguments are sent as a JSON
//!   string. An empty `tools` list is omitted (providers reject `tools: []`).
//! - **Arguments.** `tool_calls[].function.arguments` is a JSON *string*; it is parsed
//!   into a [`serde_json::Value`]. An empty string means no arguments and becomes `{}`.
//!   The arguments are not checked against the tool's schema here.
//! - **Secrets.** The API key is sent only in the `Authorization` header and never
//!   appears in `Debug` output or errors.
//!
//! # What it does not do
//! No retries, no streaming, no rate limiting, no request-size limit beyond what the
//! provider enforces. It is excluded from the madsim build (`#[cfg(not(madsim))]`):
//! simulated code uses a scripted [`LlmClient`] instead.
//!
//! # Why ureq
//! ureq 2 is a small synchronous client (rustls, no async runtime of its own, no hyper,
//! no tower), so it cannot register timers with a tokio reactor that is not there; one
//! call runs on `tokio::task::spawn_blocking`, which suits a handful of concurrent model
//! calls that each take seconds. It has an overall per-request timeout, which is the
//! whole budget we need. reqwest would add hyper, tower and a second dependency on the
//! real tokio to the workspace for no feature this client uses.

use std::io::Read;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use troupe_runtime::Clock;

use crate::{ChatMessage, LlmClient, LlmError, LlmReply, LlmRequest, Role, ToolCall, ToolSpec};

/// The base URL used when `OPENAI_BASE_URL` is not set.
pub const OPENAI_BASE_URL_DEFAULT: &str = "https://api.openai.com/v1";

/// The model used when `OPENAI_MODEL` is not set and the request names none.
pub const OPENAI_MODEL_DEFAULT: &str = "gpt-4o-mini";

/// The per-call time limit used when `OPENAI_REQUEST_TIMEOUT_MS` is not set.
pub const OPENAI_REQUEST_TIMEOUT_MS_DEFAULT: u64 = 60_000;

/// The largest per-call time limit a config may set.
pub const OPENAI_REQUEST_TIMEOUT_MS_MAX: u64 = 600_000;

/// How much of an error response body is kept in [`LlmError::Provider`], in bytes.
pub const PROVIDER_ERROR_BODY_BYTES_MAX: usize = 2_048;

/// The largest successful response body that is read, in bytes; a longer body is
/// [`LlmError::Malformed`].
pub const RESPONSE_BODY_BYTES_MAX: usize = 8 * 1024 * 1024;

const _: () = assert!(OPENAI_REQUEST_TIMEOUT_MS_DEFAULT > 0);
const _: () = assert!(OPENAI_REQUEST_TIMEOUT_MS_DEFAULT <= OPENAI_REQUEST_TIMEOUT_MS_MAX);
const _: () = assert!(PROVIDER_ERROR_BODY_BYTES_MAX <= RESPONSE_BODY_BYTES_MAX);

/// Why an [`OpenAiConfig`] could not be built or was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpenAiConfigError {
    /// A required environment variable is not set (or is empty).
    #[error("environment variable {name} is required but not set")]
    MissingEnv {
        /// The variable's name.
        name: &'static str,
    },
    /// An environment variable is set to something that is not a valid value.
    #[error("environment variable {name} is invalid: {cause}")]
    InvalidEnv {
        /// The variable's name.
        name: &'static str,
        /// What is wrong with it.
        cause: String,
    },
    /// The API key is empty.
    #[error("api_key must not be empty")]
    EmptyApiKey,
    /// The base URL is not an `http://` or `https://` URL.
    #[error("base_url must start with http:// or https://, got {base_url:?}")]
    InvalidBaseUrl {
        /// The rejected URL.
        base_url: String,
    },
    /// The model name is empty.
    #[error("model must not be empty")]
    EmptyModel,
    /// The request timeout is outside `0 < request_timeout_ms <= max_ms`.
    #[error("request_timeout must satisfy 0 < {request_timeout_ms} ms <= {max_ms} ms")]
    InvalidRequestTimeout {
        /// The rejected timeout, in milliseconds.
        request_timeout_ms: u128,
        /// [`OPENAI_REQUEST_TIMEOUT_MS_MAX`].
        max_ms: u64,
    },
}

/// Where and how [`OpenAiClient`] talks to an OpenAI-compatible provider.
///
/// `Debug` shows the API key redacted.
#[derive(Clone, PartialEq, Eq)]
pub struct OpenAiConfig {
    /// The API root, without `/chat/completions` (default [`OPENAI_BASE_URL_DEFAULT`]);
    /// a trailing `/` is ignored.
    pub base_url: String,
    /// The bearer token sent in `Authorization`.
    pub api_key: String,
    /// The model used when a request names none (default [`OPENAI_MODEL_DEFAULT`]).
    pub model: String,
    /// The longest one call may take; the request's deadline may shorten it.
    pub request_timeout: Duration,
}

impl std::fmt::Debug for OpenAiConfig {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("OpenAiConfig")
            .field("base_url", &self.base_url)
            .field("api_key", &"<redacted>")
            .field("model", &self.model)
            .field("request_timeout", &self.request_timeout)
            .finish()
    }
}

impl OpenAiConfig {
    /// A config for `api_key` with every other field at its default.
    pub fn new(api_key: impl Into<String>) -> Self {
        Self {
            base_url: OPENAI_BASE_URL_DEFAULT.to_owned(),
            api_key: api_key.into(),
            model: OPENAI_MODEL_DEFAULT.to_owned(),
            request_timeout: Duration::from_millis(OPENAI_REQUEST_TIMEOUT_MS_DEFAULT),
        }
    }

    /// Reads the config from the process environment: `OPENAI_API_KEY` (required),
    /// `OPENAI_BASE_URL`, `OPENAI_MODEL` and `OPENAI_REQUEST_TIMEOUT_MS` (optional; an
    /// empty variable counts as unset), then validates it.
    ///
    /// # Errors
    /// [`OpenAiConfigError::MissingEnv`] without an API key,
    /// [`OpenAiConfigError::InvalidEnv`] for a timeout that is not an integer, or any
    /// error of [`OpenAiConfig::validate`].
    pub fn from_env() -> Result<Self, OpenAiConfigError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Like [`OpenAiConfig::from_env`], reading variables through `lookup` (for tests and
    /// for callers that keep settings elsewhere).
    ///
    /// # Errors
    /// As [`OpenAiConfig::from_env`].
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, OpenAiConfigError> {
        let read = |name: &'static str| lookup(name).filter(|value| !value.trim().is_empty());
        let api_key = read("OPENAI_API_KEY").ok_or(OpenAiConfigError::MissingEnv { name: "OPENAI_API_KEY" })?;
        let mut config = Self::new(api_key.trim());
        if let Some(base_url) = read("OPENAI_BASE_URL") {
            config.base_url = base_url.trim().to_owned();
        }
        if let Some(model) = read("OPENAI_MODEL") {
            config.model = model.trim().to_owned();
        }
        if let Some(timeout_ms) = read("OPENAI_REQUEST_TIMEOUT_MS") {
            let timeout_ms: u64 = timeout_ms
                .trim()
                .parse()
                .map_err(|error| OpenAiConfigError::InvalidEnv {
                    name: "OPENAI_REQUEST_TIMEOUT_MS",
                    cause: format!("{timeout_ms:?} is not a whole number of milliseconds: {error}"),
                })?;
            config.request_timeout = Duration::from_millis(timeout_ms);
        }
        config.validate()?;
        Ok(config)
    }

    /// Checks every field.
    ///
    /// # Errors
    /// The first violated rule: a non-empty API key and model, an `http(s)://` base URL,
    /// and `0 < request_timeout <= OPENAI_REQUEST_TIMEOUT_MS_MAX` ms.
    pub fn validate(&self) -> Result<(), OpenAiConfigError> {
        if self.api_key.is_empty() {
            return Err(OpenAiConfigError::EmptyApiKey);
        }
        let scheme_ok = self.base_url.starts_with("http://") || self.base_url.starts_with("https://");
        let host_present = self
            .base_url
            .split_once("://")
            .is_some_and(|(_, rest)| !rest.trim_start_matches('/').is_empty());
        if !scheme_ok || !host_present {
            return Err(OpenAiConfigError::InvalidBaseUrl {
                base_url: self.base_url.clone(),
            });
        }
        if self.model.is_empty() {
            return Err(OpenAiConfigError::EmptyModel);
        }
        let timeout_ms = self.request_timeout.as_millis();
        if timeout_ms == 0 || timeout_ms > u128::from(OPENAI_REQUEST_TIMEOUT_MS_MAX) {
            return Err(OpenAiConfigError::InvalidRequestTimeout {
                request_timeout_ms: timeout_ms,
                max_ms: OPENAI_REQUEST_TIMEOUT_MS_MAX,
            });
        }
        Ok(())
    }

    /// `{base_url}/chat/completions`.
    fn chat_completions_url(&self) -> String {
        format!("{}/chat/completions", self.base_url.trim_end_matches('/'))
    }
}

/// An [`LlmClient`] for OpenAI-compatible chat-completions providers.
///
/// Cheap to clone (connections are pooled and shared between clones).
///
/// # Examples
/// ```no_run
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// use troupe_agent::{OpenAiClient, OpenAiConfig};
/// let client = OpenAiClient::new(OpenAiConfig::from_env()?, troupe_runtime::Clock::new())?;
/// # let _ = client; Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct OpenAiClient {
    config: OpenAiConfig,
    clock: Clock,
    agent: ureq::Agent,
}

impl OpenAiClient {
    /// A client for `config`; request deadlines are read on `clock`, which must be the
    /// runtime's clock (`RuntimeHandle::clock()`) so deadlines share its epoch.
    ///
    /// # Errors
    /// Any error of [`OpenAiConfig::validate`].
    pub fn new(config: OpenAiConfig, clock: Clock) -> Result<Self, OpenAiConfigError> {
        config.validate()?;
        let agent = ureq::AgentBuilder::new()
            .user_agent(concat!("troupe-agent/", env!("CARGO_PKG_VERSION")))
            .build();
        Ok(Self { config, clock, agent })
    }

    /// The config this client was built with.
    pub fn config(&self) -> &OpenAiConfig {
        &self.config
    }
}

#[async_trait]
impl LlmClient for OpenAiClient {
    async fn complete(&self, request: LlmRequest) -> Result<LlmReply, LlmError> {
        let budget = self
            .config
            .request_timeout
            .min(request.deadline.remaining(self.clock.now()));
        let timeout_ms = u64::try_from(budget.as_millis()).unwrap_or(u64::MAX);
        if budget.is_zero() {
            return Err(LlmError::Timeout { timeout_ms });
        }
        let model = if request.model.is_empty() {
            self.config.model.clone()
        } else {
            request.model.clone()
        };
        let body = serde_json::to_vec(&WireRequest::from_request(&model, &request))
            .expect("a request of strings and JSON values always serializes");
        let http_request = self
            .agent
            .post(&self.config.chat_completions_url())
            .set("Authorization", &format!("Bearer {}", self.config.api_key))
            .set("Content-Type", "application/json")
            .timeout(budget);
        let call = tokio::task::spawn_blocking(move || complete_blocking(http_request, &body));
        // ureq enforces the budget itself; this outer timeout only bounds the wait if a
        // blocking thread is slow to start. The thread still finishes within the budget.
        match tokio::time::timeout(budget, call).await {
            Err(_elapsed) => Err(LlmError::Timeout { timeout_ms }),
            Ok(Err(join_error)) if join_error.is_panic() => std::panic::resume_unwind(join_error.into_panic()),
            Ok(Err(join_error)) => Err(LlmError::Unreachable {
                cause: format!("the HTTP call was cancelled: {join_error}"),
            }),
            Ok(Ok(result)) => result.map_err(|failure| failure.into_llm_error(timeout_ms)),
        }
    }
}

/// What went wrong on the blocking side, before the budget is known to the message.
enum CallFailure {
    Timeout,
    Llm(LlmError),
}

impl CallFailure {
    fn into_llm_error(self, timeout_ms: u64) -> LlmError {
        match self {
            CallFailure::Timeout => LlmError::Timeout { timeout_ms },
            CallFailure::Llm(error) => error,
        }
    }
}

/// Sends the request and decodes the answer; runs on a blocking thread.
fn complete_blocking(request: ureq::Request, body: &[u8]) -> Result<LlmReply, CallFailure> {
    match request.send_bytes(body) {
        Ok(response) => {
            let bytes = complete_blocking_read_body(response, RESPONSE_BODY_BYTES_MAX)?;
            if bytes.len() > RESPONSE_BODY_BYTES_MAX {
                return Err(CallFailure::Llm(LlmError::Malformed {
                    cause: format!("the response body exceeds {RESPONSE_BODY_BYTES_MAX} bytes"),
                }));
            }
            parse_response(&bytes).map_err(CallFailure::Llm)
        }
        Err(ureq::Error::Status(status, response)) => {
            // A body that cannot be read (or is not UTF-8) still reports the status; the
            // cut lands on a character boundary.
            let bytes = complete_blocking_read_body(response, PROVIDER_ERROR_BODY_BYTES_MAX).unwrap_or_default();
            let text = String::from_utf8_lossy(&bytes);
            let body = troupe_core::truncate_utf8(&text, PROVIDER_ERROR_BODY_BYTES_MAX).to_owned();
            Err(CallFailure::Llm(LlmError::Provider { status, body }))
        }
        Err(ureq::Error::Transport(transport)) => Err(transport_failure(&transport)),
    }
}

/// Reads at most `limit_bytes + 1` bytes of the body, so a caller can tell "exactly at
/// the limit" from "over it".
fn complete_blocking_read_body(response: ureq::Response, limit_bytes: usize) -> Result<Vec<u8>, CallFailure> {
    let limit_plus_one = u64::try_from(limit_bytes).unwrap_or(u64::MAX).saturating_add(1);
    let mut bytes = Vec::new();
    match response.into_reader().take(limit_plus_one).read_to_end(&mut bytes) {
        Ok(_) => Ok(bytes),
        Err(error) if is_timeout_io(&error) => Err(CallFailure::Timeout),
        Err(error) => Err(CallFailure::Llm(LlmError::Unreachable {
            cause: format!("reading the response failed: {error}"),
        })),
    }
}

/// Classifies a ureq transport error: a timed-out socket anywhere in the chain is a
/// timeout, a broken HTTP framing is a malformed answer, the rest is unreachable.
fn transport_failure(transport: &ureq::Transport) -> CallFailure {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(transport);
    while let Some(error) = source {
        if error.downcast_ref::<std::io::Error>().is_some_and(is_timeout_io) {
            return CallFailure::Timeout;
        }
        source = error.source();
    }
    match transport.kind() {
        ureq::ErrorKind::BadStatus | ureq::ErrorKind::BadHeader => CallFailure::Llm(LlmError::Malformed {
            cause: transport.to_string(),
        }),
        _ => CallFailure::Llm(LlmError::Unreachable {
            cause: transport.to_string(),
        }),
    }
}

fn is_timeout_io(error: &std::io::Error) -> bool {
    matches!(
        error.kind(),
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
    )
}

/// Decodes a successful chat-completions body into the first choice's message.
fn parse_response(bytes: &[u8]) -> Result<LlmReply, LlmError> {
    let response: WireResponse = serde_json::from_slice(bytes).map_err(|error| LlmError::Malformed {
        cause: format!("the response is not a chat completion: {error}"),
    })?;
    let Some(choice) = response.choices.into_iter().next() else {
        return Err(LlmError::Malformed {
            cause: "the response has no choices".to_owned(),
        });
    };
    let mut tool_calls = Vec::with_capacity(choice.message.tool_calls.len());
    for call in choice.message.tool_calls {
        let arguments = if call.function.arguments.trim().is_empty() {
            serde_json::Value::Object(serde_json::Map::new())
        } else {
            serde_json::from_str(&call.function.arguments).map_err(|error| LlmError::Malformed {
                cause: format!(
                    "the arguments of tool call {:?} ({}) are not JSON: {error}",
                    call.id, call.function.name
                ),
            })?
        };
        tool_calls.push(ToolCall {
            id: call.id,
            name: call.function.name,
            arguments,
        });
    }
    let message = ChatMessage {
        role: Role::Assistant,
        content: choice.message.content.unwrap_or_default(),
        tool_calls,
        tool_call_id: None,
    };
    Ok(LlmReply { message })
}

// ---- The wire format (only the fields this client uses). ----

#[derive(Serialize)]
struct WireRequest<'a> {
    model: &'a str,
    messages: Vec<WireMessage<'a>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<WireTool<'a>>,
}

impl<'a> WireRequest<'a> {
    fn from_request(model: &'a str, request: &'a LlmRequest) -> Self {
        Self {
            model,
            messages: request.messages.iter().map(WireMessage::from_message).collect(),
            tools: request.tools.iter().map(WireTool::from_spec).collect(),
        }
    }
}

#[derive(Serialize)]
struct WireMessage<'a> {
    role: &'static str,
    /// `None` (JSON null) only for an assistant message that just calls tools.
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<WireToolCallOut<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_call_id: Option<&'a str>,
}

impl<'a> WireMessage<'a> {
    fn from_message(message: &'a ChatMessage) -> Self {
        let role = match message.role {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        };
        let content = if message.content.is_empty() && !message.tool_calls.is_empty() {
            None
        } else {
            Some(message.content.as_str())
        };
        Self {
            role,
            content,
            tool_calls: message.tool_calls.iter().map(WireToolCallOut::from_call).collect(),
            tool_call_id: message.tool_call_id.as_deref(),
        }
    }
}

#[derive(Serialize)]
struct WireToolCallOut<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    function: WireFunctionCallOut<'a>,
}

impl<'a> WireToolCallOut<'a> {
    fn from_call(call: &'a ToolCall) -> Self {
        Self {
            id: &call.id,
            kind: "function",
            function: WireFunctionCallOut {
                name: &call.name,
                arguments: call.arguments.to_string(),
            },
        }
    }
}

#[derive(Serialize)]
struct WireFunctionCallOut<'a> {
    name: &'a str,
    /// The protocol carries arguments as a JSON string.
    arguments: String,
}

#[derive(Serialize)]
struct WireTool<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    function: WireFunction<'a>,
}

impl<'a> WireTool<'a> {
    fn from_spec(spec: &'a ToolSpec) -> Self {
        Self {
            kind: "function",
            function: WireFunction {
                name: &spec.name,
                description: &spec.description,
                parameters: &spec.parameters,
            },
        }
    }
}

#[derive(Serialize)]
struct WireFunction<'a> {
    name: &'a str,
    description: &'a str,
    parameters: &'a serde_json::Value,
}

#[derive(Deserialize)]
struct WireResponse {
    choices: Vec<WireChoice>,
}

#[derive(Deserialize)]
struct WireChoice {
    message: WireReplyMessage,
}

#[derive(Deserialize)]
struct WireReplyMessage {
    #[serde(default)]
    content: Option<String>,
    #[serde(default, deserialize_with = "null_as_empty")]
    tool_calls: Vec<WireToolCallIn>,
}

#[derive(Deserialize)]
struct WireToolCallIn {
    id: String,
    function: WireFunctionCallIn,
}

#[derive(Deserialize)]
struct WireFunctionCallIn {
    name: String,
    #[serde(default)]
    arguments: String,
}

/// `tool_calls: null` is what some providers send for "no calls".
fn null_as_empty<'de, D, T>(deserializer: D) -> Result<Vec<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Ok(Option::<Vec<T>>::deserialize(deserializer)?.unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |name| {
            pairs
                .iter()
                .find(|(key, _)| *key == name)
                .map(|(_, value)| (*value).to_owned())
        }
    }

    #[test]
    fn from_lookup_without_api_key_is_missing_env() {
        let error = OpenAiConfig::from_lookup(lookup(&[("OPENAI_MODEL", "m")])).unwrap_err();
        assert_eq!(error, OpenAiConfigError::MissingEnv { name: "OPENAI_API_KEY" });
        let error = OpenAiConfig::from_lookup(lookup(&[("OPENAI_API_KEY", "  ")])).unwrap_err();
        assert_eq!(error, OpenAiConfigError::MissingEnv { name: "OPENAI_API_KEY" });
    }

    #[test]
    fn from_lookup_with_only_api_key_uses_defaults() {
        let config = OpenAiConfig::from_lookup(lookup(&[("OPENAI_API_KEY", "sk-test")])).unwrap();
        assert_eq!(config.api_key, "sk-test");
        assert_eq!(config.base_url, OPENAI_BASE_URL_DEFAULT);
        assert_eq!(config.model, OPENAI_MODEL_DEFAULT);
        assert_eq!(
            config.request_timeout,
            Duration::from_millis(OPENAI_REQUEST_TIMEOUT_MS_DEFAULT)
        );
    }

    #[test]
    fn from_lookup_reads_every_variable_and_rejects_bad_ones() {
        let config = OpenAiConfig::from_lookup(lookup(&[
            ("OPENAI_API_KEY", "k"),
            ("OPENAI_BASE_URL", "http://127.0.0.1:9/v1/"),
            ("OPENAI_MODEL", "local-model"),
            ("OPENAI_REQUEST_TIMEOUT_MS", "1500"),
        ]))
        .unwrap();
        assert_eq!(config.chat_completions_url(), "http://127.0.0.1:9/v1/chat/completions");
        assert_eq!(config.model, "local-model");
        assert_eq!(config.request_timeout, Duration::from_millis(1_500));

        let error = OpenAiConfig::from_lookup(lookup(&[
            ("OPENAI_API_KEY", "k"),
            ("OPENAI_REQUEST_TIMEOUT_MS", "soon"),
        ]))
        .unwrap_err();
        assert!(matches!(
            error,
            OpenAiConfigError::InvalidEnv {
                name: "OPENAI_REQUEST_TIMEOUT_MS",
                ..
            }
        ));

        let error = OpenAiConfig::from_lookup(lookup(&[
            ("OPENAI_API_KEY", "k"),
            ("OPENAI_BASE_URL", "api.example.invalid"),
        ]))
        .unwrap_err();
        assert!(matches!(error, OpenAiConfigError::InvalidBaseUrl { .. }));
    }

    #[test]
    fn validate_states_the_violated_timeout_bound() {
        let mut config = OpenAiConfig::new("k");
        config.request_timeout = Duration::ZERO;
        assert!(matches!(
            config.validate(),
            Err(OpenAiConfigError::InvalidRequestTimeout { .. })
        ));
        config.request_timeout = Duration::from_millis(OPENAI_REQUEST_TIMEOUT_MS_MAX + 1);
        let error = config.validate().unwrap_err();
        assert!(error.to_string().contains("<= 600000 ms"), "{error}");
        config.request_timeout = Duration::from_millis(OPENAI_REQUEST_TIMEOUT_MS_MAX);
        assert_eq!(config.validate(), Ok(()));
    }

    #[test]
    fn debug_output_never_shows_the_api_key() {
        let config = OpenAiConfig::new("sk-very-secret");
        let shown = format!("{config:?}");
        assert!(!shown.contains("sk-very-secret"), "{shown}");
        assert!(shown.contains("<redacted>"), "{shown}");
    }

    #[test]
    fn assistant_tool_call_message_is_sent_with_null_content_and_string_arguments() {
        let mut message = ChatMessage::new(Role::Assistant, "");
        message.tool_calls.push(ToolCall {
            id: "call_1".to_owned(),
            name: "add".to_owned(),
            arguments: serde_json::json!({"a": 1}),
        });
        let wire = serde_json::to_value(WireMessage::from_message(&message)).unwrap();
        assert_eq!(
            wire,
            serde_json::json!({
                "role": "assistant",
                "content": null,
                "tool_calls": [{"id": "call_1", "type": "function",
                                "function": {"name": "add", "arguments": "{\"a\":1}"}}]
            })
        );
    }

    #[test]
    fn empty_arguments_string_parses_as_empty_object_and_null_tool_calls_as_none() {
        let reply = parse_response(
            br#"{"choices":[{"message":{"role":"assistant","content":null,
                "tool_calls":[{"id":"c","type":"function","function":{"name":"now","arguments":""}}]}}]}"#,
        )
        .unwrap();
        assert_eq!(reply.message.tool_calls[0].arguments, serde_json::json!({}));
        assert_eq!(reply.message.content, "");

        let reply =
            parse_response(br#"{"choices":[{"message":{"role":"assistant","content":"hi","tool_calls":null}}]}"#)
                .unwrap();
        assert!(reply.message.tool_calls.is_empty());
    }

    #[test]
    fn response_without_choices_is_malformed() {
        let error = parse_response(br#"{"choices":[]}"#).unwrap_err();
        assert!(matches!(error, LlmError::Malformed { .. }));
        let error = parse_response(b"not json").unwrap_err();
        assert!(matches!(error, LlmError::Malformed { .. }));
    }
}
