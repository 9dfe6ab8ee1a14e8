//! Delegations waiting for approval across process crashes, in the simulator.
//!
//! Goal: a delegation that needs approval stays queued durably (in the delegator's
//! outbox, its approval in the organisation's store) until it is approved, denied or its
//! deadline passes, whatever happens to the process meanwhile; its outcome reaches the
//! delegator exactly once, and nothing that was not approved reaches the delegatee.
//! Method: per round, a fresh store; a supervised agent `a` (every contact needs
//! approval) whose scripted model delegates one job per ask to `b` (with
//! `delegate_to_agent`; in the second test with `call_agent`, as an agent whose calls
//! that need approval are sent as tasks, `CallApproval::Delegate`); a resolver approves
//! or denies each pending approval at a random moment (seeded; the first two of a round
//! one of each, then drawn), and in some rounds
//! leaves the last one to its deadline; the whole system is dropped (the process dies:
//! running turns and delivery tasks are cut, their commits fenced off) at a random
//! moment, then a second system starts on the same data (it resumes by itself), the
//! approvals still pending are resolved there, and the stores are checked.
//!
//! Faults: process crash at a random time, model latency (random per round), approvals
//! resolved before, during and after the crash, deadlines passing.
//! Invariants, per delegation whose turn committed (its task record exists):
//! - ApprovedDeliveredOnce: approved → the task is `completed` with `b`'s answer to
//!   exactly that job, and `b`'s log holds the job once;
//! - DeniedNeverDelivered: denied → `rejected`, its result names the denial, and `b`
//!   never saw the job (not even its model);
//! - TimedOutNeverDelivered: never resolved → `failed` at its deadline, `b` never saw it;
//! - OutcomeOnce: `a`'s log holds the task's outcome exactly once;
//! - NoOrphanDelivery: an approval whose delegating turn never committed (cut by the
//!   crash) sends nothing when resolved;
//! - NoOrphanListed: such an approval is never listed for a person (the approver
//!   resolves only what `pending_approvals` lists);
//! - Drained: no inbox or outbox entries left.
#![cfg(madsim)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use troupe::agent::{
    AgentSpec, AgentSystem, BehaviourMode, CallApproval, Membership, ScriptRule, ScriptedLlm, TaskState,
};
use troupe::runtime::{MemoryStore, StateStore};
use troupe_sim::serde_json::json;
use troupe_sim::SimRng;

#[path = "support/approvals.rs"]
mod approvals;
use approvals::Approver;

const ROUNDS: u64 = 12;
/// Asks per round, each delegating one job.
const JOBS: u64 = 3;
/// The delegations' deadline.
const TASK_TIMEOUT_MS: u64 = 20_000;

/// How `a` hands a job to `b`.
#[derive(Clone, Copy)]
enum HandOff {
    /// With `delegate_to_agent`.
    Delegate,
    /// With `call_agent`, as an agent with `CallApproval::Delegate`: the call needs
    /// approval, so it is sent as a task.
    CallSentAsTask,
}

fn script(latency_ms: u64, hand_off: HandOff) -> ScriptedLlm {
    let latency = Duration::from_millis(latency_ms);
    let tool = match hand_off {
        HandOff::Delegate => "delegate_to_agent",
        HandOff::CallSentAsTask => "call_agent",
    };
    // A task's result quotes the job ("hand off ..."): its rule comes first.
    ScriptedLlm::new()
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("you delegated")
                .reply("noted")
                .latency(latency),
        )
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("hand off")
                .call(
                    tool,
                    json!({"agent_id": "b", "message": "{input}", "timeout_ms": TASK_TIMEOUT_MS}),
                )
                .latency(latency),
        )
        .rule(
            ScriptRule::agent("a")
                .on_tool_result()
                .reply("{tool_result}")
                .latency(latency),
        )
        .rule(ScriptRule::agent("b").reply("b did: {input}").latency(latency))
}

fn start(llm: &ScriptedLlm, store: Arc<dyn StateStore>, hand_off: HandOff) -> AgentSystem {
    let call_approval = match hand_off {
        HandOff::Delegate => CallApproval::WaitInTurn,
        HandOff::CallSentAsTask => CallApproval::Delegate,
    };
    AgentSystem::builder()
        .store(store)
        .llm(Arc::new(llm.clone()))
        .agent(AgentSpec::new("a").call_approval(call_approval))
        .agent(AgentSpec::new("b"))
        .start()
        .expect("the system starts")
}

