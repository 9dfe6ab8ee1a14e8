//! Three edges an embedder hits around agents that change while the system runs.
//!
//! - A config file applied to a running system (`AgentClient::apply_config`) may name a
//!   tool an attached MCP server lists now, as `define_agent` may; a name no one lists
//!   is refused with `AgentSpecError::UnknownTool` naming the attached servers, at the
//!   file's line and column, and nothing is applied.
//! - A task still in its delegator's outbox when its target is removed (the delivery
//!   waits: the target's mailbox is full) ends `rejected` once, and the reason says the
//!   target was removed and what to do ("define it again"), as its draining activation
//!   says when it refuses an append.
//! - An external task (`AgentClient::delegate_external`) waiting in a removed agent's
//!   inbox is ended by the drain: `rejected` in its record with the reason "agent X was
//!   removed before it worked this task", once; the one the agent was working at the
//!   removal completes.
//!
//! Method: the real runtime and store, scripted models; an rmcp server in-process over
//! streamable HTTP on loopback for the first (`support/mcp_setup.rs`'s
//! `ChangingServer`). The removal tests run on paused time (the simulator in the madsim
//! build) and on tokio's multi-thread runtime; the MCP test on tokio's current-thread
//! and multi-thread runtimes, never simulated.
//!
//! Run: `cargo nextest run -p troupe-agent --test removal_leftovers` (and with
//! `CARGO_TARGET_DIR=target/madsim RUSTFLAGS="--cfg madsim"` for the simulator).

use std::sync::Arc;
use std::time::Duration;

use troupe_agent::{
    AgentCallError, AgentEvent, AgentSpec, AgentSystem, ChatMessage, ExternalTaskRequest, Role, ScriptRule,
    ScriptedLlm, TaskState,
};
use troupe_core::InvokeError;
use troupe_runtime::{KindConfig, MemoryStore};

/// How long the worker's model takes on anything.
const WORK_MS: u64 = 2_000;
/// The tasks' timeout: far longer than any wait below, so no task ends by its deadline.
const TASK_TIMEOUT_MS: u64 = 60_000;
/// How long, after the removal, every task may take to end.
const ENDED_WITHIN_MS: u64 = 5_000;
/// How often the tests look again.
const POLL_MS: u64 = 20;
/// The worker's mailbox in the outbox test: its running turn plus this many waiting
/// messages, and a delivery is refused `Busy` (and retried).
const MAILBOX: usize = 1;
/// What a delivery to the removed worker is refused with, and so its task's reason.
const REMOVED_REFUSAL: &str = "agent/worker rejected the request: agent worker was removed; define it again to call it";
/// The reason the drain rejects an unworked task of the removed worker with.
const REMOVED_BEFORE_WORK: &str = "agent worker was removed before it worked this task";

fn user_messages_containing(log: &[ChatMessage], needle: &str) -> usize {
    log.iter()
        .filter(|m| m.role == Role::User && m.content.contains(needle))
        .count()
}

/// `boss` and a slow `worker` (each of its turns takes `WORK_MS`), agents' mailboxes of
/// `mailbox`.
fn boss_and_slow_worker(mailbox: usize) -> AgentSystem {
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("worker")
                .reply("done {input}")
                .latency(Duration::from_millis(WORK_MS)),
        )
        .rule(ScriptRule::agent("boss").reply("seen"));
    AgentSystem::builder()
        .store(Arc::new(MemoryStore::new()))
        .llm(Arc::new(llm))
        .agent(AgentSpec::new("boss"))
        .agent(AgentSpec::new("worker"))
        .kind_config(KindConfig::default().with_mailbox_capacity(mailbox))
        .start()
        .expect("the system starts")
}

/// Waits for the `n`-th model turn of `worker` to start from now (counted on `events`).
async fn worker_turn_started(events: &mut tokio::sync::broadcast::Receiver<AgentEvent>, n: usize) {
    let mut seen = 0;
    let started = async {
        loop {
            if let Ok(AgentEvent::TurnStarted { agent, .. }) = events.recv().await {
                if agent.key() == "worker" {
                    seen += 1;
                    if seen == n {
                        break;
                    }
                }
            }
        }
    };
    tokio::time::timeout(Duration::from_millis(2 * WORK_MS), started)
        .await
        .unwrap_or_else(|_| panic!("the worker's model turn {n} starts within {} ms", 2 * WORK_MS));
}

