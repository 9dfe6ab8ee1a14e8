//! Beyond the synchronous ask: a coordinator delegates a task to an analyst through the
//! built-in `delegate_to_agent` tool and answers at once; the analyst works it in its
//! own turn, and the result comes back to the coordinator as a new message (the
//! callback); then the program sends the analyst a fire-and-forget notification. Both
//! go through each agent's durable inbox. The model is the scripted one (no API key, no
//! network).
//!
//! Run it with `cargo run --example delegate_notify`. It prints each step.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::broadcast::error::RecvError;
use troupe::agent::{AgentEvent, AgentSpec, AgentSystem, Role, ScriptRule, ScriptedLlm};
use troupe::json;

/// How long the program waits for the delegated task and the notification, at most.
const WAIT_MS: u64 = 10_000;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let llm = ScriptedLlm::new()
        // The coordinator hands the work on and does not wait for it.
        .rule(ScriptRule::agent("coordinator").on_user_containing("plan").call(
            "delegate_to_agent",
            json!({"agent_id": "analyst", "message": "estimate the budget for: {input}"}),
        ))
        .rule(
            ScriptRule::agent("coordinator")
                .on_tool_result()
                .reply("on it: {tool_result}"),
        )
        // The callback: the task's result arrives as a message to the coordinator.
        .rule(
            ScriptRule::agent("coordinator")
                .on_user_containing("you delegated is completed")
                .reply("thanks, noted the estimate"),
        )
        .rule(
            ScriptRule::agent("analyst")
                .on_user_containing("[task")
                .reply("about 120k")
                .latency(Duration::from_millis(300)),
        )
        .rule(
            ScriptRule::agent("analyst")
                .on_user_containing("[notification")
                .reply("ok"),
        );
    let system = AgentSystem::builder()
        .llm(Arc::new(llm))
        .agent(AgentSpec::new("coordinator").role("plans the work"))
        .agent(AgentSpec::new("analyst").role("estimates costs"))
        .start()?;
    let mut events = system.subscribe();

    let reply = system.ask("coordinator", "plan the quarter").await?;
    println!("coordinator (at once): {}", reply.text);

    // Wait for the task to finish; the delegatee's answer is its result.
    let task_id = tokio::time::timeout(Duration::from_millis(WAIT_MS), async {
        loop {
            match events.recv().await {
                Ok(AgentEvent::DelegationFinished { task_id, state, .. }) => {
                    println!("task {task_id} finished: {state:?}");
                    return Ok(task_id);
                }
                Ok(_) | Err(RecvError::Lagged(_)) => {}
                Err(RecvError::Closed) => return Err("the agent system stopped"),
            }
        }
    })
    .await??;
    // The event comes from the turn that records the result, before its commit: the
    // task's committed record is read until it shows the end too.
    let task = tokio::time::timeout(Duration::from_millis(WAIT_MS), async {
        loop {
            match system.task("coordinator", &task_id).await? {
                Some(task) if task.state.is_final() => return Ok::<_, troupe::runtime::StoreError>(task),
                _ => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    })
    .await??;
    println!(
        "task {task_id}: {:?}, result: {}",
        task.state,
        task.result.as_deref().unwrap_or("(none)")
    );

    // Fire-and-forget: `notify` returns once the message is in the analyst's inbox.
    let msg_id = system.notify("analyst", "the budget review moved to Friday").await?;
    println!("notification accepted as {msg_id}");

    // Both inboxes drain on their own (the coordinator's callback turn, the analyst's
    // notification turn); wait until nothing is left, then read the logs.
    tokio::time::timeout(Duration::from_millis(WAIT_MS), async {
        while system.pending("coordinator").await? != (0, 0) || system.pending("analyst").await? != (0, 0) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok::<_, troupe::runtime::StoreError>(())
    })
    .await??;
    for agent in ["coordinator", "analyst"] {
        for message in system.conversation_log(agent).await? {
            if matches!(message.role, Role::User | Role::Assistant) && !message.content.is_empty() {
                println!("{agent} log, {:?}: {}", message.role, message.content);
            }
        }
    }
    system.shutdown().await;
    Ok(())
}
