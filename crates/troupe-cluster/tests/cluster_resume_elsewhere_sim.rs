//! A node's resume sweep leaves alone the agents and conversations that another living
//! node owns: it starts no activation of them (which their placement would refuse
//! `NotOwner`), while their owner processes their pending entries (two simulated
//! cluster nodes, madsim's etcd, one `MemoryStore` both reach, the real agents,
//! conversations, dispatcher, routing and store; the scripted model of
//! `support/agents.rs` with one rule more, below; a resume sweep on each node every
//! [`SWEEP_MS`], as `troupe node` runs one).
//!
//! Method, per seed: `a` and `b` are placed on node-1 and the group conversation `room`
//! (a human `h` and `b`) is created through node-1, so all three run there. Through
//! node-1's client `a` delegates a `long job` to `b` (the model takes
//! [`LONG_JOB_MODEL_LATENCY_MS`] on it). Once `b`'s turn on it has started, `h` posts
//! `@b` in the room through node-1: its relay's delivery waits behind `b`'s turn. For
//! [`WATCHED_MS`] (several of node-2's sweep rounds) `b` holds the task in its inbox and
//! the room its relay, both committed and pending (checked at the end of the window),
//! both placed on node-1. Then everything settles on node-1: the task completes, `b`
//! answers the mention once.
//!
//! node-2's runtime must start no activation at all in the whole run (its
//! `RuntimeCounters::activations_started`): every request of the test goes through
//! node-1, so an activation there could only come from its sweep waking `b` or the room
//! locally. Before, it did, every round: the local tell was accepted and the activation
//! it started was refused `NotOwner` by the placement (one etcd claim each, seen by
//! nobody).
//!
//! The takeover the sweep exists for (an owner that died, whose lease ended) is tested
//! in `cluster_resume_sweep_sim.rs` (agents) and `cluster_conversation_sweep_sim.rs`
//! (conversations).
//!
//! Run with `CARGO_TARGET_DIR=target/madsim RUSTFLAGS="--cfg madsim" cargo nextest run -p troupe-cluster --test cluster_resume_elsewhere_sim`.
#![cfg(madsim)]

#[path = "support/agents.rs"]
mod agents;
#[path = "support/sim_etcd.rs"]
mod sim_etcd;
#[path = "support/sim_nodes.rs"]
mod sim_nodes;

use std::time::Duration;

use agents::script;
use madsim::runtime::Handle;
use sim_etcd::start_sim_etcd;
use sim_nodes::{answers_of_b, ETCD_ADDRESS};
use tokio::time::Instant;
use troupe_agent::{ConversationKind, ConversationMessage, Participant, ScriptRule, ScriptedLlm, Sender, TaskState};

const NODE_NAMES: [&str; 2] = ["node-1", "node-2"];
/// How long each ask may take, in milliseconds.
const ASK_TIMEOUT_MS: u64 = 10_000;
/// The sweep's period on each node, in milliseconds.
const SWEEP_MS: u64 = 1_000;
/// The model's latency on `b`'s `long job`, in simulated milliseconds.
const LONG_JOB_MODEL_LATENCY_MS: u64 = 8_000;
/// How long the test watches `b` and the room pending on node-1, from the post, in
/// simulated milliseconds: five of node-2's sweep rounds, well within the job.
const WATCHED_MS: u64 = 5 * SWEEP_MS;
const _: () = assert!(WATCHED_MS + SWEEP_MS < LONG_JOB_MODEL_LATENCY_MS);
/// How long after the post everything may take to settle, in simulated milliseconds:
/// the job (8 s), the mention's turn (0.4 s), the reports, with room.
const SETTLE_BOUND_MS: u64 = 30_000;
/// Pause between polls, in milliseconds.
const POLL_MS: u64 = 20;
/// Seeds the test runs under.
const SEEDS: u64 = 4;
/// Simulated time limit of one run, in seconds.
const RUN_TIME_LIMIT_S: u64 = 120;
/// The conversation.
const ROOM: &str = "room";

/// The two nodes (`sim_nodes::SweepCluster`); this file's reads are below.
type Cluster = sim_nodes::SweepCluster;

/// The script of `support/agents.rs`, and `b` given a `long job` answers `task done`
/// after [`LONG_JOB_MODEL_LATENCY_MS`] (no earlier rule matches a task of that text).
fn long_job_script() -> ScriptedLlm {
    script().rule(
        ScriptRule::agent("b")
            .on_user_containing("long job")
            .latency(Duration::from_millis(LONG_JOB_MODEL_LATENCY_MS))
            .reply("task done"),
    )
}

impl Cluster {
    /// Creates the room (`h` and `b`) through node-1's client, so it runs on node-1.
    async fn create_room_on_node_1(&self) {
        self.on_node_1(|client| async move {
            client
                .create_conversation(
                    ROOM,
                    vec![Participant::Human("h".into()), Participant::Agent("b".into())],
                    ConversationKind::Group,
                )
                .await
        })
        .await
        .expect("node-1 creates the room");
    }

    /// Activations node `index`'s runtime has started so far.
    async fn activations_started(&self, index: usize) -> u64 {
        self.client(index).await.runtime().counters().activations_started
    }
}

