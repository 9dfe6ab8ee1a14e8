//! External tasks (`AgentClient::delegate_external`): Troupe tasks from outside the
//! system, with no delegating agent, through the real runtime and the receiver's
//! durable inbox; only the model is scripted.
//!
//! Runs in both builds: `cargo test -p troupe-agent --test external` (tokio with paused
//! time) and under madsim (`RUSTFLAGS="--cfg madsim"`), except the multi-thread test.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use troupe_agent::{
    AgentSpec, AgentSystem, ChatMessage, ExternalCancel, ExternalForget, ExternalTaskRequest, InboxError, Role,
    ScriptRule, ScriptedLlm, TaskState,
};
use troupe_runtime::{MemoryStore, SqliteStore, StateStore};

#[path = "support/gate_store.rs"]
mod gate_store;
use gate_store::GateStore;

/// How long the scripted `slow` model takes, in milliseconds.
const SLOW_MS: u64 = 5_000;

fn script() -> ScriptedLlm {
    ScriptedLlm::new()
        .rule(ScriptRule::agent("echo").reply("echo: {input}"))
        .rule(
            ScriptRule::agent("slow")
                .reply("slow done")
                .latency(Duration::from_millis(SLOW_MS)),
        )
}

fn start(llm: &ScriptedLlm, store: Arc<dyn StateStore>) -> AgentSystem {
    AgentSystem::builder()
        .store(store)
        .llm(Arc::new(llm.clone()))
        .agent(AgentSpec::new("echo"))
        .agent(AgentSpec::new("slow"))
        .start()
        .expect("the system starts")
}

fn request(msg_id: &str, text: &str) -> ExternalTaskRequest {
    ExternalTaskRequest {
        origin: "test".to_string(),
        msg_id: msg_id.to_string(),
        text: text.to_string(),
        attachment: format!("{{\"msg\":\"{msg_id}\"}}"),
        ..ExternalTaskRequest::default()
    }
}

fn user_messages_containing(log: &[ChatMessage], needle: &str) -> usize {
    log.iter()
        .filter(|m| m.role == Role::User && m.content.contains(needle))
        .count()
}

