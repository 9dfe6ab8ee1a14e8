//! A group conversation across a three-node simulated cluster under network partitions
//! injected by the seed: every mention answered exactly once, the sequence gap-free,
//! every acknowledged post stored once, every inbox drained (the invariants of the
//! one-node conversation DST, `tests/dst_conversations.rs`, now with every mention, its
//! delivery and its answer crossing the simulated network).
//!
//! Set-up, per seed: three `ClusterNode`s on madsim's etcd and one `MemoryStore` every
//! node reaches (the real agents, conversations, dispatcher, routing, fencing and
//! transport; the scripted model below). Each node joins again after a lost lease. The
//! group conversation `room` (a human `h` and the agents `a`, `b`, `c`) is created
//! through a node the seed picks, so it runs there; each agent is placed (its first
//! turn) on one of the two other nodes, also picked by the seed: every mention's
//! delivery and every answer crosses nodes.
//!
//! Workload: [`ROUNDS`] rounds; in each the human posts [`POSTS`] messages
//! `@a @c topic {round}.{i}` in turn, each through a node the seed picks per attempt.
//! `a` answers `@b please check`, `b` answers `@c fyi`, `c` answers `noted`: a mention
//! chain of depth 3, four mention turns per post. A post's first attempt is sent twice
//! at once, through two random nodes (a duplicated request: if both are acknowledged,
//! at one seq, one of them new). A post attempt that fails or takes longer than
//! [`POST_ATTEMPT_TIMEOUT_MS`] (the user gives up waiting and drops it: it may still
//! commit) is retried with the same client id through a random node, as a user would,
//! until acknowledged (at most [`POST_ATTEMPTS_MAX`] attempts). Between rounds a random
//! pause.
//!
//! Faults, drawn from the seed while the rounds run, two injectors at once: node↔node
//! partitions (a random pair cut both ways for 0.5–6 s, then healed, after a random
//! gap) and node↔etcd partitions (a random node cut from etcd for 1–8 s; past the
//! lease TTL of 3 s the node loses its lease, drops its activations and joins again
//! with a new lease once healed); one cut in [`LONG_CUT_EVERY`] lasts 10–40 s instead,
//! past an agent's tries of an answer. After the last round both injectors stop, every
//! link is healed, and every node starts a resume sweep
//! (`AgentClient::start_resume_sweep`, every [`SWEEP_MS`]); the system is then given at
//! most [`SETTLE_BOUND_MS`] of simulated time to settle (every mention answered, no
//! relay left, inboxes and outboxes empty), then [`QUIET_MS`] more (so a late duplicate
//! would show), and the stored conversation is checked.
//!
//! Invariants (as the one-node DST): seqs 0..n without gaps (GapFreeSequence); every
//! mention of every stored message answered exactly once, by the agent's reply or a
//! system note (NoMentionLost, NoMentionAnsweredTwice); every acknowledged post stored
//! exactly once, at the seq its acknowledgement gave, and no post stored twice
//! (NoAckedPostLost, dedupe by client id); every agent's inbox and outbox empty (the
//! stored keys and the counters) and no relay left. Since no model fails and every
//! partition heals long before a mention's 120 s deadline, every answer is a reply: the
//! chain is complete for every stored post (`a`, `b` once each, `c` twice).
//!
//! The control ([`a_retry_under_a_new_client_id_stores_a_post_twice`]) retries failed
//! posts under a fresh client id instead: some seed then stores a post twice, which the
//! invariants catch (the dedupe by client id is what keeps retries safe, and the
//! scenario does produce posts that commit after their sender gave up).
//!
//! What it showed when written: no invariant violated in 100 seeds. With the sweeps
//! removed every seed still settled (activation-time resume and the delivery and answer
//! retries sufficed here); with the retries removed the invariants still held (an
//! unacknowledged post may be stored or not) and only the check that some post was
//! retried failed.
//!
//! Kills and slow disks
//! ([`every_mention_is_answered_exactly_once_under_node_kills_and_slow_disks`]): the
//! same scenario and partitions, and also a third injector that kills a random node
//! (`Handle::kill`: its tasks, connections and memory gone) every
//! [`KILL_GAP_MS`] and restarts it (`Handle::restart`: it joins again with a new lease)
//! after [`KILL_DOWN_MS`], one node down at a time; and slow disks: a random non-empty
//! set of nodes whose every store operation first waits up to a per-node bound drawn in
//! [`SLOW_DISK_TYPICAL_MS`], one in [`SLOW_DISK_STALL_EVERY`] stalling
//! [`SLOW_DISK_STALL_MS`] (`support/slow_disk.rs`, the slow store of `cluster_sim.rs`).
//! A post attempt through a node that is dead or dies during it fails; the post is
//! retried with the same client id through another node. After the last round every
//! killed node is restarted, then the same settling ([`KILL_SETTLE_BOUND_MS`]) and the
//! same invariants; a run that killed no node or ran no slow store operation fails. Seeds
//! 1..=[`KILL_SEEDS`]; `TROUPE_KILL_DST_SEEDS=<n>` or `<a>-<b>` picks others.
//!
//! What the kills and slow disks found (2026-12-01, 200 seeds): 12 seeds (14, 20, 32,
//! 39, 53, 67, 86, 92, 102, 149, 174, 194) leave a mention of `c` unanswered when
//! checked, or answered by an `Undeliverable` note ("the deadline passed (agent/c is
//! busy: its mailbox of 64 messages is full)"), although every fault ended long
//! before: a liveness bug, not an exactly-once one (in all 200 seeds every
//! acknowledged post is stored once at its seq, the sequence is gap-free and no mention
//! is answered twice). What the record shows (seed 86 with a 10 s sweep, where only the
//! room's node-3 has a slow disk and `c` has moved there): after the faults `c` runs no
//! turn for 250 simulated seconds while its node takes in 255 appends of mentions, the
//! same mention up to 15 times as new (`MessageReceived`, duplicate false) and none committed: the
//! agent's mailbox stays full of the delivery tasks' appends (one per pending relay and
//! per conversation activation that started it, each retried every 100 ms while
//! refused busy); on the slow disk an append waits in the queue about as long as its
//! 30 s acknowledgement timeout (`AGENT_DELIVERY_ACK_TIMEOUT_MS`), finishes after its
//! deadline and is not committed (the runtime drops a turn that ends past its
//! deadline), and is sent again: the work is redone, never kept, and the inbox's own
//! processing starves. With the 1 s sweep, 21 of 200 seeds took over 60 s to settle
//! (up to 272 s) against a median of 0.6 s; with the default 10 s sweep seed 86 still
//! does not settle in 300 s; without the stalls, the kills or the sweep the four seeds
//! tried settle (in 0–70 s).
//!
//! Fixed in part the same day (`conversation.rs`: `relay`, `deliver`): a mention has one
//! delivery task per process, however many activations of its conversation resumed it
//! (`AgentShared::start_mention_delivery`), and a task's pause between attempts doubles
//! from `AGENT_DELIVERY_RETRY_MS` (100 ms) up to `AGENT_MENTION_DELIVERY_RETRY_MAX_MS`
//! (5 s) instead of staying at 100 ms. Over the same 200 seeds, one process per seed:
//! 12 failing seeds before (the list above, the same with a 300 s settle bound), 2 after
//! (74 and 151): a mention's deadline passed while it waited for an agent on a slow
//! disk (seed 74, as run at 4843f60: the mention of `c` in #10 still
//! unanswered at the 120 s settle bound; seed 151: "@c could not answer #30: the
//! deadline passed before it could answer").
//!
//! Where those 120 s went (2026-12-01, seeds 74 and 151 recorded with temporary prints of
//! every delivery attempt, agent turn and conversation turn): to waste, not to the faults.
//! Seed 74's mention of `c` in #10 (posted at 6.6 s, deadline at 126.6 s; the faults ended
//! at 33.7 s): 11.6 s of attempts cut by the faults (a kill, a lost lease), 5.7 s until the
//! room's next activation resumed it, two appends that waited 30 s each in `c`'s mailbox
//! and expired (60 s), a third accepted after 11.4 s (at 95.6 s), then 31 s in `c`'s inbox
//! behind earlier mentions. `c`'s mention turns took 4–15 s each, nearly all of it
//! posting the answer: the room's mailbox was full of the resume sweep's wake-ups (every
//! round, every pending relay), each reading its relay key on the slow disk before it found
//! the delivery task already running: 385 such turns, 68 s of the room's 125 s after the
//! faults (its 45 posts took 11 s, its 32 resumes 11 s); answer posts took a median 4.1 s,
//! up to 15.3 s; 30 appends timed out at their 30 s acknowledgement. Seed 151 the same (316
//! wake-ups, 72 s): its mention of `c` in #30 (posted at 40.5 s; the faults ended at 47.6
//! s) had three appends expire in `c`'s mailbox (90 s), was accepted at 141 s with 19 s
//! left, and waited past its deadline in the inbox.
//!
//! Fixed (1a79a47, `conversation.rs`: `relay` and the `Resume` command): a wake-up of a
//! mention whose delivery task runs in this process reads nothing (checked before the store
//! read), and a resume does not wake it. Over 1..=200, one process per seed: 74 and 151
//! fail before, none after (one run of 1..=200 passes too). With the turns timed (the same
//! temporary prints; they change no run), the longest time from a mention's first relay to
//! its answer in a seed: up to 137 s before (6 seeds over 90 s, 11 over 60 s), up to 70 s
//! after (none over 90 s, 3 over 60 s); appends timed out at 30 s: 173 before, 60 after;
//! relay turns: 19 575 taking 1 485 s before, 15 770 taking 823 s after (those left read
//! their relay: a mention's first wake-up in a process, or one whose task there has ended).
//! Settling after the faults: a median of 0.4 s both, 18 seeds over 60 s before (up to 121
//! s), 6 after (up to 99 s, seed 13). The test runs in CI on seeds 1..=[`KILL_SEEDS`],
//! which includes two of the seeds the earlier fix made pass (14 and 20: both fail without
//! it).
//!
//! The same waste on the agent's side: an agent's resume (the sweep's, every round) told
//! `Process` again for every inbox entry, those already queued too, and each extra one
//! read its entry to find it gone: in seed 13 after the fix above, 107 of the agents'
//! 180 `Process` turns did nothing (25 s of their turns). Now a resume skips an entry
//! whose `Process` this activation told and may still run (`AgentActor::process_told`,
//! `tests/process_once.rs` in troupe-agent). Over 1..=200 in one process, settled after
//! the faults: mean 11.6 s before, 11.3 s after; median 0.45 s and 0.64 s; slowest 99 s
//! and 74 s; 6 and 4 seeds over 60 s: the tail shortened, the rest moved within what any
//! change of timing moves in these runs.
//!
//! Run with `CARGO_TARGET_DIR=target/madsim RUSTFLAGS="--cfg madsim" cargo nextest run -p troupe-cluster --test cluster_conversation_partition_dst`.
#![cfg(madsim)]

