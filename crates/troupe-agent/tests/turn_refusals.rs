//! An inbox turn that must fail whole is answered by no one: when an agent's turn meets
//! its fence refused (its activation is stale) or its store failing, no failure note
//! goes into a conversation and no failed result goes back for a task: the agent never
//! had that failure. The entry stays, and the agent answers it once it can.
//!
//! Method: a store whose fence checks fail on demand (`GateStore`), and two stores on
//! one SQLite file, the second claiming the agent while the first's turn runs (a stale
//! activation, as a second process makes it). Every wait is bounded.
//!
//! Runs in both builds: `cargo nextest run -p troupe-agent --test turn_refusals`, and
//! under madsim (`RUSTFLAGS="--cfg madsim"`); the multi-thread test in the normal build.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use troupe_agent::{
    agent_id, AgentSpec, AgentSystem, ConversationKind, ConversationMessage, Participant, ScriptRule, ScriptedLlm,
    Sender, TaskState, Tool,
};
use troupe_runtime::{MemoryStore, SqliteStore, StateStore};

#[allow(dead_code)] // the knobs the other tests use and these do not
#[path = "support/gate_store.rs"]
mod gate_store;
use gate_store::GateStore;

/// How long a test waits for what it expects, at most.
const WAIT_MAX: Duration = Duration::from_secs(60);
/// How often a test looks again.
const POLL: Duration = Duration::from_millis(50);

fn human() -> Sender {
    Sender::Human("h".to_string())
}

/// Waits (bounded by [`WAIT_MAX`]) until `done` says so.
async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let mut waited = Duration::ZERO;
    while !done() {
        assert!(waited < WAIT_MAX, "waited {WAIT_MAX:?} for {what}");
        tokio::time::sleep(POLL).await;
        waited += POLL;
    }
}

/// The messages of conversation `room`.
async fn messages(system: &AgentSystem) -> Vec<ConversationMessage> {
    system.read_messages("room", None, 100).await.unwrap()
}

/// Waits (bounded) until `agent` has answered in `room`, and asserts that nothing else
/// was said: the post, one answer, no system note.
async fn assert_answered_without_a_note(system: &AgentSystem, agent: &str, answer: &str) {
    let mut waited = Duration::ZERO;
    loop {
        let messages = messages(system).await;
        let notes: Vec<&ConversationMessage> = messages
            .iter()
            .filter(|message| message.sender == Sender::System)
            .collect();
        assert!(
            notes.is_empty(),
            "a failure note for a failure the agent never had: {notes:?}"
        );
        if messages.len() >= 2 {
            assert_eq!(messages.len(), 2, "{messages:?}");
            assert_eq!(messages[1].sender, Sender::Agent(agent.to_string()));
            assert_eq!(messages[1].text, answer);
            return;
        }
        assert!(waited < WAIT_MAX, "no answer after {WAIT_MAX:?}: {messages:?}");
        tokio::time::sleep(POLL).await;
        waited += POLL;
    }
}

/// A system of agent `b` (and `a`, who delegates) on `store`.
fn gated_system(store: Arc<GateStore>) -> AgentSystem {
    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("b").reply("hello back"))
        .rule(ScriptRule::agent("a").reply("noted"));
    AgentSystem::builder()
        .store(store)
        .llm(Arc::new(llm))
        .agent(AgentSpec::new("a"))
        .agent(AgentSpec::new("b"))
        .start()
        .expect("the system starts")
}

/// Goal: a mention whose turn meets its store failing (the fence check before the model
/// call fails: a store error, not a refusal of the fence) posts no failure note; the
/// mention stays, and is answered once the store works. Before, the conversation said
/// "@b could not answer #0: get failed: injected fault", for a failure of the store, not
/// of b (d1fc5cb let only `Fenced` and `NotOwner` through).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mention_whose_turn_meets_a_failing_store_posts_no_failure_note() {
    let store = GateStore::new(Arc::new(MemoryStore::new()), false);
    let system = gated_system(store.clone());
    let participants = vec![Participant::Human("h".to_string()), Participant::Agent("b".to_string())];
    system
        .create_conversation("room", participants, ConversationKind::Group)
        .await
        .unwrap();

    store.fail_fence_checks.store(true, Ordering::SeqCst);
    system.post_message("room", human(), "m0", "@b hi").await.unwrap();
    wait_for("b's turn to meet the failing store", || {
        store.failed_fence_checks.load(Ordering::SeqCst) >= 1
    })
    .await;
    // The turn that met it has ended (it fails at once); a note would be posted by now.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let said = messages(&system).await;
    assert_eq!(said.len(), 1, "only the post: {said:?}");

    store.fail_fence_checks.store(false, Ordering::SeqCst);
    assert_answered_without_a_note(&system, "b", "hello back").await;
    system.shutdown().await;
}

