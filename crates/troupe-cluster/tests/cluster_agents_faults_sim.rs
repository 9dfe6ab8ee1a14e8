//! Agent deliveries across three simulated cluster nodes under node faults (madsim's
//! etcd, one `MemoryStore` every node reaches, the real agents, dispatcher, routing and
//! store; the scripted model of `support/agents.rs`).
//!
//! Method, per seed: `a` is placed on node-1, `b` on node-2, `c` on node-3. Through
//! node-1's client (node-1 is never faulted) the test makes `a` delegate
//! [`DELEGATIONS`] tasks to `b` (`AgentClient::delegate`: the command is persisted in
//! `a`'s outbox, delivered to `b`'s owner, worked in a turn of `b`, its result delivered
//! back to `a`'s inbox) and sends `c` [`NOTIFICATIONS`] notifications
//! (`notify_with_id`, retried with the same id until acknowledged) and as many from `a`
//! (`notify_as`: queued in `a`'s outbox, delivered to `c`'s owner), spaced at random;
//! one delegation in [`CANCEL_ONE_IN`] is canceled (`AgentClient::cancel`) right after
//! it is made (the cancellation's tombstone is delivered to `b`'s owner).
//! Faults at random moments (seeded): node-2 (`b`'s owner) killed, restarted
//! [`RESTART_AFTER_MS_MIN`]–[`RESTART_AFTER_MS_MAX`] ms later; node-3 (`c`'s owner) cut
//! from etcd for [`CUT_MS`] ms (its lease runs out: it drops its activations and joins
//! again with a new lease).
//!
//! Invariants after settling: every acknowledged delegation has exactly one outcome at
//! `a` (its task record final, the outcome in `a`'s committed log once): `Completed`
//! with `b`'s answer and `b`'s committed log holding the task once, or `Canceled` (only
//! if a cancellation was queued) and `b` never worked it; each acknowledged notification is in `c`'s
//! committed log exactly once; every inbox and outbox drained; `c` processed `a`'s
//! notifications, and `b` worked `a`'s tasks, in the order `a` sent them (with the
//! receiver's order check removed, seed 3 works them as 4, 2, 1, 3, 0; 400 seeds passed
//! with it on 2026-11-30, by hand).
//!
//! A second scenario (`mention_scenario`, below) puts a conversation on node-2 and kills
//! it, and cuts node-3 (`c`'s owner) from etcd, while mentions of `b` and `c` are being
//! delivered and answered: every mention is answered exactly once.
//!
//! Run with `CARGO_TARGET_DIR=target/madsim RUSTFLAGS="--cfg madsim" cargo nextest run -p troupe-cluster --test cluster_agents_faults_sim`.
#![cfg(madsim)]

#[path = "support/agents.rs"]
mod agents;
#[path = "support/sim_etcd.rs"]
mod sim_etcd;
#[path = "support/sim_nodes.rs"]
mod sim_nodes;

use sim_etcd::start_sim_etcd;
use sim_nodes::{node_ip, ETCD_ADDRESS};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agents::{agent_system, script, Seen};
use madsim::rand::Rng;
use madsim::runtime::Handle;
use tokio::time::Instant;
use troupe_agent::{AgentClient, ChatMessage, ConversationKind, Participant, Role, ScriptedLlm, Sender, TaskState};
use troupe_runtime::MemoryStore;

const NODE_NAMES: [&str; 3] = ["node-1", "node-2", "node-3"];
/// How long each ask may take, in milliseconds.
const ASK_TIMEOUT_MS: u64 = 10_000;
/// Delegations `a` makes to `b` per seed.
const DELEGATIONS: usize = 6;
/// Notifications sent to `c` per seed.
const NOTIFICATIONS: usize = 6;
/// The longest random pause between two sends, in milliseconds.
const SEND_GAP_MS_MAX: u64 = 600;
/// The latest moment a fault starts after the first send, in milliseconds.
const FAULT_AT_MS_MAX: u64 = 3_000;
/// How long node-2 stays dead before it restarts, in milliseconds (bounds).
const RESTART_AFTER_MS_MIN: u64 = 500;
const RESTART_AFTER_MS_MAX: u64 = 5_000;
/// How long node-3 is cut from etcd, in milliseconds (longer than the lease TTL).
const CUT_MS: u64 = 4_500;
/// How long a send is retried before the test gives up on it, in milliseconds.
const SEND_RETRY_MS: u64 = 15_000;
/// Pause between retries and polls, in milliseconds.
const RETRY_PAUSE_MS: u64 = 200;
/// How long everything may take to settle after the faults, in simulated ms.
const SETTLE_BOUND_MS: u64 = 60_000;
/// Seeds the scenario runs under.
const SEEDS: u64 = 20;
/// Seeds the replay test runs, each twice.
const REPLAY_SEEDS: u64 = 2;
/// Simulated time limit of one run, in seconds.
const RUN_TIME_LIMIT_S: u64 = 300;

