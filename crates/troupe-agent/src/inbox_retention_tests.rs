//! How long an agent keeps what dedupes its delegations' results: tests that drive real
//! agents (the scripted model really calls `delegate_to_agent`) and send the delegator
//! a crafted late copy of a result, as a delegatee's delivery would bring it.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use troupe_core::{ActorId, CallContext, Deadline};
use troupe_runtime::{MemoryStore, StateStore};

use crate::agent::agent_id;
use crate::inbox::{decode_reply, AgentCommand, EnqueueReply, InboxBody, InboxEntry, TaskState, TaskStatus};
use crate::{AgentSpec, AgentSystem, Budget, InboxError, Role, ScriptRule, ScriptedLlm};

/// Long enough for every delivery and turn of the tests' delegations to be done.
const SETTLE: Duration = Duration::from_secs(20);

/// A coordinator that delegates every "plan" to an analyst, which answers "result-42"
/// (to "plan last", 5 s later). Used by the normal build's test only.
#[cfg(not(madsim))]
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
/// Sends `coordinator` a copy of task `task_id`'s result from `from`, as that agent's
/// delivery would bring it late, and gives the coordinator's answer.
async fn send_late_result(
    system: &AgentSystem,
    coordinator: &ActorId,
    from: &str,
    msg_id: &str,
    task_id: &str,
    text: &str,
) -> EnqueueReply {
    let runtime = system.runtime();
    let copy = InboxEntry {
        msg_id: msg_id.to_string(),
        from: Some(agent_id(from).unwrap()),
        body: InboxBody::TaskUpdate {
            task_id: task_id.to_string(),
            state: TaskState::Completed,
            text: text.to_string(),
        },
        context: CallContext::root(runtime.deadline_in(Duration::from_secs(30))),
        budget: Budget::UNLIMITED,
        pair: None,
    };
    let reply = runtime
        .invoke_within(
            coordinator,
            AgentCommand::Enqueue(copy).encode(),
            Duration::from_secs(5),
        )
        .await
        .expect("the coordinator answers");
    decode_reply::<EnqueueReply>(&reply).unwrap()
}

/// How many user messages of `log` contain `needle`.
fn user_messages_containing(log: &[crate::ChatMessage], needle: &str) -> usize {
    log.iter()
        .filter(|message| message.role == Role::User && message.content.contains(needle))
        .count()
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
///
/// Normal build only (tokio's paused clock): it passes an hour of virtual time, and the
/// simulator's sweep (`scripts/dst`) stops any seed at 600 virtual seconds as a hang.
#[cfg(not(madsim))]
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
    let reply = send_late_result(
        &system,
        &coordinator,
        "analyst",
        &format!("analyst.late.{first}"),
        first,
        "result-42 once more",
    )
    .await;
    assert_eq!(reply, EnqueueReply::Duplicate);
    tokio::time::sleep(SETTLE).await;
    let log = system.conversation_log("coordinator").await.unwrap();
    let shown = |needle: &str| user_messages_containing(&log, needle);
    assert_eq!(shown("once more"), 0, "the late copy is not shown: {log:?}");
    assert_eq!(shown(&format!("[task {first} you delegated is completed]")), 1);
    assert!(
        task_records(&store, &coordinator).await.len() == 1,
        "the copy made no record"
    );
    system.shutdown().await;
}

/// The delegatees of [`coordinator_workers_and_reviewer`].
fn worker(n: u64) -> String {
    format!("worker-{n}")
}

