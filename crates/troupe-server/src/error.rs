//! The one error shape of every route: `{"error": {"code": "...", "message": "..."}}`,
//! with the status and (for 429 and 503) `Retry-After` decided from the typed error.

use std::borrow::Cow;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use troupe_agent::{AgentCallError, InboxError};
use troupe_core::{CallRefused, InvokeError};
use troupe_runtime::StoreError;

use crate::limits::SERVER_RETRY_AFTER_S;

/// An error answered to an HTTP client: a status, a stable machine-readable `code` and
/// a message for people saying what was wrong and what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// A stable snake_case code, e.g. `agent_not_found`, `busy`, `timeout`.
    pub code: &'static str,
    /// What went wrong, for people.
    pub message: String,
    /// Seconds to wait before retrying, sent as `Retry-After`.
    pub retry_after_s: Option<u64>,
    /// OpenAI's error `type` (`invalid_request_error`, `server_error`): set on the
    /// OpenAI-compatible routes' errors, whose body then also carries `type` and `param`
    /// as OpenAI's does (`{"error": {"message", "type", "param", "code"}}`).
    pub openai_type: Option<&'static str>,
    /// The request field the error is about (OpenAI's `param`), if any: a top-level
    /// field's name, or serde's path to a nested one (`messages[0].role`).
    pub param: Option<Cow<'static, str>>,
}

impl ApiError {
    /// An error with `status`, `code` and `message` and no `Retry-After`.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            retry_after_s: None,
            openai_type: None,
            param: None,
        }
    }

    /// The same error in OpenAI's shape: `type` (`invalid_request_error` for a client
    /// error, `server_error` otherwise, unless set already) and `param` in its body.
    pub fn openai(mut self) -> Self {
        // OpenAI's API answers every invalid request 400 (its clients raise
        // `BadRequestError`); the REST routes' 422 becomes that.
        if self.status == StatusCode::UNPROCESSABLE_ENTITY {
            self.status = StatusCode::BAD_REQUEST;
        }
        if self.openai_type.is_none() {
            self.openai_type = Some(if self.status.is_client_error() {
                "invalid_request_error"
            } else {
                "server_error"
            });
        }
        self
    }

    /// The same error about request field `param` (OpenAI's `param`).
    pub fn param(mut self, param: impl Into<Cow<'static, str>>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// The JSON body: `{"error": {"code", "message"}}`, plus `type` and `param` (null
    /// if none) for an error in OpenAI's shape ([`ApiError::openai`]).
    pub fn body(&self) -> serde_json::Value {
        let mut error = json!({"code": self.code, "message": self.message});
        if let Some(kind) = self.openai_type {
            error["type"] = json!(kind);
            error["param"] = json!(self.param);
        }
        json!({ "error": error })
    }

    /// The same error with `Retry-After: SERVER_RETRY_AFTER_S`.
    pub(crate) fn retry_after(mut self) -> Self {
        self.retry_after_s = Some(SERVER_RETRY_AFTER_S);
        self
    }

    /// 400 `bad_request`.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }

    /// 422 with `code`.
    pub fn unprocessable(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, code, message)
    }

    /// 404 `agent_not_found` for agent `agent`.
    pub fn agent_not_found(agent: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "agent_not_found",
            format!("agent {agent:?} not found; GET /v1/agents lists the agents"),
        )
    }

    /// 503 `overloaded`, with `Retry-After`.
    pub fn overloaded(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "overloaded", message).retry_after()
    }

    /// 503 `storage_unavailable`, with `Retry-After`: the store failed for a moment
    /// ([`StoreError::Unavailable`]: its connection refused or closed, its server
    /// restarting, its file locked by another process) and the runtime's tries within
    /// the request's deadline did not get through. Almost always nothing was committed;
    /// a connection lost after `COMMIT` was sent may have applied it unseen, so only a
    /// request carrying a `msg_id` is sure to run once when sent again. Until 2026-12-07
    /// it was 500 `storage_failed`, which told a client not to retry.
    pub fn storage_unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "storage_unavailable", message).retry_after()
    }

    /// The answer to a store failure `error` said as `message`: 503
    /// `storage_unavailable` if it is transient ([`StoreError::is_transient`]), 500
    /// `storage_failed` otherwise.
    pub fn storage(error: &StoreError, message: impl Into<String>) -> Self {
        if error.is_transient() {
            Self::storage_unavailable(message)
        } else {
            Self::new(StatusCode::INTERNAL_SERVER_ERROR, "storage_failed", message)
        }
    }

    /// 500 `internal`.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }
}

