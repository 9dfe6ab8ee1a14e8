//! Testing your own agents under the simulator, as an embedder does it: this file uses
//! only the `troupe` facade, `tokio` (renamed `madsim-tokio`) and `madsim`, not the
//! project's own DST harness (`troupe-sim`, which is not published). README.md,
//! "Testing your agents under the simulator", walks through it.
//!
//! The application: `coordinator` asks `analyst` through `call_agent`, on a model that
//! the test makes flaky (it fails or answers slowly, at times past the ask's timeout, as
//! the seed decides), with its state in a SQLite file. The process is killed at a moment the seed picks and
//! started again on the same file. What the application's users must be able to rely on:
//! - every ask ends by its timeout (plus [`DEADLINE_SLACK_MS`]), answered or with a
//!   typed error;
//! - every answered ask is in `coordinator`'s log exactly once after the crash, with
//!   the answer its caller got, and no ask is in it twice;
//! - after the restart, the agents keep answering.
//!
//! Run (each seed replays exactly; a failure prints its seed):
//! `RUSTFLAGS="--cfg madsim" cargo test --test embedder_simulation`, with
//! `MADSIM_TEST_SEED=7` for one seed, `MADSIM_TEST_NUM=100` for a hundred from it, and
//! `MADSIM_TEST_CHECK_DETERMINISM=1` to run a seed twice and compare every random draw.
#![cfg(madsim)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use madsim::rand::{thread_rng, Rng};
use troupe::agent::{
    AgentCallError, AgentSpec, AgentSystem, LlmClient, LlmError, LlmReply, LlmRequest, Role, ScriptRule, ScriptedLlm,
};
use troupe::json;
use troupe::runtime::SqliteStore;

/// How long each ask may take, as the application's callers set it.
const ASK_TIMEOUT_MS: u64 = 2_000;
/// How late past its timeout an ask may end: the simulator's clock is exact, so this is
/// the runtime's own work, not scheduling noise.
const DEADLINE_SLACK_MS: u64 = 10;
/// Asks before the crash (the crash usually cuts them short) and after the restart.
const ASKS: usize = 40;
/// Percent of model calls that fail at once.
const MODEL_FAILURE_PERCENT: u32 = 10;
/// Percent of model calls that answer after [`MODEL_SLOW_MS`] (some asks then time out).
const MODEL_SLOW_PERCENT: u32 = 10;
/// A slow model call's latency range, in milliseconds.
const MODEL_SLOW_MS: std::ops::Range<u64> = 500..3_000;
/// A normal model call's latency range, in milliseconds.
const MODEL_FAST_MS: std::ops::Range<u64> = 1..50;
/// The crash comes this long after the start, the seed picks where (milliseconds).
const CRASH_AFTER_MS: std::ops::Range<u64> = 200..8_000;

/// The model, made flaky by the simulator's seeded random generator: the embedder's
/// own fault injection, wrapped around the scripted model that plays the agents.
struct FlakyModel {
    inner: ScriptedLlm,
}

#[troupe::async_trait]
impl LlmClient for FlakyModel {
    async fn complete(&self, request: LlmRequest) -> Result<LlmReply, LlmError> {
        let (roll, latency_ms) = {
            let mut rng = thread_rng();
            let roll = rng.gen_range(0..100);
            let slow = (MODEL_FAILURE_PERCENT..MODEL_FAILURE_PERCENT + MODEL_SLOW_PERCENT).contains(&roll);
            let latency_ms = if slow {
                rng.gen_range(MODEL_SLOW_MS)
            } else {
                rng.gen_range(MODEL_FAST_MS)
            };
            (roll, latency_ms)
        };
        tokio::time::sleep(Duration::from_millis(latency_ms)).await;
        if roll < MODEL_FAILURE_PERCENT {
            return Err(LlmError::Unreachable {
                cause: "injected by the test".into(),
            });
        }
        self.inner.complete(request).await
    }
}

/// The application: two agents on the flaky model, state in the SQLite file at `path`.
fn start_application(path: &PathBuf) -> AgentSystem {
    let script = ScriptedLlm::new()
        .without_recording()
        .rule(
            ScriptRule::agent("coordinator")
                .on_user_containing("question")
                .call("call_agent", json!({"agent_id": "analyst", "message": "{input}"})),
        )
        .rule(
            ScriptRule::agent("coordinator")
                .on_tool_result()
                .reply("analyst says: {tool_result}"),
        )
        .rule(ScriptRule::agent("analyst").reply("noted: {input}"));
    AgentSystem::builder()
        .store(Arc::new(
            SqliteStore::open(path).expect("open the application's SQLite file"),
        ))
        .llm(Arc::new(FlakyModel { inner: script }))
        .agent(AgentSpec::new("coordinator").role("answers questions with the analyst's help"))
        .agent(AgentSpec::new("analyst").role("answers the coordinator"))
        .start()
        .expect("the application starts")
}

/// What the application's callers were told: the answer of every ask that succeeded.
type Answered = Arc<Mutex<BTreeMap<String, String>>>;