/// A coordinator whose model delegates "plan" to `worker-0` and "review" to a reviewer
/// (which answers at once), and [`crate::limits::AGENT_TASKS_OPEN_MAX`] workers, whose
/// model takes 30 s of a task's 60.
fn coordinator_workers_and_reviewer(store: &Arc<MemoryStore>, recorder: &crate::CallRecorder) -> AgentSystem {
    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("coordinator").on_user_containing("plan").call(
            "delegate_to_agent",
            json!({"agent_id": "worker-0", "message": "crunch {input}", "timeout_ms": 60000}),
        ))
        .rule(ScriptRule::agent("coordinator").on_user_containing("review").call(
            "delegate_to_agent",
            json!({"agent_id": "reviewer", "message": "check {input}", "timeout_ms": 60000}),
        ))
        .rule(
            ScriptRule::agent("coordinator")
                .on_user_containing("you delegated is")
                .reply("thanks"),
        )
        .rule(
            ScriptRule::agent("coordinator")
                .on_tool_result()
                .reply("sent: {tool_result}"),
        )
        .rule(ScriptRule::agent("reviewer").on_user_containing("[task").reply("fine"))
        .rule(
            ScriptRule::any_agent()
                .on_user_containing("[task")
                .reply("result-42")
                .latency(Duration::from_secs(30)),
        );
    let mut builder = AgentSystem::builder()
        .store(store.clone())
        .llm(Arc::new(llm))
        .observer(Arc::new(recorder.clone()))
        .agent(AgentSpec::new("coordinator"))
        .agent(AgentSpec::new("reviewer"));
    for n in 0..crate::limits::AGENT_TASKS_OPEN_MAX {
        builder = builder.agent(AgentSpec::new(worker(n)));
    }
    builder.start().expect("the system starts")
}

/// Goal: a task whose delegatee accepted it and then never answers (here the delegatee
/// loses it while it works, so no result ever comes) does not stay open at
/// its delegator for good: once its deadline and
/// [`crate::limits::AGENT_TASK_RESULT_GRACE_MS`] have passed, the delegator's next turn
/// resolves it `failed` ("no result by the task's deadline ..."), with one
/// `DelegationFinished`, and counts its slot back, so an agent whose
/// [`crate::limits::AGENT_TASKS_OPEN_MAX`] slots were all held by such tasks delegates
/// again; a result that comes after that is a `Duplicate`, never shown to the model.
/// Method: the coordinator delegates a task to each worker (the first by its model, the
/// rest by the API), all its slots; each worker accepts its task and loses it while
/// working on it; one more delegation is refused; virtual time passes the deadline and
/// the grace; one more delegation (to a reviewer) is accepted and completes; then a
/// crafted copy of the first task's result comes to the coordinator.
#[tokio::test(start_paused = true)]
async fn a_task_whose_delegatee_never_answers_fails_after_its_deadline_and_frees_its_slot() {
    use crate::limits::{AGENT_TASKS_OPEN_MAX, AGENT_TASK_RESULT_GRACE_MS};
    let store = Arc::new(MemoryStore::new());
    let recorder = crate::CallRecorder::new();
    let system = coordinator_workers_and_reviewer(&store, &recorder);
    let coordinator = agent_id("coordinator").unwrap();
    let reply = system.ask("coordinator", "plan 0").await.unwrap().text;
    assert!(reply.starts_with("sent: "), "the model delegated: {reply}");
    for n in 1..AGENT_TASKS_OPEN_MAX {
        let text = format!("plan {n}");
        let delegated = system.delegate("coordinator", &worker(n), &text, Some(60_000)).await;
        delegated.expect("a slot is free");
    }
    // Every worker has accepted its task and works on it; each goes away meanwhile.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(system.pending("coordinator").await.unwrap(), (0, 0), "all acknowledged");
    for n in 0..AGENT_TASKS_OPEN_MAX {
        lose_the_task_of(&store, n).await;
    }
    let full = system
        .delegate("coordinator", "reviewer", "review early", Some(60_000))
        .await;
    let limit = AGENT_TASKS_OPEN_MAX;
    assert_eq!(
        full,
        Err(InboxError::OutboxFull {
            agent: coordinator.clone(),
            limit
        })
    );
    // Within the grace, nothing is resolved.
    tokio::time::sleep(Duration::from_millis(60_000)).await;
    let refused = system.delegate("coordinator", "reviewer", "review", Some(60_000)).await;
    assert_eq!(
        refused,
        Err(InboxError::OutboxFull {
            agent: coordinator.clone(),
            limit
        })
    );

    tokio::time::sleep(Duration::from_millis(AGENT_TASK_RESULT_GRACE_MS)).await;
    let task = system
        .delegate("coordinator", "reviewer", "review late", Some(60_000))
        .await
        .expect("the overdue tasks' slots are free again");
    tokio::time::sleep(SETTLE).await;
    let records = task_records(&store, &coordinator).await;
    let (to_workers, to_reviewer): (Vec<_>, Vec<_>) = records.iter().partition(|(id, _)| *id != task);
    assert_eq!(to_reviewer.len(), 1);
    assert_eq!(to_reviewer[0].1.state, TaskState::Completed);
    assert_eq!(to_workers.len() as u64, AGENT_TASKS_OPEN_MAX);
    for (id, record) in &to_workers {
        assert_eq!(record.state, TaskState::Failed, "{id}: {record:?}");
        let result = record.result.as_deref().unwrap_or_default();
        assert!(result.starts_with("no result by the task's deadline"), "{id}: {result}");
    }
    let finished: Vec<(String, TaskState)> = recorder
        .events()
        .into_iter()
        .filter_map(|event| match event {
            crate::AgentEvent::DelegationFinished { task_id, state, .. } => Some((task_id, state)),
            _ => None,
        })
        .collect();
    assert_eq!(
        finished.len() as u64,
        AGENT_TASKS_OPEN_MAX + 1,
        "one end each: {finished:?}"
    );
    let failed = finished.iter().filter(|(_, state)| *state == TaskState::Failed);
    assert_eq!(failed.count() as u64, AGENT_TASKS_OPEN_MAX);

    // A late copy of the first task's result, as its worker's delivery would bring it.
    let first = "coordinator.0".to_string();
    let reply = send_late_result(
        &system,
        &coordinator,
        "worker-0",
        "worker-0.late",
        &first,
        "result-42 after all",
    )
    .await;
    assert_eq!(reply, EnqueueReply::Duplicate);
    tokio::time::sleep(SETTLE).await;
    let log = system.conversation_log("coordinator").await.unwrap();
    let shown = |needle: &str| user_messages_containing(&log, needle);
    assert_eq!(shown("after all"), 0, "the late copy is not shown: {log:?}");
    assert_eq!(shown(&format!("[task {first} you delegated is failed] no result")), 1);
    assert_eq!(
        system.task("coordinator", &first).await.unwrap().unwrap().state,
        TaskState::Failed
    );
    system.shutdown().await;
}

