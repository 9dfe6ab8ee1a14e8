//! `troupe serve`: an [`AgentClient`](troupe_agent::AgentClient) behind HTTP.
//!
//! ```text
//! client ─HTTP─► auth ─► concurrency limit ─► body limit ─► timeout ─► route ─► AgentClient
//!                 401        503 overloaded      413            504       404/422/429/...
//! ```
//!
//! [`router`] builds an `axum::Router` over an agent client: REST for agents, messages
//! (a JSON reply, or the turn's events and the reply over SSE), history, notifications
//! and delegated tasks; conversations (direct or group, of agents and humans: post with
//! `@mentions` that trigger the agents' turns, read in pages by seq); the organisation
//! (links, permission rules, memberships, the policy, pending approvals to approve or
//! deny); an SSE stream of every [`AgentEvent`](troupe_agent::AgentEvent);
//! `/health` and `/metrics` (Prometheus text); and the OpenAI-compatible
//! `/v1/chat/completions` and `/v1/models`, where the model is the agent id. Every error
//! has one JSON shape, `{"error": {"code", "message"}}` ([`ApiError`]). [`serve`] runs the
//! router on a listener until a shutdown signal, then lets requests in flight finish
//! within [`limits::SERVER_SHUTDOWN_GRACE_MS`].
//!
//! The server does not run agents itself and holds no state of its own beyond its
//! counters, its in-memory A2A tasks and the topology's view of the event stream: the
//! agent system behind the client does the work. Every agent is also an A2A v1.0 agent
//! (an Agent Card and a JSON-RPC endpoint under `/a2a/{agent}`; see docs/serve.md). The
//! topology page, `GET /` (`/ui`), draws the agents, their links and the calls and
//! messages as they pass. It does not call remote agents (yet).
//!
//! With the cargo feature `otel`, `otel::layer` exports the spans (a request's
//! `http_request` and its descendants) over OTLP/HTTP.
//!
//! Under `--cfg madsim` (the simulator build) the crate is empty: HTTP is not simulated.

#![warn(missing_docs)]

#[cfg(not(madsim))]
mod a2a;
#[cfg(not(madsim))]
mod a2a_tasks;
#[cfg(not(madsim))]
mod agents;
#[cfg(not(madsim))]
mod agents_stream;
#[cfg(not(madsim))]
mod config;
#[cfg(not(madsim))]
mod conversations;
#[cfg(not(madsim))]
mod error;
#[cfg(not(madsim))]
mod events;
#[cfg(not(madsim))]
mod keyed_lock;
pub mod limits;
#[cfg(not(madsim))]
mod metrics;
#[cfg(not(madsim))]
mod openai_compat;
#[cfg(not(madsim))]
mod org;
#[cfg(all(feature = "otel", not(madsim)))]
pub mod otel;
#[cfg(not(madsim))]
mod server;
#[cfg(not(madsim))]
mod topology;

#[cfg(not(madsim))]
pub use agents::TRACE_ID_HEADER;
#[cfg(not(madsim))]
pub use config::{LogLinesDropped, PeerAddresses, ServeError, ServerConfig};
#[cfg(not(madsim))]
pub use error::ApiError;
#[cfg(not(madsim))]
pub use events::event_json;
#[cfg(not(madsim))]
pub use server::{bearer_credential, read_body, router, same_secret, serve, serve_http};
