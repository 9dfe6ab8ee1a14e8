//! Agents end to end through the real runtime: the dispatcher, agent actors, their
//! tools and `call_agent`; only the model is scripted, and it really emits the tool calls.
//!
//! Runs in both builds: `cargo test -p troupe-agent --test agents` (tokio with paused
//! time) and `CARGO_TARGET_DIR=target/madsim RUSTFLAGS="--cfg madsim" cargo test -p
//! troupe-agent --test agents` (the madsim simulator).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;
use troupe_agent::limits::AGENT_REPLY_SIZE_MAX_BYTES;
use troupe_agent::{
    agent_id, call_agent, AgentCallError, AgentEvent, AgentSpec, AgentSystem, CallOutcome, CallRecorder, Role,
    ScriptRule, ScriptedLlm, Tool, ToolError,
};
use troupe_core::limits::AGENT_CALL_DEPTH_MAX;
use troupe_core::{CallRefused, Deadline, InvokeError};
use troupe_runtime::{KindConfig, MemoryStore, SqliteStore, StateStore};

const SECOND: Duration = Duration::from_secs(1);
/// Virtual time is exact under paused tokio; madsim adds microseconds of scheduling jitter.
const JITTER: Duration = Duration::from_millis(10);

fn assert_about(actual: Duration, expected: Duration, what: &str) {
    assert!(
        actual >= expected && actual < expected + JITTER,
        "{what}: {actual:?}, expected {expected:?}"
    );
}

fn assert_deadline_about(actual: Deadline, expected: Deadline, what: &str) {
    let (a, e) = (actual.as_micros(), expected.as_micros());
    assert!(
        a.abs_diff(e) < JITTER.as_micros() as u64,
        "{what}: {actual:?}, expected {expected:?}"
    );
}

fn start(llm: &ScriptedLlm, agents: &[&str], recorder: &CallRecorder) -> AgentSystem {
    start_on(llm, agents, recorder, Arc::new(MemoryStore::new()))
}

fn start_on(llm: &ScriptedLlm, agents: &[&str], recorder: &CallRecorder, store: Arc<dyn StateStore>) -> AgentSystem {
    let mut builder = AgentSystem::builder()
        .store(store)
        .llm(Arc::new(llm.clone()))
        .observer(Arc::new(recorder.clone()));
    for agent in agents {
        builder = builder.agent(AgentSpec::new(*agent).role(format!("the {agent}")));
    }
    builder.start().expect("the system starts")
}

fn ask_rule(agent: &str, target: &str, message: &str) -> ScriptRule {
    ScriptRule::agent(agent)
        .on_user_containing("")
        .call("call_agent", json!({"agent_id": target, "message": message}))
}

/// (agent key, depth, chain keys, deadline) of every turn started, in order.
fn turns(recorder: &CallRecorder) -> Vec<(String, u32, Vec<String>, Deadline)> {
    recorder
        .events()
        .into_iter()
        .filter_map(|event| match event {
            AgentEvent::TurnStarted {
                agent,
                depth,
                chain,
                deadline,
                ..
            } => Some((
                agent.key().to_string(),
                depth,
                chain.iter().map(|a| a.key().to_string()).collect(),
                deadline,
            )),
            _ => None,
        })
        .collect()
}

/// Goal: the basic ask. Method: A's model calls `call_agent(b)`; B's own model answers;
/// A's model sees B's answer as the tool result and answers with it.
#[tokio::test(start_paused = true)]
async fn an_agent_asks_another_and_gets_its_answer() {
    let llm = ScriptedLlm::new()
        .rule(ask_rule("a", "b", "what is 6 x 7?"))
        .rule(ScriptRule::agent("a").on_tool_result().reply("b says {tool_result}"))
        .rule(ScriptRule::agent("b").on_user_containing("6 x 7").reply("42"));
    let recorder = CallRecorder::new();
    let system = start(&llm, &["a", "b"], &recorder);
    let reply = system.ask("a", "ask b").await.unwrap();
    assert_eq!(reply.text, "b says 42");
    assert_eq!(reply.steps, 2);
    assert_eq!(llm.tool_results_seen_by("a"), vec!["42".to_string()]);
    let b_input = llm.requests_of("b")[0].messages.last().unwrap().content.clone();
    assert_eq!(b_input, "[message from agent a] what is 6 x 7?");
    let b_tools: Vec<String> = llm.requests_of("b")[0].tools.iter().map(|t| t.name.clone()).collect();
    assert_eq!(
        b_tools,
        vec!["call_agent", "delegate_to_agent", "notify_agent"],
        "call_agent, delegate_to_agent and notify_agent are registered for every agent"
    );

    // Both turns were committed: A's log holds user, tool call, tool result, answer.
    let a_log = system.conversation_log("a").await.unwrap();
    let roles: Vec<Role> = a_log.iter().map(|m| m.role).collect();
    assert_eq!(roles, vec![Role::User, Role::Assistant, Role::Tool, Role::Assistant]);
    assert_eq!(system.conversation_log("b").await.unwrap().len(), 2);
    let tree = recorder.call_trees();
    assert_eq!(tree.len(), 1);
    assert_eq!(tree[0].children.len(), 1);
    assert_eq!(tree[0].children[0].target, agent_id("b").unwrap());
    assert_eq!(tree[0].children[0].depth, 1);
    system.shutdown().await;
}