/// Deletes worker `n`'s inbox entry of the task it is working from `store` (which
/// fences its activation off, so the turn working it cannot commit): the task is lost
/// with nobody to answer it. (A removed worker no longer strands its tasks: its boxes
/// are drained, `tests/removed_agent_drain.rs`.)
async fn lose_the_task_of(store: &MemoryStore, n: u64) {
    let worker = agent_id(&worker(n)).unwrap();
    let lost = delete_as_stored(store, &worker, &["inbox/", "tasks_in/"]).await;
    assert_eq!(lost, 2, "the task's entry and its tasks_in/ key");
}

/// Delegates "plan alone" (by the API) from the coordinator to worker 0 with a 60 s
/// timeout, waits for its acknowledgement and loses it at the worker
/// ([`lose_the_task_of`]): the task stays open with nobody to answer it. Its id.
async fn delegate_to_a_lost_worker(system: &AgentSystem, store: &MemoryStore) -> String {
    let task = system
        .delegate("coordinator", &worker(0), "plan alone", Some(60_000))
        .await
        .expect("delegated");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(system.pending("coordinator").await.unwrap(), (0, 0), "acknowledged");
    lose_the_task_of(store, 0).await;
    task
}

/// A new system of `agents` on `store` (what an earlier system left), on `llm`: the
/// restart of a process.
fn restarted(store: &Arc<MemoryStore>, llm: ScriptedLlm, agents: &[&str]) -> AgentSystem {
    let mut builder = AgentSystem::builder().store(store.clone()).llm(Arc::new(llm));
    for agent in agents {
        builder = builder.agent(AgentSpec::new(*agent));
    }
    builder.start().expect("the system starts")
}