/// How many messages of `log` contain `needle`.
fn count(log: &[troupe::agent::ChatMessage], needle: &str) -> usize {
    log.iter().filter(|m| m.content.contains(needle)).count()
}

/// Goal and method: see the module documentation.
#[madsim::test]
async fn a_delegation_waiting_for_approval_is_resolved_exactly_once_across_crashes() {
    run(HandOff::Delegate).await;
}

/// The same, where `a` hands each job off with `call_agent` and its calls that need
/// approval are sent as tasks (`CallApproval::Delegate`).
#[madsim::test]
async fn a_call_sent_as_a_task_for_approval_is_resolved_exactly_once_across_crashes() {
    run(HandOff::CallSentAsTask).await;
}

/// The task id and the approval id a tool result of `a` names: "task a.N is pending
/// approval K: ..." (`delegate_to_agent`) or "the call to b needs approval K: your
/// question was sent as task a.N instead, ..." (`call_agent`).
fn task_and_approval(result: &str) -> Option<(String, u64)> {
    if let Some(rest) = result.strip_prefix("task ") {
        let (task_id, rest) = rest.split_once(" is pending approval ")?;
        let (id, _) = rest.split_once(':')?;
        return Some((task_id.to_string(), id.parse().ok()?));
    }
    let rest = result.strip_prefix("the call to b needs approval ")?;
    let (id, rest) = rest.split_once(':')?;
    let rest = rest.strip_prefix(" your question was sent as task ")?;
    let (task_id, _) = rest.split_once(' ')?;
    Some((task_id.to_string(), id.parse().ok()?))
}