impl From<&CallRefused> for ApiError {
    fn from(refused: &CallRefused) -> Self {
        let message = refused.to_string();
        match refused {
            CallRefused::AgentNotFound { .. } => Self::new(StatusCode::NOT_FOUND, "agent_not_found", message),
            CallRefused::TooManyCalls { .. } => Self::new(StatusCode::TOO_MANY_REQUESTS, "busy", message).retry_after(),
            CallRefused::InvalidTimeout { .. } => Self::unprocessable("invalid_timeout", message),
            CallRefused::DeadlineExpired => Self::new(StatusCode::GATEWAY_TIMEOUT, "timeout", message),
            _ => Self::new(StatusCode::CONFLICT, "refused", message),
        }
    }
}

impl From<&InvokeError> for ApiError {
    fn from(error: &InvokeError) -> Self {
        let message = error.to_string();
        match error {
            InvokeError::Timeout { .. } => Self::new(StatusCode::GATEWAY_TIMEOUT, "timeout", message),
            InvokeError::Busy { .. } => Self::new(StatusCode::TOO_MANY_REQUESTS, "busy", message).retry_after(),
            InvokeError::DispatcherBusy { .. } | InvokeError::ConnectionBusy { .. } => Self::overloaded(message),
            InvokeError::Refused(refused) => refused.into(),
            InvokeError::ActorFailed { .. } => Self::new(StatusCode::INTERNAL_SERVER_ERROR, "agent_failed", message),
            InvokeError::Rejected { .. } | InvokeError::DeadlockDetected { .. } => {
                Self::new(StatusCode::CONFLICT, "refused", message)
            }
            // Another process (another server on the same store) took the agent over
            // since this server's activation of it: the turn committed nothing and the
            // stale activation is closed, so the same request sent again runs on a
            // fresh activation from the newest state.
            InvokeError::StorageFailed {
                source: StoreError::Fenced { .. },
                ..
            } => Self::new(StatusCode::SERVICE_UNAVAILABLE, "fenced", message).retry_after(),
            // The store failed for a moment (`Unavailable`) and stayed down past the
            // request's deadline: 503 `storage_unavailable`. Any other store failure
            // would fail the same way again: 500 `storage_failed`. An `Unavailable`
            // from another node arrives as itself (transport protocol 8) and is 503.
            InvokeError::StorageFailed { source, .. } => Self::storage(source, message),
            InvokeError::Unreachable { .. } => Self::new(StatusCode::BAD_GATEWAY, "unreachable", message),
            // The runtime is stopping (or stopped) while the server still serves: a
            // server started again on this address serves the same request, so say when
            // to try, as every other 503 does. Until 2026-12-07 it had no `Retry-After`
            // and said only "the runtime has shut down".
            InvokeError::Shutdown | InvokeError::Cancelled { .. } => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "shutting_down",
                format!("{message}: this server is stopping; send the request again once it is back"),
            )
            .retry_after(),
            InvokeError::ActorNotFound { .. } => Self::internal(message),
        }
    }
}

impl From<AgentCallError> for ApiError {
    fn from(error: AgentCallError) -> Self {
        match &error {
            AgentCallError::Refused(refused) => refused.into(),
            AgentCallError::Invoke(invoke) => invoke.into(),
            // The agent's model failed (typed since 2026-12-07; an `ActorFailed` before):
            // answered as that was, 500 `agent_failed` with the same text.
            AgentCallError::ModelFailed(_) => {
                Self::new(StatusCode::INTERNAL_SERVER_ERROR, "agent_failed", error.to_string())
            }
            AgentCallError::InvalidAgentId { .. } => Self::bad_request(error.to_string()),
            AgentCallError::MalformedReply { .. } => Self::internal(error.to_string()),
            AgentCallError::NotPermitted(_) => Self::new(StatusCode::FORBIDDEN, "not_permitted", error.to_string()),
            AgentCallError::BudgetExhausted(_) => Self::unprocessable("budget_exhausted", error.to_string()),
            AgentCallError::Remote(_) => Self::new(StatusCode::BAD_GATEWAY, "remote_failed", error.to_string()),
            // Only `call_agent`'s tool gets it (a turn's call); an ask from outside never does.
            AgentCallError::SentAsTask { .. } => Self::internal(error.to_string()),
        }
    }
}