/// Goal: A→B→A is refused before anything is sent, with the chain in the error, and the
/// refusal reaches the models as a readable tool result. Method: B's model calls A back;
/// B's model must see the refusal, and A's model sees it inside B's answer.
#[tokio::test(start_paused = true)]
async fn a_call_back_up_the_chain_is_refused_with_the_chain_and_the_models_see_it() {
    let llm = ScriptedLlm::new()
        .rule(ask_rule("a", "b", "help"))
        .rule(ScriptRule::agent("a").on_tool_result().reply("a got: {tool_result}"))
        .rule(ask_rule("b", "a", "can you clarify?"))
        .rule(
            ScriptRule::agent("b")
                .on_tool_result()
                .reply("b could not ask a: {tool_result}"),
        );
    let recorder = CallRecorder::new();
    let system = start(&llm, &["a", "b"], &recorder);
    let started = tokio::time::Instant::now();
    let reply = system.ask("a", "go").await.unwrap();
    assert_about(started.elapsed(), Duration::ZERO, "the refusal must be immediate");
    let refusal = "error: call_agent failed: call refused: cycle detected: agent/a -> agent/b -> agent/a";
    let b_saw = llm.tool_results_seen_by("b");
    assert_eq!(b_saw.len(), 1);
    assert!(b_saw[0].starts_with(refusal), "{}", b_saw[0]);
    let a_saw = llm.tool_results_seen_by("a");
    assert!(
        a_saw[0].starts_with(&format!("b could not ask a: {refusal}")),
        "{}",
        a_saw[0]
    );
    assert!(reply.text.contains("agent/a -> agent/b -> agent/a"));
    // A was asked exactly once: the refused call never reached it.
    assert_eq!(
        llm.requests_of("a").len(),
        2,
        "A's two steps, no turn for the refused call"
    );
    assert_eq!(turns(&recorder).iter().filter(|t| t.0 == "a").count(), 1);
    let refused = &recorder.call_trees()[0].children[0].children[0];
    match &refused.finished {
        Some((_, troupe_agent::CallOutcome::Refused(CallRefused::CycleDetected { chain }))) => {
            let keys: Vec<&str> = chain.iter().map(|a| a.key()).collect();
            assert_eq!(keys, vec!["a", "b", "a"]);
        }
        other => panic!("expected a cycle refusal, got {other:?}"),
    }
    system.shutdown().await;
}

/// Goal: depth is bounded at 5. Method: a0 → a1 → … → a5 each ask the next; a5's call to
/// a6 must be refused with DepthExceeded, and a6 must never run.
#[tokio::test(start_paused = true)]
async fn a_chain_of_depth_five_succeeds_and_the_sixth_call_is_refused() {
    let names: Vec<String> = (0..7).map(|i| format!("a{i}")).collect();
    let mut llm = ScriptedLlm::new();
    for i in 0..6 {
        llm = llm
            .rule(ask_rule(&names[i], &names[i + 1], &format!("hop {}", i + 1)))
            .rule(
                ScriptRule::agent(names[i].clone())
                    .on_tool_result()
                    .reply(format!("{}<{{tool_result}}", names[i])),
            );
    }
    llm = llm.rule(ScriptRule::agent("a6").reply("unreachable"));
    let recorder = CallRecorder::new();
    let agents: Vec<&str> = names.iter().map(String::as_str).collect();
    let system = start(&llm, &agents, &recorder);
    let reply = system.ask("a0", "start").await.unwrap();
    let refusal = format!(
        "error: call_agent failed: call refused: call depth {AGENT_CALL_DEPTH_MAX} has reached the limit of {AGENT_CALL_DEPTH_MAX}"
    );
    assert!(
        reply.text.starts_with(&format!("a0<a1<a2<a3<a4<a5<{refusal}")),
        "{}",
        reply.text
    );
    assert!(llm.requests_of("a6").is_empty(), "a6 must never run");
    let depths: Vec<(String, u32)> = turns(&recorder).into_iter().map(|t| (t.0, t.1)).collect();
    let expected: Vec<(String, u32)> = (0..6).map(|i| (names[i].clone(), i as u32)).collect();
    assert_eq!(depths, expected);
    let chain_of_a5 = &turns(&recorder)[5].2;
    assert_eq!(chain_of_a5, &names[..5].to_vec());
    system.shutdown().await;
}

/// Goal: a callee slower than the caller's timeout yields Timeout, and its late reply
/// is discarded: the callee's turn is cancelled at its deadline and commits nothing.
/// Method: `slow`'s model takes 5 s; A calls it with timeout_ms 1000.
#[tokio::test(start_paused = true)]
async fn a_callee_slower_than_the_timeout_yields_timeout_and_its_late_reply_is_discarded() {
    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("a").on_user_containing("").call(
            "call_agent",
            json!({"agent_id": "slow", "message": "take your time", "timeout_ms": 1000}),
        ))
        .rule(ScriptRule::agent("a").on_tool_result().reply("{tool_result}"))
        .rule(ScriptRule::agent("slow").reply("late answer").latency(5 * SECOND));
    let recorder = CallRecorder::new();
    let system = start(&llm, &["a", "slow"], &recorder);
    let started = tokio::time::Instant::now();
    let reply = system.ask("a", "go").await.unwrap();
    assert_about(started.elapsed(), SECOND, "A waits its timeout");
    assert!(
        reply
            .text
            .starts_with("error: call_agent failed: call failed: invocation of agent/slow timed out after 1000 ms"),
        "{}",
        reply.text
    );
    let call = &recorder.call_trees()[0].children[0];
    assert!(matches!(
        &call.finished,
        Some((_, troupe_agent::CallOutcome::Failed(InvokeError::Timeout { .. })))
    ));

    // Let the slow model's latency run out: nothing may arrive or be committed.
    tokio::time::sleep(10 * SECOND).await;
    assert_eq!(llm.requests_of("slow").len(), 1, "the slow turn started once");
    assert!(
        llm.answers().iter().all(|a| a.agent.key() != "slow"),
        "the late answer was never produced"
    );
    assert!(
        system.conversation_log("slow").await.unwrap().is_empty(),
        "the cancelled turn committed nothing"
    );
    assert!(system.history_window("slow").await.unwrap().is_empty());
    let counters = system.runtime().counters();
    assert_eq!(
        counters.turns_failed + counters.turns_abandoned,
        1,
        "the slow turn ended unsuccessfully (its own deadline and its caller's end at one instant) and nothing else did: {counters:?}"
    );
    // A's own turn did commit, with the timeout as the tool result.
    let a_log = system.conversation_log("a").await.unwrap();
    assert!(a_log[2].content.contains("timed out"));
    system.shutdown().await;
}

