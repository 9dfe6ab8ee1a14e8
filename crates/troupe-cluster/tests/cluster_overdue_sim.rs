//! A delegated task that its delegatee accepted and never answers is resolved `failed` at
//! its due time (its deadline plus `AGENT_TASK_RESULT_GRACE_MS`) on a cluster, once, by
//! the node that runs its delegator, and by a living node when the delegator's node
//! died; a node that does not run the delegator sends it nothing (two simulated cluster
//! nodes, madsim's etcd, one `MemoryStore` both reach, the real agents, dispatcher,
//! routing and store; the scripted model of `support/agents.rs`; a resume sweep on each
//! node every [`SWEEP_MS`], as `troupe node` runs one).
//!
//! Every node defines `a`; only `b`'s home node defines `b`, so `b`'s work is lost with
//! that node (or with its entry, deleted from the store) and nobody answers `a`'s task.
//! The task's timeout is [`DELEGATION_TIMEOUT_MS`]: its due time is about 65 s after the
//! delegation, which the simulator passes in a moment.
//!
//! - `the_node_that_takes_over_a_dead_delegators_agent_resolves_its_overdue_task`: `a`
//!   and `b` live on node-2; `a` delegates `slow delegated work` to `b`; once `b` has
//!   the task (and `a`'s outbox is drained), node-2 is killed while `b` works, never to
//!   come back. Nothing is sent afterwards. The task is still `submitted` a second before
//!   its due time and `failed` ("no result by the task's deadline ...") within
//!   [`RESOLVED_WITHIN_MS`] after it, by a turn of `a` on node-1.
//! - `a_node_that_does_not_run_the_delegator_sends_its_overdue_wake_up_nowhere`: `a` and
//!   `b` live on node-1; `a` delegates to `b`, `b` loses the task while it works (its
//!   entry deleted from the store: its result is never delivered); node-2 starts after that, so it reads `a`'s open task from the
//!   store at its start (and its sweep each round). node-1 resolves the task at its due
//!   time; node-2's runtime starts no activation at all (no wake-up of `a` there, which
//!   `a`'s placement on node-1 would refuse, or which would move `a` to node-2).
//!
//! Run with `CARGO_TARGET_DIR=target/madsim RUSTFLAGS="--cfg madsim" cargo nextest run -p troupe-cluster --test cluster_overdue_sim`.
#![cfg(madsim)]

#[path = "support/agents.rs"]
mod agents;
#[path = "support/sim_etcd.rs"]
mod sim_etcd;
#[path = "support/sim_nodes.rs"]
mod sim_nodes;

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agents::{script, NodeObserver, Seen};
use madsim::runtime::{Handle, NodeHandle};
use sim_etcd::start_sim_etcd;
use sim_nodes::{joined_client, node_ip, place_on, run_rejoining, Slots, ETCD_ADDRESS};
use tokio::time::Instant;
use troupe_agent::limits::{AGENT_OVERDUE_TAKEOVER_DELAY_MS, AGENT_TASK_RESULT_GRACE_MS};
use troupe_agent::{AgentClient, AgentEvent, AgentSpec, AgentSystem, AgentSystemBuilder, ScriptedLlm, TaskState};
use troupe_core::Deadline;
use troupe_runtime::MemoryStore;

const NODE_NAMES: [&str; 2] = ["node-1", "node-2"];
/// The delegated task's timeout, in milliseconds.
const DELEGATION_TIMEOUT_MS: u64 = 5_000;
/// The sweep's period on each node, in milliseconds.
const SWEEP_MS: u64 = 1_000;
/// How long after its due time the task may take to be resolved, in simulated
/// milliseconds: a node that does not run the delegator waits
/// [`AGENT_OVERDUE_TAKEOVER_DELAY_MS`] past it before it wakes the delegator, with room.
const RESOLVED_WITHIN_MS: u64 = AGENT_OVERDUE_TAKEOVER_DELAY_MS + 5_000;
/// How long after its due time a task resolved by its delegator's own node has
/// settled (the resolution's turns, the failure shown to the model), in simulated
/// milliseconds.
const SETTLED_MS: u64 = 2_000;
const _: () = assert!(SETTLED_MS < AGENT_OVERDUE_TAKEOVER_DELAY_MS);
/// How long placing an agent (its first ask) may take, in milliseconds.
const ASK_TIMEOUT_MS: u64 = 10_000;
/// Pause between polls, in milliseconds.
const POLL_MS: u64 = 20;
/// Seeds each test runs under.
const SEEDS: u64 = 4;
/// Simulated time limit of one run, in seconds.
const RUN_TIME_LIMIT_S: u64 = 300;