/// Goal: an external task runs once in the agent's own turn, its outcome (state,
/// result, steps) is committed where `external_task` reads it, its attachment comes
/// back as given, and resending the same message id returns the same task and stores
/// nothing new. A rejected one is recorded ended at once and never runs.
#[tokio::test(start_paused = true)]
async fn an_external_task_runs_once_and_a_resend_is_stored_once() {
    let system = start(&script(), Arc::new(MemoryStore::new()));
    let id = system.delegate_external("echo", request("m-1", "hello")).await.unwrap();
    let again = system.delegate_external("echo", request("m-1", "hello")).await.unwrap();
    assert_eq!(id, again);
    assert_eq!(id, "echo-task-0");
    let other = system.delegate_external("echo", request("m-2", "world")).await.unwrap();
    assert_ne!(other, id);
    let rejected = system
        .delegate_external(
            "echo",
            ExternalTaskRequest {
                rejected: Some("refused: a cycle".to_string()),
                trace_id: None,
                ..request("m-3", "never")
            },
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let task = system.external_task("echo", &id).await.unwrap().unwrap();
    assert_eq!(task.state, TaskState::Completed);
    assert_eq!(task.result.as_deref(), Some("echo: hello"));
    assert_eq!(task.reply.map(|reply| reply.steps), Some(1));
    assert_eq!(task.attachment, "{\"msg\":\"m-1\"}");
    assert_eq!(task.origin, "test");
    let rejected = system.external_task("echo", &rejected).await.unwrap().unwrap();
    assert_eq!(rejected.state, TaskState::Rejected);
    assert_eq!(rejected.result.as_deref(), Some("refused: a cycle"));
    let log = system.conversation_log("echo").await.unwrap();
    assert_eq!(user_messages_containing(&log, "hello"), 1, "{log:?}");
    assert_eq!(user_messages_containing(&log, "world"), 1);
    assert_eq!(user_messages_containing(&log, "never"), 0);
    let all = system.external_tasks("echo", None, 10).await.unwrap();
    let ids: Vec<&str> = all.iter().map(|task| task.task_id.as_str()).collect();
    assert_eq!(ids, [id.as_str(), other.as_str(), rejected.task_id.as_str()]);
    let page = system.external_tasks("echo", Some(all[0].seq), 1).await.unwrap();
    assert_eq!(page.len(), 1);
    assert_eq!(page[0].task_id, other);
    assert_eq!(system.pending("echo").await.unwrap(), (0, 0));
    assert!(system.external_task("echo", "echo-task-99").await.unwrap().is_none());
    assert!(matches!(
        system.delegate_external("nobody", request("m-4", "x")).await,
        Err(InboxError::Refused(_))
    ));
    system.shutdown().await;
}

/// Goal: an ended external task can be forgotten (its record, its index and the mark
/// that made its message id return it are deleted), so the same message id then starts
/// a new task that runs again; a running task is kept and still completes; forgetting twice, or an unknown task, is `UnknownTask`; a
/// rejected task is forgotten too.
#[tokio::test(start_paused = true)]
async fn an_ended_external_task_is_forgotten_and_its_message_id_starts_anew() {
    let system = start(&script(), Arc::new(MemoryStore::new()));
    // (A send is acknowledged after the agent's running turn: `waiting` is sent first.)
    let waiting = system
        .delegate_external("slow", request("f-2", "next job"))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(2 * SLOW_MS)).await;
    let running = system
        .delegate_external("slow", request("f-1", "long job"))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(
        system.external_task("slow", &running).await.unwrap().unwrap().state,
        TaskState::Working
    );
    assert_eq!(
        system.forget_external("slow", &running).await.unwrap(),
        ExternalForget::NotEnded
    );
    tokio::time::sleep(Duration::from_millis(2 * SLOW_MS)).await;
    for id in [&running, &waiting] {
        let task = system.external_task("slow", id).await.unwrap().unwrap();
        assert_eq!(task.state, TaskState::Completed, "kept while open, then done: {id}");
    }

    assert_eq!(
        system.forget_external("slow", &running).await.unwrap(),
        ExternalForget::Forgotten
    );
    assert!(system.external_task("slow", &running).await.unwrap().is_none());
    let listed = system.external_tasks("slow", None, 10).await.unwrap();
    let ids: Vec<&str> = listed.iter().map(|task| task.task_id.as_str()).collect();
    assert_eq!(ids, [waiting.as_str()]);
    assert!(matches!(
        system.forget_external("slow", &running).await,
        Err(InboxError::UnknownTask { .. })
    ));
    assert!(matches!(
        system.forget_external("slow", "slow-task-99").await,
        Err(InboxError::UnknownTask { .. })
    ));

    // Its message id is free again: a new task, which runs.
    let anew = system
        .delegate_external("slow", request("f-1", "long job"))
        .await
        .unwrap();
    assert_ne!(anew, running);
    // The message id of a task still kept still names it.
    assert_eq!(
        system
            .delegate_external("slow", request("f-2", "next job"))
            .await
            .unwrap(),
        waiting
    );
    tokio::time::sleep(Duration::from_millis(2 * SLOW_MS)).await;
    let task = system.external_task("slow", &anew).await.unwrap().unwrap();
    assert_eq!(task.state, TaskState::Completed);
    let log = system.conversation_log("slow").await.unwrap();
    assert_eq!(user_messages_containing(&log, "long job"), 2, "{log:?}");
    assert_eq!(user_messages_containing(&log, "next job"), 1, "{log:?}");

    let rejected = system
        .delegate_external(
            "echo",
            ExternalTaskRequest {
                rejected: Some("refused".to_string()),
                ..request("f-3", "never")
            },
        )
        .await
        .unwrap();
    assert_eq!(
        system.forget_external("echo", &rejected).await.unwrap(),
        ExternalForget::Forgotten
    );
    assert!(system.external_task("echo", &rejected).await.unwrap().is_none());
    assert_eq!(system.pending("slow").await.unwrap(), (0, 0));
    system.shutdown().await;
}

