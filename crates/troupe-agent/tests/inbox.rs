//! Delegate, notify and the durable inbox, end to end through the real runtime; only the
//! model is scripted, and it really emits the `delegate_to_agent` and `notify_agent`
//! tool calls.
//!
//! Crash points: a store wrapper "crashes" the whole process at its k-th commit (the
//! commit is applied, its caller sees an error, and every later store operation fails:
//! persisted but not acknowledged, and nothing after), then a second system starts on
//! the same data. The delegate protocol is run once fault-free to count its commits, and
//! then once per crash point k = 1..=N (see `CRASH_POINTS` in docs/architecture.md).
//!
//! Runs in both builds: `cargo test -p troupe-agent --test inbox` (tokio with paused
//! time) and under madsim (`RUSTFLAGS="--cfg madsim"`).

#[path = "support/crash_store.rs"]
mod crash_store;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use crash_store::{CommitKeys, CrashStore};
use serde_json::json;
use troupe_agent::{
    AgentEvent, AgentSpec, AgentSystem, CallRecorder, ChatMessage, InboxError, Role, ScriptRule, ScriptedLlm, TaskState,
};
use troupe_core::{ActorId, CallRefused};
use troupe_runtime::{MemoryStore, SqliteStore, StateStore, TurnCommit};

fn start(llm: &ScriptedLlm, agents: &[&str], store: Arc<dyn StateStore>, recorder: &CallRecorder) -> AgentSystem {
    let mut builder = AgentSystem::builder()
        .store(store)
        .llm(Arc::new(llm.clone()))
        .observer(Arc::new(recorder.clone()));
    for agent in agents {
        builder = builder.agent(AgentSpec::new(*agent).role(format!("the {agent}")));
    }
    builder.start().expect("the system starts")
}

async fn settle() {
    tokio::time::sleep(Duration::from_secs(20)).await;
}

/// A coordinator and an analyst on the memory store, the coordinator answering "seen"
/// to the outcome of a task it delegated, the analyst as `analyst` scripts it.
fn coordinator_and_analyst(analyst: ScriptedLlm) -> AgentSystem {
    coordinator_and_analyst_observed(analyst, &CallRecorder::new())
}

/// [`coordinator_and_analyst`], its events reported to `recorder`.
fn coordinator_and_analyst_observed(analyst: ScriptedLlm, recorder: &CallRecorder) -> AgentSystem {
    let llm = analyst.rule(
        ScriptRule::agent("coordinator")
            .on_user_containing("you delegated is")
            .reply("seen"),
    );
    start(
        &llm,
        &["coordinator", "analyst"],
        Arc::new(MemoryStore::new()),
        recorder,
    )
}

/// An analyst slow (5 s) on a message containing "slow" and fast on any other task.
fn slow_then_fast_analyst() -> ScriptedLlm {
    ScriptedLlm::new()
        .rule(
            ScriptRule::agent("analyst")
                .on_user_containing("slow")
                .reply("slow done")
                .latency(Duration::from_secs(5)),
        )
        .rule(
            ScriptRule::agent("analyst")
                .on_user_containing("[task")
                .reply("fast done"),
        )
}

fn user_messages_containing(log: &[ChatMessage], needle: &str) -> usize {
    log.iter()
        .filter(|m| m.role == Role::User && m.content.contains(needle))
        .count()
}

fn delegation_script() -> ScriptedLlm {
    ScriptedLlm::new()
        .rule(ScriptRule::agent("coordinator").on_user_containing("plan").call(
            "delegate_to_agent",
            json!({"agent_id": "analyst", "message": "crunch {input}", "timeout_ms": 60000}),
        ))
        .rule(
            ScriptRule::agent("coordinator")
                .on_tool_result()
                .reply("ok: {tool_result}"),
        )
        .rule(
            ScriptRule::agent("coordinator")
                .on_user_containing("you delegated is")
                .reply("thanks"),
        )
        .rule(
            ScriptRule::agent("analyst")
                .on_user_containing("[task")
                .reply("result-42"),
        )
        .rule(
            ScriptRule::agent("analyst")
                .on_user_containing("[notification")
                .reply("noted"),
        )
        .rule(
            ScriptRule::agent("coordinator")
                .on_user_containing("[notification")
                .reply("noted"),
        )
}

/// Goal: a notification to an agent that is not active is persisted when acknowledged,
/// processed once in a turn of the agent's own, and a redelivery with the same id is
/// acknowledged without a second entry or a second turn.
#[tokio::test(start_paused = true)]
async fn a_notification_to_an_inactive_agent_is_processed_exactly_once_and_a_duplicate_is_dropped() {
    let llm = delegation_script();
    let recorder = CallRecorder::new();
    let system = start(
        &llm,
        &["coordinator", "analyst"],
        Arc::new(MemoryStore::new()),
        &recorder,
    );
    let mut stream = system.subscribe();
    system
        .notify_with_id("analyst", "m-1", "disk is full", None)
        .await
        .unwrap();
    settle().await;
    system
        .notify_with_id("analyst", "m-1", "disk is full", None)
        .await
        .unwrap();
    let analyst = troupe_agent::agent_id("analyst").unwrap();
    system.runtime().deactivate(&analyst).await.unwrap();
    system
        .notify_with_id("analyst", "m-1", "disk is full", None)
        .await
        .unwrap();
    system
        .notify_with_id("analyst", "m-2", "disk is fine", None)
        .await
        .unwrap();
    settle().await;
    let log = system.conversation_log("analyst").await.unwrap();
    assert_eq!(user_messages_containing(&log, "disk is full"), 1);
    assert_eq!(user_messages_containing(&log, "disk is fine"), 1);
    assert_eq!(llm.requests_of("analyst").len(), 2);
    assert_eq!(system.pending("analyst").await.unwrap(), (0, 0));
    let mut received = Vec::new();
    while let Ok(event) = stream.try_recv() {
        if let AgentEvent::MessageReceived { msg_id, duplicate, .. } = event {
            received.push((msg_id, duplicate));
        }
    }
    assert_eq!(
        received,
        [
            ("m-1".to_string(), false),
            ("m-1".to_string(), true),
            ("m-1".to_string(), true),
            ("m-2".to_string(), false)
        ]
    );
    assert_eq!(
        system.notify("nobody", "x").await,
        Err(InboxError::Refused(CallRefused::AgentNotFound {
            target: troupe_agent::agent_id("nobody").unwrap()
        }))
    );
    system.shutdown().await;
}

