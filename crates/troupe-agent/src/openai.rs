//! [`OpenAiClient`]: an [`LlmClient`] that speaks the OpenAI-compatible
//! chat-completions protocol over HTTP (async, reqwest on tokio), with tool calling,
//! optional streaming, token usage and retries.
//!
//! It owns the wire format, the retries and the time budget of one model call; the
//! agent layer owns everything else (the chat, tool dispatch, schema validation of
//! arguments).
//!
//! ```text
//!  LlmRequest ──► request body (JSON) ──► POST {base_url}/chat/completions
//!                                            │  429 / 5xx / no connection:
//!                                            │  wait (Retry-After, or backoff with
//!                                            │  full jitter) and send again, while the
//!                                            │  budget lasts and retries remain
//!  LlmReply   ◄── choices[0].message  ◄──────┘  body (≤ RESPONSE_BODY_BYTES_MAX), or
//!  (+ usage)      or the assembled stream       SSE `data:` chunks until `[DONE]`
//! ```
//!
//! # Guarantees and edge behaviour
//! - **Time budget.** Each call gets `min(config.request_timeout, request.deadline -
//!   clock.now())`, read from the [`Clock`] given to [`OpenAiClient::new`] (the
//!   runtime's clock, so the deadline and the budget share one epoch). The budget covers
//!   every attempt, every wait between attempts, connecting, sending and reading the
//!   whole answer. A deadline that has already passed fails with [`LlmError::Timeout`]
//!   at once, without sending anything; a budget that runs out mid-call is
//!   [`LlmError::Timeout`].
//! - **Retries.** A 429, 408 or 5xx status, a failure to connect or send, or a
//!   connection lost while reading a non-streamed answer, is retried up to
//!   [`OpenAiConfig::retries_max`] times. The wait is the response's
//!   `retry-after-ms` or `Retry-After` (seconds) header when present (capped at
//!   [`RETRY_AFTER_MS_MAX`]; the HTTP-date form is ignored, as it needs the wall clock),
//!   otherwise exponential backoff with full jitter: uniform in `[0, min(backoff_max,
//!   backoff_initial * 2^retry)]`, drawn from a SplitMix64 generator seeded by
//!   [`OpenAiConfig::retry_jitter_seed`] (shared by clones; no OS randomness). A retry
//!   whose wait would leave less than [`RETRY_ATTEMPT_MS_MIN`] of the budget is not
//!   started: the call fails with the last error (e.g. [`LlmError::Provider`] 500)
//!   before the deadline, instead of starting an attempt that cannot finish. Other statuses (400, 401,
//!   404, ...) and malformed answers are not retried. A streamed answer is never
//!   retried once its body has started (its deltas were already shown).
//! - **Streaming.** With [`OpenAiConfig::stream`] the request asks for `stream: true`
//!   (and usage in the last chunk); the SSE `data:` chunks are assembled into one reply:
//!   text deltas are concatenated, tool-call deltas are merged by `index` (id and name
//!   from the first delta that has them, argument fragments concatenated); a delta
//!   naming another id than its index's call starts a new call (servers that send
//!   parallel calls whole, all at index 0). Calls keep the order they started in. Every delta
//!   is also handed to the [`StreamObserver`] set by
//!   [`OpenAiClient::with_stream_observer`], as it arrives, and then how the stream
//!   ended ([`StreamDelta::End`]: an observer that showed text learns that a
//!   `content_filter` or `error` finish reason made it no answer). A stream that ends without
//!   `data: [DONE]`, a chunk that is not JSON, an `error` chunk, or a tool-call index of
//!   [`STREAM_TOOL_CALLS_MAX`] or more is [`LlmError::Malformed`].
//! - **Tool-call ids.** A tool call without an `id` (left out, `null` or empty, as some
//!   OpenAI-compatible servers send), streamed or not, is passed on with an empty id;
//!   the agent's turn gives it `call_{step}_{index}` and sends its result under it.
//! - **Token limit.** An answer whose `finish_reason` is `"length"` (the provider
//!   stopped at its token limit, e.g. the cap a budget sets) is returned with
//!   [`LlmReply::truncated`]; a tool call it cut (arguments that are not JSON) is
//!   [`LlmError::Malformed`] naming the token limit.
//! - **Other finish reasons.** `"content_filter"` (the provider withheld the answer) and
//!   `"error"` (it failed mid-answer, as some gateways say) are
//!   [`LlmError::StoppedEarly`] with [`crate::EarlyStop`], streamed or not: the empty
//!   or partial text is not taken for an answer. `"stop"`, `"tool_calls"`,
//!   `"function_call"`, none, and the end-of-answer values of common local servers
//!   (`"eos"`, `"eos_token"`, `"stop_sequence"`, `"end_turn"`) are a complete answer;
//!   any other value is taken as one too, with a warning naming it.
//! - **Token cap field.** The completion's cap ([`LlmRequest::max_tokens`]) is sent as
//!   `max_tokens`, or `max_completion_tokens` with [`OpenAiConfig::token_cap_field`]
//!   (OpenAI's newer models refuse `max_tokens` with a 400). A 400 that refuses the
//!   field sent (it names it, as unsupported) is sent again at once, once, with the
//!   other field (not counted as a retry), and the client and its clones send that
//!   field from then on.
//! - **Usage.** The provider's `usage` (prompt, completion, total tokens) is returned in
//!   [`LlmReply::usage`]; `None` when the provider sent none.
//! - **Errors.** HTTP status >= 400 (after retries) → [`LlmError::Provider`] with the
//!   start of the body (at most [`PROVIDER_ERROR_BODY_BYTES_MAX`] bytes, cut on a UTF-8
//!   boundary); no connection (refused, DNS, TLS, reset before an answer) →
//!   [`LlmError::Unreachable`]; the budget ran out → [`LlmError::Timeout`]; an answer
//!   that is not the protocol (bad JSON, no choices, tool-call arguments that are not
//!   JSON, a body over [`RESPONSE_BODY_BYTES_MAX`], a truncated stream) →
//!   [`LlmError::Malformed`]; a status-200 body that is an `error` object is
//!   [`LlmError::Malformed`] with the provider's message.
//! - **Config.** An API key that cannot be sent in a header (a control or non-ASCII
//!   character) and a base URL that does not parse are refused by
//!   [`OpenAiConfig::validate`] ([`OpenAiClient::new`]), not reported per call.
//! - **Cancellation.** Dropping the future of [`LlmClient::complete`] (the turn was
//!   cancelled or its deadline passed) drops the HTTP request: the connection is closed
//!   and no further attempt is made.
//! - **Model.** `request.model` is sent when it is not empty; otherwise
//!   [`OpenAiConfig::model`].
//! - **Messages.** An assistant message with tool calls and empty text is sent with
//!   `content: null`, as the protocol expects; tool-call arguments are sent as a JSON
//!   string. An empty `tools` list is omitted (providers reject `tools: []`).
//! - **Arguments.** `tool_calls[].function.arguments` is a JSON *string*; it is parsed
//!   into a [`serde_json::Value`]. An empty string (or null) means no arguments and
//!   becomes `{}`. A JSON object sent in its place (some servers do) is taken as it is;
//!   anything else is [`LlmError::Malformed`].
//!   The arguments are not checked against the tool's schema here.
//! - **Secrets.** The API key is sent only in the `Authorization` header and never
//!   appears in `Debug` output or errors.
//!
//! # What it does not do
//! No client-side rate limiting, no request-size limit beyond what the provider
//! enforces, no HTTP/2, no proxy configuration beyond reqwest's environment defaults.
//! It is excluded from the madsim build (`#[cfg(not(madsim))]`): simulated code uses a
//! scripted [`LlmClient`] instead.
//!
//! # Why reqwest
//! An async client on the tokio the runtime already runs on: one model call is a future
//! (no blocking thread), dropping it cancels the request, and the body can be read as it
//! arrives, which streaming needs. TLS is rustls with the `ring` provider (no C build of
//! aws-lc); the provider is installed as the process default when none is.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use troupe_core::{ActorId, Deadline};
use troupe_runtime::Clock;