/// The coordinator alone, restarted on `store`, thanking for whatever it is told of a
/// task it delegated (the failure of an overdue one).
fn restarted_coordinator(store: &Arc<MemoryStore>) -> AgentSystem {
    let llm = ScriptedLlm::new().rule(
        ScriptRule::agent("coordinator")
            .on_user_containing("you delegated is")
            .reply("thanks"),
    );
    restarted(store, llm, &["coordinator"])
}

/// Goal: a task whose delegatee accepted it and then never answers is resolved `failed`
/// at its due time (its deadline plus [`crate::limits::AGENT_TASK_RESULT_GRACE_MS`])
/// with nothing more sent to its delegator: the delegation armed the delegator's
/// wake-up for that time. Before, it was resolved only by the delegator's next command,
/// and `AgentClient::task` said `submitted` for as long as none came. Method: the
/// coordinator delegates (by the API) a task to a worker, which accepts it and loses
/// it while working on it; nothing else is sent; the task is read just before its
/// due time and after it.
#[tokio::test(start_paused = true)]
async fn an_overdue_task_is_resolved_at_its_due_time_with_no_other_turn_of_its_delegator() {
    use crate::limits::AGENT_TASK_RESULT_GRACE_MS;
    let store = Arc::new(MemoryStore::new());
    let recorder = crate::CallRecorder::new();
    let system = coordinator_workers_and_reviewer(&store, &recorder);
    let task = delegate_to_a_lost_worker(&system, &store).await;
    let due = system.task("coordinator", &task).await.unwrap().expect("kept").deadline;
    let due = Duration::from_micros(due.as_micros()) + Duration::from_millis(AGENT_TASK_RESULT_GRACE_MS);
    let now = Duration::from_micros(system.runtime().now().as_micros());
    tokio::time::sleep(due - now - Duration::from_secs(1)).await;
    let record = system.task("coordinator", &task).await.unwrap().expect("kept");
    assert_eq!(record.state, TaskState::Submitted, "not due yet: {record:?}");

    tokio::time::sleep(Duration::from_secs(2)).await;
    let record = system.task("coordinator", &task).await.unwrap().expect("kept");
    assert_eq!(record.state, TaskState::Failed, "resolved at its due time: {record:?}");
    let result = record.result.unwrap_or_default();
    assert!(result.starts_with("no result by the task's deadline"), "{result}");
    let failed = recorder
        .events()
        .into_iter()
        .filter(|event| {
            matches!(event, crate::AgentEvent::DelegationFinished { task_id, state: TaskState::Failed, .. }
                if *task_id == task)
        })
        .count();
    assert_eq!(failed, 1, "one end");
    system.shutdown().await;
}

/// Goal: after a restart, an agent whose delegated task stays open (its delegatee never
/// answers) and that has nothing else pending still has it resolved `failed` at its due
/// time with nothing sent to it: the new system arms the agent's wake-up from its
/// earliest `task_due/` key when it starts. Before, the wake-up armed by the delegation
/// was lost with the process, and the task stayed `submitted` until the agent's next
/// command. Method: the coordinator delegates a task to a worker, which accepts it and
/// loses it while working on it; the system stops; a new system (no worker) starts on
/// the same store; nothing is sent; the task is read past its due time.
#[tokio::test(start_paused = true)]
async fn an_overdue_task_left_open_by_a_restart_is_resolved_at_its_due_time() {
    use crate::limits::AGENT_TASK_RESULT_GRACE_MS;
    let store = Arc::new(MemoryStore::new());
    let system = coordinator_workers_and_reviewer(&store, &crate::CallRecorder::new());
    let task = delegate_to_a_lost_worker(&system, &store).await;
    system.shutdown().await;

    let system = restarted_coordinator(&store);
    // Past the task's deadline and grace on the new system's clock.
    let deadline = system.task("coordinator", &task).await.unwrap().expect("kept").deadline;
    let due = Deadline::after(deadline, Duration::from_millis(AGENT_TASK_RESULT_GRACE_MS));
    tokio::time::sleep(due.remaining(system.runtime().now()) + Duration::from_secs(1)).await;
    let record = system.task("coordinator", &task).await.unwrap().expect("kept");
    assert_eq!(record.state, TaskState::Failed, "resolved at its due time: {record:?}");
    let result = record.result.unwrap_or_default();
    assert!(result.starts_with("no result by the task's deadline"), "{result}");
    system.shutdown().await;
}

