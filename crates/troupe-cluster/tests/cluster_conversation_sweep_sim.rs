//! A conversation whose node dies with a mention committed but not yet delivered, with
//! nothing sent afterwards and no node starting, is taken over by a living node's resume
//! sweep (`AgentClient::start_resume_sweep`, its `resume_conversations` half): the
//! mention is delivered and answered once (two simulated cluster nodes, madsim's etcd,
//! one `MemoryStore` both reach, the real agents, conversations, dispatcher, routing and
//! store; the scripted model of `support/agents.rs`).
//!
//! Method, per seed and placement: `a` is placed on node-1 and `b` on node-1 or node-2;
//! the group conversation `room` (a human `h` and `b`) is created through node-2, so it
//! runs there. Through node-1's client `a` delegates a task of `slow delegated work` to
//! `b` (the model takes `SLOW_TASK_MODEL_LATENCY_MS` on it). Once `b`'s turn on it has
//! started, `h` posts `@b` in the room through node-1. The post commits the message and
//! its relay (`relay/{seq}/b`) on node-2; the relay's delivery (an `Enqueue` request to
//! `b`) waits behind `b`'s running turn. node-2 is killed at a random moment within the
//! model's latency, while the relay is stored and undelivered (checked: the relay key is
//! stored, `b`'s inbox holds only the task, the room no answer), and never restarted.
//! Nothing is sent afterwards.
//!
//! The delivery dies with node-2 wherever `b` lives: with `b` on node-1, its `Enqueue`
//! waiting there is dropped unrun once its caller is gone (node-1's
//! `RuntimeCounters::expired_dropped` went from 0 to 1 after the kill in each of the 6
//! control seeds, checked when this was written), so `b` finishes its task and has nothing pending, and only
//! the room's relay is left. With `b` on node-2, `b`'s task is left in its inbox too,
//! which the sweep's `resume_pending` half resumes on node-1.
//!
//! `b` works a task, not an earlier mention of the room, on purpose: an answer to an
//! earlier mention, posted once the room's lease has run out, activates the room on a
//! living node, and that activation resumes its own relays
//! (`ConversationActor::resume_at_activation`): the room would be resumed without
//! `resume_conversations` (checked with a variant not kept: `b` on node-1 answering an
//! earlier mention when node-2 died; the later mention was answered with no sweep
//! 3.0–3.1 s after the kill, 6 seeds).
//!
//! With a sweep on each node: `b` answers the mention once (`seen`, no note), on
//! node-1, the relay is gone and `b`'s boxes are drained, within [`SETTLE_BOUND_MS`].
//! Without one (the control): [`SETTLE_BOUND_MS`] after the kill the relay is still
//! stored and the room holds no answer: the gap the sweep closes.
//!
//! Run with `CARGO_TARGET_DIR=target/madsim RUSTFLAGS="--cfg madsim" cargo nextest run -p troupe-cluster --test cluster_conversation_sweep_sim`.
#![cfg(madsim)]

#[path = "support/agents.rs"]
mod agents;
#[path = "support/sim_etcd.rs"]
mod sim_etcd;
#[path = "support/sim_nodes.rs"]
mod sim_nodes;

use sim_etcd::start_sim_etcd;
use sim_nodes::{answers_of_b, ETCD_ADDRESS};
use std::time::Duration;

use agents::{script, SLOW_TASK_MODEL_LATENCY_MS};
use madsim::rand::Rng;
use madsim::runtime::Handle;
use tokio::time::Instant;
use troupe_agent::{ConversationKind, ConversationMessage, Participant, Sender, TaskState};