/// Nodes whose agent systems define `a`, and `b` on node `b_home` only; each runs a
/// resume sweep while joined.
struct Cluster {
    llm: ScriptedLlm,
    seen: Seen,
    store: MemoryStore,
    slots: Arc<Slots>,
    b_home: usize,
}

impl Cluster {
    async fn new(b_home: usize) -> Self {
        let _etcd = start_sim_etcd(&Handle::current(), ETCD_ADDRESS).await;
        Self {
            llm: script(),
            seen: Seen::default(),
            store: MemoryStore::new(),
            slots: Arc::new(Mutex::new(vec![None; NODE_NAMES.len()])),
            b_home,
        }
    }

    /// Starts node `index` and waits until it has joined.
    async fn start_node(&self, index: usize) -> NodeHandle {
        let (slots, llm, seen, store, b_home) = (
            Arc::clone(&self.slots),
            self.llm.clone(),
            self.seen.clone(),
            self.store.clone(),
            self.b_home,
        );
        let node = Handle::current()
            .create_node()
            .name(NODE_NAMES[index])
            .ip(node_ip(index))
            .init(move || {
                let (slots, llm, seen, store) = (Arc::clone(&slots), llm.clone(), seen.clone(), store.clone());
                let system = move || agent_system(&llm, index, &seen, b_home);
                let joined = |client: &AgentClient| {
                    client
                        .start_resume_sweep(Duration::from_millis(SWEEP_MS))
                        .expect("the period is in range")
                };
                run_rejoining(index, NODE_NAMES[index], store, slots, system, joined, |sweep, _| {
                    drop(sweep)
                })
            })
            .build();
        joined_client(&self.slots, index).await;
        node
    }

    async fn client(&self, index: usize) -> AgentClient {
        joined_client(&self.slots, index).await
    }

    /// Runs `work` with node `index`'s client on that node.
    async fn on<T: Send + 'static, F: Future<Output = T> + Send + 'static>(
        &self,
        node: &NodeHandle,
        index: usize,
        work: impl FnOnce(AgentClient) -> F,
    ) -> T {
        let client = self.client(index).await;
        node.spawn(work(client)).await.expect("the node's task")
    }

    /// Places `agent` on node `index` (`node`): its first turn runs there.
    async fn place(&self, node: &NodeHandle, index: usize, agent: &str) {
        let client = self.client(index).await;
        let timeout = Duration::from_millis(ASK_TIMEOUT_MS);
        place_on(node, client, &self.seen, (index, NODE_NAMES[index]), agent, timeout).await;
    }

