//! Troupe's deterministic simulation harness (DST), for tests only.
//!
//! A scenario builds a simulated deployment on madsim (server nodes running the real
//! [`troupe_runtime`] with probe actors), drives a workload from a seeded random
//! generator, injects faults ([`Fault`]), and checks invariants after every recorded
//! event. Everything that happens is recorded in a [`Trace`] whose hash is printed with
//! the seed, so a run is reproducible and two runs of one seed can be compared.
//!
//! ```text
//!  test task (madsim main node)        node-1 .. node-N (killable, restartable)
//!  ┌──────────────────────────┐        ┌──────────────────────────────────────┐
//!  │ Sim: workload, faults,   │invoke  │ troupe_runtime::Runtime              │
//!  │ phases, replay line      ├───────►│   probe actors ── record ──┐         │
//!  └────────────┬─────────────┘        └────────────────────────────┼─────────┘
//!               │ record                  disk: MemoryStore (outlives the node)
//!               ▼                                                   ▼
//!          Trace ──► Invariants (one per file, named after docs/tla) ◄─┘
//! ```
//!
//! Invariants observe: the single-activation check reads `on_activate`/`on_deactivate`
//! of real activations; depth, chain and deadline checks read the `CallContext` each
//! real turn runs under; "nothing acknowledged is lost" compares reads made through the
//! runtime with a reference model of what clients were told. None of them asks the
//! runtime whether it is correct.
//!
//! Planted bugs live here, never in production code: [`AdmissionMode`] (a caller that
//! skips the chain or depth check, forges a longer deadline or bypasses the wait-for
//! graph), [`StoreMode`] (a store that acks before persisting or splits a turn's
//! commit), [`Placement::BugSplitBrain`] and [`ClientMode::BugRetryIgnoresDeadline`].
//! Tests flip them and assert that the matching invariant catches the bug.
//!
//! Outside the simulator only the pure parts compile (trace, invariants, probe actor);
//! [`require_simulator`] panics, so a DST test can never pass on real tokio.

#![warn(missing_docs)]
// `Fault`, `Placement` and `ClientMode`, which the crate doc links, exist only under the
// simulator: outside it their links cannot resolve.
#![cfg_attr(not(madsim), allow(rustdoc::broken_intra_doc_links))]

/// JSON for scripted tool calls in scenarios.
pub use serde_json;
/// The agent layer, re-exported for scenarios (the facade does not export it).
pub use troupe_agent as agent;

pub mod agents;
mod guard;
pub mod invariants;
mod probe;
mod rng;
#[cfg(madsim)]
mod runtime_observer;
mod stores;
mod trace;

#[cfg(madsim)]
mod cluster;
#[cfg(madsim)]
mod faults;
#[cfg(madsim)]
mod harness;
mod replay;
#[cfg(madsim)]
pub mod workload;

pub use guard::{require_simulator, SIMULATOR_REQUIRED};
pub use invariants::{Invariants, Violation};
pub use probe::{
    node_address, owner_of, probe, probe_kind, AdmissionMode, AuditGroup, ProbeConfig, ProbeFactory, ProbeOp,
    ProbeReply, ProbeRequest, RefusalKind, Router, TRANSPORT_PORT,
};
pub use replay::{replay_cargo_command, replay_command, Scenario};
pub use rng::SimRng;
pub use stores::{ActorPick, InFlightStore, StoreMode, SyncingStore};
pub use trace::{Event, Stamped, Trace, TraceClock};

#[cfg(madsim)]
pub use cluster::{ClientMode, Disk, NodeId, Placement, SimCluster};
#[cfg(madsim)]
pub use faults::Fault;
#[cfg(madsim)]
pub use harness::{AgentOutcome, Outcome, Report, Sim, SimClient, SimConfig, ROOT_CALL_ID_BASE};
