//! The agent layer on the hardened call path: abandoned calls cancel the callee's model
//! and tool work, calls during shutdown fail at once, removed agents stop, and a tool
//! sees its turn's identity read-only. Both builds; the real runtime and agents, only the
//! model is scripted (it really emits the tool calls).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use troupe_agent::{
    agent_id, AgentCallError, AgentEvent, AgentSpec, AgentSystem, CallRecorder, ScriptRule, ScriptedLlm, Tool,
    ToolError,
};
use troupe_core::{CallRefused, InvokeError};

const MS: Duration = Duration::from_millis(1);

/// A scripted model whose boss asks worker `message` through `call_agent`, then answers
/// with `reply` (a template that may use `{tool_result}`).
fn boss_asks_worker(message: &str, reply: &str) -> ScriptedLlm {
    ScriptedLlm::new()
        .rule(
            ScriptRule::agent("boss")
                .on_user_containing("")
                .call("call_agent", json!({"agent_id": "worker", "message": message})),
        )
        .rule(ScriptRule::agent("boss").on_tool_result().reply(reply))
}

/// A tool that sleeps `ms` and counts how often it started.
fn step_tool(started: &Arc<AtomicU32>, ms: u64) -> Tool {
    let started = Arc::clone(started);
    Tool::from_fn(
        "step",
        "does one slow step of work",
        json!({"type": "object"}),
        move |_context, _arguments| {
            let started = Arc::clone(&started);
            async move {
                started.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Ok("stepped".to_string())
            }
        },
    )
}

/// Goal: when the outside caller gives up, the whole call subtree stops at once: the
/// callee makes no further model or tool calls and neither agent commits anything.
/// (Before, the callee kept calling its model and tools until its own 30 s deadline.)
/// Method: boss asks worker through call_agent (default 30 s timeout); worker's model
/// calls a 100 ms tool step after step; the asker drops its request after 350 ms.
#[tokio::test(start_paused = true)]
async fn a_caller_that_gives_up_stops_its_callees_model_and_tool_calls_and_nothing_commits() {
    let steps = Arc::new(AtomicU32::new(0));
    let llm = boss_asks_worker("work", "{tool_result}")
        .rule(
            ScriptRule::agent("worker")
                .on_user_containing("")
                .call("step", json!({})),
        )
        .rule(ScriptRule::agent("worker").on_tool_result().call("step", json!({})));
    let system = AgentSystem::builder()
        .llm(Arc::new(llm.clone()))
        .agent(AgentSpec::new("boss"))
        .agent(AgentSpec::new("worker").max_steps(troupe_agent::limits::AGENT_TURN_STEPS_MAX))
        .tool(step_tool(&steps, 100))
        .start()
        .unwrap();
    let asked = tokio::time::timeout(350 * MS, system.ask("boss", "go")).await;
    assert!(asked.is_err(), "the asker gave up first");
    let requests_at_give_up = llm.requests_of("worker").len();
    let steps_at_give_up = steps.load(Ordering::SeqCst);
    assert!(
        requests_at_give_up >= 3,
        "the worker was busy: {requests_at_give_up} model calls"
    );
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(
        llm.requests_of("worker").len(),
        requests_at_give_up,
        "no model call after the caller gave up"
    );
    assert_eq!(
        steps.load(Ordering::SeqCst),
        steps_at_give_up,
        "no tool call after the caller gave up"
    );
    assert!(
        system.conversation_log("worker").await.unwrap().is_empty(),
        "the worker committed nothing"
    );
    assert!(
        system.conversation_log("boss").await.unwrap().is_empty(),
        "the boss committed nothing"
    );
    assert_eq!(system.runtime().counters().turns_abandoned, 2);
    system.shutdown().await;
}

