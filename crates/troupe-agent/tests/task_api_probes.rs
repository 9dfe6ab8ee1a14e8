//! Probes of the task API an embedder calls (`delegate`, `cancel`, `task`) under
//! concurrency.
//!
//! Runs in both builds: `cargo test -p troupe-agent --test task_api_probes` (tokio
//! with paused time, and the multi-thread runtime) and under madsim
//! (`RUSTFLAGS="--cfg madsim"`).

use std::sync::Arc;
use std::time::Duration;

use troupe_agent::{AgentSpec, AgentSystem, ChatMessage, Role, ScriptRule, ScriptedLlm, TaskState};
use troupe_runtime::MemoryStore;

/// How long the worker's first task takes: the second waits behind it.
const FIRST_TASK: Duration = Duration::from_millis(500);
/// Cancellations of one task sent at once.
const CANCELS: usize = 4;

fn count(log: &[ChatMessage], needle: &str) -> usize {
    log.iter()
        .filter(|m| m.role == Role::User && m.content.contains(needle))
        .count()
}

/// Goal: several cancellations of one task sent at once, while the task waits behind
/// another: each is answered (queued, or the task already ended), the task resolves
/// canceled once, the delegator reads that once, and the worker never works on it.
async fn concurrent_cancels_of_one_task_resolve_it_once() {
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("worker")
                .on_user_containing("first")
                .reply("first done")
                .latency(FIRST_TASK),
        )
        .rule(ScriptRule::agent("worker").reply("done"))
        .rule(ScriptRule::agent("boss").reply("noted"))
        .without_recording();
    let system = AgentSystem::builder()
        .store(Arc::new(MemoryStore::new()))
        .llm(Arc::new(llm))
        .agent(AgentSpec::new("boss"))
        .agent(AgentSpec::new("worker"))
        .start()
        .expect("the system starts");
    let first = system.delegate("boss", "worker", "first", None).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let second = system.delegate("boss", "worker", "second", None).await.unwrap();
    let mut cancels = Vec::new();
    for _ in 0..CANCELS {
        let client = system.client();
        let task = second.clone();
        cancels.push(tokio::spawn(async move { client.cancel("boss", &task).await }));
    }
    for cancel in cancels {
        let answer = cancel.await.unwrap();
        assert!(matches!(answer, Ok(None) | Ok(Some(TaskState::Canceled))), "{answer:?}");
    }
    let mut states = None;
    for _ in 0..200 {
        let a = system.task("boss", &first).await.unwrap().map(|s| s.state);
        let b = system.task("boss", &second).await.unwrap().map(|s| s.state);
        states = Some((a, b));
        if a == Some(TaskState::Completed) && b == Some(TaskState::Canceled) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(states, Some((Some(TaskState::Completed), Some(TaskState::Canceled))));
    // Every result turn has run by the time the log shows it; a little longer lets a
    // second one, if any, land.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let boss = system.conversation_log("boss").await.unwrap();
    assert_eq!(count(&boss, "you delegated is canceled"), 1, "{boss:#?}");
    assert_eq!(count(&boss, "you delegated is completed"), 1, "{boss:#?}");
    let worker = system.conversation_log("worker").await.unwrap();
    assert_eq!(count(&worker, "second"), 0, "the worker never works on it");
    system.shutdown().await;
}

/// [`concurrent_cancels_of_one_task_resolve_it_once`] with paused time (and under the
/// simulator).
#[tokio::test(start_paused = true)]
async fn concurrent_cancels_resolve_the_task_once() {
    concurrent_cancels_of_one_task_resolve_it_once().await;
}

/// [`concurrent_cancels_of_one_task_resolve_it_once`] on the multi-thread runtime.
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_cancels_resolve_the_task_once_on_the_multi_thread_runtime() {
    concurrent_cancels_of_one_task_resolve_it_once().await;
}
