//! Agents on three simulated cluster nodes (madsim's etcd, one `MemoryStore` every node
//! reaches), each node embedding an agent system through
//! `AgentSystemBuilder::prepare` → `ClusterNode::start` → `PendingAgentSystem::attach`.
//! The model is scripted and really emits `call_agent` tool calls (see
//! `support/agents.rs`); the dispatcher, the agents, the routing and the store are the
//! real ones.
//!
//! One scenario per seed, [`SEEDS`] seeds:
//! 1. `a` is placed on node-1, `b` on node-2, `c` on node-3, `d<i>` on node-(i mod 3 + 1)
//!    (each asked `ping` through its node's client).
//! 2. Asked through node-3's client, `a` (owned by node-1) calls `b`, which calls `c`:
//!    the reply is `a<b<c-answer`, each turn ran on its agent's node (the root ask was
//!    routed from node-3 to node-1) at depth 0, 1, 2, each under the ask's trace id. An
//!    ask continued from another process (`ask_continued`) made on node-3 runs on node-1
//!    at the caller's depth and chain.
//! 3. `a` → `b` → `a`: `b`'s call is refused `CycleDetected` naming `a -> b -> a`, on
//!    node-2, and `a` runs no second turn.
//! 4. `d0` → … → `d5` across the nodes: `d5`'s call is refused `DepthExceeded`; `d6`
//!    never runs; each `d<i>` ran on its node at depth i.
//! 5. `a` delegates a task to `b` (the command made through node-3's client): `b` works
//!    on it once, on node-2, and the result comes back to `a` once, on node-1 (the inbox
//!    and outbox deliveries routed between nodes).
//! 6. The organisation is one record every node writes: the enforced policy written
//!    through node-3 refuses `a → b` on node-1 (`a`'s node), a link written through
//!    node-2 admits it there one cache age later, the open policy is written back
//!    through node-1; an agent defined through node-2 answers through node-3 one
//!    refresh period later, and once removed through node-1 it is refused there.
//! 7. node-3 (owner of `c`) is killed: asking `c` from node-1 succeeds on another node
//!    once node-3's lease has expired, its committed log is still there (every
//!    acknowledged exchange, in order) and its model saw the earlier answer again in
//!    its history window.
//!
//! Run with `CARGO_TARGET_DIR=target/madsim RUSTFLAGS="--cfg madsim" cargo nextest run -p troupe-cluster --test cluster_agents_sim`.
#![cfg(madsim)]

#[path = "support/agents.rs"]
mod agents;
#[path = "support/sim_etcd.rs"]
mod sim_etcd;
#[path = "support/sim_nodes.rs"]
mod sim_nodes;

use sim_etcd::start_sim_etcd;
use sim_nodes::{node_ip, ETCD_ADDRESS, SIM_LEASE_TTL_S};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agents::{agent_system, script, Seen, DEPTH_AGENTS};
use madsim::runtime::Handle;
use tokio::time::Instant;
use troupe_agent::{
    AgentCallError, AgentClient, AgentEvent, AgentReply, AgentSpec, AskOptions, CallOutcome, ChatMessage, Link,
    OrgPolicy, ScriptedLlm, TaskState, TroupeCallMetadata, DIRECTORY_REFRESH_MS, ORG_CACHE_MAX_AGE_MS,
};
use troupe_core::limits::AGENT_CALL_DEPTH_MAX;
use troupe_core::{CallRefused, TraceId};
use troupe_runtime::MemoryStore;

const NODE_NAMES: [&str; 3] = ["node-1", "node-2", "node-3"];
/// How long each ask may take, in milliseconds.
const ASK_TIMEOUT_MS: u64 = 10_000;
/// How long one ask to the killed node's agent may take, in milliseconds.
const RETRY_ASK_TIMEOUT_MS: u64 = 2_000;
/// Pause between asks while the killed node's lease runs out, in milliseconds.
const RETRY_PAUSE_MS: u64 = 200;
/// The longest time the killed node's agent may stay unserved, in simulated ms: the
/// lease TTL, plus one renewal interval it may have been renewed late, plus slack.
const TAKEOVER_BOUND_MS: u64 = SIM_LEASE_TTL_S * 1_000 * 2 + 2_000;
/// Slack over the organisation's cache age for a change written through one node to
/// reach another node's admission, in simulated milliseconds.
const ORG_REACH_SLACK_MS: u64 = 10;
/// Seeds the scenario runs under.
const SEEDS: u64 = 20;
/// Seeds the replay test runs, each twice.
const REPLAY_SEEDS: u64 = 3;
/// Simulated time limit of one run, in seconds.
const RUN_TIME_LIMIT_S: u64 = 120;