/// Goal: a `call_agent` made by a running turn after `AgentSystem::shutdown` began fails
/// at once with a typed shutdown error that the model reads, and shutdown does not wait
/// for the call's timeout. Method: boss's model runs a 100 ms tool, then asks worker;
/// shutdown starts at 50 ms.
#[tokio::test(start_paused = true)]
async fn a_call_agent_made_after_shutdown_began_fails_at_once_and_the_model_reads_why() {
    let steps = Arc::new(AtomicU32::new(0));
    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("boss").on_user_containing("").call("step", json!({})))
        .rule(
            ScriptRule::agent("boss")
                .on_tool_result_containing("stepped")
                .call("call_agent", json!({"agent_id": "worker", "message": "help"})),
        )
        .rule(
            ScriptRule::agent("boss")
                .on_tool_result()
                .reply("boss saw: {tool_result}"),
        )
        .rule(ScriptRule::agent("worker").reply("helped"));
    let system = AgentSystem::builder()
        .llm(Arc::new(llm.clone()))
        .agent(AgentSpec::new("boss"))
        .agent(AgentSpec::new("worker"))
        .tool(step_tool(&steps, 100))
        .start()
        .unwrap();
    let client = system.client();
    let asked = tokio::spawn(async move { client.ask("boss", "go").await });
    tokio::time::sleep(50 * MS).await;
    let started = tokio::time::Instant::now();
    system.shutdown().await;
    let took = started.elapsed();
    let reply = asked.await.unwrap().unwrap();
    assert_eq!(
        reply.text,
        "boss saw: error: call_agent failed: call failed: the runtime has shut down"
    );
    assert!(
        took <= 60 * MS,
        "shutdown waited only for the boss's turn to finish: {took:?}"
    );
    assert!(llm.requests_of("worker").is_empty(), "the worker never ran");
}

/// Goal: removing an agent takes it out of the directory and deactivates its live
/// activation (on_deactivate runs, its conversation stays stored); later asks and
/// calls are refused with `AgentNotFound`.
#[tokio::test(start_paused = true)]
async fn a_removed_agent_is_deactivated_and_later_calls_to_it_are_refused() {
    let llm = boss_asks_worker("help", "boss saw: {tool_result}").rule(ScriptRule::agent("worker").reply("helped"));
    let recorder = CallRecorder::new();
    let system = AgentSystem::builder()
        .llm(Arc::new(llm))
        .observer(Arc::new(recorder.clone()))
        .agent(AgentSpec::new("boss"))
        .agent(AgentSpec::new("worker"))
        .start()
        .unwrap();
    assert_eq!(system.ask("worker", "hello").await.unwrap().text, "helped");
    let removed = system.remove_agent("worker").await.unwrap();
    assert_eq!(removed.map(|spec| spec.id), Some("worker".to_string()));
    let deactivated = recorder
        .events()
        .iter()
        .filter(|e| matches!(e, AgentEvent::Deactivated { agent, .. } if agent.key() == "worker"))
        .count();
    assert_eq!(deactivated, 1, "the live activation was deactivated");
    assert_eq!(
        system.conversation_log("worker").await.unwrap().len(),
        2,
        "its conversation is kept"
    );
    assert_eq!(
        system.ask("worker", "hello again").await,
        Err(AgentCallError::Refused(CallRefused::AgentNotFound {
            target: agent_id("worker").unwrap()
        }))
    );
    assert_eq!(
        system.ask("boss", "go").await.unwrap().text,
        "boss saw: error: call_agent failed: call refused: agent agent/worker not found"
    );
    assert_eq!(system.remove_agent("worker").await, Ok(None));
    system.shutdown().await;
}

