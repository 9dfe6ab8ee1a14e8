//! Troupe: a virtual-actor runtime for AI agents.
//!
//! This facade re-exports the pure core ([`core`]) and the runtime ([`runtime`]).
//! See the README for a tour and `docs/` for the design.

#![warn(missing_docs)]

pub use troupe_agent as agent;
pub use troupe_core as core;
pub use troupe_runtime as runtime;

/// The README's code examples, compiled as doctests so they cannot drift from the API.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
