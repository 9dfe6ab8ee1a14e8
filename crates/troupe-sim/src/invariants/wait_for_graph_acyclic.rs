//! WaitForGraphAcyclic (`docs/tla/MultiAgentInvocation.tla`): no cycle of actors
//! waiting on each other survives.
//!
//! Observed from the callers: `WaitBegin` when a turn starts waiting on a call,
//! `WaitEnd` when it stops. A caller records its wait just before the runtime adds the
//! call's edge, so a cycle may appear for an instant before the runtime refuses the
//! closing edge; it must be gone within [`WAIT_FOR_CYCLE_GRACE_US`] of virtual time.
//! A deadlock broken only by deadlines lives for the whole timeout and is caught.
//! A killed node's waits end with its tasks (their guards record `WaitEnd`).
//!
//! Scope: the runtime's wait-for graph is per node (each runtime records the edges of
//! its turns' calls; the transport does not share them), so the check applies to
//! cycles whose edges are all routed by one node. A cycle across nodes is broken only by
//! deadlines; EveryCallResolves bounds it. The DST report lists this as a known gap
//! against the TLA+ model, where the graph is global.

use std::collections::{BTreeMap, BTreeSet};

use super::Invariant;
use crate::trace::{Event, Stamped};

/// How long a wait-for cycle may live, in virtual microseconds.
pub const WAIT_FOR_CYCLE_GRACE_US: u64 = 1_000;

/// See the module documentation.
#[derive(Debug, Default)]
pub struct WaitForGraphAcyclic {
    /// Live waits: call → (caller, target, host node).
    waits: BTreeMap<u64, (String, String, u32)>,
    /// Since when the current cycle exists, and what it is.
    cycle_since: Option<(u64, Vec<String>)>,
}

impl WaitForGraphAcyclic {
    fn find_cycle(&self) -> Option<Vec<String>> {
        let hosts: BTreeSet<u32> = self.waits.values().map(|(_, _, host)| *host).collect();
        hosts.into_iter().find_map(|host| self.find_cycle_on(host))
    }

    fn find_cycle_on(&self, host: u32) -> Option<Vec<String>> {
        let mut edges: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
        for (caller, target, _) in self.waits.values().filter(|(_, _, on)| *on == host) {
            edges.entry(caller).or_default().insert(target);
        }
        // Depth-first search with colours; returns the first cycle found.
        fn visit<'a>(
            node: &'a str,
            edges: &BTreeMap<&'a str, BTreeSet<&'a str>>,
            state: &mut BTreeMap<&'a str, u8>,
            stack: &mut Vec<&'a str>,
        ) -> Option<Vec<String>> {
            state.insert(node, 1);
            stack.push(node);
            for next in edges.get(node).into_iter().flatten() {
                match state.get(next).copied().unwrap_or(0) {
                    1 => {
                        let start = stack.iter().position(|n| n == next).unwrap_or(0);
                        let mut cycle: Vec<String> = stack[start..].iter().map(|n| n.to_string()).collect();
                        cycle.push((*next).to_string());
                        return Some(cycle);
                    }
                    0 => {
                        if let Some(cycle) = visit(next, edges, state, stack) {
                            return Some(cycle);
                        }
                    }
                    _ => {}
                }
            }
            stack.pop();
            state.insert(node, 2);
            None
        }
        let mut state = BTreeMap::new();
        for node in edges.keys() {
            if state.get(node).copied().unwrap_or(0) == 0 {
                if let Some(cycle) = visit(node, &edges, &mut state, &mut Vec::new()) {
                    return Some(cycle);
                }
            }
        }
        None
    }

    fn check_age(&self, now_us: u64) -> Result<(), String> {
        match &self.cycle_since {
            Some((since, cycle)) if now_us.saturating_sub(*since) > WAIT_FOR_CYCLE_GRACE_US => Err(format!(
                "the wait-for cycle {} has survived {:.3} ms (grace {:.3} ms)",
                cycle.join(" -> "),
                (now_us - since) as f64 / 1000.0,
                WAIT_FOR_CYCLE_GRACE_US as f64 / 1000.0
            )),
            _ => Ok(()),
        }
    }

    fn update(&mut self, now_us: u64) {
        match self.find_cycle() {
            Some(cycle) => {
                if self.cycle_since.is_none() {
                    self.cycle_since = Some((now_us, cycle));
                }
            }
            None => self.cycle_since = None,
        }
    }
}

impl Invariant for WaitForGraphAcyclic {
    fn name(&self) -> &'static str {
        "WaitForGraphAcyclic"
    }

    fn observe(&mut self, stamped: &Stamped) -> Result<(), String> {
        // Any event is a moment at which a surviving cycle can be seen.
        let aged = self.check_age(stamped.at_us);
        match &stamped.event {
            Event::WaitBegin {
                call,
                caller,
                target,
                host,
            } => {
                self.waits.insert(*call, (caller.clone(), target.clone(), *host));
                self.update(stamped.at_us);
            }
            Event::WaitEnd { call, .. } => {
                self.waits.remove(call);
                self.update(stamped.at_us);
            }
            _ => {}
        }
        if aged.is_err() {
            // Report once per cycle.
            self.cycle_since = None;
        }
        aged
    }

    fn finish(&mut self, now_us: u64) -> Result<(), String> {
        self.check_age(now_us)
    }
}