async fn run(hand_off: HandOff) {
    let rng = Arc::new(Mutex::new(SimRng::new()));
    let mut outcomes: BTreeMap<&str, usize> = BTreeMap::new();
    let mut orphans = 0;
    let mut orphans_listed = 0;
    let mut crossed_the_crash = 0;
    for round in 0..ROUNDS {
        let draw = |low, high| rng.lock().unwrap().range(low, high);
        let latency_ms = draw(1, 120);
        let leave_one = draw(0, 4) == 0;
        // In half the rounds the approver is away until the process has died (so the
        // delegations committed by then wait across the crash); otherwise it resolves
        // while the asks run. Three asks take about 6 model latencies.
        let approver_away = draw(0, 2) == 0;
        let resolver_starts_ms = (!approver_away).then(|| draw(0, 4 * latency_ms + 100));
        let crash_after_ms = draw(0, 6 * latency_ms + 200);
        let llm = script(latency_ms, hand_off);
        let data = MemoryStore::new();
        let first = start(&llm, Arc::new(data.clone()), hand_off);
        let supervised = Membership {
            manager: None,
            mode: BehaviourMode::Supervised,
        };
        first.set_membership("a", supervised).await.unwrap();
        let leave = leave_one.then(|| format!("hand off job{}", JOBS - 1));
        let approver = Approver::new(Arc::clone(&rng), leave);

        let client = first.client();
        let asks = tokio::spawn(async move {
            for i in 0..JOBS {
                let _ = client.ask("a", &format!("hand off job{i}")).await;
            }
        });
        let resolver = approver.spawn(first.client(), resolver_starts_ms);
        tokio::time::sleep(Duration::from_millis(crash_after_ms)).await;
        asks.abort();
        resolver.abort();
        drop(first); // the process dies here
                     // A restart takes a moment: by then the dead runtime has aborted its turns (an
                     // in-process drop is not instantaneous; without the pause, a turn of the dead
                     // process can still commit after the new one resumed, as if two processes ran).
        tokio::time::sleep(Duration::from_secs(1)).await;

        let second = start(&llm, Arc::new(data.clone()), hand_off);
        let client = second.client();
        // Let the dead process's last turns be cut before resolving what is pending.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let before = approver.decided();
        approver.resolve_pending(&client).await;
        if approver.decided() > before {
            crossed_the_crash += 1;
        }
        // Past every deadline: the one left unresolved times out.
        tokio::time::sleep(Duration::from_millis(TASK_TIMEOUT_MS + 10_000)).await;

        let org = second.organisation().await.unwrap();
        let a_log = second.conversation_log("a").await.unwrap();
        let b_log = second.conversation_log("b").await.unwrap();
        let b_seen: Vec<String> = llm
            .requests_of("b")
            .iter()
            .filter_map(|r| r.messages.last().map(|m| m.content.clone()))
            .collect();
        // Which task each approval belongs to, from the tool results `a`'s model saw
        // (tasks are only created in the first system, so no id is reused).
        let mut task_of: BTreeMap<u64, String> = BTreeMap::new();
        for result in llm.tool_results_seen_by("a") {
            let Some((task_id, id)) = task_and_approval(&result) else {
                panic!("round {round}: unexpected tool result {result:?}")
            };
            task_of.insert(id, task_id);
        }
        // Approvals the resolver never saw (recorded by a turn of the dead process as it
        // was being cut) are checked like the others: never resolved.
        let listed = approver.messages.lock().unwrap().clone();
        let mut jobs = listed.clone();
        for approval in org.pending_approvals() {
            jobs.entry(approval.id).or_insert(approval.message);
        }
        let decisions = approver.decisions.lock().unwrap().clone();
        for (id, job) in &jobs {
            let job_text = job.as_str();
            let state = org.approval(*id).expect("kept").state;
            let committed = match task_of.get(id) {
                Some(task_id) => second.task("a", task_id).await.unwrap().map(|t| (task_id.clone(), t)),
                None => None,
            };
            let Some((task_id, task)) = committed else {
                // NoOrphanDelivery: the delegating turn never committed.
                assert_eq!(count(&b_log, job_text), 0, "round {round}: orphan {id} delivered");
                orphans += 1;
                if listed.contains_key(id) {
                    orphans_listed += 1;
                }
                continue;
            };
            if let Some(approved) = decisions.get(id) {
                let expected = if *approved {
                    troupe::agent::ApprovalState::Approved
                } else {
                    troupe::agent::ApprovalState::Denied
                };
                assert_eq!(state, expected, "round {round}: approval {id} kept as decided");
            }
            let result = task.result.clone().unwrap_or_default();
            match state {
                troupe::agent::ApprovalState::Approved => {
                    assert_eq!(task.state, TaskState::Completed, "round {round}: {task_id}: {result}");
                    assert!(result.starts_with("b did: ") && result.contains(job_text), "{result}");
                    assert_eq!(
                        count(&b_log, job_text),
                        2,
                        "round {round}: b's log holds {job_text} once (its input and its answer)\n{b_log:#?}"
                    );
                    *outcomes.entry("approved").or_default() += 1;
                }
                troupe::agent::ApprovalState::Denied => {
                    assert_eq!(task.state, TaskState::Rejected, "round {round}: {task_id}: {result}");
                    assert!(result.contains(&format!("approval {id} was denied")), "{result}");
                    assert!(
                        !b_seen.iter().any(|m| m.contains(job_text)),
                        "round {round}: denied {job_text} reached b"
                    );
                    *outcomes.entry("denied").or_default() += 1;
                }
                troupe::agent::ApprovalState::Pending | troupe::agent::ApprovalState::Expired => {
                    assert_eq!(task.state, TaskState::Failed, "round {round}: {task_id}: {result}");
                    assert!(result.contains("still pending at the deadline"), "{result}");
                    assert!(
                        !b_seen.iter().any(|m| m.contains(job_text)),
                        "round {round}: unapproved {job_text} reached b"
                    );
                    *outcomes.entry("timed out").or_default() += 1;
                }
            }
            // OutcomeOnce.
            let outcome = format!("[task {task_id} you delegated is {}]", task.state.as_str());
            assert_eq!(
                count(&a_log, &outcome),
                1,
                "round {round}: {outcome} in a's log\n{a_log:#?}"
            );
        }
        for agent in ["a", "b"] {
            assert_eq!(
                second.pending(agent).await.unwrap(),
                (0, 0),
                "round {round}: {agent} drained"
            );
        }
        second.shutdown().await;
    }
    assert!(
        outcomes.contains_key("approved") && outcomes.contains_key("denied"),
        "both outcomes must occur: {outcomes:?}"
    );
    assert!(crossed_the_crash > 0, "some approvals must be resolved after the crash");
    eprintln!(
        "outcomes {outcomes:?}, orphan approvals {orphans} ({orphans_listed} listed), rounds resolving after \
         the crash {crossed_the_crash}"
    );
    // NoOrphanListed.
    assert_eq!(orphans_listed, 0, "orphan approvals were listed for a person");
}