struct AgentCluster {
    nodes: Vec<madsim::runtime::NodeHandle>,
    etcd: madsim::runtime::NodeHandle,
    /// Each node's current agent client (replaced when the node joins again).
    slots: Arc<sim_nodes::Slots>,
    llm: ScriptedLlm,
    seen: Seen,
    /// What the nodes noted (joins, lease losses), in order.
    notes: Arc<Mutex<Vec<String>>>,
}

async fn start_agent_cluster() -> AgentCluster {
    let handle = Handle::current();
    let etcd = start_sim_etcd(&handle, ETCD_ADDRESS).await;
    let llm = script();
    let seen = Seen::default();
    let store = MemoryStore::new();
    let slots: Arc<sim_nodes::Slots> = Arc::new(Mutex::new(vec![None; NODE_NAMES.len()]));
    let notes: Arc<Mutex<Vec<String>>> = Arc::default();
    let nodes: Vec<_> = (0..NODE_NAMES.len())
        .map(|index| {
            let (slots, llm, seen, store, notes) = (
                Arc::clone(&slots),
                llm.clone(),
                seen.clone(),
                store.clone(),
                Arc::clone(&notes),
            );
            handle
                .create_node()
                .name(NODE_NAMES[index])
                .ip(node_ip(index))
                .init(move || {
                    let (slots, llm, seen, store) = (Arc::clone(&slots), llm.clone(), seen.clone(), store.clone());
                    let name = NODE_NAMES[index];
                    let system = move || agent_system(&llm, index, &seen);
                    let (on_join, on_loss) = (Arc::clone(&notes), Arc::clone(&notes));
                    let joined = move |_: &AgentClient| on_join.lock().expect("notes").push(format!("{name} joined"));
                    let lost = move |(), reason| {
                        let note = format!("{name} lost its lease: {reason:?}");
                        on_loss.lock().expect("notes").push(note);
                    };
                    sim_nodes::run_rejoining(index, name, store, slots, system, joined, lost)
                })
                .build()
        })
        .collect();
    let cluster = AgentCluster {
        nodes,
        etcd,
        slots,
        llm,
        seen,
        notes,
    };
    for index in 0..NODE_NAMES.len() {
        cluster.client(index).await;
    }
    cluster
}

impl AgentCluster {
    /// Node `index`'s agent client once it has joined.
    async fn client(&self, index: usize) -> AgentClient {
        sim_nodes::joined_client(&self.slots, index).await
    }

    /// Places `agent` on node `index`: its first turn runs there.
    async fn place(&self, index: usize, agent: &str) {
        let client = self.client(index).await;
        let timeout = Duration::from_millis(ASK_TIMEOUT_MS);
        let node = (index, NODE_NAMES[index]);
        sim_nodes::place_on(&self.nodes[index], client, &self.seen, node, agent, timeout).await;
    }

    /// The faults of both scenarios, in a task: node-2 killed `kill_at` ms from now and
    /// restarted `restart_after` ms later; node-3 cut from etcd `cut_at` ms from now for
    /// [`CUT_MS`]. Resolves to what `due` said just before the kill.
    fn faults(
        &self,
        kill_at: u64,
        restart_after: u64,
        cut_at: u64,
        due: impl FnOnce() -> usize + Send + 'static,
    ) -> tokio::task::JoinHandle<usize> {
        let (node_2, node_3, etcd) = (self.nodes[1].id(), self.nodes[2].id(), self.etcd.id());
        tokio::spawn(async move {
            let handle = Handle::current();
            let net = madsim::net::NetSim::current();
            let kill = async {
                tokio::time::sleep(Duration::from_millis(kill_at)).await;
                let due = due();
                handle.kill(node_2);
                tokio::time::sleep(Duration::from_millis(restart_after)).await;
                handle.restart(node_2);
                due
            };
            let cut = async {
                tokio::time::sleep(Duration::from_millis(cut_at)).await;
                net.clog_link(node_3, etcd);
                net.clog_link(etcd, node_3);
                tokio::time::sleep(Duration::from_millis(CUT_MS)).await;
                net.unclog_link(node_3, etcd);
                net.unclog_link(etcd, node_3);
            };
            tokio::join!(kill, cut).0
        })
    }

