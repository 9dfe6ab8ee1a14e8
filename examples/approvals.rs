//! Human approval of an agent's call, without holding its turn: an intern agent in
//! `supervised` mode (every contact it starts needs approval) whose `call_agent` calls
//! are sent as tasks while they wait (`CallApproval::Delegate`). Its question waits in
//! its outbox, durably, until a person approves it through the API; then the analyst
//! answers, and the answer comes back to the intern as the task's result. The scripted
//! model (deterministic, no API key, no network) stands in for a real one.
//!
//! Run it with `cargo run --example approvals`. It prints each step.

use std::sync::Arc;
use std::time::Duration;

use troupe::agent::{
    AgentEvent, AgentSpec, AgentSystem, BehaviourMode, CallApproval, Membership, ScriptRule, ScriptedLlm, TaskState,
};
use troupe::json;

/// How long the example waits for the answer to come back before it gives up.
const ANSWER_WAIT_MS_MAX: u64 = 10_000;
/// How often it looks.
const POLL_MS: u64 = 10;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("intern")
                .on_user_containing("you delegated is")
                .reply("noted: {input}"),
        )
        .rule(ScriptRule::agent("intern").on_user_containing("").call(
            "call_agent",
            json!({"agent_id": "analyst", "message": "Is our Q3 churn estimate of 4% plausible?"}),
        ))
        .rule(ScriptRule::agent("intern").on_tool_result().reply("{tool_result}"))
        .rule(ScriptRule::agent("analyst").reply("Plausible: Q1 and Q2 were 3.8% and 4.1%."));
    let system = AgentSystem::builder()
        .llm(Arc::new(llm))
        .agent(
            AgentSpec::new("intern")
                .role("checks numbers")
                .call_approval(CallApproval::Delegate),
        )
        .agent(AgentSpec::new("analyst").role("knows the history"))
        .start()?;
    let supervised = Membership {
        manager: None,
        mode: BehaviourMode::Supervised,
    };
    system.set_membership("intern", supervised).await?;

    // The intern's turn ends at once: its question waits for approval as a task. The
    // approval is listed for a person once that turn has committed and the task waits
    // in the outbox, reported as an `ApprovalRequested` event (what a UI listens to).
    let mut events = system.subscribe();
    let reply = system.ask("intern", "Check the churn estimate.").await?;
    println!("intern: {}", reply.text);
    let listed = tokio::time::timeout(Duration::from_millis(ANSWER_WAIT_MS_MAX), async {
        loop {
            match events.recv().await {
                Ok(AgentEvent::ApprovalRequested { id, .. }) => return Ok(id),
                Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(closed) => return Err(closed),
            }
        }
    })
    .await
    .map_err(|_| format!("no approval was listed within {ANSWER_WAIT_MS_MAX} ms"))??;
    println!("approval {listed} requested");
    let pending = system.pending_approvals().await?;
    let [approval] = pending.as_slice() else {
        return Err(format!("expected one pending approval, found {pending:?}").into());
    };
    println!(
        "pending approval {}: {} -> {} ({:?}): {:?}",
        approval.id, approval.from, approval.to, approval.kind, approval.message
    );

    // A person approves it (over REST: POST /v1/approvals/{id}/approve).
    system.approve(approval.id).await?;
    println!("approved {}", approval.id);

    // The analyst answers; the answer comes back to the intern as the task's result.
    let mut waited = 0;
    let task = loop {
        match system.task("intern", "intern.0").await? {
            Some(task) if task.state.is_final() => break task,
            _ if waited >= ANSWER_WAIT_MS_MAX => return Err("no answer came back in time".into()),
            _ => {
                tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
                waited += POLL_MS;
            }
        }
    };
    if task.state != TaskState::Completed {
        return Err(format!("the task ended {:?}: {:?}", task.state, task.result).into());
    }
    println!("task intern.0 completed: {}", task.result.unwrap_or_default());
    // The intern's model reads the result in a turn of its own.
    loop {
        let log = system.conversation_log("intern").await?;
        if let Some(noted) = log.iter().rev().find(|message| message.content.starts_with("noted:")) {
            println!("intern: {}", noted.content);
            break;
        }
        if waited >= ANSWER_WAIT_MS_MAX {
            return Err("the intern never read the result".into());
        }
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        waited += POLL_MS;
    }
    system.shutdown().await;
    Ok(())
}