/// Goal: a delegated task's due time means the same instant to the process that reads it
/// after a restart as to the one that stored it: the task is resolved at its due time,
/// however long the first process had run. Before 2026-12-06 each runtime's clock counted
/// from the runtime's start, so the restarted process read the due time late by the first
/// runtime's age at the delegation (300 s here): the task was still `submitted` a second
/// after its due time. Method: the first system runs 300 s, then the coordinator delegates
/// to a worker that accepts and loses it; the due time is taken as an instant on the
/// simulator's clock; the system stops and a new one starts on the same store; the task
/// is read a second before that instant and a second after it.
///
/// Simulator only: its wall clock is virtual and goes on across the restart, as a real
/// one does. Tokio's paused clock (the normal build's tests) pauses the monotonic clock
/// but not the wall clock, so there a restarted clock is anchored at the real time,
/// behind the virtual time passed.
#[cfg(madsim)]
#[tokio::test]
async fn a_due_time_stored_before_a_restart_keeps_its_real_time() {
    use crate::limits::AGENT_TASK_RESULT_GRACE_MS;
    let store = Arc::new(MemoryStore::new());
    let system = coordinator_workers_and_reviewer(&store, &crate::CallRecorder::new());
    tokio::time::sleep(Duration::from_secs(300)).await;
    let task = delegate_to_a_lost_worker(&system, &store).await;
    let deadline = system.task("coordinator", &task).await.unwrap().expect("kept").deadline;
    let due = Deadline::after(deadline, Duration::from_millis(AGENT_TASK_RESULT_GRACE_MS));
    let due_at = tokio::time::Instant::now() + due.remaining(system.runtime().now());
    system.shutdown().await;

    let system = restarted_coordinator(&store);
    tokio::time::sleep_until(due_at - Duration::from_secs(1)).await;
    let record = system.task("coordinator", &task).await.unwrap().expect("kept");
    assert_eq!(record.state, TaskState::Submitted, "not due yet: {record:?}");
    tokio::time::sleep_until(due_at + Duration::from_secs(1)).await;
    let record = system.task("coordinator", &task).await.unwrap().expect("kept");
    assert_eq!(
        record.state,
        TaskState::Failed,
        "resolved at its due time, a second ago: {record:?}"
    );
    system.shutdown().await;
}

/// Deletes from `agent`'s key space every key under `prefixes`, as one commit, and gives
/// how many went: the store as a version before those keys would have left it.
async fn delete_as_stored(store: &MemoryStore, agent: &ActorId, prefixes: &[&str]) -> usize {
    let mut writes = Vec::new();
    for prefix in prefixes {
        for (key, _) in store.scan(agent, prefix, None, 1_000).await.unwrap() {
            writes.push((key, None));
        }
    }
    let deleted = writes.len();
    let claimed = store.claim(agent).await.unwrap();
    let commit = troupe_runtime::TurnCommit {
        state: troupe_runtime::StateChange::Unchanged,
        writes,
    };
    store.commit(agent, claimed.fence, commit).await.unwrap();
    deleted
}