    /// `a`'s delegation of `slow delegated work` to `b`, through node `index`'s client,
    /// once `b` has the task in its inbox and `a`'s outbox is drained: the task's id.
    async fn delegate_until_acknowledged(&self, node: &NodeHandle, index: usize, reader: &NodeHandle) -> String {
        let task = self
            .on(node, index, |client| async move {
                client
                    .delegate("a", "b", "slow delegated work", Some(DELEGATION_TIMEOUT_MS))
                    .await
            })
            .await
            .expect("a takes the delegation");
        let sent = Instant::now();
        loop {
            let (a, b) = self
                .on(reader, 0, |client| async move {
                    (client.pending("a").await, client.pending("b").await)
                })
                .await;
            if b.expect("b's counters").0 == 1 && a.expect("a's counters").1 == 0 {
                return task;
            }
            assert!(
                sent.elapsed() < Duration::from_millis(ASK_TIMEOUT_MS),
                "the task was not delivered to b"
            );
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
    }

    /// `a`'s record of `task`, read through node-1 (`reader`).
    async fn task(&self, reader: &NodeHandle, task: &str) -> troupe_agent::TaskStatus {
        let task = task.to_string();
        self.on(reader, 0, |client| async move { client.task("a", &task).await })
            .await
            .expect("the record reads")
            .expect("an acknowledged task has a record")
    }

    /// The simulated instant `task` is due: its deadline plus the grace, read as a
    /// time from now on node-1's clock.
    async fn due_at(&self, reader: &NodeHandle, task: &str) -> Instant {
        let deadline = self.task(reader, task).await.deadline;
        let due = Deadline::after(deadline, Duration::from_millis(AGENT_TASK_RESULT_GRACE_MS));
        let now = self.client(0).await.runtime().now();
        Instant::now() + due.remaining(now)
    }

    /// `a`'s record of `task` once it is final, or as it stands at `bound`.
    async fn task_when_final(&self, reader: &NodeHandle, task: &str, bound: Instant) -> troupe_agent::TaskStatus {
        loop {
            let record = self.task(reader, task).await;
            if record.state.is_final() || Instant::now() >= bound {
                return record;
            }
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
    }

    /// The nodes `a`'s turns ran on since `from` (an index into its turns), in order.
    fn nodes_of_a_since(&self, from: usize) -> Vec<usize> {
        self.seen.turns_of("a")[from..]
            .iter()
            .map(|(node, _, _)| *node)
            .collect()
    }

    /// Deletes `b`'s inbox entries (and their `tasks_in/` keys) from the store.
    async fn lose_the_task_at_b(&self) {
        use troupe_runtime::StateStore;
        let b = troupe_agent::agent_id("b").unwrap();
        let mut writes = Vec::new();
        for prefix in ["inbox/", "tasks_in/"] {
            for (key, _) in self.store.scan(&b, prefix, None, 100).await.unwrap() {
                writes.push((key, None));
            }
        }
        assert_eq!(writes.len(), 2, "the task's entry and its tasks_in/ key");
        let claimed = self.store.claim(&b).await.unwrap();
        let commit = troupe_runtime::TurnCommit {
            state: troupe_runtime::StateChange::Unchanged,
            writes,
        };
        self.store.commit(&b, claimed.fence, commit).await.unwrap();
    }

    /// How many `DelegationFinished` events ended `task` `failed`, on any node.
    fn failed_ends(&self, task: &str) -> usize {
        self.seen
            .events()
            .iter()
            .filter(|(_, event)| {
                matches!(event, AgentEvent::DelegationFinished { task_id, state: TaskState::Failed, .. }
                    if task_id == task)
            })
            .count()
    }
}

/// Node `node`'s agent system: `a`, and `b` if `node` is `b_home`; the shared script
/// and the node's observer.
fn agent_system(llm: &ScriptedLlm, node: usize, seen: &Seen, b_home: usize) -> AgentSystemBuilder {
    let observer = NodeObserver {
        node,
        seen: seen.clone(),
    };
    let builder = AgentSystem::builder()
        .llm(Arc::new(llm.clone()))
        .observer(Arc::new(observer))
        .agent(AgentSpec::new("a").role("the a"));
    if node == b_home {
        builder.agent(AgentSpec::new("b").role("the b"))
    } else {
        builder
    }
}

/// What one run saw.
struct Outcome {
    /// The task a second before its due time, and when final (or at the bound).
    before_due: TaskState,
    after_due: troupe_agent::TaskStatus,
    /// Simulated ms from the due time until the task was final (the bound if never).
    resolved_after_due_ms: i128,
    /// The nodes of `a`'s turns since the fault (the kill, or node-2's start).
    a_nodes: Vec<usize>,
    failed_ends: usize,
    /// Activations node-2's runtime started (only counted where node-2 lives on).
    node_2_activations: Option<u64>,
    /// Turns node-1's runtime ran from [`SETTLED_MS`] after the due time until
    /// [`RESOLVED_WITHIN_MS`] after it (likewise): a wake-up node-2 routed to `a`.
    node_1_turns_later: Option<u64>,
}

/// Waits until a second before the task's due time, reads it, then waits until it is
/// final (at most [`RESOLVED_WITHIN_MS`] past the due time) and reads it again.
async fn around_due(cluster: &Cluster, reader: &NodeHandle, task: &str) -> (TaskState, troupe_agent::TaskStatus, i128) {
    let due_at = cluster.due_at(reader, task).await;
    tokio::time::sleep_until(due_at - Duration::from_secs(1)).await;
    let before_due = cluster.task(reader, task).await.state;
    let bound = due_at + Duration::from_millis(RESOLVED_WITHIN_MS);
    let after_due = cluster.task_when_final(reader, task, bound).await;
    let now = Instant::now();
    let resolved_after_due_ms = if now >= due_at {
        (now - due_at).as_millis() as i128
    } else {
        -((due_at - now).as_millis() as i128)
    };
    (before_due, after_due, resolved_after_due_ms)
}

/// `a` and `b` on node-2, which is killed once `b` has the task.
async fn delegator_node_dies() -> Outcome {
    let cluster = Cluster::new(1).await;
    let node_1 = cluster.start_node(0).await;
    let node_2 = cluster.start_node(1).await;
    cluster.place(&node_2, 1, "a").await;
    cluster.place(&node_2, 1, "b").await;
    let task = cluster.delegate_until_acknowledged(&node_2, 1, &node_1).await;
    let at_kill = cluster.task(&node_1, &task).await.state;
    assert_eq!(at_kill, TaskState::Submitted, "b still works at the kill");
    Handle::current().kill(node_2.id());
    let turns_before = cluster.seen.turns_of("a").len();
    let (before_due, after_due, resolved_after_due_ms) = around_due(&cluster, &node_1, &task).await;
    Outcome {
        before_due,
        after_due,
        resolved_after_due_ms,
        a_nodes: cluster.nodes_of_a_since(turns_before),
        failed_ends: cluster.failed_ends(&task),
        node_2_activations: None,
        node_1_turns_later: None,
    }
}

/// `a` and `b` on node-1; `b` loses the task while it works; node-2 starts after that.
async fn other_node_starts_after_the_delegation() -> Outcome {
    let cluster = Cluster::new(0).await;
    let node_1 = cluster.start_node(0).await;
    cluster.place(&node_1, 0, "a").await;
    cluster.place(&node_1, 0, "b").await;
    let task = cluster.delegate_until_acknowledged(&node_1, 0, &node_1).await;
    // b loses the task while it works (a removed agent's boxes are drained now, so a
    // removal would deliver its result): its entry is deleted from the store, which
    // fences b's activation off, so the turn working it cannot commit.
    cluster.lose_the_task_at_b().await;
    assert_eq!(
        cluster.task(&node_1, &task).await.state,
        TaskState::Submitted,
        "b's result is never delivered"
    );
    let turns_before = cluster.seen.turns_of("a").len();
    let _node_2 = cluster.start_node(1).await;
    let (before_due, after_due, resolved_after_due_ms) = around_due(&cluster, &node_1, &task).await;
    // The resolution's turns are over; then past the time node-2 would wake `a` if it did.
    let due_at = cluster.due_at(&node_1, &task).await;
    tokio::time::sleep_until(due_at + Duration::from_millis(SETTLED_MS)).await;
    let node_1_turns = cluster.client(0).await.runtime().counters().turns_run;
    tokio::time::sleep_until(due_at + Duration::from_millis(RESOLVED_WITHIN_MS)).await;
    let node_1_turns_later = cluster.client(0).await.runtime().counters().turns_run - node_1_turns;
    let node_2_activations = cluster.client(1).await.runtime().counters().activations_started;
    Outcome {
        before_due,
        after_due,
        resolved_after_due_ms,
        a_nodes: cluster.nodes_of_a_since(turns_before),
        failed_ends: cluster.failed_ends(&task),
        node_2_activations: Some(node_2_activations),
        node_1_turns_later: Some(node_1_turns_later),
    }
}

fn run_seed<F: Future<Output = Outcome> + 'static>(seed: u64, scenario: impl FnOnce() -> F) -> Outcome {
    let mut runtime = madsim::runtime::Runtime::with_seed_and_config(seed, madsim::Config::default());
    runtime.set_time_limit(Duration::from_secs(RUN_TIME_LIMIT_S));
    runtime.block_on(scenario())
}

/// Checks what every run must show: submitted before its due time, then failed for want
/// of a result, once, within the bound.
fn check_resolved_at_due(seed: u64, outcome: &Outcome) {
    assert_eq!(
        outcome.before_due,
        TaskState::Submitted,
        "seed {seed}: not due a second before its due time"
    );
    assert_eq!(
        outcome.after_due.state,
        TaskState::Failed,
        "seed {seed}: resolved within {RESOLVED_WITHIN_MS} ms of its due time: {:?}",
        outcome.after_due
    );
    let result = outcome.after_due.result.clone().unwrap_or_default();
    assert!(
        result.starts_with("no result by the task's deadline"),
        "seed {seed}: resolved as overdue: {result}"
    );
    assert_eq!(outcome.failed_ends, 1, "seed {seed}: one end");
}

/// Goal: a task whose delegator's node died after the delegation (and whose delegatee's
/// work died with it) is resolved `failed` at its due time by the living node, with
/// nothing sent to the delegator: the living node learns of the open task from the
/// store in its resume sweep and wakes the delegator at its due time (after
/// `AGENT_OVERDUE_TAKEOVER_DELAY_MS`), which claims it there. Before, the living node
/// armed wake-ups only at its start, before this task existed, and the task stayed
/// `submitted` until something reached the delegator.
#[test]
fn the_node_that_takes_over_a_dead_delegators_agent_resolves_its_overdue_task() {
    for seed in 1..=SEEDS {
        let outcome = run_seed(seed, delegator_node_dies);
        eprintln!(
            "seed {seed}: {:?} {} ms after its due time; a's turns since the kill on {:?}",
            outcome.after_due.state, outcome.resolved_after_due_ms, outcome.a_nodes
        );
        check_resolved_at_due(seed, &outcome);
        assert!(
            !outcome.a_nodes.is_empty() && outcome.a_nodes.iter().all(|node| *node == 0),
            "seed {seed}: a ran on node-1 only after the kill: {:?}",
            outcome.a_nodes
        );
    }
}

/// Goal: a node that does not run the delegator sends no wake-up for its overdue task:
/// the delegator's own node resolves it at its due time, and the other node, which read
/// the open task from the store (at its start, and in each sweep), finds it resolved
/// when it looks, after `AGENT_OVERDUE_TAKEOVER_DELAY_MS`, and starts no activation.
/// Before, the other node told the delegator locally at the due time: its runtime
/// started an activation of `a`, whose claim `a`'s placement on node-1 refused (or, with
/// `a` idle and released by then, which moved `a` to node-2).
#[test]
fn a_node_that_does_not_run_the_delegator_sends_its_overdue_wake_up_nowhere() {
    for seed in 1..=SEEDS {
        let outcome = run_seed(seed, other_node_starts_after_the_delegation);
        eprintln!(
            "seed {seed}: {:?} {} ms after its due time; a's turns since node-2 started on {:?}; \
             node-2 started {:?} activations; node-1 ran {:?} turns after it settled",
            outcome.after_due.state,
            outcome.resolved_after_due_ms,
            outcome.a_nodes,
            outcome.node_2_activations,
            outcome.node_1_turns_later
        );
        check_resolved_at_due(seed, &outcome);
        assert_eq!(
            outcome.node_2_activations,
            Some(0),
            "seed {seed}: node-2 started no activation"
        );
        assert_eq!(
            outcome.node_1_turns_later,
            Some(0),
            "seed {seed}: no wake-up reached a after its resolution"
        );
        assert!(
            !outcome.a_nodes.is_empty() && outcome.a_nodes.iter().all(|node| *node == 0),
            "seed {seed}: a ran on node-1 only: {:?}",
            outcome.a_nodes
        );
    }
}
