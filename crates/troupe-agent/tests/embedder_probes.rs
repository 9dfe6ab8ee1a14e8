//! Probes of the agent layer's guarantees as an embedder meets them, through the public
//! API only (the builder, the client, the scripted model that really emits tool calls),
//! where the other test files do not already look:
//!
//! - a delegated task whose process is dropped while its delegatee's model works, and a
//!   new process on the same SQLite file: the result turn happens once;
//! - two processes on one SQLite file at once, both delegating from the same agent and
//!   resuming: every acknowledged task is worked once and its result taken once;
//! - `delegate_to_agent` and `notify_agent` called by the model with bad arguments:
//!   each is a tool error the model reads, naming what is wrong, and nothing is sent.
//!
//! The SQLite probes run on tokio's multi-thread runtime in real time (normal build);
//! the argument probe in both builds (`cargo test -p troupe-agent --test embedder_probes`,
//! and under `RUSTFLAGS="--cfg madsim"`).

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use troupe_agent::{AgentSpec, AgentSystem, ScriptRule, ScriptedLlm};
use troupe_runtime::MemoryStore;

/// Goal: a model's `delegate_to_agent` and `notify_agent` calls with bad arguments (a
/// number for the agent id, the message missing, an unknown field, an unknown agent, a
/// message longer than `AGENT_MESSAGE_SIZE_MAX_BYTES`, a timeout of 0 or a fraction, the
/// agent itself) are each answered with a tool error the model reads, naming what is
/// wrong, and nothing is queued: no task record, no outbox entry, no turn at the target.
#[tokio::test(start_paused = true)]
async fn bad_send_arguments_from_the_model_are_tool_errors_and_send_nothing() {
    let oversized = "x".repeat(troupe_agent::limits::AGENT_MESSAGE_SIZE_MAX_BYTES + 1);
    let cases: Vec<(&str, serde_json::Value, &str)> = vec![
        ("case-type", json!({"agent_id": 5, "message": "hi"}), "agent_id"),
        ("case-missing", json!({"agent_id": "b"}), "message"),
        (
            "case-unknown-field",
            json!({"agent_id": "b", "message": "hi", "urgent": true}),
            "urgent",
        ),
        (
            "case-unknown-agent",
            json!({"agent_id": "ghost", "message": "hi"}),
            "ghost",
        ),
        (
            "case-oversized",
            json!({"agent_id": "b", "message": oversized}),
            "message",
        ),
        (
            "case-zero-timeout",
            json!({"agent_id": "b", "message": "hi", "timeout_ms": 0}),
            "timeout_ms",
        ),
        (
            "case-fraction",
            json!({"agent_id": "b", "message": "hi", "timeout_ms": 1.5}),
            "timeout_ms",
        ),
        ("case-self", json!({"agent_id": "a", "message": "hi"}), "cycle"),
        (
            "case-bad-id",
            json!({"agent_id": "no/slash", "message": "hi"}),
            "no/slash",
        ),
    ];
    for tool in ["delegate_to_agent", "notify_agent"] {
        let mut llm = ScriptedLlm::new().rule(ScriptRule::agent("a").on_tool_result().reply("{tool_result}"));
        for (needle, arguments, _) in &cases {
            llm = llm.rule(
                ScriptRule::agent("a")
                    .on_user_containing(*needle)
                    .call(tool, arguments.clone()),
            );
        }
        let llm = llm.rule(ScriptRule::agent("b").reply("b was reached"));
        let system = AgentSystem::builder()
            .store(Arc::new(MemoryStore::new()))
            .llm(Arc::new(llm.clone()))
            .agent(AgentSpec::new("a"))
            .agent(AgentSpec::new("b"))
            .start()
            .expect("the system starts");
        for (needle, _, named) in &cases {
            let reply = tokio::time::timeout(Duration::from_secs(60), system.ask("a", needle))
                .await
                .expect("answered within 60 s")
                .expect("the turn ends with the tool's error as the model's answer");
            assert!(
                reply.text.contains("error") && reply.text.contains(named),
                "{tool} {needle}: the model read {:?}, which does not name {named:?}",
                reply.text
            );
        }
        // Whatever was queued would have been delivered by now (paused time).
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert_eq!(system.pending("a").await.unwrap(), (0, 0), "{tool}");
        assert_eq!(system.pending("b").await.unwrap(), (0, 0), "{tool}");
        assert!(llm.requests_of("b").is_empty(), "{tool}: b was reached");
        assert_eq!(
            system.task("a", "a.0").await.unwrap(),
            None,
            "{tool}: a task record was written"
        );
        system.shutdown().await;
    }
}