/// Goal: a tool sees its turn's identity, depth and chain as the runtime set them (read
/// only), and a call to its own agent is refused at once as a cycle, not left to wait
/// out its timeout.
#[tokio::test(start_paused = true)]
async fn a_tool_sees_its_turn_read_only_and_a_call_to_its_own_agent_is_refused_at_once() {
    let probe = Tool::from_fn(
        "probe",
        "reports the context",
        json!({"type": "object"}),
        |context, _arguments| async move {
            let started = context.now();
            let own = context.agent_id().key().to_string();
            let result = troupe_agent::call_agent(&context, &own, "me?", Some(20_000)).await;
            let waited_us = context.now().as_micros() - started.as_micros();
            let refused = match result {
                Err(AgentCallError::Refused(CallRefused::CycleDetected { chain })) => chain
                    .iter()
                    .map(|id| id.key().to_string())
                    .collect::<Vec<_>>()
                    .join(">"),
                other => return Err(ToolError::failed("probe", format!("expected a cycle, got {other:?}"))),
            };
            Ok(format!(
                "{own} depth={} chain={} refused={refused} waited_us={waited_us}",
                context.call_depth(),
                context.call_chain().len()
            ))
        },
    );
    let llm = boss_asks_worker("probe", "{tool_result}")
        .rule(
            ScriptRule::agent("worker")
                .on_user_containing("")
                .call("probe", json!({})),
        )
        .rule(ScriptRule::agent("worker").on_tool_result().reply("{tool_result}"));
    let system = AgentSystem::builder()
        .llm(Arc::new(llm))
        .agent(AgentSpec::new("boss"))
        .agent(AgentSpec::new("worker"))
        .tool(probe)
        .start()
        .unwrap();
    assert_eq!(
        system.ask("boss", "go").await.unwrap().text,
        "worker depth=1 chain=1 refused=boss>worker>worker waited_us=0"
    );
    assert_eq!(
        system.runtime().counters().deadlocks_refused,
        0,
        "refused by admission, nothing was sent"
    );
    system.shutdown().await;
}

/// Goal: the typed error of a refused call survives the agent layer unchanged.
#[test]
fn a_refusal_inside_an_invoke_error_reads_as_the_refusal() {
    let error = InvokeError::Refused(CallRefused::ShuttingDown);
    assert_eq!(error.to_string(), "call refused: the runtime is shutting down");
}

/// Goal: a root invocation from inside a turn, through a handle the tool captured
/// (here an `AgentClient`), is refused at once: it would skip the chain, the wait-for
/// graph and the turn's deadline (before, a tool could ask its own agent this way and
/// hang until the ask's timeout). Method: a tool that holds the system's client asks its
/// own agent and another agent.
#[tokio::test(start_paused = true)]
async fn a_root_invoke_from_inside_a_turn_through_a_captured_handle_is_refused_at_once() {
    let client: Arc<std::sync::OnceLock<troupe_agent::AgentClient>> = Arc::default();
    let captured = Arc::clone(&client);
    let sneaky = Tool::from_fn(
        "sneaky",
        "asks agents around the caller handle",
        json!({"type": "object"}),
        move |context, _arguments| {
            let client = captured.get().expect("the client is set before any ask").clone();
            async move {
                let started = context.now();
                let own = client.ask("worker", "me?").await;
                let other = client.ask("boss", "you?").await;
                let waited_us = context.now().as_micros() - started.as_micros();
                let refused = |result: &Result<troupe_agent::AgentReply, AgentCallError>| {
                    matches!(
                        result,
                        Err(AgentCallError::Invoke(InvokeError::Refused(
                            CallRefused::RootInvokeInsideTurn
                        )))
                    )
                };
                Ok(format!(
                    "own refused={} other refused={} waited_us={waited_us}",
                    refused(&own),
                    refused(&other)
                ))
            }
        },
    );
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("worker")
                .on_user_containing("")
                .call("sneaky", json!({})),
        )
        .rule(ScriptRule::agent("worker").on_tool_result().reply("{tool_result}"))
        .rule(ScriptRule::agent("boss").reply("boss here"));
    let system = AgentSystem::builder()
        .llm(Arc::new(llm))
        .agent(AgentSpec::new("boss"))
        .agent(AgentSpec::new("worker"))
        .tool(sneaky)
        .start()
        .unwrap();
    client.set(system.client()).unwrap();
    assert_eq!(
        system.ask("worker", "go").await.unwrap().text,
        "own refused=true other refused=true waited_us=0"
    );
    assert_eq!(
        system.ask("boss", "hi").await.unwrap().text,
        "boss here",
        "outside a turn, asking works"
    );
    system.shutdown().await;
}
