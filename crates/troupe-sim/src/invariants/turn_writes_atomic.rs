//! TurnWritesAtomic: a turn's writes and its state change are committed all together
//! or not at all (the atomic commit of `docs/tla/ActorLifecycle.tla`'s turn).
//!
//! Observed by audits made through the runtime: a probe's `Batch` turn writes `keys`
//! entries `b/<batch>/<i>` and counts the batch in its state, in one turn. An audit
//! (a turn that scans the entries and reads the state) must find every batch complete,
//! numbered `0..batches`, and exactly as many batches as the state counts.

use super::Invariant;
use crate::trace::{Event, Stamped};

/// See the module documentation.
#[derive(Debug, Default)]
pub struct TurnWritesAtomic;

impl Invariant for TurnWritesAtomic {
    fn name(&self) -> &'static str {
        "TurnWritesAtomic"
    }

    fn observe(&mut self, stamped: &Stamped) -> Result<(), String> {
        let Event::Audited { actor, batches, groups } = &stamped.event else {
            return Ok(());
        };
        for group in groups {
            if group.present != group.expected {
                return Err(format!(
                    "{actor}: batch {} has {} of its {} writes",
                    group.batch, group.present, group.expected
                ));
            }
        }
        let numbered = groups
            .iter()
            .enumerate()
            .all(|(index, group)| group.batch == index as u64);
        if groups.len() as u64 != *batches || !numbered {
            let found: Vec<u64> = groups.iter().map(|group| group.batch).collect();
            return Err(format!(
                "{actor}: its state counts {batches} batches but its writes hold batches {found:?}"
            ));
        }
        Ok(())
    }
}
