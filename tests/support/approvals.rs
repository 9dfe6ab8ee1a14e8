//! An approver for the simulated approval scenarios (`dst_org_approvals.rs`,
//! `dst_mention_approvals.rs`): resolves pending approvals at seeded random moments,
//! approving or denying each (its first two decisions one of each, then drawn), except
//! those of the contact left to its deadline, and records what it decided.

#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use troupe::agent::AgentClient;
use troupe_sim::SimRng;

/// One round's approver.
pub struct Approver {
    rng: Arc<Mutex<SimRng>>,
    /// Approvals whose message ends with this are left to their deadline.
    leave: Option<String>,
    /// The decisions that returned: approval id → approved.
    pub decisions: Mutex<BTreeMap<u64, bool>>,
    /// Each approval seen: id → its message.
    pub messages: Mutex<BTreeMap<u64, String>>,
}

impl Approver {
    pub fn new(rng: Arc<Mutex<SimRng>>, leave: Option<String>) -> Arc<Self> {
        Arc::new(Self {
            rng,
            leave,
            decisions: Mutex::default(),
            messages: Mutex::default(),
        })
    }

    fn draw(&self, low: u64, high: u64) -> u64 {
        self.rng.lock().unwrap().range(low, high)
    }

    /// How many decisions have returned.
    pub fn decided(&self) -> usize {
        self.decisions.lock().unwrap().len()
    }

    /// Resolves every approval pending now, with a random pause after each.
    pub async fn resolve_pending(&self, client: &AgentClient) {
        let Ok(pending) = client.pending_approvals().await else {
            return;
        };
        for approval in pending {
            self.messages
                .lock()
                .unwrap()
                .insert(approval.id, approval.message.clone());
            if self
                .leave
                .as_deref()
                .is_some_and(|left| approval.message.ends_with(left))
            {
                continue;
            }
            // The first two decisions are one of each, the rest drawn: every round that
            // resolves two approvals covers both outcomes (drawn alone, a seed whose few
            // committed delegations were all denied failed the coverage check of
            // `dst_org_approvals.rs`: base 1081423923, seed 1081425593, 6 denied).
            let (approved_any, denied_any) = {
                let decided = self.decisions.lock().unwrap();
                (
                    decided.values().any(|&approved| approved),
                    decided.values().any(|&approved| !approved),
                )
            };
            let approve = match (approved_any, denied_any) {
                (false, _) => true,
                (true, false) => false,
                (true, true) => self.draw(0, 2) == 0,
            };
            let resolved = if approve {
                client.approve(approval.id).await
            } else {
                client.deny(approval.id).await
            };
            if resolved.is_ok() {
                self.decisions.lock().unwrap().insert(approval.id, approve);
            }
            let pause = self.draw(0, 40);
            tokio::time::sleep(Duration::from_millis(pause)).await;
        }
    }

    /// Resolves what is pending from `starts_ms` on, again and again after random
    /// pauses, until aborted; `None` (the approver away) resolves nothing.
    pub fn spawn(self: &Arc<Self>, client: AgentClient, starts_ms: Option<u64>) -> tokio::task::JoinHandle<()> {
        let approver = Arc::clone(self);
        tokio::spawn(async move {
            let Some(starts_ms) = starts_ms else {
                return;
            };
            tokio::time::sleep(Duration::from_millis(starts_ms)).await;
            loop {
                approver.resolve_pending(&client).await;
                let pause = approver.draw(1, 60);
                tokio::time::sleep(Duration::from_millis(pause)).await;
            }
        })
    }
}