use crate::{ChatMessage, EarlyStop, LlmClient, LlmError, LlmReply, LlmRequest, Role, TokenUsage, ToolCall, ToolSpec};

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

/// The largest successful response body that is read, in bytes (a whole streamed
/// answer counts too); a longer body is [`LlmError::Malformed`].
pub const RESPONSE_BODY_BYTES_MAX: usize = 8 * 1024 * 1024;

/// Retries after the first attempt, by default ([`OpenAiConfig::retries_max`]).
pub const OPENAI_RETRIES_DEFAULT: u32 = 3;

/// The most retries a config may set.
pub const OPENAI_RETRIES_MAX: u32 = 10;

/// The first backoff ceiling, in milliseconds, by default
/// ([`OpenAiConfig::retry_backoff_initial`]).
pub const OPENAI_RETRY_BACKOFF_INITIAL_MS_DEFAULT: u64 = 250;

/// The largest backoff ceiling, in milliseconds, by default
/// ([`OpenAiConfig::retry_backoff_max`]).
pub const OPENAI_RETRY_BACKOFF_MS_MAX_DEFAULT: u64 = 8_000;

/// The longest `Retry-After` that is honoured as given, in milliseconds; a longer one is
/// cut to this (and then still bounded by the call's budget).
pub const RETRY_AFTER_MS_MAX: u64 = 60_000;

/// The least budget, in milliseconds, that must remain after a retry's wait for the
/// retry to be started.
pub const RETRY_ATTEMPT_MS_MIN: u64 = 100;

/// The jitter seed by default ([`OpenAiConfig::retry_jitter_seed`]).
pub const OPENAI_RETRY_JITTER_SEED_DEFAULT: u64 = 0x7201_0BE5_EED5_0001;

/// The number of distinct tool calls one streamed answer may carry (indices
/// `0..STREAM_TOOL_CALLS_MAX`); a higher index is [`LlmError::Malformed`].
pub const STREAM_TOOL_CALLS_MAX: usize = 128;

/// Which request field carries the completion's token cap ([`LlmRequest::max_tokens`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TokenCapField {
    /// `max_tokens`: what OpenAI-compatible servers read (the default).
    #[default]
    MaxTokens,
    /// `max_completion_tokens`: what OpenAI's newer models (the o-series, gpt-5)
    /// require; they refuse `max_tokens` with a 400.
    MaxCompletionTokens,
}

impl TokenCapField {
    /// The field's name in the request.
    pub fn name(self) -> &'static str {
        match self {
            Self::MaxTokens => "max_tokens",
            Self::MaxCompletionTokens => "max_completion_tokens",
        }
    }

    fn other(self) -> Self {
        match self {
            Self::MaxTokens => Self::MaxCompletionTokens,
            Self::MaxCompletionTokens => Self::MaxTokens,
        }
    }

    fn from_u8(value: u8) -> Self {
        if value == 1 {
            Self::MaxCompletionTokens
        } else {
            Self::MaxTokens
        }
    }

    fn to_u8(self) -> u8 {
        match self {
            Self::MaxTokens => 0,
            Self::MaxCompletionTokens => 1,
        }
    }
}

const _: () = assert!(OPENAI_REQUEST_TIMEOUT_MS_DEFAULT > 0);
const _: () = assert!(OPENAI_REQUEST_TIMEOUT_MS_DEFAULT <= OPENAI_REQUEST_TIMEOUT_MS_MAX);
const _: () = assert!(PROVIDER_ERROR_BODY_BYTES_MAX <= RESPONSE_BODY_BYTES_MAX);
const _: () = assert!(OPENAI_RETRIES_DEFAULT <= OPENAI_RETRIES_MAX);
const _: () = assert!(0 < OPENAI_RETRY_BACKOFF_INITIAL_MS_DEFAULT);
const _: () = assert!(OPENAI_RETRY_BACKOFF_INITIAL_MS_DEFAULT <= OPENAI_RETRY_BACKOFF_MS_MAX_DEFAULT);

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
    /// The API key cannot be sent in the `Authorization` header (it holds a character
    /// other than visible ASCII: a newline, a control or a non-ASCII character pasted
    /// with it). The key itself is not shown.
    #[error("api_key cannot be sent in an HTTP header: {cause}; check the key for a pasted newline, space or non-ASCII character")]
    InvalidApiKey {
        /// Which character is wrong, and where (never the key).
        cause: String,
    },
    /// The base URL is not an `http://` or `https://` URL, or does not parse as one.
    #[error("base_url must be an http:// or https:// URL, got {base_url:?}{}", cause.as_deref().map(|cause| format!(": {cause}")).unwrap_or_default())]
    InvalidBaseUrl {
        /// The rejected URL.
        base_url: String,
        /// Why it does not parse, when it starts right.
        cause: Option<String>,
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
    /// The retry settings are outside their bounds.
    #[error(
        "retries must satisfy retries_max <= {OPENAI_RETRIES_MAX} and \
         0 < retry_backoff_initial <= retry_backoff_max: {cause}"
    )]
    InvalidRetry {
        /// Which rule is broken.
        cause: String,
    },
    /// The HTTP client could not be built (TLS set-up).
    #[error("the HTTP client could not be built: {cause}")]
    HttpClient {
        /// What failed.
        cause: String,
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
    /// The longest one call may take, retries included; the request's deadline may
    /// shorten it.
    pub request_timeout: Duration,
    /// Ask for a streamed answer (`stream: true`, SSE); default `false`.
    pub stream: bool,
    /// Retries after the first attempt (default [`OPENAI_RETRIES_DEFAULT`], at most
    /// [`OPENAI_RETRIES_MAX`]); 0 turns retries off.
    pub retries_max: u32,
    /// The backoff ceiling before the first retry (default
    /// [`OPENAI_RETRY_BACKOFF_INITIAL_MS_DEFAULT`] ms); it doubles per retry.
    pub retry_backoff_initial: Duration,
    /// The largest backoff ceiling (default [`OPENAI_RETRY_BACKOFF_MS_MAX_DEFAULT`] ms).
    pub retry_backoff_max: Duration,
    /// Seeds the jitter generator (default [`OPENAI_RETRY_JITTER_SEED_DEFAULT`]).
    pub retry_jitter_seed: u64,
    /// The field the token cap is sent in (default [`TokenCapField::MaxTokens`]; env
    /// `OPENAI_TOKEN_CAP_FIELD`). A 400 refusing it switches to the other one.
    pub token_cap_field: TokenCapField,
}