/// Goal: a caller-chosen message id is at most `AGENT_MESSAGE_ID_LENGTH_MAX_BYTES`
/// (what the agent's dedupe mark `seen/{msg_id}` leaves of the store's key limit): the
/// longest is taken, and deduplicated, by `notify_with_id`, `notify_with` and
/// `delegate_external`; one byte more is `MessageIdTooLong` naming both lengths, and
/// nothing is kept. (Before, it failed in the store as a storage error that said to
/// retry, which could never succeed.)
#[tokio::test(start_paused = true)]
async fn a_message_id_longer_than_its_limit_is_refused_and_the_longest_is_taken() {
    use troupe_agent::limits::AGENT_MESSAGE_ID_LENGTH_MAX_BYTES;
    use troupe_agent::{ExternalTaskRequest, NotifyOptions};
    let llm = delegation_script();
    let recorder = CallRecorder::new();
    let system = start(
        &llm,
        &["coordinator", "analyst"],
        Arc::new(MemoryStore::new()),
        &recorder,
    );
    let too_long = InboxError::MessageIdTooLong {
        length_bytes: AGENT_MESSAGE_ID_LENGTH_MAX_BYTES + 1,
        max_bytes: AGENT_MESSAGE_ID_LENGTH_MAX_BYTES,
    };
    let id = |byte: char, extra: usize| byte.to_string().repeat(AGENT_MESSAGE_ID_LENGTH_MAX_BYTES + extra);
    let external = |msg_id: String| ExternalTaskRequest {
        origin: "test".to_string(),
        msg_id,
        text: "crunch".to_string(),
        ..ExternalTaskRequest::default()
    };
    assert_eq!(
        system.notify_with_id("analyst", &id('a', 1), "over", None).await,
        Err(too_long.clone())
    );
    let options = NotifyOptions::default().msg_id(id('b', 1));
    assert_eq!(
        system.notify_with("analyst", "over", options).await,
        Err(too_long.clone())
    );
    assert_eq!(
        system.delegate_external("analyst", external(id('c', 1))).await,
        Err(too_long.clone())
    );
    assert!(too_long.to_string().contains("use a shorter id"), "{too_long}");
    settle().await;
    assert!(
        system.conversation_log("analyst").await.unwrap().is_empty(),
        "nothing kept"
    );

    // The longest: taken, and a resend of it is a duplicate.
    for _ in 0..2 {
        system
            .notify_with_id("analyst", &id('a', 0), "longest", None)
            .await
            .unwrap();
        let options = NotifyOptions::default().msg_id(id('b', 0));
        assert_eq!(
            system.notify_with("analyst", "longest too", options).await.unwrap(),
            id('b', 0)
        );
    }
    let first = system.delegate_external("analyst", external(id('c', 0))).await.unwrap();
    let again = system.delegate_external("analyst", external(id('c', 0))).await.unwrap();
    assert_eq!(first, again, "a resent external task is the same task");
    settle().await;
    let log = system.conversation_log("analyst").await.unwrap();
    assert_eq!(user_messages_containing(&log, "longest"), 2, "each notification once");
    system.shutdown().await;
}

async fn delegate_round_trip(store: Arc<dyn StateStore>) {
    let llm = delegation_script();
    let recorder = CallRecorder::new();
    let system = start(&llm, &["coordinator", "analyst"], store, &recorder);
    let reply = system.ask("coordinator", "plan the quarter").await.unwrap();
    assert_eq!(
        reply.text,
        "ok: delegated as task coordinator.0; the result will come back as a message"
    );
    settle().await;
    let task = system.task("coordinator", "coordinator.0").await.unwrap().unwrap();
    assert_eq!(task.state, TaskState::Completed);
    assert_eq!(task.result.as_deref(), Some("result-42"));
    let coordinator = system.conversation_log("coordinator").await.unwrap();
    assert_eq!(
        user_messages_containing(
            &coordinator,
            "[task coordinator.0 you delegated is completed] result-42"
        ),
        1
    );
    let analyst = system.conversation_log("analyst").await.unwrap();
    assert_eq!(
        user_messages_containing(
            &analyst,
            "[task coordinator.0 delegated by agent coordinator] crunch plan the quarter"
        ),
        1
    );
    assert_eq!(system.pending("coordinator").await.unwrap(), (0, 0));
    assert_eq!(system.pending("analyst").await.unwrap(), (0, 0));
    let finished: Vec<TaskState> = recorder
        .events()
        .into_iter()
        .filter_map(|event| match event {
            AgentEvent::DelegationFinished { state, .. } => Some(state),
            _ => None,
        })
        .collect();
    assert_eq!(finished, [TaskState::Completed]);
    system.shutdown().await;
}

/// Goal: a delegation returns its task id at once, the delegatee works in its own turn,
/// and the result reaches the delegator as a new turn exactly once.
#[tokio::test(start_paused = true)]
async fn a_delegated_task_is_worked_by_the_delegatee_and_its_result_comes_back_once() {
    delegate_round_trip(Arc::new(MemoryStore::new())).await;
}

/// Goal: the same with the SQLite store (the inbox is plain key writes).
#[tokio::test(start_paused = true)]
async fn a_delegated_task_round_trips_in_sqlite() {
    let store = SqliteStore::open_in_memory().unwrap();
    delegate_round_trip(Arc::new(store)).await;
}

