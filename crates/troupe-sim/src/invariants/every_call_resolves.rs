//! EveryCallResolves (`docs/tla/MultiAgentInvocation.tla`, liveness): every request and
//! every call between actors completes, fails or times out by its deadline; nothing
//! hangs.
//!
//! Observed at the callers: a client's `RequestSent`/`RequestResolved`, a probe's
//! `CallAdmitted`/`WaitEnd`. A resolution later than the deadline (plus one
//! millisecond of scheduling slack) is a violation as soon as it happens; anything still
//! pending when the run ends (after the liveness phase) is a hang.
//!
//! Turns too (EveryTurnEnds): a probe's turn that ends (`TurnEnded`) later than its
//! context's deadline plus the slack ran past its deadline: its caller had already been
//! told `Timeout`, so expired work was running.

use std::collections::BTreeMap;

use super::Invariant;
use crate::trace::{Event, Stamped};

/// Scheduling slack allowed past a deadline, in virtual microseconds.
pub const RESOLVE_SLACK_US: u64 = 1_000;

/// See the module documentation.
#[derive(Debug, Default)]
pub struct EveryCallResolves {
    requests: BTreeMap<u64, (String, u64)>,
    calls: BTreeMap<u64, (String, u64)>,
    /// Live waits (every wait source reports its end, cancellations included).
    waits: BTreeMap<u64, String>,
    /// The running turn of each actor: (node, deadline).
    turns: BTreeMap<String, (u32, u64)>,
}

fn late(what: &str, name: &str, deadline_us: u64, now_us: u64) -> Result<(), String> {
    if now_us > deadline_us + RESOLVE_SLACK_US {
        return Err(format!(
            "{what} {name} resolved at {:.3} ms, after its deadline {:.3} ms",
            now_us as f64 / 1000.0,
            deadline_us as f64 / 1000.0
        ));
    }
    Ok(())
}

fn pending(what: &str, open: &BTreeMap<u64, (String, u64)>, now_us: u64) -> Result<(), String> {
    match open.iter().next() {
        Some((id, (name, deadline_us))) => Err(format!(
            "{} {what}s never resolved; {what} {id} to {name} is still pending at {:.3} ms, its deadline was {:.3} ms",
            open.len(),
            now_us as f64 / 1000.0,
            *deadline_us as f64 / 1000.0
        )),
        None => Ok(()),
    }
}

impl Invariant for EveryCallResolves {
    fn name(&self) -> &'static str {
        "EveryCallResolves"
    }

    fn observe(&mut self, stamped: &Stamped) -> Result<(), String> {
        let now = stamped.at_us;
        match &stamped.event {
            Event::RequestSent {
                request,
                target,
                deadline_us,
            } => {
                self.requests.insert(*request, (target.clone(), *deadline_us));
            }
            Event::RequestResolved { request, .. } => {
                if let Some((target, deadline_us)) = self.requests.remove(request) {
                    late("request to", &target, deadline_us, now)?;
                }
            }
            Event::CallAdmitted {
                call,
                caller,
                target,
                deadline_us,
                ..
            } => {
                self.calls
                    .insert(*call, (format!("{caller} -> {target}"), *deadline_us));
            }
            Event::WaitBegin {
                call, caller, target, ..
            } => {
                self.waits.insert(*call, format!("{caller} -> {target}"));
            }
            Event::TurnStarted {
                node,
                actor,
                deadline_us,
                ..
            } => {
                self.turns.insert(actor.clone(), (*node, *deadline_us));
            }
            Event::TurnEnded { actor, .. } => {
                if let Some((_, deadline_us)) = self.turns.remove(actor) {
                    if now > deadline_us + RESOLVE_SLACK_US {
                        return Err(format!(
                            "a turn of {actor} ran until {:.3} ms, past its deadline {:.3} ms",
                            now as f64 / 1000.0,
                            deadline_us as f64 / 1000.0
                        ));
                    }
                }
            }
            Event::NodeKilled { node } => {
                self.turns.retain(|_, (host, _)| host != node);
            }
            Event::WaitEnd { call, .. } => {
                self.waits.remove(call);
                if let Some((name, deadline_us)) = self.calls.remove(call) {
                    late("call", &name, deadline_us, now)?;
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn finish(&mut self, now_us: u64) -> Result<(), String> {
        pending("request", &self.requests, now_us)?;
        pending("call", &self.calls, now_us)?;
        match self.waits.iter().next() {
            Some((id, name)) => Err(format!(
                "{} waits never ended; wait {id} of {name} is still open at {:.3} ms",
                self.waits.len(),
                now_us as f64 / 1000.0
            )),
            None => Ok(()),
        }
    }
}
