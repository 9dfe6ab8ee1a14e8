//! Goal: an agent system that is dropped, or shut down, frees its runtime and all it
//! holds (the store, the model client, the agents), however it was used: an ask that
//! went through `call_agent`, and a conversation whose mention started a delivery.
//!
//! It did not: the agents' shared state held a strong handle to the runtime, and the
//! runtime holds the agents' shared state (through the agent and conversation
//! factories), a reference cycle. Every system ever started stayed in memory with its
//! store, about 9 MB per seed of `dst_conversations`'s crash test (its resident memory
//! grew from 35 MB at 2 seeds to 161 MB at 16; valgrind named the leaked
//! `AgentShared`). The shared state now holds a `WeakRuntimeHandle`.
//!
//! Method: the test keeps its own `Arc` of the store and of the scripted model, uses the
//! system, drops it (or shuts it down), and waits (bounded) for the system's tasks to
//! end: then its own `Arc`s must be the only ones left. With the cycle, each count stays
//! at 2 or more for good, and the test fails after `RELEASE_WAIT_MS` naming the counts.
//! On tokio (2 worker threads, and current_thread); not under the simulator, whose
//! tasks end with its run.
//!
//! Also here: a turn of a dropped system starts no further model request (it used to
//! ask its model about the `ShuttingDown` refusals its last tools got, in a process that
//! was gone: a random-base sweep's `dst_org_approvals` seed 1894390107 saw the dead
//! process's model request).
#![cfg(not(madsim))]

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tokio::sync::Notify;
use troupe_agent::{
    AgentSpec, AgentSystem, ConversationKind, Participant, ScriptRule, ScriptedLlm, Sender, TaskState, Tool,
};
use troupe_runtime::{MemoryStore, Runtime};

/// How long the dropped system's tasks get to end (ms): they are aborted at the drop and
/// end at their next poll, well within it.
const RELEASE_WAIT_MS: u64 = 5_000;
/// How often the test looks at the counts meanwhile (ms).
const RELEASE_POLL_MS: u64 = 10;
/// The shutdown grace of the systems with a task in flight (ms).
const SHUTDOWN_GRACE_MS: u64 = 200;
/// The conversation the test posts in.
const CONVERSATION: &str = "standup";

/// `asker` asks `answerer` through `call_agent` when asked about 6 x 7, and answers
/// anything else (the conversation's mention) with a line of its own; `answerer`
/// answers "42".
fn script() -> ScriptedLlm {
    ScriptedLlm::new()
        .rule(
            ScriptRule::agent("asker")
                .on_user_containing("6 x 7")
                .call("call_agent", json!({"agent_id": "answerer", "message": "{input}"})),
        )
        .rule(ScriptRule::agent("asker").on_tool_result().reply("{tool_result}"))
        .rule(ScriptRule::agent("asker").reply("asker: on it"))
        .rule(ScriptRule::agent("answerer").reply("42"))
}

/// Starts a system on `store` and `llm`, asks through `call_agent`, and posts a mention
/// whose answer it waits for; returns the system, still running.
async fn used_system(store: &Arc<MemoryStore>, llm: &Arc<ScriptedLlm>) -> AgentSystem {
    let system = AgentSystem::builder()
        .store(Arc::clone(store) as _)
        .llm(Arc::clone(llm) as _)
        .agent(AgentSpec::new("asker"))
        .agent(AgentSpec::new("answerer"))
        .start()
        .unwrap();
    let reply = system.ask("asker", "what is 6 x 7?").await.unwrap();
    assert_eq!(reply.text, "42");
    let people = vec![
        Participant::Agent("asker".to_string()),
        Participant::Human("hugo".to_string()),
    ];
    system
        .create_conversation(CONVERSATION, people, ConversationKind::Group)
        .await
        .unwrap();
    system
        .post_message(CONVERSATION, Sender::Human("hugo".to_string()), "h0", "@asker status?")
        .await
        .unwrap();
    // The mention is delivered by a task of the system; wait for its answer, so that the
    // drop below finds that path used.
    let deadline = tokio::time::Instant::now() + Duration::from_millis(RELEASE_WAIT_MS);
    loop {
        let messages = system.read_messages(CONVERSATION, None, 100).await.unwrap();
        if messages.iter().any(|message| message.text == "asker: on it") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the mention was not answered within {RELEASE_WAIT_MS} ms: {messages:#?}"
        );
        tokio::time::sleep(Duration::from_millis(RELEASE_POLL_MS)).await;
    }
    system
}

