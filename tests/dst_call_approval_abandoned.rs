//! Calls waiting in their turn for approval whose callers give up, in the simulator.
//!
//! Goal: a `call_agent` that waits in its turn for a person's approval ends one way
//! only, whatever the order of the person's decision, the caller giving up and the
//! model's latency: approved while its caller waits → the callee answers it once;
//! denied → the callee never sees it; its caller gone first → the approval is taken off
//! the list (marked expired) and the callee never sees it. Nothing is left pending for a
//! person once every caller has an answer or has gone.
//!
//! Method: per round, a fresh store; a supervised agent `a` (every contact needs
//! approval, its calls wait in the turn) whose scripted model calls `b` with the job it
//! is asked; `JOBS` asks start at random moments, each given up (its future dropped, as
//! an HTTP client that leaves) at a random moment; a resolver polls the listed approvals
//! at random intervals and approves, denies or leaves each (seeded draws; the first two
//! of a round approved and denied at once), after a random pause. The organisation's
//! writes are in flight for up to `ORG_WRITE_MS_MAX` each and land whether or not their
//! caller still waits (`InFlightStore`, as SQLite's thread or a PostgreSQL server
//! finishes a write), and `EARLY_PERCENT` of the asks are given up just after their
//! model's step, while their approval may be being written. Checked at `CHECK_AT_MS`, before any call's deadline (`call_agent`'s 30 s), so
//! that no approval can read expired by its deadline.
//!
//! Faults: callers giving up at random moments (some while their approval's write is in
//! flight), model latency (random per round), slow writes of the organisation that
//! outlive their callers, decisions racing the callers giving up.
//! Invariants, per approval:
//! - NoPendingLeft: none is stored pending, and none is listed (before 2026-12-02 an
//!   approval whose caller gave up stayed pending and listed until the call's deadline;
//!   until later that day, one whose caller gave up while it was being written did);
//! - OnlyApprovedReachB: `b` saw the job only if the approval is stored approved;
//! - AtMostOnce: `b` saw each job at most once;
//! - AnsweredAsDecided: a caller that got an answer got `b`'s answer to its job only if
//!   approved, the denial naming the approval only if denied;
//! - DecisionsHold: a decision that returned is what is stored; one refused as not
//!   pending lost to the caller giving up (stored expired).
#![cfg(madsim)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use troupe::agent::ORG_STORE_KIND;
use troupe::agent::{
    AgentSpec, AgentSystem, ApprovalState, BehaviourMode, CallApproval, Membership, OrgError, ScriptRule, ScriptedLlm,
};
use troupe::runtime::MemoryStore;
use troupe_sim::serde_json::json;
use troupe_sim::{InFlightStore, SimRng};

const ROUNDS: u64 = 10;
/// Asks per round, each calling `b` with one job.
const JOBS: u64 = 4;
/// The latest an ask starts, in milliseconds.
const START_MS_MAX: u64 = 1_000;
/// The earliest a caller gives up after it started, in milliseconds: time for its
/// approval to be listed, seen and decided at once, and for the call to be answered.
const GIVE_UP_MS_MIN: u64 = 1_500;
/// The latest a caller gives up after it started, in milliseconds.
const GIVE_UP_MS_MAX: u64 = 4_000;
/// The longest a write of the organisation is in flight, in milliseconds.
const ORG_WRITE_MS_MAX: u64 = 40;
/// The share of asks, in percent, given up just after their model's step: up to
/// `ORG_WRITE_MS_MAX` later, while their approval may be being written.
const EARLY_PERCENT: u64 = 25;
/// The longest the resolver pauses before a decision, in milliseconds.
const DECIDE_MS_MAX: u64 = 2_000;
/// When the round is checked, in milliseconds from its start: after every caller has an
/// answer or has gone (and a second more for an approval to be taken off the list),
/// well before any call's deadline.
const CHECK_AT_MS: u64 = START_MS_MAX + GIVE_UP_MS_MAX + DECIDE_MS_MAX + 2_000;
const _: () = assert!(CHECK_AT_MS < 30_000, "checked before call_agent's default deadline");

/// What the resolver decided and what came of it: approval id → (approve, result).
type Decisions = BTreeMap<u64, (bool, Result<ApprovalState, OrgError>)>;

