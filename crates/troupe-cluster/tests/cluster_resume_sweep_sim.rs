//! A delegatee whose node dies while it works a task, with no later request to it and
//! no node starting, is taken over by a living node's resume sweep
//! (`AgentClient::start_resume_sweep`) and completes the task (two simulated cluster
//! nodes, madsim's etcd, one `MemoryStore` both reach, the real agents, dispatcher,
//! routing and store; the scripted model of `support/agents.rs`).
//!
//! Method, per seed: `a` is placed on node-1 and `b` on node-2. Through node-1's client,
//! `a` delegates a task of `slow delegated work` to `b` (the model takes
//! `SLOW_TASK_MODEL_LATENCY_MS` on it). Once `b`'s inbox holds the task and `a`'s outbox
//! is drained (the delivery was acknowledged), node-2 is killed at a random moment
//! within the model's latency and never restarted. Nothing is sent afterwards.
//!
//! With a sweep on each node: the task completes once, worked by `b` on node-1, within
//! [`SETTLE_BOUND_MS`]. Without one (the control): it is still unresolved, and the entry
//! still in `b`'s inbox, [`SETTLE_BOUND_MS`] later: the gap the sweep closes.
//!
//! Also: a cancellation made through another node's client (`cancel_scenario`).
//!
//! Run with `CARGO_TARGET_DIR=target/madsim RUSTFLAGS="--cfg madsim" cargo nextest run -p troupe-cluster --test cluster_resume_sweep_sim`.
#![cfg(madsim)]

#[path = "support/agents.rs"]
mod agents;
#[path = "support/sim_etcd.rs"]
mod sim_etcd;
#[path = "support/sim_nodes.rs"]
mod sim_nodes;

use sim_etcd::start_sim_etcd;
use sim_nodes::ETCD_ADDRESS;
use std::time::Duration;

use agents::{script, SLOW_TASK_MODEL_LATENCY_MS};
use madsim::rand::Rng;
use madsim::runtime::Handle;
use tokio::time::Instant;
use troupe_agent::{ChatMessage, Role, TaskState, TaskStatus};

const NODE_NAMES: [&str; 2] = ["node-1", "node-2"];
/// How long each ask may take, in milliseconds.
const ASK_TIMEOUT_MS: u64 = 10_000;
/// The sweep's period on each node, in milliseconds.
const SWEEP_MS: u64 = 1_000;
/// How long the task may take to complete after the kill, in simulated milliseconds:
/// the lease TTL (3 s), a sweep period (1 s), the model's latency (2 s), with room.
const SETTLE_BOUND_MS: u64 = 20_000;
/// Pause between polls, in milliseconds.
const POLL_MS: u64 = 20;
/// Seeds each test runs under.
const SEEDS: u64 = 6;
/// Simulated time limit of one run, in seconds.
const RUN_TIME_LIMIT_S: u64 = 120;

/// The two nodes (`sim_nodes::SweepCluster`); this file's reads are below.
type Cluster = sim_nodes::SweepCluster;

/// Two nodes, each joining again after a lost lease, each running a resume sweep
/// (every [`SWEEP_MS`]) if `sweep`.
async fn start_cluster(sweep: bool) -> Cluster {
    let _etcd = start_sim_etcd(&Handle::current(), ETCD_ADDRESS).await;
    let sweep = sweep.then_some(Duration::from_millis(SWEEP_MS));
    Cluster::start(&NODE_NAMES, &script(), sweep, Duration::from_millis(ASK_TIMEOUT_MS)).await
}

impl Cluster {
    async fn task(&self, id: &str) -> TaskStatus {
        let id = id.to_string();
        self.on_node_1(|client| async move { client.task("a", &id).await })
            .await
            .expect("the task reads")
            .expect("an acknowledged task has a record")
    }

    async fn log(&self, agent: &'static str) -> Vec<ChatMessage> {
        self.on_node_1(move |client| async move { client.conversation_log(agent).await })
            .await
            .expect("the log reads")
    }

    /// `a` delegates `text` to `b`, through node-1; the task's id.
    async fn delegate_slow(&self, text: &'static str) -> String {
        self.on_node_1(move |client| async move { client.delegate("a", "b", text, None).await })
            .await
            .expect("a (node-1) takes the delegation")
    }

    /// Cancels `a`'s task `task` through node-2's client (`a` lives on node-1).
    async fn cancel_through_node_2(&self, task: &str) -> Option<TaskState> {
        let (client, task) = (self.client(1).await, task.to_string());
        self.nodes[1]
            .spawn(async move { client.cancel("a", &task).await })
            .await
            .expect("node-2's task")
            .expect("a (node-1) answers the cancellation sent through node-2")
    }

    /// The nodes `agent`'s turns ran on, in order, repeats collapsed.
    fn nodes_of(&self, agent: &str) -> Vec<&'static str> {
        let mut nodes: Vec<&'static str> = self
            .seen
            .turns_of(agent)
            .iter()
            .map(|(node, _, _)| NODE_NAMES[*node])
            .collect();
        nodes.dedup();
        nodes
    }
}