#[path = "support/agents.rs"]
mod agents;
#[path = "support/sim_etcd.rs"]
mod sim_etcd;
#[path = "support/sim_nodes.rs"]
mod sim_nodes;
#[path = "support/slow_disk.rs"]
mod slow_disk;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agents::{agent_system, Seen};
use madsim::net::NetSim;
use madsim::rand::Rng;
use madsim::runtime::{Handle, NodeHandle};
use sim_etcd::start_sim_etcd;
use sim_nodes::{node_ip, ETCD_ADDRESS};
use slow_disk::{DiskProfile, SlowDisk};
use tokio::time::Instant;
use troupe_agent::{
    AgentClient, ConversationKind, ConversationMessage, Participant, Posted, ScriptRule, ScriptedLlm, Sender,
    AGENT_KIND, CONVERSATION_KIND, CONVERSATION_PAGE_MAX,
};
use troupe_core::ActorId;
use troupe_runtime::{MemoryStore, StateStore};

const NODE_NAMES: [&str; 3] = ["node-1", "node-2", "node-3"];
/// How long each placement ask may take, in milliseconds.
const ASK_TIMEOUT_MS: u64 = 10_000;
/// The resume sweep's period on each node once the faults end, in milliseconds.
const SWEEP_MS: u64 = 1_000;
/// Rounds per seed.
const ROUNDS: u64 = 8;
/// Human posts per round, each mentioning `a` and `c`.
const POSTS: u64 = 2;
/// The agents of the conversation.
const AGENTS: [&str; 3] = ["a", "b", "c"];
/// The human of the conversation.
const HUMAN: &str = "h";
/// The conversation.
const ROOM: &str = "room";
/// How long a user waits for one post attempt before giving up on it, in milliseconds.
const POST_ATTEMPT_TIMEOUT_MS: u64 = 3_000;
/// Most attempts of one post.
const POST_ATTEMPTS_MAX: u32 = 30;
/// Pause between two attempts of a post, in milliseconds.
const POST_RETRY_PAUSE_MS: u64 = 200;
/// The longest pause between two rounds, in milliseconds.
const ROUND_PAUSE_MAX_MS: u64 = 2_000;
/// Range of a node↔node partition's length, in milliseconds.
const NODE_CUT_MS: (u64, u64) = (500, 6_000);
/// Range of a node↔etcd partition's length, in milliseconds (the lease TTL is 3 s).
const ETCD_CUT_MS: (u64, u64) = (1_000, 8_000);
/// One cut in this many is long instead: past an agent's five tries of a mention's
/// answer (0.5 + 1 + 2 + 4 + 8 s) and a post's ack timeout.
const LONG_CUT_EVERY: u32 = 5;
/// Range of a long cut's length, in milliseconds.
const LONG_CUT_MS: (u64, u64) = (10_000, 40_000);
/// Range of the gap between two partitions of one injector, in milliseconds.
const FAULT_GAP_MS: (u64, u64) = (200, 2_000);
/// Range of the model's latency on a mention, drawn per seed, in milliseconds.
const MODEL_LATENCY_MS: (u64, u64) = (20, 400);
/// How long the system may take to settle after the last round, in simulated
/// milliseconds: a rejoin after the last cut (lease TTL plus the join), a sweep period,
/// and a chain of four model turns, with room.
const SETTLE_BOUND_MS: u64 = 60_000;
/// Simulated time waited after the system settled before the check, in milliseconds.
const QUIET_MS: u64 = 5_000;
/// Pause between polls, in milliseconds.
const POLL_MS: u64 = 200;
/// Seeds of the main test.
const SEEDS: u64 = 100;
/// Seeds the control tries (it stops at the first that stores a post twice). About one
/// seed in ten does (19 of 1..=200 on 2026-12-06, before and after the resume change of
/// 51382ce, at other seeds: any change to what the nodes send moves every seed's
/// trajectory), so 30 seeds missed with a chance of about 0.9^30, 4 %, and did after
/// 51382ce (the first was seed 36); 100 miss with about 0.9^100, under 0.01 %.
const CONTROL_SEEDS: u64 = 100;
/// Seeds the replay test runs, each twice.
const REPLAY_SEEDS: [u64; 2] = [1, 2];
/// Simulated time limit of one run, in seconds.
const RUN_TIME_LIMIT_S: u64 = 600;
/// Range of the gap before the next node kill, in milliseconds.
const KILL_GAP_MS: (u64, u64) = (1_000, 6_000);
/// Range of how long a killed node stays down before it restarts, in milliseconds
/// (shorter and longer than the 3 s lease TTL).
const KILL_DOWN_MS: (u64, u64) = (300, 8_000);
/// Range of the longest wait of a slow disk's operations, drawn per slow node, in
/// milliseconds.
const SLOW_DISK_TYPICAL_MS: (u64, u64) = (20, 300);
/// One operation in this many on a slow disk stalls for [`SLOW_DISK_STALL_MS`].
const SLOW_DISK_STALL_EVERY: u64 = 50;
/// A slow disk's stall, in milliseconds: past the lease TTL and a post's ack timeout.
const SLOW_DISK_STALL_MS: u64 = 3_500;
/// Seeds of the kill and slow-disk test in CI; `TROUPE_KILL_DST_SEEDS=<n>` runs seeds
/// 1..=n instead (by hand).
const KILL_SEEDS: u64 = 20;
/// How long the kill and slow-disk runs may take to settle after the faults, in
/// simulated milliseconds: twice the partition runs' bound (a restarted node's rejoin,
/// every store operation of a slow node waiting), and still below a mention's 120 s
/// deadline counted from the end of the faults.
const KILL_SETTLE_BOUND_MS: u64 = 120_000;
/// Seeds the kill and slow-disk replay test runs, each twice.
const KILL_REPLAY_SEEDS: [u64; 2] = [3, 4];
/// What an attempt through a node that was killed (or is dead) fails with.
const NODE_DIED: &str = "its node died";