impl From<InboxError> for ApiError {
    fn from(error: InboxError) -> Self {
        let message = error.to_string();
        match &error {
            InboxError::Refused(refused) => refused.into(),
            InboxError::Invoke(invoke) => invoke.into(),
            InboxError::Full { .. } => Self::new(StatusCode::TOO_MANY_REQUESTS, "inbox_full", message).retry_after(),
            InboxError::OutboxFull { .. } => {
                Self::new(StatusCode::TOO_MANY_REQUESTS, "outbox_full", message).retry_after()
            }
            InboxError::InvalidAgentId { .. } => Self::bad_request(message),
            InboxError::EmptyMessageId | InboxError::MessageIdTooLong { .. } => {
                Self::unprocessable("invalid_message_id", message)
            }
            InboxError::UnknownTask { .. } => Self::new(StatusCode::NOT_FOUND, "task_not_found", message),
            InboxError::Malformed { .. } => Self::internal(message),
            InboxError::NotPermitted(_) => Self::new(StatusCode::FORBIDDEN, "not_permitted", message),
            InboxError::BudgetExhausted(_) => Self::unprocessable("budget_exhausted", message),
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(error: StoreError) -> Self {
        Self::storage(&error, error.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(seconds) = self.retry_after_s {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

/// A JSON body whose rejections are [`ApiError`]s: 400 `invalid_json` (syntax), 422
/// `invalid_body` (wrong fields or types), 415 `unsupported_media_type` (no
/// `Content-Type: application/json`), 413 `body_too_large`.
pub(crate) struct ApiJson<T>(pub(crate) T);

impl<T, S> axum::extract::FromRequest<S> for ApiJson<T>
where
    T: serde::de::DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(request: axum::extract::Request, state: &S) -> Result<Self, ApiError> {
        if !is_json(request.headers()) {
            return Err(not_json(request.headers()));
        }
        match axum::Json::<T>::from_request(request, state).await {
            Ok(axum::Json(value)) => Ok(Self(value)),
            Err(rejection) => {
                let status = rejection.status();
                let code = match status {
                    StatusCode::BAD_REQUEST => "invalid_json",
                    StatusCode::UNPROCESSABLE_ENTITY => "invalid_body",
                    StatusCode::UNSUPPORTED_MEDIA_TYPE => "unsupported_media_type",
                    StatusCode::PAYLOAD_TOO_LARGE => "body_too_large",
                    _ => "bad_request",
                };
                Err(ApiError::new(status, code, rejection.body_text()))
            }
        }
    }
}

/// A JSON body of an OpenAI-compatible route: as [`ApiJson`] (the same codes; a 422 is
/// 400 there, as OpenAI's API answers any invalid request: [`ApiError::openai`]),
/// its refusals in OpenAI's shape (`type: "invalid_request_error"`) with `param` naming
/// the field that is wrong, as serde's path to it (`messages[0].role`; a missing field
/// by its own path; null when the body as a whole is wrong: not JSON at its start, or
/// not `Content-Type: application/json`). Until 2026-12-06 the chat completion's body
/// was read by [`ApiJson`], whose refusals had neither `type` nor `param`.
pub(crate) struct OpenAiJson<T>(pub(crate) T);

impl<T, S> axum::extract::FromRequest<S> for OpenAiJson<T>
where
    T: serde::de::DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(request: axum::extract::Request, state: &S) -> Result<Self, ApiError> {
        if !is_json(request.headers()) {
            return Err(not_json(request.headers()).openai());
        }
        let bytes = axum::body::Bytes::from_request(request, state)
            .await
            .map_err(|rejection| {
                let code = if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                    "body_too_large"
                } else {
                    "body_unreadable"
                };
                ApiError::new(rejection.status(), code, rejection.body_text()).openai()
            })?;
        let mut json = serde_json::Deserializer::from_slice(&bytes);
        let value: T = serde_path_to_error::deserialize(&mut json)
            .map_err(|error| body_refusal(&error.path().to_string(), error.inner()))?;
        // Anything but white space after the value (as serde_json::from_slice refuses).
        json.end().map_err(|error| body_refusal(".", &error))?;
        Ok(Self(value))
    }
}

/// Whether `headers` say the body is JSON: `application/json`, or `application/*+json`.
fn is_json(headers: &axum::http::HeaderMap) -> bool {
    let Some(value) = headers.get(header::CONTENT_TYPE).and_then(|value| value.to_str().ok()) else {
        return false;
    };
    let media = value.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
    media == "application/json" || (media.starts_with("application/") && media.ends_with("+json"))
}

/// 415 `unsupported_media_type`: a body sent without `Content-Type: application/json`
/// (`headers` lack it), saying what to send and what was sent. Until 2026-12-07 it was
/// axum's text "Expected request with `Content-Type: application/json`", which named
/// neither.
fn not_json(headers: &axum::http::HeaderMap) -> ApiError {
    let sent = match headers.get(header::CONTENT_TYPE) {
        None => "no Content-Type was sent".to_string(),
        Some(value) => format!(
            "it was sent as `Content-Type: {}`",
            String::from_utf8_lossy(value.as_bytes())
        ),
    };
    ApiError::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported_media_type",
        format!("the request body must be JSON sent with `Content-Type: application/json`; {sent}"),
    )
}

/// The refusal of a body serde could not read: 400 `invalid_json` for a syntax error
/// (or a body that ends early), `invalid_body` for a field missing or of the wrong type
/// (400 once in OpenAI's shape); `param` the field's path.
fn body_refusal(path: &str, inner: &serde_json::Error) -> ApiError {
    let (status, code, what) = match inner.classify() {
        serde_json::error::Category::Data => (
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_body",
            "Failed to deserialize the JSON body into the target type",
        ),
        _ => (
            StatusCode::BAD_REQUEST,
            "invalid_json",
            "Failed to parse the request body as JSON",
        ),
    };
    let at = (path != ".").then(|| path.to_string());
    // serde names a missing field in its message only: "missing field `model`".
    let missing = inner
        .to_string()
        .strip_prefix("missing field `")
        .and_then(|rest| rest.split_once('`'))
        .map(|(field, _)| field.to_string());
    let param = match (at, missing) {
        (Some(at), Some(field)) => Some(format!("{at}.{field}")),
        (None, Some(field)) => Some(field),
        (at, None) => at,
    };
    let message = match &param {
        Some(param) => format!("{what}: {param}: {inner}"),
        None => format!("{what}: {inner}"),
    };
    let refusal = ApiError::new(status, code, message).openai();
    match param {
        Some(param) => refusal.param(param),
        None => refusal,
    }
}

/// A query string whose rejection is 400 `invalid_query`.
pub(crate) struct ApiQuery<T>(pub(crate) T);

impl<T, S> axum::extract::FromRequestParts<S> for ApiQuery<T>
where
    T: serde::de::DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, ApiError> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(value)) => Ok(Self(value)),
            Err(rejection) => Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_query",
                rejection.body_text(),
            )),
        }
    }
}