/// Goal: cancel maps to Troupe's cancel: a task waiting behind a running one is canceled
/// (committed) and never reaches the model, even though its processing was queued ahead
/// of the cancel; the running one answers `Running` and completes; an ended one answers
/// `Ended`.
#[tokio::test(start_paused = true)]
async fn an_external_task_canceled_before_it_starts_never_runs() {
    let system = start(&script(), Arc::new(MemoryStore::new()));
    let first = system.delegate_external("slow", request("a", "first")).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        system.external_task("slow", &first).await.unwrap().unwrap().state,
        TaskState::Working
    );
    // Two more append while the first runs (their appends wait for its turn); their
    // processing is then queued in arrival order, ahead of any cancel sent now.
    let send = |msg: &'static str| {
        let client = system.client();
        tokio::spawn(async move { client.delegate_external("slow", request(msg, msg)).await })
    };
    let (second, third) = (send("second"), send("third"));
    let running = system.cancel_external("slow", &first).await.unwrap();
    assert!(matches!(running, ExternalCancel::Running(ref task) if task.state == TaskState::Working));
    let (second, third) = (second.await.unwrap().unwrap(), third.await.unwrap().unwrap());
    let seq = |id: &str| id.rsplit('-').next().unwrap().parse::<u64>().unwrap();
    // The later one waits behind the earlier one's turn: cancel it.
    let (second, later) = if seq(&second) < seq(&third) {
        (second, third)
    } else {
        (third, second)
    };
    let canceled = system.cancel_external("slow", &later).await.unwrap();
    let ExternalCancel::Canceled(task) = canceled else {
        panic!("not canceled: {canceled:?}");
    };
    assert_eq!(task.state, TaskState::Canceled);
    tokio::time::sleep(Duration::from_millis(4 * SLOW_MS)).await;
    assert_eq!(
        system.external_task("slow", &first).await.unwrap().unwrap().state,
        TaskState::Completed
    );
    assert_eq!(
        system.external_task("slow", &second).await.unwrap().unwrap().state,
        TaskState::Completed
    );
    assert_eq!(
        system.external_task("slow", &later).await.unwrap().unwrap().state,
        TaskState::Canceled
    );
    assert!(matches!(
        system.cancel_external("slow", &later).await.unwrap(),
        ExternalCancel::Ended(_)
    ));
    assert!(matches!(
        system.cancel_external("slow", "slow-task-404").await,
        Err(InboxError::UnknownTask { .. })
    ));
    let log = system.conversation_log("slow").await.unwrap();
    let later_text = system.external_task("slow", &later).await.unwrap().unwrap().attachment;
    let later_text = if later_text.contains("second") {
        "second"
    } else {
        "third"
    };
    assert_eq!(user_messages_containing(&log, later_text), 0, "{log:?}");
    assert_eq!(user_messages_containing(&log, "first"), 1);
    assert_eq!(log.iter().filter(|m| m.role == Role::User).count(), 2, "{log:?}");
    assert_eq!(system.pending("slow").await.unwrap(), (0, 0));
    system.shutdown().await;
}

/// Goal: an external task survives a restart on the same store in the middle of its
/// turn: started before (working, not committed), completed after, once. Method: the
/// slow model is mid-turn when the first system's store stops answering (a crash: its
/// turn never commits) and it shuts down; the store still holds the
/// task `submitted` in the inbox; a second system on the same SQLite store resumes it.
#[tokio::test(start_paused = true)]
async fn an_external_task_survives_a_restart_mid_task() {
    let store: Arc<dyn StateStore> = Arc::new(SqliteStore::open_in_memory().unwrap());
    let llm = script();
    let crashing = GateStore::new(Arc::clone(&store), false);
    let first = start(&llm, Arc::clone(&crashing) as Arc<dyn StateStore>);
    let id = first
        .delegate_external("slow", request("r-1", "survive"))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(SLOW_MS / 2)).await;
    assert_eq!(
        first.external_task("slow", &id).await.unwrap().unwrap().state,
        TaskState::Working
    );
    // The process dies: nothing it does from now on reaches the store.
    crashing.dead.store(true, Ordering::SeqCst);
    first.shutdown().await;

    let second = start(&llm, Arc::clone(&store));
    let before = second.external_task("slow", &id).await.unwrap().unwrap();
    // The first turn never committed: submitted (or already working again, resumed).
    assert!(
        matches!(before.state, TaskState::Submitted | TaskState::Working),
        "{before:?}"
    );
    assert_eq!(second.pending("slow").await.unwrap(), (1, 0));
    tokio::time::sleep(Duration::from_millis(3 * SLOW_MS)).await;
    let after = second.external_task("slow", &id).await.unwrap().unwrap();
    assert_eq!(after.state, TaskState::Completed);
    assert_eq!(after.result.as_deref(), Some("slow done"));
    // A resend after the restart still finds the same task.
    assert_eq!(
        second
            .delegate_external("slow", request("r-1", "survive"))
            .await
            .unwrap(),
        id
    );
    let log = second.conversation_log("slow").await.unwrap();
    assert_eq!(user_messages_containing(&log, "survive"), 1, "{log:?}");
    assert_eq!(second.pending("slow").await.unwrap(), (0, 0));
    second.shutdown().await;
}