const NODE_NAMES: [&str; 2] = ["node-1", "node-2"];
/// How long each ask may take, in milliseconds.
const ASK_TIMEOUT_MS: u64 = 10_000;
/// The sweep's period on each node, in milliseconds.
const SWEEP_MS: u64 = 1_000;
/// How long the mention may take to be answered after the kill, in simulated
/// milliseconds: the lease TTL (3 s), a sweep period (1 s), the rest of `b`'s task (at
/// most 2 s; worked again from its start on node-1 if `b` was on node-2) and the
/// mention's turn (0.4 s), with room.
const SETTLE_BOUND_MS: u64 = 20_000;
/// Pause between polls, in milliseconds.
const POLL_MS: u64 = 20;
/// Seeds each test runs under.
const SEEDS: u64 = 6;
/// Simulated time limit of one run, in seconds.
const RUN_TIME_LIMIT_S: u64 = 120;
/// The conversation.
const ROOM: &str = "room";
/// The nodes `b` is placed on, one run each per seed (the room is always on node-2).
const B_PLACEMENTS: [usize; 2] = [0, 1];

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
    /// Creates the room (`h` and `b`) through node-2's client, so it runs on node-2.
    async fn create_room_on_node_2(&self) {
        let client = self.client(1).await;
        self.nodes[1]
            .spawn(async move {
                client
                    .create_conversation(
                        ROOM,
                        vec![Participant::Human("h".into()), Participant::Agent("b".into())],
                        ConversationKind::Group,
                    )
                    .await
            })
            .await
            .expect("node-2's task")
            .expect("node-2 creates the room");
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

/// What one run saw.
struct Outcome {
    /// The answers to the mention at the end (at the bound if not settled).
    answers: Vec<ConversationMessage>,
    /// The room's relay keys at the end.
    relays: Vec<String>,
    /// Simulated ms from the kill until the mention was answered, its relay gone and
    /// `b`'s boxes drained (the bound if not).
    settled_ms: u128,
    /// `b`'s inbox and outbox at the end.
    b_pending: (u64, u64),
    /// `b`'s task's state at the end.
    task: TaskState,
    /// The nodes `b`'s turns ran on.
    b_nodes: Vec<&'static str>,
    /// Simulated ms from the post until the kill.
    kill_after_ms: u64,
    /// Every agent event of both nodes, rendered, in order, then the room's messages:
    /// the run's record.
    record: Vec<String>,
}

/// The scenario of the module docs, `b` on node `b_node`, with or without sweeps.
async fn scenario(b_node: usize, sweep: bool) -> Outcome {
    let cluster = start_cluster(sweep).await;
    cluster.place(0, "a").await;
    cluster.place(b_node, "b").await;
    cluster.create_room_on_node_2().await;
    let kill_after_ms = madsim::rand::thread_rng().gen_range(0..SLOW_TASK_MODEL_LATENCY_MS / 2);
    let task = cluster
        .on_node_1(|client| async move { client.delegate("a", "b", "slow delegated work", None).await })
        .await
        .expect("a (node-1) takes the delegation");
    // b's turn on the task has started (its ping was its first).
    let sent = Instant::now();
    while cluster.seen.turns_of("b").len() < 2 {
        assert!(
            sent.elapsed() < Duration::from_millis(ASK_TIMEOUT_MS),
            "b did not start the task"
        );
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
    let posted = cluster
        .on_node_1(|client| async move {
            client
                .post_message(ROOM, Sender::Human("h".into()), "m-1", "what do you think, @b?")
                .await
        })
        .await
        .expect("the room (node-2) takes the post");
    assert!(!posted.duplicate, "a first post");
    tokio::time::sleep(Duration::from_millis(kill_after_ms)).await;
    // The mention is durable and undelivered: its relay stored, b's inbox holding only
    // the task b is still working, no answer.
    let relay = format!("relay/{:020}/b", posted.seq);
    assert_eq!(cluster.relays(ROOM).await, [relay], "the relay is stored at the kill");
    assert_eq!(
        cluster.pending("b").await,
        (1, 0),
        "b's inbox holds only the task at the kill"
    );
    let at_kill = cluster.task_state(&task).await;
    assert!(!at_kill.is_final(), "b is still working at the kill: {at_kill:?}");
    assert!(
        answers_of_b(&cluster.room(ROOM).await, posted.seq).is_empty(),
        "no answer at the kill"
    );
    Handle::current().kill(cluster.nodes[1].id());
    let killed = Instant::now();
    let (answers, relays, b_pending) = loop {
        let answers = answers_of_b(&cluster.room(ROOM).await, posted.seq);
        let (relays, b_pending) = (cluster.relays(ROOM).await, cluster.pending("b").await);
        let settled = !answers.is_empty() && relays.is_empty() && b_pending == (0, 0);
        if settled || killed.elapsed() >= Duration::from_millis(SETTLE_BOUND_MS) {
            break (answers, relays, b_pending);
        }
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    };
    let settled_ms = killed.elapsed().as_millis();
    let mut record = cluster.seen.record();
    record.extend(cluster.room(ROOM).await.iter().map(|message| format!("{message:?}")));
    Outcome {
        answers,
        relays,
        settled_ms,
        b_pending,
        task: cluster.task_state(&task).await,
        b_nodes: cluster.nodes_of("b"),
        kill_after_ms,
        record,
    }
}

fn run_seed(seed: u64, b_node: usize, sweep: bool) -> Outcome {
    let mut runtime = madsim::runtime::Runtime::with_seed_and_config(seed, madsim::Config::default());
    runtime.set_time_limit(Duration::from_secs(RUN_TIME_LIMIT_S));
    runtime.block_on(scenario(b_node, sweep))
}

/// Goal: with a resume sweep on every node, a mention whose conversation's node died
/// before delivering it is delivered and answered exactly once, on the living node,
/// though nothing is sent after the kill and no node starts; whether the mentioned agent
/// lived on the living node or on the dead one.
#[test]
fn a_sweep_on_a_living_node_delivers_a_dead_nodes_pending_mention() {
    for b_node in B_PLACEMENTS {
        let (mut fastest, mut slowest) = (u128::MAX, 0);
        for seed in 1..=SEEDS {
            let outcome = run_seed(seed, b_node, true);
            let run = format!("b on {}, seed {seed}", NODE_NAMES[b_node]);
            eprintln!(
                "{run}: killed {} ms after the post; answered {} ms after the kill ({:?}); b ran on {:?}",
                outcome.kill_after_ms,
                outcome.settled_ms,
                outcome.answers.iter().map(|m| &m.text).collect::<Vec<_>>(),
                outcome.b_nodes
            );
            assert_eq!(outcome.answers.len(), 1, "{run}: one answer: {:?}", outcome.answers);
            assert_eq!(outcome.answers[0].sender, Sender::Agent("b".into()), "{run}");
            assert_eq!(outcome.answers[0].text, "seen", "{run}: b's reply, no note");
            assert!(outcome.relays.is_empty(), "{run}: relay left: {:?}", outcome.relays);
            assert_eq!(outcome.b_pending, (0, 0), "{run}: b's inbox and outbox drained");
            assert_eq!(outcome.task, TaskState::Completed, "{run}: b's task completes too");
            let moved: &[&str] = if b_node == 0 {
                &["node-1"]
            } else {
                &["node-2", "node-1"]
            };
            assert_eq!(outcome.b_nodes, moved, "{run}: b's turns after the kill ran on node-1");
            fastest = fastest.min(outcome.settled_ms);
            slowest = slowest.max(outcome.settled_ms);
        }
        eprintln!(
            "b on {}, over {SEEDS} seeds: the mention was answered {fastest}–{slowest} ms (simulated) after the kill",
            NODE_NAMES[b_node]
        );
    }
}

/// Goal (the control): without a sweep, the same mention is still undelivered
/// [`SETTLE_BOUND_MS`] after the kill, its relay stored and no answer in the room:
/// nothing else resumes it, so the test above shows the sweep's work. With `b` on
/// node-1, `b` has finished its task and has nothing pending: the room's relay is the
/// only work left.
#[test]
fn without_a_sweep_the_dead_nodes_pending_mention_waits() {
    for b_node in B_PLACEMENTS {
        for seed in 1..=SEEDS {
            let outcome = run_seed(seed, b_node, false);
            let run = format!("b on {}, seed {seed}", NODE_NAMES[b_node]);
            assert!(
                outcome.answers.is_empty(),
                "{run}: nothing answered the mention: {:?}",
                outcome.answers
            );
            assert_eq!(outcome.relays.len(), 1, "{run}: the relay is still stored");
            if b_node == 0 {
                assert_eq!(outcome.task, TaskState::Completed, "{run}: b's task completed");
                assert_eq!(outcome.b_pending, (0, 0), "{run}: b has nothing pending");
                assert_eq!(outcome.b_nodes, ["node-1"], "{run}");
            } else {
                assert!(
                    !outcome.task.is_final(),
                    "{run}: b's task waits too: {:?}",
                    outcome.task
                );
                assert_eq!(outcome.b_pending, (1, 0), "{run}: only the task, in b's inbox");
                assert_eq!(outcome.b_nodes, ["node-2"], "{run}: b ran nowhere else");
            }
        }
    }
}

/// Goal: two runs of a seed record the same agent events and messages in the same
/// order, sweeps included (the scenario replays from its seed).
#[test]
fn the_conversation_sweep_scenario_replays_identically_from_its_seed() {
    for b_node in B_PLACEMENTS {
        let (first, second) = (run_seed(1, b_node, true).record, run_seed(1, b_node, true).record);
        assert!(!first.is_empty());
        assert_eq!(first, second, "b on {}: seed 1 replays identically", NODE_NAMES[b_node]);
    }
}