/// Waits (bounded by `ENDED_WITHIN_MS`) until `read` gives a final state, and returns it
/// with its text.
async fn ended<F, Fut>(what: &str, mut read: F) -> (TaskState, String)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<(TaskState, Option<String>)>>,
{
    let mut last = None;
    let wait = async {
        loop {
            last = read().await;
            if let Some((state, text)) = &last {
                if state.is_final() {
                    break (*state, text.clone().unwrap_or_default());
                }
            }
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
    };
    match tokio::time::timeout(Duration::from_millis(ENDED_WITHIN_MS), wait).await {
        Ok(end) => end,
        Err(_) => panic!("{what} still open {ENDED_WITHIN_MS} ms after the removal: {last:?}"),
    }
}

/// The outbox scenario: the worker runs a turn with one ask waiting behind it (its
/// mailbox is full), the boss delegates a task to it (its delivery is refused `Busy`
/// and retried), the worker is removed: the task ends `rejected` with
/// [`REMOVED_REFUSAL`], the boss reads that end once, and every box is empty.
async fn a_task_left_in_the_outbox_ends_saying_its_target_was_removed() {
    let system = boss_and_slow_worker(MAILBOX);
    let mut events = system.subscribe();
    let first = system.client();
    let running = tokio::spawn(async move { first.ask("worker", "first").await });
    worker_turn_started(&mut events, 1).await;
    let second = system.client();
    let waiting = tokio::spawn(async move { second.ask("worker", "second").await });
    // Full once the second ask waits: one more message is refused at once.
    let full = async {
        loop {
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
            if let Err(AgentCallError::Invoke(InvokeError::Busy { .. })) = system.ask("worker", "third").await {
                break;
            }
        }
    };
    tokio::time::timeout(Duration::from_millis(WORK_MS / 2), full)
        .await
        .expect("the worker's mailbox is full while its first turn runs");

    let mut finished = system.subscribe();
    let task = system
        .delegate("boss", "worker", "job.", Some(TASK_TIMEOUT_MS))
        .await
        .expect("acknowledged: in the boss's outbox");
    assert_eq!(
        system.pending("boss").await.unwrap().1,
        1,
        "the task waits in the boss's outbox"
    );
    system.remove_agent("worker").await.expect("removed");

    let (state, reason) = ended("the task", || async {
        let status = system.task("boss", &task).await.unwrap()?;
        Some((status.state, status.result))
    })
    .await;
    assert_eq!((state, reason.as_str()), (TaskState::Rejected, REMOVED_REFUSAL));
    // Its first turn answers; the ask waiting behind it is refused by the drain.
    assert_eq!(running.await.unwrap().expect("answered").text, "done first");
    let refused = waiting.await.unwrap().expect_err("refused");
    assert!(
        refused
            .to_string()
            .contains("agent worker was removed; define it again to call it"),
        "{refused}"
    );
    let settled = async {
        while system.pending("boss").await.unwrap() != (0, 0) {
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
    };
    tokio::time::timeout(Duration::from_millis(ENDED_WITHIN_MS), settled)
        .await
        .expect("the boss's boxes end empty");
    let boss = system.conversation_log("boss").await.unwrap();
    assert_eq!(
        user_messages_containing(&boss, &format!("[task {task} you delegated is")),
        1,
        "{boss:#?}"
    );
    let mut ends = 0;
    while let Ok(event) = finished.try_recv() {
        if let AgentEvent::DelegationFinished { task_id, state, .. } = event {
            if task_id == task {
                assert_eq!(state, TaskState::Rejected);
                ends += 1;
            }
        }
    }
    assert_eq!(ends, 1, "one DelegationFinished for the task");
    let worker = system.conversation_log("worker").await.unwrap();
    assert_eq!(user_messages_containing(&worker, "job."), 0, "never worked");
    system.shutdown().await;
}

/// Goal: a task still in the delegator's outbox when its target is removed ends
/// `rejected` once with a reason that says the target was removed and what to do, on
/// paused time (the simulator in the madsim build). Before: `rejected` with "call
/// refused: agent agent/worker not found".
#[tokio::test(start_paused = true)]
async fn a_task_in_the_delegators_outbox_when_its_target_is_removed_ends_saying_so() {
    a_task_left_in_the_outbox_ends_saying_its_target_was_removed().await;
}

/// Goal: the same on tokio's multi-thread runtime (real time).
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_task_in_the_delegators_outbox_when_its_target_is_removed_ends_saying_so_on_worker_threads() {
    a_task_left_in_the_outbox_ends_saying_its_target_was_removed().await;
}

/// An external task's request with message id `msg_id` and text `text`.
fn external(msg_id: &str, text: &str) -> ExternalTaskRequest {
    ExternalTaskRequest {
        origin: "test".to_string(),
        msg_id: msg_id.to_string(),
        text: text.to_string(),
        timeout_ms: Some(TASK_TIMEOUT_MS),
        ..ExternalTaskRequest::default()
    }
}

/// The external scenario: two external tasks reach the worker's inbox behind a running
/// ask; the worker is removed during its turn on the first of them: that one completes
/// with its answer, the other ends `rejected` with [`REMOVED_BEFORE_WORK`] in its
/// record, never worked; the worker's inbox ends empty.
async fn an_external_task_in_the_inbox_is_ended_by_the_drain() {
    let system = boss_and_slow_worker(troupe_core::limits::MAILBOX_CAPACITY_DEFAULT);
    let mut events = system.subscribe();
    let client = system.client();
    let warm_up = tokio::spawn(async move { client.ask("worker", "warm up").await });
    worker_turn_started(&mut events, 1).await;
    // Both appends wait behind the warm-up turn.
    let mut sends = Vec::new();
    for i in 0..2 {
        let client = system.client();
        sends.push(tokio::spawn(async move {
            client
                .delegate_external("worker", external(&format!("m-{i}"), &format!("ext-{i}.")))
                .await
        }));
    }
    let mut tasks = Vec::new();
    for send in sends {
        tasks.push(send.await.unwrap().expect("kept in the worker's inbox"));
    }
    warm_up.await.unwrap().expect("the warm-up is answered");
    // The worker's turn on the first of them runs; the other waits in its inbox.
    worker_turn_started(&mut events, 1).await;
    assert_eq!(system.pending("worker").await.unwrap().0, 2, "both in the inbox");
    system.remove_agent("worker").await.expect("removed");

    let mut ends = Vec::new();
    for task in &tasks {
        let end = ended(task, || async {
            let record = system.external_task("worker", task).await.unwrap()?;
            Some((record.state, record.result))
        })
        .await;
        ends.push(end);
    }
    let settled = async {
        while system.pending("worker").await.unwrap() != (0, 0) {
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
    };
    tokio::time::timeout(Duration::from_millis(ENDED_WITHIN_MS), settled)
        .await
        .expect("the worker's boxes end empty");
    let log = system.conversation_log("worker").await.unwrap();
    let worked: Vec<usize> = (0..2)
        .map(|i| user_messages_containing(&log, &format!("ext-{i}.")))
        .collect();
    assert_eq!(worked.iter().sum::<usize>(), 1, "one worked, once: {worked:?}");
    for (i, (task, end)) in tasks.iter().zip(&ends).enumerate() {
        if worked[i] == 1 {
            assert_eq!(end.0, TaskState::Completed, "{task}: {end:?}");
            assert!(end.1.starts_with("done "), "{task}: {end:?}");
        } else {
            assert_eq!(
                (end.0, end.1.as_str()),
                (TaskState::Rejected, REMOVED_BEFORE_WORK),
                "{task}"
            );
        }
    }
    system.shutdown().await;
}

/// Goal: the drain ends an external task waiting in a removed agent's inbox, once, in
/// its record, on paused time (the simulator in the madsim build).
#[tokio::test(start_paused = true)]
async fn an_external_task_in_a_removed_agents_inbox_ends_rejected_once() {
    an_external_task_in_the_inbox_is_ended_by_the_drain().await;
}

/// Goal: the same on tokio's multi-thread runtime (real time).
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_external_task_in_a_removed_agents_inbox_ends_rejected_once_on_worker_threads() {
    an_external_task_in_the_inbox_is_ended_by_the_drain().await;
}

/// The config file test: a real MCP server, never simulated.
#[cfg(all(not(madsim), target_os = "linux"))]
#[path = "support/mcp_setup.rs"]
mod mcp_setup;

#[cfg(all(not(madsim), target_os = "linux"))]
mod config_tools {
    use std::sync::Arc;

    use troupe_agent::{AgentSpecError, ConfigError, OrgConfig, OrgError};

    use super::mcp_setup::{attached_system, changing_server, growing_agents, wait_for};

    /// Declares `user`, who may use `fresh` only.
    const NAMES_FRESH: &str = r#"
[[agents]]
id = "user"
tools = ["fresh"]
"#;

    /// Declares `typo`, naming a tool no one lists.
    const NAMES_A_TYPO: &str = r#"
[[agents]]
id = "typo"
tools = ["echo", "fersh"]
"#;

    /// `fresh` appears in the server's list; a config declaring an agent that names it
    /// is applied, and the agent is offered it and calls it; a config naming a tool no
    /// one lists is refused at the tool's line and column with `UnknownTool` naming the
    /// server, and nothing of it is applied.
    async fn a_config_may_name_a_tool_a_server_lists_now() {
        let (server, _shutdown) = changing_server().await;
        let llm = Arc::new(growing_agents());
        let system = attached_system(llm.clone(), &["boss"], &server);
        assert_eq!(system.ask("boss", "grow").await.unwrap().text, "result: set");
        wait_for("fresh listed", || server.tool_names().contains(&"fresh".to_owned())).await;

        let config = OrgConfig::from_toml(NAMES_FRESH, "org.toml").unwrap();
        system
            .apply_config(&config)
            .await
            .expect("a tool the server lists now may be named");
        assert_eq!(
            system.ask("user", "use fresh").await.unwrap().text,
            "result: called fresh"
        );
        let offered: Vec<String> = llm.requests_of("user")[0]
            .tools
            .iter()
            .map(|tool| tool.name.clone())
            .collect();
        assert_eq!(offered, ["fresh"]);

        let config = OrgConfig::from_toml(NAMES_A_TYPO, "org.toml").unwrap();
        let error = system
            .apply_config(&config)
            .await
            .expect_err("a name no one lists is refused");
        let OrgError::Config(ConfigError::Agent {
            line,
            column,
            field,
            error: refused,
            ..
        }) = &error
        else {
            panic!("not a refused agent in the file: {error:?}");
        };
        let AgentSpecError::UnknownTool {
            id,
            tool,
            known,
            servers,
        } = &**refused
        else {
            panic!("not UnknownTool: {refused:?}");
        };
        assert_eq!((*line, *column, field.as_str()), (4, 18, "agents[0].tools[1]"));
        assert_eq!((id.as_str(), tool.as_str()), ("typo", "fersh"));
        assert!(known.contains(&"fresh".to_owned()), "{known:?}");
        assert_eq!(servers, &["MCP server \"live\"".to_owned()]);
        assert!(
            error.to_string().starts_with(
                "org.toml:4:18: field `agents[0].tools[1]`: agent \"typo\" names tool \"fersh\", which this system \
                 does not have"
            ),
            "{error}"
        );
        assert!(
            error
                .to_string()
                .contains("no attached server lists it now (MCP server \"live\")"),
            "{error}"
        );
        assert!(!system.directory().contains("typo"), "nothing applied");
        system.shutdown().await;
    }

    /// Goal: `apply_config` accepts a tool an attached server lists now, as
    /// `define_agent` does, and refuses an unknown one with `UnknownTool` naming the
    /// servers. Before (the tools checked against the catalog made at start only): the
    /// first config was refused at `org.toml:4:10`, field `agents[0].tools[0]`, tool
    /// "fresh" unknown, registered tools `[call_agent, delegate_to_agent, echo,
    /// notify_agent, set_extra]`, no server named.
    #[tokio::test]
    async fn apply_config_accepts_a_tool_an_attached_server_lists_now() {
        a_config_may_name_a_tool_a_server_lists_now().await;
    }

    /// As above, on worker threads.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn apply_config_accepts_a_tool_an_attached_server_lists_now_on_worker_threads() {
        a_config_may_name_a_tool_a_server_lists_now().await;
    }
}

/// Goal: a request that reaches a removed agent that never stored anything (so no
/// draining activation is made for it: a delivery that read the directory just before
/// the removal, or a caller of the runtime) is refused saying it was removed and what
/// to do. Method: remove the unused worker, then ask it through the runtime, past the
/// directory check of `AgentClient::ask` (the activation is refused, so the runtime
/// reports it failed). Before: "agent/worker failed: rejected: agent worker is not in
/// the directory".
#[tokio::test(start_paused = true)]
async fn a_removed_agent_that_never_ran_is_refused_saying_it_was_removed() {
    let system = boss_and_slow_worker(troupe_core::limits::MAILBOX_CAPACITY_DEFAULT);
    system.remove_agent("worker").await.expect("removed");
    let runtime = system.runtime();
    let request = troupe_agent::AgentRequest {
        text: "hello".to_string(),
        from: None,
        call: None,
        budget: troupe_agent::Budget::UNLIMITED,
    };
    let refused = runtime
        .invoke(
            &troupe_agent::agent_id("worker").unwrap(),
            request.encode(),
            runtime.deadline_in(Duration::from_millis(ENDED_WITHIN_MS)),
        )
        .await
        .expect_err("refused");
    assert_eq!(
        refused.to_string(),
        "agent/worker failed: rejected: agent worker was removed; define it again to call it",
        "{refused:?}"
    );
    system.shutdown().await;
}
