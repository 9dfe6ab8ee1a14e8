//! OpenTelemetry export of the tracing spans (cargo feature `otel`): a
//! `tracing_subscriber` layer that turns every span it sees into an OpenTelemetry span
//! and sends them in batches over OTLP/HTTP (protobuf) to a collector.
//!
//! ```text
//! http_request ─► invoke ─► turn (chain) ─► model_call / tool_call ─► invoke ─► turn ...
//!   one trace: the request's span is the root, every span of its calls is a descendant
//!   ──► tracing-opentelemetry ─► batch (a tokio task) ─► POST {endpoint}/v1/traces
//! ```
//!
//! The spans are the ones the server, the runtime and the agents already open at `info`
//! (so the same `RUST_LOG` filter chooses them): a request's `http_request`, then each
//! call's `invoke` and `turn` (its `chain` field is the call chain, outermost agent
//! first), `model_call` and `tool_call`. Their fields become attributes.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig as _};
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator, SdkTracerProvider};
use opentelemetry_sdk::Resource;
use tracing::Subscriber;
use tracing_subscriber::registry::LookupSpan;

/// The path a collector receives OTLP/HTTP traces on, appended to the endpoint.
pub const OTLP_TRACES_PATH: &str = "/v1/traces";
/// How long one export request may take, in milliseconds; then that batch is dropped.
pub const OTLP_EXPORT_TIMEOUT_MS: u64 = 10_000;
/// Longest endpoint accepted, in bytes.
pub const OTLP_ENDPOINT_LENGTH_MAX_BYTES: usize = 2_048;

/// Why the exporter could not be set up, or could not flush.
#[derive(Debug, thiserror::Error)]
pub enum OtelError {
    /// The endpoint is not an `http://` URL.
    #[error(
        "the OTLP endpoint {endpoint:?} is not valid: {reason}; give the collector's OTLP/HTTP base URL, \
         e.g. http://127.0.0.1:4318 ({OTLP_TRACES_PATH} is appended)"
    )]
    InvalidEndpoint {
        /// The endpoint given.
        endpoint: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The exporter could not be built.
    #[error("the OTLP exporter could not be built: {0}")]
    Exporter(String),
    /// Flushing or shutting the exporter down failed (spans may be lost).
    #[error("the OTLP exporter could not flush: {0}")]
    Shutdown(String),
}

/// Keeps the exporter running; [`OtelGuard::shutdown`] sends the spans still buffered.
#[derive(Debug)]
pub struct OtelGuard {
    provider: SdkTracerProvider,
}

impl OtelGuard {
    /// Sends every span ended so far and stops the exporter (call it before exit, or
    /// spans of the last moments are lost). Waits on a blocking-pool thread of tokio,
    /// because the SDK's shutdown blocks until the export task answers.
    ///
    /// # Errors
    /// [`OtelError::Shutdown`] if the flush failed or the collector did not answer.
    pub async fn shutdown(self) -> Result<(), OtelError> {
        let provider = self.provider;
        tokio::task::spawn_blocking(move || provider.shutdown())
            .await
            .map_err(|error| OtelError::Shutdown(error.to_string()))?
            .map_err(|error| OtelError::Shutdown(error.to_string()))
    }
}

/// The base URL checked, with [`OTLP_TRACES_PATH`] appended.
fn traces_url(endpoint: &str) -> Result<String, OtelError> {
    let invalid = |reason| OtelError::InvalidEndpoint {
        endpoint: endpoint.to_string(),
        reason,
    };
    if endpoint.len() > OTLP_ENDPOINT_LENGTH_MAX_BYTES {
        return Err(invalid("it is longer than 2048 bytes"));
    }
    let Some(rest) = endpoint.strip_prefix("http://") else {
        return Err(invalid(
            "only http:// is supported (this build has no TLS for OTLP; use a local collector)",
        ));
    };
    if rest.is_empty() || rest.starts_with('/') || rest.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(invalid("it has no host, or has spaces or control characters"));
    }
    let base = endpoint.trim_end_matches('/');
    if base.ends_with(OTLP_TRACES_PATH) {
        return Ok(base.to_string());
    }
    Ok(format!("{base}{OTLP_TRACES_PATH}"))
}

