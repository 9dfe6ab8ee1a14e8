//! A removed agent's durable boxes are drained, not stranded (docs/architecture.md,
//! "Delegate, notify and the durable inbox"): the result of the task it was working at
//! its removal is delivered; the tasks already in its inbox, not yet worked, go back
//! to their delegator `rejected` with the reason "agent worker was removed before it
//! worked this task", each once, also when the process crashes mid-drain and the next
//! one (on the same SQLite file) finishes it; an agent defined again while its drain
//! runs works the entries left.
//!
//! Before the drain, every test here failed the same way: the worked task's result
//! stayed in the removed worker's outbox and its inbox tasks were never worked, so the
//! tasks stayed `submitted` until their deadline plus `AGENT_TASK_RESULT_GRACE_MS`.
//!
//! Runs in both builds: `cargo nextest run -p troupe-agent --test removed_agent_drain`
//! (tokio with paused time, and the multi-thread runtime), and with
//! `RUSTFLAGS="--cfg madsim"` on the simulator.

#[path = "support/crash_store.rs"]
mod crash_store;

use std::sync::Arc;
use std::time::Duration;

use crash_store::{CommitKeys, CrashStore};
use troupe_agent::{AgentEvent, AgentSpec, AgentSystem, ChatMessage, Role, ScriptRule, ScriptedLlm, TaskState};
use troupe_runtime::{SqliteStore, StateStore};

/// Tasks delegated to the worker that is removed.
const JOBS: usize = 4;
/// The tasks' timeout: far longer than any bound below, so no task ends by its
/// deadline (before the drain they ended `failed` at this plus 60 s).
const TASK_TIMEOUT_MS: u64 = 60_000;
/// How long the worker's model takes on a task.
const WORK_MS: u64 = 500;
/// How long the worker's model takes on a task in the SQLite crash test.
const SQLITE_WORK_MS: u64 = 5_000;
/// How long, after the removal returned, every task may take to end.
const DRAINED_WITHIN_MS: u64 = 5_000;
/// The pause between two delegations (their deliveries reach the worker in order).
const DELEGATION_GAP_MS: u64 = 50;
/// How often the tests look again.
const POLL_MS: u64 = 20;
/// The reason an unworked task of a removed agent is rejected with.
const REMOVED_REASON: &str = "agent worker was removed before it worked this task";
/// The reasons a task not yet in the worker's inbox is rejected with once the worker
/// is removed: its delegator's delivery finds it gone from the directory, or its
/// draining activation refuses the append.
const NOT_DELIVERED_REASONS: [&str; 2] = [
    "call refused: agent agent/worker not found",
    "agent/worker rejected the request: agent worker was removed; define it again to call it",
];

fn user_messages_containing(log: &[ChatMessage], needle: &str) -> usize {
    log.iter()
        .filter(|m| m.role == Role::User && m.content.contains(needle))
        .count()
}

fn start(store: Arc<dyn StateStore>, work: Duration) -> AgentSystem {
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("worker")
                .on_user_containing("[task")
                .reply("done {input}")
                .latency(work),
        )
        .rule(ScriptRule::agent("worker").reply("ready").latency(work))
        .rule(ScriptRule::agent("boss").reply("seen"));
    AgentSystem::builder()
        .store(store)
        .llm(Arc::new(llm))
        .agent(AgentSpec::new("boss"))
        .agent(AgentSpec::new("worker"))
        .start()
        .expect("the system starts")
}

/// Waits for the `n`-th model turn of `worker` to start from now (counted on `events`).
async fn worker_turn_started(events: &mut tokio::sync::broadcast::Receiver<AgentEvent>, n: usize, bound_ms: u64) {
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
    tokio::time::timeout(Duration::from_millis(bound_ms), started)
        .await
        .unwrap_or_else(|_| panic!("the worker's model turn {n} starts within {bound_ms} ms"));
}