/// Goal: on worker threads too, a callee agent whose model outlives its caller's timeout
/// is cut at the deadline by the runtime (its model loop has no timer of its own for an
/// ask) and commits nothing, while the caller gets the timeout as its tool result.
/// Method: a multi_thread runtime in real time; `slow`'s model takes 1 s, A calls it with
/// timeout_ms 100; then wait past the slow model's latency.
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callee_slower_than_the_timeout_commits_nothing_on_the_multi_thread_runtime() {
    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("a").on_user_containing("").call(
            "call_agent",
            json!({"agent_id": "slow", "message": "take your time", "timeout_ms": 100}),
        ))
        .rule(ScriptRule::agent("a").on_tool_result().reply("{tool_result}"))
        .rule(ScriptRule::agent("slow").reply("late answer").latency(SECOND));
    let recorder = CallRecorder::new();
    let system = start(&llm, &["a", "slow"], &recorder);
    let reply = system.ask("a", "go").await.unwrap();
    assert!(
        reply
            .text
            .starts_with("error: call_agent failed: call failed: invocation of agent/slow timed out after 100 ms"),
        "{}",
        reply.text
    );
    tokio::time::sleep(SECOND + SECOND / 2).await;
    assert!(
        llm.answers().iter().all(|a| a.agent.key() != "slow"),
        "the late answer was never produced"
    );
    assert!(
        system.conversation_log("slow").await.unwrap().is_empty(),
        "the cut turn committed nothing"
    );
    let counters = system.runtime().counters();
    assert_eq!(counters.turns_failed + counters.turns_abandoned, 1, "{counters:?}");
    system.shutdown().await;
}

/// Goal: the deadline only shrinks along a chain, and a chain never outlives its root.
/// Method: a0 → … → a5, each model step takes 1 s and hop i asks for (40 − 5i) s; record
/// each turn's deadline. Then a root with a 3 s deadline: the whole chain must give up by
/// then and no turn may have a later deadline.
#[tokio::test(start_paused = true)]
async fn the_deadline_shrinks_along_a_five_hop_chain_and_never_outlives_the_root() {
    let names: Vec<String> = (0..6).map(|i| format!("a{i}")).collect();
    let mut llm = ScriptedLlm::new();
    for i in 0..5 {
        let timeout_ms = (40 - 5 * i as u64) * 1_000;
        llm = llm
            .rule(
                ScriptRule::agent(names[i].clone())
                    .on_user_containing("")
                    .call(
                        "call_agent",
                        json!({"agent_id": names[i + 1], "message": "next", "timeout_ms": timeout_ms}),
                    )
                    .latency(SECOND),
            )
            .rule(
                ScriptRule::agent(names[i].clone())
                    .on_tool_result()
                    .reply("{tool_result}"),
            );
    }
    llm = llm.rule(ScriptRule::agent("a5").reply("bottom").latency(SECOND));
    let recorder = CallRecorder::new();
    let agents: Vec<&str> = names.iter().map(String::as_str).collect();
    let system = start(&llm, &agents, &recorder);

    let root_deadline = system.runtime().deadline_in(60 * SECOND);
    let reply = system.ask_with_timeout("a0", "go", 60 * SECOND).await.unwrap();
    assert_eq!(reply.text, "bottom");
    let deadlines: Vec<Deadline> = turns(&recorder).into_iter().map(|t| t.3).collect();
    assert_eq!(deadlines.len(), 6);
    assert_deadline_about(deadlines[0], root_deadline, "the root turn has the root deadline");
    for pair in deadlines.windows(2) {
        assert!(pair[1] < pair[0], "the deadline must shrink: {deadlines:?}");
    }
    // Hop 1 starts after a0's 1 s step and asks for 40 s: 41 s after the root started.
    assert_deadline_about(
        deadlines[1],
        Deadline::from_micros(root_deadline.as_micros() - 19_000_000),
        "hop 1",
    );

    // A root with 3 s: five 1 s steps do not fit; everything ends at the root deadline.
    let short = CallRecorder::new();
    let system2 = start(&llm, &agents, &short);
    let started = tokio::time::Instant::now();
    let root_deadline = system2.runtime().deadline_in(3 * SECOND);
    let result = system2.ask_with_timeout("a0", "go", 3 * SECOND).await;
    assert!(
        matches!(result, Err(AgentCallError::Invoke(InvokeError::Timeout { .. }))),
        "{result:?}"
    );
    assert_about(started.elapsed(), 3 * SECOND, "the short root");
    // a0, a1 and a2 each start a turn one step apart (at 0, 1 and 2 s); a2's step ends
    // at the root deadline, so a3 never runs. Every hop asked for more than is left, so
    // every turn has the root's deadline.
    let late = turns(&short);
    let agents_late: Vec<&str> = late.iter().map(|t| t.0.as_str()).collect();
    assert_eq!(agents_late, vec!["a0", "a1", "a2"], "{late:?}");
    for turn in &late {
        assert_deadline_about(turn.3, root_deadline, &format!("the deadline of {}", turn.0));
    }
    tokio::time::sleep(60 * SECOND).await;
    assert!(system2.conversation_log("a0").await.unwrap().is_empty());
    system.shutdown().await;
    system2.shutdown().await;
}