/// Goal: a delegated task whose turn meets its store failing sends no failed result
/// back: the task stays with b, and completes once the store works. Before, a got the
/// task back `failed` with "get failed: injected fault".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_whose_turn_meets_a_failing_store_sends_no_failed_result() {
    let store = GateStore::new(Arc::new(MemoryStore::new()), false);
    let system = gated_system(store.clone());
    // a is active before the store fails (its own turns are not under test).
    system.ask("a", "hello").await.unwrap();

    store.fail_fence_checks.store(true, Ordering::SeqCst);
    let task = system.delegate("a", "b", "do it", None).await.unwrap();
    wait_for("b's task turn to meet the failing store", || {
        store.failed_fence_checks.load(Ordering::SeqCst) >= 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let status = system.task("a", &task).await.unwrap().expect("a keeps its task");
    assert_ne!(
        status.state,
        TaskState::Failed,
        "a failed result for the store's failure: {status:?}"
    );

    store.fail_fence_checks.store(false, Ordering::SeqCst);
    let mut waited = Duration::ZERO;
    loop {
        // The entry stays until a resume tells b again.
        system.resume_pending().await.unwrap();
        let status = system.task("a", &task).await.unwrap().expect("a keeps its task");
        assert_ne!(status.state, TaskState::Failed, "{status:?}");
        if status.state == TaskState::Completed {
            assert_eq!(status.result.as_deref(), Some("hello back"));
            break;
        }
        assert!(waited < WAIT_MAX, "not completed after {WAIT_MAX:?}: {status:?}");
        tokio::time::sleep(POLL).await;
        waited += POLL;
    }
    system.shutdown().await;
}

/// A mention's turn on a SQLite file whose agent a second store claims while the turn
/// runs (between its two model steps, in a tool): the stale activation's turn fails
/// whole, no failure note is posted, and a fresh activation answers the mention. Before
/// d1fc5cb the conversation said "@writer could not answer #0: ... fenced".
async fn a_stale_activations_mention_posts_no_failure_note() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("troupe.db");
    let first_store: Arc<dyn StateStore> = Arc::new(SqliteStore::open(&path).expect("the store opens"));
    let second_store = SqliteStore::open(&path).expect("the store opens");

    // The tool holds the first mention turn until the second store has claimed writer.
    let entered = Arc::new(AtomicBool::new(false));
    let released = Arc::new(AtomicBool::new(false));
    let hold = {
        let (entered, released) = (entered.clone(), released.clone());
        Tool::from_fn(
            "hold",
            "Waits.",
            json!({"type": "object"}),
            move |_context, _arguments| {
                let (entered, released) = (entered.clone(), released.clone());
                async move {
                    entered.store(true, Ordering::SeqCst);
                    let mut waited = Duration::ZERO;
                    while !released.load(Ordering::SeqCst) && waited < WAIT_MAX {
                        tokio::time::sleep(POLL).await;
                        waited += POLL;
                    }
                    Ok("held".to_string())
                }
            },
        )
    };
    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("writer").on_tool_result().reply("from the first"))
        .rule(
            ScriptRule::agent("writer")
                .on_user_containing("conversation")
                .call("hold", json!({})),
        )
        .rule(ScriptRule::agent("writer").reply("ready"));
    let system = AgentSystem::builder()
        .store(first_store)
        .llm(Arc::new(llm))
        .tool(hold)
        .agent(AgentSpec::new("writer"))
        .start()
        .expect("the system starts");
    let participants = vec![
        Participant::Human("h".to_string()),
        Participant::Agent("writer".to_string()),
    ];
    system
        .create_conversation("room", participants, ConversationKind::Group)
        .await
        .unwrap();
    assert_eq!(system.ask("writer", "one").await.unwrap().text, "ready");

    system.post_message("room", human(), "m0", "@writer hi").await.unwrap();
    wait_for("the mention's turn to reach its tool", || {
        entered.load(Ordering::SeqCst)
    })
    .await;
    // Another process claims writer: the running activation is stale from now on.
    second_store.claim(&agent_id("writer").unwrap()).await.unwrap();
    released.store(true, Ordering::SeqCst);

    assert_answered_without_a_note(&system, "writer", "from the first").await;
    system.shutdown().await;
}

#[tokio::test]
async fn a_stale_activations_mention_on_a_shared_sqlite_file_posts_no_failure_note() {
    a_stale_activations_mention_posts_no_failure_note().await;
}

/// [`a_stale_activations_mention_on_a_shared_sqlite_file_posts_no_failure_note`] on
/// the multi-thread runtime.
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_activations_mention_on_a_shared_sqlite_file_posts_no_failure_note_on_the_multi_thread_runtime() {
    a_stale_activations_mention_posts_no_failure_note().await;
}