impl std::fmt::Debug for OpenAiConfig {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("OpenAiConfig")
            .field("base_url", &self.base_url)
            .field("api_key", &"<redacted>")
            .field("model", &self.model)
            .field("request_timeout", &self.request_timeout)
            .field("stream", &self.stream)
            .field("retries_max", &self.retries_max)
            .field("retry_backoff_initial", &self.retry_backoff_initial)
            .field("retry_backoff_max", &self.retry_backoff_max)
            .field("retry_jitter_seed", &self.retry_jitter_seed)
            .field("token_cap_field", &self.token_cap_field)
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
            stream: false,
            retries_max: OPENAI_RETRIES_DEFAULT,
            retry_backoff_initial: Duration::from_millis(OPENAI_RETRY_BACKOFF_INITIAL_MS_DEFAULT),
            retry_backoff_max: Duration::from_millis(OPENAI_RETRY_BACKOFF_MS_MAX_DEFAULT),
            retry_jitter_seed: OPENAI_RETRY_JITTER_SEED_DEFAULT,
            token_cap_field: TokenCapField::MaxTokens,
        }
    }

    /// This config, sending the token cap in `field`.
    #[must_use]
    pub fn with_token_cap_field(mut self, field: TokenCapField) -> Self {
        self.token_cap_field = field;
        self
    }

    /// Reads the config from the process environment: `OPENAI_API_KEY` (required),
    /// `OPENAI_BASE_URL`, `OPENAI_MODEL`, `OPENAI_REQUEST_TIMEOUT_MS` and
    /// `OPENAI_TOKEN_CAP_FIELD` (`max_tokens` or `max_completion_tokens`) (optional; an
    /// empty variable counts as unset), then validates it. The other fields keep their
    /// defaults.
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
        if let Some(field) = read("OPENAI_TOKEN_CAP_FIELD") {
            config.token_cap_field = match field.trim() {
                "max_tokens" => TokenCapField::MaxTokens,
                "max_completion_tokens" => TokenCapField::MaxCompletionTokens,
                other => {
                    return Err(OpenAiConfigError::InvalidEnv {
                        name: "OPENAI_TOKEN_CAP_FIELD",
                        cause: format!("{other:?} is neither max_tokens nor max_completion_tokens"),
                    })
                }
            };
        }
        config.validate()?;
        Ok(config)
    }

    /// Checks every field.
    ///
    /// # Errors
    /// The first violated rule: a non-empty API key of visible ASCII (it goes in a
    /// header), a non-empty model, an `http(s)://` base URL that parses,
    /// `0 < request_timeout <= OPENAI_REQUEST_TIMEOUT_MS_MAX` ms, `retries_max <=
    /// OPENAI_RETRIES_MAX` and `0 < retry_backoff_initial <= retry_backoff_max`.
    pub fn validate(&self) -> Result<(), OpenAiConfigError> {
        if self.api_key.is_empty() {
            return Err(OpenAiConfigError::EmptyApiKey);
        }
        // What a header value may hold: visible ASCII and spaces (RFC 9110 field values,
        // as reqwest builds them). Checked here, a key that cannot be sent was the
        // request's "builder error", reported as `Unreachable` after every retry.
        if let Some((index, character)) = self
            .api_key
            .char_indices()
            .find(|(_, character)| !(character.is_ascii_graphic() || *character == ' '))
        {
            return Err(OpenAiConfigError::InvalidApiKey {
                cause: format!(
                    "character {} of the key is {}",
                    self.api_key[..index].chars().count() + 1,
                    if character.is_ascii_control() {
                        format!("the control character {:?}", character)
                    } else {
                        format!("the non-ASCII character U+{:04X}", u32::from(character))
                    }
                ),
            });
        }
        let scheme_ok = self.base_url.starts_with("http://") || self.base_url.starts_with("https://");
        let host_present = self
            .base_url
            .split_once("://")
            .is_some_and(|(_, rest)| !rest.trim_start_matches('/').is_empty());
        if !scheme_ok || !host_present {
            return Err(OpenAiConfigError::InvalidBaseUrl {
                base_url: self.base_url.clone(),
                cause: None,
            });
        }
        // Parsed as the request will parse it: a URL that does not parse was the
        // request's "builder error", reported as `Unreachable` after every retry.
        if let Err(error) = reqwest::Url::parse(&self.chat_completions_url()) {
            return Err(OpenAiConfigError::InvalidBaseUrl {
                base_url: self.base_url.clone(),
                cause: Some(error.to_string()),
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
        if self.retries_max > OPENAI_RETRIES_MAX {
            return Err(OpenAiConfigError::InvalidRetry {
                cause: format!("retries_max is {}", self.retries_max),
            });
        }
        if self.retry_backoff_initial.is_zero() || self.retry_backoff_initial > self.retry_backoff_max {
            return Err(OpenAiConfigError::InvalidRetry {
                cause: format!(
                    "retry_backoff_initial is {:?}, retry_backoff_max is {:?}",
                    self.retry_backoff_initial, self.retry_backoff_max
                ),
            });
        }
        Ok(())
    }

    /// `{base_url}/chat/completions`.
    fn chat_completions_url(&self) -> String {
        format!("{}/chat/completions", self.base_url.trim_end_matches('/'))
    }
}

/// One piece of a streamed answer, as it arrives, and its end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamDelta<'a> {
    /// More of the assistant's text.
    Text(&'a str),
    /// More of tool call number `index` (in the order the model started them).
    ToolCall {
        /// The call's position in the answer.
        index: usize,
        /// The call's id, on the delta that carries it (usually the first).
        id: Option<&'a str>,
        /// The tool's name, on the delta that carries it (usually the first).
        name: Option<&'a str>,
        /// The next fragment of the arguments' JSON text (may be empty).
        arguments: &'a str,
    },
    /// The stream ended: the answer's last delta. `Ok` when what arrived is the answer
    /// (the model call returns it); `Err` with the call's error when it is not: the
    /// provider stopped it early ([`LlmError::StoppedEarly`]: its content filter withheld
    /// it, or it failed mid-answer), or the stream broke off or was malformed. Text an
    /// observer already showed is then to be withdrawn: it is not the agent's answer.
    /// Not sent for a call cut before its stream ended (its deadline passed, its turn
    /// was cancelled), nor for one answered with an error status (no delta came).
    End {
        /// How the stream ended.
        outcome: Result<(), &'a LlmError>,
    },
}

/// Sees a streamed answer's deltas as they arrive (tokens to a UI, a log, a metric).
///
/// Called on the task that runs the model call, between reads: keep it quick and do
/// not block. A closure `Fn(&ActorId, &StreamDelta)` is an observer.
pub trait StreamObserver: Send + Sync + 'static {
    /// One delta of the answer `agent` is receiving.
    fn on_delta(&self, agent: &ActorId, delta: &StreamDelta<'_>);
}

impl<F> StreamObserver for F
where
    F: Fn(&ActorId, &StreamDelta<'_>) + Send + Sync + 'static,
{
    fn on_delta(&self, agent: &ActorId, delta: &StreamDelta<'_>) {
        self(agent, delta);
    }
}

/// SplitMix64: a tiny seeded generator for backoff jitter (no OS randomness).
#[derive(Debug)]
struct Jitter {
    state: u64,
}

impl Jitter {
    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Installs rustls' `ring` provider as the process default unless one is installed
/// (reqwest and rmcp's HTTP transport are built without a provider of their own, in
/// this workspace): call it before building a reqwest client.
pub fn ensure_tls_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Losing a race to another installer is fine: some provider is then installed.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// An [`LlmClient`] for OpenAI-compatible chat-completions providers.
///
/// Cheap to clone (connections are pooled and shared between clones, and so is the
/// jitter generator).
///
/// # Examples
/// ```no_run
/// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
/// use troupe_agent::{OpenAiClient, OpenAiConfig};
/// let client = OpenAiClient::new(OpenAiConfig::from_env()?, troupe_runtime::Clock::new())?;
/// # let _ = client; Ok(()) }
/// ```
#[derive(Clone)]
pub struct OpenAiClient {
    config: OpenAiConfig,
    clock: Clock,
    http: reqwest::Client,
    jitter: Arc<Mutex<Jitter>>,
    observer: Option<Arc<dyn StreamObserver>>,
    /// The [`TokenCapField`] sent now (`to_u8`), shared by clones: the config's, until a
    /// 400 refuses it.
    token_cap_field: Arc<AtomicU8>,
}

impl std::fmt::Debug for OpenAiClient {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("OpenAiClient")
            .field("config", &self.config)
            .field("observer", &self.observer.is_some())
            .finish_non_exhaustive()
    }
}

impl OpenAiClient {
    /// A client for `config`; request deadlines are read on `clock`, which must be the
    /// runtime's clock (`RuntimeHandle::clock()`) so deadlines share its epoch.
    ///
    /// # Errors
    /// Any error of [`OpenAiConfig::validate`], or [`OpenAiConfigError::HttpClient`].
    pub fn new(config: OpenAiConfig, clock: Clock) -> Result<Self, OpenAiConfigError> {
        config.validate()?;
        ensure_tls_provider();
        let http = reqwest::Client::builder()
            .user_agent(concat!("troupe-agent/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|error| OpenAiConfigError::HttpClient {
                cause: error.to_string(),
            })?;
        let jitter = Arc::new(Mutex::new(Jitter {
            state: config.retry_jitter_seed,
        }));
        let token_cap_field = Arc::new(AtomicU8::new(config.token_cap_field.to_u8()));
        Ok(Self {
            config,
            clock,
            http,
            jitter,
            observer: None,
            token_cap_field,
        })
    }

    /// This client, handing every delta of a streamed answer to `observer` (only when
    /// [`OpenAiConfig::stream`] is on).
    #[must_use]
    pub fn with_stream_observer(mut self, observer: Arc<dyn StreamObserver>) -> Self {
        self.observer = Some(observer);
        self
    }

    /// The config this client was built with.
    pub fn config(&self) -> &OpenAiConfig {
        &self.config
    }

    /// The full-jitter wait before retry number `retry` (0-based): uniform in
    /// `[0, min(backoff_max, backoff_initial * 2^retry)]`, whole milliseconds.
    fn backoff(&self, retry: u32) -> Duration {
        let initial_ms = u64::try_from(self.config.retry_backoff_initial.as_millis()).unwrap_or(u64::MAX);
        let max_ms = u64::try_from(self.config.retry_backoff_max.as_millis()).unwrap_or(u64::MAX);
        let ceiling_ms = initial_ms
            .checked_shl(retry.min(63))
            .filter(|shifted| shifted >> retry.min(63) == initial_ms)
            .unwrap_or(u64::MAX)
            .min(max_ms);
        let draw = self
            .jitter
            .lock()
            .expect("the jitter lock is never poisoned")
            .next_u64();
        Duration::from_millis(draw % ceiling_ms.saturating_add(1))
    }

    /// One HTTP exchange: send, then read the whole answer (or stream).
    async fn attempt(&self, body: &[u8], agent: &ActorId) -> Result<LlmReply, Attempt> {
        let response = self
            .http
            .post(self.config.chat_completions_url())
            .bearer_auth(&self.config.api_key)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.to_vec())
            .send()
            .await
            .map_err(|error| Attempt::Retryable {
                error: LlmError::Unreachable {
                    cause: describe_reqwest_error(&error),
                },
                retry_after: None,
            })?;
        let status = response.status().as_u16();
        if status >= 400 {
            let retry_after = retry_after(response.headers());
            let (bytes, _) = read_capped(response, PROVIDER_ERROR_BODY_BYTES_MAX)
                .await
                .unwrap_or_default();
            let text = String::from_utf8_lossy(&bytes);
            let error = LlmError::Provider {
                status,
                body: troupe_core::truncate_utf8(&text, PROVIDER_ERROR_BODY_BYTES_MAX).to_owned(),
                retry_after_ms: retry_after.map(|wait| u64::try_from(wait.as_millis()).unwrap_or(u64::MAX)),
            };
            return Err(if status == 408 || status == 429 || status >= 500 {
                Attempt::Retryable { error, retry_after }
            } else {
                Attempt::Final(error)
            });
        }
        if self.config.stream {
            return read_stream(response, agent, self.observer.as_deref())
                .await
                .map_err(Attempt::Final);
        }
        let (bytes, over) =
            read_capped(response, RESPONSE_BODY_BYTES_MAX)
                .await
                .map_err(|error| Attempt::Retryable {
                    error,
                    retry_after: None,
                })?;
        if over {
            return Err(Attempt::Final(LlmError::Malformed {
                cause: format!("the response body exceeds {RESPONSE_BODY_BYTES_MAX} bytes"),
            }));
        }
        parse_response(&bytes).map_err(Attempt::Final)
    }
}

/// How one attempt failed.
enum Attempt {
    /// Worth another attempt, after `retry_after` if the provider said.
    Retryable {
        error: LlmError,
        retry_after: Option<Duration>,
    },
    /// Not worth another attempt.
    Final(LlmError),
}

#[async_trait]
impl LlmClient for OpenAiClient {
    async fn complete(&self, request: LlmRequest) -> Result<LlmReply, LlmError> {
        let started = self.clock.now();
        let budget = self.config.request_timeout.min(request.deadline.remaining(started));
        let timeout_ms = u64::try_from(budget.as_millis()).unwrap_or(u64::MAX);
        if budget.is_zero() {
            return Err(LlmError::Timeout { timeout_ms });
        }
        let end = Deadline::after(started, budget);
        let model = if request.model.is_empty() {
            self.config.model.as_str()
        } else {
            request.model.as_str()
        };
        let mut field = TokenCapField::from_u8(self.token_cap_field.load(Ordering::Relaxed));
        let encode = |field| {
            serde_json::to_vec(&WireRequest::from_request(model, &request, self.config.stream, field))
                .expect("a request of strings and JSON values always serializes")
        };
        let mut body = encode(field);
        let mut switched = false;
        let mut retries = 0;
        loop {
            let outcome = match self.clock.run_until(end, self.attempt(&body, &request.agent)).await {
                Err(_elapsed) => return Err(LlmError::Timeout { timeout_ms }),
                Ok(outcome) => outcome,
            };
            let (error, retry_after) = match outcome {
                Ok(reply) => return Ok(reply),
                Err(Attempt::Final(error)) => {
                    // The model refuses the field the cap was sent in (OpenAI's newer
                    // models and `max_tokens`): once, at once, with the other field,
                    // which the client keeps.
                    if !switched && request.max_tokens.is_some() && refuses_token_cap_field(&error, field) {
                        tracing::info!(
                            refused = field.name(),
                            sent = field.other().name(),
                            "model call: the provider refuses the token cap's field; sending the other"
                        );
                        field = field.other();
                        self.token_cap_field.store(field.to_u8(), Ordering::Relaxed);
                        body = encode(field);
                        switched = true;
                        continue;
                    }
                    return Err(error);
                }
                Err(Attempt::Retryable { error, retry_after }) => (error, retry_after),
            };
            if retries >= self.config.retries_max {
                return Err(error);
            }
            let wait = retry_after.unwrap_or_else(|| self.backoff(retries));
            let remaining = end.remaining(self.clock.now());
            if wait.saturating_add(Duration::from_millis(RETRY_ATTEMPT_MS_MIN)) > remaining {
                tracing::debug!(?error, ?wait, "model call: no time left to retry");
                return Err(error);
            }
            tracing::debug!(?error, ?wait, retry = retries + 1, "model call: retrying");
            tokio::time::sleep(wait).await;
            retries += 1;
        }
    }
}

/// Whether `error` is a 400 that refuses the token cap's `field`: it says a parameter
/// is unsupported, unknown or not allowed, and of the two fields' names (whole words) it
/// names `field` first, as OpenAI's "Unsupported parameter: 'max_tokens' is not supported
/// with this model. Use 'max_completion_tokens' instead." does. A 400 about the field's
/// value ("max_tokens is too large") is not a refusal of it.
fn refuses_token_cap_field(error: &LlmError, field: TokenCapField) -> bool {
    let LlmError::Provider { status: 400, body, .. } = error else {
        return false;
    };
    let body = body.to_ascii_lowercase();
    let refusal = ["unsupported", "not supported", "unrecognized", "unknown", "not allowed"]
        .iter()
        .any(|word| body.contains(word));
    let first_named = |name: &str| {
        body.match_indices(name).map(|(at, _)| at).find(|&at| {
            let word_byte = |byte: u8| byte.is_ascii_alphanumeric() || byte == b'_';
            let before = at.checked_sub(1).map(|index| body.as_bytes()[index]);
            let after = body.as_bytes().get(at + name.len()).copied();
            !before.is_some_and(word_byte) && !after.is_some_and(word_byte)
        })
    };
    match (first_named(field.name()), first_named(field.other().name())) {
        (Some(sent), Some(other)) => refusal && sent < other,
        (Some(_), None) => refusal,
        (None, _) => false,
    }
}

/// The wait a 429/5xx asks for: `retry-after-ms` (OpenAI's, milliseconds) or
/// `Retry-After` in seconds, capped at [`RETRY_AFTER_MS_MAX`]; `None` when absent or in
/// the HTTP-date form.
fn retry_after(headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    let number = |name: &str| -> Option<f64> {
        let value = headers.get(name)?.to_str().ok()?.trim().parse::<f64>().ok()?;
        (value.is_finite() && value >= 0.0).then_some(value)
    };
    let ms = number("retry-after-ms").or_else(|| number("retry-after").map(|seconds| seconds * 1_000.0))?;
    // The cap keeps the float-to-int conversion in range.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let ms = ms.min(RETRY_AFTER_MS_MAX as f64).ceil() as u64;
    Some(Duration::from_millis(ms))
}

/// A reqwest error's text with its chain of causes (the URL is in it, never the key).
fn describe_reqwest_error(error: &reqwest::Error) -> String {
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Reads at most `limit_bytes` of the body; `true` when there was more.
async fn read_capped(mut response: reqwest::Response, limit_bytes: usize) -> Result<(Vec<u8>, bool), LlmError> {
    let mut bytes = Vec::new();
    loop {
        match response.chunk().await {
            Ok(None) => return Ok((bytes, false)),
            Ok(Some(chunk)) => {
                let room = limit_bytes - bytes.len();
                if chunk.len() > room {
                    bytes.extend_from_slice(&chunk[..room]);
                    return Ok((bytes, true));
                }
                bytes.extend_from_slice(&chunk);
            }
            Err(error) => {
                return Err(LlmError::Unreachable {
                    cause: format!("reading the response failed: {}", describe_reqwest_error(&error)),
                })
            }
        }
    }
}

/// A streamed answer being put together.
#[derive(Default)]
struct StreamAssembly {
    content: String,
    /// In the order they started.
    calls: Vec<PartialToolCall>,
    /// The position in `calls` of the call each provider index last started.
    position_of_index: Vec<Option<usize>>,
    usage: Option<TokenUsage>,
    done: bool,
    /// The provider stopped at its token limit (`finish_reason: "length"`).
    cut: bool,
    /// The provider stopped early for another reason, and its `finish_reason`.
    early: Option<(EarlyStop, String)>,
}

#[derive(Default)]
struct PartialToolCall {
    id: String,
    name: String,
    arguments: String,
}

impl StreamAssembly {
    /// Takes one SSE line (without its newline).
    fn line(&mut self, line: &[u8], agent: &ActorId, observer: Option<&dyn StreamObserver>) -> Result<(), LlmError> {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(data) = line.strip_prefix(b"data:") else {
            // Blank separators, comments (`:`), `event:`, `id:`, `retry:`.
            return Ok(());
        };
        let data = data.strip_prefix(b" ").unwrap_or(data);
        if self.done {
            return Err(LlmError::Malformed {
                cause: "the stream went on after [DONE]".to_owned(),
            });
        }
        if data == b"[DONE]" {
            self.done = true;
            return Ok(());
        }
        let chunk: WireChunk = serde_json::from_slice(data).map_err(|error| LlmError::Malformed {
            cause: format!("a stream chunk is not JSON: {error}"),
        })?;
        if let Some(error) = chunk.error {
            let text = error.to_string();
            return Err(LlmError::Malformed {
                cause: format!(
                    "the stream carried an error: {}",
                    troupe_core::truncate_utf8(&text, PROVIDER_ERROR_BODY_BYTES_MAX)
                ),
            });
        }
        if let Some(usage) = chunk.usage {
            self.usage = Some(usage.into());
        }
        for choice in chunk.choices.into_iter().filter(|choice| choice.index == 0) {
            match finish_of(choice.finish_reason.as_deref()) {
                Finish::Complete => {}
                Finish::Cut => self.cut = true,
                Finish::Early(early) => {
                    let reason = choice.finish_reason.as_deref().unwrap_or_default();
                    let reason = troupe_core::truncate_utf8(reason, PROVIDER_ERROR_BODY_BYTES_MAX).to_owned();
                    self.early = Some((early, reason));
                }
            }
            if let Some(text) = choice.delta.content.filter(|text| !text.is_empty()) {
                if let Some(observer) = observer {
                    observer.on_delta(agent, &StreamDelta::Text(&text));
                }
                self.content.push_str(&text);
            }
            for call in choice.delta.tool_calls {
                if call.index >= STREAM_TOOL_CALLS_MAX {
                    return Err(LlmError::Malformed {
                        cause: format!("tool call index {} is not below {STREAM_TOOL_CALLS_MAX}", call.index),
                    });
                }
                if self.position_of_index.len() <= call.index {
                    self.position_of_index.resize(call.index + 1, None);
                }
                // A delta continues the call its index started, unless it names another
                // id: some servers send parallel calls whole, each at index 0 (or with no
                // index). Merged, their arguments ran together ("trailing characters").
                let continued = self.position_of_index[call.index].filter(|position| {
                    let held = &self.calls[*position].id;
                    call.id
                        .as_deref()
                        .is_none_or(|id| id.is_empty() || held.is_empty() || id == held)
                });
                let position = match continued {
                    Some(position) => position,
                    None => {
                        if self.calls.len() >= STREAM_TOOL_CALLS_MAX {
                            return Err(LlmError::Malformed {
                                cause: format!("the answer holds more than {STREAM_TOOL_CALLS_MAX} tool calls"),
                            });
                        }
                        self.calls.push(PartialToolCall::default());
                        self.position_of_index[call.index] = Some(self.calls.len() - 1);
                        self.calls.len() - 1
                    }
                };
                let function = call.function.unwrap_or_default();
                if let Some(observer) = observer {
                    observer.on_delta(
                        agent,
                        &StreamDelta::ToolCall {
                            index: position,
                            id: call.id.as_deref(),
                            name: function.name.as_deref(),
                            arguments: function.arguments.as_deref().unwrap_or(""),
                        },
                    );
                }
                let partial = &mut self.calls[position];
                if let Some(id) = call.id.filter(|_| partial.id.is_empty()) {
                    partial.id = id;
                }
                if let Some(name) = function.name.filter(|_| partial.name.is_empty()) {
                    partial.name = name;
                }
                if let Some(arguments) = function.arguments {
                    partial.arguments.push_str(&arguments);
                }
            }
        }
        Ok(())
    }

    fn finish(self) -> Result<LlmReply, LlmError> {
        if !self.done {
            return Err(LlmError::Malformed {
                cause: "the stream ended before data: [DONE]".to_owned(),
            });
        }
        if let Some((reason, finish_reason)) = self.early {
            return Err(LlmError::StoppedEarly {
                reason,
                finish_reason,
                partial_bytes: self.content.len(),
            });
        }
        let mut tool_calls = Vec::with_capacity(self.calls.len());
        for call in self.calls {
            if call.name.is_empty() {
                return Err(LlmError::Malformed {
                    cause: format!("streamed tool call {:?} has no name", call.id),
                });
            }
            let arguments = decode_arguments(&call.id, &call.name, &call.arguments, self.cut)?;
            tool_calls.push(ToolCall {
                id: call.id,
                name: call.name,
                arguments,
            });
        }
        let message = ChatMessage {
            role: Role::Assistant,
            content: self.content,
            tool_calls,
            tool_call_id: None,
        };
        Ok(LlmReply {
            message,
            usage: self.usage,
            truncated: self.cut,
        })
    }
}

/// Reads an SSE body line by line into one reply ([`read_stream_body`]), and tells the
/// observer how the stream ended ([`StreamDelta::End`]).
async fn read_stream(
    response: reqwest::Response,
    agent: &ActorId,
    observer: Option<&dyn StreamObserver>,
) -> Result<LlmReply, LlmError> {
    let read = read_stream_body(response, agent, observer).await;
    if let Some(observer) = observer {
        observer.on_delta(
            agent,
            &StreamDelta::End {
                outcome: read.as_ref().map(drop),
            },
        );
    }
    read
}

/// Reads an SSE body line by line into one reply, at most [`RESPONSE_BODY_BYTES_MAX`].
async fn read_stream_body(
    mut response: reqwest::Response,
    agent: &ActorId,
    observer: Option<&dyn StreamObserver>,
) -> Result<LlmReply, LlmError> {
    let mut assembly = StreamAssembly::default();
    let mut pending: Vec<u8> = Vec::new();
    let mut total_bytes = 0_usize;
    loop {
        let chunk = match response.chunk().await {
            Ok(Some(chunk)) => chunk,
            Ok(None) => break,
            Err(error) => {
                return Err(LlmError::Malformed {
                    cause: format!("the stream broke off: {}", describe_reqwest_error(&error)),
                })
            }
        };
        total_bytes = total_bytes.saturating_add(chunk.len());
        if total_bytes > RESPONSE_BODY_BYTES_MAX {
            return Err(LlmError::Malformed {
                cause: format!("the streamed response exceeds {RESPONSE_BODY_BYTES_MAX} bytes"),
            });
        }
        pending.extend_from_slice(&chunk);
        let mut consumed = 0;
        while let Some(newline) = pending[consumed..].iter().position(|byte| *byte == b'\n') {
            assembly.line(&pending[consumed..consumed + newline], agent, observer)?;
            consumed += newline + 1;
        }
        pending.drain(..consumed);
    }
    if !pending.is_empty() {
        assembly.line(&pending, agent, observer)?;
    }
    assembly.finish()
}

/// How an answer ended, by its `finish_reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Finish {
    /// Complete (`"stop"`, `"tool_calls"`, none, ...).
    Complete,
    /// Stopped at the provider's token limit (`"length"`).
    Cut,
    /// Stopped early for another reason ([`LlmError::StoppedEarly`]).
    Early(EarlyStop),
}

/// What a `finish_reason` says (see the module's **Other finish reasons**).
fn finish_of(reason: Option<&str>) -> Finish {
    match reason {
        None
        | Some("" | "stop" | "tool_calls" | "function_call" | "eos" | "eos_token" | "stop_sequence" | "end_turn") => {
            Finish::Complete
        }
        Some("length") => Finish::Cut,
        Some("content_filter") => Finish::Early(EarlyStop::ContentFilter),
        Some("error") => Finish::Early(EarlyStop::Error),
        Some(other) => {
            tracing::warn!(
                finish_reason = other,
                "model call: an unknown finish_reason, taken as a complete answer"
            );
            Finish::Complete
        }
    }
}

/// An answer that ended as `finish` after `partial_bytes` of text, as an error when it
/// ended early.
fn check_finish(finish: Finish, reason: Option<&str>, partial_bytes: usize) -> Result<(), LlmError> {
    match finish {
        Finish::Early(early) => Err(LlmError::StoppedEarly {
            reason: early,
            finish_reason: troupe_core::truncate_utf8(reason.unwrap_or_default(), PROVIDER_ERROR_BODY_BYTES_MAX)
                .to_owned(),
            partial_bytes,
        }),
        Finish::Complete | Finish::Cut => Ok(()),
    }
}

/// Parses one tool call's JSON-string arguments; empty means `{}`. `cut`: the provider
/// stopped the answer at its token limit, which the error then names (the likely
/// reason the arguments end early).
fn decode_arguments(id: &str, name: &str, arguments: &str, cut: bool) -> Result<serde_json::Value, LlmError> {
    if arguments.trim().is_empty() {
        return Ok(serde_json::Value::Object(serde_json::Map::new()));
    }
    serde_json::from_str(arguments).map_err(|error| LlmError::Malformed {
        cause: format!(
            "the arguments of tool call {id:?} ({name}) are not JSON: {error}{}",
            if cut {
                "; the provider stopped the answer at its token limit (finish_reason \"length\"): allow the \
                 call more tokens (the agent's budget, or the provider's max_tokens)"
            } else {
                ""
            }
        ),
    })
}

/// Decodes a successful chat-completions body into the first choice's message.
fn parse_response(bytes: &[u8]) -> Result<LlmReply, LlmError> {
    let response: WireResponse = serde_json::from_slice(bytes).map_err(|error| {
        // Some gateways answer an error with status 200 and an `error` object: its text
        // is what says what went wrong (before, only "missing field `choices`" did).
        #[derive(Deserialize)]
        struct WireErrorBody {
            error: serde_json::Value,
        }
        match serde_json::from_slice::<WireErrorBody>(bytes) {
            Ok(WireErrorBody { error }) if !error.is_null() => {
                let text = match error.get("message").and_then(serde_json::Value::as_str) {
                    Some(message) => message.to_owned(),
                    None => error.to_string(),
                };
                LlmError::Malformed {
                    cause: format!(
                        "the provider answered status 200 with an error instead of a chat completion: {}",
                        troupe_core::truncate_utf8(&text, PROVIDER_ERROR_BODY_BYTES_MAX)
                    ),
                }
            }
            _ => LlmError::Malformed {
                cause: format!("the response is not a chat completion: {error}"),
            },
        }
    })?;
    let Some(choice) = response.choices.into_iter().next() else {
        return Err(LlmError::Malformed {
            cause: "the response has no choices".to_owned(),
        });
    };
    let finish = finish_of(choice.finish_reason.as_deref());
    check_finish(
        finish,
        choice.finish_reason.as_deref(),
        choice.message.content.as_deref().map_or(0, str::len),
    )?;
    let cut = finish == Finish::Cut;
    let mut tool_calls = Vec::with_capacity(choice.message.tool_calls.len());
    for call in choice.message.tool_calls {
        let arguments = match call.function.arguments {
            serde_json::Value::String(text) => decode_arguments(&call.id, &call.function.name, &text, cut)?,
            serde_json::Value::Null => serde_json::Value::Object(serde_json::Map::new()),
            object @ serde_json::Value::Object(_) => object,
            other => {
                return Err(LlmError::Malformed {
                    cause: format!(
                        "the arguments of tool call {:?} ({}) are neither a JSON string nor an object: {}",
                        call.id,
                        call.function.name,
                        troupe_core::truncate_utf8(&other.to_string(), PROVIDER_ERROR_BODY_BYTES_MAX)
                    ),
                })
            }
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
    Ok(LlmReply {
        message,
        usage: response.usage.map(TokenUsage::from),
        truncated: cut,
    })
}

// ---- The wire format (only the fields this client uses). ----

#[derive(Serialize)]
struct WireRequest<'a> {
    model: &'a str,
    messages: Vec<WireMessage<'a>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<WireTool<'a>>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<WireStreamOptions>,
    /// The turn's tokens left (the provider caps the completion with it), in the
    /// field [`TokenCapField`] says.
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_completion_tokens: Option<u64>,
}

#[derive(Serialize)]
struct WireStreamOptions {
    include_usage: bool,
}

impl<'a> WireRequest<'a> {
    fn from_request(model: &'a str, request: &'a LlmRequest, stream: bool, cap_field: TokenCapField) -> Self {
        let (max_tokens, max_completion_tokens) = match cap_field {
            TokenCapField::MaxTokens => (request.max_tokens, None),
            TokenCapField::MaxCompletionTokens => (None, request.max_tokens),
        };
        Self {
            model,
            messages: request.messages.iter().map(WireMessage::from_message).collect(),
            tools: request.tools.iter().map(WireTool::from_spec).collect(),
            stream,
            stream_options: stream.then_some(WireStreamOptions { include_usage: true }),
            max_tokens,
            max_completion_tokens,
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
    #[serde(default)]
    usage: Option<WireUsage>,
}

#[derive(Deserialize)]
struct WireUsage {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
    #[serde(default)]
    total_tokens: u64,
}

impl From<WireUsage> for TokenUsage {
    fn from(usage: WireUsage) -> Self {
        Self {
            prompt_tokens: usage.prompt_tokens,
            completion_tokens: usage.completion_tokens,
            total_tokens: usage.total_tokens,
        }
    }
}

/// One `data:` chunk of a streamed answer.
#[derive(Deserialize)]
struct WireChunk {
    #[serde(default, deserialize_with = "null_as_empty")]
    choices: Vec<WireChunkChoice>,
    #[serde(default)]
    usage: Option<WireUsage>,
    #[serde(default)]
    error: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct WireChunkChoice {
    #[serde(default)]
    index: u32,
    #[serde(default)]
    delta: WireDelta,
    /// On the choice's last chunk: `"length"` when the provider stopped at its token
    /// limit.
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize, Default)]
struct WireDelta {
    #[serde(default)]
    content: Option<String>,
    #[serde(default, deserialize_with = "null_as_empty")]
    tool_calls: Vec<WireToolCallDelta>,
}

#[derive(Deserialize)]
struct WireToolCallDelta {
    #[serde(default)]
    index: usize,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    function: Option<WireFunctionDelta>,
}

#[derive(Deserialize, Default)]
struct WireFunctionDelta {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
}

#[derive(Deserialize)]
struct WireChoice {
    message: WireReplyMessage,
    /// `"length"` when the provider stopped at its token limit.
    #[serde(default)]
    finish_reason: Option<String>,
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
    /// Absent or `null` from some OpenAI-compatible servers: then empty, and the agent
    /// gives the call an id of its own (`call_{step}_{index}`, as for an empty id).
    #[serde(default, deserialize_with = "null_as_empty_text")]
    id: String,
    function: WireFunctionCallIn,
}

#[derive(Deserialize)]
struct WireFunctionCallIn {
    name: String,
    /// A JSON string by the protocol; some servers send the JSON object itself.
    #[serde(default)]
    arguments: serde_json::Value,
}

/// A text field sent as `null` (or left out, with `#[serde(default)]`): empty.
fn null_as_empty_text<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
    Ok(Option::<String>::deserialize(deserializer)?.unwrap_or_default())
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

    #[tokio::test]
    async fn backoff_is_full_jitter_under_a_doubling_ceiling_and_reproducible_from_the_seed() {
        let mut config = OpenAiConfig::new("k");
        config.retry_backoff_initial = Duration::from_millis(100);
        config.retry_backoff_max = Duration::from_millis(700);
        let draws = |config: OpenAiConfig| {
            let client = OpenAiClient::new(config, Clock::new()).unwrap();
            (0..40).map(|retry| client.backoff(retry % 8)).collect::<Vec<_>>()
        };
        let first = draws(config.clone());
        assert_eq!(first, draws(config.clone()), "same seed, same waits");
        for (index, wait) in first.iter().enumerate() {
            let retry = u32::try_from(index % 8).unwrap();
            let ceiling_ms = (100_u64 << retry).min(700);
            assert!(wait.as_millis() <= u128::from(ceiling_ms), "retry {retry}: {wait:?}");
        }
        // Full jitter spreads: not every wait is at the ceiling or at zero.
        assert!(first.iter().any(|wait| wait.as_millis() > 0 && wait.as_millis() < 100));
        config.retry_jitter_seed ^= 1;
        assert_ne!(first, draws(config), "another seed, other waits");
    }

    #[test]
    fn retry_after_reads_milliseconds_or_seconds_and_caps_them() {
        let headers = |pairs: &[(&'static str, &str)]| {
            let mut map = reqwest::header::HeaderMap::new();
            for (name, value) in pairs {
                map.insert(*name, value.parse().unwrap());
            }
            map
        };
        assert_eq!(retry_after(&headers(&[])), None);
        assert_eq!(
            retry_after(&headers(&[("retry-after", "2")])),
            Some(Duration::from_secs(2))
        );
        assert_eq!(
            retry_after(&headers(&[("retry-after", "2"), ("retry-after-ms", "150")])),
            Some(Duration::from_millis(150))
        );
        assert_eq!(
            retry_after(&headers(&[("retry-after", "86400")])),
            Some(Duration::from_millis(RETRY_AFTER_MS_MAX))
        );
        assert_eq!(
            retry_after(&headers(&[("retry-after", "Wed, 21 Oct 2015 07:28:00 GMT")])),
            None
        );
        assert_eq!(retry_after(&headers(&[("retry-after", "-1")])), None);
    }

    #[test]
    fn validate_bounds_the_retry_settings() {
        let mut config = OpenAiConfig::new("k");
        config.retries_max = OPENAI_RETRIES_MAX + 1;
        assert!(matches!(config.validate(), Err(OpenAiConfigError::InvalidRetry { .. })));
        config.retries_max = OPENAI_RETRIES_MAX;
        config.retry_backoff_initial = Duration::ZERO;
        assert!(matches!(config.validate(), Err(OpenAiConfigError::InvalidRetry { .. })));
        config.retry_backoff_initial = config.retry_backoff_max + Duration::from_millis(1);
        assert!(matches!(config.validate(), Err(OpenAiConfigError::InvalidRetry { .. })));
        config.retry_backoff_initial = config.retry_backoff_max;
        assert_eq!(config.validate(), Ok(()));
    }

    #[test]
    fn stream_tool_call_index_out_of_range_is_malformed() {
        let agent = ActorId::new("agent", "a").unwrap();
        let mut assembly = StreamAssembly::default();
        let line = format!(
            r#"data: {{"choices":[{{"index":0,"delta":{{"tool_calls":[{{"index":{STREAM_TOOL_CALLS_MAX},"id":"x"}}]}}}}]}}"#
        );
        let error = assembly.line(line.as_bytes(), &agent, None).unwrap_err();
        assert!(matches!(error, LlmError::Malformed { .. }), "{error:?}");
    }

    #[test]
    fn only_a_400_refusing_the_field_sent_switches_it() {
        let provider = |status, body: &str| LlmError::Provider {
            status,
            body: body.to_owned(),
            retry_after_ms: None,
        };
        let refused = provider(
            400,
            r#"{"error":{"message":"Unsupported parameter: 'max_tokens' is not supported with this model. Use 'max_completion_tokens' instead.","param":"max_tokens","code":"unsupported_parameter"}}"#,
        );
        assert!(refuses_token_cap_field(&refused, TokenCapField::MaxTokens));
        // The other field was sent: this refusal is not about it.
        assert!(!refuses_token_cap_field(&refused, TokenCapField::MaxCompletionTokens));
        let unknown = provider(
            400,
            r#"{"detail":"Unrecognized request argument supplied: max_completion_tokens"}"#,
        );
        assert!(refuses_token_cap_field(&unknown, TokenCapField::MaxCompletionTokens));
        assert!(!refuses_token_cap_field(&unknown, TokenCapField::MaxTokens));
        let unknown = provider(400, r#"{"error":"unknown field \"max_completion_tokens\""}"#);
        assert!(refuses_token_cap_field(&unknown, TokenCapField::MaxCompletionTokens));
        // A cap too large for the model is a 400 about the field, not a refusal of it.
        let too_large = provider(
            400,
            r#"{"error":{"message":"max_tokens is too large: 500000. This model supports at most 16384 completion tokens.","param":"max_tokens","code":"invalid_value"}}"#,
        );
        assert!(!refuses_token_cap_field(&too_large, TokenCapField::MaxTokens));
        assert!(!refuses_token_cap_field(
            &provider(422, refused_body(&refused)),
            TokenCapField::MaxTokens
        ));
    }

    fn refused_body(error: &LlmError) -> &str {
        match error {
            LlmError::Provider { body, .. } => body,
            _ => "",
        }
    }

    #[test]
    fn response_without_choices_is_malformed() {
        let error = parse_response(br#"{"choices":[]}"#).unwrap_err();
        assert!(matches!(error, LlmError::Malformed { .. }));
        let error = parse_response(b"not json").unwrap_err();
        assert!(matches!(error, LlmError::Malformed { .. }));
    }
}
