//! Two agent systems on one store (two processes on one SQLite file): an agent's stale
//! activation learns that it is fenced before it calls the model, not after it has paid
//! for the call and its commit is refused.
//!
//! Runs in both builds: `cargo test -p troupe-agent --test fenced_model_calls`, and
//! under madsim (`RUSTFLAGS="--cfg madsim"`).

use std::sync::Arc;

use troupe_agent::{AgentCallError, AgentSpec, AgentSystem, ScriptRule, ScriptedLlm};
use troupe_core::InvokeError;
use troupe_runtime::{MemoryStore, SqliteStore, StateStore, StoreError};

/// One system with agent `writer` on `store`, its model answering `answer`.
fn system(store: Arc<dyn StateStore>, llm: &ScriptedLlm) -> AgentSystem {
    AgentSystem::builder()
        .store(store)
        .llm(Arc::new(llm.clone()))
        .agent(AgentSpec::new("writer"))
        .start()
        .expect("the system starts")
}

/// The first system activates `writer`; the second claims it since, which makes the
/// first's activation stale. The first's next ask is refused `Fenced` before its model
/// is called; the ask after it runs in a fresh activation and is answered.
async fn a_stale_agent_does_not_call_its_model(first_store: Arc<dyn StateStore>, second_store: Arc<dyn StateStore>) {
    let first_model = ScriptedLlm::new().rule(ScriptRule::agent("writer").reply("from the first"));
    let second_model = ScriptedLlm::new().rule(ScriptRule::agent("writer").reply("from the second"));
    let first = system(first_store, &first_model);
    let second = system(second_store, &second_model);

    assert_eq!(first.ask("writer", "one").await.unwrap().text, "from the first");
    assert_eq!(second.ask("writer", "two").await.unwrap().text, "from the second");

    let stale = first.ask("writer", "three").await;
    assert!(
        matches!(
            stale,
            Err(AgentCallError::Invoke(InvokeError::StorageFailed {
                source: StoreError::Fenced { .. },
                ..
            }))
        ),
        "the stale activation's ask: {stale:?}"
    );
    assert_eq!(
        first_model.requests_of("writer").len(),
        1,
        "the stale activation called its model for an answer it could not commit"
    );

    // A fresh activation of the first system claims the agent again and answers, from
    // the state the second committed.
    assert_eq!(first.ask("writer", "four").await.unwrap().text, "from the first");
    assert_eq!(first_model.requests_of("writer").len(), 2);
    let log = first.conversation_log("writer").await.unwrap();
    let asked: Vec<&str> = log
        .iter()
        .filter(|m| m.role == troupe_agent::Role::User)
        .map(|m| m.content.as_str())
        .collect();
    assert_eq!(asked, ["one", "two", "four"], "what the log kept");
    first.shutdown().await;
    second.shutdown().await;
}

/// Two systems on clones of one memory store (they share its data, as two processes
/// share a file).
#[tokio::test(start_paused = true)]
async fn a_stale_agent_on_a_shared_memory_store_does_not_call_its_model() {
    let store = MemoryStore::new();
    a_stale_agent_does_not_call_its_model(Arc::new(store.clone()), Arc::new(store)).await;
}

/// Two systems on one SQLite file, each with its own connection.
#[tokio::test(start_paused = true)]
async fn a_stale_agent_on_a_shared_sqlite_file_does_not_call_its_model() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("troupe.db");
    let open = || -> Arc<dyn StateStore> { Arc::new(SqliteStore::open(&path).expect("the store opens")) };
    a_stale_agent_does_not_call_its_model(open(), open()).await;
}

/// [`a_stale_agent_on_a_shared_sqlite_file_does_not_call_its_model`] on the
/// multi-thread runtime.
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_agent_on_a_shared_sqlite_file_does_not_call_its_model_on_the_multi_thread_runtime() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("troupe.db");
    let open = || -> Arc<dyn StateStore> { Arc::new(SqliteStore::open(&path).expect("the store opens")) };
    a_stale_agent_does_not_call_its_model(open(), open()).await;
}