    /// A settle loop's poll found `open` still open: fails once `since` is
    /// [`SETTLE_BOUND_MS`] old, naming it, `what` it waited after, the `faults` (kill at,
    /// restart after, cut at, in ms) and the nodes' notes; else pauses before the next
    /// poll.
    async fn not_yet(&self, since: Instant, open: &str, what: &str, faults: (u64, u64, u64)) {
        let (kill_at, restart_after, cut_at) = faults;
        assert!(
            since.elapsed() < Duration::from_millis(SETTLE_BOUND_MS),
            "{open}, {} ms after {what} (kill at {kill_at} ms, restart after {restart_after} ms, cut at {cut_at} ms); notes {:?}",
            since.elapsed().as_millis(),
            self.notes.lock().expect("notes")
        );
        tokio::time::sleep(Duration::from_millis(RETRY_PAUSE_MS)).await;
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

    /// Every agent event of every node, then the nodes' notes: a run's record.
    fn record(&self) -> Vec<String> {
        let mut record = self.seen.record();
        record.extend(self.notes.lock().expect("notes").iter().cloned());
        record
    }

    /// `agent`'s committed log, read from the shared store through node-1.
    async fn log(&self, agent: &str) -> Vec<ChatMessage> {
        let client = self.client(0).await;
        let agent = agent.to_string();
        self.nodes[0]
            .spawn(async move { client.conversation_log(&agent).await })
            .await
            .expect("the read's task")
            .expect("the log reads")
    }
}

fn count(log: &[ChatMessage], role: Role, needle: &str) -> usize {
    log.iter()
        .filter(|m| m.role == role && m.content.contains(needle))
        .count()
}

/// How the acknowledged delegations ended.
#[derive(Default)]
struct Outcomes {
    completed: usize,
    canceled: usize,
}

/// One delegation in this many is canceled right after it is made.
const CANCEL_ONE_IN: u32 = 3;

/// What one run measured and recorded.
struct RunResult {
    /// Delegations acknowledged (task ids returned).
    delegated: usize,
    /// Cancellations queued, and how the delegations ended.
    cancel_sent: usize,
    outcomes: Outcomes,
    /// Notifications acknowledged.
    notified: usize,
    /// Simulated ms from the first send until every outcome was in.
    settled_ms: u128,
    /// Delegations not yet resolved at `a` when node-2 was killed.
    due_at_kill: usize,
    /// Turns of `b` started on a task (cut turns included).
    b_task_turns: usize,
    /// The nodes `b`'s and `c`'s turns ran on, in order, repeats collapsed.
    b_nodes: Vec<&'static str>,
    c_nodes: Vec<&'static str>,
    /// Every agent event of every node and the nodes' notes, rendered in order.
    record: Vec<String>,
}

/// How many task results `a`'s model has been shown so far.
fn results_seen_by_a(llm: &ScriptedLlm) -> usize {
    llm.requests_of("a")
        .iter()
        .filter(|request| {
            request
                .messages
                .last()
                .is_some_and(|message| message.content.contains("you delegated is"))
        })
        .count()
}

/// Waits until every task of `task_ids` is final at `a` and the inboxes and outboxes of
/// `a`, `b`, `c` are drained; panics after [`SETTLE_BOUND_MS`] from `since`.
async fn settle(cluster: &AgentCluster, task_ids: &[String], since: Instant, what: &str, faults: (u64, u64, u64)) {
    loop {
        let client = cluster.client(0).await;
        let ids = task_ids.to_vec();
        let done = cluster.nodes[0]
            .spawn(async move {
                for id in &ids {
                    match client.task("a", id).await {
                        Ok(Some(status)) if status.state.is_final() => {}
                        _ => return false,
                    }
                }
                for agent in ["a", "b", "c"] {
                    if client.pending(agent).await.ok() != Some((0, 0)) {
                        return false;
                    }
                }
                true
            })
            .await
            .expect("the poll's task");
        if done {
            break;
        }
        let pending = {
            let client = cluster.client(0).await;
            cluster.nodes[0]
                .spawn(async move {
                    let mut pending = Vec::new();
                    for agent in ["a", "b", "c"] {
                        pending.push((agent, client.pending(agent).await.ok()));
                    }
                    pending
                })
                .await
                .expect("the read's task")
        };
        cluster
            .not_yet(since, &format!("not settled: pending {pending:?}"), what, faults)
            .await;
    }
}

async fn scenario() -> RunResult {
    let cluster = start_agent_cluster().await;
    cluster.place(0, "a").await;
    cluster.place(1, "b").await;
    cluster.place(2, "c").await;
    let mut rng = madsim::rand::thread_rng();
    let kill_at = rng.gen_range(0..FAULT_AT_MS_MAX);
    let restart_after = rng.gen_range(RESTART_AFTER_MS_MIN..RESTART_AFTER_MS_MAX);
    let cut_at = rng.gen_range(0..FAULT_AT_MS_MAX);
    let gaps: Vec<u64> = (0..DELEGATIONS.max(NOTIFICATIONS))
        .map(|_| rng.gen_range(0..SEND_GAP_MS_MAX))
        .collect();
    // Which delegations the client cancels right after making them.
    let cancels: Vec<bool> = (0..DELEGATIONS).map(|_| rng.gen_range(0..CANCEL_ONE_IN) == 0).collect();
    let start = Instant::now();

    // The faults; the kill notes how many outcomes were still due at `a` then.
    let llm = cluster.llm.clone();
    let faults = cluster.faults(kill_at, restart_after, cut_at, move || {
        DELEGATIONS - results_seen_by_a(&llm)
    });

    // The sends, through node-1 (never faulted).
    let client = cluster.client(0).await;
    let sends = cluster.nodes[0].spawn({
        let gaps = gaps.clone();
        let cancels = cancels.clone();
        async move {
            let delegate = async {
                let (mut ids, mut canceled) = (Vec::new(), Vec::new());
                for (i, gap) in gaps.iter().take(DELEGATIONS).enumerate() {
                    tokio::time::sleep(Duration::from_millis(*gap)).await;
                    match client.delegate("a", "b", &format!("delegated work {i}"), None).await {
                        Ok(id) => {
                            if cancels[i] {
                                let answer = client.cancel("a", &id).await;
                                canceled.push((id.clone(), answer.expect("a (node-1) takes the cancellation")));
                            }
                            ids.push(id)
                        }
                        Err(error) => panic!("a (node-1, never faulted) refused delegation {i}: {error}"),
                    }
                }
                (ids, canceled)
            };
            let notify = async {
                let (mut acked, mut from_a) = (Vec::new(), Vec::new());
                for (i, gap) in gaps.iter().take(NOTIFICATIONS).enumerate() {
                    tokio::time::sleep(Duration::from_millis(*gap)).await;
                    let tried = Instant::now();
                    loop {
                        match client
                            .notify_with_id("c", &format!("n-{i}"), &format!("note {i}"), None)
                            .await
                        {
                            Ok(()) => {
                                acked.push(i);
                                break;
                            }
                            Err(_) if tried.elapsed() < Duration::from_millis(SEND_RETRY_MS) => {
                                tokio::time::sleep(Duration::from_millis(RETRY_PAUSE_MS)).await;
                            }
                            Err(error) => panic!("notification {i} never acknowledged: {error}"),
                        }
                    }
                    // An agent-to-agent notification: a (node-1) queues it in its outbox,
                    // its delivery goes to c's owner.
                    let id = client
                        .notify_as("a", "c", &format!("agent note {i}"))
                        .await
                        .expect("a (node-1, never faulted) queues a notification");
                    from_a.push(id);
                }
                (acked, from_a)
            };
            tokio::join!(delegate, notify)
        }
    });
    let ((task_ids, canceled), (notified, from_a)) = sends.await.expect("the sends' task");
    // Settle (once now, and again after the faults, which may come later): every task
    // final at a, every inbox and outbox drained.
    settle(
        &cluster,
        &task_ids,
        start,
        "the sends",
        (kill_at, restart_after, cut_at),
    )
    .await;
    let settled_ms = start.elapsed().as_millis();
    let due_at_kill = faults.await.expect("the faults' task");
    settle(
        &cluster,
        &task_ids,
        Instant::now(),
        "the faults",
        (kill_at, restart_after, cut_at),
    )
    .await;

    let a_log = cluster.log("a").await;
    let b_log = cluster.log("b").await;
    let c_log = cluster.log("c").await;
    let client = cluster.client(0).await;
    let mut results = Outcomes::default();
    for id in &task_ids {
        let status = {
            let (client, id) = (client.clone(), id.clone());
            cluster.nodes[0]
                .spawn(async move { client.task("a", &id).await })
                .await
                .expect("the read's task")
                .expect("the task reads")
                .expect("an acknowledged task has a record")
        };
        let cancel = canceled.iter().find(|(task, _)| task == id).map(|(_, answer)| *answer);
        let worked = count(&b_log, Role::User, &format!("[task {id} delegated by agent a]"));
        let outcomes = count(&a_log, Role::User, &format!("[task {id} you delegated is"));
        assert_eq!(outcomes, 1, "task {id}: one outcome at a (kill at {kill_at} ms)");
        match status.state {
            TaskState::Completed => {
                assert_eq!(status.result.as_deref(), Some("task done"), "task {id}: {status:?}");
                assert_eq!(worked, 1, "task {id}: b's committed log holds its work once");
                assert_eq!(
                    count(&a_log, Role::User, &format!("[task {id} you delegated is completed]")),
                    1
                );
                results.completed += 1;
            }
            TaskState::Canceled => {
                assert!(
                    matches!(cancel, Some(None)),
                    "task {id} canceled only if a cancellation was queued: {cancel:?}"
                );
                assert_eq!(worked, 0, "task {id}: a canceled task is never worked");
                assert_eq!(
                    count(&a_log, Role::User, &format!("[task {id} you delegated is canceled]")),
                    1
                );
                results.canceled += 1;
            }
            other => panic!("task {id} ended {other:?}: {status:?} (kill at {kill_at} ms)"),
        }
    }
    for i in 0..NOTIFICATIONS {
        let delivered = count(&c_log, Role::User, &format!("[notification n-{i} from"));
        let expected = usize::from(notified.contains(&i));
        assert_eq!(delivered, expected, "notification n-{i} delivered once");
    }
    for id in &from_a {
        let delivered = count(&c_log, Role::User, &format!("[notification {id} from"));
        assert_eq!(delivered, 1, "a's notification {id} delivered to c once: {c_log:?}");
    }
    // The order between two agents: c processed a's notifications, and b a's tasks, in
    // the order a sent them (a canceled task is never worked, so it is left out).
    let order_in = |log: &[ChatMessage], ids: &[String], prefix: &str| -> Vec<usize> {
        log.iter()
            .filter(|message| message.role == Role::User)
            .filter_map(|message| {
                ids.iter()
                    .position(|id| message.content.starts_with(&format!("{prefix}{id} ")))
            })
            .collect()
    };
    let c_order = order_in(&c_log, &from_a, "[notification ");
    assert!(
        c_order.windows(2).all(|pair| pair[0] < pair[1]),
        "c processed a's notifications in the order sent: {c_order:?} (kill at {kill_at} ms)"
    );
    let b_order = order_in(&b_log, &task_ids, "[task ");
    assert!(
        b_order.windows(2).all(|pair| pair[0] < pair[1]),
        "b worked a's tasks in the order delegated: {b_order:?} (kill at {kill_at} ms)"
    );
    let b_task_turns = cluster
        .llm
        .requests_of("b")
        .iter()
        .filter(|request| {
            request
                .messages
                .last()
                .is_some_and(|message| message.content.contains("delegated by agent a]"))
        })
        .count();
    let (b_nodes, c_nodes) = (cluster.nodes_of("b"), cluster.nodes_of("c"));
    let record = cluster.record();
    RunResult {
        delegated: task_ids.len(),
        cancel_sent: canceled.len(),
        outcomes: results,
        notified: notified.len() + from_a.len(),
        settled_ms,
        due_at_kill,
        b_task_turns,
        b_nodes,
        c_nodes,
        record,
    }
}

/// Runs `scenario` in a simulation of `seed`.
fn run_seed<T>(seed: u64, scenario: impl std::future::Future<Output = T>) -> T {
    let mut runtime = madsim::runtime::Runtime::with_seed_and_config(seed, madsim::Config::default());
    runtime.set_time_limit(Duration::from_secs(RUN_TIME_LIMIT_S));
    runtime.block_on(scenario)
}

fn run(seed: u64) -> RunResult {
    run_seed(seed, scenario())
}

/// The scenario of the module docs under each of [`SEEDS`] seeds.
#[test]
fn agent_deliveries_resolve_exactly_once_while_nodes_die_and_lose_their_lease() {
    let (mut fastest, mut slowest) = (u128::MAX, 0);
    let (mut mid_protocol, mut moved, mut canceled, mut c_moved) = (0, 0, 0, 0);
    for seed in 1..=SEEDS {
        let result = run(seed);
        eprintln!(
            "seed {seed}: {} delegations ({} unresolved at the kill; {} cancellations sent; {} completed, {} canceled) and {} notifications acknowledged, each resolved once; all in {} ms after the first send; b's model asked {} times for {} tasks; b ran on {:?}, c on {:?}",
            result.delegated,
            result.due_at_kill,
            result.cancel_sent,
            result.outcomes.completed,
            result.outcomes.canceled,
            result.notified,
            result.settled_ms,
            result.b_task_turns,
            result.delegated,
            result.b_nodes,
            result.c_nodes
        );
        if result.c_nodes.len() > 1 {
            c_moved += 1;
        }
        canceled += result.outcomes.canceled;
        if result.b_nodes.len() > 1 {
            moved += 1;
        }
        if result.due_at_kill > 0 {
            mid_protocol += 1;
        }
        fastest = fastest.min(result.settled_ms);
        slowest = slowest.max(result.settled_ms);
    }
    eprintln!(
        "over {SEEDS} seeds: all outcomes in {fastest}–{slowest} ms (simulated) after the first send; the kill landed mid-protocol in {mid_protocol}; b moved to another node in {moved}; {canceled} tasks canceled; c's turns changed node in {c_moved}"
    );
    assert!(
        mid_protocol > 0,
        "some kills must land while delegations are unresolved"
    );
}

/// Runs each of [`REPLAY_SEEDS`] twice and asserts that both runs recorded the same.
fn assert_replays(record_of: impl Fn(u64) -> Vec<String>) {
    for seed in 1..=REPLAY_SEEDS {
        let first = record_of(seed);
        let second = record_of(seed);
        assert!(!first.is_empty());
        assert_eq!(first, second, "seed {seed} replays identically");
    }
}

/// Two runs of a seed record the same events at the same simulated times.
#[test]
fn the_agent_faults_scenario_replays_identically_from_its_seed() {
    assert_replays(|seed| run(seed).record);
}

/// The conversation of the mention scenario.
const ROOM: &str = "room";
/// Messages the human posts in it (each mentions `b`, `c` or both).
const POSTS: usize = 8;
/// The longest a seed of the mention scenario may take from the first post until every
/// mention is answered, in simulated ms: the posts (at most 8 × 600 ms), the dead node's
/// lease running out (3 s), node-3's cut (4.5 s) and an answer's retries (at most
/// 15.5 s) overlap; all 20 seeds take 5.4–9.7 s. A turn's call made on a node whose lease
/// was lost for good used to loop until its 30 s timeout, holding up that node's
/// rejoining (seed 3: 35.2 s).
const MENTIONS_ANSWERED_BOUND_MS: u128 = 20_000;

/// The agents post `i` mentions.
fn mentioned(i: usize) -> &'static [&'static str] {
    match i % 3 {
        0 => &["b"],
        1 => &["c"],
        _ => &["b", "c"],
    }
}