/// Sends [`ASKS`] asks one after another, checking each ends in time, and records the
/// answered ones; returns how many failed (typed, in time).
async fn ask_all(system: &AgentSystem, round: &str, answered: &Answered) -> usize {
    let mut failed = 0;
    for i in 0..ASKS {
        let question = format!("question {i} of the {round}");
        let started = tokio::time::Instant::now();
        let outcome = system
            .ask_with_timeout("coordinator", &question, Duration::from_millis(ASK_TIMEOUT_MS))
            .await;
        let took = started.elapsed();
        assert!(
            took <= Duration::from_millis(ASK_TIMEOUT_MS + DEADLINE_SLACK_MS),
            "`{question}` ended after {took:?}, past its {ASK_TIMEOUT_MS} ms timeout: {outcome:?}"
        );
        match outcome {
            Ok(reply) => {
                answered.lock().unwrap().insert(question, reply.text);
            }
            // A model that fails: its typed error (the fault wrapper's `Unreachable`);
            // one too slow, or a call cut by the crash: the runtime's typed errors.
            Err(AgentCallError::ModelFailed(_)) | Err(AgentCallError::Invoke(_)) => failed += 1,
            Err(other) => panic!("`{question}` failed with an error the application does not expect: {other}"),
        }
    }
    failed
}

/// The answered asks are each in `coordinator`'s log once, followed by the answer their
/// caller got; no ask is in it twice.
async fn check_log(system: &AgentSystem, answered: &Answered) {
    let log = system.conversation_log("coordinator").await.expect("read the log");
    let mut seen = BTreeMap::new();
    for (at, message) in log.iter().enumerate() {
        if message.role == Role::User {
            assert!(
                seen.insert(message.content.clone(), at).is_none(),
                "`{}` is in the log twice",
                message.content
            );
        }
    }
    for (question, answer) in answered.lock().unwrap().iter() {
        let at = *seen
            .get(question)
            .unwrap_or_else(|| panic!("`{question}` was answered, but the log lost it"));
        let logged = log[at + 1..]
            .iter()
            .find(|m| m.role == Role::Assistant && m.tool_calls.is_empty())
            .unwrap_or_else(|| panic!("`{question}` was answered, but its answer is not in the log"));
        assert_eq!(&logged.content, answer, "the logged answer to `{question}`");
    }
}

/// A fresh SQLite file for this run (the determinism check runs a seed twice in one
/// process, so the first run's file is removed, with SQLite's side files).
fn fresh_file(name: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!("troupe-embedder-simulation-{name}-{}.db", std::process::id()));
    for suffix in ["", "-wal", "-shm", "-journal"] {
        let mut side = path.clone().into_os_string();
        side.push(suffix);
        let _ = std::fs::remove_file(side);
    }
    path
}

/// Goal: the guarantees in the file's documentation hold through a flaky model and a
/// crash at a moment the seed picks. Method: the application runs on its own simulated
/// node; the node is killed (its tasks dropped mid-turn, as a process dies) and the
/// application starts again, on another node, on the same file; the log is checked against what the callers were told, then
/// the restarted application answers another round.
#[madsim::test]
async fn answered_asks_survive_a_crash_on_a_flaky_model() {
    let path = fresh_file("crash");
    let answered = Answered::default();
    let handle = madsim::runtime::Handle::current();
    let node = handle.create_node().name("application").build();
    let crash_after = Duration::from_millis(thread_rng().gen_range(CRASH_AFTER_MS));

    let before = node.spawn({
        let (path, answered) = (path.clone(), answered.clone());
        async move {
            let system = start_application(&path);
            ask_all(&system, "first run", &answered).await
        }
    });
    tokio::time::sleep(crash_after).await;
    handle.kill(node.id());
    // The first run either finished before the crash (and reports its failures) or was
    // cut by it.
    let first_run = before.await;
    let answered_before = answered.lock().unwrap().len();
    // The process starts again on the same file: a fresh node (madsim's `restart` of a
    // node cancels what is spawned on it after, so the new process gets its own).
    let restarted = handle.create_node().name("application-restarted").build();

    let failed_after = restarted
        .spawn({
            let (path, answered) = (path.clone(), answered.clone());
            async move {
                let system = start_application(&path);
                check_log(&system, &answered).await;
                let failed = ask_all(&system, "second run", &answered).await;
                check_log(&system, &answered).await;
                system.shutdown().await;
                failed
            }
        })
        .await
        .expect("the restarted application runs to its end");
    let answered = answered.lock().unwrap().len();
    println!(
        "crash at {crash_after:?} ({}); answered {answered_before} before it, {} after the restart ({failed_after} failed)",
        match first_run {
            Ok(failed) => format!("after the first run's {ASKS} asks, {failed} of them failed"),
            Err(_) => "during the first run".to_string(),
        },
        answered - answered_before,
    );
    // The flaky model fails about one ask in three; the rest must be answered.
    assert!(answered >= ASKS / 3, "only {answered} asks answered");
    assert!(failed_after < ASKS, "every ask after the restart failed");
    let _ = std::fs::remove_file(&path);
}