/// A layer exporting the spans to the OTLP/HTTP collector at `endpoint` (its base URL,
/// e.g. `http://127.0.0.1:4318`), as service `service_name`, and the guard that flushes
/// it. Must be called inside a tokio runtime: the batches are sent from a task on it.
///
/// # Errors
/// [`OtelError::InvalidEndpoint`], [`OtelError::Exporter`].
pub fn layer<S>(endpoint: &str, service_name: &str) -> Result<(impl tracing_subscriber::Layer<S>, OtelGuard), OtelError>
where
    S: Subscriber + for<'span> LookupSpan<'span>,
{
    let url = traces_url(endpoint)?;
    // reqwest needs a TLS provider even for http:// (see Cargo.toml); an already
    // installed one is kept.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(url)
        .with_timeout(Duration::from_millis(OTLP_EXPORT_TIMEOUT_MS))
        .build()
        .map_err(|error| OtelError::Exporter(error.to_string()))?;
    let processor = opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
        exporter,
        opentelemetry_sdk::runtime::Tokio,
    )
    .build();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_id_generator(RequestedTraceIds::default())
        .with_resource(Resource::builder().with_service_name(service_name.to_string()).build())
        .build();
    let tracer = provider.tracer("troupe");
    // Without context activation, a span's OpenTelemetry span is started when it is
    // first needed (a child span, its context asked for, its close), not when it is
    // first entered: a request's `http_request` span, entered by the middleware before
    // the A2A handler has read the message, can still be given its message's trace id
    // ([`start_in_requested_trace`]). Troupe's spans name their parents (explicitly, or
    // as tracing's current span), so the export's parents are the same either way.
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_context_activation(false);
    EXPORTING.store(true, Ordering::Relaxed);
    // Calls to remote agents carry the calling span's context, so that a Troupe server
    // called exports its spans under that span, in the caller's trace.
    troupe_agent::set_traceparent_source(current_traceparent);
    // Work that starts outside any turn in a Troupe trace (an inbox entry's delivery) is
    // exported in that trace.
    troupe_agent::set_trace_starter(start_in_trace);
    Ok((layer, OtelGuard { provider }))
}

/// The W3C `traceparent` of the current span as the export knows it (it is started
/// if it was not yet), or `None` when the span is not exported.
fn current_traceparent() -> Option<String> {
    use opentelemetry::propagation::TextMapPropagator as _;
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;

    let mut headers = std::collections::HashMap::new();
    opentelemetry_sdk::propagation::TraceContextPropagator::new()
        .inject_context(&tracing::Span::current().context(), &mut headers);
    headers.remove("traceparent")
}

/// Whether an export layer was made in this process ([`layer`]): until then the A2A
/// handler does not look for a message's trace id to give the export.
static EXPORTING: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// The trace id the export gives the next trace it starts on this thread, set by
    /// [`start_in_requested_trace`] around the start of one span.
    static REQUESTED_TRACE_ID: Cell<Option<u128>> = const { Cell::new(None) };
}

/// The export's ids: the SDK's random ones, but for a trace id requested on this thread
/// ([`REQUESTED_TRACE_ID`]), which the next trace started here gets.
#[derive(Debug, Default)]
struct RequestedTraceIds(RandomIdGenerator);

impl IdGenerator for RequestedTraceIds {
    fn new_trace_id(&self) -> opentelemetry::trace::TraceId {
        match REQUESTED_TRACE_ID.take() {
            Some(requested) => opentelemetry::trace::TraceId::from(requested),
            None => self.0.new_trace_id(),
        }
    }

    fn new_span_id(&self) -> opentelemetry::trace::SpanId {
        self.0.new_span_id()
    }
}

/// Makes an A2A message's own trace id (`params.message.metadata.troupe.trace_id` of
/// the JSON-RPC `body`, when it is one: rule 1 of docs/serve.md, "Trace ids") the
/// export's trace id of the current span, the request's `http_request`: the request's
/// spans are then exported in the trace the A2A task names. A `traceparent` of the same
/// trace stays the span's parent; one of another trace is not (the message's id comes
/// first, as for Troupe's own trace id). Does nothing without an export layer, for a
/// body that carries no such id, or once the span has started (it has a child span).
/// Called by the A2A handler before anything else of the request.
pub(crate) fn start_in_requested_trace(headers: &axum::http::HeaderMap, body: &[u8]) {
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;

    if !EXPORTING.load(Ordering::Relaxed) {
        return;
    }
    let Some(requested) = message_trace_id(body) else {
        return;
    };
    let span = tracing::Span::current();
    let callers = headers
        .get("traceparent")
        .and_then(|value| value.to_str().ok())
        .and_then(troupe_core::TraceId::from_traceparent);
    if callers != Some(requested) {
        // A parent of another trace would give the span that trace's id.
        let _ = span.set_parent(opentelemetry::Context::new());
    }
    start_in_trace(&span, requested);
}