/// The agents (by key) and trace ids of the conversation turns the recorder saw start.
fn turn_traces(recorder: &CallRecorder) -> Vec<(String, Option<troupe_core::TraceId>)> {
    recorder
        .events()
        .into_iter()
        .filter_map(|event| match event {
            AgentEvent::TurnStarted { agent, trace_id, .. } => Some((agent.key().to_string(), trace_id)),
            _ => None,
        })
        .collect()
}

/// Goal: a notification and a delegation sent from outside with a trace id run under
/// it: the notification's turn; the task's turn at the delegatee and the delegator's
/// turn on its result (the result keeps the task's trace); untraced ones run untraced.
#[tokio::test(start_paused = true)]
async fn traced_notifications_and_delegations_run_under_their_trace_id() {
    let recorder = CallRecorder::new();
    let system = coordinator_and_analyst_observed(slow_then_fast_analyst(), &recorder);
    let noted = troupe_core::TraceId::new(0x1111);
    let options = troupe_agent::NotifyOptions::default().msg_id("n-1").traced(noted);
    assert_eq!(
        system.notify_with("analyst", "[task-like] fyi", options).await.unwrap(),
        "n-1"
    );
    settle().await;
    assert_eq!(turn_traces(&recorder), [("analyst".to_string(), Some(noted))]);
    let empty = troupe_agent::NotifyOptions::default().msg_id("");
    assert!(matches!(
        system.notify_with("analyst", "x", empty).await,
        Err(InboxError::EmptyMessageId)
    ));

    let delegated = troupe_core::TraceId::new(0x2222);
    let options = troupe_agent::DelegateOptions::default().traced(delegated);
    let task = system
        .delegate_with("coordinator", "analyst", "crunch", options)
        .await
        .unwrap();
    settle().await;
    let status = system.task("coordinator", &task).await.unwrap().unwrap();
    assert_eq!(status.state, TaskState::Completed);
    assert_eq!(
        turn_traces(&recorder)[1..],
        [
            ("analyst".to_string(), Some(delegated)),
            ("coordinator".to_string(), Some(delegated)),
        ],
        "the task's turn, then the result's"
    );

    let untraced = system
        .delegate("coordinator", "analyst", "crunch again", None)
        .await
        .unwrap();
    settle().await;
    assert_eq!(
        system.task("coordinator", &untraced).await.unwrap().unwrap().state,
        TaskState::Completed
    );
    assert_eq!(
        turn_traces(&recorder)[3..],
        [("analyst".to_string(), None), ("coordinator".to_string(), None)]
    );
    system.shutdown().await;
}

/// Goal: a dedupe mark (`seen/`) is kept only for a message that needs one to be known
/// again: a notification with an id from outside gets one; a delegated task (its place
/// in the pair's order dedupes it), a task's result (its task record) and an id-less
/// notification get none.
#[tokio::test(start_paused = true)]
async fn dedupe_marks_are_kept_only_where_nothing_else_dedupes() {
    let store = Arc::new(MemoryStore::new());
    let llm = delegation_script();
    let recorder = CallRecorder::new();
    let system = start(&llm, &["coordinator", "analyst"], store.clone(), &recorder);
    system.ask("coordinator", "plan the quarter").await.unwrap();
    system
        .notify_with_id("analyst", "m-1", "disk is full", None)
        .await
        .unwrap();
    system.notify("analyst", "disk is fine").await.unwrap();
    settle().await;
    let task = system.task("coordinator", "coordinator.0").await.unwrap().unwrap();
    assert_eq!(task.state, TaskState::Completed);
    let analyst_log = system.conversation_log("analyst").await.unwrap();
    assert_eq!(user_messages_containing(&analyst_log, "disk is fine"), 1);
    let marks = |agent: &str| {
        let store = store.clone();
        let agent = troupe_agent::agent_id(agent).unwrap();
        async move {
            let found = store.scan(&agent, "seen/", None, 100).await.unwrap();
            found.into_iter().map(|(key, _)| key).collect::<Vec<_>>()
        }
    };
    assert_eq!(marks("analyst").await, ["seen/m-1"]);
    assert_eq!(marks("coordinator").await, Vec::<String>::new());
    system.shutdown().await;
}

