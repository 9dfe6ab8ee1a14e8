//! Processes as the embedder review and probes start them: a system of named agents on a
//! store and a scripted model (on one SQLite file when several processes share the data),
//! and sends made from several processes at once, sorted into those that succeeded and
//! those that failed. One piece, so that the suites that start processes the same way
//! cannot drift apart.
#![allow(dead_code)] // each test file uses part of it

use std::fmt::Display;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use troupe_agent::{AgentClient, AgentSpec, AgentSystem, AgentSystemBuilder, ChatMessage, Role, ScriptedLlm};
use troupe_runtime::{SqliteStore, StateStore};

/// A builder of a system of `agents` on `store` and the model `llm` (a clone, which
/// shares its state, so the test can still read what it was asked).
pub(crate) fn builder_of(store: Arc<dyn StateStore>, llm: &ScriptedLlm, agents: &[&str]) -> AgentSystemBuilder {
    let mut builder = AgentSystem::builder().store(store).llm(Arc::new(llm.clone()));
    for agent in agents {
        builder = builder.agent(AgentSpec::new(*agent));
    }
    builder
}

/// A path for a new SQLite file in a new temporary directory, and the directory, which
/// is removed when it is dropped: hold it (`let (_dir, path) = ...`) for the whole test.
pub(crate) fn sqlite_file() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agents.sqlite3");
    (dir, path)
}

/// A process of `agents` on the SQLite file at `path` and the model `llm`, started.
pub(crate) fn on_sqlite(path: &Path, llm: &ScriptedLlm, agents: &[&str]) -> AgentSystem {
    let store = Arc::new(SqliteStore::open(path).expect("the store opens"));
    builder_of(store, llm, agents).start().expect("the system starts")
}

/// User messages of `log` that contain `needle`.
pub(crate) fn user_messages_containing(log: &[ChatMessage], needle: &str) -> usize {
    log.iter()
        .filter(|m| m.role == Role::User && m.content.contains(needle))
        .count()
}

/// Checks that each `(text, task)` of `tasks` is in the analyst's log `analyst` once (the
/// task worked once) and `task`'s result in the coordinator's log `coordinator` once;
/// returns the result's message of each, in the order of `tasks`.
pub(crate) fn each_task_worked_once_and_its_result_read_once<'a>(
    analyst: &[ChatMessage],
    coordinator: &'a [ChatMessage],
    tasks: &[(String, String)],
) -> Vec<&'a ChatMessage> {
    let mut read = Vec::new();
    for (text, task) in tasks {
        assert_eq!(
            user_messages_containing(analyst, text),
            1,
            "{text} ({task}) in the analyst's log: {analyst:#?}"
        );
        let result = format!("[task {task} you delegated is completed]");
        let results: Vec<&ChatMessage> = coordinator
            .iter()
            .filter(|m| m.role == Role::User && m.content.contains(&result))
            .collect();
        assert_eq!(
            results.len(),
            1,
            "{text}'s result in the coordinator's log: {coordinator:#?}"
        );
        read.push(results[0]);
    }
    read
}

/// Sends `per_process` messages from each of `systems` at once, each in a task of its
/// own: the `i`th of process `p` has the text `{prefix}-{p}-{i}.` and is sent by
/// `send(client, text)`. Waits for each at most `wait` (failing with `late`); the texts
/// whose send succeeded, with what it returned, and those whose send failed, with the
/// error as text, each in the order sent.
pub(crate) async fn sent_from_each<T, E, Fut>(
    systems: &[&AgentSystem],
    per_process: usize,
    prefix: &str,
    (wait, late): (Duration, &str),
    send: impl Fn(AgentClient, String) -> Fut,
) -> (Vec<(String, T)>, Vec<(String, String)>)
where
    Fut: Future<Output = Result<T, E>> + Send + 'static,
    T: Send + 'static,
    E: Display + Send + 'static,
{
    let mut sends = Vec::new();
    for (p, system) in systems.iter().enumerate() {
        for i in 0..per_process {
            let text = format!("{prefix}-{p}-{i}.");
            let sent = send(system.client(), text.clone());
            sends.push(tokio::spawn(async move { (text, sent.await) }));
        }
    }
    let mut succeeded = Vec::new();
    let mut failed = Vec::new();
    for send in sends {
        let (text, sent) = tokio::time::timeout(wait, send).await.expect(late).unwrap();
        match sent {
            Ok(value) => succeeded.push((text, value)),
            Err(error) => failed.push((text, error.to_string())),
        }
    }
    (succeeded, failed)
}
