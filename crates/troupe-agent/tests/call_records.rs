//! `call_agent` exchanges are recorded off the call's path (`call_record.rs`): queued in
//! memory, stored by one turn of the pair's direct conversation
//! `CALL_RECORD_FLUSH_DELAY_MS` later; a read through the API and the system's shutdown
//! store what waits first. Real runtime and agents; only the model is scripted.
//!
//! Runs in both builds: `cargo test -p troupe-agent --test call_records` and under
//! madsim (`RUSTFLAGS="--cfg madsim"`).

use std::sync::Arc;

use troupe_agent::{AgentSpec, AgentSystem, ScriptRule, ScriptedLlm, Sender, CONVERSATION_KIND};
use troupe_runtime::{MemoryStore, SqliteStore, StateStore};

#[path = "support/gate_store.rs"]
mod gate_store;
use gate_store::GateStore;

/// `a` asks `b` through `call_agent` and replies with its answer; `b` answers "42".
fn script() -> ScriptedLlm {
    ScriptedLlm::new()
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("")
                .call("call_agent", serde_json::json!({"agent_id": "b", "message": "{input}"})),
        )
        .rule(ScriptRule::agent("a").on_tool_result().reply("a got {tool_result}"))
        .rule(ScriptRule::agent("b").reply("42"))
        .without_recording()
}

fn start(store: Arc<dyn StateStore>) -> AgentSystem {
    AgentSystem::builder()
        .store(store)
        .llm(Arc::new(script()))
        .agent(AgentSpec::new("a"))
        .agent(AgentSpec::new("b"))
        .start()
        .expect("the system starts")
}

fn direct() -> String {
    troupe_agent::direct_conversation_id("a", "b")
}

/// The question and answer texts of the pair's conversation, in order, as read through
/// the API.
async fn recorded(system: &AgentSystem) -> Vec<(Sender, String)> {
    let messages = system.read_messages(&direct(), None, 500).await.unwrap();
    messages.into_iter().map(|m| (m.sender, m.text)).collect()
}

fn exchange(question: &str) -> [(Sender, String); 2] {
    [
        (Sender::Agent("a".to_string()), question.to_string()),
        (Sender::Agent("b".to_string()), "42".to_string()),
    ]
}

/// Goal: a call's record is read through the API as soon as the call returned, though
/// it waits in memory for the conversation's next turn (the read stores it first), on
/// the multi-thread runtime, call after call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_is_read_in_its_conversation_as_soon_as_it_returned() {
    let system = start(Arc::new(MemoryStore::new()));
    let mut expected = Vec::new();
    for n in 0..5 {
        let question = format!("question {n}");
        assert_eq!(system.ask("a", &question).await.unwrap().text, "a got 42");
        expected.extend(exchange(&question));
        assert_eq!(recorded(&system).await, expected, "after call {n}");
    }
    system.shutdown().await;
}

/// Goal: exchanges recorded within `CALL_RECORD_FLUSH_DELAY_MS` of each other are
/// stored by one turn and one commit of their conversation, not one each, and are all
/// there in the order of the calls. Paused time: ten calls at one instant.
#[tokio::test(start_paused = true)]
async fn calls_recorded_together_share_one_commit_of_their_conversation() {
    let store = GateStore::new(Arc::new(MemoryStore::new()), false);
    // The commits of the pair's direct conversation.
    store.count_commits(|actor, _| actor.kind().as_str() == CONVERSATION_KIND && actor.key() == direct());
    let system = start(store.clone());
    let mut expected = Vec::new();
    for n in 0..10 {
        let question = format!("question {n}");
        assert_eq!(system.ask("a", &question).await.unwrap().text, "a got 42");
        expected.extend(exchange(&question));
    }
    let created = store.counted_commits();
    assert_eq!(
        created, 1,
        "only the conversation's creation is committed while the calls run"
    );
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    assert_eq!(store.counted_commits(), 2, "the ten exchanges are stored by one commit");
    assert_eq!(recorded(&system).await, expected);
    system.shutdown().await;
}

/// Goal: records still waiting in memory when the system shuts down are stored before
/// it stops: the next process on the same file reads them. Shut down right after the
/// call, before the conversation's wake-up is due.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shutdown_stores_the_records_still_waiting() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("troupe.db");
    let system = start(Arc::new(SqliteStore::open(&path).unwrap()));
    assert_eq!(system.ask("a", "before the shutdown").await.unwrap().text, "a got 42");
    system.shutdown().await;

    let next = start(Arc::new(SqliteStore::open(&path).unwrap()));
    assert_eq!(recorded(&next).await, exchange("before the shutdown"));
    next.shutdown().await;
}
