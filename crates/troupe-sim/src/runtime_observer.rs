//! Turns the runtime's own events ([`RuntimeEvent`]) into trace events, so invariants
//! can see what no reply shows: when a caller gave up and when a turn decided to commit.

use troupe_runtime::{RuntimeEvent, RuntimeObserver};

use crate::trace::{Event, Trace};

/// Records one node's runtime events in the trace.
pub(crate) struct TraceRuntimeObserver {
    node: u32,
    trace: Trace,
}

impl TraceRuntimeObserver {
    pub(crate) fn new(node: u32, trace: Trace) -> Self {
        Self { node, trace }
    }
}

impl RuntimeObserver for TraceRuntimeObserver {
    fn on_event(&self, event: &RuntimeEvent) {
        let node = self.node;
        match event {
            RuntimeEvent::RequestAbandoned { target, request } => self.trace.record(Event::RequestAbandoned {
                node,
                target: target.to_string(),
                request: *request,
            }),
            RuntimeEvent::TurnCommitting { actor, request } => self.trace.record(Event::TurnCommitting {
                node,
                actor: actor.to_string(),
                request: *request,
            }),
            RuntimeEvent::TurnAbandoned { actor, request } => self.trace.record(Event::TurnAbandoned {
                node,
                actor: actor.to_string(),
                request: *request,
            }),
            // The simulator's single-node runs have no placement to release.
            RuntimeEvent::ActivationEnded { .. } => {}
        }
    }
}
