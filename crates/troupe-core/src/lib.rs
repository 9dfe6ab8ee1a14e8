//! Troupe's pure core: identifiers, limits, errors, the call context and the protocol
//! state machines (actor lifecycle, call admission).
//!
//! This crate does no I/O and knows nothing of tokio. Everything here is a plain value
//! or a function from inputs to a decision, so it is what the TLA+ specs under
//! `docs/tla/` describe and what unit and property tests cover fastest. The runtime
//! (`troupe-runtime`) executes the decisions.
//!
//! Every type that travels with an invocation ([`ActorId`], [`CallContext`],
//! [`Deadline`], [`InvokeError`]) is `serde`-serializable so it can cross a network
//! inside a request envelope: cycle and depth checks hold in a cluster too.

#![warn(missing_docs)]

mod admission;
mod call_context;
mod deadline;
mod error;
mod fence;
mod id;
mod lifecycle;
pub mod limits;
mod store_error;
mod text;

pub use admission::{admit_call, AdmissionRequest, CallAdmitted, CallRefused};
pub use call_context::{CallContext, TraceId, TRACE_ID_HEX_DIGITS};
pub use deadline::Deadline;
pub use error::InvokeError;
pub use fence::Fence;
pub use id::{ActorId, ActorKind, IdError};
pub use lifecycle::{Lifecycle, LifecycleEvent, LifecycleState};
pub use store_error::{StoreError, StoreItem, StoreOperation};
pub use text::truncate_utf8;