/// What one run saw.
struct Outcome {
    /// node-2's activations at the end of the watched window, and at the end.
    node_2_activations_watched: u64,
    node_2_activations: u64,
    /// `b`'s (inbox, outbox) and the room's relays at the end of the watched window.
    b_pending_watched: (u64, u64),
    relays_watched: usize,
    /// At the end (at the bound if not settled).
    task: TaskState,
    answers: Vec<ConversationMessage>,
    relays: Vec<String>,
    b_pending: (u64, u64),
    /// Simulated ms from the post until everything settled (the bound if not).
    settled_ms: u128,
    /// The nodes any agent event happened on.
    event_nodes: Vec<usize>,
}

/// The scenario of the module docs.
async fn scenario() -> Outcome {
    let _etcd = start_sim_etcd(&Handle::current(), ETCD_ADDRESS).await;
    let sweep = Some(Duration::from_millis(SWEEP_MS));
    let cluster = Cluster::start(
        &NODE_NAMES,
        &long_job_script(),
        sweep,
        Duration::from_millis(ASK_TIMEOUT_MS),
    )
    .await;
    cluster.place(0, "a").await;
    cluster.place(0, "b").await;
    cluster.create_room_on_node_1().await;
    let task = cluster
        .on_node_1(|client| async move { client.delegate("a", "b", "a long job", None).await })
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
        .expect("the room (node-1) takes the post");
    let posted_at = Instant::now();
    tokio::time::sleep(Duration::from_millis(WATCHED_MS)).await;
    let b_pending_watched = cluster.pending("b").await;
    let relays_watched = cluster.relays(ROOM).await.len();
    let node_2_activations_watched = cluster.activations_started(1).await;
    let (task_state, answers, relays, b_pending) = loop {
        let task_state = cluster.task_state(&task).await;
        let answers = answers_of_b(&cluster.room(ROOM).await, posted.seq);
        let (relays, b_pending) = (cluster.relays(ROOM).await, cluster.pending("b").await);
        let settled =
            task_state == TaskState::Completed && !answers.is_empty() && relays.is_empty() && b_pending == (0, 0);
        if settled || posted_at.elapsed() >= Duration::from_millis(SETTLE_BOUND_MS) {
            break (task_state, answers, relays, b_pending);
        }
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    };
    let settled_ms = posted_at.elapsed().as_millis();
    // Two more rounds of node-2's sweep over the settled state.
    tokio::time::sleep(Duration::from_millis(2 * SWEEP_MS)).await;
    let mut event_nodes: Vec<usize> = cluster.seen.events().iter().map(|(node, _)| *node).collect();
    event_nodes.sort_unstable();
    event_nodes.dedup();
    Outcome {
        node_2_activations_watched,
        node_2_activations: cluster.activations_started(1).await,
        b_pending_watched,
        relays_watched,
        task: task_state,
        answers,
        relays,
        b_pending,
        settled_ms,
        event_nodes,
    }
}

fn run_seed(seed: u64) -> Outcome {
    let mut runtime = madsim::runtime::Runtime::with_seed_and_config(seed, madsim::Config::default());
    runtime.set_time_limit(Duration::from_secs(RUN_TIME_LIMIT_S));
    runtime.block_on(scenario())
}

/// Goal: a node's resume sweep starts no activation of an agent or a conversation with
/// pending entries that another living node owns (its wake-up would be refused
/// `NotOwner` there), and the owner processes those entries: the task completes and
/// the mention is answered once, on node-1.
#[test]
fn a_sweep_starts_no_activation_of_what_another_living_node_owns() {
    let (mut fastest, mut slowest) = (u128::MAX, 0);
    for seed in 1..=SEEDS {
        let outcome = run_seed(seed);
        eprintln!(
            "seed {seed}: node-2 started {} activations while b and the room were pending, {} in all; \
             settled {} ms after the post",
            outcome.node_2_activations_watched, outcome.node_2_activations, outcome.settled_ms
        );
        assert_eq!(
            outcome.b_pending_watched,
            (1, 0),
            "seed {seed}: b's inbox held the task through the watched window"
        );
        assert_eq!(
            outcome.relays_watched, 1,
            "seed {seed}: the room's relay was pending through the watched window"
        );
        assert_eq!(
            (outcome.node_2_activations_watched, outcome.node_2_activations),
            (0, 0),
            "seed {seed}: node-2 started an activation (while pending, in all)"
        );
        assert_eq!(outcome.task, TaskState::Completed, "seed {seed}: b's task completes");
        assert_eq!(
            outcome.answers.len(),
            1,
            "seed {seed}: one answer: {:?}",
            outcome.answers
        );
        assert_eq!(outcome.answers[0].text, "seen", "seed {seed}: b's reply, no note");
        assert!(
            outcome.relays.is_empty(),
            "seed {seed}: relay left: {:?}",
            outcome.relays
        );
        assert_eq!(outcome.b_pending, (0, 0), "seed {seed}: b's inbox and outbox drained");
        assert_eq!(outcome.event_nodes, [0], "seed {seed}: every agent event on node-1");
        fastest = fastest.min(outcome.settled_ms);
        slowest = slowest.max(outcome.settled_ms);
    }
    eprintln!("over {SEEDS} seeds: settled {fastest}–{slowest} ms (simulated) after the post");
}
