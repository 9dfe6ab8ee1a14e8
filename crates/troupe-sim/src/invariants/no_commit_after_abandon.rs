//! NoCommitAfterAbandon: a turn whose caller has stopped waiting never commits.
//!
//! Observed from the runtime's own events: `RequestAbandoned` (the caller's wait ended
//! without a reply; its reply channel is closed) and `TurnCommitting` (a turn decided to
//! commit). Request ids are unique within one runtime incarnation, so a node's entries
//! are forgotten when it starts again. A commit decided before the abandonment is
//! allowed (it was in flight); one decided after is the violation.

use std::collections::BTreeSet;

use super::Invariant;
use crate::trace::{Event, Stamped};

/// See the module documentation.
#[derive(Debug, Default)]
pub struct NoCommitAfterAbandon {
    /// (node, request) pairs whose callers gave up.
    abandoned: BTreeSet<(u32, u64)>,
    /// How many abandonments were seen (a scenario can require some).
    seen: u64,
}

impl NoCommitAfterAbandon {
    /// Abandonments observed so far.
    pub fn abandonments(&self) -> u64 {
        self.seen
    }
}

impl Invariant for NoCommitAfterAbandon {
    fn name(&self) -> &'static str {
        "NoCommitAfterAbandon"
    }

    fn observe(&mut self, stamped: &Stamped) -> Result<(), String> {
        match &stamped.event {
            Event::NodeStarted { node } => {
                self.abandoned.retain(|(of, _)| of != node);
                Ok(())
            }
            Event::RequestAbandoned { node, request, .. } => {
                self.seen += 1;
                self.abandoned.insert((*node, *request));
                Ok(())
            }
            Event::TurnCommitting { node, actor, request } if self.abandoned.contains(&(*node, *request)) => Err(
                format!("{actor} on node {node} commits request {request} after its caller gave up on it"),
            ),
            _ => Ok(()),
        }
    }
}