/// Goal: the Rust API delegates and cancels; a task cancelled before it started
/// resolves canceled, once, and the delegatee never works on it. Method: the analyst's
/// model is slow on a first task, so the delivery of the second keeps timing out and
/// the cancellation overtakes it (a tombstone at the analyst cancels it on arrival).
#[tokio::test(start_paused = true)]
async fn a_task_cancelled_before_it_started_resolves_canceled_and_is_never_worked() {
    let system = coordinator_and_analyst(slow_then_fast_analyst());
    let first = system
        .delegate("coordinator", "analyst", "slow one", None)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let second = system
        .delegate("coordinator", "analyst", "second one", None)
        .await
        .unwrap();
    assert_eq!((first.as_str(), second.as_str()), ("coordinator.0", "coordinator.1"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(system.cancel("coordinator", &second).await, Ok(None));
    settle().await;
    let states = (
        system.task("coordinator", &first).await.unwrap().unwrap().state,
        system.task("coordinator", &second).await.unwrap().unwrap().state,
    );
    assert_eq!(states, (TaskState::Completed, TaskState::Canceled));
    assert_eq!(
        system.cancel("coordinator", &second).await,
        Ok(Some(TaskState::Canceled))
    );
    let analyst = system.conversation_log("analyst").await.unwrap();
    assert_eq!(user_messages_containing(&analyst, "second one"), 0);
    let coordinator = system.conversation_log("coordinator").await.unwrap();
    assert_eq!(user_messages_containing(&coordinator, "you delegated is canceled"), 1);
    assert_eq!(user_messages_containing(&coordinator, "you delegated is completed"), 1);
    system.shutdown().await;
}

/// Goal: a delegation to an agent that is not in the directory, or to the delegator
/// itself, is refused at admission with nothing kept; a task whose deadline passes
/// while its delivery waits behind the delegatee's long turn resolves failed, once, and
/// is never worked.
#[tokio::test(start_paused = true)]
async fn refused_delegations_keep_nothing_and_an_expired_task_resolves_failed_unworked() {
    let system = coordinator_and_analyst(slow_then_fast_analyst());
    assert_eq!(
        system.delegate("coordinator", "ghost", "x", None).await,
        Err(InboxError::Refused(CallRefused::AgentNotFound {
            target: troupe_agent::agent_id("ghost").unwrap()
        }))
    );
    let coordinator = troupe_agent::agent_id("coordinator").unwrap();
    assert_eq!(
        system.delegate("coordinator", "coordinator", "x", None).await,
        Err(InboxError::Refused(CallRefused::CycleDetected {
            chain: vec![coordinator.clone(), coordinator]
        }))
    );
    assert_eq!(system.pending("coordinator").await.unwrap(), (0, 0));
    let slow = system
        .delegate("coordinator", "analyst", "slow one", None)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let short = system
        .delegate("coordinator", "analyst", "short one", Some(1_000))
        .await
        .unwrap();
    assert_eq!((slow.as_str(), short.as_str()), ("coordinator.0", "coordinator.1"));
    settle().await;
    let status = system.task("coordinator", &short).await.unwrap().unwrap();
    assert_eq!(
        (status.state, status.result.as_deref()),
        (TaskState::Failed, Some("the deadline passed before work started"))
    );
    let analyst = system.conversation_log("analyst").await.unwrap();
    assert_eq!(user_messages_containing(&analyst, "short one"), 0);
    let log = system.conversation_log("coordinator").await.unwrap();
    assert_eq!(
        user_messages_containing(&log, "[task coordinator.1 you delegated is failed]"),
        1
    );
    assert_eq!(
        user_messages_containing(&log, "[task coordinator.0 you delegated is completed]"),
        1
    );
    system.shutdown().await;
}

/// Goal: a delivery attempt is never started after its entry's deadline. Method: the
/// analyst's model takes 40 s on a first task; a second task, of a deadline 50 ms longer
/// than a delivery's acknowledgement wait (`AGENT_DELIVERY_ACK_TIMEOUT_MS`), waits behind
/// that turn: its first attempt times out 50 ms before its deadline, the deadline passes
/// during the pause before the next attempt, and that attempt must not be made. Before
/// 2026-12-06 it was made, waited for the analyst's turn, was acknowledged (the delegator
/// told `MessageSent` for a task past its deadline) and failed at the analyst, unworked.
#[tokio::test(start_paused = true)]
async fn a_delivery_whose_deadline_passes_during_its_pause_is_not_attempted_again() {
    use troupe_agent::limits::{AGENT_DELIVERY_ACK_TIMEOUT_MS, AGENT_DELIVERY_RETRY_MS};
    const ANALYST_TURN_S: u64 = 40;
    // Passes within the pause after the first attempt's acknowledgement wait ends.
    const TASK_TIMEOUT_MS: u64 = AGENT_DELIVERY_ACK_TIMEOUT_MS + AGENT_DELIVERY_RETRY_MS / 2;
    let recorder = CallRecorder::new();
    let system = coordinator_and_analyst_observed(
        ScriptedLlm::new()
            .rule(
                ScriptRule::agent("analyst")
                    .on_user_containing("long")
                    .reply("long done")
                    .latency(Duration::from_secs(ANALYST_TURN_S)),
            )
            .rule(ScriptRule::agent("analyst").on_user_containing("[task").reply("worked")),
        &recorder,
    );
    let long = system
        .delegate("coordinator", "analyst", "long one", None)
        .await
        .unwrap();
    // The long task's turn has started before the second task is sent.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let late = system
        .delegate("coordinator", "analyst", "late one", Some(TASK_TIMEOUT_MS))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(ANALYST_TURN_S + 20)).await;
    let status = system.task("coordinator", &late).await.unwrap().unwrap();
    assert_eq!(
        (status.state, status.result.as_deref()),
        (
            TaskState::Failed,
            Some("the deadline passed before it could be delivered")
        ),
        "{status:?}"
    );
    let sent: Vec<String> = recorder
        .events()
        .into_iter()
        .filter_map(|event| match event {
            AgentEvent::MessageSent { msg_id, .. } => Some(msg_id),
            _ => None,
        })
        .collect();
    assert!(
        !sent.iter().any(|msg_id| msg_id.contains(late.as_str())),
        "the task was reported sent after its deadline: {sent:?}"
    );
    assert!(sent.iter().any(|msg_id| msg_id.contains(long.as_str())), "{sent:?}");
    let analyst = system.conversation_log("analyst").await.unwrap();
    assert_eq!(user_messages_containing(&analyst, "late one"), 0);
    let coordinator = system.conversation_log("coordinator").await.unwrap();
    assert_eq!(
        user_messages_containing(&coordinator, &format!("[task {late} you delegated is failed]")),
        1
    );
    system.shutdown().await;
}

/// Goal: `MessageSent` is told once per entry, by the report that takes it off the
/// outbox, however many delivery tasks delivered it. Method: agents idle out after 1 s;
/// the coordinator delegates a task while the analyst is in a 10 s turn, so its delivery
/// waits; the coordinator idles out, is asked again (its new activation resumes the
/// pending outbox entry: a second delivery task for it), and when the analyst's turn
/// ends both deliveries are acknowledged (`Accepted`, then `Duplicate`) and both report.
/// Before 2026-12-06 each acknowledged attempt told `MessageSent`: two for one task.
#[tokio::test(start_paused = true)]
async fn a_task_delivered_by_two_delivery_tasks_is_reported_sent_once() {
    const ANALYST_TURN_S: u64 = 10;
    let idle = Duration::from_secs(1);
    let recorder = CallRecorder::new();
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("analyst")
                .on_user_containing("long")
                .reply("long done")
                .latency(Duration::from_secs(ANALYST_TURN_S)),
        )
        .rule(ScriptRule::agent("analyst").on_user_containing("[task").reply("worked"))
        .rule(ScriptRule::agent("coordinator").reply("seen"));
    let mut builder = AgentSystem::builder()
        .store(Arc::new(MemoryStore::new()))
        .llm(Arc::new(llm))
        .observer(Arc::new(recorder.clone()))
        .kind_config(troupe_runtime::KindConfig {
            idle_timeout: idle,
            ..troupe_runtime::KindConfig::default()
        });
    for agent in ["coordinator", "analyst"] {
        builder = builder.agent(AgentSpec::new(agent).role(format!("the {agent}")));
    }
    let system = builder.start().expect("the system starts");
    let deactivated = |agent: &str| {
        recorder
            .events()
            .iter()
            .filter(|event| matches!(event, AgentEvent::Deactivated { agent: id, .. } if id.key() == agent))
            .count()
    };
    system
        .delegate("coordinator", "analyst", "long one", None)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let task = system
        .delegate("coordinator", "analyst", "second one", None)
        .await
        .unwrap();
    tokio::time::sleep(idle * 3).await;
    assert!(
        deactivated("coordinator") >= 1,
        "the coordinator idled out while its delivery waited"
    );
    assert_eq!(
        system.pending("coordinator").await.unwrap().1,
        1,
        "the task is still in the outbox"
    );
    // A new activation of the coordinator: it resumes its pending outbox entry.
    system.ask("coordinator", "hello").await.unwrap();
    tokio::time::sleep(Duration::from_secs(ANALYST_TURN_S + 20)).await;
    let status = system.task("coordinator", &task).await.unwrap().unwrap();
    assert_eq!(status.state, TaskState::Completed, "{status:?}");
    let analyst = system.conversation_log("analyst").await.unwrap();
    assert_eq!(user_messages_containing(&analyst, "second one"), 1, "worked once");
    let sent = recorder
        .events()
        .into_iter()
        .filter(|event| matches!(event, AgentEvent::MessageSent { msg_id, .. } if *msg_id == task))
        .count();
    assert_eq!(sent, 1, "MessageSent told for {task}");
    system.shutdown().await;
}

