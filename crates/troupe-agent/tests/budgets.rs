//! Budgets along the chain, end to end through the real runtime; only the model is
//! scripted, and it really emits the `call_agent` tool calls and reports its usage (one
//! token per word).
//!
//! The boss asks two workers in parallel (one step, two `call_agent` calls), then
//! answers with what they said. Each test first runs the same script without a limit on
//! a fresh system to measure what every step costs, then runs it on another fresh system
//! under a budget chosen from those numbers (the runs are deterministic).
//!
//! Runs in both builds (tokio with paused time, and the simulator), except the
//! multi-thread test (normal build only: the simulator has one thread).

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::json;
use troupe_agent::{
    agent_id, AgentCallError, AgentEvent, AgentSpec, AgentSystem, AskOptions, Budget, BudgetResource, CallRecorder,
    LlmClient, ScriptRule, ScriptedLlm, AGENT_CALL_PARENT_RESERVE_PERCENT,
};

/// The boss asks both workers at once and answers with their replies.
fn boss_asks_two_workers() -> ScriptedLlm {
    ScriptedLlm::new()
        .rule(
            ScriptRule::agent("boss")
                .on_user_containing("")
                .call(
                    "call_agent",
                    json!({"agent_id": "north", "message": "count the northern stars"}),
                )
                .call(
                    "call_agent",
                    json!({"agent_id": "south", "message": "count the southern stars"}),
                ),
        )
        .rule(
            ScriptRule::agent("boss")
                .on_tool_result()
                .reply("the workers say {tool_result}"),
        )
        .rule(ScriptRule::agent("north").reply("about two hundred billion"))
        .rule(ScriptRule::agent("south").reply("about two hundred billion"))
}

fn start(llm: &Arc<ScriptedLlm>, recorder: &CallRecorder) -> AgentSystem {
    AgentSystem::builder()
        .llm(Arc::clone(llm) as Arc<dyn LlmClient>)
        .observer(Arc::new(recorder.clone()))
        .agent(AgentSpec::new("boss"))
        .agent(AgentSpec::new("north"))
        .agent(AgentSpec::new("south"))
        .start()
        .unwrap()
}

/// The tokens of every model step, per agent, in order, as `ModelResponded` reported.
fn steps(recorder: &CallRecorder) -> BTreeMap<String, Vec<u64>> {
    let mut steps: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for event in recorder.events() {
        if let AgentEvent::ModelResponded { agent, usage, .. } = event {
            let tokens = usage.expect("the scripted model reports usage").total_tokens;
            steps.entry(agent.key().to_string()).or_default().push(tokens);
        }
    }
    steps
}

/// Tokens the model calls of each root call's whole tree used (the chain's true spend,
/// from the events, independent of the meters' arithmetic).
fn spend_per_root(recorder: &CallRecorder) -> BTreeMap<u64, u64> {
    let mut root_of: BTreeMap<u64, u64> = BTreeMap::new();
    let mut spend: BTreeMap<u64, u64> = BTreeMap::new();
    for event in recorder.events() {
        match event {
            AgentEvent::CallStarted { call, parent, .. } => {
                let root = parent.map_or(call, |parent| root_of[&parent]);
                root_of.insert(call, root);
            }
            AgentEvent::ModelResponded {
                call: Some(call),
                usage,
                ..
            } => {
                *spend.entry(root_of[&call]).or_default() += usage.map_or(0, |usage| usage.total_tokens);
            }
            _ => {}
        }
    }
    spend
}

/// What each step costs without a limit.
#[derive(Debug)]
struct Costs {
    boss_call: u64,
    boss_answer: u64,
    north: u64,
    south: u64,
}

impl Costs {
    fn total(&self) -> u64 {
        self.boss_call + self.boss_answer + self.north + self.south
    }
}

async fn measure() -> Costs {
    let llm = Arc::new(boss_asks_two_workers());
    let recorder = CallRecorder::new();
    let system = start(&llm, &recorder);
    let reply = system.ask("boss", "how many stars are there").await.unwrap();
    let steps = steps(&recorder);
    let costs = Costs {
        boss_call: steps["boss"][0],
        boss_answer: steps["boss"][1],
        north: steps["north"][0],
        south: steps["south"][0],
    };
    // Unlimited, the reply's spend is everything the chain's model calls used.
    assert_eq!(reply.spent.tokens, costs.total(), "{costs:?}");
    assert_eq!(reply.spent.tool_calls, 2);
    assert_eq!(llm.requests_of("north")[0].max_tokens, None);
    system.shutdown().await;
    costs
}

