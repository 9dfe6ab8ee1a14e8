//! DeadlineMonotone (`docs/tla/MultiAgentInvocation.tla`): a callee's deadline is never
//! later than its caller's, so a chain of calls can never outlive its root.
//!
//! Observed at both ends: each admitted call (the child context against the caller's
//! own deadline) and each real turn (the context it runs under against the deadline
//! its caller sent along in the payload). Deadlines are converted to trace time on the
//! node that reads them, so they compare across runtimes and nodes.

use super::Invariant;
use crate::trace::{Event, Stamped};

/// Rounding between a runtime's clock and the trace clock, in microseconds.
const DEADLINE_ROUNDING_US: u64 = 1;

/// See the module documentation.
#[derive(Debug, Default)]
pub struct DeadlineMonotone;

impl Invariant for DeadlineMonotone {
    fn name(&self) -> &'static str {
        "DeadlineMonotone"
    }

    fn observe(&mut self, stamped: &Stamped) -> Result<(), String> {
        match &stamped.event {
            Event::CallAdmitted { caller, target, deadline_us, parent_deadline_us, .. }
                if *deadline_us > parent_deadline_us + DEADLINE_ROUNDING_US =>
            {
                Err(format!(
                    "{caller} -> {target} was admitted with deadline {deadline_us} us, later than the caller's {parent_deadline_us} us"
                ))
            }
            Event::TurnStarted { actor, deadline_us, parent_deadline_us, chain, .. }
                if *deadline_us > parent_deadline_us + DEADLINE_ROUNDING_US =>
            {
                Err(format!(
                    "a turn of {actor} (chain {chain:?}) runs until {deadline_us} us, later than its caller's deadline {parent_deadline_us} us"
                ))
            }
            _ => Ok(()),
        }
    }
}
