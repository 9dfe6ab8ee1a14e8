//! Permission changes racing with calls on tokio's multi-thread runtime.
//!
//! Normal build only: the simulator has one thread; `tests/dst_org_permissions.rs` is
//! the simulated scenario.

#![cfg(not(madsim))]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use troupe_agent::{
    AgentCallError, AgentSpec, AgentSystem, NotPermitted, NotPermittedReason, PermissionRule, RuleMatch, ScriptRule,
    ScriptedLlm,
};

const CALLERS: usize = 4;
const ROUNDS: u64 = 20;
const CALLS_PER_ROUND_MIN: u64 = 20;

/// Goal: a call admitted after a revoke has returned is refused, and a call admitted
/// after the grant has returned goes through: every call that started after a change
/// returned and ended before the next change started was decided on that change's
/// rule. Method: 4 callers on 4 worker threads ask `b` as `a` in a loop, reading a
/// phase counter before and after each call; the main task toggles a deny rule 20
/// times, setting the counter odd before each change starts and even (2 × round) after
/// it returns (odd round: denied), and waits for at least 20 calls per round.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_call_admitted_after_a_revoke_returns_is_refused() {
    let llm = ScriptedLlm::new()
        .without_recording()
        .rule(ScriptRule::agent("b").reply("ok"));
    let system = AgentSystem::builder()
        .llm(Arc::new(llm))
        .agent(AgentSpec::new("a"))
        .agent(AgentSpec::new("b"))
        .start()
        .unwrap();
    let generation = Arc::new(AtomicU64::new(0));
    let calls = Arc::new(AtomicU64::new(0));
    let mut callers = Vec::new();
    for _ in 0..CALLERS {
        let client = system.client();
        let (generation, calls) = (Arc::clone(&generation), Arc::clone(&calls));
        callers.push(tokio::spawn(async move {
            // (generation, permitted) of the calls that saw no change while running.
            let mut decided = Vec::new();
            loop {
                let before = generation.load(Ordering::SeqCst);
                if before > 2 * ROUNDS {
                    return decided;
                }
                let result = client.ask_as("a", "b", "ping", Duration::from_secs(10)).await;
                let after = generation.load(Ordering::SeqCst);
                let permitted = match result {
                    Ok(reply) => {
                        assert_eq!(reply.text, "ok");
                        true
                    }
                    Err(AgentCallError::NotPermitted(NotPermitted {
                        reason: NotPermittedReason::Denied(RuleMatch::ExplicitDeny),
                        ..
                    })) => false,
                    Err(other) => panic!("unexpected error {other}"),
                };
                calls.fetch_add(1, Ordering::SeqCst);
                // Checked only when no change was in progress or started meanwhile.
                if before == after && before % 2 == 0 {
                    decided.push((before / 2, permitted));
                }
            }
        }));
    }
    for round in 1..=ROUNDS + 1 {
        let target = calls.load(Ordering::SeqCst) + CALLS_PER_ROUND_MIN;
        while calls.load(Ordering::SeqCst) < target {
            tokio::task::yield_now().await;
        }
        generation.store(2 * round - 1, Ordering::SeqCst);
        if round <= ROUNDS {
            if round % 2 == 1 {
                system.set_permission("a", PermissionRule::deny("b")).await.unwrap();
            } else {
                system.remove_permission("a", "b").await.unwrap();
            }
        }
        generation.store(2 * round, Ordering::SeqCst);
    }
    let mut checked = [0_u64; 2];
    for caller in callers {
        for (generation, permitted) in caller.await.unwrap() {
            let denied = generation % 2 == 1;
            assert_eq!(
                permitted, !denied,
                "a call in generation {generation} (denied: {denied}) was decided on another generation's rule"
            );
            checked[usize::from(denied)] += 1;
        }
    }
    assert!(
        checked[0] > 0 && checked[1] > 0,
        "both states were exercised: {checked:?}"
    );
    println!(
        "calls checked: {} while allowed, {} while denied",
        checked[0], checked[1]
    );
    system.shutdown().await;
}