async fn ask(
    budget: Budget,
) -> (
    Arc<ScriptedLlm>,
    CallRecorder,
    AgentSystem,
    Result<troupe_agent::AgentReply, AgentCallError>,
) {
    let llm = Arc::new(boss_asks_two_workers());
    let recorder = CallRecorder::new();
    let system = start(&llm, &recorder);
    let result = system
        .ask_with("boss", "how many stars are there", AskOptions::default().budget(budget))
        .await;
    (llm, recorder, system, result)
}

/// What each of `calls` `call_agent`s in one step is granted of `left`: an equal share
/// of what the caller's reserve (`AGENT_CALL_PARENT_RESERVE_PERCENT`, rounded down)
/// leaves.
fn call_share(left: u64, calls: u64) -> u64 {
    (left - left * AGENT_CALL_PARENT_RESERVE_PERCENT / 100) / calls
}

/// The least the boss may have left after its first step for the two workers' shares to
/// cover both of them.
fn left_covering_both_workers(costs: &Costs) -> u64 {
    let widest = costs.north.max(costs.south);
    (widest..).find(|&left| call_share(left, 2) >= widest).unwrap()
}

/// Goal: with the least budget under which both workers' shares cover them, each
/// worker gets its equal share of what the boss's reserve leaves after its first step
/// (reserved at once), is charged what it spent, and the unused part comes back: the
/// boss's last step is capped at all the workers did not spend. Why not the run's
/// unlimited spend (as under the equal split of everything left): there the shares
/// (half of what the reserve leaves each) are under what a worker needs.
#[tokio::test(start_paused = true)]
async fn parallel_workers_share_the_bosss_budget_and_the_unused_part_comes_back() {
    let costs = measure().await;
    let left = left_covering_both_workers(&costs);
    let budget = costs.boss_call + left;
    assert!(budget > costs.total(), "{costs:?}: the reserve costs a fan-out budget");
    let (llm, recorder, system, result) = ask(Budget::tokens(budget)).await;
    let reply = result.unwrap_or_else(|error| panic!("under {budget} ({costs:?}): {error}"));
    assert_eq!(reply.spent.tokens, costs.total());
    let share = call_share(left, 2);
    assert_eq!(
        share,
        costs.north.max(costs.south),
        "the least budget: the widest fits exactly"
    );
    assert_eq!(llm.requests_of("boss")[0].max_tokens, Some(budget));
    assert_eq!(llm.requests_of("north")[0].max_tokens, Some(share));
    assert_eq!(llm.requests_of("south")[0].max_tokens, Some(share));
    assert_eq!(
        llm.requests_of("boss")[1].max_tokens,
        Some(left - costs.north - costs.south),
        "the shares' unused part came back"
    );
    assert_eq!(
        spend_per_root(&recorder).into_values().collect::<Vec<_>>(),
        vec![costs.total()]
    );
    system.shutdown().await;
}

/// Goal: one token short of the least budget under which the workers' shares cover
/// them, the workers run out, and the boss's answer (which reads their refusals, longer
/// than their answers) does not fit in what it kept either: the caller gets the typed
/// error, with what the chain spent (the boss's first step: the workers spent nothing
/// and their grants came back), and the boss's conversation keeps nothing of the turn.
#[tokio::test(start_paused = true)]
async fn one_token_short_the_root_gets_budget_exhausted() {
    let costs = measure().await;
    assert_eq!(costs.north, costs.south, "both workers need the same: both run out");
    let left = left_covering_both_workers(&costs) - 1;
    let budget = costs.boss_call + left;
    let (llm, recorder, system, result) = ask(Budget::tokens(budget)).await;
    let share = call_share(left, 2);
    assert_eq!(llm.requests_of("north")[0].max_tokens, Some(share));
    assert_eq!(share, costs.north - 1);
    let Err(AgentCallError::BudgetExhausted(exhausted)) = result else {
        panic!("expected BudgetExhausted, got {result:?}");
    };
    assert_eq!(exhausted.agent, agent_id("boss").unwrap());
    assert_eq!(exhausted.resource, BudgetResource::Tokens);
    assert_eq!(exhausted.limit, budget);
    assert_eq!(exhausted.spent, costs.boss_call);
    assert_eq!(
        llm.requests_of("boss").len(),
        2,
        "the last step was tried under its cap"
    );
    assert_eq!(llm.requests_of("boss")[1].max_tokens, Some(left));
    assert_eq!(llm.answers().iter().filter(|a| a.agent.key() == "boss").count(), 1);
    let spent = spend_per_root(&recorder).into_values().collect::<Vec<_>>();
    assert_eq!(spent, vec![costs.boss_call]);
    assert!(system.conversation_log("boss").await.unwrap().is_empty());
    system.shutdown().await;
}