/// Goal: task records stored before the `task_end/` and `task_due/` indexes (an agent
/// upgraded from a version before 3cd28b6 and acfd711) get their index keys once the
/// agent runs again, so an old open task whose delegatee never answers is resolved
/// failed after its deadline and [`crate::limits::AGENT_TASK_RESULT_GRACE_MS`], and an
/// old ended record is deleted after [`crate::limits::AGENT_TASK_RECORD_KEPT_MS`].
/// Method: the coordinator delegates a task that completes and one whose worker loses
/// it while working; the system stops and the index keys (and the index marker)
/// are deleted from the store, as the old version left it; a new system on that store
/// passes the deadline and grace and delegates (its turn indexes the old records and
/// resolves the overdue one); then it passes the retention and delegates again.
///
/// Normal build only (tokio's paused clock): it passes an hour of virtual time, and the
/// simulator's sweep (`scripts/dst`) stops any seed at 600 virtual seconds as a hang.
#[cfg(not(madsim))]
#[tokio::test(start_paused = true)]
async fn task_records_from_before_the_indexes_are_indexed_then_resolved_and_deleted() {
    use crate::limits::{AGENT_TASK_RECORD_KEPT_MS, AGENT_TASK_RESULT_GRACE_MS};
    let store = Arc::new(MemoryStore::new());
    let coordinator = agent_id("coordinator").unwrap();
    let system = coordinator_workers_and_reviewer(&store, &crate::CallRecorder::new());
    let reviewed = system
        .delegate("coordinator", "reviewer", "review first", Some(60_000))
        .await
        .expect("delegated");
    tokio::time::sleep(SETTLE).await;
    let abandoned = system
        .delegate("coordinator", &worker(0), "plan 0", Some(60_000))
        .await
        .expect("delegated");
    tokio::time::sleep(Duration::from_secs(1)).await;
    lose_the_task_of(&store, 0).await;
    system.shutdown().await;
    for prefix in ["task_end/", "task_due/"] {
        let deleted = delete_as_stored(&store, &coordinator, &[prefix]).await;
        assert_eq!(deleted, 1, "the one {prefix} key");
    }
    delete_as_stored(&store, &coordinator, &[crate::inbox::TASK_INDEX_VERSION_KEY]).await;

    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("reviewer").on_user_containing("[task").reply("fine"))
        .rule(
            ScriptRule::agent("coordinator")
                .on_user_containing("you delegated is")
                .reply("thanks"),
        );
    let system = restarted(&store, llm, &["coordinator", "reviewer"]);
    // Past the old task's deadline and grace on the new system's clock.
    let deadline = system
        .task("coordinator", &abandoned)
        .await
        .unwrap()
        .expect("kept")
        .deadline;
    let overdue = Deadline::after(deadline, Duration::from_millis(AGENT_TASK_RESULT_GRACE_MS));
    tokio::time::sleep(overdue.remaining(system.runtime().now()) + SETTLE).await;
    system
        .delegate("coordinator", "reviewer", "review late", Some(60_000))
        .await
        .expect("delegated");
    tokio::time::sleep(SETTLE).await;
    let record = system.task("coordinator", &abandoned).await.unwrap().expect("kept");
    assert_eq!(
        record.state,
        TaskState::Failed,
        "the old open task is resolved: {record:?}"
    );
    let result = record.result.unwrap_or_default();
    assert!(result.starts_with("no result by the task's deadline"), "{result}");
    assert!(
        system.task("coordinator", &reviewed).await.unwrap().is_some(),
        "the old ended record is kept for its retention"
    );

    tokio::time::sleep(Duration::from_millis(AGENT_TASK_RECORD_KEPT_MS)).await;
    let last = system
        .delegate("coordinator", "reviewer", "review last", Some(60_000))
        .await
        .expect("delegated");
    tokio::time::sleep(SETTLE).await;
    let kept: Vec<String> = task_records(&store, &coordinator)
        .await
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    assert_eq!(kept, [last], "only the newest task's record is kept");
    system.shutdown().await;
}

/// A system of one coordinator that answers "hi" to anything, on `store`.
fn coordinator_alone(store: &Arc<MemoryStore>) -> AgentSystem {
    let llm = ScriptedLlm::new().rule(ScriptRule::agent("coordinator").on_user_containing("").reply("hi"));
    AgentSystem::builder()
        .store(store.clone())
        .llm(Arc::new(llm))
        .agent(AgentSpec::new("coordinator"))
        .start()
        .expect("the system starts")
}

