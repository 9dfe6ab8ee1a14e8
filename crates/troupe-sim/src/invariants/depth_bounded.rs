//! DepthBounded (`docs/tla/MultiAgentInvocation.tla`): no call is admitted, and no turn
//! runs, deeper than `AGENT_CALL_DEPTH_MAX`.
//!
//! Observed from the context each real turn runs under and from each admitted call.

use troupe_core::limits::AGENT_CALL_DEPTH_MAX;

use super::Invariant;
use crate::trace::{Event, Stamped};

/// See the module documentation.
#[derive(Debug, Default)]
pub struct DepthBounded;

impl Invariant for DepthBounded {
    fn name(&self) -> &'static str {
        "DepthBounded"
    }

    fn observe(&mut self, stamped: &Stamped) -> Result<(), String> {
        match &stamped.event {
            Event::TurnStarted {
                actor, depth, chain, ..
            } if *depth > AGENT_CALL_DEPTH_MAX => Err(format!(
                "a turn of {actor} runs at depth {depth} > {AGENT_CALL_DEPTH_MAX} (chain {chain:?})"
            )),
            Event::CallAdmitted {
                caller, target, depth, ..
            } if *depth > AGENT_CALL_DEPTH_MAX => Err(format!(
                "{caller} -> {target} was admitted at depth {depth} > {AGENT_CALL_DEPTH_MAX}"
            )),
            Event::TurnStarted {
                actor, depth, chain, ..
            } if *depth as usize != chain.len() => Err(format!(
                "a turn of {actor} runs at depth {depth} with a chain of {} ({chain:?})",
                chain.len()
            )),
            _ => Ok(()),
        }
    }
}