/// Goal: at most 10 calls in flight per agent. Method: A's model emits 11 `call_agent`
/// calls in one step, to 11 workers that each take 1 s; the calls run concurrently, the
/// first ten are answered and the eleventh is refused with TooManyCalls.
#[tokio::test(start_paused = true)]
async fn the_eleventh_concurrent_call_from_one_agent_is_refused_with_too_many_calls() {
    let workers: Vec<String> = (0..11).map(|i| format!("w{i}")).collect();
    let mut fan_out = ScriptRule::agent("a").on_user_containing("");
    for worker in &workers {
        fan_out = fan_out.call("call_agent", json!({"agent_id": worker, "message": "work"}));
    }
    let llm = ScriptedLlm::new()
        .rule(fan_out)
        .rule(ScriptRule::agent("a").on_tool_result().reply("{tool_result}"))
        .rule(ScriptRule::any_agent().reply("done by {agent}").latency(SECOND));
    let recorder = CallRecorder::new();
    let mut agents = vec!["a"];
    agents.extend(workers.iter().map(String::as_str));
    let system = start(&llm, &agents, &recorder);
    let started = tokio::time::Instant::now();
    system.ask("a", "fan out").await.unwrap();
    assert_about(started.elapsed(), SECOND, "the ten admitted calls ran concurrently");
    let results = llm.tool_results_seen_by("a");
    assert_eq!(results.len(), 11);
    for (i, result) in results[..10].iter().enumerate() {
        assert_eq!(result, &format!("done by w{i}"));
    }
    assert_eq!(
        results[10],
        "error: call_agent failed: call refused: too many calls in flight: 10 already, the limit is 10"
    );
    assert!(llm.requests_of("w10").is_empty(), "the refused call was never sent");
    // The slots were freed: the next turn can call again.
    system.ask("a", "fan out again").await.unwrap();
    assert_eq!(llm.tool_results_seen_by("a").len(), 22);
    system.shutdown().await;
}

/// Goal: conversation history survives a restart. Method: talk to an agent, shut the
/// runtime down, build a new one on the same store, talk again: the model must see the
/// first exchange, and the full log must hold both.
async fn restart_keeps_history(store: Arc<dyn StateStore>) {
    let first = ScriptedLlm::new().rule(ScriptRule::agent("a").reply("noted, Ada"));
    let system = start_on(&first, &["a"], &CallRecorder::new(), Arc::clone(&store));
    assert_eq!(system.ask("a", "my name is Ada").await.unwrap().text, "noted, Ada");
    system.shutdown().await;

    let second = ScriptedLlm::new().rule(
        ScriptRule::agent("a")
            .on_user_containing("my name?")
            .reply("you are Ada"),
    );
    let system = start_on(&second, &["a"], &CallRecorder::new(), Arc::clone(&store));
    assert_eq!(system.ask("a", "what is my name?").await.unwrap().text, "you are Ada");
    let seen: Vec<(Role, String)> = second.requests_of("a")[0]
        .messages
        .iter()
        .map(|m| (m.role, m.content.clone()))
        .collect();
    assert_eq!(
        seen[1..].to_vec(),
        vec![
            (Role::User, "my name is Ada".to_string()),
            (Role::Assistant, "noted, Ada".to_string()),
            (Role::User, "what is my name?".to_string()),
        ]
    );
    assert_eq!(seen[0].0, Role::System);
    let log: Vec<String> = system
        .conversation_log("a")
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.content)
        .collect();
    assert_eq!(
        log,
        vec!["my name is Ada", "noted, Ada", "what is my name?", "you are Ada"]
    );
    system.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn an_agent_restarted_between_two_messages_keeps_its_conversation_history() {
    restart_keeps_history(Arc::new(MemoryStore::new())).await;
}

/// As above on the durable default. (SQLite reads OS randomness once per process, so
/// madsim's determinism check, which runs a test twice in one process, flags it.)
#[tokio::test(start_paused = true)]
async fn an_agent_restarted_between_two_messages_keeps_its_conversation_history_in_sqlite() {
    restart_keeps_history(Arc::new(SqliteStore::open_in_memory().unwrap())).await;
}