/// The scripted model: `ping` → `pong` (placement); a mention of `a` → `a` mentions
/// `b`; of `b` → `b` mentions `c`; of `c` → `noted`; each after `latency_ms`.
fn script(latency_ms: u64) -> ScriptedLlm {
    let latency = Duration::from_millis(latency_ms);
    let mention = |agent: &str, reply: &str| {
        ScriptRule::agent(agent)
            .on_user_containing("[conversation")
            .latency(latency)
            .reply(reply)
    };
    ScriptedLlm::new()
        .rule(ScriptRule::any_agent().on_user_containing("ping").reply("pong"))
        .rule(mention("a", "a: @b please check"))
        .rule(mention("b", "b: @c fyi"))
        .rule(mention("c", "c: noted"))
}

/// How a run's user retries a failed post.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Retry {
    /// With the same client id (as the API asks).
    SameId,
    /// With a fresh client id per attempt (the control: not what the API asks).
    FreshId,
}

/// The faults a run injects besides the node↔node and node↔etcd partitions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Faults {
    /// Kill a random node at random moments and restart it after a random time.
    kills: bool,
    /// Give a random non-empty set of nodes a slow disk.
    slow_disks: bool,
    /// How long the system may take to settle after the faults, in simulated ms.
    settle_bound_ms: u64,
}

impl Faults {
    const PARTITIONS: Self = Self {
        kills: false,
        slow_disks: false,
        settle_bound_ms: SETTLE_BOUND_MS,
    };
    const KILLS_AND_SLOW_DISKS: Self = Self {
        kills: true,
        slow_disks: true,
        settle_bound_ms: KILL_SETTLE_BOUND_MS,
    };
}

/// What the nodes and the tasks of a run share with the test.
#[derive(Clone)]
struct Shared {
    slots: Arc<sim_nodes::Slots>,
    seen: Seen,
    store: MemoryStore,
    /// Faults, joins, lease losses and posts, with their simulated time: the run's log.
    log: Arc<Mutex<Vec<String>>>,
    start: Instant,
    /// Set once the faults have ended: every node then runs a resume sweep.
    sweep: Arc<AtomicBool>,
    lease_losses: Arc<AtomicU64>,
    /// Each node's disk (every store operation of the node goes through it).
    disks: Arc<[DiskProfile; 3]>,
    /// Store operations that waited on a slow disk.
    slow_ops: Arc<AtomicU64>,
    /// Whether each node is killed (until it restarts).
    dead: Arc<[AtomicBool; 3]>,
}

impl Shared {
    fn note(&self, line: String) {
        let at = self.start.elapsed().as_millis();
        self.log.lock().expect("the log").push(format!("{at:>7} ms {line}"));
    }
}

struct Cluster {
    nodes: Vec<NodeHandle>,
    etcd: NodeHandle,
    shared: Shared,
}

/// Three nodes on the disks `disks`, each joining again after a lost lease (and after a
/// restart), each running a resume sweep once `shared.sweep` is set.
async fn start_cluster(llm: &ScriptedLlm, disks: [DiskProfile; 3]) -> Cluster {
    let handle = Handle::current();
    let etcd = start_sim_etcd(&handle, ETCD_ADDRESS).await;
    let shared = Shared {
        slots: Arc::new(Mutex::new(vec![None; NODE_NAMES.len()])),
        seen: Seen::default(),
        store: MemoryStore::new(),
        log: Arc::default(),
        start: Instant::now(),
        sweep: Arc::default(),
        lease_losses: Arc::default(),
        disks: Arc::new(disks),
        slow_ops: Arc::default(),
        dead: Arc::default(),
    };
    let nodes = (0..NODE_NAMES.len())
        .map(|index| {
            let (shared, llm) = (shared.clone(), llm.clone());
            handle
                .create_node()
                .name(NODE_NAMES[index])
                .ip(node_ip(index))
                .init(move || run_node(index, shared.clone(), llm.clone()))
                .build()
        })
        .collect();
    let cluster = Cluster { nodes, etcd, shared };
    for index in 0..NODE_NAMES.len() {
        cluster.client(index).await;
    }
    cluster
}