/// Starts `span`, a root span or one whose parent is of trace `trace`, in the export's
/// trace `trace`: the id generator is asked for it while the span starts, on this
/// thread (a span with a parent takes its parent's trace id and leaves the request
/// unused). Does nothing without an export layer, or once the span has started.
pub(crate) fn start_in_trace(span: &tracing::Span, trace: troupe_core::TraceId) {
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;

    if !EXPORTING.load(Ordering::Relaxed) {
        return;
    }
    REQUESTED_TRACE_ID.set(Some(trace.get()));
    drop(span.context());
    REQUESTED_TRACE_ID.set(None);
}

/// `params.message.metadata.troupe.trace_id` of an A2A JSON-RPC body, when it is a
/// trace id ([`troupe_core::TraceId::parse_hex`]; an older caller's free-form id is
/// not). Read on its own: the handler reads the body again, and answers whatever is
/// wrong with it.
fn message_trace_id(body: &[u8]) -> Option<troupe_core::TraceId> {
    #[derive(serde::Deserialize)]
    struct Request {
        params: Option<Params>,
    }
    #[derive(serde::Deserialize)]
    struct Params {
        message: Option<Message>,
    }
    #[derive(serde::Deserialize)]
    struct Message {
        metadata: Option<Metadata>,
    }
    #[derive(serde::Deserialize)]
    struct Metadata {
        troupe: Option<Troupe>,
    }
    #[derive(serde::Deserialize)]
    struct Troupe {
        trace_id: Option<String>,
    }
    let request: Request = serde_json::from_slice(body).ok()?;
    let trace_id = request.params?.message?.metadata?.troupe?.trace_id?;
    troupe_core::TraceId::parse_hex(&trace_id)
}

/// Makes the W3C Trace Context of `headers` (a `traceparent`, and its `tracestate`) the
/// parent of `span` in the export: the request's spans then join the caller's trace
/// instead of starting one. Without a valid `traceparent`, or without the export layer
/// installed, nothing changes (a new trace, as before).
pub(crate) fn continue_callers_trace(span: &tracing::Span, headers: &axum::http::HeaderMap) {
    use opentelemetry::propagation::TextMapPropagator as _;
    use opentelemetry::trace::TraceContextExt as _;
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;

    let parent = opentelemetry_sdk::propagation::TraceContextPropagator::new()
        .extract(&opentelemetry_http::HeaderExtractor(headers));
    if parent.span().span_context().is_valid() {
        // Fails only when no export layer is installed: then there is no trace to join.
        let _ = span.set_parent(parent);
    }
}

/// The trace id of the export's trace the current span belongs to (a request's
/// `http_request` span, whose trace the export started or joined), as Troupe's trace
/// id; `None` without the export layer.
pub(crate) fn exported_trace_id() -> Option<troupe_core::TraceId> {
    use opentelemetry::trace::TraceContextExt as _;
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;

    let context = tracing::Span::current().context();
    let span = context.span();
    let exported = span.span_context();
    exported
        .is_valid()
        .then(|| troupe_core::TraceId::new(u128::from_be_bytes(exported.trace_id().to_bytes())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_endpoint_must_be_http_and_gets_the_traces_path_once() {
        assert_eq!(
            traces_url("http://127.0.0.1:4318").unwrap(),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(
            traces_url("http://collector:4318/").unwrap(),
            "http://collector:4318/v1/traces"
        );
        assert_eq!(
            traces_url("http://c:4318/v1/traces").unwrap(),
            "http://c:4318/v1/traces"
        );
        for bad in ["https://c:4318", "c:4318", "", "http://", "http:///x", "http://a b"] {
            let error = traces_url(bad).unwrap_err();
            assert!(matches!(error, OtelError::InvalidEndpoint { .. }), "{bad}: {error}");
            assert!(error.to_string().contains("http://127.0.0.1:4318"), "{error}");
        }
    }
}
