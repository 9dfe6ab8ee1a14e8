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
    /// Waits whose call has no recorded deadline (agents' calls): they must end too.
    waits: BTreeMap<u64, (String, u64)>,
    /// The host node of each wait that may end unreported.
    unreported_hosts: BTreeMap<u64, u32>,
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
            Event::RequestSent { request, target, deadline_us } => {
                self.requests.insert(*request, (target.clone(), *deadline_us));
            }
            Event::RequestResolved { request, .. } => {
                if let Some((target, deadline_us)) = self.requests.remove(request) {
                    late("request to", &target, deadline_us, now)?;
                }
            }
            Event::CallAdmitted { call, caller, target, deadline_us, .. } => {
                self.calls.insert(*call, (format!("{caller} -> {target}"), *deadline_us));
            }
            Event::WaitBegin { call, caller, target, expires_us, host } => {
                self.waits.insert(*call, (format!("{caller} -> {target}"), expires_us.unwrap_or(u64::MAX)));
                if expires_us.is_some() {
                    self.unreported_hosts.insert(*call, *host);
                }
            }
            Event::TurnStarted { node, actor, deadline_us, .. } => {
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
                // Waits that cannot report their end (agents') die with their node.
                let dead: Vec<u64> =
                    self.unreported_hosts.iter().filter(|(_, host)| *host == node).map(|(call, _)| *call).collect();
                for call in dead {
                    self.unreported_hosts.remove(&call);
                    self.waits.remove(&call);
                }
            }
            Event::WaitEnd { call, .. } => {
                self.waits.remove(call);
                self.unreported_hosts.remove(call);
                if let Some((name, deadline_us)) = self.calls.remove(call) {
                    late("call", &name, deadline_us, now)?;
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn finish(&mut self, now_us: u64) -> Result<(), String> {
        // A wait that may end unreported has ended by its caller turn's deadline.
        self.waits.retain(|_, (_, until)| *until == u64::MAX || *until + RESOLVE_SLACK_US >= now_us);
        pending("request", &self.requests, now_us)?;
        pending("call", &self.calls, now_us)?;
        pending("wait", &self.waits, now_us)
    }
}