fn script(latency_ms: u64) -> ScriptedLlm {
    let latency = Duration::from_millis(latency_ms);
    ScriptedLlm::new()
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("job")
                .call("call_agent", json!({"agent_id": "b", "message": "{input}"}))
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

fn start(llm: &ScriptedLlm) -> AgentSystem {
    AgentSystem::builder()
        .store(InFlightStore::new(MemoryStore::new(), ORG_WRITE_MS_MAX, |actor| {
            actor.kind().as_str() == ORG_STORE_KIND
        }))
        .llm(Arc::new(llm.clone()))
        .agent(AgentSpec::new("a").call_approval(CallApproval::WaitInTurn))
        .agent(AgentSpec::new("b"))
        .start()
        .expect("the system starts")
}

/// Goal and method: see the module documentation.
#[madsim::test]
async fn a_call_waiting_for_approval_ends_once_whether_decided_or_given_up() {
    let rng = Arc::new(Mutex::new(SimRng::new()));
    let draw = |low, high| rng.lock().unwrap().range(low, high);
    let mut outcomes: BTreeMap<&str, usize> = BTreeMap::new();
    for round in 0..ROUNDS {
        let latency_ms = draw(1, 200);
        let llm = script(latency_ms);
        let system = start(&llm);
        let supervised = Membership {
            manager: None,
            mode: BehaviourMode::Supervised,
        };
        system.set_membership("a", supervised).await.unwrap();

        // The asks: job → its answer (`None`: the caller gave up first).
        let answers: Arc<Mutex<BTreeMap<u64, Option<String>>>> = Arc::default();
        let mut asks = Vec::new();
        let mut early = Vec::new();
        for job in 0..JOBS {
            let starts = draw(0, START_MS_MAX);
            let gives_up = if draw(0, 100) < EARLY_PERCENT {
                early.push(format!("job{job}"));
                latency_ms + draw(0, ORG_WRITE_MS_MAX + 1)
            } else {
                draw(GIVE_UP_MS_MIN, GIVE_UP_MS_MAX)
            };
            let (client, answers) = (system.client(), Arc::clone(&answers));
            asks.push(tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(starts)).await;
                let text = format!("job{job}");
                let asked = client.ask("a", &text);
                let answer = match tokio::time::timeout(Duration::from_millis(gives_up), asked).await {
                    Ok(reply) => Some(reply.expect("the ask is answered").text),
                    Err(_gave_up) => None,
                };
                answers.lock().unwrap().insert(job, answer);
            }));
        }

        // The resolver: each approval it sees listed, once, after a pause.
        let decisions: Arc<Mutex<Decisions>> = Arc::default();
        let seen: Arc<Mutex<BTreeMap<u64, String>>> = Arc::default();
        let resolver = {
            let (client, decisions, seen, rng) = (
                system.client(),
                Arc::clone(&decisions),
                Arc::clone(&seen),
                Arc::clone(&rng),
            );
            tokio::spawn(async move {
                let draw = |low, high| rng.lock().unwrap().range(low, high);
                // The first two approvals seen in a round are approved and denied at
                // once, while their callers still wait (a caller waits at least
                // `GIVE_UP_MS_MIN`): every round covers both; the rest are drawn.
                let mut made = 0;
                loop {
                    tokio::time::sleep(Duration::from_millis(draw(10, 300))).await;
                    let Ok(listed) = client.pending_approvals().await else {
                        continue;
                    };
                    for approval in listed {
                        if seen.lock().unwrap().insert(approval.id, approval.message).is_some() {
                            continue;
                        }
                        // Drawn: a third approved, a third denied, a third left to the
                        // caller (who gives up).
                        let (choice, pause) = match made {
                            0 => (0, 0),
                            1 => (1, 0),
                            _ => (draw(0, 3), draw(0, DECIDE_MS_MAX)),
                        };
                        made += 1;
                        if choice == 2 {
                            continue;
                        }
                        let (client, decisions) = (client.clone(), Arc::clone(&decisions));
                        tokio::spawn(async move {
                            tokio::time::sleep(Duration::from_millis(pause)).await;
                            let approve = choice == 0;
                            let result = if approve {
                                client.approve(approval.id).await
                            } else {
                                client.deny(approval.id).await
                            };
                            let result = result.map(|record| record.state);
                            decisions.lock().unwrap().insert(approval.id, (approve, result));
                        });
                    }
                }
            })
        };

        tokio::time::sleep(Duration::from_millis(CHECK_AT_MS)).await;
        resolver.abort();
        for ask in asks {
            ask.await.unwrap();
        }

        let org = system.organisation().await.unwrap();
        // NoPendingLeft.
        let listed = system.pending_approvals().await.unwrap();
        assert!(listed.is_empty(), "round {round}: still listed: {listed:?}");
        let pending = org.pending_approvals();
        assert!(pending.is_empty(), "round {round}: still pending: {pending:?}");

        let b_seen: Vec<String> = llm
            .requests_of("b")
            .iter()
            .filter_map(|request| request.messages.last().map(|message| message.content.clone()))
            .collect();
        let answers = answers.lock().unwrap().clone();
        let decisions = decisions.lock().unwrap().clone();
        let seen = seen.lock().unwrap().clone();
        // A job whose approval the resolver never saw was never approved: b never saw it.
        for job in (0..JOBS).map(|job| format!("job{job}")) {
            if !seen.values().any(|message| *message == job) {
                assert!(
                    !b_seen.iter().any(|message| message.contains(job.as_str())),
                    "round {round}: {job}, never approved, reached b"
                );
                if early.contains(&job) {
                    // Stored expired (taken off the list), or never stored (given up
                    // before its write, or its write in flight fenced).
                    let stored: Vec<_> = org.approvals().filter(|approval| approval.message == job).collect();
                    let outcome = match stored.as_slice() {
                        [] => "given up early, no approval stored",
                        [approval] if approval.state == ApprovalState::Expired => {
                            "given up early, taken off the list unseen"
                        }
                        other => panic!("round {round}: {job} given up early: {other:?}"),
                    };
                    *outcomes.entry(outcome).or_default() += 1;
                }
            }
        }
        for (id, job) in &seen {
            let state = org.approval(*id).expect("kept").state;
            let reached_b = b_seen.iter().filter(|message| message.contains(job.as_str())).count();
            // AtMostOnce, OnlyApprovedReachB.
            assert!(reached_b <= 1, "round {round}: {job} reached b {reached_b} times");
            if reached_b == 1 {
                assert_eq!(state, ApprovalState::Approved, "round {round}: {job} reached b");
            }
            // AnsweredAsDecided.
            let number: u64 = job.trim_start_matches("job").parse().expect("a job's message");
            match answers.get(&number).cloned().flatten() {
                Some(text) if text.starts_with("b did: ") && text.ends_with(job.as_str()) => {
                    assert_eq!(state, ApprovalState::Approved, "round {round}: {job} answered: {text}");
                    assert_eq!(reached_b, 1, "round {round}: {job} answered without b");
                    *outcomes.entry("approved and answered").or_default() += 1;
                }
                Some(text) => {
                    assert!(
                        text.contains(&format!("approval {id} was denied")),
                        "round {round}: {text}"
                    );
                    assert_eq!(state, ApprovalState::Denied, "round {round}: {job}: {text}");
                    *outcomes.entry("denied").or_default() += 1;
                }
                None => {
                    let outcome = match state {
                        ApprovalState::Expired => "given up, taken off the list",
                        ApprovalState::Approved => "given up after approval",
                        ApprovalState::Denied => "given up after denial",
                        ApprovalState::Pending => panic!("round {round}: approval {id} pending (checked above)"),
                    };
                    *outcomes.entry(outcome).or_default() += 1;
                }
            }
            // DecisionsHold.
            match decisions.get(id) {
                Some((_, Ok(decided))) => assert_eq!(*decided, state, "round {round}: approval {id}"),
                Some((_, Err(OrgError::NotPending { .. }))) => {
                    assert_eq!(
                        state,
                        ApprovalState::Expired,
                        "round {round}: approval {id} lost to whom?"
                    );
                    *outcomes.entry("a decision lost to the caller giving up").or_default() += 1;
                }
                Some((_, Err(error))) => panic!("round {round}: approval {id}: {error}"),
                None => {}
            }
        }
        system.shutdown().await;
    }
    eprintln!("outcomes {outcomes:?}");
    for needed in ["approved and answered", "denied"] {
        assert!(outcomes.contains_key(needed), "{needed} must occur: {outcomes:?}");
    }
    // A caller giving up before any decision (seed 260132 had no approval to take off
    // the list: its 15 early callers gave up before theirs was stored, and every later
    // approval was decided).
    assert!(
        [
            "given up, taken off the list",
            "given up early, taken off the list unseen",
            "given up early, no approval stored",
        ]
        .iter()
        .any(|given_up| outcomes.contains_key(given_up)),
        "a caller giving up before a decision must occur: {outcomes:?}"
    );
}