/// What one run of the mention scenario measured and recorded.
struct MentionRun {
    /// Posts acknowledged, with their seqs.
    posted: Vec<(usize, u64)>,
    /// Mentions posted but not yet answered by a model when node-2 was killed.
    due_at_kill: usize,
    /// Simulated ms from the first post until every mention was answered.
    settled_ms: u128,
    /// The nodes `c`'s turns ran on, in order, repeats collapsed.
    c_nodes: Vec<&'static str>,
    record: Vec<String>,
}

/// The room's messages, read through node-1.
async fn room(cluster: &AgentCluster) -> Vec<troupe_agent::ConversationMessage> {
    let client = cluster.client(0).await;
    cluster.nodes[0]
        .spawn(async move {
            client
                .read_messages(ROOM, None, troupe_agent::CONVERSATION_PAGE_MAX)
                .await
        })
        .await
        .expect("the read's task")
        .unwrap_or_default()
}

/// The messages answering the mention of `agent` in message `seq`: its reply, or a
/// system note about it.
fn answers<'a>(
    messages: &'a [troupe_agent::ConversationMessage],
    seq: u64,
    agent: &'a str,
) -> impl Iterator<Item = &'a troupe_agent::ConversationMessage> + 'a {
    messages.iter().filter(move |message| {
        message.reply_to == Some(seq)
            && (message.sender == Sender::Agent(agent.to_string())
                || message.note.as_ref().is_some_and(|note| note.agent == agent))
    })
}