/// Goal: Rust callers get typed errors, unknown agents are refused, and bad tool
/// arguments come back to the model as a clear error. Method: a Rust tool `probe` calls
/// `call_agent` and keeps the typed results; A's model calls probe on itself and on a
/// missing agent, and calls `call_agent` with a wrong argument type.
#[tokio::test(start_paused = true)]
async fn rust_callers_get_typed_errors_and_bad_arguments_reach_the_model_as_errors() {
    let typed: Arc<Mutex<Vec<Result<String, AgentCallError>>>> = Arc::default();
    let kept = Arc::clone(&typed);
    let probe = Tool::from_fn(
        "probe",
        "calls an agent from Rust",
        json!({"type": "object", "properties": {"agent_id": {"type": "string"}}, "required": ["agent_id"],
               "additionalProperties": false}),
        move |context, arguments| {
            let kept = Arc::clone(&kept);
            async move {
                let target = arguments["agent_id"].as_str().unwrap().to_string();
                let result = call_agent(&context, &target, "hi", None).await.map(|reply| reply.text);
                kept.lock().unwrap().push(result.clone());
                result.map_err(|error| ToolError::failed("probe", error.to_string()))
            }
        },
    );
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("")
                .call("probe", json!({"agent_id": "a"}))
                .call("probe", json!({"agent_id": "ghost"}))
                .call("call_agent", json!({"agent_id": "b", "message": 7}))
                .call("probe", json!({"agent": "b"}))
                .call("no_such_tool", json!({})),
        )
        .rule(ScriptRule::agent("a").on_tool_result().reply("done"));
    let recorder = CallRecorder::new();
    let system = AgentSystem::builder()
        .llm(Arc::new(llm.clone()))
        .observer(Arc::new(recorder))
        .agent(AgentSpec::new("a"))
        .agent(AgentSpec::new("b"))
        .tool(probe)
        .start()
        .unwrap();
    assert_eq!(system.ask("a", "probe").await.unwrap().text, "done");
    let a = agent_id("a").unwrap();
    let ghost = agent_id("ghost").unwrap();
    assert_eq!(
        typed.lock().unwrap().clone(),
        vec![
            Err(AgentCallError::Refused(CallRefused::CycleDetected {
                chain: vec![a.clone(), a]
            })),
            Err(AgentCallError::Refused(CallRefused::AgentNotFound {
                target: ghost.clone()
            })),
        ]
    );
    let results = llm.tool_results_seen_by("a");
    assert!(results[0].starts_with("error: probe failed: call refused: cycle detected: agent/a -> agent/a"));
    assert_eq!(
        results[1],
        "error: probe failed: call refused: agent agent/ghost not found"
    );
    assert_eq!(
        results[2],
        "error: invalid arguments for call_agent: $.message: 7 is not of type \"string\""
    );
    assert!(results[3].starts_with("error: invalid arguments for probe: $: \"agent_id\" is a required property"));
    assert_eq!(
        results[4],
        "error: unknown tool \"no_such_tool\"; available tools: call_agent, delegate_to_agent, notify_agent, probe"
    );
    // An outside caller asking a missing agent gets the same typed refusal.
    assert_eq!(
        system.ask("ghost", "hello").await,
        Err(AgentCallError::Refused(CallRefused::AgentNotFound { target: ghost }))
    );
    system.shutdown().await;
}

/// Goal: a failing model fails the turn and nothing of it is committed; replies are
/// capped without splitting a character. Method: inject a model failure, then a reply
/// of multi-byte characters longer than the cap.
#[tokio::test(start_paused = true)]
async fn a_model_failure_commits_nothing_and_long_replies_are_capped_on_a_character_boundary() {
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("fail")
                .fail("provider down")
                .times(1),
        )
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("long")
                .reply("é".repeat(AGENT_REPLY_SIZE_MAX_BYTES)),
        );
    let system = start(&llm, &["a"], &CallRecorder::new());
    let failed = system.ask("a", "please fail").await;
    match failed {
        Err(AgentCallError::ModelFailed(failed)) => {
            assert_eq!(
                failed.error,
                troupe_agent::LlmError::Injected {
                    cause: "provider down".into()
                }
            );
        }
        other => panic!("expected ModelFailed, got {other:?}"),
    }
    assert!(system.conversation_log("a").await.unwrap().is_empty());
    let long = system.ask("a", "something long").await.unwrap();
    assert!(long.truncated);
    assert_eq!(
        long.text.len(),
        AGENT_REPLY_SIZE_MAX_BYTES,
        "é is 2 bytes and the cap is even"
    );
    assert!(long.text.chars().all(|c| c == 'é'));
    assert_eq!(system.conversation_log("a").await.unwrap().len(), 2);
    system.shutdown().await;
}

/// Goal: one agent stuck in a slow model call never delays another agent. Method: A's
/// model takes 10 s; while A waits, B must answer in (virtually) no time.
#[tokio::test(start_paused = true)]
async fn an_agent_answers_while_another_is_stuck_in_a_slow_model_call() {
    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("a").reply("slow answer").latency(10 * SECOND))
        .rule(ScriptRule::agent("b").reply("quick answer"));
    let system = start(&llm, &["a", "b"], &CallRecorder::new());
    let client = system.client();
    let slow = tokio::spawn(async move { client.ask("a", "think hard").await });
    tokio::time::sleep(Duration::from_millis(1)).await;
    let started = tokio::time::Instant::now();
    assert_eq!(system.ask("b", "quick?").await.unwrap().text, "quick answer");
    assert_about(started.elapsed(), Duration::ZERO, "b must not wait for a");
    assert!(!slow.is_finished(), "a is still thinking");
    assert_eq!(slow.await.unwrap().unwrap().text, "slow answer");
    system.shutdown().await;
}

/// Goal: a cycle that no call chain shows (two independent requests: A waits on B while
/// B waits on A) is caught by the runtime's wait-for graph, at once, and reaches B's
/// model as a readable tool result; both requests then complete. Method: ask A and B
/// concurrently; A's model calls B at 0.5 s, B's model calls A at 1 s.
#[tokio::test(start_paused = true)]
async fn crossing_calls_from_independent_requests_are_refused_as_a_deadlock_and_both_complete() {
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("start")
                .call("call_agent", json!({"agent_id": "b", "message": "question from a"}))
                .latency(SECOND / 2),
        )
        .rule(ScriptRule::agent("a").on_tool_result().reply("a got: {tool_result}"))
        .rule(
            ScriptRule::agent("b")
                .on_user_containing("question from a")
                .reply("b answers a"),
        )
        .rule(
            ScriptRule::agent("b")
                .on_user_containing("start")
                .call("call_agent", json!({"agent_id": "a", "message": "question from b"}))
                .latency(SECOND),
        )
        .rule(ScriptRule::agent("b").on_tool_result().reply("b got: {tool_result}"));
    let system = start(&llm, &["a", "b"], &CallRecorder::new());
    let client = system.client();
    let from_a = tokio::spawn(async move { client.ask("a", "start").await });
    let b_reply = system.ask("b", "start").await.unwrap();
    assert!(
        b_reply.text.starts_with(
            "b got: error: call_agent failed: call failed: deadlock detected: agent/b -> agent/a -> agent/b"
        ),
        "{}",
        b_reply.text
    );
    assert_eq!(from_a.await.unwrap().unwrap().text, "a got: b answers a");
    assert_eq!(system.runtime().counters().deadlocks_refused, 1);
    assert!(llm
        .requests_of("a")
        .iter()
        .all(|r| !r.messages.iter().any(|m| m.content.contains("question from b"))));
    system.shutdown().await;
}