/// Goal: an external task continues the call chain and depth it arrived with, so the
/// agent's own calls are checked against them: a call back to an agent on the chain is
/// refused as a cycle, while the same task from outside (empty chain) may make it.
#[tokio::test(start_paused = true)]
async fn an_external_task_continues_its_chain_and_a_call_back_is_a_cycle() {
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("caller")
                .on_user_containing("ring")
                .call("call_agent", serde_json::json!({"agent_id": "echo", "message": "back"})),
        )
        .rule(ScriptRule::agent("caller").on_tool_result().reply("got: {tool_result}"))
        .rule(ScriptRule::agent("echo").reply("echo: {input}"));
    let system = AgentSystem::builder()
        .store(Arc::new(MemoryStore::new()))
        .llm(Arc::new(llm))
        .agent(AgentSpec::new("echo"))
        .agent(AgentSpec::new("caller"))
        .start()
        .unwrap();
    let chained = system
        .delegate_external(
            "caller",
            ExternalTaskRequest {
                chain: vec!["echo".to_string()],
                depth: 1,
                ..request("k-1", "ring one")
            },
        )
        .await
        .unwrap();
    let plain = system
        .delegate_external("caller", request("k-2", "ring two"))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let chained = system.external_task("caller", &chained).await.unwrap().unwrap();
    assert_eq!((chained.chain.clone(), chained.depth), (vec!["echo".to_string()], 1));
    let result = chained.result.unwrap_or_default();
    assert!(result.contains("cycle"), "{result}");
    let plain = system.external_task("caller", &plain).await.unwrap().unwrap();
    let result = plain.result.unwrap_or_default();
    assert!(result.starts_with("got: echo:") && result.ends_with("back"), "{result}");
    system.shutdown().await;
}

/// Goal: concurrent external sends to one agent on the multi-thread runtime, each
/// message sent twice at once, make exactly one task and one outcome per message id.
/// Goal: on the multi-thread runtime, tasks sent and forgotten concurrently each run
/// once, `Forgotten` comes only after a task's outcome is committed (its reply is then
/// in the agent's log, written in the same turn), and exactly the forgotten tasks are
/// gone. Method: 12 tasks, each forgotten in a loop from its own thread, starting right
/// after it is sent (bounded). (A forget that reaches the agent's mailbox finds the
/// task done: its processing was queued at its append, before any forget; the client's
/// and the turn's checks of the state are for a processing not queued, as after a
/// refused wake-up, and are covered by the paused-time test above.)
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forgetting_races_the_tasks_turns_and_never_deletes_an_open_task() {
    const TASKS: usize = 12;
    let system = start(&script().without_recording(), Arc::new(MemoryStore::new()));
    let mut handles = Vec::new();
    for n in 0..TASKS {
        let client = system.client();
        handles.push(tokio::spawn(async move {
            let text = format!("race-{n}.");
            let id = client
                .delegate_external("echo", request(&format!("r-{n}"), &text))
                .await
                .unwrap();
            for _ in 0..400 {
                match client.forget_external("echo", &id).await.unwrap() {
                    ExternalForget::NotEnded => tokio::time::sleep(Duration::from_millis(5)).await,
                    ExternalForget::Forgotten => {
                        let log = client.conversation_log("echo").await.unwrap();
                        let replied = log
                            .iter()
                            .any(|m| m.role == Role::Assistant && m.content == format!("echo: {text}"));
                        assert!(replied, "task {id} was forgotten before its outcome was committed");
                        return (text, id);
                    }
                }
            }
            panic!("task {id} was never forgotten");
        }));
    }
    for handle in handles {
        let (text, id) = handle.await.unwrap();
        assert!(system.external_task("echo", &id).await.unwrap().is_none(), "{id}");
        let log = system.conversation_log("echo").await.unwrap();
        assert_eq!(user_messages_containing(&log, &text), 1, "{text}");
    }
    assert!(system.external_tasks("echo", None, 100).await.unwrap().is_empty());
    assert_eq!(system.pending("echo").await.unwrap(), (0, 0));
    system.shutdown().await;
}

