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

/// How many delegations race their approval, denial and deadline.
const APPROVAL_RACES: u64 = 30;
/// Their deadline.
const APPROVAL_RACE_TIMEOUT_MS: u64 = 150;

/// Goal: an approve, a deny and the deadline racing for one queued delegation give
/// exactly one outcome: at most one of approve and deny succeeds; the task ends once,
/// `completed` only if approved, `rejected` only if denied (naming the denial), `failed`
/// naming the deadline otherwise; the delegatee's model sees the job exactly when it
/// completed; the delegator's model reads the outcome exactly once. Method: `a` is
/// supervised; 30 delegations through the API with a 150 ms deadline, each approved and
/// denied from two tasks on 4 worker threads after delays spread over 0..300 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn approve_deny_and_the_deadline_racing_give_one_outcome() {
    use troupe_agent::{BehaviourMode, Membership, TaskState};
    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("a").reply("noted"))
        .rule(ScriptRule::agent("b").reply("done"));
    let system = AgentSystem::builder()
        .llm(Arc::new(llm.clone()))
        .agent(AgentSpec::new("a"))
        .agent(AgentSpec::new("b"))
        .start()
        .unwrap();
    let supervised = Membership {
        manager: None,
        mode: BehaviourMode::Supervised,
    };
    system.set_membership("a", supervised).await.unwrap();
    let mut outcomes = std::collections::BTreeMap::<&str, u64>::new();
    for i in 0..APPROVAL_RACES {
        let job = format!("job {i}");
        let task_id = system
            .delegate("a", "b", &job, Some(APPROVAL_RACE_TIMEOUT_MS))
            .await
            .unwrap();
        // Listed once the delegation's delivery waits for it, a moment after it returned.
        let mut listed = None;
        for _ in 0..1_000 {
            let pending = system.pending_approvals().await.unwrap();
            listed = pending.into_iter().find(|approval| approval.message == job);
            if listed.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let approval = listed.expect("the delegation waits for approval");
        let (approve_after, deny_after) = ((i * 37) % 300, (i * 53 + 20) % 300);
        let client = system.client();
        let approve = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(approve_after)).await;
            client.approve(approval.id).await.is_ok()
        });
        let client = system.client();
        let deny = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(deny_after)).await;
            client.deny(approval.id).await.is_ok()
        });
        let (approved, denied) = (approve.await.unwrap(), deny.await.unwrap());
        assert!(!(approved && denied), "{task_id}: approved and denied");
        let mut task = None;
        for _ in 0..100 {
            task = system.task("a", &task_id).await.unwrap().filter(|t| t.state.is_final());
            if task.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let task = task.unwrap_or_else(|| panic!("{task_id} never ended"));
        // Let the outcome's turn at `a` (and any late delivery) finish.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let result = task.result.clone().unwrap_or_default();
        // Cut at the deadline by the invocation of b's turn, while it ran.
        let cut_while_running = result.contains("invocation of agent/b timed out");
        let name = match task.state {
            TaskState::Completed => {
                assert!(approved, "{task_id} completed without approval");
                "completed"
            }
            TaskState::Rejected => {
                assert!(denied, "{task_id} rejected without a denial: {result}");
                assert!(
                    result.contains(&format!("approval {} was denied", approval.id)),
                    "{result}"
                );
                "rejected"
            }
            TaskState::Failed => {
                // The deadline, caught where it passed: before delivery or work ("the
                // deadline passed ..."), or by the invocation of b's turn that it cut
                // ("invocation of agent/b timed out ...").
                assert!(result.contains("deadline") || cut_while_running, "{task_id}: {result}");
                "failed"
            }
            other => panic!("{task_id} ended {other:?}"),
        };
        *outcomes.entry(name).or_default() += 1;
        let b_saw = llm
            .requests_of("b")
            .iter()
            .filter(|r| {
                r.messages
                    .last()
                    .is_some_and(|m| m.content.ends_with(&format!("] {job}")))
            })
            .count();
        // Completed: b worked on it once. Cut at the deadline while b's turn ran: b's
        // model may have seen it once (the turn is rolled back). Otherwise never.
        let expected = usize::from(task.state == TaskState::Completed);
        assert!(
            b_saw == expected || (cut_while_running && b_saw <= 1),
            "{task_id} ({name}: {result}): b's model saw it {b_saw} times"
        );
        let outcome = format!("[task {task_id} you delegated is {name}]");
        let a_read = system
            .conversation_log("a")
            .await
            .unwrap()
            .iter()
            .filter(|m| m.content.contains(&outcome))
            .count();
        assert_eq!(a_read, 1, "{outcome} read {a_read} times");
    }
    assert!(
        outcomes.len() >= 2,
        "the races must end more than one way: {outcomes:?}"
    );
    system.shutdown().await;
}