/// Node `index`: joins, publishes its client, sweeps once the faults end, and after a
/// lost lease abandons its node and joins again.
async fn run_node(index: usize, shared: Shared, llm: ScriptedLlm) {
    let store = SlowDisk::new(shared.store.clone(), shared.disks[index], Arc::clone(&shared.slow_ops));
    let (slots, seen) = (Arc::clone(&shared.slots), shared.seen.clone());
    let system = move || agent_system(&llm, index, &seen);
    let on_join = shared.clone();
    let joined = move |client: &AgentClient| {
        on_join.note(format!("{} joined", NODE_NAMES[index]));
        let (flag, client) = (Arc::clone(&on_join.sweep), client.clone());
        tokio::spawn(async move {
            while !flag.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
            }
            let _sweep = client
                .start_resume_sweep(Duration::from_millis(SWEEP_MS))
                .expect("the period is in range");
            std::future::pending::<()>().await;
        })
    };
    let lost = move |sweeper: tokio::task::JoinHandle<()>, reason| {
        sweeper.abort();
        shared.lease_losses.fetch_add(1, Ordering::SeqCst);
        shared.note(format!("{} lost its lease: {reason:?}", NODE_NAMES[index]));
    };
    sim_nodes::run_rejoining(index, NODE_NAMES[index], store, slots, system, joined, lost).await;
}

impl Cluster {
    /// Node `index`'s current incarnation (a restarted node is a new one: tasks spawned
    /// through the handle of a killed incarnation never run).
    fn node(&self, index: usize) -> NodeHandle {
        Handle::current()
            .get_node(self.nodes[index].id())
            .expect("the node exists")
    }

    /// Node `index`'s agent client once it has joined.
    async fn client(&self, index: usize) -> AgentClient {
        sim_nodes::joined_client(&self.shared.slots, index).await
    }

    /// Places `agent` on node `index`: its first turn runs there.
    async fn place(&self, index: usize, agent: &str) {
        let client = self.client(index).await;
        let timeout = Duration::from_millis(ASK_TIMEOUT_MS);
        let node = (index, NODE_NAMES[index]);
        sim_nodes::place_on(&self.node(index), client, &self.shared.seen, node, agent, timeout).await;
    }

    /// Runs `work` with node `index`'s client, on that node (its traffic leaves from
    /// that node's address, so the node's partitions apply to it).
    async fn on_node<T: Send + 'static, F: std::future::Future<Output = T> + Send + 'static>(
        &self,
        index: usize,
        work: impl FnOnce(AgentClient) -> F,
    ) -> T {
        let client = self.client(index).await;
        self.node(index).spawn(work(client)).await.expect("the node's task")
    }

    /// Creates the room through node `index`'s client, so it runs there.
    async fn create_room_on(&self, index: usize) {
        let mut people: Vec<Participant> = AGENTS.iter().map(|a| Participant::Agent(a.to_string())).collect();
        people.push(Participant::Human(HUMAN.into()));
        self.on_node(index, |client| async move {
            client.create_conversation(ROOM, people, ConversationKind::Group).await
        })
        .await
        .expect("the room is created");
    }

    /// The room's committed messages, read through a joined node.
    async fn room(&self) -> Vec<ConversationMessage> {
        self.on_node(0, |client| async move {
            client.read_messages(ROOM, None, CONVERSATION_PAGE_MAX).await
        })
        .await
        .expect("the room reads")
    }

    /// The keys under `prefix` of actor `actor`, read from the shared store.
    async fn keys(&self, actor: &ActorId, prefix: &str) -> Vec<String> {
        self.shared
            .store
            .scan(actor, prefix, None, CONVERSATION_PAGE_MAX)
            .await
            .expect("the store scans")
            .into_iter()
            .map(|(key, _)| key)
            .collect()
    }

    /// What is left to do: the room's relay keys, and per agent its stored inbox and
    /// outbox keys and its counters (inbox, outbox).
    async fn leftovers(&self) -> Leftovers {
        let room = ActorId::new(CONVERSATION_KIND, ROOM).expect("the room's actor id");
        let relays = self.keys(&room, "relay/").await;
        let mut boxes = BTreeMap::new();
        for agent in AGENTS {
            let id = ActorId::new(AGENT_KIND, agent).expect("an agent's actor id");
            let mut keys = self.keys(&id, "inbox/").await;
            keys.extend(self.keys(&id, "outbox/").await);
            let counters = self
                .on_node(0, move |client| async move { client.pending(agent).await })
                .await
                .expect("the counters read");
            boxes.insert(agent, (keys, counters));
        }
        Leftovers { relays, boxes }
    }
}

#[derive(Debug, PartialEq, Eq)]
struct Leftovers {
    relays: Vec<String>,
    boxes: BTreeMap<&'static str, (Vec<String>, (u64, u64))>,
}

impl Leftovers {
    fn none(&self) -> bool {
        self.relays.is_empty()
            && self
                .boxes
                .values()
                .all(|(keys, counters)| keys.is_empty() && *counters == (0, 0))
    }
}

/// How many stored messages answer the mention of `agent` in `seq`: its reply, or a
/// system note about it.
fn answers(messages: &[ConversationMessage], seq: u64, agent: &str) -> usize {
    messages
        .iter()
        .filter(|m| m.reply_to == Some(seq))
        .filter(|m| m.sender == Sender::Agent(agent.to_string()) || m.note.as_ref().is_some_and(|n| n.agent == agent))
        .count()
}

/// Whether every mention of every message has at least one answer.
fn all_answered(messages: &[ConversationMessage]) -> bool {
    messages
        .iter()
        .all(|m| m.mentions.iter().all(|agent| answers(messages, m.seq, agent) > 0))
}

/// One post as the user saw it.
#[derive(Clone, Debug)]
struct PostOutcome {
    text: String,
    /// The seq of the acknowledgement, if an attempt was acknowledged.
    acked: Option<u64>,
    attempts: u32,
}

/// What one run saw.
struct Outcome {
    messages: Vec<ConversationMessage>,
    posts: Vec<PostOutcome>,
    leftovers: Leftovers,
    /// Simulated ms from the end of the faults until the system settled (the bound if
    /// it did not).
    settled_ms: u128,
    settled: bool,
    /// The bound `settled_ms` was held to.
    settle_bound_ms: u64,
    node_cuts: u64,
    etcd_cuts: u64,
    lease_losses: u64,
    /// Post attempts that failed or timed out.
    failed_attempts: u64,
    /// Post attempts that failed because their node was killed (or was dead).
    died_attempts: u64,
    /// Attempts sent through another node after the post's previous attempt died with
    /// its node.
    retried_elsewhere: u64,
    /// Node kills and restarts.
    kills: u64,
    restarts: u64,
    /// Store operations that waited on a slow disk.
    slow_ops: u64,
    /// The nodes with a slow disk.
    slow_nodes: Vec<&'static str>,
    /// Duplicated first attempts acknowledged inconsistently (two seqs, or both new).
    mismatches: Vec<String>,
    /// The nodes each agent's turns ran on (turn counts by node).
    turns_by_node: BTreeMap<&'static str, [usize; 3]>,
    room_node: usize,
    /// Simulated seconds the run took.
    virtual_s: u64,
    /// Every agent event of every node, the log, then the room's messages: the record.
    record: Vec<String>,
}