/// Delegates `JOBS` tasks to `worker` while an ask (taking `work_ms`) keeps it busy,
/// so their appends queue in its mailbox, and returns their ids once a turn of the
/// worker on a task runs with at least one more task waiting in its inbox (the running
/// turn's entry leaves the inbox when that turn commits). Usually that is the turn on
/// task 0 with all the others in the inbox; a delivery that arrives out of order waits
/// for a retry, so on worker threads or the simulator a later turn may be the first.
async fn delegate_and_wait_for_the_inbox(system: &AgentSystem, work_ms: u64) -> Vec<String> {
    let mut events = system.subscribe();
    let client = system.client();
    let ask = tokio::spawn(async move { client.ask("worker", "warm up").await });
    worker_turn_started(&mut events, 1, work_ms).await;
    let mut tasks = Vec::new();
    for i in 0..JOBS {
        let task = system
            .delegate("boss", "worker", &format!("job-{i}."), Some(TASK_TIMEOUT_MS))
            .await
            .expect("acknowledged");
        tasks.push(task);
        // One delivery at a time: one that overtakes an earlier one is refused out of
        // order and retried later, after the turns the earlier one started.
        tokio::time::sleep(Duration::from_millis(DELEGATION_GAP_MS)).await;
    }
    ask.await.unwrap().expect("the warm-up ask is answered");
    for _ in 0..JOBS - 1 {
        worker_turn_started(&mut events, 1, 2 * work_ms).await;
        if system.pending("worker").await.unwrap().0 >= 2 {
            return tasks;
        }
    }
    panic!("no turn of the worker ran with a task waiting in its inbox");
}