/// Waits (at most `RELEASE_WAIT_MS`) until the test's own `Arc`s of the store and the
/// model are the only ones; fails naming the counts if they are not by then.
async fn assert_released(store: &Arc<MemoryStore>, llm: &Arc<ScriptedLlm>, how: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_millis(RELEASE_WAIT_MS);
    while Arc::strong_count(store) > 1 || Arc::strong_count(llm) > 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{RELEASE_WAIT_MS} ms after the system was {how}, it still holds the store ({} references) \
             and the model ({} references): something it owns keeps its runtime alive",
            Arc::strong_count(store),
            Arc::strong_count(llm)
        );
        tokio::time::sleep(Duration::from_millis(RELEASE_POLL_MS)).await;
    }
}

async fn dropped_system_is_freed() {
    let (store, llm) = (Arc::new(MemoryStore::new()), Arc::new(script()));
    let system = used_system(&store, &llm).await;
    assert!(Arc::strong_count(&store) > 1, "the running system holds the store");
    drop(system);
    assert_released(&store, &llm, "dropped").await;
}

async fn shut_down_system_is_freed() {
    let (store, llm) = (Arc::new(MemoryStore::new()), Arc::new(script()));
    let system = used_system(&store, &llm).await;
    system.shutdown().await;
    assert_released(&store, &llm, "shut down").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_agent_system_frees_its_runtime_on_two_worker_threads() {
    dropped_system_is_freed().await;
}

#[tokio::test]
async fn a_dropped_agent_system_frees_its_runtime_on_one_thread() {
    dropped_system_is_freed().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shut_down_agent_system_frees_its_runtime() {
    shut_down_system_is_freed().await;
}

/// Goal: once its system is dropped, a turn asks its model nothing more. Method: `a`'s
/// model calls the tool `gate`, which tells the test it runs and waits; the test lets
/// it finish and drops the system at once, on the same thread, so the turn goes on
/// after the drop every time (its task was woken before the dispatcher's). The turn
/// then ends (its caller is told the runtime stopped) without the second model request
/// that would read the tool's result: the model saw one request.
#[tokio::test]
async fn a_turn_of_a_dropped_system_makes_no_further_model_request() {
    let (started, go) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let (tool_started, tool_go) = (Arc::clone(&started), Arc::clone(&go));
    let gate = Tool::from_fn(
        "gate",
        "waits until the test opens it",
        json!({"type": "object"}),
        move |_context, _arguments| {
            let (started, go) = (Arc::clone(&tool_started), Arc::clone(&tool_go));
            async move {
                started.notify_one();
                go.notified().await;
                Ok("opened".to_string())
            }
        },
    );
    let llm = Arc::new(
        ScriptedLlm::new()
            .rule(ScriptRule::agent("a").on_user_containing("").call("gate", json!({})))
            .rule(ScriptRule::agent("a").on_tool_result().reply("done")),
    );
    let system = AgentSystem::builder()
        .llm(Arc::clone(&llm) as _)
        .agent(AgentSpec::new("a"))
        .tool(gate)
        .start()
        .unwrap();
    let client = system.client();
    let ask = tokio::spawn(async move { client.ask("a", "open the gate").await });
    started.notified().await;
    go.notify_one(); // the tool may finish, when the turn's task runs next
    drop(system);
    let answer = ask.await.unwrap();
    assert!(answer.is_err(), "the dropped system's turn does not answer: {answer:?}");
    assert_eq!(
        llm.requests_of("a").len(),
        1,
        "no model request after the drop: {:#?}",
        llm.requests_of("a")
    );
}

/// Starts a system on `store` and `llm` whose `asker` delegates a task to `answerer`
/// (waited for until it completed) and notifies it; then delegates a second task whose
/// answer is held up by the tool `hold` (which never returns): the outbox, the inbox and
/// a delegated turn are all in use when the system goes. Returns the running system.
async fn system_with_tasks(store: &Arc<MemoryStore>, llm: &Arc<ScriptedLlm>) -> AgentSystem {
    let hold = Tool::from_fn(
        "hold",
        "never returns",
        json!({"type": "object"}),
        |_context, _arguments| async move {
            std::future::pending::<()>().await;
            Ok(String::new())
        },
    );
    // A short grace: the held turn never ends, so a shutdown waits all of it.
    let runtime = Runtime::builder()
        .shutdown_grace(Duration::from_millis(SHUTDOWN_GRACE_MS))
        .unwrap();
    let system = AgentSystem::builder()
        .runtime(runtime)
        .store(Arc::clone(store) as _)
        .llm(Arc::clone(llm) as _)
        .agent(AgentSpec::new("asker"))
        .agent(AgentSpec::new("answerer"))
        .tool(hold)
        .start()
        .unwrap();
    let client = system.client();
    let task = client
        .delegate("asker", "answerer", "what is 6 x 7?", None)
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_millis(RELEASE_WAIT_MS);
    loop {
        let status = client.task("asker", &task).await.unwrap();
        if status
            .as_ref()
            .is_some_and(|status| status.state == TaskState::Completed)
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the delegated task did not complete within {RELEASE_WAIT_MS} ms: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(RELEASE_POLL_MS)).await;
    }
    client.notify("answerer", "fyi: the report is out").await.unwrap();
    let held = client.delegate("asker", "answerer", "hold this", None).await.unwrap();
    // Wait until the held task is being worked on: its turn runs when the system goes.
    let deadline = tokio::time::Instant::now() + Duration::from_millis(RELEASE_WAIT_MS);
    while !llm
        .requests_of("answerer")
        .iter()
        .any(|request| format!("{request:?}").contains("hold this"))
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the held task did not reach its delegatee within {RELEASE_WAIT_MS} ms"
        );
        tokio::time::sleep(Duration::from_millis(RELEASE_POLL_MS)).await;
    }
    let _ = held;
    system
}