/// Mentions in a conversation owned by a node that dies: `b` is placed on node-1 and
/// `c` on node-3, the group conversation `room` (a human `h`, `b`, `c`) is created
/// through node-2, so it runs there. Through node-1 (never faulted) `h` posts
/// [`POSTS`] messages mentioning `b`, `c` or both, spaced at random, each retried with
/// its id until acknowledged. The model takes [`agents::MENTION_MODEL_LATENCY_MS`] per
/// mention, so the relays of later mentions wait, pending, while an agent answers an
/// earlier one. node-2 is killed at a random moment and restarted later: its relay
/// tasks die with it, the room moves to the node the next post comes through, and an
/// agent's answer posted while the room has no owner fails. node-3 is cut from etcd
/// for [`CUT_MS`] from another random moment: its lease runs out and `c` moves.
///
/// After settling, each acknowledged post is in the room once, with exactly one answer
/// (`seen`, no note) from each agent it mentions, the room's seqs have no gaps, and
/// every mention was answered within [`MENTIONS_ANSWERED_BOUND_MS`].
async fn mention_scenario() -> MentionRun {
    let cluster = start_agent_cluster().await;
    cluster.place(0, "b").await;
    cluster.place(2, "c").await;
    {
        let client = cluster.client(1).await;
        cluster.nodes[1]
            .spawn(async move {
                client
                    .create_conversation(
                        ROOM,
                        vec![
                            Participant::Human("h".into()),
                            Participant::Agent("b".into()),
                            Participant::Agent("c".into()),
                        ],
                        ConversationKind::Group,
                    )
                    .await
            })
            .await
            .expect("the create's task")
            .expect("node-2 creates the room");
    }
    let mut rng = madsim::rand::thread_rng();
    let kill_at = rng.gen_range(0..FAULT_AT_MS_MAX);
    let restart_after = rng.gen_range(RESTART_AFTER_MS_MIN..RESTART_AFTER_MS_MAX);
    let cut_at = rng.gen_range(0..FAULT_AT_MS_MAX);
    let gaps: Vec<u64> = (0..POSTS).map(|_| rng.gen_range(0..SEND_GAP_MS_MAX)).collect();
    let start = Instant::now();
    let mentions_posted = Arc::new(Mutex::new(0_usize));

    // node-2 (the room's node) killed and restarted; node-3 (c's node) cut from etcd,
    // so c moves to a living node while mentions of it are delivered.
    let (llm, posted) = (cluster.llm.clone(), Arc::clone(&mentions_posted));
    let faults = cluster.faults(kill_at, restart_after, cut_at, move || {
        let answered = llm
            .answers()
            .iter()
            .filter(|answer| answer.message.content == "seen")
            .count();
        posted.lock().expect("posted").saturating_sub(answered)
    });

    let client = cluster.client(0).await;
    let posted = cluster.nodes[0]
        .spawn({
            let mentions_posted = Arc::clone(&mentions_posted);
            async move {
                let mut posted = Vec::new();
                for (i, gap) in gaps.iter().enumerate() {
                    tokio::time::sleep(Duration::from_millis(*gap)).await;
                    let text = format!("topic {i} for @{}", mentioned(i).join(" @"));
                    let tried = Instant::now();
                    loop {
                        match client
                            .post_message(ROOM, Sender::Human("h".into()), &format!("p-{i}"), &text)
                            .await
                        {
                            Ok(done) => {
                                posted.push((i, done.seq));
                                *mentions_posted.lock().expect("posted") += mentioned(i).len();
                                break;
                            }
                            Err(_) if tried.elapsed() < Duration::from_millis(SEND_RETRY_MS) => {
                                tokio::time::sleep(Duration::from_millis(RETRY_PAUSE_MS)).await;
                            }
                            Err(error) => panic!("post {i} never acknowledged: {error}"),
                        }
                    }
                }
                posted
            }
        })
        .await
        .expect("the posts' task");

    // Every mention answered, now and again once the faults are over.
    let settled = |since: Instant, what: &'static str| {
        let (cluster, posted) = (&cluster, &posted);
        async move {
            loop {
                let messages = room(cluster).await;
                let open: Vec<(u64, &str)> = posted
                    .iter()
                    .flat_map(|(i, seq)| mentioned(*i).iter().map(move |agent| (*seq, *agent)))
                    .filter(|(seq, agent)| answers(&messages, *seq, agent).next().is_none())
                    .collect();
                if open.is_empty() {
                    return messages;
                }
                let faults = (kill_at, restart_after, cut_at);
                cluster
                    .not_yet(since, &format!("mentions unanswered: {open:?}"), what, faults)
                    .await;
            }
        }
    };
    settled(start, "the posts").await;
    let settled_ms = start.elapsed().as_millis();
    let due_at_kill = faults.await.expect("the faults' task");
    let messages = settled(Instant::now(), "the faults").await;

    let seqs: Vec<u64> = messages.iter().map(|message| message.seq).collect();
    assert_eq!(
        seqs,
        (0..messages.len() as u64).collect::<Vec<_>>(),
        "the room's seqs have no gaps"
    );
    for (i, seq) in &posted {
        let copies = messages
            .iter()
            .filter(|message| {
                message.sender == Sender::Human("h".into()) && message.text.starts_with(&format!("topic {i} "))
            })
            .count();
        assert_eq!(copies, 1, "post {i} is in the room once");
        for agent in mentioned(*i) {
            let found: Vec<_> = answers(&messages, *seq, agent).collect();
            assert_eq!(found.len(), 1, "post {i} (#{seq}): one answer from {agent}: {found:?}");
            assert_eq!(found[0].text, "seen", "post {i}: {agent} answered, no note: {found:?}");
        }
    }
    let c_nodes = cluster.nodes_of("c");
    let mut record = cluster.record();
    record.extend(messages.iter().map(|message| format!("{message:?}")));
    MentionRun {
        posted,
        due_at_kill,
        settled_ms,
        c_nodes,
        record,
    }
}

