//! Troupe: a virtual-actor runtime for AI agents.
//!
//! This facade re-exports the pure core ([`core`]), the runtime ([`runtime`]) and the
//! agent layer ([`agent`]), with what their signatures need from other crates
//! ([`Bytes`], [`async_trait`](macro@async_trait), [`json!`]), so an application's Cargo.toml needs only
//! `troupe` and `tokio`. See the README for a tour, `examples/` for programs that run,
//! and `docs/` for the design.

#![warn(missing_docs)]

pub use troupe_agent as agent;
pub use troupe_core as core;
pub use troupe_runtime as runtime;

/// The byte buffer of actor payloads, replies and snapshots (the `bytes` crate's).
pub use bytes::Bytes;

/// The attribute for implementing the agent layer's async traits (the `async-trait`
/// crate's): `#[troupe::async_trait]`. Not for [`runtime::Actor`] or
/// [`runtime::TypedActor`], whose hooks are plain `async fn`s.
pub use async_trait::async_trait;

/// Builds a JSON value (the `serde_json` crate's macro), as tool schemas and scripted
/// tool-call arguments take.
pub use serde_json::json;

/// The README's code examples, compiled as doctests so they cannot drift from the API.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