/// Goal: workers granted less than their turn needs run out; the boss's model reads
/// why as the two tool results, and the chain never spends past the budget.
#[tokio::test(start_paused = true)]
async fn workers_granted_too_little_run_out_and_the_model_reads_why() {
    let costs = measure().await;
    let budget = costs.boss_call + costs.north;
    let (llm, recorder, system, result) = ask(Budget::tokens(budget)).await;
    let share = call_share(costs.north, 2);
    assert_eq!(llm.requests_of("north")[0].max_tokens, Some(share));
    assert_eq!(llm.requests_of("south")[0].max_tokens, Some(share));
    let seen = llm.tool_results_seen_by("boss");
    assert_eq!(seen.len(), 2, "{seen:?}");
    let refused = |agent: &str| {
        format!("error: call_agent failed: the budget of agent/{agent}'s turn is exhausted: 0 of {share} tokens")
    };
    assert!(seen[0].starts_with(&refused("north")), "{seen:?}");
    assert!(seen[1].starts_with(&refused("south")), "{seen:?}");
    // The workers spent nothing (their answers did not fit), so the boss has all the
    // rest for its answer: the chain's spend is the boss's steps only.
    let spent = spend_per_root(&recorder).into_values().sum::<u64>();
    assert!(spent <= budget, "{spent} > {budget}");
    match result {
        Ok(reply) => assert_eq!(reply.spent.tokens, spent),
        Err(AgentCallError::BudgetExhausted(exhausted)) => assert_eq!(exhausted.spent, spent),
        Err(other) => panic!("unexpected {other}"),
    }
    system.shutdown().await;
}

/// Goal: with nothing left after its first step, the boss's calls are refused before
/// anything is sent (the workers are never asked) and its next model call never starts.
#[tokio::test(start_paused = true)]
async fn with_nothing_left_no_call_is_sent_and_no_model_call_starts() {
    let costs = measure().await;
    let budget = costs.boss_call;
    let (llm, _recorder, system, result) = ask(Budget::tokens(budget)).await;
    assert!(llm.requests_of("north").is_empty());
    assert!(llm.requests_of("south").is_empty());
    assert_eq!(llm.requests_of("boss").len(), 1);
    let Err(AgentCallError::BudgetExhausted(exhausted)) = result else {
        panic!("expected BudgetExhausted, got {result:?}");
    };
    assert_eq!((exhausted.spent, exhausted.limit), (budget, budget));
    system.shutdown().await;
}

/// Goal: a tool-call budget of one runs the first `call_agent` and refuses the second
/// with a tool result the model reads; the reply counts one tool call.
#[tokio::test(start_paused = true)]
async fn a_tool_call_budget_refuses_the_calls_past_it() {
    let budget = Budget {
        tokens: None,
        tool_calls: Some(1),
    };
    let (llm, _recorder, system, result) = ask(budget).await;
    let reply = result.unwrap();
    assert_eq!(reply.spent.tool_calls, 1);
    assert_eq!(llm.requests_of("north").len(), 1);
    assert!(llm.requests_of("south").is_empty());
    let seen = llm.tool_results_seen_by("boss");
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(seen[0], "about two hundred billion");
    assert!(
        seen[1].starts_with("error: the budget of agent/boss's turn is exhausted: 1 of 1 tool calls"),
        "{seen:?}"
    );
    system.shutdown().await;
}