fn run_mentions(seed: u64) -> MentionRun {
    run_seed(seed, mention_scenario())
}

/// The mention scenario of [`mention_scenario`] under each of [`SEEDS`] seeds.
#[test]
fn every_mention_is_answered_once_while_the_conversations_node_dies() {
    let (mut fastest, mut slowest, mut mid_protocol, mut c_moved) = (u128::MAX, 0, 0, 0);
    for seed in 1..=SEEDS {
        let result = run_mentions(seed);
        eprintln!(
            "seed {seed}: {} posts acknowledged, {} mentions unanswered at the kill, every mention answered once within {} ms of the first post; c ran on {:?}",
            result.posted.len(),
            result.due_at_kill,
            result.settled_ms,
            result.c_nodes
        );
        if result.due_at_kill > 0 {
            mid_protocol += 1;
        }
        if result.c_nodes.len() > 1 {
            c_moved += 1;
        }
        assert!(
            result.settled_ms <= MENTIONS_ANSWERED_BOUND_MS,
            "seed {seed}: the mentions took {} ms, over {MENTIONS_ANSWERED_BOUND_MS} ms",
            result.settled_ms
        );
        fastest = fastest.min(result.settled_ms);
        slowest = slowest.max(result.settled_ms);
    }
    eprintln!(
        "over {SEEDS} seeds: every mention answered once, in {fastest}–{slowest} ms (simulated) after the first post; the kill landed with mentions unanswered in {mid_protocol}; c's turns changed node in {c_moved}"
    );
    assert!(mid_protocol > 0, "some kills must land while mentions are unanswered");
}

/// Two runs of a seed of the mention scenario record the same events and messages.
#[test]
fn the_mention_scenario_replays_identically_from_its_seed() {
    assert_replays(|seed| run_mentions(seed).record);
}
