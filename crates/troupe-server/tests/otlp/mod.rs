//! What the OpenTelemetry tests share (`tests/otel.rs`, `tests/otel_remote.rs`): an
//! in-process OTLP/HTTP collector on 127.0.0.1 (an axum route decoding the protobuf with
//! `opentelemetry-proto`), the export layer installed as the process's subscriber, and
//! readers of the spans received.
#![allow(dead_code)]

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::Layer as _;
use troupe_server::otel::OtelGuard;

/// The collector: every span of every export request it received, and the paths asked.
#[derive(Default)]
pub(crate) struct Received {
    pub(crate) spans: Vec<Span>,
    pub(crate) service_names: BTreeSet<String>,
    pub(crate) content_types: BTreeSet<String>,
}

pub(crate) async fn collector() -> (String, Arc<Mutex<Received>>) {
    let received = Arc::new(Mutex::new(Received::default()));
    let sink = Arc::clone(&received);
    let app = axum::Router::new().route(
        "/v1/traces",
        post(move |headers: axum::http::HeaderMap, body: Bytes| {
            let sink = Arc::clone(&sink);
            async move {
                let request = ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf export request");
                let mut received = sink.lock().unwrap();
                if let Some(kind) = headers.get("content-type").and_then(|value| value.to_str().ok()) {
                    received.content_types.insert(kind.to_string());
                }
                for resource in request.resource_spans {
                    for attribute in resource.resource.iter().flat_map(|r| r.attributes.iter()) {
                        if attribute.key == "service.name" {
                            received
                                .service_names
                                .insert(text(attribute.value.as_ref().and_then(|v| v.value.as_ref())));
                        }
                    }
                    for scope in resource.scope_spans {
                        received.spans.extend(scope.spans);
                    }
                }
                // An empty ExportTraceServiceResponse.
                ([("content-type", "application/x-protobuf")], Vec::<u8>::new())
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), received)
}

pub(crate) fn text(value: Option<&AnyValue>) -> String {
    match value {
        Some(AnyValue::StringValue(text)) => text.clone(),
        Some(AnyValue::IntValue(number)) => number.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

pub(crate) fn attribute(span: &Span, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|attribute| attribute.key == key)
        .map(|attribute| text(attribute.value.as_ref().and_then(|v| v.value.as_ref())))
}

/// Installs the export to the collector at `endpoint`, as service `service`, as this
/// process's subscriber (the server's, the runtime's and the agents' spans at `info`):
/// one per test process, so each test that installs it is a file of its own.
pub(crate) fn install(endpoint: &str, service: &str) -> OtelGuard {
    let (layer, guard) = troupe_server::otel::layer(endpoint, service).expect("the exporter starts");
    let filter = tracing_subscriber::filter::Targets::new()
        .with_target("troupe_server", tracing::Level::INFO)
        .with_target("troupe_runtime", tracing::Level::INFO)
        .with_target("troupe_agent", tracing::Level::INFO);
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer.with_filter(filter)))
        .expect("the only subscriber of this test process");
    guard
}

/// Bytes (a trace or span id) as lowercase hex.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// The trace id a response names (`x-troupe-trace-id`).
pub(crate) fn trace_id_of(response: &reqwest::Response) -> Option<String> {
    response
        .headers()
        .get("x-troupe-trace-id")
        .and_then(|value| value.to_str().ok())
        .map(str::to_string)
}