/// Three nodes, each with its agent system attached, and the test's view of them.
struct AgentCluster {
    nodes: Vec<madsim::runtime::NodeHandle>,
    clients: Vec<AgentClient>,
    llm: ScriptedLlm,
    seen: Seen,
    _etcd: madsim::runtime::NodeHandle,
}

async fn start_agent_cluster() -> AgentCluster {
    let handle = Handle::current();
    let etcd = start_sim_etcd(&handle, ETCD_ADDRESS).await;
    let llm = script();
    let seen = Seen::default();
    let store = MemoryStore::new();
    let slots: Arc<sim_nodes::Slots> = Arc::new(Mutex::new(vec![None; NODE_NAMES.len()]));
    let nodes: Vec<_> = (0..NODE_NAMES.len())
        .map(|index| {
            let (slots, llm, seen, store) = (Arc::clone(&slots), llm.clone(), seen.clone(), store.clone());
            handle
                .create_node()
                .name(NODE_NAMES[index])
                .ip(node_ip(index))
                .init(move || {
                    let (slots, llm, seen, store) = (Arc::clone(&slots), llm.clone(), seen.clone(), store.clone());
                    async move {
                        let system = move || agent_system(&llm, index, &seen);
                        let (node, client) = sim_nodes::join(index, NODE_NAMES[index], &store, &system).await;
                        slots.lock().expect("slots")[index] = Some(client);
                        std::future::pending::<()>().await;
                        drop(node);
                    }
                })
                .build()
        })
        .collect();
    let clients = loop {
        let ready: Option<Vec<AgentClient>> = slots.lock().expect("slots").iter().cloned().collect();
        if let Some(clients) = ready {
            break clients;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    AgentCluster {
        nodes,
        clients,
        llm,
        seen,
        _etcd: etcd,
    }
}

impl AgentCluster {
    /// Asks `agent` through node `index`'s agent client (from inside that node).
    async fn ask(&self, index: usize, agent: &str, text: &str, timeout_ms: u64) -> Result<AgentReply, AgentCallError> {
        let client = self.clients[index].clone();
        let (agent, text) = (agent.to_string(), text.to_string());
        self.nodes[index]
            .spawn(async move {
                client
                    .ask_with_timeout(&agent, &text, Duration::from_millis(timeout_ms))
                    .await
            })
            .await
            .expect("the ask's task")
    }

    /// As [`AgentCluster::ask`], under trace id `trace`.
    async fn ask_traced(
        &self,
        index: usize,
        agent: &str,
        text: &str,
        trace: TraceId,
    ) -> Result<AgentReply, AgentCallError> {
        let client = self.clients[index].clone();
        let (agent, text) = (agent.to_string(), text.to_string());
        let options = AskOptions::default()
            .timeout(Duration::from_millis(ASK_TIMEOUT_MS))
            .traced(trace);
        self.nodes[index]
            .spawn(async move { client.ask_with(&agent, &text, options).await })
            .await
            .expect("the ask's task")
    }

    /// Runs `work` with node `index`'s agent client, inside that node.
    async fn with_client<T, F>(&self, index: usize, work: impl FnOnce(AgentClient) -> F) -> T
    where
        F: std::future::Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        let work = work(self.clients[index].clone());
        self.nodes[index].spawn(work).await.expect("the node's task")
    }

    /// Places `agent` on node `index`: its first turn runs there.
    async fn place(&self, index: usize, agent: &str) {
        let reply = self.ask(index, agent, "ping", ASK_TIMEOUT_MS).await;
        assert_eq!(reply.expect("a ping").text, "pong", "{agent} answers a ping");
        let last = self.seen.turns_of(agent).pop().expect("a turn");
        assert_eq!(last.0, index, "{agent} placed on {}", NODE_NAMES[index]);
    }

    /// `agent`'s committed log, read from the shared store through node `index`.
    async fn log(&self, index: usize, agent: &str) -> Vec<ChatMessage> {
        let client = self.clients[index].clone();
        let agent = agent.to_string();
        self.nodes[index]
            .spawn(async move { client.conversation_log(&agent).await })
            .await
            .expect("the read's task")
            .expect("the log reads")
    }
}

fn contents(log: &[ChatMessage]) -> Vec<String> {
    log.iter().map(|message| message.content.clone()).collect()
}

/// What one run of the scenario measured and recorded.
struct RunResult {
    /// How long `c` went unserved after its node was killed (simulated).
    takeover: Duration,
    /// Asks to `c` that failed meanwhile.
    failed_asks: u32,
    /// Every agent event of every node, rendered with its node (times included).
    record: Vec<String>,
}

/// The scenario of the module docs; panics with what broke.
async fn scenario() -> RunResult {
    let cluster = start_agent_cluster().await;
    let seen = &cluster.seen;
    // 1. Placement.
    cluster.place(0, "a").await;
    cluster.place(1, "b").await;
    cluster.place(2, "c").await;
    for index in 0..DEPTH_AGENTS - 1 {
        cluster.place(index % NODE_NAMES.len(), &format!("d{index}")).await;
    }

    // 2. a → b → c, asked through node-3: the root ask is routed to a's owner, and
    //    every turn of it runs under the ask's trace id on its own node.
    seen.clear();
    let trace = TraceId::new(0x7472_6f75_7065_0000_0000_0000_0000_0002);
    let reply = cluster.ask_traced(2, "a", "start the chain", trace).await;
    assert_eq!(reply.expect("the chain answers").text, "a<b<c-answer");
    for agent in ["a", "b", "c"] {
        assert_eq!(
            seen.traces_of(agent),
            vec![Some(trace)],
            "{agent}'s turn ran under the ask's trace id"
        );
    }
    for (agent, node, depth, chain) in [("a", 0, 0, vec![]), ("b", 1, 1, vec!["a"]), ("c", 2, 2, vec!["a", "b"])] {
        let chain: Vec<String> = chain.into_iter().map(String::from).collect();
        assert_eq!(
            seen.turns_of(agent),
            vec![(node, depth, chain)],
            "{agent}'s one turn ran on {} at depth {depth}",
            NODE_NAMES[node]
        );
    }
    let root_asked_on = seen.events().into_iter().find_map(|(node, event)| match event {
        AgentEvent::CallStarted {
            caller: None, target, ..
        } if target.key() == "a" => Some(node),
        _ => None,
    });
    assert_eq!(root_asked_on, Some(2), "the root ask was made on node-3");
    // An ask continued from another process (`ask_continued`, as A2A's blocking
    // `SendMessage` with Troupe's context made it), made on node-3, runs on a's owner
    // under the caller's depth and chain (before: run locally, refused `NotOwner`).
    seen.clear();
    let context = TroupeCallMetadata {
        chain: vec!["hq".to_string()],
        depth: 1,
        timeout_ms: Some(ASK_TIMEOUT_MS),
        trace_id: None,
    };
    let reply = cluster
        .with_client(2, move |client| async move {
            let deadline = client.runtime().deadline_in(Duration::from_millis(ASK_TIMEOUT_MS));
            client.ask_continued("a", "ping", &context, deadline).await
        })
        .await;
    assert_eq!(reply.expect("the continued ask answers").text, "pong");
    assert_eq!(
        seen.turns_of("a"),
        vec![(0, 1, vec!["hq".to_string()])],
        "a's turn ran on node-1 at the caller's depth, with its chain"
    );

    // 3. a → b → a is refused, on b's node, naming the chain.
    seen.clear();
    let reply = cluster
        .ask(0, "a", "make a cycle", ASK_TIMEOUT_MS)
        .await
        .expect("the cycle's root answers");
    let refusal = "error: call_agent failed: call refused: cycle detected: agent/a -> agent/b -> agent/a";
    assert!(
        reply.text.starts_with(&format!("a<b<{refusal}")),
        "the models saw the refusal: {}",
        reply.text
    );
    let refused: Vec<(usize, Vec<String>)> = seen
        .events()
        .into_iter()
        .filter_map(|(node, event)| match event {
            AgentEvent::CallFinished {
                outcome: CallOutcome::Refused(CallRefused::CycleDetected { chain }),
                ..
            } => Some((node, chain.iter().map(|a| a.key().to_string()).collect())),
            _ => None,
        })
        .collect();
    assert_eq!(refused, vec![(1, vec!["a".to_string(), "b".into(), "a".into()])]);
    assert_eq!(seen.turns_of("a").len(), 1, "the refused call never reached a");
    assert_eq!(seen.turns_of("b")[0].0, 1, "b ran on node-2");

    // 4. The depth limit across nodes.
    seen.clear();
    let reply = cluster
        .ask(1, "d0", "deep", ASK_TIMEOUT_MS)
        .await
        .expect("the deep chain's root answers");
    let depth_refusal = format!(
        "error: call_agent failed: call refused: call depth {AGENT_CALL_DEPTH_MAX} has reached the limit of {AGENT_CALL_DEPTH_MAX}"
    );
    assert!(
        reply.text.starts_with(&format!("d0<d1<d2<d3<d4<d5<{depth_refusal}")),
        "{}",
        reply.text
    );
    assert!(cluster.llm.requests_of("d6").is_empty(), "d6 never ran");
    for index in 0..DEPTH_AGENTS - 1 {
        let turns = seen.turns_of(&format!("d{index}"));
        assert_eq!(turns.len(), 1, "d{index} ran once");
        assert_eq!(
            (turns[0].0, turns[0].1),
            (index % NODE_NAMES.len(), index as u32),
            "d{index} ran on its node at its depth"
        );
    }

    // 5. a (node-1) delegates to b (node-2) through node-3's client: the command goes to
    // a's owner, a's outbox delivers the task to b's owner, b works on it in a turn of
    // its own on node-2, and the result comes back to a on node-1, exactly once.
    seen.clear();
    let client = cluster.clients[2].clone();
    let task_id = cluster.nodes[2]
        .spawn(async move { client.delegate("a", "b", "delegated work", None).await })
        .await
        .expect("the delegation's task")
        .expect("a accepts the delegation");
    let delegated = Instant::now();
    let status = loop {
        let client = cluster.clients[0].clone();
        let id = task_id.clone();
        let status = cluster.nodes[0]
            .spawn(async move { client.task("a", &id).await })
            .await
            .expect("the read's task")
            .expect("the task reads");
        match status {
            Some(status) if status.state.is_final() && !seen.turns_of("a").is_empty() => break status,
            _ => {
                assert!(
                    delegated.elapsed() < Duration::from_millis(ASK_TIMEOUT_MS),
                    "task {task_id} did not come back: {status:?}"
                );
                tokio::time::sleep(Duration::from_millis(RETRY_PAUSE_MS)).await;
            }
        }
    };
    assert_eq!(
        (status.state, status.result.as_deref()),
        (TaskState::Completed, Some("task done")),
        "{status:?}"
    );
    let b_turns = seen.turns_of("b");
    assert_eq!(b_turns.len(), 1, "b worked on the task once: {b_turns:?}");
    assert_eq!(b_turns[0].0, 1, "b worked on the task on node-2");
    let a_turns = seen.turns_of("a");
    assert_eq!(a_turns.len(), 1, "a took the result once: {a_turns:?}");
    assert_eq!(a_turns[0].0, 0, "a took the result on node-1");

    // 6. The organisation, written through three nodes, decides a's calls on node-1.
    let reach = Duration::from_millis(ORG_CACHE_MAX_AGE_MS + ORG_REACH_SLACK_MS);
    cluster
        .with_client(
            2,
            |client| async move { client.set_org_policy(OrgPolicy::Enforced).await },
        )
        .await
        .expect("node-3 writes the policy");
    tokio::time::sleep(reach).await;
    seen.clear();
    let refused = cluster.ask(0, "a", "just b", ASK_TIMEOUT_MS).await.expect("a answers");
    assert!(
        refused.text.contains("call not permitted: a may not ask b"),
        "the policy written through node-3 refuses a → b on node-1: {}",
        refused.text
    );
    assert!(seen.turns_of("b").is_empty(), "b was not called");
    cluster
        .with_client(1, |client| async move { client.add_link(Link::new("a", "b")).await })
        .await
        .expect("node-2 writes a link");
    tokio::time::sleep(reach).await;
    let reply = cluster.ask(0, "a", "just b", ASK_TIMEOUT_MS).await.expect("a answers");
    assert_eq!(
        reply.text, "a<b-answer",
        "the link written through node-2 admits a → b on node-1"
    );
    cluster
        .with_client(0, |client| async move { client.set_org_policy(OrgPolicy::Open).await })
        .await
        .expect("node-1 writes the policy back");
    // The stored directory too: an agent defined through node-2 answers through node-3
    // one refresh period later; removed through node-1, it is refused through node-3.
    let period = Duration::from_millis(DIRECTORY_REFRESH_MS + ORG_REACH_SLACK_MS);
    cluster
        .with_client(
            1,
            |client| async move { client.define_agent(AgentSpec::new("x")).await },
        )
        .await
        .expect("node-2 defines x");
    tokio::time::sleep(period).await;
    let reply = cluster
        .ask(2, "x", "ping", ASK_TIMEOUT_MS)
        .await
        .expect("x answers through node-3");
    assert_eq!(reply.text, "pong");
    cluster
        .with_client(0, |client| async move { client.remove_agent("x").await })
        .await
        .expect("node-1 removes x");
    tokio::time::sleep(period).await;
    let refused = cluster.ask(2, "x", "ping", ASK_TIMEOUT_MS).await;
    assert!(
        matches!(refused, Err(AgentCallError::Refused(CallRefused::AgentNotFound { .. }))),
        "the removal made through node-1 holds on node-3: {refused:?}"
    );

    // 7. Kill c's owner: c's history survives and is reloaded on another node.
    let before = cluster.log(0, "c").await;
    let acknowledged = ["pong", "[message from agent b] leaf question", "c-answer"];
    let before_text = contents(&before);
    for text in acknowledged {
        assert!(
            before_text.iter().any(|content| content.ends_with(text)),
            "c's log holds the acknowledged {text:?}: {before_text:?}"
        );
    }
    seen.clear();
    Handle::current().kill(cluster.nodes[2].id());
    let killed = Instant::now();
    let mut failed_asks = 0;
    let reply = loop {
        match cluster.ask(0, "c", "again", RETRY_ASK_TIMEOUT_MS).await {
            Ok(reply) => break reply,
            Err(error) => {
                failed_asks += 1;
                assert!(
                    killed.elapsed() < Duration::from_millis(TAKEOVER_BOUND_MS),
                    "c not served {} ms after its node died: {error}",
                    killed.elapsed().as_millis()
                );
                tokio::time::sleep(Duration::from_millis(RETRY_PAUSE_MS)).await;
            }
        }
    };
    let takeover = killed.elapsed();
    assert_eq!(reply.text, "c-again");
    let turns = seen.turns_of("c");
    assert_eq!(turns.len(), 1, "one turn of c after the kill: {turns:?}");
    assert_ne!(turns[0].0, 2, "c ran on a living node");
    let after = cluster.log(0, "c").await;
    assert_eq!(
        after[..before.len()],
        before[..],
        "c's committed log is intact after its node died"
    );
    assert_eq!(
        contents(&after[before.len()..]),
        vec!["again".to_string(), "c-again".to_string()]
    );
    let last_request = cluster.llm.requests_of("c").pop().expect("c's model was asked");
    assert!(
        last_request
            .messages
            .iter()
            .any(|message| message.content == "c-answer"),
        "c's reloaded history window holds its earlier answer: {:?}",
        contents(&last_request.messages.to_vec())
    );
    RunResult {
        takeover,
        failed_asks,
        record: seen.record(),
    }
}

fn run(seed: u64) -> RunResult {
    let mut runtime = madsim::runtime::Runtime::with_seed_and_config(seed, madsim::Config::default());
    runtime.set_time_limit(Duration::from_secs(RUN_TIME_LIMIT_S));
    runtime.block_on(scenario())
}

/// The scenario of the module docs under each of [`SEEDS`] seeds.
#[test]
fn agents_call_each_other_across_nodes_under_the_call_rules_and_survive_a_node_kill() {
    let (mut fastest, mut slowest) = (Duration::MAX, Duration::ZERO);
    for seed in 1..=SEEDS {
        eprintln!("seed {seed}: running");
        let RunResult {
            takeover, failed_asks, ..
        } = run(seed);
        eprintln!(
            "seed {seed}: c served again {} ms after its node died ({failed_asks} asks failed meanwhile)",
            takeover.as_millis()
        );
        fastest = fastest.min(takeover);
        slowest = slowest.max(takeover);
    }
    eprintln!(
        "over {SEEDS} seeds: c served again {}–{} ms (simulated) after its node died",
        fastest.as_millis(),
        slowest.as_millis()
    );
}

/// Two runs of each of [`REPLAY_SEEDS`] seeds record the same agent events, on the same
/// nodes, at the same simulated times (and different seeds record different runs).
#[test]
fn the_agents_scenario_replays_identically_from_its_seed() {
    let mut records = Vec::new();
    for seed in 1..=REPLAY_SEEDS {
        let first = run(seed).record;
        let second = run(seed).record;
        assert!(!first.is_empty());
        assert_eq!(first, second, "seed {seed} replays identically");
        records.push(first);
    }
    records.dedup();
    eprintln!("{} distinct records over {REPLAY_SEEDS} seeds", records.len());
}