/// `answerer` holds a task on "hold this" (calls `hold`), and answers anything else with
/// "42"; `asker` answers every result or notice it gets with "noted".
fn task_script() -> ScriptedLlm {
    ScriptedLlm::new()
        .rule(
            ScriptRule::agent("answerer")
                .on_user_containing("hold this")
                .call("hold", json!({})),
        )
        .rule(ScriptRule::agent("answerer").reply("42"))
        .rule(ScriptRule::agent("asker").reply("noted"))
}

/// Goal: a system whose agents delegated and notified (outbox and inbox deliveries, a
/// delegated turn still running) is freed when dropped or shut down, like one that used
/// only `call_agent` and conversations. Method as above.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_system_with_delegated_tasks_frees_its_runtime() {
    let (store, llm) = (Arc::new(MemoryStore::new()), Arc::new(task_script()));
    let system = system_with_tasks(&store, &llm).await;
    drop(system);
    assert_released(&store, &llm, "dropped with a task in flight").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shut_down_system_with_delegated_tasks_frees_its_runtime() {
    let (store, llm) = (Arc::new(MemoryStore::new()), Arc::new(task_script()));
    let system = system_with_tasks(&store, &llm).await;
    system.shutdown().await;
    assert_released(&store, &llm, "shut down with a task in flight").await;
}