/// Cuts random links for random times while `stop` is unset, one cut at a time: pairs
/// of nodes (`etcd` is `None`) or a node and etcd. Returns how many cuts it made.
async fn inject(
    ends: Vec<madsim::task::NodeId>,
    etcd: Option<madsim::task::NodeId>,
    stop: Arc<AtomicBool>,
    shared: Shared,
) -> u64 {
    let net = NetSim::current();
    let mut cuts = 0;
    while !stop.load(Ordering::SeqCst) {
        let (gap, length, from, to, what) = {
            let mut rng = madsim::rand::thread_rng();
            let gap = rng.gen_range(FAULT_GAP_MS.0..FAULT_GAP_MS.1);
            match etcd {
                None => {
                    let first = rng.gen_range(0..ends.len());
                    let second = (first + rng.gen_range(1..ends.len())) % ends.len();
                    let (low, high) = if rng.gen_ratio(1, LONG_CUT_EVERY) {
                        LONG_CUT_MS
                    } else {
                        NODE_CUT_MS
                    };
                    let length = rng.gen_range(low..high);
                    let what = format!("{} and {}", NODE_NAMES[first], NODE_NAMES[second]);
                    (gap, length, ends[first], ends[second], what)
                }
                Some(etcd) => {
                    let node = rng.gen_range(0..ends.len());
                    let (low, high) = if rng.gen_ratio(1, LONG_CUT_EVERY) {
                        LONG_CUT_MS
                    } else {
                        ETCD_CUT_MS
                    };
                    let length = rng.gen_range(low..high);
                    (gap, length, ends[node], etcd, format!("{} and etcd", NODE_NAMES[node]))
                }
            }
        };
        tokio::time::sleep(Duration::from_millis(gap)).await;
        if stop.load(Ordering::SeqCst) {
            break;
        }
        shared.note(format!("cut {what} for {length} ms"));
        net.clog_link(from, to);
        net.clog_link(to, from);
        tokio::time::sleep(Duration::from_millis(length)).await;
        net.unclog_link(from, to);
        net.unclog_link(to, from);
        shared.note(format!("healed {what}"));
        cuts += 1;
    }
    cuts
}

/// Kills a random node at random moments while `stop` is unset, one at a time, and
/// restarts it after a random time (the restarted node joins again with a new lease and
/// an empty memory). Returns the kills and the restarts.
async fn kill_nodes(ids: Vec<madsim::task::NodeId>, stop: Arc<AtomicBool>, shared: Shared) -> (u64, u64) {
    let handle = Handle::current();
    let (mut kills, mut restarts) = (0, 0);
    while !stop.load(Ordering::SeqCst) {
        let (gap, node, down) = {
            let mut rng = madsim::rand::thread_rng();
            (
                rng.gen_range(KILL_GAP_MS.0..KILL_GAP_MS.1),
                rng.gen_range(0..ids.len()),
                rng.gen_range(KILL_DOWN_MS.0..KILL_DOWN_MS.1),
            )
        };
        tokio::time::sleep(Duration::from_millis(gap)).await;
        if stop.load(Ordering::SeqCst) {
            break;
        }
        shared.note(format!("kill {} for {down} ms", NODE_NAMES[node]));
        shared.dead[node].store(true, Ordering::SeqCst);
        shared.slots.lock().expect("slots")[node] = None;
        handle.kill(ids[node]);
        kills += 1;
        tokio::time::sleep(Duration::from_millis(down)).await;
        handle.restart(ids[node]);
        shared.dead[node].store(false, Ordering::SeqCst);
        restarts += 1;
        shared.note(format!("restarted {}", NODE_NAMES[node]));
    }
    (kills, restarts)
}

/// One attempt of a post through node `node`, given up after
/// [`POST_ATTEMPT_TIMEOUT_MS`] (the request is dropped: it may still commit). Fails
/// with [`NODE_DIED`] if the node is dead or is killed during the attempt.
async fn attempt(cluster: &Cluster, node: usize, id: &str, text: &str) -> Result<Posted, String> {
    if cluster.shared.dead[node].load(Ordering::SeqCst) {
        return Err(format!("{NODE_DIED} (dead)"));
    }
    let client = cluster.shared.slots.lock().expect("slots")[node].clone();
    // A node between two leases: the user's request fails at once.
    let client = client.ok_or_else(|| "the node is not serving".to_string())?;
    let (id, text) = (id.to_string(), text.to_string());
    let attempt = async move {
        let posting = client.post_message(ROOM, Sender::Human(HUMAN.into()), &id, &text);
        match tokio::time::timeout(Duration::from_millis(POST_ATTEMPT_TIMEOUT_MS), posting).await {
            Ok(Ok(posted)) => Ok(posted),
            Ok(Err(error)) => Err(error.to_string()),
            Err(_) => Err("the user gave up waiting".to_string()),
        }
    };
    // A task of a killed node is dropped: its handle resolves to an error.
    match cluster.node(node).spawn(attempt).await {
        Ok(outcome) => outcome,
        Err(_) => Err(format!("{NODE_DIED} during the attempt")),
    }
}

/// Posts `text` as the human until an attempt is acknowledged (at most
/// [`POST_ATTEMPTS_MAX`]), each attempt through a random node; the first attempt is
/// sent twice at once, through two random nodes (a duplicated request). Retried under
/// `client_id`, or (the control) a fresh id per attempt; after an attempt that died
/// with its node, through another node. `counts` counts the failed attempts, those that
/// died with their node, and the attempts sent elsewhere after one died; a duplicated
/// first attempt acknowledged twice at two seqs, or twice as new, is added to
/// `mismatches`.
async fn post(
    cluster: &Cluster,
    client_id: &str,
    text: &str,
    retry: Retry,
    counts: &mut AttemptCounts,
    mismatches: &mut Vec<String>,
) -> PostOutcome {
    let mut attempts = 0;
    // The node the previous attempt died with, if it did.
    let mut died_with = None;
    while attempts < POST_ATTEMPTS_MAX {
        attempts += 1;
        let id = match retry {
            Retry::SameId => client_id.to_string(),
            Retry::FreshId => format!("{client_id}~{attempts}"),
        };
        let (node, twin) = {
            let mut rng = madsim::rand::thread_rng();
            let (mut node, twin) = (rng.gen_range(0..NODE_NAMES.len()), rng.gen_range(0..NODE_NAMES.len()));
            if let Some(dead) = died_with {
                if node == dead {
                    node = (dead + rng.gen_range(1..NODE_NAMES.len())) % NODE_NAMES.len();
                }
                counts.retried_elsewhere += 1;
            }
            (node, twin)
        };
        let outcome = if attempts == 1 {
            let (first, second) = tokio::join!(attempt(cluster, node, &id, text), attempt(cluster, twin, &id, text));
            if let (Ok(first), Ok(second)) = (&first, &second) {
                if first.seq != second.seq || first.duplicate == second.duplicate {
                    mismatches.push(format!(
                        "{client_id}: a duplicated post acknowledged as {first:?} and {second:?}"
                    ));
                }
            }
            match (first, second) {
                (Ok(posted), _) | (Err(_), Ok(posted)) => Ok(posted),
                (Err(error), Err(_)) => Err(error),
            }
        } else {
            attempt(cluster, node, &id, text).await
        };
        match outcome {
            Ok(posted) => {
                cluster.shared.note(format!(
                    "post {client_id} acknowledged at #{} (duplicate: {}, attempt {attempts})",
                    posted.seq, posted.duplicate
                ));
                return PostOutcome {
                    text: text.to_string(),
                    acked: Some(posted.seq),
                    attempts,
                };
            }
            Err(error) => {
                counts.failed += 1;
                died_with = error.starts_with(NODE_DIED).then_some(node);
                counts.died += u64::from(died_with.is_some());
                cluster.shared.note(format!(
                    "post {client_id} through {} failed (attempt {attempts}): {error}",
                    NODE_NAMES[node]
                ));
                tokio::time::sleep(Duration::from_millis(POST_RETRY_PAUSE_MS)).await;
            }
        }
    }
    PostOutcome {
        text: text.to_string(),
        acked: None,
        attempts,
    }
}