/// Goal: on tokio's multi-thread runtime, many concurrent requests under one budget
/// each never spend more than it, counted from the model calls of each request's tree.
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_each_stay_within_their_budget_on_the_multi_thread_runtime() {
    const REQUESTS: usize = 16;
    let costs = measure().await;
    let budget = costs.total() + costs.total() / 2;
    let llm = Arc::new(boss_asks_two_workers());
    let recorder = CallRecorder::new();
    let system = start(&llm, &recorder);
    let mut handles = Vec::new();
    for index in 0..REQUESTS {
        let client = system.client();
        handles.push(tokio::spawn(async move {
            let options = AskOptions::default().budget(Budget::tokens(budget));
            client
                .ask_with("boss", &format!("how many stars {index}"), options)
                .await
        }));
    }
    let (mut answered, mut exhausted) = (0, 0);
    for handle in handles {
        match handle.await.unwrap() {
            Ok(reply) => {
                assert!(reply.spent.tokens <= budget);
                answered += 1;
            }
            Err(AgentCallError::BudgetExhausted(error)) => {
                assert!(error.spent <= budget);
                exhausted += 1;
            }
            Err(other) => panic!("unexpected {other}"),
        }
    }
    assert_eq!(answered + exhausted, REQUESTS);
    // The history window grows each turn, so later requests cost more and run out.
    assert!(
        answered >= 1 && exhausted >= 1,
        "answered {answered}, exhausted {exhausted}"
    );
    let spend = spend_per_root(&recorder);
    assert_eq!(spend.len(), REQUESTS);
    for (root, spent) in spend {
        assert!(spent <= budget, "request {root} spent {spent} of {budget}");
    }
    system.shutdown().await;
}

/// Goal: a delegated task carries its grant with it (persisted in the inbox entry), the
/// delegating turn is charged the whole grant at once (its reply's spend includes it),
/// and the delegator's turn that reads the result runs on what the task left.
#[tokio::test(start_paused = true)]
async fn a_delegated_task_runs_on_its_grant_and_the_result_on_what_it_left() {
    let llm = Arc::new(
        ScriptedLlm::new()
            .rule(ScriptRule::agent("boss").on_user_containing("plan").call(
                "delegate_to_agent",
                json!({"agent_id": "north", "message": "count the stars", "timeout_ms": 60000}),
            ))
            .rule(ScriptRule::agent("boss").on_tool_result().reply("delegated"))
            .rule(
                ScriptRule::agent("boss")
                    .on_user_containing("you delegated is")
                    .reply("thanks"),
            )
            .rule(ScriptRule::agent("north").on_user_containing("[task").reply("many")),
    );
    let recorder = CallRecorder::new();
    let system = start(&llm, &recorder);
    const BUDGET: u64 = 1_000;
    const SEND_GRANT_DIVISOR: u64 = troupe_agent::limits::AGENT_SEND_GRANT_DIVISOR;
    let reply = system
        .ask_with(
            "boss",
            "plan the count",
            AskOptions::default().budget(Budget::tokens(BUDGET)),
        )
        .await
        .unwrap();
    assert_eq!(reply.text, "delegated");
    tokio::time::sleep(std::time::Duration::from_secs(20)).await;

    let boss = llm.requests_of("boss");
    let north = llm.requests_of("north");
    assert_eq!(
        (boss.len(), north.len()),
        (3, 1),
        "two steps of the asked turn, one of the result"
    );
    let first_step = steps(&recorder)["boss"][0];
    // One delegation in the step: half of what is left (a send keeps the other half for
    // the rest of the turn, as its grant never comes back to it).
    let grant = (BUDGET - first_step) / SEND_GRANT_DIVISOR;
    assert_eq!(north[0].max_tokens, Some(grant));
    assert_eq!(
        boss[1].max_tokens,
        Some(BUDGET - first_step - grant),
        "charged whole, at once"
    );
    let answer_step = steps(&recorder)["boss"][1];
    assert_eq!(reply.spent.tokens, first_step + grant + answer_step);
    let north_spent = steps(&recorder)["north"][0];
    assert_eq!(
        boss[2].max_tokens,
        Some(grant - north_spent),
        "the result's turn runs on what the task left"
    );
    system.shutdown().await;
}

mod a_child_cut_mid_spend {
    use super::*;
    use std::time::Duration;

    /// What the boss gives the worker, far less than the worker's second step takes.
    const WORKER_CALL_MS: u64 = 200;
    /// How long the worker's second model step takes (it is cut long before).
    const WORKER_SECOND_STEP_MS: u64 = 5_000;