/// A page's `limit` query parameter: `default` when absent; 400 `invalid_query` unless
/// it is between 1 and `max`.
pub(crate) fn page_limit(given: Option<usize>, default: usize, max: usize) -> Result<usize, ApiError> {
    let limit = given.unwrap_or(default);
    if limit == 0 || limit > max {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_query",
            format!("limit must be between 1 and {max}, got {limit}"),
        ));
    }
    Ok(limit)
}

#[cfg(test)]
mod tests {
    use troupe_core::{ActorId, InvokeError};
    use troupe_runtime::{StoreError, StoreOperation};

    use super::*;

    fn failed(source: StoreError) -> InvokeError {
        InvokeError::StorageFailed {
            target: ActorId::new("agent", "a").expect("an id"),
            source,
        }
    }

    /// Goal: a store down for a moment is 503 `storage_unavailable` with `Retry-After`
    /// (REST, and OpenAI's shape: `type: server_error`), through every error type that
    /// carries it; any other store failure stays 500 `storage_failed`. Before
    /// 2026-12-07 both were 500 `storage_failed`.
    #[test]
    fn a_store_down_for_a_moment_is_503_storage_unavailable_and_other_store_failures_stay_500() {
        let unavailable = StoreError::Unavailable {
            operation: StoreOperation::Commit,
            cause: "connection refused".to_string(),
        };
        let backend = StoreError::Backend {
            operation: StoreOperation::Commit,
            cause: "relation does not exist".to_string(),
        };
        for error in [
            ApiError::from(&failed(unavailable.clone())),
            ApiError::from(AgentCallError::Invoke(failed(unavailable.clone()))),
            ApiError::from(InboxError::Invoke(failed(unavailable.clone()))),
            ApiError::from(unavailable.clone()),
        ] {
            assert_eq!(
                (error.status, error.code, error.retry_after_s),
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "storage_unavailable",
                    Some(SERVER_RETRY_AFTER_S)
                ),
                "{error:?}"
            );
            assert!(error.message.contains("connection refused"), "{error:?}");
            let openai = error.openai().body();
            assert_eq!(openai["error"]["type"], "server_error");
            assert_eq!(openai["error"]["code"], "storage_unavailable");
        }
        for error in [ApiError::from(&failed(backend.clone())), ApiError::from(backend)] {
            assert_eq!(
                (error.status, error.code, error.retry_after_s),
                (StatusCode::INTERNAL_SERVER_ERROR, "storage_failed", None),
                "{error:?}"
            );
        }
    }
}