/// Runs delegate + notify with a crash at commit `crash_at` (0: never), restarts on
/// the same data, and checks the invariants. Returns the commits of the first run.
async fn run_with_crash(crash_at: u64, data: Arc<dyn StateStore>) -> Vec<String> {
    let llm = delegation_script();
    let recorder = CallRecorder::new();
    let crash = Arc::new(CrashStore::new(Arc::clone(&data), CommitKeys::Short));
    crash.arm(crash_at);
    let first = start(
        &llm,
        &["coordinator", "analyst"],
        Arc::clone(&crash) as Arc<dyn StateStore>,
        &recorder,
    );
    let asked = first.ask("coordinator", "plan the quarter").await;
    let notified = first.notify_with_id("analyst", "n-1", "fyi budget", None).await;
    settle().await;
    let commits = crash.log();
    drop(first); // the process dies (if it has not already, in effect)
    let second = start(&llm, &["coordinator", "analyst"], data, &recorder);
    settle().await;
    let coordinator = second.conversation_log("coordinator").await.unwrap();
    let analyst = second.conversation_log("analyst").await.unwrap();
    let accepted = coordinator
        .iter()
        .any(|m| m.role == Role::Tool && m.content.contains("delegated as task coordinator.0"));
    if crash_at == 0 {
        assert!(asked.is_ok() && notified.is_ok() && accepted);
    }
    if asked.is_ok() {
        assert!(
            accepted,
            "crash at {crash_at}: an acknowledged ask's delegation is committed"
        );
    }
    let expected = u64::from(accepted) as usize;
    let task = second.task("coordinator", "coordinator.0").await.unwrap();
    assert_eq!(
        task.map(|t| t.state),
        accepted.then_some(TaskState::Completed),
        "crash at {crash_at}: every accepted delegation resolves"
    );
    assert_eq!(
        user_messages_containing(&coordinator, "[task coordinator.0 you delegated is completed]"),
        expected,
        "crash at {crash_at}: the result is processed exactly once by the delegator"
    );
    assert_eq!(
        user_messages_containing(&analyst, "[task coordinator.0 delegated by agent coordinator]"),
        expected,
        "crash at {crash_at}: the task is worked exactly once"
    );
    let notes = user_messages_containing(&analyst, "fyi budget");
    if notified.is_ok() {
        assert_eq!(
            notes, 1,
            "crash at {crash_at}: an acknowledged notification is processed once"
        );
    } else {
        assert!(notes <= 1, "crash at {crash_at}: never twice");
    }
    assert_eq!(
        second.pending("coordinator").await.unwrap(),
        (0, 0),
        "crash at {crash_at}"
    );
    assert_eq!(second.pending("analyst").await.unwrap(), (0, 0), "crash at {crash_at}");
    second.shutdown().await;
    commits
}