/// Waits (bounded, paused time) until `agent`'s log holds an assistant message
/// containing `needle`; that message.
async fn answered(system: &AgentSystem, agent: &str, needle: &str) -> String {
    let wait = async {
        loop {
            let log = system.conversation_log(agent).await.unwrap();
            if let Some(found) = log
                .iter()
                .find(|m| m.role == troupe_agent::Role::Assistant && m.content.contains(needle))
            {
                break found.content.clone();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(600), wait)
        .await
        .unwrap_or_else(|_| panic!("{agent} never answered with {needle:?}"))
}

/// Goal: a chain of delegations is bounded at depth 5 as a chain of calls is: d0 (asked
/// from outside, depth 0) delegates to d1, whose task turn delegates to d2, ...; d5's
/// task turn (depth 5) is refused `DepthExceeded` naming the limit, d6 never runs, and
/// the four delegations before it each end `completed` back at their delegator.
#[tokio::test(start_paused = true)]
async fn a_chain_of_delegations_stops_at_depth_five() {
    let names: Vec<String> = (0..7).map(|i| format!("d{i}")).collect();
    let mut llm = ScriptedLlm::new();
    for i in 0..6 {
        llm = llm
            .rule(
                ScriptRule::agent(names[i].clone())
                    .on_user_containing("you delegated is")
                    .reply("result seen"),
            )
            .rule(
                ScriptRule::agent(names[i].clone())
                    .on_tool_result()
                    .reply(format!("{} sent: {{tool_result}}", names[i])),
            )
            .rule(
                ScriptRule::agent(names[i].clone())
                    .on_user_containing(if i == 0 { "start" } else { "[task" })
                    .call(
                        "delegate_to_agent",
                        json!({"agent_id": names[i + 1], "message": format!("hop {}", i + 1)}),
                    ),
            );
    }
    let llm = llm.rule(ScriptRule::agent("d6").reply("unreachable"));
    let mut builder = AgentSystem::builder()
        .store(Arc::new(MemoryStore::new()))
        .llm(Arc::new(llm.clone()));
    for name in &names {
        builder = builder.agent(AgentSpec::new(name.clone()));
    }
    let system = builder.start().expect("the system starts");
    let reply = system.ask("d0", "start").await.unwrap();
    assert!(
        reply.text.starts_with("d0 sent: delegated as task d0.0"),
        "{}",
        reply.text
    );
    let refused = answered(&system, "d5", "d5 sent:").await;
    assert!(refused.contains("call depth 5 has reached the limit of 5"), "{refused}");
    for name in &names[..5] {
        let task = format!("{name}.0");
        let wait = async {
            loop {
                let status = system.task(name, &task).await.unwrap().expect("the task's record");
                if status.state.is_final() {
                    break status;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        let status = tokio::time::timeout(Duration::from_secs(600), wait).await.unwrap();
        assert_eq!(status.state, troupe_agent::TaskState::Completed, "{name}: {status:?}");
    }
    assert!(llm.requests_of("d6").is_empty(), "d6 must never run");
    system.shutdown().await;
}

/// Goal: a cycle that closes through a delegation, a call and a notification is refused
/// with the whole chain: a delegates to b; b's task turn calls c; c's turn notifies a,
/// which is in its chain: `CycleDetected` "agent/a -> agent/b -> agent/c -> agent/a",
/// read by c's model; a gets no notification, and b's call still answers.
#[tokio::test(start_paused = true)]
async fn a_cycle_through_a_delegation_a_call_and_a_notification_is_refused_with_the_chain() {
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("you delegated is")
                .reply("result seen"),
        )
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("[notification")
                .reply("unexpected"),
        )
        .rule(ScriptRule::agent("a").on_tool_result().reply("a sent: {tool_result}"))
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("start")
                .call("delegate_to_agent", json!({"agent_id": "b", "message": "work"})),
        )
        .rule(ScriptRule::agent("b").on_tool_result().reply("b got: {tool_result}"))
        .rule(
            ScriptRule::agent("b")
                .on_user_containing("[task")
                .call("call_agent", json!({"agent_id": "c", "message": "help"})),
        )
        .rule(ScriptRule::agent("c").on_tool_result().reply("c sent: {tool_result}"))
        .rule(
            ScriptRule::agent("c")
                .on_user_containing("help")
                .call("notify_agent", json!({"agent_id": "a", "message": "loop"})),
        );
    let system = AgentSystem::builder()
        .store(Arc::new(MemoryStore::new()))
        .llm(Arc::new(llm.clone()))
        .agent(AgentSpec::new("a"))
        .agent(AgentSpec::new("b"))
        .agent(AgentSpec::new("c"))
        .start()
        .expect("the system starts");
    system.ask("a", "start").await.unwrap();
    let b = answered(&system, "b", "b got:").await;
    assert!(
        b.contains(
            "c sent: error: notify_agent failed: refused: cycle detected: agent/a -> agent/b -> agent/c -> agent/a"
        ),
        "{b}"
    );
    answered(&system, "a", "result seen").await;
    assert!(
        llm.requests_of("a")
            .iter()
            .all(|r| r.messages.iter().all(|m| !m.content.contains("[notification"))),
        "a was notified"
    );
    system.shutdown().await;
}

/// Goal: a timeout of 0 ms given to the Rust API's sends (`delegate`, `delegate_with`,
/// `notify_with_id`, `notify_with`, `delegate_external`) is refused as `call_agent`'s
/// and the tools' are, `InvalidTimeout`, and nothing is sent or kept; 1 ms is taken.
/// Before: each was taken as a 1 ms deadline and acknowledged, so the task or
/// notification was kept and then failed or dropped unworked.
#[tokio::test(start_paused = true)]
async fn a_zero_timeout_given_to_the_api_is_refused_and_sends_nothing() {
    use troupe_agent::{DelegateOptions, ExternalTaskRequest, InboxError, NotifyOptions};
    use troupe_core::CallRefused;
    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("b").reply("b was reached"))
        .rule(ScriptRule::agent("a").reply("seen"));
    let system = AgentSystem::builder()
        .store(Arc::new(MemoryStore::new()))
        .llm(Arc::new(llm.clone()))
        .agent(AgentSpec::new("a"))
        .agent(AgentSpec::new("b"))
        .start()
        .expect("the system starts");
    let external = ExternalTaskRequest {
        origin: "probe".into(),
        msg_id: "ext-0".into(),
        text: "x".into(),
        timeout_ms: Some(0),
        ..ExternalTaskRequest::default()
    };
    let results = [
        ("delegate", system.delegate("a", "b", "x", Some(0)).await),
        (
            "delegate_with",
            system
                .delegate_with("a", "b", "x", DelegateOptions::default().timeout_ms(0))
                .await,
        ),
        (
            "notify_with_id",
            system
                .notify_with_id("b", "m-0", "x", Some(0))
                .await
                .map(|()| String::new()),
        ),
        (
            "notify_with",
            system
                .notify_with(
                    "b",
                    "x",
                    NotifyOptions {
                        timeout_ms: Some(0),
                        ..NotifyOptions::default()
                    },
                )
                .await,
        ),
        ("delegate_external", system.delegate_external("b", external).await),
    ];
    for (api, result) in results {
        assert!(
            matches!(
                result,
                Err(InboxError::Refused(CallRefused::InvalidTimeout { requested_ms: 0 }))
            ),
            "{api}: {result:?}"
        );
    }
    // Whatever was kept would have been worked or dropped by now (paused time).
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(system.pending("a").await.unwrap(), (0, 0));
    assert_eq!(system.pending("b").await.unwrap(), (0, 0));
    assert_eq!(system.task("a", "a.0").await.unwrap(), None);
    assert!(system.external_tasks("b", None, 10).await.unwrap().is_empty());
    assert!(llm.requests_of("b").is_empty(), "b was reached");
    // The smallest timeout is taken.
    system
        .notify_with_id("b", "m-1", "x", Some(1))
        .await
        .expect("1 ms is taken");
    system.shutdown().await;
}

/// Goal: an ask given no time (`ask_with_timeout` of 0) ends at once with a typed
/// `Timeout`, asks no model and commits nothing.
#[tokio::test(start_paused = true)]
async fn an_ask_given_no_time_is_a_typed_timeout_and_asks_no_model() {
    use troupe_agent::AgentCallError;
    use troupe_core::InvokeError;
    let llm = ScriptedLlm::new().rule(ScriptRule::agent("a").reply("hello"));
    let system = AgentSystem::builder()
        .store(Arc::new(MemoryStore::new()))
        .llm(Arc::new(llm.clone()))
        .agent(AgentSpec::new("a"))
        .start()
        .expect("the system starts");
    let none = tokio::time::timeout(
        Duration::from_secs(1),
        system.ask_with_timeout("a", "go", Duration::ZERO),
    )
    .await
    .expect("no time ends at once");
    assert!(
        matches!(none, Err(AgentCallError::Invoke(InvokeError::Timeout { .. }))),
        "{none:?}"
    );
    assert!(llm.requests_of("a").is_empty(), "a's model was asked");
    assert!(system.conversation_log("a").await.unwrap().is_empty());
    assert_eq!(system.ask("a", "go").await.unwrap().text, "hello");
    system.shutdown().await;
}

/// Goal: the direct conversation that records a pair's `call_agent` exchanges is that
/// pair's alone, whatever characters the agents' ids hold: agents `a` and `b|c`, and
/// agents `a|b` and `c`, each call the other; each pair's exchange is in its own direct
/// conversation, and an agent lists only conversations it takes part in. Before the
/// fix both pairs were `dm:a|b|c`: the first pair's conversation, the second pair's
/// exchange not recorded (a definition conflict, logged) and `c` and `a|b` listed in
/// a conversation of `a` and `b|c`.
#[tokio::test(start_paused = true)]
async fn each_pair_has_its_own_direct_conversation_whatever_its_ids_hold() {
    use troupe_agent::{direct_conversation_id, Participant};
    let llm = ScriptedLlm::new()
        .rule(ScriptRule::any_agent().on_tool_result().reply("{tool_result}"))
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("go")
                .call("call_agent", json!({"agent_id": "b|c", "message": "from a"})),
        )
        .rule(
            ScriptRule::agent("a|b")
                .on_user_containing("go")
                .call("call_agent", json!({"agent_id": "c", "message": "from a|b"})),
        )
        .rule(ScriptRule::agent("b|c").reply("b|c answers"))
        .rule(ScriptRule::agent("c").reply("c answers"));
    let mut builder = AgentSystem::builder()
        .store(Arc::new(MemoryStore::new()))
        .llm(Arc::new(llm));
    for agent in ["a", "b|c", "a|b", "c"] {
        builder = builder.agent(AgentSpec::new(agent));
    }
    let system = builder.start().expect("the system starts");
    assert_eq!(system.ask("a", "go").await.unwrap().text, "b|c answers");
    assert_eq!(system.ask("a|b", "go").await.unwrap().text, "c answers");
    let first = direct_conversation_id("a", "b|c");
    let second = direct_conversation_id("a|b", "c");
    assert_ne!(first, second, "two pairs, one conversation id");
    for (id, question, answer) in [(&first, "from a", "b|c answers"), (&second, "from a|b", "c answers")] {
        let texts: Vec<String> = system
            .read_messages(id, None, 10)
            .await
            .unwrap()
            .into_iter()
            .map(|m| m.text)
            .collect();
        assert_eq!(texts, [question, answer], "{id}");
    }
    for agent in ["a", "b|c", "a|b", "c"] {
        for id in system.conversations_of(agent).await.unwrap() {
            let info = system
                .conversation(&id)
                .await
                .unwrap()
                .expect("a listed conversation exists");
            assert!(
                info.participants.contains(&Participant::Agent(agent.to_string())),
                "{agent} lists {id}, a conversation of {:?}",
                info.participants
            );
        }
    }
    system.shutdown().await;
}