fn count(log: &[ChatMessage], needle: &str) -> usize {
    log.iter()
        .filter(|m| m.role == Role::User && m.content.contains(needle))
        .count()
}

/// What one run saw.
struct Outcome {
    /// The task's state at the end (completed, or how it stood at the bound).
    state: TaskState,
    /// Simulated ms from the kill until the task completed and `b`'s outbox drained (the
    /// bound if not).
    settled_ms: u128,
    /// `b`'s inbox and outbox at the end.
    b_pending: (u64, u64),
    /// Times `b`'s committed log holds the task, and `a`'s its completion.
    worked: usize,
    completions: usize,
    b_nodes: Vec<&'static str>,
    /// Every agent event of both nodes, rendered, in order: the run's record.
    record: Vec<String>,
}

/// The scenario of the module docs, with or without sweeps.
async fn scenario(sweep: bool) -> Outcome {
    let cluster = start_cluster(sweep).await;
    cluster.place(0, "a").await;
    cluster.place(1, "b").await;
    let kill_after = madsim::rand::thread_rng().gen_range(0..SLOW_TASK_MODEL_LATENCY_MS / 2);
    let id = cluster
        .on_node_1(|client| async move { client.delegate("a", "b", "slow delegated work", None).await })
        .await
        .expect("a (node-1) takes the delegation");
    // Delivered and acknowledged: in b's inbox, out of a's outbox.
    let sent = Instant::now();
    while !(cluster.pending("b").await.0 == 1 && cluster.pending("a").await.1 == 0) {
        assert!(
            sent.elapsed() < Duration::from_millis(ASK_TIMEOUT_MS),
            "the task was not delivered to b"
        );
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
    tokio::time::sleep(Duration::from_millis(kill_after)).await;
    let at_kill = cluster.task(&id).await.state;
    assert!(!at_kill.is_final(), "b is still working at the kill: {at_kill:?}");
    Handle::current().kill(cluster.nodes[1].id());
    let killed = Instant::now();
    // Settled: the task completed at `a`, and `b`'s report of it acknowledged (its
    // outbox entry removed a moment after `a` committed the result).
    let (state, b_pending) = loop {
        let (state, b_pending) = (cluster.task(&id).await.state, cluster.pending("b").await);
        let settled = state == TaskState::Completed && b_pending == (0, 0);
        if settled || killed.elapsed() >= Duration::from_millis(SETTLE_BOUND_MS) {
            break (state, b_pending);
        }
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    };
    let settled_ms = killed.elapsed().as_millis();
    Outcome {
        state,
        settled_ms,
        b_pending,
        worked: count(&cluster.log("b").await, &format!("[task {id} delegated by agent a]")),
        completions: count(
            &cluster.log("a").await,
            &format!("[task {id} you delegated is completed]"),
        ),
        b_nodes: cluster.nodes_of("b"),
        record: cluster.seen.record(),
    }
}

fn run_seed(seed: u64, sweep: bool) -> Outcome {
    let mut runtime = madsim::runtime::Runtime::with_seed_and_config(seed, madsim::Config::default());
    runtime.set_time_limit(Duration::from_secs(RUN_TIME_LIMIT_S));
    runtime.block_on(scenario(sweep))
}

/// Goal: with a resume sweep on every node, a task whose delegatee's node died mid-work
/// completes exactly once, worked by the delegatee on the living node, though nothing
/// is sent to it after the kill and no node starts.
#[test]
fn a_sweep_on_a_living_node_takes_over_a_dead_nodes_pending_task() {
    let (mut fastest, mut slowest) = (u128::MAX, 0);
    for seed in 1..=SEEDS {
        let outcome = run_seed(seed, true);
        eprintln!(
            "seed {seed}: {:?} {} ms after the kill; b ran on {:?}",
            outcome.state, outcome.settled_ms, outcome.b_nodes
        );
        assert_eq!(outcome.state, TaskState::Completed, "seed {seed}: the task completes");
        assert_eq!(outcome.worked, 1, "seed {seed}: b's committed log holds the task once");
        assert_eq!(outcome.completions, 1, "seed {seed}: a learns the result once");
        assert_eq!(outcome.b_pending, (0, 0), "seed {seed}: b's inbox and outbox drained");
        assert_eq!(outcome.b_nodes, ["node-2", "node-1"], "seed {seed}: b moved to node-1");
        fastest = fastest.min(outcome.settled_ms);
        slowest = slowest.max(outcome.settled_ms);
    }
    eprintln!("over {SEEDS} seeds: the task completed {fastest}–{slowest} ms (simulated) after the kill");
}

/// Goal (the control): without a sweep, the same task is still unresolved
/// [`SETTLE_BOUND_MS`] after the kill, its entry still in `b`'s inbox: nothing else
/// resumes it, so the test above shows the sweep's work.
#[test]
fn without_a_sweep_the_dead_nodes_pending_task_waits() {
    for seed in 1..=SEEDS {
        let outcome = run_seed(seed, false);
        assert!(
            !outcome.state.is_final(),
            "seed {seed}: nothing resumed b: {:?}",
            outcome.state
        );
        assert_eq!(outcome.b_pending.0, 1, "seed {seed}: the task is still in b's inbox");
        assert_eq!(outcome.worked, 0, "seed {seed}: b's work died with its node");
        assert_eq!(outcome.b_nodes, ["node-2"], "seed {seed}: b ran nowhere else");
    }
}

/// Goal: two runs of a seed record the same agent events in the same order, sweeps
/// included (the scenario replays from its seed).
#[test]
fn the_sweep_scenario_replays_identically_from_its_seed() {
    let (first, second) = (run_seed(1, true).record, run_seed(1, true).record);
    assert!(!first.is_empty());
    assert_eq!(first, second, "seed 1 replays identically");
}

/// What the cross-node cancellation scenario saw.
struct Cancellation {
    /// `cancel` of the waiting task through node-2's client, and of the finished one.
    queued: Option<TaskState>,
    after_end: Option<TaskState>,
    /// The two tasks' final states.
    first: TaskState,
    second: TaskState,
    /// Times `b`'s committed log holds the second task, and `a`'s its cancellation.
    second_worked: usize,
    second_canceled: usize,
}

/// `a` (node-1) delegates two slow tasks to `b` (node-2); the second is canceled through
/// node-2's client at once, so the command crosses to `a`'s node.
async fn cancel_scenario() -> Cancellation {
    let cluster = start_cluster(false).await;
    cluster.place(0, "a").await;
    cluster.place(1, "b").await;
    let first = cluster.delegate_slow("slow delegated work 1").await;
    let second = cluster.delegate_slow("slow delegated work 2").await;
    let queued = cluster.cancel_through_node_2(&second).await;
    let started = Instant::now();
    let (first_state, second_state) = loop {
        let (one, two) = (cluster.task(&first).await.state, cluster.task(&second).await.state);
        if one.is_final() && two.is_final() && cluster.pending("b").await == (0, 0) {
            break (one, two);
        }
        assert!(
            started.elapsed() < Duration::from_millis(SETTLE_BOUND_MS),
            "the tasks did not end: {one:?}, {two:?}"
        );
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    };
    let after_end = cluster.cancel_through_node_2(&first).await;
    Cancellation {
        queued,
        after_end,
        first: first_state,
        second: second_state,
        second_worked: count(
            &cluster.log("b").await,
            &format!("[task {second} delegated by agent a]"),
        ),
        second_canceled: count(
            &cluster.log("a").await,
            &format!("[task {second} you delegated is canceled]"),
        ),
    }
}

/// Goal: a cancellation made through another node's client reaches the delegator's
/// node: the waiting task is canceled and never worked, the running one completes, and
/// cancelling a finished task through that client reports its final state.
#[test]
fn a_cancellation_through_another_nodes_client_reaches_the_delegator() {
    let mut canceled = 0;
    for seed in 1..=SEEDS {
        let mut runtime = madsim::runtime::Runtime::with_seed_and_config(seed, madsim::Config::default());
        runtime.set_time_limit(Duration::from_secs(RUN_TIME_LIMIT_S));
        let seen = runtime.block_on(cancel_scenario());
        eprintln!("seed {seed}: the second task ended {:?}", seen.second);
        assert_eq!(seen.queued, None, "seed {seed}: the cancellation is queued");
        assert_eq!(
            seen.first,
            TaskState::Completed,
            "seed {seed}: the running task completes"
        );
        // The cancellation wins if it reaches b before b starts the task: then it is never
        // worked. The two tasks are delivered by separate tasks, so the second may reach b
        // first and be running when the cancellation arrives: then it completes.
        match seen.second {
            TaskState::Canceled => {
                assert_eq!(seen.second_worked, 0, "seed {seed}: b never worked the canceled task");
                assert_eq!(
                    seen.second_canceled, 1,
                    "seed {seed}: a learns of the cancellation once"
                );
                canceled += 1;
            }
            TaskState::Completed => {
                assert_eq!(seen.second_worked, 1, "seed {seed}: b worked the task once");
                assert_eq!(seen.second_canceled, 0, "seed {seed}: no cancellation notice");
            }
            other => panic!("seed {seed}: the second task ended {other:?}"),
        }
        assert_eq!(
            seen.after_end,
            Some(TaskState::Completed),
            "seed {seed}: a finished task reports its state"
        );
    }
    eprintln!("the waiting task was canceled through node-2 in {canceled} of {SEEDS} seeds");
    assert!(canceled > 0, "the cancellation through node-2 took effect in no seed");
}
