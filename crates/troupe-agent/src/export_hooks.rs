//! Hooks for an exporter of the agents' spans (troupe-server's `otel` feature), which
//! this crate does not depend on: installed once per process, absent otherwise.
//!
//! - [`set_traceparent_source`]: remote calls send the calling span's W3C
//!   `traceparent`, so a Troupe server called exports its spans in the caller's trace.
//! - [`set_trace_starter`]: the span of work that starts outside any turn but belongs to
//!   a trace (an inbox entry's delivery, run by a task of its own) is started in the
//!   exported trace of that id, so the turns it leads to are exported there too rather
//!   than as traces of their own.

use std::sync::OnceLock;

use troupe_core::TraceId;

/// Where a remote call's W3C `traceparent` header comes from (see
/// [`set_traceparent_source`]).
static TRACEPARENT_SOURCE: OnceLock<fn() -> Option<String>> = OnceLock::new();

/// How a root span is started in an exported trace (see [`set_trace_starter`]).
static TRACE_STARTER: OnceLock<fn(&tracing::Span, TraceId)> = OnceLock::new();

/// Installs the source of remote calls' `traceparent` header: a function that gives the
/// header for the current span, or `None` (see docs/serve.md, "Trace ids"). Without
/// one, no `traceparent` is sent (the callee still continues Troupe's trace id,
/// `metadata.troupe.trace_id`). The first installation in a process stays; later ones
/// are ignored.
pub fn set_traceparent_source(source: fn() -> Option<String>) {
    let _ = TRACEPARENT_SOURCE.set(source);
}

/// Installs how a new root span is started in the exported trace of a Troupe trace id:
/// a function called on the thread that made the span, before it is entered (see
/// docs/serve.md, "Trace ids"). Without one, such spans start traces of their own in an
/// exporter. The first installation in a process stays; later ones are ignored.
pub fn set_trace_starter(starter: fn(&tracing::Span, TraceId)) {
    let _ = TRACE_STARTER.set(starter);
}

/// The current span's W3C `traceparent`, when an exporter gives one. (Remote calls,
/// its one user, are not made under the simulator.)
#[cfg_attr(madsim, allow(dead_code))]
pub(crate) fn current_traceparent() -> Option<String> {
    TRACEPARENT_SOURCE.get().and_then(|source| source())
}

/// Starts `span`, a new root span, in the exported trace `trace`, when an exporter is
/// installed.
pub(crate) fn start_in_trace(span: &tracing::Span, trace: TraceId) {
    if let Some(starter) = TRACE_STARTER.get() {
        starter(span, trace);
    }
}