/// The number of `agent`'s keys under `prefix`.
async fn keys_under(store: &MemoryStore, agent: &ActorId, prefix: &str) -> usize {
    store.scan(agent, prefix, None, 10_000).await.unwrap().len()
}

/// Goal: an agent with no task record and no `task_index_version` marker looks for
/// records to index once ever, not once per activation: its first turn finds none and
/// writes the marker with its commit, so a later activation reads the marker and scans
/// nothing. Before, nothing was written and every activation scanned `task/` again (one
/// empty scan each). Method: a fresh agent is asked once; the marker is read from the
/// store; the system stops and a new one asks it again, and the marker is still the
/// only task key.
#[tokio::test(start_paused = true)]
async fn an_agent_with_no_task_record_marks_its_task_index_at_its_first_turn() {
    use crate::inbox::{TASK_INDEX_VERSION, TASK_INDEX_VERSION_KEY};
    let store = Arc::new(MemoryStore::new());
    let coordinator = agent_id("coordinator").unwrap();
    let system = coordinator_alone(&store);
    assert_eq!(system.ask("coordinator", "one").await.unwrap().text, "hi");
    assert_eq!(keys_under(&store, &coordinator, "task/").await, 0, "no record");
    let marker = store.get(&coordinator, TASK_INDEX_VERSION_KEY).await.unwrap();
    assert_eq!(
        marker.as_deref(),
        Some(TASK_INDEX_VERSION),
        "marked with the first turn"
    );
    system.shutdown().await;

    let system = coordinator_alone(&store);
    assert_eq!(system.ask("coordinator", "two").await.unwrap().text, "hi");
    assert_eq!(keys_under(&store, &coordinator, TASK_INDEX_VERSION_KEY).await, 1);
    system.shutdown().await;
}

/// Goal: the indexing of task records from before the indexes goes
/// [`crate::limits::AGENT_TASK_INDEX_MIGRATED_PER_TURN`] records a turn, and a new
/// activation (as after a crash) resumes after the last committed page: every record
/// gets exactly one index key (a page done again would give its ended records a second
/// `task_end/` key, at another time), then the marker, and the cursor goes. Method:
/// 2 × the page + 5 records, every other one ended, are written into the store as the
/// old version left them; one turn; the system stops and a new one runs two more turns.
#[tokio::test(start_paused = true)]
async fn task_index_migration_goes_a_page_a_turn_and_resumes_after_the_last_committed_page() {
    use crate::inbox::{Record, TASK_INDEX_CURSOR_KEY, TASK_INDEX_VERSION_KEY};
    use crate::limits::AGENT_TASK_INDEX_MIGRATED_PER_TURN as PAGE;
    let store = Arc::new(MemoryStore::new());
    let coordinator = agent_id("coordinator").unwrap();
    let records = 2 * PAGE + 5;
    // An hour from now (on a clock anchored as the system's will be): no open task is
    // overdue during the test.
    let deadline = troupe_runtime::Clock::new().deadline_in(Duration::from_secs(3_600));
    let writes = (0..records)
        .map(|n| {
            let task_id = format!("coordinator.{n:04}");
            let ended = n % 2 == 0;
            let record = TaskStatus {
                task_id: task_id.clone(),
                to: agent_id("gone").unwrap(),
                state: if ended {
                    TaskState::Completed
                } else {
                    TaskState::Submitted
                },
                result: ended.then(|| "done".to_string()),
                deadline,
                context: CallContext::root(deadline),
            };
            (format!("task/{task_id}"), Some(record.encode().unwrap()))
        })
        .collect();
    let claimed = store.claim(&coordinator).await.unwrap();
    let commit = troupe_runtime::TurnCommit {
        state: troupe_runtime::StateChange::Unchanged,
        writes,
    };
    store.commit(&coordinator, claimed.fence, commit).await.unwrap();
    let indexed = |store: Arc<MemoryStore>, coordinator: ActorId| async move {
        keys_under(&store, &coordinator, "task_end/").await + keys_under(&store, &coordinator, "task_due/").await
    };

    let system = coordinator_alone(&store);
    assert_eq!(system.ask("coordinator", "one").await.unwrap().text, "hi");
    assert_eq!(
        indexed(store.clone(), coordinator.clone()).await,
        PAGE,
        "one page a turn"
    );
    assert_eq!(keys_under(&store, &coordinator, TASK_INDEX_CURSOR_KEY).await, 1);
    system.shutdown().await;

    let system = coordinator_alone(&store);
    tokio::time::sleep(Duration::from_secs(1)).await;
    for text in ["two", "three"] {
        assert_eq!(system.ask("coordinator", text).await.unwrap().text, "hi");
    }
    assert_eq!(
        keys_under(&store, &coordinator, "task_end/").await,
        records.div_ceil(2),
        "one task_end/ key per ended record"
    );
    assert_eq!(keys_under(&store, &coordinator, "task_due/").await, records / 2);
    assert_eq!(
        keys_under(&store, &coordinator, TASK_INDEX_VERSION_KEY).await,
        1,
        "done"
    );
    assert_eq!(keys_under(&store, &coordinator, TASK_INDEX_CURSOR_KEY).await, 0);
    system.shutdown().await;
}