/// Goal: storage failures are errors the caller sees, never silent loss. Method: fail
/// the next commit: the ask fails with StorageFailed and the conversation does not
/// advance; fail the next load of a fresh activation: the ask fails with StorageFailed
/// and the agent does not start from an empty state; after healing, both work.
#[tokio::test(start_paused = true)]
async fn storage_failures_reach_the_caller_and_the_conversation_never_silently_advances() {
    let llm = ScriptedLlm::new().rule(ScriptRule::agent("a").reply("ok: {input}"));
    let store = Arc::new(MemoryStore::new());
    let system = start_on(&llm, &["a"], &CallRecorder::new(), store.clone());
    assert_eq!(system.ask("a", "one").await.unwrap().text, "ok: one");

    store.faults().fail_next_commits(1);
    let failed = system.ask("a", "two").await;
    assert!(
        matches!(failed, Err(AgentCallError::Invoke(InvokeError::StorageFailed { .. }))),
        "{failed:?}"
    );
    let log: Vec<String> = system
        .conversation_log("a")
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.content)
        .collect();
    assert_eq!(log, vec!["one", "ok: one"], "the failed turn left nothing behind");
    assert_eq!(system.ask("a", "three").await.unwrap().text, "ok: three");
    system.shutdown().await;

    // A new runtime on the same store: the first load fails, and must not start empty.
    let system = start_on(&llm, &["a"], &CallRecorder::new(), store.clone());
    // A new process reads the stored agent directory at its first lookup: read it
    // first, so the fault below hits the activation's load.
    system.reload_directory().await.unwrap();
    store.faults().fail_next_loads(1);
    let failed = system.ask("a", "four").await;
    assert!(
        matches!(failed, Err(AgentCallError::Invoke(InvokeError::StorageFailed { .. }))),
        "{failed:?}"
    );
    assert_eq!(system.ask("a", "five").await.unwrap().text, "ok: five");
    let window: Vec<String> = system
        .history_window("a")
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.content)
        .collect();
    assert_eq!(window, vec!["one", "ok: one", "three", "ok: three", "five", "ok: five"]);
    system.shutdown().await;
}

/// (event name, agent key) of every activation and deactivation, in order.
fn lifecycle(recorder: &CallRecorder) -> Vec<(&'static str, String, Deadline)> {
    recorder
        .events()
        .into_iter()
        .filter_map(|event| match event {
            AgentEvent::Activated { agent, at } => Some(("activated", agent.key().to_string(), at)),
            AgentEvent::Deactivated { agent, at } => Some(("deactivated", agent.key().to_string(), at)),
            _ => None,
        })
        .collect()
}

/// Goal: observers see every activation and deactivation of an agent, from the
/// runtime's real hooks, in order and at the right times. Method: an agent with a 50 ms
/// idle timeout is asked, left idle (it deactivates), asked again (a second activation),
/// and the system is shut down while it is active (it deactivates again).
#[tokio::test(start_paused = true)]
async fn an_agent_reports_activation_and_deactivation_to_observers() {
    let llm = ScriptedLlm::new().rule(ScriptRule::agent("a").reply("hello"));
    let recorder = CallRecorder::new();
    let idle = Duration::from_millis(50);
    let system = AgentSystem::builder()
        .llm(Arc::new(llm))
        .observer(Arc::new(recorder.clone()))
        .kind_config(KindConfig {
            idle_timeout: idle,
            ..KindConfig::default()
        })
        .agent(AgentSpec::new("a"))
        .agent(AgentSpec::new("b"))
        .start()
        .unwrap();
    let origin = system.runtime().now();
    assert!(
        lifecycle(&recorder).is_empty(),
        "nothing is active before the first ask"
    );

    assert_eq!(system.ask("a", "hi").await.unwrap().text, "hello");
    let events = recorder.events();
    let activated = events
        .iter()
        .position(|e| matches!(e, AgentEvent::Activated { .. }))
        .unwrap();
    let turn = events
        .iter()
        .position(|e| matches!(e, AgentEvent::TurnStarted { .. }))
        .unwrap();
    assert!(
        activated < turn,
        "the activation is reported before its first turn: {events:?}"
    );
    assert_eq!(lifecycle(&recorder).len(), 1);

    // Idle for longer than two idle timeouts: deactivated (between one and two after).
    tokio::time::sleep(idle * 3).await;
    let seen = lifecycle(&recorder);
    assert_eq!(
        seen.iter()
            .map(|(what, agent, _)| (*what, agent.as_str()))
            .collect::<Vec<_>>(),
        vec![("activated", "a"), ("deactivated", "a")]
    );
    // The idle timer checks once per idle timeout from the activation: the first check
    // finds the ask, the second finds nothing and deactivates.
    let idle_for = Duration::from_micros(seen[1].2.as_micros() - seen[0].2.as_micros());
    assert_about(idle_for, idle * 2, "deactivated at the second idle check");
    assert_deadline_about(seen[0].2, origin, "activated at the ask");

    // Asked again: a second activation; shutdown ends it.
    assert_eq!(system.ask("a", "again").await.unwrap().text, "hello");
    system.shutdown().await;
    let seen: Vec<(&str, String)> = lifecycle(&recorder)
        .into_iter()
        .map(|(what, agent, _)| (what, agent))
        .collect();
    let expected: Vec<(&str, String)> = ["activated", "deactivated", "activated", "deactivated"]
        .into_iter()
        .map(|what| (what, "a".to_string()))
        .collect();
    assert_eq!(seen, expected, "b was never asked, so never activated");
}