/// Goal: every accepted delegation resolves exactly once, no acknowledged message is
/// lost and none is processed twice, with the process crashing at every commit of the
/// protocol (each crash point: the k-th commit applied but not acknowledged, nothing
/// after), then restarting on the same data.
#[tokio::test(start_paused = true)]
async fn delegate_and_notify_survive_a_crash_at_every_commit_of_the_protocol() {
    let commits = run_with_crash(0, Arc::new(MemoryStore::new())).await;
    // The crash points, in the order the fault-free run commits them (docs/architecture.md);
    // a turn's messages are one log entry, keyed by its last message. Each agent's first
    // commit marks its task index (`task_index_version`): it has no record to index.
    let expected = [
        "coordinator: log/3 outbox/0 pair_out/analyst task/coordinator.0 task_due/coordinator.0 task_index_version",
        "analyst: inbox/0 pair_in/coordinator task_index_version tasks_in/coordinator.0",
        "analyst: -inbox/0 log/1 outbox/0 pair_in/coordinator -tasks_in/coordinator.0",
        "coordinator: -outbox/0 pair_out/analyst",
        "coordinator: inbox/0 task/coordinator.0 -task_due/coordinator.0 task_end/coordinator.0",
        "coordinator: -inbox/0 log/5",
        "analyst: -outbox/0",
        "analyst: dedupe_slot/0 inbox/1 seen/n-1",
        "analyst: -inbox/1 log/3",
    ];
    // Paused tokio has one order. The simulator's order depends on the seed (the external
    // note may reach the analyst before the relayed task, swapping their inbox and log
    // positions), so there the same nine commits are checked as a set, for either order.
    #[cfg(not(madsim))]
    assert_eq!(commits, expected);
    #[cfg(madsim)]
    {
        let sorted = |list: &[&str]| {
            let mut list: Vec<String> = list.iter().map(|s| s.to_string()).collect();
            list.sort();
            list
        };
        let note_first = [
            "coordinator: log/3 outbox/0 pair_out/analyst task/coordinator.0 task_due/coordinator.0 task_index_version",
            "analyst: dedupe_slot/0 inbox/0 seen/n-1 task_index_version",
            "analyst: inbox/1 pair_in/coordinator tasks_in/coordinator.0",
            "analyst: -inbox/0 log/1",
            "analyst: -inbox/1 log/3 outbox/0 pair_in/coordinator -tasks_in/coordinator.0",
            "coordinator: -outbox/0 pair_out/analyst",
            "coordinator: inbox/0 task/coordinator.0 -task_due/coordinator.0 task_end/coordinator.0",
            "coordinator: -inbox/0 log/5",
            "analyst: -outbox/0",
        ];
        let mut actual = commits.clone();
        actual.sort();
        assert!(
            actual == sorted(&expected) || actual == sorted(&note_first),
            "{commits:#?}"
        );
    }
    for crash_at in 1..=commits.len() as u64 {
        run_with_crash(crash_at, Arc::new(MemoryStore::new())).await;
    }
}

/// Goal: the same crash points on the SQLite store (one in-memory database shared by
/// the crashed system and its successor).
#[tokio::test(start_paused = true)]
async fn delegate_and_notify_survive_a_crash_at_every_commit_in_sqlite() {
    let sqlite = || Arc::new(SqliteStore::open_in_memory().unwrap()) as Arc<dyn StateStore>;
    let commits = run_with_crash(0, sqlite()).await;
    assert_eq!(commits.len(), 9);
    for crash_at in 1..=commits.len() as u64 {
        run_with_crash(crash_at, sqlite()).await;
    }
}

/// Goal: on tokio's multi-thread runtime, many concurrent notifications and delegations
/// between four agents (each delegating to the next, notifying the one after) are each
/// processed exactly once and every delegation resolves completed exactly once.
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_notifications_and_delegations_on_the_multi_thread_runtime_are_processed_once() {
    const AGENTS: [&str; 4] = ["a0", "a1", "a2", "a3"];
    const ROUNDS: usize = 10;
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::any_agent()
                .on_user_containing("[task")
                .reply("done {input}"),
        )
        .rule(
            ScriptRule::any_agent()
                .on_user_containing("[notification")
                .reply("noted"),
        )
        .rule(
            ScriptRule::any_agent()
                .on_user_containing("you delegated is")
                .reply("thanks"),
        )
        .without_recording();
    let recorder = CallRecorder::new();
    let system = start(&llm, &AGENTS, Arc::new(MemoryStore::new()), &recorder);
    let mut handles = Vec::new();
    for round in 0..ROUNDS {
        for (i, agent) in AGENTS.iter().enumerate() {
            let client = system.client();
            let next = AGENTS[(i + 1) % AGENTS.len()];
            let after = AGENTS[(i + 2) % AGENTS.len()];
            handles.push(tokio::spawn(async move {
                let task = client
                    .delegate(agent, next, &format!("job {agent}-{round}"), None)
                    .await
                    .unwrap();
                let note = format!("note {agent}-{round}");
                client.notify_as(agent, after, &note).await.unwrap();
                client
                    .notify_with_id(
                        after,
                        &format!("ext-{agent}-{round}"),
                        &format!("ext {agent}-{round}"),
                        None,
                    )
                    .await
                    .unwrap();
                (agent.to_string(), task)
            }));
        }
    }
    let mut tasks = Vec::new();
    for handle in handles {
        tasks.push(handle.await.unwrap());
    }
    // Real time here: wait until every inbox and outbox is empty (bounded).
    for _ in 0..200 {
        let mut pending = 0;
        for agent in AGENTS {
            let (inbox, outbox) = system.pending(agent).await.unwrap();
            pending += inbox + outbox;
        }
        if pending == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for (agent, task) in &tasks {
        let status = system.task(agent, task).await.unwrap().unwrap();
        assert_eq!(status.state, TaskState::Completed, "{agent} {task}");
    }
    for (i, agent) in AGENTS.iter().enumerate() {
        let log = system.conversation_log(agent).await.unwrap();
        let before = AGENTS[(i + AGENTS.len() - 1) % AGENTS.len()];
        let two_before = AGENTS[(i + AGENTS.len() - 2) % AGENTS.len()];
        for round in 0..ROUNDS {
            assert_eq!(user_messages_containing(&log, &format!("job {before}-{round}")), 1);
            assert_eq!(user_messages_containing(&log, &format!("note {two_before}-{round}")), 1);
            assert_eq!(user_messages_containing(&log, &format!("ext {two_before}-{round}")), 1);
        }
        assert_eq!(user_messages_containing(&log, "you delegated is completed"), ROUNDS);
        assert_eq!(system.pending(agent).await.unwrap(), (0, 0));
    }
    system.shutdown().await;
}