    /// The boss calls the worker alone; the worker spends a step calling the helper
    /// (which answers), then its second step outlasts the boss's timeout; the boss then
    /// tells its user.
    fn script() -> ScriptedLlm {
        ScriptedLlm::new()
            .rule(
                ScriptRule::agent("boss")
                    .on_tool_result()
                    .reply("the boss says {tool_result}"),
            )
            .rule(ScriptRule::agent("boss").on_user_containing("").call(
                "call_agent",
                json!({"agent_id": "worker", "message": "count the stars", "timeout_ms": WORKER_CALL_MS}),
            ))
            .rule(
                ScriptRule::agent("worker")
                    .on_tool_result()
                    .reply("the worker counted {tool_result}")
                    .latency(Duration::from_millis(WORKER_SECOND_STEP_MS)),
            )
            .rule(
                ScriptRule::agent("worker")
                    .on_user_containing("")
                    .call("call_agent", json!({"agent_id": "helper", "message": "help me count"})),
            )
            .rule(ScriptRule::agent("helper").reply("about two hundred billion"))
    }

    fn start(llm: &Arc<ScriptedLlm>, recorder: &CallRecorder) -> AgentSystem {
        AgentSystem::builder()
            .llm(Arc::clone(llm) as Arc<dyn LlmClient>)
            .observer(Arc::new(recorder.clone()))
            .agent(AgentSpec::new("boss"))
            .agent(AgentSpec::new("worker"))
            .agent(AgentSpec::new("helper"))
            .start()
            .unwrap()
    }

    /// Goal: a child cut after it has spent part of its grant (one model step and a
    /// call of its own) leaves its caller the reserve a lone call keeps
    /// (`AGENT_CALL_PARENT_RESERVE_PERCENT`), so the caller answers its user; and the
    /// chain's true spend (the tokens the model reported, every agent's) stays within
    /// the budget, also after the cut model step's time has passed, while the caller
    /// is charged no less than it (the cut child: its whole grant). Method: an
    /// unlimited run measures each step; the run under the budget is checked against
    /// those numbers and the events.
    #[tokio::test(start_paused = true)]
    async fn leaves_its_caller_the_reserve_and_the_chain_stays_within_the_budget() {
        let llm = Arc::new(script());
        let recorder = CallRecorder::new();
        let system = start(&llm, &recorder);
        let reply = system.ask("boss", "how many stars").await.unwrap();
        assert!(reply.text.contains("timed out"), "{}", reply.text);
        let costs = steps(&recorder);
        let (boss, worker, helper) = (&costs["boss"], &costs["worker"], &costs["helper"]);
        assert_eq!((boss.len(), worker.len(), helper.len()), (2, 1, 1), "{costs:?}");
        system.shutdown().await;

        // Ample for what the worker and the helper spend, with the reserve kept for the
        // boss's answer; granted everything left, the boss could not answer at all.
        let budget = boss[0] + 4 * (boss[1] + worker[0] + helper[0]);
        let llm = Arc::new(script());
        let recorder = CallRecorder::new();
        let system = start(&llm, &recorder);
        let result = system
            .ask_with(
                "boss",
                "how many stars",
                AskOptions::default().budget(Budget::tokens(budget)),
            )
            .await;
        let reply = result.unwrap_or_else(|error| panic!("under a budget of {budget}: {error}"));
        assert!(reply.text.contains("timed out"), "{}", reply.text);
        let worker_grant = llm.requests_of("worker")[0].max_tokens.expect("the worker's cap");
        let left = budget - boss[0];
        assert_eq!(worker_grant, call_share(left, 1), "the lone call's grant");
        // The worker's second step started (the worker was cut mid-spend).
        assert_eq!(llm.requests_of("worker").len(), 2);
        assert_eq!(reply.spent.tokens, boss[0] + worker_grant + boss[1]);
        assert!(reply.spent.tokens <= budget, "{} > {budget}", reply.spent.tokens);
        // Past the cut step's latency: no model call answers late and adds to the spend.
        tokio::time::sleep(Duration::from_millis(2 * WORKER_SECOND_STEP_MS)).await;
        let spent: u64 = spend_per_root(&recorder).into_values().sum();
        assert_eq!(spent, boss[0] + boss[1] + worker[0] + helper[0]);
        assert!(
            spent <= reply.spent.tokens,
            "true spend {spent} > charged {}",
            reply.spent.tokens
        );
        system.shutdown().await;
    }
}

mod parallel_calls_that_time_out {
    use super::*;
    use std::time::Duration;

    /// What the boss gives each worker, far less than a worker's model takes.
    const WORKER_CALL_MS: u64 = 200;
    /// How long a worker's model step takes (it is cut long before).
    const WORKER_STEP_MS: u64 = 5_000;
    /// The workers the boss can call, one per parallel call.
    const WORKERS: [&str; 3] = ["north", "south", "east"];