/// Goal: a `call_agent` whose caller stops waiting (its future is dropped, as when the
/// caller's turn is cut) still reports its end, as `Cancelled`, exactly once. Method: a
/// tool of A runs `call_agent(b)` under a 20 ms timeout while B's model takes 1 s; the
/// timeout drops the call mid-flight. A then answers, B's turn is abandoned.
#[tokio::test(start_paused = true)]
async fn a_cut_caller_reports_its_in_flight_call_as_cancelled() {
    let impatient = Tool::from_fn(
        "impatient",
        "asks b but gives up after 20 ms",
        json!({"type": "object"}),
        |context, _arguments| async move {
            match tokio::time::timeout(
                Duration::from_millis(20),
                call_agent(&context, "b", "slow?", Some(5_000)),
            )
            .await
            {
                Ok(result) => result
                    .map(|reply| reply.text)
                    .map_err(|e| ToolError::failed("impatient", e.to_string())),
                Err(_) => Ok("gave up".to_string()),
            }
        },
    );
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("")
                .call("impatient", json!({})),
        )
        .rule(ScriptRule::agent("a").on_tool_result().reply("a: {tool_result}"))
        .rule(ScriptRule::agent("b").reply("late").latency(SECOND));
    let recorder = CallRecorder::new();
    let system = AgentSystem::builder()
        .llm(Arc::new(llm))
        .observer(Arc::new(recorder.clone()))
        .agent(AgentSpec::new("a"))
        .agent(AgentSpec::new("b"))
        .tool(impatient)
        .start()
        .unwrap();
    assert_eq!(system.ask("a", "go").await.unwrap().text, "a: gave up");

    let events = recorder.events();
    let started: Vec<(u64, Deadline)> = events
        .iter()
        .filter_map(|event| match event {
            AgentEvent::CallStarted {
                call,
                caller: Some(caller),
                target,
                at,
                ..
            } => {
                assert_eq!((caller.key(), target.key()), ("a", "b"));
                Some((*call, *at))
            }
            _ => None,
        })
        .collect();
    assert_eq!(started.len(), 1, "{events:?}");
    let (call, at) = started[0];
    let finished: Vec<(CallOutcome, Deadline)> = events
        .iter()
        .filter_map(|event| match event {
            AgentEvent::CallFinished {
                call: finished,
                outcome,
                at,
            } if *finished == call => Some((outcome.clone(), *at)),
            _ => None,
        })
        .collect();
    assert_eq!(finished.len(), 1, "exactly one end: {events:?}");
    assert_eq!(finished[0].0, CallOutcome::Cancelled);
    assert_eq!(finished[0].0.label(), "cancelled");
    assert_deadline_about(
        finished[0].1,
        Deadline::from_micros(at.as_micros() + 20_000),
        "cancelled when dropped",
    );
    let tree = recorder.render_tree();
    assert!(
        tree.contains("a -> b") && tree.contains("cancelled: the caller's turn was cut"),
        "{tree}"
    );
    system.shutdown().await;
}

/// Goal: an embedder can start the runtime itself (a cluster node does). Method:
/// `prepare`, start the returned builder, then `attach`: before `attach` an agent cannot
/// activate (refused, naming what to do); a runtime without the agent kind is refused
/// at `attach`; once attached, asks are answered and the log is committed.
#[tokio::test(start_paused = true)]
async fn a_prepared_system_runs_on_a_runtime_started_by_the_embedder() {
    let llm = ScriptedLlm::new().rule(ScriptRule::agent("a").reply("hello"));
    let builder = || {
        AgentSystem::builder()
            .llm(Arc::new(llm.clone()))
            .agent(AgentSpec::new("a"))
    };
    let (runtime_builder, pending) = builder().prepare().expect("a valid system");
    let runtime = runtime_builder.start();
    let early = runtime
        .handle()
        .invoke_within(&agent_id("a").unwrap(), bytes::Bytes::from_static(b"{}"), SECOND)
        .await;
    match early {
        Err(InvokeError::ActorFailed { cause, .. }) => assert!(cause.contains("PendingAgentSystem::attach"), "{cause}"),
        other => panic!("an agent must not activate before attach: {other:?}"),
    }
    let (_, other_pending) = builder().prepare().expect("a valid system");
    let bare = troupe_runtime::Runtime::builder().start();
    assert!(matches!(
        other_pending.attach(bare.handle()),
        Err(troupe_agent::AgentSystemError::NotRegistered)
    ));
    bare.shutdown().await;
    let client = pending
        .attach(runtime.handle())
        .expect("the runtime has the agent kind");
    assert_eq!(client.ask("a", "hi").await.unwrap().text, "hello");
    assert_eq!(client.conversation_log("a").await.unwrap().len(), 2);
    runtime.shutdown().await;
}

