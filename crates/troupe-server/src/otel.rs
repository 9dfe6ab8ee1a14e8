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

use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig as _};
use opentelemetry_sdk::trace::SdkTracerProvider;
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
        .with_resource(Resource::builder().with_service_name(service_name.to_string()).build())
        .build();
    let tracer = provider.tracer("troupe");
    let layer = tracing_opentelemetry::layer().with_tracer(tracer);
    Ok((layer, OtelGuard { provider }))
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
