//! How long an agent keeps what dedupes its delegations' results: tests that drive real
//! agents (the scripted model really calls `delegate_to_agent`) and send the delegator
//! a crafted late copy of a result, as a delegatee's delivery would bring it.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use troupe_core::{ActorId, CallContext};
use troupe_runtime::{MemoryStore, StateStore};

use crate::agent::agent_id;
use crate::inbox::{decode_reply, AgentCommand, EnqueueReply, InboxBody, InboxEntry, TaskState, TaskStatus};
use crate::{AgentSpec, AgentSystem, Budget, Role, ScriptRule, ScriptedLlm};

/// Long enough for every delivery and turn of the tests' delegations to be done.
const SETTLE: Duration = Duration::from_secs(20);

/// A coordinator that delegates every "plan" to an analyst, which answers "result-42"
/// (to "plan last", 5 s later).
fn coordinator_and_analyst(store: &Arc<MemoryStore>) -> AgentSystem {
    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("coordinator").on_user_containing("plan").call(
            "delegate_to_agent",
            json!({"agent_id": "analyst", "message": "crunch {input}", "timeout_ms": 60000}),
        ))
        .rule(ScriptRule::agent("coordinator").on_tool_result().reply("ok"))
        .rule(
            ScriptRule::agent("coordinator")
                .on_user_containing("you delegated is")
                .reply("thanks"),
        )
        .rule(
            ScriptRule::agent("analyst")
                .on_user_containing("plan last")
                .reply("result-last")
                .latency(Duration::from_secs(5)),
        )
        .rule(
            ScriptRule::agent("analyst")
                .on_user_containing("[task")
                .reply("result-42"),
        );
    AgentSystem::builder()
        .store(store.clone())
        .llm(Arc::new(llm))
        .agent(AgentSpec::new("coordinator"))
        .agent(AgentSpec::new("analyst"))
        .start()
        .expect("the system starts")
}

/// The coordinator's task records, by task id.
async fn task_records(store: &MemoryStore, coordinator: &ActorId) -> Vec<(String, TaskStatus)> {
    let records = store.scan(coordinator, "task/", None, 1_000).await.unwrap();
    records
        .into_iter()
        .map(|(key, bytes)| {
            let record = <TaskStatus as crate::inbox::Record>::decode(&key, &bytes).unwrap();
            (record.task_id.clone(), record)
        })
        .collect()
}

/// Goal: the record of a delegated task (`task/{id}`, which dedupes its result) is
/// deleted once it has been ended for [`crate::limits::AGENT_TASK_RECORD_KEPT_MS`], by
/// the agent's later delegation and result turns, at most
/// [`crate::limits::AGENT_TASK_RECORDS_PRUNED_PER_PASS`] a turn; a late copy of a
/// result whose record is gone is still a `Duplicate`, never shown to the model again.
/// Method: 20 delegations complete; virtual time passes the retention; one more
/// delegation deletes a pass of the old records and its result the rest, leaving only
/// its own record; then a crafted copy of the first task's result comes to the
/// coordinator.
#[tokio::test(start_paused = true)]
async fn ended_task_records_are_deleted_after_their_retention_and_a_late_result_is_still_a_duplicate() {
    let store = Arc::new(MemoryStore::new());
    let system = coordinator_and_analyst(&store);
    let coordinator = agent_id("coordinator").unwrap();
    let delegations = 20;
    for n in 0..delegations {
        assert_eq!(
            system.ask("coordinator", &format!("plan {n}")).await.unwrap().text,
            "ok"
        );
    }
    tokio::time::sleep(SETTLE).await;
    let ended = task_records(&store, &coordinator).await;
    assert_eq!(ended.len(), delegations);
    assert!(ended.iter().all(|(_, record)| record.state == TaskState::Completed));

    tokio::time::sleep(Duration::from_millis(crate::limits::AGENT_TASK_RECORD_KEPT_MS)).await;
    assert_eq!(system.ask("coordinator", "plan last").await.unwrap().text, "ok");
    // The delegation's turn deleted one pass of the ended records; its result (the
    // analyst takes 5 s) has not come yet.
    let pass = crate::limits::AGENT_TASK_RECORDS_PRUNED_PER_PASS;
    let after_one_pass = task_records(&store, &coordinator).await;
    assert_eq!(after_one_pass.len(), delegations - pass + 1, "one pass: {pass} records");
    tokio::time::sleep(SETTLE).await;
    let kept = task_records(&store, &coordinator).await;
    let kept_ids: Vec<&str> = kept.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(kept.len(), 1, "only the newest task's record is kept: {kept_ids:?}");
    assert!(ended.iter().all(|(id, _)| id != kept_ids[0]));
    assert_eq!(kept[0].1.state, TaskState::Completed);

    // A late copy of the first task's result, as the analyst's delivery would bring it.
    let (first, _) = &ended[0];
    let runtime = system.runtime();
    let copy = InboxEntry {
        msg_id: format!("analyst.late.{first}"),
        from: Some(agent_id("analyst").unwrap()),
        body: InboxBody::TaskUpdate {
            task_id: first.clone(),
            state: TaskState::Completed,
            text: "result-42 once more".to_string(),
        },
        context: CallContext::root(runtime.deadline_in(Duration::from_secs(30))),
        budget: Budget::UNLIMITED,
        pair: None,
    };
    let reply = runtime
        .invoke_within(
            &coordinator,
            AgentCommand::Enqueue(copy).encode(),
            Duration::from_secs(5),
        )
        .await
        .expect("the coordinator answers");
    assert_eq!(decode_reply::<EnqueueReply>(&reply).unwrap(), EnqueueReply::Duplicate);
    tokio::time::sleep(SETTLE).await;
    let log = system.conversation_log("coordinator").await.unwrap();
    let shown = |needle: &str| {
        log.iter()
            .filter(|message| message.role == Role::User && message.content.contains(needle))
            .count()
    };
    assert_eq!(shown("once more"), 0, "the late copy is not shown: {log:?}");
    assert_eq!(shown(&format!("[task {first} you delegated is completed]")), 1);
    assert!(
        task_records(&store, &coordinator).await.len() == 1,
        "the copy made no record"
    );
    system.shutdown().await;
}