/// Goal: a notification an outside caller sends with an id of its choosing is
/// processed (once) whatever the id looks like, also when it is shaped like an id the
/// agents make for their own messages (`{agent}.{n}`): the receiver must not take it
/// for a duplicate of an agent's cancellation it had. Method: the coordinator delegates
/// a slow task and a second one and cancels the second (its cancellation is the
/// coordinator's message `coordinator.2`, marked as seen by the analyst); then an
/// outside caller notifies the analyst with the id `coordinator.2`; and likewise a
/// message id shaped like a mention's. Each acknowledged notification must reach the
/// analyst's model.
#[tokio::test(start_paused = true)]
async fn an_outside_message_id_shaped_like_an_agents_own_is_not_taken_for_a_duplicate() {
    use troupe_agent::TaskState;
    let llm = ScriptedLlm::new()
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
        .rule(
            ScriptRule::agent("analyst")
                .on_user_containing("[notification")
                .reply("noted"),
        )
        .rule(ScriptRule::agent("coordinator").reply("seen"));
    let system = AgentSystem::builder()
        .store(Arc::new(MemoryStore::new()))
        .llm(Arc::new(llm.clone()))
        .agent(AgentSpec::new("coordinator"))
        .agent(AgentSpec::new("analyst"))
        .start()
        .expect("the system starts");
    let first = system
        .delegate("coordinator", "analyst", "slow one", None)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let second = system
        .delegate("coordinator", "analyst", "second one", None)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(system.cancel("coordinator", &second).await, Ok(None));
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert_eq!(
        system.task("coordinator", &second).await.unwrap().unwrap().state,
        TaskState::Canceled
    );
    assert_eq!(first, "coordinator.0");
    // The coordinator's third message (after its two tasks) was the cancellation.
    system
        .notify_with_id("analyst", "coordinator.2", "outside note one", None)
        .await
        .expect("acknowledged");
    tokio::time::sleep(Duration::from_secs(20)).await;
    let log = system.conversation_log("analyst").await.unwrap();
    let shown = log.iter().filter(|m| m.content.contains("outside note one")).count();
    assert_eq!(shown, 1, "an acknowledged notification was processed {shown} times");

    // The other way round: the outside id first, then the coordinator's cancellation
    // of that name (its messages 3 and 4 are tasks, 5 the cancellation).
    system
        .notify_with_id("analyst", "coordinator.5", "outside note two", None)
        .await
        .expect("acknowledged");
    let slow = system
        .delegate("coordinator", "analyst", "slow two", None)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let fourth = system
        .delegate("coordinator", "analyst", "fourth one", None)
        .await
        .unwrap();
    assert_eq!((slow.as_str(), fourth.as_str()), ("coordinator.3", "coordinator.4"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(system.cancel("coordinator", &fourth).await, Ok(None));
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert_eq!(
        system.task("coordinator", &fourth).await.unwrap().unwrap().state,
        TaskState::Canceled,
        "the cancellation was taken for a duplicate of the outside note"
    );
    let log = system.conversation_log("analyst").await.unwrap();
    assert!(
        !log.iter().any(|m| m.content.contains("fourth one")),
        "the canceled task was worked"
    );
    assert_eq!(log.iter().filter(|m| m.content.contains("outside note two")).count(), 1);
    system.shutdown().await;
}

/// Goal: a remote agent, which can only be asked (`call_agent`: a remote A2A agent
/// cannot be sent a task or a notification), is not offered to the model as a target of
/// `delegate_to_agent` or `notify_agent`, and a model that sends it one anyway reads
/// why, not that it does not exist; nothing is sent. Method: agent `a` beside remote
/// `hq` (a URL nothing listens on: nothing may be sent); the tools' descriptions and
/// the prompt are read, then `a`'s model delegates to and notifies `hq`.
#[tokio::test(start_paused = true)]
async fn a_remote_agent_is_offered_for_calls_only_and_a_send_to_it_says_why() {
    use troupe_agent::{Link, OrgPolicy, RemoteAgent};
    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("a").on_tool_result().reply("{tool_result}"))
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("delegate")
                .call("delegate_to_agent", json!({"agent_id": "hq", "message": "work"})),
        )
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("notify")
                .call("notify_agent", json!({"agent_id": "hq", "message": "news"})),
        )
        .rule(ScriptRule::agent("a").reply("hello"));
    let system = AgentSystem::builder()
        .store(Arc::new(MemoryStore::new()))
        .llm(Arc::new(llm.clone()))
        .agent(AgentSpec::new("a"))
        .agent(AgentSpec::new("b"))
        .remote_agent(RemoteAgent::new("hq", "http://127.0.0.1:9/a2a/hq").role("analyses for HQ"))
        .start()
        .expect("the system starts");
    system.set_org_policy(OrgPolicy::Enforced).await.unwrap();
    system.add_link(Link::new("a", "b")).await.unwrap();
    system.add_link(Link::new("a", "hq")).await.unwrap();
    system.ask("a", "hi").await.unwrap();
    let request = &llm.requests_of("a")[0];
    let description = |name: &str| {
        request
            .tools
            .iter()
            .find(|tool| tool.name == name)
            .unwrap()
            .description
            .clone()
    };
    assert!(description("call_agent").ends_with(" Agents you may contact: b, hq."));
    for tool in ["delegate_to_agent", "notify_agent"] {
        assert!(
            description(tool).ends_with(" Agents you may contact: b."),
            "{tool}: {}",
            description(tool)
        );
    }
    let prompt = &request.messages[0].content;
    assert!(prompt.contains("- hq: analyses for HQ (call_agent only)"), "{prompt}");
    for (ask, tool) in [("delegate", "delegate_to_agent"), ("notify", "notify_agent")] {
        let reply = system.ask("a", ask).await.unwrap().text;
        assert!(
            reply.starts_with(&format!("error: {tool} failed"))
                && reply.contains("hq is an agent on another server")
                && reply.contains("call_agent"),
            "{reply}"
        );
    }
    assert_eq!(system.pending("a").await.unwrap(), (0, 0));
    assert_eq!(system.task("a", "a.0").await.unwrap(), None);
    system.shutdown().await;
}