/// Goal: an agent's role is listed in the system message of every agent that may
/// contact it (up to `AGENT_PEERS_LISTED_MAX` of them), and its name in its own: both
/// are bounded (`AGENT_ROLE_SIZE_MAX_BYTES`, `AGENT_NAME_SIZE_MAX_BYTES`) as the system
/// prompt is, so one definition cannot blow up every peer's prompt. A longer one is
/// refused by the builder, by `define_agent` (nothing stored), and for a remote agent's
/// role, naming the field, the size and the limit; one at the limit is taken.
#[tokio::test(start_paused = true)]
async fn a_role_or_name_longer_than_its_limit_is_refused() {
    use troupe_agent::limits::{AGENT_NAME_SIZE_MAX_BYTES, AGENT_ROLE_SIZE_MAX_BYTES};
    use troupe_agent::{AgentSpecError, AgentSystemError, DirectoryError, RemoteAgent, RemoteAgentError};

    let llm = ScriptedLlm::new().rule(ScriptRule::any_agent().reply("ok"));
    let build = |spec: AgentSpec| {
        AgentSystem::builder()
            .llm(Arc::new(llm.clone()))
            .agent(AgentSpec::new("peer"))
            .agent(spec)
            .start()
    };
    let too_long = |field: &'static str, limit: usize| AgentSpecError::FieldTooLong {
        id: "a".into(),
        field,
        size: limit + 1,
        limit,
    };
    let long_role = build(AgentSpec::new("a").role("r".repeat(AGENT_ROLE_SIZE_MAX_BYTES + 1)))
        .expect_err("a role over the limit is refused");
    let expected = too_long("role", AGENT_ROLE_SIZE_MAX_BYTES);
    assert_eq!(long_role.to_string(), expected.to_string());
    assert!(matches!(long_role, AgentSystemError::Spec(error) if error == expected));
    assert_eq!(
        expected.to_string(),
        format!(
            "the role of a is {} bytes, more than the limit of {AGENT_ROLE_SIZE_MAX_BYTES}; shorten it",
            AGENT_ROLE_SIZE_MAX_BYTES + 1
        )
    );
    let long_name = build(AgentSpec::new("a").name("n".repeat(AGENT_NAME_SIZE_MAX_BYTES + 1)))
        .expect_err("a name over the limit is refused");
    let expected = too_long("name", AGENT_NAME_SIZE_MAX_BYTES);
    assert!(matches!(long_name, AgentSystemError::Spec(error) if error == expected));

    let at_limit = AgentSpec::new("a")
        .role("r".repeat(AGENT_ROLE_SIZE_MAX_BYTES))
        .name("n".repeat(AGENT_NAME_SIZE_MAX_BYTES));
    let system = build(at_limit).unwrap();
    let defined = system
        .define_agent(AgentSpec::new("b").role("r".repeat(AGENT_ROLE_SIZE_MAX_BYTES + 1)))
        .await
        .expect_err("define_agent refuses it");
    assert!(
        matches!(&defined, DirectoryError::Invalid(AgentSpecError::FieldTooLong { id, field: "role", .. }) if id == "b"),
        "{defined:?}"
    );
    assert!(!system.directory().contains("b"), "nothing defined");
    assert_eq!(system.ask("a", "hi").await.unwrap().text, "ok");
    system.shutdown().await;

    let remote = AgentSystem::builder()
        .llm(Arc::new(llm.clone()))
        .agent(AgentSpec::new("a"))
        .remote_agent(
            RemoteAgent::new("hq", "http://127.0.0.1:9/a2a/hq").role("r".repeat(AGENT_ROLE_SIZE_MAX_BYTES + 1)),
        )
        .start()
        .expect_err("a remote agent's role over the limit is refused");
    assert!(
        matches!(
            remote,
            AgentSystemError::Remote(RemoteAgentError::RoleTooLong { ref id, size, limit: AGENT_ROLE_SIZE_MAX_BYTES })
                if id == "hq" && size == AGENT_ROLE_SIZE_MAX_BYTES + 1
        ),
        "{remote:?}"
    );
}

/// `*` is every agent in permission rules and links, and an id padded with whitespace
/// reads as another's: neither can be an agent's id, at the builder or through
/// `define_agent`, and nothing is defined. (Before 2026-12-06 both were accepted: an
/// agent `*` could not be named alone by any rule, as `PUT
/// /v1/agents/x/permissions/*` showed.)
#[tokio::test]
async fn an_id_that_cannot_name_one_agent_is_refused() {
    use troupe_agent::{AgentSpecError, AgentSystemError, DirectoryError};

    let llm = ScriptedLlm::new().rule(ScriptRule::any_agent().reply("ok"));
    for (id, why) in [
        ("*", "\"*\" means every agent in permission rules and links"),
        (" ", "it begins or ends with whitespace"),
        ("coordinator ", "it begins or ends with whitespace"),
        ("\u{a0}critic", "it begins or ends with whitespace"),
    ] {
        let expected = AgentSpecError::UnusableId { id: id.into(), why };
        let built = AgentSystem::builder()
            .llm(Arc::new(llm.clone()))
            .agent(AgentSpec::new(id))
            .start()
            .expect_err("the builder refuses it");
        assert!(
            matches!(&built, AgentSystemError::Spec(error) if *error == expected),
            "{id:?}: {built:?}"
        );
        assert_eq!(
            built.to_string(),
            format!("agent id {id:?} cannot name an agent: {why}; pick another id")
        );
        let system = AgentSystem::builder()
            .llm(Arc::new(llm.clone()))
            .agent(AgentSpec::new("a"))
            .start()
            .unwrap();
        let defined = system
            .define_agent(AgentSpec::new(id))
            .await
            .expect_err("define_agent refuses it");
        assert!(
            matches!(&defined, DirectoryError::Invalid(error) if *error == expected),
            "{id:?}: {defined:?}"
        );
        assert!(!system.directory().contains(id), "{id:?}: nothing defined");
        system.shutdown().await;
    }
    // Ids that hold a space or a star inside, or start with `@`, name one agent each.
    let system = AgentSystem::builder()
        .llm(Arc::new(llm.clone()))
        .agent(AgentSpec::new("two words"))
        .agent(AgentSpec::new("a*b"))
        .agent(AgentSpec::new("@critic"))
        .start()
        .unwrap();
    assert_eq!(system.ask("two words", "hi").await.unwrap().text, "ok");
    system.shutdown().await;
}