#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_external_sends_to_one_agent_each_make_one_task_and_one_outcome() {
    const MESSAGES: usize = 24;
    let system = start(&script().without_recording(), Arc::new(MemoryStore::new()));
    let mut handles = Vec::new();
    for n in 0..MESSAGES {
        for _copy in 0..2 {
            let client = system.client();
            handles.push(tokio::spawn(async move {
                let id = client
                    .delegate_external("echo", request(&format!("c-{n}"), &format!("job-{n}.")))
                    .await
                    .unwrap();
                (n, id)
            }));
        }
    }
    let mut ids = std::collections::BTreeMap::new();
    for handle in handles {
        let (n, id) = handle.await.unwrap();
        let first = ids.entry(n).or_insert_with(|| id.clone());
        assert_eq!(*first, id, "both copies of message {n} name one task");
    }
    let distinct: std::collections::BTreeSet<&String> = ids.values().collect();
    assert_eq!(distinct.len(), MESSAGES);
    // Real time here: wait until every task has ended (bounded).
    for _ in 0..200 {
        let tasks = system.external_tasks("echo", None, 100).await.unwrap();
        if tasks.iter().all(|task| task.state.is_final()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let tasks = system.external_tasks("echo", None, 100).await.unwrap();
    assert_eq!(tasks.len(), MESSAGES);
    let log = system.conversation_log("echo").await.unwrap();
    for (n, id) in &ids {
        let task = system.external_task("echo", id).await.unwrap().unwrap();
        assert_eq!(task.state, TaskState::Completed, "{id}");
        assert_eq!(task.result.as_deref(), Some(format!("echo: job-{n}.").as_str()));
        assert_eq!(user_messages_containing(&log, &format!("job-{n}.")), 1, "{n}");
    }
    assert_eq!(system.pending("echo").await.unwrap(), (0, 0));
    system.shutdown().await;
}

/// Goal: an external task whose enqueue turn runs in the shutdown's grace (queued behind
/// a long turn when the shutdown began) is refused `Shutdown`, the runtime's typed
/// error, not `ActorFailed` with the refusal in a string: the turn's wake-up of its own
/// processing is refused because the runtime stops, and that reaches the caller as it
/// is. (Before 2026-12-06: `ActorFailed { cause: "could not schedule inbox work: the
/// runtime has shut down" }`; `troupe serve` stored that as the A2A task's outcome.)
#[tokio::test(start_paused = true)]
async fn an_external_task_taken_during_the_shutdown_grace_is_refused_shutdown() {
    let llm = script();
    let system = start(&llm, Arc::new(MemoryStore::new()));
    let client = system.client();
    let asking = {
        let client = client.clone();
        tokio::spawn(async move { client.ask("slow", "take your time").await })
    };
    tokio::time::sleep(Duration::from_millis(10)).await;
    let delegating = {
        let client = client.clone();
        tokio::spawn(async move { client.delegate_external("slow", request("m-grace", "after")).await })
    };
    // The shutdown starts while the slow turn runs and the task waits behind it; the
    // turn ends (at SLOW_MS) well within the grace, and the task's turn runs then.
    tokio::time::sleep(Duration::from_millis(SLOW_MS - 1_000)).await;
    system.shutdown().await;
    assert_eq!(
        asking
            .await
            .unwrap()
            .expect("the running turn finishes in the grace")
            .text,
        "slow done"
    );
    let refused = delegating.await.unwrap().expect_err("the runtime stopped");
    assert!(
        matches!(refused, InboxError::Invoke(troupe_core::InvokeError::Shutdown)),
        "{refused:?}"
    );
}