/// Goal: a full inbox refuses at append time with `Full` and keeps nothing, never drops
/// an acknowledged entry. Method: while the analyst is in a 5 s turn, 300 appends queue
/// in its (enlarged) mailbox; they then run back to back, before any processing turn
/// (those are told to the back of the mailbox), so exactly 256 fill the inbox and 44
/// are refused.
#[tokio::test(start_paused = true)]
async fn a_full_inbox_refuses_at_append_time_and_every_acknowledged_entry_is_processed() {
    const SENT: usize = 300;
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("analyst")
                .on_user_containing("hold")
                .reply("held")
                .latency(Duration::from_secs(5)),
        )
        .rule(
            ScriptRule::agent("analyst")
                .on_user_containing("[notification")
                .reply("noted")
                .latency(Duration::from_millis(100)),
        )
        .without_recording();
    let system = AgentSystem::builder()
        .llm(Arc::new(llm))
        .agent(AgentSpec::new("analyst"))
        .kind_config(troupe_runtime::KindConfig::default().with_mailbox_capacity(1_024))
        .start()
        .unwrap();
    let client = system.client();
    let hold = tokio::spawn(async move { client.ask("analyst", "hold").await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut sends = Vec::new();
    for i in 0..SENT {
        let client = system.client();
        sends.push(tokio::spawn(async move {
            client
                .notify_with_id("analyst", &format!("n{i}"), &format!("note {i};"), Some(300_000))
                .await
        }));
    }
    let mut accepted = Vec::new();
    let mut full = Vec::new();
    for (i, send) in sends.into_iter().enumerate() {
        match send.await.unwrap() {
            Ok(()) => accepted.push(i),
            Err(InboxError::Full { capacity, .. }) => {
                assert_eq!(capacity, troupe_agent::limits::AGENT_INBOX_CAPACITY);
                full.push(i);
            }
            Err(other) => panic!("{other}"),
        }
    }
    assert_eq!(hold.await.unwrap().unwrap().text, "held");
    assert_eq!((accepted.len(), full.len()), (256, 44));
    tokio::time::sleep(Duration::from_secs(60)).await;
    let log = system.conversation_log("analyst").await.unwrap();
    assert_eq!(user_messages_containing(&log, "[notification"), 256);
    for i in accepted {
        assert_eq!(user_messages_containing(&log, &format!("note {i};")), 1, "note {i}");
    }
    for i in full {
        assert_eq!(user_messages_containing(&log, &format!("note {i};")), 0, "note {i}");
    }
    assert_eq!(system.pending("analyst").await.unwrap(), (0, 0));
    system.shutdown().await;
}

/// Goal: the chain travels with the task: the delegatee cannot delegate back to its
/// delegator (refused as a cycle), so a delegate ping-pong is refused at the first
/// bounce, and the refusal reaches the delegator as the task's result.
#[tokio::test(start_paused = true)]
async fn a_task_cannot_be_delegated_back_to_its_delegator() {
    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("analyst").on_user_containing("[task").call(
            "delegate_to_agent",
            json!({"agent_id": "coordinator", "message": "you do it"}),
        ))
        .rule(ScriptRule::agent("analyst").on_tool_result().reply("{tool_result}"))
        .rule(
            ScriptRule::agent("coordinator")
                .on_user_containing("you delegated is")
                .reply("ok"),
        );
    let recorder = CallRecorder::new();
    let system = start(
        &llm,
        &["coordinator", "analyst"],
        Arc::new(MemoryStore::new()),
        &recorder,
    );
    let task = system.delegate("coordinator", "analyst", "work", None).await.unwrap();
    settle().await;
    let status = system.task("coordinator", &task).await.unwrap().unwrap();
    assert_eq!(status.state, TaskState::Completed);
    assert_eq!(
        status.result.as_deref(),
        Some(
            "error: delegate_to_agent failed: refused: cycle detected: agent/coordinator -> agent/analyst -> \
             agent/coordinator (an agent in a call chain cannot be called again until it answers)"
        )
    );
    assert_eq!(system.pending("coordinator").await.unwrap(), (0, 0));
    system.shutdown().await;
}

/// Goal: a delegated task whose model is slower than the task's deadline is ended by
/// the model loop's own timer at that deadline, not by the runtime's cut of the whole
/// turn a grace later (which would commit nothing): the task resolves failed with the
/// timeout, once, soon after its deadline, and the delegator hears of it. Method: the
/// analyst's model takes 5 s on a task of 1 s; the task is read half-way through the
/// grace. (With the model loop running without its timer, the task is still open then.)
#[tokio::test(start_paused = true)]
async fn a_task_whose_model_outlives_its_deadline_fails_at_the_deadline() {
    const TASK_TIMEOUT_MS: u64 = 1_000;
    let system = coordinator_and_analyst(
        ScriptedLlm::new().rule(
            ScriptRule::agent("analyst")
                .on_user_containing("[task")
                .reply("too late")
                .latency(Duration::from_secs(5)),
        ),
    );
    let task = system
        .delegate("coordinator", "analyst", "crunch", Some(TASK_TIMEOUT_MS))
        .await
        .unwrap();
    // Half of the processing turn's grace past the task's deadline.
    tokio::time::sleep(Duration::from_millis(TASK_TIMEOUT_MS + 500)).await;
    let status = system.task("coordinator", &task).await.unwrap().unwrap();
    assert_eq!(status.state, TaskState::Failed, "{status:?}");
    let result = status.result.unwrap_or_default();
    assert!(result.contains("timed out") || result.contains("timeout"), "{result}");
    settle().await;
    let coordinator = system.conversation_log("coordinator").await.unwrap();
    assert_eq!(user_messages_containing(&coordinator, "you delegated is failed"), 1);
    let analyst = system.conversation_log("analyst").await.unwrap();
    assert!(
        analyst.iter().all(|message| message.content != "too late"),
        "the late answer was logged"
    );
    system.shutdown().await;
}