/// Goal: the overdue wake-up's bookkeeping (`arm_overdue_wake`, `disarm_overdue_wake`)
/// holds on the multi-thread runtime, where turns on several workers arm and disarm at
/// once: many concurrent arms of one agent leave one armed wake-up, at the earliest due
/// armed, which tells the agent at that time (it is activated) and is then gone; an
/// agent whose every arm was followed by a disarm is never told; no entry is left.
/// Method: 2 workers, a fresh system (nothing active); 8 tasks arm `coordinator` 100
/// times each for dues 2.00-2.04 s away, while 8 others each arm `reviewer` and then
/// disarm it, 100 times; the armed due is read, then the dispatcher's activations and
/// the map 2.5 s later (real time: the paused clock needs a current_thread runtime).
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overdue_wake_ups_armed_and_disarmed_from_many_workers_fire_at_the_earliest_or_never() {
    const TASKS: u64 = 8;
    const ARMS: u64 = 100;
    let store = Arc::new(MemoryStore::new());
    let system = restarted(&store, ScriptedLlm::new(), &["coordinator", "reviewer"]);
    let shared = Arc::clone(&system.client().shared);
    let coordinator = agent_id("coordinator").unwrap();
    let reviewer = agent_id("reviewer").unwrap();
    assert_eq!(
        system.runtime().stats().await.unwrap().activations,
        0,
        "nothing active yet"
    );
    let base = system.runtime().now().as_micros() + 2_000_000;
    let mut tasks = Vec::new();
    for task in 0..TASKS {
        let (shared, coordinator, reviewer) = (Arc::clone(&shared), coordinator.clone(), reviewer.clone());
        tasks.push(tokio::spawn(async move {
            for arm in 0..ARMS {
                // 40 ms of dues, the earliest (`base`) armed by task 0's first arm.
                super::arm_overdue_wake(&shared, &coordinator, base + (task * ARMS + arm) * 50);
                super::arm_overdue_wake(&shared, &reviewer, base);
                super::disarm_overdue_wake(&shared, &reviewer);
                tokio::task::yield_now().await;
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    {
        let wakes = shared.overdue_wakes.lock().unwrap();
        assert_eq!(wakes.len(), 1, "one wake-up, the coordinator's");
        let armed = wakes.get(&coordinator).expect("the coordinator's");
        assert_eq!(
            armed.due_us.load(std::sync::atomic::Ordering::Relaxed),
            base,
            "the earliest due"
        );
    }

    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert!(shared.overdue_wakes.lock().unwrap().is_empty(), "fired, and gone");
    assert_eq!(
        system.runtime().stats().await.unwrap().activations,
        1,
        "the coordinator was told (activated); the reviewer never"
    );
    system.shutdown().await;
}