#[cfg(not(madsim))]
#[path = "support/processes.rs"]
mod processes;

#[cfg(not(madsim))]
mod real_time {
    use super::*;
    use crate::processes::{
        each_task_worked_once_and_its_result_read_once, on_sqlite, sent_from_each, sqlite_file,
        user_messages_containing,
    };
    use std::collections::BTreeMap;
    use troupe_agent::{AgentEvent, Role, TaskState};

    fn script(latency: Duration) -> ScriptedLlm {
        ScriptedLlm::new()
            .rule(
                ScriptRule::agent("analyst")
                    .on_user_containing("[task")
                    .reply("done {input}")
                    .latency(latency),
            )
            .rule(
                ScriptRule::agent("coordinator")
                    .on_user_containing("you delegated is")
                    .reply("thanks"),
            )
    }

    fn process(path: &std::path::Path, llm: &ScriptedLlm) -> AgentSystem {
        on_sqlite(path, llm, &["coordinator", "analyst"])
    }

    /// Waits (bounded) until every task of `tasks` that `coordinator` delegated is final,
    /// reading the store through `system`; their states.
    async fn final_states(system: &AgentSystem, tasks: &[String]) -> BTreeMap<String, TaskState> {
        let wait = async {
            loop {
                let mut states = BTreeMap::new();
                for task in tasks {
                    if let Some(status) = system.task("coordinator", task).await.unwrap() {
                        if status.state.is_final() {
                            states.insert(task.clone(), status.state);
                        }
                    }
                }
                if states.len() == tasks.len() {
                    break states;
                }
                // Polls the store: the turns that end the tasks may run in another process.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(60), wait)
            .await
            .expect("every task ends within 60 s")
    }

    /// Waits (at most 10 s) for a turn of the analyst to start, failing with `what`.
    async fn analyst_started(events: &mut tokio::sync::broadcast::Receiver<AgentEvent>, what: &str) {
        let started = async {
            loop {
                if let Ok(AgentEvent::TurnStarted { agent, .. }) = events.recv().await {
                    if agent.key() == "analyst" {
                        break;
                    }
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(10), started)
            .await
            .expect(what);
    }

    /// Goal: a task whose process is dropped while its delegatee's model is answering
    /// is worked and its result taken exactly once by a new process on the same SQLite
    /// file, and the dropped process's late answer commits nothing. Method: the
    /// analyst's model takes 2 s; the first system is dropped once the analyst's turn
    /// started; a second system starts on the file (its start resumes the entries); once
    /// the task is completed, and again after the dropped model call could have ended,
    /// the logs are counted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_task_whose_process_is_dropped_mid_work_completes_once_in_the_next() {
        let (_dir, path) = sqlite_file();
        let slow = script(Duration::from_secs(2));
        let first = process(&path, &slow);
        let mut events = first.subscribe();
        let task = first
            .delegate("coordinator", "analyst", "job-1", Some(60_000))
            .await
            .expect("the delegation is acknowledged");
        analyst_started(&mut events, "the analyst starts the task").await;
        drop(first);

        let second = process(&path, &script(Duration::ZERO));
        let states = final_states(&second, std::slice::from_ref(&task)).await;
        assert_eq!(states[&task], TaskState::Completed);
        // Past the dropped model call's end (2 s after it began): a late commit of the
        // dropped process would show now.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let analyst = second.conversation_log("analyst").await.unwrap();
        let coordinator = second.conversation_log("coordinator").await.unwrap();
        assert_eq!(user_messages_containing(&analyst, "job-1"), 1, "{analyst:#?}");
        assert_eq!(user_messages_containing(&coordinator, "done"), 1, "{coordinator:#?}");
        assert_eq!(second.pending("analyst").await.unwrap(), (0, 0));
        assert_eq!(second.pending("coordinator").await.unwrap(), (0, 0));
        second.shutdown().await;
    }

    /// Goal: an acknowledged notification whose process is dropped while the agent's
    /// model works on it is processed exactly once by a new process on the same
    /// SQLite file, and the same id sent again to the new process is a duplicate.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_notification_whose_process_is_dropped_mid_turn_is_processed_once_in_the_next() {
        let (_dir, path) = sqlite_file();
        let script = |latency: Duration| {
            ScriptedLlm::new().rule(
                ScriptRule::agent("analyst")
                    .on_user_containing("[notification")
                    .reply("noted")
                    .latency(latency),
            )
        };
        let first = process(&path, &script(Duration::from_secs(2)));
        let mut events = first.subscribe();
        first
            .notify_with_id("analyst", "note-1", "disk is full", None)
            .await
            .expect("acknowledged");
        analyst_started(&mut events, "the analyst starts on the notification").await;
        drop(first);

        let llm = script(Duration::ZERO);
        let second = process(&path, &llm);
        let processed = async {
            loop {
                let log = second.conversation_log("analyst").await.unwrap();
                if log.iter().any(|m| m.role == Role::Assistant && m.content == "noted") {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(30), processed)
            .await
            .expect("processed by the next process within 30 s");
        second
            .notify_with_id("analyst", "note-1", "disk is full", None)
            .await
            .expect("a resend is acknowledged");
        // Past the dropped model call's end, and past the resend's processing if any.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let log = second.conversation_log("analyst").await.unwrap();
        assert_eq!(user_messages_containing(&log, "disk is full"), 1, "{log:#?}");
        assert_eq!(second.pending("analyst").await.unwrap(), (0, 0));
        second.shutdown().await;
    }

    /// Goal: two processes on one SQLite file at once, both delegating from the same
    /// agent to the same agent and both resuming entries: every delegation a process
    /// acknowledged ends `completed`, its task is in the analyst's log once and its
    /// result in the coordinator's once; a delegation refused (its process's activation
    /// fenced by the other's) leaves nothing. Fencing keeps one committer per agent.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_processes_on_one_file_work_each_acknowledged_task_once() {
        const JOBS_PER_PROCESS: usize = 6;
        let (_dir, path) = sqlite_file();
        let llm = script(Duration::from_millis(100));
        let one = process(&path, &llm);
        let two = process(&path, &llm);
        let (acknowledged, refused) = sent_from_each(
            &[&one, &two],
            JOBS_PER_PROCESS,
            "job",
            (Duration::from_secs(30), "each delegation answers within 30 s"),
            |client, text| async move {
                let sent = client.delegate("coordinator", "analyst", &text, Some(60_000)).await;
                let _ = client.resume_pending().await;
                sent
            },
        )
        .await;
        assert!(!acknowledged.is_empty(), "nothing acknowledged: {refused:?}");
        let tasks: Vec<String> = acknowledged.iter().map(|(_, task)| task.clone()).collect();
        let mut ids = tasks.clone();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), tasks.len(), "one task id given twice: {acknowledged:?}");
        let states = final_states(&one, &tasks).await;
        for (text, task) in &acknowledged {
            assert_eq!(states[task], TaskState::Completed, "{text} ({task})");
        }
        // Let both processes' deliveries and resumes settle.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let analyst = one.conversation_log("analyst").await.unwrap();
        let coordinator = one.conversation_log("coordinator").await.unwrap();
        let results = each_task_worked_once_and_its_result_read_once(&analyst, &coordinator, &acknowledged);
        for ((text, _), result) in acknowledged.iter().zip(results) {
            assert!(result.content.contains(text.as_str()), "{result:#?}");
        }
        for (text, _) in &refused {
            assert_eq!(user_messages_containing(&analyst, text), 0, "refused {text} was worked");
        }
        one.shutdown().await;
        two.shutdown().await;
    }
    /// Goal: on the multi-thread runtime, concurrent callers of one agent with a small
    /// mailbox, some of whom give up (a short timeout, or their future dropped) while
    /// their question waits or is being answered: each caller gets its answer or a
    /// typed error (`Busy` for a full mailbox, `Timeout`), and the agent's log holds
    /// exactly the questions whose callers got an answer, each once: a question whose
    /// caller gave up is never committed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_callers_that_give_up_leave_nothing_and_the_others_get_their_answer() {
        use troupe_agent::AgentCallError;
        use troupe_core::InvokeError;
        const CALLERS: usize = 24;
        let llm = ScriptedLlm::new().rule(
            ScriptRule::agent("w")
                .reply("answer to {input}")
                .latency(Duration::from_millis(200)),
        );
        let system = AgentSystem::builder()
            .store(Arc::new(MemoryStore::new()))
            .llm(Arc::new(llm))
            .kind_config(troupe_runtime::KindConfig::default().with_mailbox_capacity(4))
            .agent(AgentSpec::new("w"))
            .start()
            .expect("the system starts");
        // Callers come a few at a time, so some find room in the mailbox and some wait;
        // every fifth drops its future 50 ms after asking (while its question waits or
        // is being answered), every third of the others gives it 150 ms.
        let mut callers = Vec::new();
        for i in 0..CALLERS {
            let client = system.client();
            let question = format!("q-{i}.");
            let timeout = if i % 3 == 0 {
                Duration::from_millis(150)
            } else {
                Duration::from_secs(20)
            };
            let drops = i % 5 == 4;
            let asked = {
                let question = question.clone();
                tokio::spawn(async move {
                    let ask = client.ask_with_timeout("w", &question, timeout);
                    if drops {
                        tokio::time::timeout(Duration::from_millis(50), ask).await.ok()
                    } else {
                        Some(ask.await)
                    }
                })
            };
            callers.push((question, asked));
            if i % 4 == 3 {
                tokio::time::sleep(Duration::from_millis(120)).await;
            }
        }
        let mut answered = Vec::new();
        let mut outcomes = std::collections::BTreeMap::<&str, usize>::new();
        for (question, asked) in callers {
            let result = tokio::time::timeout(Duration::from_secs(30), asked)
                .await
                .expect("every caller is answered within 30 s")
                .unwrap();
            let kind = match &result {
                None => "dropped",
                Some(Ok(reply)) => {
                    assert_eq!(reply.text, format!("answer to {question}"));
                    answered.push(question.clone());
                    "answered"
                }
                Some(Err(AgentCallError::Invoke(InvokeError::Busy { .. }))) => "busy",
                Some(Err(AgentCallError::Invoke(InvokeError::Timeout { .. }))) => "timeout",
                Some(Err(other)) => panic!("{question}: an error neither Busy nor Timeout: {other}"),
            };
            *outcomes.entry(kind).or_default() += 1;
        }
        // Past the longest turn a dropped or timed-out question could still be in.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let log = system.conversation_log("w").await.unwrap();
        let mut logged: Vec<String> = log
            .iter()
            .filter(|m| m.role == Role::User)
            .map(|m| m.content.clone())
            .collect();
        logged.sort();
        answered.sort();
        assert_eq!(logged, answered, "outcomes {outcomes:?}");
        assert!(outcomes.get("answered").copied().unwrap_or(0) > 0, "{outcomes:?}");
        system.shutdown().await;
    }
}