/// Waits until every task of `tasks` is final at the boss, within `bound_ms`.
async fn ends(system: &AgentSystem, tasks: &[String], bound_ms: u64) -> Vec<(TaskState, String)> {
    let wait = async {
        loop {
            let mut ended = Vec::new();
            for task in tasks {
                if let Some(status) = system.task("boss", task).await.unwrap() {
                    if status.state.is_final() {
                        ended.push((status.state, status.result.unwrap_or_default()));
                    }
                }
            }
            if ended.len() == tasks.len() {
                break ended;
            }
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
    };
    match tokio::time::timeout(Duration::from_millis(bound_ms), wait).await {
        Ok(ended) => ended,
        Err(_) => {
            let mut states = Vec::new();
            for task in tasks {
                states.push(system.task("boss", task).await.unwrap().map(|s| s.state));
            }
            panic!(
                "tasks at a removed agent still open {bound_ms} ms after: {states:?}; pending boss {:?} worker {:?}",
                system.pending("boss").await,
                system.pending("worker").await
            );
        }
    }
}

/// The rule, checked: a task the worker worked (its turn committed: the task is in the
/// worker's log) completed with its answer; every other one rejected with
/// [`REMOVED_REASON`]; none worked twice; the boss read each end once; every box is
/// empty. Returns which tasks were worked.
async fn check_drained(system: &AgentSystem, tasks: &[String], ended: &[(TaskState, String)]) -> Vec<bool> {
    let settled = async {
        loop {
            if system.pending("boss").await.unwrap() == (0, 0) && system.pending("worker").await.unwrap() == (0, 0) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
    };
    tokio::time::timeout(Duration::from_millis(DRAINED_WITHIN_MS), settled)
        .await
        .expect("every inbox and outbox ends empty");
    let worker = system.conversation_log("worker").await.unwrap();
    let boss = system.conversation_log("boss").await.unwrap();
    let mut worked = Vec::new();
    for (i, (task, end)) in tasks.iter().zip(ended).enumerate() {
        let times = user_messages_containing(&worker, &format!("job-{i}."));
        assert!(times <= 1, "{task} worked {times} times");
        if times == 1 {
            assert_eq!(end.0, TaskState::Completed, "{task}: {end:?}");
            assert!(end.1.ends_with(&format!("job-{i}.")), "{task}: {end:?}");
        } else {
            // Rejected by the worker's drain, or refused at delivery (one not yet
            // delivered at the removal; or one whose acknowledgement a crash lost,
            // sent again by the next process): the boss's record takes the first end
            // that comes, once.
            assert_eq!(end.0, TaskState::Rejected, "{task}: {end:?}");
            assert!(
                end.1 == REMOVED_REASON || NOT_DELIVERED_REASONS.contains(&end.1.as_str()),
                "{task}: the reason names neither the removal nor the agent gone: {end:?}"
            );
        }
        worked.push(times == 1);
        assert_eq!(
            user_messages_containing(&boss, &format!("[task {task} you delegated is")),
            1,
            "{task}: {boss:#?}"
        );
    }
    worked
}

/// The drain scenario on the memory store: tasks in the inbox of a worker removed
/// during its first turn.
async fn a_removed_workers_inbox_is_drained() {
    let system = start(
        Arc::new(troupe_runtime::MemoryStore::new()),
        Duration::from_millis(WORK_MS),
    );
    let tasks = delegate_and_wait_for_the_inbox(&system, WORK_MS).await;
    system.remove_agent("worker").await.expect("removed");
    let ended = ends(&system, &tasks, DRAINED_WITHIN_MS).await;
    check_drained(&system, &tasks, &ended).await;
    assert!(
        ended.iter().any(|end| end.1 == REMOVED_REASON),
        "the drain rejected a task in the inbox: {ended:?}"
    );
    system.shutdown().await;
}

/// Goal: on paused time (the simulator in the madsim build), a worker removed during
/// its first turn delivers that task's result and rejects the 3 tasks in its inbox
/// with the reason, each once, within `DRAINED_WITHIN_MS` (before: all 4 `submitted`
/// until 120 s).
#[tokio::test(start_paused = true)]
async fn a_removed_agents_worked_result_is_delivered_and_its_unworked_tasks_rejected_once() {
    a_removed_workers_inbox_is_drained().await;
}

/// Goal: the same on tokio's multi-thread runtime (real time).
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_removed_agents_inbox_is_drained_once_on_the_multi_thread_runtime() {
    a_removed_workers_inbox_is_drained().await;
}

/// Goal: an agent defined again while its drain runs works the entries not yet ended
/// (the rule: each command's turn reads the directory; one that finds the agent
/// defined runs its model): all 4 tasks complete, each once, none rejected. Method:
/// the worker is defined again after the removal took it off the directory and while
/// its first turn (on task 0) still runs.
#[tokio::test(start_paused = true)]
async fn an_agent_defined_again_while_its_drain_runs_works_the_entries_left() {
    let system = start(
        Arc::new(troupe_runtime::MemoryStore::new()),
        Duration::from_millis(WORK_MS),
    );
    let tasks = delegate_and_wait_for_the_inbox(&system, WORK_MS).await;
    let client = system.client();
    let removal = tokio::spawn(async move { client.remove_agent("worker").await });
    let off = async {
        while system.current_directory().await.contains("worker") {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    tokio::time::timeout(Duration::from_millis(WORK_MS / 4), off)
        .await
        .expect("the removal takes the worker off the directory during its first turn");
    system
        .define_agent(AgentSpec::new("worker"))
        .await
        .expect("defined again");
    removal.await.unwrap().expect("removed");
    let ended = ends(&system, &tasks, DRAINED_WITHIN_MS + JOBS as u64 * WORK_MS).await;
    for (task, end) in tasks.iter().zip(&ended) {
        assert_eq!(end.0, TaskState::Completed, "{task}: {end:?}");
    }
    let boss = system.conversation_log("boss").await.unwrap();
    let worker = system.conversation_log("worker").await.unwrap();
    for (i, task) in tasks.iter().enumerate() {
        assert_eq!(
            user_messages_containing(&boss, &format!("[task {task} you delegated is")),
            1
        );
        assert_eq!(user_messages_containing(&worker, &format!("job-{i}.")), 1);
    }
    system.shutdown().await;
}

/// Runs the drain scenario on SQLite file `path`, crashing at the `crash_at`-th commit
/// from the removal on (0: never), then starts the next process on the same file and
/// checks the rule there. Returns the commits from the removal on of the first process.
async fn drain_with_crash(path: &std::path::Path, crash_at: u64) -> Vec<String> {
    let sqlite = Arc::new(SqliteStore::open(path).expect("the store opens")) as Arc<dyn StateStore>;
    let crash = Arc::new(CrashStore::new(sqlite, CommitKeys::AsStored));
    let first = start(
        Arc::clone(&crash) as Arc<dyn StateStore>,
        Duration::from_millis(SQLITE_WORK_MS),
    );
    let tasks = delegate_and_wait_for_the_inbox(&first, SQLITE_WORK_MS).await;
    // Tasks worked before the removal (on worker threads of the store, some may be).
    let log = first.conversation_log("worker").await.unwrap();
    let worked_before = (0..JOBS)
        .filter(|i| user_messages_containing(&log, &format!("job-{i}.")) == 1)
        .count();
    crash.arm(crash_at);
    let removed = first.remove_agent("worker").await;
    if crash_at == 0 {
        removed.expect("removed");
        let ended = ends(&first, &tasks, DRAINED_WITHIN_MS).await;
        let worked = check_drained(&first, &tasks, &ended).await;
        // The drain had work: the removal came with tasks unworked in the inbox.
        assert!(ended.iter().any(|end| end.1 == REMOVED_REASON), "{ended:?}");
        eprintln!("fault-free: worked {worked:?}");
        first.shutdown().await;
        return crash.log();
    }
    // The crash point is reached (the drain runs on after the removal returned). A
    // run's order, and so its number of commits, can differ from the fault-free run's
    // (SQLite's calls run on blocking threads; the simulator's order follows its
    // seed): a run that ends with fewer is dropped after it ended, and the next process
    // is checked the same.
    let crashed = async {
        while !crash.crashed() {
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
    };
    let reached = tokio::time::timeout(Duration::from_millis(DRAINED_WITHIN_MS), crashed).await;
    let commits = crash.log();
    if reached.is_err() {
        eprintln!(
            "crash point {crash_at} not reached: this run made {} commits",
            commits.len()
        );
    }
    drop(first); // the process dies
    let second = start(
        Arc::new(SqliteStore::open(path).expect("the store opens again")),
        Duration::from_millis(SQLITE_WORK_MS),
    );
    // A crash before the removal was stored leaves the worker defined: it works all.
    let ended = ends(&second, &tasks, DRAINED_WITHIN_MS + JOBS as u64 * SQLITE_WORK_MS).await;
    let worked = check_drained(&second, &tasks, &ended).await;
    eprintln!("crash at {crash_at}: worked {worked:?}");
    // Once the removal is stored (its record's commit applied, crashed at or not), the
    // worker works nothing but the tasks worked before and the one it was on.
    if commits.iter().any(|c| c.starts_with("agents:")) {
        assert!(
            worked[worked_before + 1..].iter().all(|w| !w),
            "crash at {crash_at}: worked {worked:?}, {worked_before} before the removal: {commits:#?}"
        );
    }
    second.shutdown().await;
    commits
}

/// Goal: a drain cut by a crash at any of its commits on SQLite (the removal's record,
/// the running turn's result, each rejection, each delivery, each read by the boss)
/// is finished by the next process on the same file, each task ended once: task 0
/// completed, the others rejected with the reason, the boss reading each once, the
/// worker never working an inbox task, every box empty. Method: a fault-free run
/// lists the commits from the removal on; then one run crashes at each of them (the
/// k-th applied but reported failed, nothing after), and the next process, started on
/// the file, resumes.
#[tokio::test(start_paused = true)]
async fn a_drain_cut_by_a_crash_on_sqlite_ends_each_task_once_in_the_next_process() {
    let dir = tempfile::tempdir().unwrap();
    let commits = drain_with_crash(&dir.path().join("free.sqlite3"), 0).await;
    eprintln!("{} commits from the removal on: {commits:#?}", commits.len());
    assert!(commits.len() >= JOBS, "{commits:#?}");
    for crash_at in 1..=commits.len() as u64 {
        drain_with_crash(&dir.path().join(format!("crash-{crash_at}.sqlite3")), crash_at).await;
    }
}
