//! DeadlineMonotone (`docs/tla/MultiAgentInvocation.tla`): a callee's deadline is never
//! later than its caller's, so a chain of calls can never outlive its root.
//!
//! Observed at both ends: each admitted call (the child context against the caller's
//! own deadline) and each real turn (the context it runs under against the deadline
//! its caller sent along in the payload). Deadlines are converted to trace time on the
//! node that reads them, so they compare across runtimes and nodes.
//!
//! Network hops get no allowance beyond rounding. The transport sends each deadline as
//! an absolute instant on the host's clock, translated with the lower bound of a clock
//! handshake, and the host refuses a request whose deadline passed before it arrived
//! (see `troupe_runtime::transport`). So a remote turn runs under a deadline no later
//! than its caller's, whatever the latency, loss or partition in between; a request
//! delivered after its caller gave up never starts a turn. (Until that fix the transport
//! rebuilt deadlines as arrival + remaining, and this check, then allowing one transit
//! per hop, found requests held by partitions running hundreds of milliseconds late;
//! see `docs/dst.md`, "Known issues".)

use super::Invariant;
use crate::trace::{Event, Stamped};

/// Rounding between a runtime's clock and the trace clock, in microseconds: each side
/// of a comparison is converted from whole microseconds of its own clock, so two
/// conversions of one instant may differ by this much.
const DEADLINE_ROUNDING_US: u64 = 1;

/// See the module documentation. Stateless; `#[non_exhaustive]` so it is built with
/// `DeadlineMonotone::default()` like the other invariants.
#[derive(Debug, Default)]
#[non_exhaustive]
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
            Event::TurnStarted { actor, deadline_us, parent_deadline_us, chain, remote, .. }
                if *deadline_us > parent_deadline_us + DEADLINE_ROUNDING_US =>
            {
                Err(format!(
                    "a turn of {actor} (chain {chain:?}, {}) runs until {deadline_us} us, later than its caller's \
                     deadline {parent_deadline_us} us by {} us (allowed {DEADLINE_ROUNDING_US} us)",
                    if *remote { "over the network" } else { "local" },
                    deadline_us - parent_deadline_us
                ))
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn remote_turn(deadline_us: u64, parent_deadline_us: u64) -> Stamped {
        let event = Event::TurnStarted {
            node: 2,
            actor: "probe/b".into(),
            depth: 1,
            chain: vec!["probe/a".into()],
            deadline_us,
            parent_deadline_us,
            remote: true,
        };
        Stamped { at_us: 0, event }
    }

    #[test]
    fn a_remote_turn_gets_no_transit_allowance_whatever_the_link_latency() {
        let mut check = DeadlineMonotone::default();
        check
            .observe(&Stamped {
                at_us: 0,
                event: Event::LinkLatencyMax { us: 50_000 },
            })
            .unwrap();
        assert!(check.observe(&remote_turn(1_000, 1_000)).is_ok());
        assert!(check.observe(&remote_turn(1_001, 1_000)).is_ok(), "rounding");
        let late = check.observe(&remote_turn(1_002, 1_000));
        assert!(late.is_err_and(|detail| detail.contains("over the network")));
    }
}