/// Buffers `writes` into `agent`'s key space as one commit, as a process of an older
/// version would have left them (its state blob untouched).
async fn write_as_stored(store: &MemoryStore, agent: &str, writes: &[(&str, String)]) {
    let id = troupe_agent::agent_id(agent).unwrap();
    let claimed = store.claim(&id).await.unwrap();
    let commit = TurnCommit {
        state: troupe_runtime::StateChange::Unchanged,
        writes: writes
            .iter()
            .map(|(key, value)| (key.to_string(), Some(Bytes::from(value.clone()))))
            .collect(),
    };
    store.commit(&id, claimed.fence, commit).await.unwrap();
}

/// Goal: the inbox records an older version stored as JSON (before the binary format
/// of 2026-12-01) still load end to end: b's pending inbox entry with its `pair_in`
/// record is processed, and a's pending outbox entry with its `pair_out` record is
/// delivered to c, processed there, and taken off a's outbox and pending list; a's task
/// record reads as it was. Method: the records are written into the store as that
/// version wrote them (its JSON, copied from a store), then a resume finds them.
#[tokio::test(start_paused = true)]
async fn inbox_records_stored_as_json_by_an_older_version_still_load() {
    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("b").on_user_containing("left in").reply("seen"))
        .rule(ScriptRule::agent("c").on_user_containing("left in").reply("seen"));
    let data = MemoryStore::new();
    let system = start(
        &llm,
        &["a", "b", "c"],
        Arc::new(data.clone()) as Arc<dyn StateStore>,
        &CallRecorder::new(),
    );
    let deadline = system.runtime().now().as_micros() + 60_000_000;
    let context = format!(
        r#"{{"depth":1,"chain":[{{"kind":"agent","key":"a"}}],"deadline":{{"at_us":{deadline}}},"trace_id":null}}"#
    );
    let entry = |msg_id: &str, text: &str, seq: u64| {
        format!(
            r#"{{"msg_id":"{msg_id}","from":{{"kind":"agent","key":"a"}},"body":{{"Notify":{{"text":"{text}"}}}},"context":{context},"budget":{{"tokens":null,"tool_calls":null}},"pair":{{"seq":{seq},"low":{seq}}}}}"#
        )
    };
    let first = format!("{:020}", 0);
    let pair_out = r#"{"next":1,"pending":[0]}"#.to_string();
    write_as_stored(
        &data,
        "b",
        &[
            (&format!("inbox/{first}"), entry("a.7", "left in the inbox", 0)),
            ("pair_in/a", r#"{"expected":1,"unprocessed":[0]}"#.to_string()),
            ("seen/a.7", String::new()),
        ],
    )
    .await;
    let out = format!(
        r#"{{"to":{{"kind":"agent","key":"c"}},"entry":{},"approval":null}}"#,
        entry("a.8", "left in the outbox", 0)
    );
    write_as_stored(
        &data,
        "a",
        &[
            (&format!("outbox/{first}"), out),
            ("pair_out/c", pair_out.clone()),
            (
                "task/a.9",
                r#"{"task_id":"a.9","to":{"kind":"agent","key":"b"},"state":"Completed","result":"42","deadline":{"at_us":5},"context":{"depth":0,"chain":[],"deadline":{"at_us":5},"trace_id":null}}"#.to_string(),
            ),
        ],
    )
    .await;

    // (The start-up resume may have found some of them already.)
    system.resume_pending().await.unwrap();
    settle().await;

    let processed = |log: &[ChatMessage], text: &str| user_messages_containing(log, text);
    let b_log = system.conversation_log("b").await.unwrap();
    assert_eq!(
        processed(&b_log, "left in the inbox"),
        1,
        "b processed its JSON entry once"
    );
    let c_log = system.conversation_log("c").await.unwrap();
    assert_eq!(
        processed(&c_log, "left in the outbox"),
        1,
        "a's JSON entry reached c once"
    );
    let a = troupe_agent::agent_id("a").unwrap();
    let b = troupe_agent::agent_id("b").unwrap();
    assert!(
        data.scan(&a, "outbox/", None, 10).await.unwrap().is_empty(),
        "delivered"
    );
    assert!(data.scan(&b, "inbox/", None, 10).await.unwrap().is_empty(), "processed");
    let released = data.get(&a, "pair_out/c").await.unwrap().unwrap();
    assert_ne!(
        released,
        Bytes::from(pair_out),
        "a's pending list was rewritten without it"
    );
    system.shutdown().await;
}

/// Goal: a task id no delegation can have (longer than `AGENT_TASK_ID_LENGTH_MAX_BYTES`,
/// the longest `{agent}.{seq}`) names no task: `cancel` is `UnknownTask` and `task` is
/// `None`, as for any other unknown id, not a storage failure of a key too long for
/// the store; the agent still answers after. Method: the id of `STATE_KEY_LENGTH_MAX`
/// bytes, and one just over the limit.
#[tokio::test(start_paused = true)]
async fn a_task_id_longer_than_any_task_id_names_no_task() {
    let system = coordinator_and_analyst(ScriptedLlm::new().rule(ScriptRule::any_agent().reply("ok")));
    for length in [
        troupe_agent::limits::AGENT_TASK_ID_LENGTH_MAX_BYTES + 1,
        troupe_runtime::STATE_KEY_LENGTH_MAX,
    ] {
        let id = "c".repeat(length);
        assert_eq!(
            system.cancel("coordinator", &id).await,
            Err(InboxError::UnknownTask {
                agent: ActorId::new("agent", "coordinator").unwrap(),
                task_id: id.clone(),
            }),
            "{length} bytes"
        );
        assert_eq!(system.task("coordinator", &id).await, Ok(None), "{length} bytes");
    }
    assert_eq!(system.ask("coordinator", "hi").await.unwrap().text, "ok");
    system.shutdown().await;
}