/// A run's post attempts: failed, died with their node, sent elsewhere after one died.
#[derive(Default)]
struct AttemptCounts {
    failed: u64,
    died: u64,
    retried_elsewhere: u64,
}

/// Each node's disk: fast, or (with `slow_disks`) slow on a random non-empty set of
/// nodes, each with its own longest wait.
fn draw_disks(slow_disks: bool) -> [DiskProfile; 3] {
    let mut disks = [DiskProfile::FAST; 3];
    if !slow_disks {
        return disks;
    }
    let mut rng = madsim::rand::thread_rng();
    let mut slow: Vec<bool> = (0..NODE_NAMES.len()).map(|_| rng.gen_ratio(1, 2)).collect();
    if !slow.contains(&true) {
        slow[rng.gen_range(0..NODE_NAMES.len())] = true;
    }
    for (disk, slow) in disks.iter_mut().zip(slow) {
        if slow {
            *disk = DiskProfile {
                typical_ms: rng.gen_range(SLOW_DISK_TYPICAL_MS.0..=SLOW_DISK_TYPICAL_MS.1),
                stall_every: SLOW_DISK_STALL_EVERY,
                stall_ms: SLOW_DISK_STALL_MS,
            };
        }
    }
    disks
}

/// The scenario of the module docs under the current seed, with `faults` added.
async fn scenario(retry: Retry, faults: Faults) -> Outcome {
    let began = Instant::now();
    let (latency_ms, room_node, placements) = {
        let mut rng = madsim::rand::thread_rng();
        let latency_ms = rng.gen_range(MODEL_LATENCY_MS.0..MODEL_LATENCY_MS.1);
        let room_node = rng.gen_range(0..NODE_NAMES.len());
        let placements: Vec<usize> = AGENTS
            .iter()
            .map(|_| (room_node + rng.gen_range(1..NODE_NAMES.len())) % NODE_NAMES.len())
            .collect();
        (latency_ms, room_node, placements)
    };
    let disks = draw_disks(faults.slow_disks);
    let slow_nodes: Vec<&'static str> = (0..NODE_NAMES.len())
        .filter(|node| disks[*node] != DiskProfile::FAST)
        .map(|node| NODE_NAMES[node])
        .collect();
    let cluster = start_cluster(&script(latency_ms), disks).await;
    for (agent, node) in AGENTS.iter().zip(&placements) {
        cluster.place(*node, agent).await;
    }
    cluster.create_room_on(room_node).await;
    cluster.shared.note(format!(
        "room on {}, a b c on {:?}, model latency {latency_ms} ms",
        NODE_NAMES[room_node],
        placements.iter().map(|n| NODE_NAMES[*n]).collect::<Vec<_>>()
    ));
    if faults.slow_disks {
        cluster.shared.note(format!("slow disks on {slow_nodes:?}: {disks:?}"));
    }

    let stop = Arc::new(AtomicBool::new(false));
    let node_ids: Vec<_> = cluster.nodes.iter().map(NodeHandle::id).collect();
    let node_injector = tokio::spawn(inject(
        node_ids.clone(),
        None,
        Arc::clone(&stop),
        cluster.shared.clone(),
    ));
    let etcd_injector = tokio::spawn(inject(
        node_ids.clone(),
        Some(cluster.etcd.id()),
        Arc::clone(&stop),
        cluster.shared.clone(),
    ));
    let killer = faults
        .kills
        .then(|| tokio::spawn(kill_nodes(node_ids, Arc::clone(&stop), cluster.shared.clone())));

    let mut posts = Vec::new();
    let mut counts = AttemptCounts::default();
    let mut mismatches = Vec::new();
    for round in 0..ROUNDS {
        for i in 0..POSTS {
            let client_id = format!("h{round}.{i}");
            let text = format!("@a @c topic {round}.{i}");
            posts.push(post(&cluster, &client_id, &text, retry, &mut counts, &mut mismatches).await);
        }
        let pause = madsim::rand::thread_rng().gen_range(0..ROUND_PAUSE_MAX_MS);
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }

    // The faults end: every cut heals (each injector heals its own before it returns),
    // every killed node restarts.
    stop.store(true, Ordering::SeqCst);
    let node_cuts = node_injector.await.expect("the node↔node injector");
    let etcd_cuts = etcd_injector.await.expect("the node↔etcd injector");
    let (kills, restarts) = match killer {
        Some(killer) => killer.await.expect("the killer"),
        None => (0, 0),
    };
    cluster.shared.note("faults ended; resume sweeps start".into());
    cluster.shared.sweep.store(true, Ordering::SeqCst);
    let healed = Instant::now();
    let settled = loop {
        let messages = cluster.room().await;
        if all_answered(&messages) && cluster.leftovers().await.none() {
            break true;
        }
        if healed.elapsed() >= Duration::from_millis(faults.settle_bound_ms) {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    };
    let settled_ms = healed.elapsed().as_millis();
    tokio::time::sleep(Duration::from_millis(QUIET_MS)).await;
    let messages = cluster.room().await;
    let leftovers = cluster.leftovers().await;
    let mut turns_by_node: BTreeMap<&'static str, [usize; 3]> = BTreeMap::new();
    for agent in AGENTS {
        let mut counts = [0; 3];
        for (node, _, _) in cluster.shared.seen.turns_of(agent) {
            counts[node] += 1;
        }
        turns_by_node.insert(agent, counts);
    }
    let mut record = cluster.shared.seen.record();
    record.extend(cluster.shared.log.lock().expect("the log").iter().cloned());
    record.extend(messages.iter().map(|message| format!("{message:?}")));
    Outcome {
        messages,
        posts,
        leftovers,
        settled_ms,
        settled,
        settle_bound_ms: faults.settle_bound_ms,
        node_cuts,
        etcd_cuts,
        lease_losses: cluster.shared.lease_losses.load(Ordering::SeqCst),
        failed_attempts: counts.failed,
        died_attempts: counts.died,
        retried_elsewhere: counts.retried_elsewhere,
        kills,
        restarts,
        slow_ops: cluster.shared.slow_ops.load(Ordering::SeqCst),
        slow_nodes,
        mismatches,
        turns_by_node,
        room_node,
        virtual_s: began.elapsed().as_secs(),
        record,
    }
}

fn run_seed(seed: u64, retry: Retry) -> Outcome {
    run_seed_with(seed, retry, Faults::PARTITIONS)
}

fn run_seed_with(seed: u64, retry: Retry, faults: Faults) -> Outcome {
    let mut runtime = madsim::runtime::Runtime::with_seed_and_config(seed, madsim::Config::default());
    runtime.set_time_limit(Duration::from_secs(RUN_TIME_LIMIT_S));
    runtime.block_on(scenario(retry, faults))
}

/// The invariants of the module docs on one run's outcome; `Err` names the first
/// violated.
fn check(outcome: &Outcome) -> Result<(), String> {
    let messages = &outcome.messages;
    let dump = || format!("{messages:#?}");
    if let Some(mismatch) = outcome.mismatches.first() {
        return Err(mismatch.clone());
    }
    let seqs: Vec<u64> = messages.iter().map(|m| m.seq).collect();
    if seqs != (0..messages.len() as u64).collect::<Vec<_>>() {
        return Err(format!("the sequence has gaps: {seqs:?}"));
    }
    for post in &outcome.posts {
        let stored: Vec<u64> = messages.iter().filter(|m| m.text == post.text).map(|m| m.seq).collect();
        if stored.len() > 1 {
            return Err(format!(
                "post {:?} stored {} times, at {stored:?}",
                post.text,
                stored.len()
            ));
        }
        if let Some(seq) = post.acked {
            if stored != [seq] {
                return Err(format!(
                    "acknowledged post {:?} (at #{seq}) stored at {stored:?}",
                    post.text
                ));
            }
        }
    }
    for message in messages {
        for agent in &message.mentions {
            let n = answers(messages, message.seq, agent);
            if n != 1 {
                return Err(format!(
                    "the mention of {agent} in #{} answered {n} times\n{}",
                    message.seq,
                    dump()
                ));
            }
        }
    }
    if let Some(note) = messages.iter().find(|m| m.note.is_some()) {
        return Err(format!(
            "a system note, though no model fails and every partition heals long before a mention's deadline: {note:?}"
        ));
    }
    let posts = messages
        .iter()
        .filter(|m| m.sender == Sender::Human(HUMAN.into()))
        .count();
    let from = |who: &str| {
        messages
            .iter()
            .filter(|m| m.sender == Sender::Agent(who.into()))
            .count()
    };
    let expected = [("a", posts), ("b", posts), ("c", 2 * posts)];
    for (agent, count) in expected {
        if from(agent) != count {
            return Err(format!(
                "{agent} replied {} times for {posts} stored posts (expected {count})",
                from(agent)
            ));
        }
    }
    if !outcome.leftovers.none() {
        return Err(format!("work left over: {:?}", outcome.leftovers));
    }
    if !outcome.settled {
        return Err(format!("not settled within {} ms", outcome.settle_bound_ms));
    }
    Ok(())
}

/// Goal: under node↔node and node↔etcd partitions injected by the seed (nodes losing
/// their leases among them), a group conversation whose agents live on other nodes
/// than it answers every mention exactly once, keeps its sequence gap-free, stores
/// every acknowledged post exactly once and drains every inbox (module docs).
#[test]
fn every_mention_is_answered_exactly_once_under_network_partitions() {
    let (mut node_cuts, mut etcd_cuts, mut lease_losses, mut failed, mut retried_posts) = (0, 0, 0, 0, 0);
    let (mut acked, mut stored_posts, mut unacked, mut virtual_s, mut slowest) = (0, 0, 0, 0, 0);
    let (mut crossed, mut repeated_turns) = (0, 0);
    for seed in 1..=SEEDS {
        let outcome = run_seed(seed, Retry::SameId);
        let stored = outcome
            .messages
            .iter()
            .filter(|m| m.sender == Sender::Human(HUMAN.into()))
            .count();
        eprintln!(
            "seed {seed}: room on {}; {} node↔node and {} node↔etcd cuts, {} lease losses; {} post attempts failed; {}/{} posts acknowledged, {stored} stored; {} messages; settled {} ms after the faults; turns by node {:?}; {} s simulated",
            NODE_NAMES[outcome.room_node],
            outcome.node_cuts,
            outcome.etcd_cuts,
            outcome.lease_losses,
            outcome.failed_attempts,
            outcome.posts.iter().filter(|p| p.acked.is_some()).count(),
            outcome.posts.len(),
            outcome.messages.len(),
            outcome.settled_ms,
            outcome.turns_by_node,
            outcome.virtual_s,
        );
        if let Err(violation) = check(&outcome) {
            for line in &outcome.record {
                eprintln!("{line}");
            }
            panic!("seed {seed}: {violation}");
        }
        node_cuts += outcome.node_cuts;
        etcd_cuts += outcome.etcd_cuts;
        lease_losses += outcome.lease_losses;
        failed += outcome.failed_attempts;
        retried_posts += outcome.posts.iter().filter(|p| p.attempts > 1).count();
        acked += outcome.posts.iter().filter(|p| p.acked.is_some()).count();
        unacked += outcome.posts.iter().filter(|p| p.acked.is_none()).count();
        stored_posts += stored;
        virtual_s += outcome.virtual_s;
        slowest = slowest.max(outcome.settled_ms);
        // The agents' turns beyond their placement pings and the replies stored: mention
        // turns that ran again because the first one's answer did not land (its post
        // failed, or its node lost its lease mid-turn).
        let turns: usize = outcome.turns_by_node.values().flatten().sum();
        repeated_turns += turns.saturating_sub(AGENTS.len() + 4 * stored);
        crossed += usize::from(
            outcome
                .turns_by_node
                .values()
                .any(|counts| counts[outcome.room_node] == 0),
        );
    }
    eprintln!(
        "{SEEDS} seeds × {ROUNDS} rounds × {POSTS} posts: {node_cuts} node↔node and {etcd_cuts} node↔etcd cuts, {lease_losses} lease losses, {failed} failed post attempts ({retried_posts} posts retried), {acked} posts acknowledged ({unacked} not), {stored_posts} stored; settled within {slowest} ms after the faults; {virtual_s} s simulated in all; {crossed} seeds with some agent never on the room's node; {repeated_turns} mention turns ran again (the first's answer did not land)"
    );
    assert!(node_cuts > 0 && etcd_cuts > 0, "both kinds of partition were injected");
    assert!(lease_losses > 0, "some node lost its lease");
    assert!(retried_posts > 0, "some post was retried");
    assert!(
        repeated_turns > 0,
        "some partition cut an answer off: a mention turn ran again"
    );
}

/// Goal (the control): a user who retries a failed post under a fresh client id
/// (not what the API asks) gets it stored twice in some seed, and the invariants say
/// so: the main test's scenario does produce posts that commit after their sender gave
/// up, and its checks catch a duplicate.
#[test]
fn a_retry_under_a_new_client_id_stores_a_post_twice() {
    for seed in 1..=CONTROL_SEEDS {
        let outcome = run_seed(seed, Retry::FreshId);
        if let Err(violation) = check(&outcome) {
            eprintln!("seed {seed}: {violation}");
            assert!(
                violation.contains("stored 2 times") || violation.contains("stored at"),
                "seed {seed}: the violation is a duplicate: {violation}"
            );
            return;
        }
    }
    panic!("no seed of {CONTROL_SEEDS} stored a post twice with fresh ids per retry");
}

/// Goal: two runs of a seed record the same agent events, faults, lease losses, posts
/// and messages in the same order.
#[test]
fn the_partition_scenario_replays_identically_from_its_seed() {
    for seed in REPLAY_SEEDS {
        let first = run_seed(seed, Retry::SameId).record;
        let second = run_seed(seed, Retry::SameId).record;
        assert!(
            first.iter().any(|line| line.contains(" cut ")),
            "seed {seed}: faults were injected"
        );
        assert_eq!(first, second, "seed {seed} replays identically");
    }
}

/// The seeds of the kill and slow-disk test: 1..=[`KILL_SEEDS`], or with
/// `TROUPE_KILL_DST_SEEDS` set (by hand) 1..=n for `<n>`, a..=b for `<a>-<b>`.
fn kill_seeds() -> std::ops::RangeInclusive<u64> {
    let Ok(seeds) = std::env::var("TROUPE_KILL_DST_SEEDS") else {
        return 1..=KILL_SEEDS;
    };
    let number = |text: &str| text.parse().expect("TROUPE_KILL_DST_SEEDS is <n> or <a>-<b>");
    match seeds.split_once('-') {
        Some((first, last)) => number(first)..=number(last),
        None => 1..=number(&seeds),
    }
}

/// Goal: the scenario of the main test, its partitions included, with node kills and
/// restarts and slow disks added (module docs, "Kills and slow disks"): the same
/// invariants hold, a post whose attempt died with its node is retried under its
/// client id through another node, and every run injected both new faults.
///
/// It found a liveness bug, fixed in two steps (module docs, "What the kills and slow
/// disks found"): seeds 14 and 20 of this range fail without the first; by hand, seeds
/// 74 and 151 of 1..=200 fail without the second (`TROUPE_KILL_DST_SEEDS=74-74`).
#[test]
fn every_mention_is_answered_exactly_once_under_node_kills_and_slow_disks() {
    let (mut kills, mut restarts, mut slow_ops, mut died, mut elsewhere) = (0, 0, 0, 0, 0);
    let (mut node_cuts, mut etcd_cuts, mut lease_losses, mut failed) = (0, 0, 0, 0);
    let (mut acked, mut stored_posts, mut unacked, mut virtual_s, mut slowest) = (0, 0, 0, 0, 0);
    let seeds = kill_seeds();
    for seed in seeds.clone() {
        let outcome = run_seed_with(seed, Retry::SameId, Faults::KILLS_AND_SLOW_DISKS);
        let stored = outcome
            .messages
            .iter()
            .filter(|m| m.sender == Sender::Human(HUMAN.into()))
            .count();
        eprintln!(
            "seed {seed}: room on {}; {} kills, {} restarts; slow disks on {:?}, {} slow store operations; {} node↔node and {} node↔etcd cuts, {} lease losses; {} post attempts failed ({} died with their node, {} attempts sent elsewhere after); {}/{} posts acknowledged, {stored} stored; {} messages; settled {} ms after the faults; {} s simulated",
            NODE_NAMES[outcome.room_node],
            outcome.kills,
            outcome.restarts,
            outcome.slow_nodes,
            outcome.slow_ops,
            outcome.node_cuts,
            outcome.etcd_cuts,
            outcome.lease_losses,
            outcome.failed_attempts,
            outcome.died_attempts,
            outcome.retried_elsewhere,
            outcome.posts.iter().filter(|p| p.acked.is_some()).count(),
            outcome.posts.len(),
            outcome.messages.len(),
            outcome.settled_ms,
            outcome.virtual_s,
        );
        let vacuous = (outcome.kills == 0 || outcome.restarts != outcome.kills || outcome.slow_ops == 0).then(|| {
            "the run injected no kill, did not restart every killed node, or ran no slow store operation".to_string()
        });
        if let Some(violation) = vacuous.or_else(|| check(&outcome).err()) {
            for line in &outcome.record {
                eprintln!("{line}");
            }
            panic!("seed {seed}: {violation}");
        }
        kills += outcome.kills;
        restarts += outcome.restarts;
        slow_ops += outcome.slow_ops;
        died += outcome.died_attempts;
        elsewhere += outcome.retried_elsewhere;
        node_cuts += outcome.node_cuts;
        etcd_cuts += outcome.etcd_cuts;
        lease_losses += outcome.lease_losses;
        failed += outcome.failed_attempts;
        acked += outcome.posts.iter().filter(|p| p.acked.is_some()).count();
        unacked += outcome.posts.iter().filter(|p| p.acked.is_none()).count();
        stored_posts += stored;
        virtual_s += outcome.virtual_s;
        slowest = slowest.max(outcome.settled_ms);
    }
    eprintln!(
        "{} seeds × {ROUNDS} rounds × {POSTS} posts: {kills} kills, {restarts} restarts, {slow_ops} slow store operations; {node_cuts} node↔node and {etcd_cuts} node↔etcd cuts, {lease_losses} lease losses; {failed} failed post attempts ({died} died with their node, {elsewhere} attempts sent through another node after); {acked} posts acknowledged ({unacked} not), {stored_posts} stored; settled within {slowest} ms after the faults; {virtual_s} s simulated in all",
        seeds.count()
    );
    assert!(
        elsewhere > 0,
        "some post attempt died with its node and the post was retried through another"
    );
}

/// Goal: two runs of a seed of the kill and slow-disk scenario record the same agent
/// events, faults, posts and messages in the same order.
#[test]
fn the_kill_and_slow_disk_scenario_replays_identically_from_its_seed() {
    for seed in KILL_REPLAY_SEEDS {
        let run = || run_seed_with(seed, Retry::SameId, Faults::KILLS_AND_SLOW_DISKS).record;
        let (first, second) = (run(), run());
        assert!(
            first.iter().any(|line| line.contains(" kill ")),
            "seed {seed}: a node was killed"
        );
        assert_eq!(first, second, "seed {seed} replays identically");
    }
}