    /// The boss calls the first `calls` workers at once, in one step; every call times
    /// out (each worker is cut inside its first model call); the boss then tells its
    /// user.
    fn script(calls: usize) -> ScriptedLlm {
        let mut first_step = ScriptRule::agent("boss").on_user_containing("");
        for worker in &WORKERS[..calls] {
            first_step = first_step.call(
                "call_agent",
                json!({"agent_id": worker, "message": "count the stars", "timeout_ms": WORKER_CALL_MS}),
            );
        }
        let mut llm = ScriptedLlm::new()
            .rule(
                ScriptRule::agent("boss")
                    .on_tool_result()
                    .reply("the boss says {tool_result}"),
            )
            .rule(first_step);
        for worker in WORKERS {
            llm = llm.rule(
                ScriptRule::agent(worker)
                    .reply("about two hundred billion")
                    .latency(Duration::from_millis(WORKER_STEP_MS)),
            );
        }
        llm
    }

    fn start(llm: &Arc<ScriptedLlm>, recorder: &CallRecorder) -> AgentSystem {
        let mut builder = AgentSystem::builder()
            .llm(Arc::clone(llm) as Arc<dyn LlmClient>)
            .observer(Arc::new(recorder.clone()))
            .agent(AgentSpec::new("boss"));
        for worker in WORKERS {
            builder = builder.agent(AgentSpec::new(worker));
        }
        builder.start().unwrap()
    }

    /// Goal: `calls` parallel `call_agent`s in one step that all time out leave their
    /// caller's turn the reserve (`AGENT_CALL_PARENT_RESERVE_PERCENT` of what it had
    /// left), as a lone call does, so the caller tells its user. Method: one unlimited
    /// run measures the boss's two steps; a second runs under twice that spend; each
    /// worker's only model call is capped at its grant and charged whole (its spend is
    /// unknown).
    async fn leave_their_caller_the_reserve(calls: usize) {
        let llm = Arc::new(script(calls));
        let recorder = CallRecorder::new();
        let system = start(&llm, &recorder);
        let reply = system.ask("boss", "how many stars").await.unwrap();
        assert_eq!(reply.text.matches("timed out").count(), calls, "{}", reply.text);
        let unlimited = reply.spent.tokens;
        let boss = steps(&recorder)["boss"].clone();
        assert_eq!(boss.len(), 2, "{boss:?}");
        assert_eq!(
            unlimited,
            boss[0] + boss[1],
            "a cut worker's unlimited grant counts nothing"
        );
        system.shutdown().await;

        let budget = 2 * unlimited;
        let llm = Arc::new(script(calls));
        let recorder = CallRecorder::new();
        let system = start(&llm, &recorder);
        let result = system
            .ask_with(
                "boss",
                "how many stars",
                AskOptions::default().budget(Budget::tokens(budget)),
            )
            .await;
        let reply = result.unwrap_or_else(|error| {
            panic!("{calls} parallel calls, under {budget} tokens (twice the unlimited spend): {error}")
        });
        assert_eq!(reply.text.matches("timed out").count(), calls, "{}", reply.text);
        let grant = call_share(budget - boss[0], calls as u64);
        for worker in &WORKERS[..calls] {
            let requests = llm.requests_of(worker);
            assert_eq!(requests.len(), 1, "{worker} was cut in its first model call");
            assert_eq!(requests[0].max_tokens, Some(grant), "{worker}'s grant");
        }
        assert_eq!(reply.spent.tokens, unlimited + calls as u64 * grant);
        assert!(reply.spent.tokens <= budget, "{} > {budget}", reply.spent.tokens);
        system.shutdown().await;
    }

    #[tokio::test(start_paused = true)]
    async fn two_that_time_out_leave_their_caller_the_reserve() {
        leave_their_caller_the_reserve(2).await;
    }

    #[tokio::test(start_paused = true)]
    async fn three_that_time_out_leave_their_caller_the_reserve() {
        leave_their_caller_the_reserve(3).await;
    }

    #[cfg(not(madsim))]
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn two_and_three_that_time_out_leave_their_caller_the_reserve_on_the_multi_thread_runtime() {
        leave_their_caller_the_reserve(2).await;
        leave_their_caller_the_reserve(3).await;
    }
}
