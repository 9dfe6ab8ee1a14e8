//! The harness: one simulated run of one scenario, in phases, with invariants checked
//! after every event and a replay command printed on any failure.
//!
//! ```text
//! Sim::start ─► phase("safety"): workload + faults, check() after each step
//!            ─► heal() ─► phase("liveness"): drain every pending request; no faults
//!            ─► finish(): end-of-run checks (nothing pending), trace hash + report
//! ```

use std::time::Duration;

use madsim::net::NetSim;
use troupe_agent::{agent_id, AgentReply, AgentRequest, Budget, ChatMessage, Role};
use troupe_core::InvokeError;
use troupe_runtime::KindConfig;

use crate::agents::{AgentSetup, LlmFaults, ToolFaults, AGENT_NODE};
use crate::cluster::{ClientMode, ClusterConfig, Disk, NodeId, Placement, SimCluster};
use crate::faults::Fault;
use crate::invariants::{Invariants, Violation};
use crate::probe::{probe, AdmissionMode, ProbeOp, ProbeReply, ProbeRequest};
use crate::replay::{self, replay_command, Running, Scenario};
use crate::rng::SimRng;
use crate::stores::StoreMode;
use crate::trace::{Event, Trace};

/// What a request came back with.
pub type Outcome = Result<ProbeReply, InvokeError>;

/// What an agent request came back with.
pub type AgentOutcome = Result<AgentReply, InvokeError>;

/// The first observer call id of a client's budgeted ask (`SimClient::ask_with_budget`):
/// far above the ids an agent system hands out (one per call, from 1), so they never meet.
pub const ROOT_CALL_ID_BASE: u64 = 1 << 48;

/// How a simulated deployment is built.
#[derive(Debug, Clone, Copy)]
pub struct SimConfig {
    /// Server nodes.
    pub nodes: u32,
    /// Per-node or shared disk.
    pub disk: Disk,
    /// When commits are acknowledged (and the planted storage bugs).
    pub store: StoreMode,
    /// How probes admit calls (and the planted admission bugs).
    pub admission: AdmissionMode,
    /// Which node hosts an actor (and the planted split brain).
    pub placement: Placement,
    /// How clients treat failures (and the planted retry bug).
    pub client: ClientMode,
    /// The probe kind's mailbox capacity, in messages.
    pub mailbox_capacity: usize,
    /// The probe kind's idle timeout: short, so activations churn.
    pub idle_timeout: Duration,
    /// For planted-bug tests: the invariant expected to be violated. Violations then do
    /// not fail the run; [`Sim::finish`] asserts that this one was found.
    pub expect_violation: Option<&'static str>,
    /// Planted bug: turns ignore that their caller gave up and commit anyway
    /// (NoCommitAfterAbandon).
    pub plant_commit_after_abandon: bool,
    /// Planted bug: a turn whose handler failed commits anyway. No DST invariant flags
    /// it; trace validation does (`scripts/trace-check`).
    pub plant_commit_failed_turn: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            nodes: 1,
            disk: Disk::PerNode,
            store: StoreMode::Durable,
            admission: AdmissionMode::Real,
            placement: Placement::Owner,
            client: ClientMode::Honest,
            mailbox_capacity: 8,
            idle_timeout: Duration::from_millis(20),
            expect_violation: None,
            plant_commit_after_abandon: false,
            plant_commit_failed_turn: false,
        }
    }
}

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct Report {
    /// The scenario.
    pub scenario: Scenario,
    /// madsim's seed.
    pub seed: u64,
    /// The hash of the whole trace.
    pub trace_hash: u64,
    /// Events recorded.
    pub events: usize,
    /// Virtual time simulated, in microseconds.
    pub virtual_us: u64,
    /// Violations found (empty unless a planted bug was expected).
    pub violations: Vec<Violation>,
    /// Tolerated known-issue violations, by invariant.
    pub tolerated: Vec<(&'static str, u64)>,
}

/// The client side: sends requests to the cluster and records what it was told.
/// Cheap to clone into spawned tasks.
#[derive(Clone)]
pub struct SimClient {
    cluster: SimCluster,
    trace: Trace,
    mode: ClientMode,
}

impl SimClient {
    fn route(&self, key: &str) -> NodeId {
        match self.cluster.placement() {
            Placement::Owner => self.cluster.owner(key),
            Placement::BugSplitBrain => SimRng::new().range(1, u64::from(self.cluster.len()) + 1) as NodeId,
        }
    }

    /// Sends `op` to probe `key` with `timeout` from the client node and records the
    /// request, its outcome and what the reference model needs (adds, gets, audits).
    pub async fn request(&self, key: &str, op: ProbeOp, timeout: Duration) -> Outcome {
        let client = self.clone();
        let key = key.to_string();
        self.cluster
            .spawn_on_client(async move { client.request_here(&key, op, timeout).await })
            .await
            .expect("a client request task never panics")
    }

    /// Sends `text` to agent `agent` from the client node over the transport, as a
    /// client from outside (depth 0); records the request and, if answered, the ack.
    pub async fn ask(&self, agent: &str, text: &str, timeout: Duration) -> AgentOutcome {
        let client = self.clone();
        let (agent, text) = (agent.to_string(), text.to_string());
        self.cluster
            .spawn_on_client(async move { client.ask_here(&agent, &text, timeout, None).await })
            .await
            .expect("a client request task never panics")
    }

    /// [`SimClient::ask`] under `budget`. The request's observer call id is
    /// [`ROOT_CALL_ID_BASE`] plus its trace request id, so the agent events of its whole
    /// call tree (`CallStarted::parent`, `ModelResponded::call`) lead back to it.
    pub async fn ask_with_budget(&self, agent: &str, text: &str, timeout: Duration, budget: Budget) -> AgentOutcome {
        let client = self.clone();
        let (agent, text) = (agent.to_string(), text.to_string());
        self.cluster
            .spawn_on_client(async move { client.ask_here(&agent, &text, timeout, Some(budget)).await })
            .await
            .expect("a client request task never panics")
    }

    async fn ask_here(&self, agent: &str, text: &str, timeout: Duration, budget: Option<Budget>) -> AgentOutcome {
        let trace = &self.trace;
        let target = agent_id(agent).expect("a valid agent id");
        let request = trace.next_id();
        trace.record(Event::RequestSent {
            request,
            target: target.to_string(),
            deadline_us: trace.clock().after_us(timeout),
        });
        let payload = AgentRequest {
            text: text.to_string(),
            from: None,
            call: budget.map(|_| ROOT_CALL_ID_BASE + request),
            budget: budget.unwrap_or(Budget::UNLIMITED),
        }
        .encode();
        let outcome = self
            .cluster
            .invoke(AGENT_NODE, &target, payload, timeout)
            .await
            .map(|bytes| AgentReply::decode(&bytes).expect("an agent reply decodes"));
        // A reply whose budget ran out answered nothing and committed nothing.
        if matches!(&outcome, Ok(reply) if reply.exhausted.is_none()) {
            trace.record(Event::AgentAcked {
                agent: target.to_string(),
                text: text.to_string(),
            });
        }
        let described = match &outcome {
            Ok(reply) => format!("ok {:?}", reply.text),
            Err(error) => format!("error {error:?}"),
        };
        trace.record(Event::RequestResolved {
            request,
            outcome: described,
        });
        outcome
    }

    async fn request_here(&self, key: &str, op: ProbeOp, timeout: Duration) -> Outcome {
        let trace = &self.trace;
        let actor = probe(key);
        let name = actor.to_string();
        let request = trace.next_id();
        let deadline_us = trace.clock().after_us(timeout);
        trace.record(Event::RequestSent {
            request,
            target: name.clone(),
            deadline_us,
        });
        let (leaf_target, leaf) = op.leaf();
        let leaf_actor = leaf_target.map_or_else(|| name.clone(), str::to_string);
        match leaf {
            ProbeOp::Add { amount } => {
                trace.record(Event::AddSent {
                    request,
                    actor: leaf_actor.clone(),
                    amount: *amount,
                });
            }
            ProbeOp::Get => trace.record(Event::GetSent {
                request,
                actor: leaf_actor.clone(),
            }),
            _ => {}
        }
        let payload = ProbeRequest {
            op: op.clone(),
            parent_deadline_us: deadline_us,
            sender_node: 0,
        }
        .encode();
        let mut attempt_timeout = timeout;
        let outcome = loop {
            let node = self.route(key);
            let result = self
                .cluster
                .invoke(node, &actor, payload.clone(), attempt_timeout)
                .await;
            match (self.mode, result) {
                (ClientMode::BugRetryIgnoresDeadline, Err(error)) if error.is_transient() => {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    attempt_timeout = timeout;
                }
                (_, result) => break result.map(|bytes| ProbeReply::decode(&bytes)),
            }
        };
        match (leaf, &outcome) {
            (ProbeOp::Add { .. }, Ok(ProbeReply::Count(value))) => {
                trace.record(Event::AddAcked {
                    request,
                    actor: leaf_actor.clone(),
                    value: *value,
                });
            }
            (ProbeOp::Get, Ok(ProbeReply::Count(value))) => {
                trace.record(Event::GetReplied {
                    request,
                    actor: leaf_actor.clone(),
                    value: *value,
                });
            }
            (ProbeOp::Audit, Ok(ProbeReply::Audit { batches, groups })) => {
                trace.record(Event::Audited {
                    actor: leaf_actor.clone(),
                    batches: *batches,
                    groups: groups.clone(),
                });
            }
            _ => {}
        }
        let described = match &outcome {
            Ok(reply) => format!("ok {reply:?}"),
            Err(error) => format!("error {error:?}"),
        };
        trace.record(Event::RequestResolved {
            request,
            outcome: described,
        });
        outcome
    }
}

/// One simulated run. See the module documentation.
pub struct Sim {
    scenario: Scenario,
    seed: u64,
    config: SimConfig,
    trace: Trace,
    cluster: SimCluster,
    client: SimClient,
    pending: Vec<tokio::task::JoinHandle<Outcome>>,
    pending_asks: Vec<tokio::task::JoinHandle<AgentOutcome>>,
    llm_faults: LlmFaults,
    tool_faults: ToolFaults,
    longest_timeout: Duration,
    finished: bool,
}

/// How long the liveness phase waits past the longest request timeout before it
/// declares the pending requests hung.
const LIVENESS_GRACE: Duration = Duration::from_secs(1);

impl Sim {
    /// Builds the deployment for `scenario` under the current madsim seed.
    ///
    /// # Panics
    /// Outside the simulator ([`crate::require_simulator`]).
    pub async fn start(scenario: Scenario, config: SimConfig) -> Self {
        Self::start_with(scenario, config, None).await
    }

    /// Builds the deployment for `scenario` with real agents on node 1, built from
    /// `agents` (see [`AgentSetup`]).
    ///
    /// # Panics
    /// Outside the simulator ([`crate::require_simulator`]).
    pub async fn start_with_agents(scenario: Scenario, config: SimConfig, agents: AgentSetup) -> Self {
        Self::start_with(scenario, config, Some(agents)).await
    }

    async fn start_with(scenario: Scenario, config: SimConfig, agents: Option<AgentSetup>) -> Self {
        crate::require_simulator();
        let seed = madsim::runtime::Handle::current().seed();
        let trace = Trace::new(Invariants::all());
        let described = trace.clone();
        replay::register(Running {
            scenario,
            seed,
            describe: Box::new(move || {
                let violations: Vec<String> = described.violations().iter().map(ToString::to_string).collect();
                format!(
                    "trace hash {:016x} after {} events\nviolations:\n  {}\nlast events:\n{}",
                    described.hash(),
                    described.len(),
                    if violations.is_empty() {
                        "(none)".to_string()
                    } else {
                        violations.join("\n  ")
                    },
                    described.tail()
                )
            }),
        });
        trace.record(Event::Phase { name: "setup" });
        let kind = KindConfig::default()
            .with_mailbox_capacity(config.mailbox_capacity)
            .with_idle_timeout(config.idle_timeout);
        let llm_faults = LlmFaults::default();
        let tool_faults = agents
            .as_ref()
            .map(|setup| setup.tool_faults.clone())
            .unwrap_or_default();
        let cluster = SimCluster::start(
            ClusterConfig {
                nodes: config.nodes,
                disk: config.disk,
                store: config.store,
                admission: config.admission,
                placement: config.placement,
                plant_commit_after_abandon: config.plant_commit_after_abandon,
                plant_commit_failed_turn: config.plant_commit_failed_turn,
                kind,
                agents,
                llm_faults: llm_faults.clone(),
            },
            trace.clone(),
        )
        .await;
        let client = SimClient {
            cluster: cluster.clone(),
            trace: trace.clone(),
            mode: config.client,
        };
        let mut longest = Duration::ZERO;
        NetSim::current().update_config(|net| longest = net.send_latency.end);
        trace.record(Event::LinkLatencyMax {
            us: u64::try_from(longest.as_micros()).unwrap_or(u64::MAX),
        });
        Self {
            scenario,
            seed,
            config,
            trace,
            cluster,
            client,
            pending: Vec::new(),
            pending_asks: Vec::new(),
            llm_faults,
            tool_faults,
            longest_timeout: Duration::ZERO,
            finished: false,
        }
    }

    /// The seed of this run.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The run's random generator (madsim's, seeded by the run's seed).
    pub fn rng(&self) -> SimRng {
        SimRng::new()
    }

    /// The trace.
    pub fn trace(&self) -> &Trace {
        &self.trace
    }

    /// The deployment.
    pub fn cluster(&self) -> &SimCluster {
        &self.cluster
    }

    /// A client handle for spawned tasks.
    pub fn client(&self) -> SimClient {
        self.client.clone()
    }

    /// Enters a phase.
    pub fn phase(&self, name: &'static str) {
        self.trace.record(Event::Phase { name });
        self.check();
    }

    /// Sends a request and waits for its outcome; checks the invariants after it.
    pub async fn request(&mut self, key: &str, op: ProbeOp, timeout: Duration) -> Outcome {
        self.longest_timeout = self.longest_timeout.max(timeout);
        let outcome = self.client.request(key, op, timeout).await;
        self.check();
        outcome
    }

    /// Sends a request in the background; [`Sim::drain`] waits for it.
    pub fn spawn_request(&mut self, key: &str, op: ProbeOp, timeout: Duration) {
        self.longest_timeout = self.longest_timeout.max(timeout);
        let client = self.client.clone();
        let key = key.to_string();
        self.pending
            .push(tokio::spawn(async move { client.request(&key, op, timeout).await }));
    }

    /// Asks agent `agent` and waits for the answer; checks the invariants after it.
    pub async fn ask(&mut self, agent: &str, text: &str, timeout: Duration) -> AgentOutcome {
        self.longest_timeout = self.longest_timeout.max(timeout);
        let outcome = self.client.ask(agent, text, timeout).await;
        self.check();
        outcome
    }

    /// Asks agent `agent` under `budget` in the background (see
    /// [`SimClient::ask_with_budget`]); [`Sim::drain_asks`] waits for it.
    pub fn spawn_ask_with_budget(&mut self, agent: &str, text: &str, timeout: Duration, budget: Budget) {
        self.longest_timeout = self.longest_timeout.max(timeout);
        let client = self.client.clone();
        let (agent, text) = (agent.to_string(), text.to_string());
        self.pending_asks.push(tokio::spawn(async move {
            client.ask_with_budget(&agent, &text, timeout, budget).await
        }));
    }

    /// Asks agent `agent` in the background; [`Sim::drain_asks`] waits for it.
    pub fn spawn_ask(&mut self, agent: &str, text: &str, timeout: Duration) {
        self.longest_timeout = self.longest_timeout.max(timeout);
        let client = self.client.clone();
        let (agent, text) = (agent.to_string(), text.to_string());
        self.pending_asks
            .push(tokio::spawn(async move { client.ask(&agent, &text, timeout).await }));
    }

    /// Waits for every background ask (as [`Sim::drain`] does for requests).
    pub async fn drain_asks(&mut self) -> Vec<AgentOutcome> {
        let bound = self.longest_timeout + LIVENESS_GRACE;
        let started = tokio::time::Instant::now();
        let mut outcomes = Vec::new();
        for task in std::mem::take(&mut self.pending_asks) {
            let left = bound.saturating_sub(started.elapsed());
            match tokio::time::timeout(left, task).await {
                Ok(Ok(outcome)) => outcomes.push(outcome),
                Ok(Err(join_error)) => panic!("an ask task failed: {join_error}"),
                Err(_) => {}
            }
        }
        self.check();
        outcomes
    }

    /// Reads each agent's committed conversation log through the live agent system and
    /// records its user messages (NoAckedStateLost checks every acknowledged message is
    /// there). Retries while the node or its storage is down.
    pub async fn read_agent_logs(&mut self, agents: &[&str]) {
        for agent in agents {
            for attempt in 0..20 {
                let log = match self.cluster.agent_client() {
                    Some(client) => client.conversation_log(agent).await.ok(),
                    None => None,
                };
                if let Some(log) = log {
                    let user_texts = log
                        .iter()
                        .filter(|message: &&ChatMessage| message.role == Role::User)
                        .map(|message| message.content.clone())
                        .collect();
                    let agent = agent_id(agent).expect("a valid agent id").to_string();
                    self.trace.record(Event::AgentLogRead { agent, user_texts });
                    break;
                }
                assert!(attempt < 19, "the log of agent {agent} could not be read after healing");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        self.check();
    }

    /// The model fault switches.
    pub fn llm_faults(&self) -> &LlmFaults {
        &self.llm_faults
    }

    /// The tool fault switches.
    pub fn tool_faults(&self) -> &ToolFaults {
        &self.tool_faults
    }

    /// Waits until work the server side may still run for requests already resolved at
    /// the client has finished: the longest timeout used so far, plus one transit.
    pub async fn quiesce(&self) {
        self.advance(self.longest_timeout + Duration::from_millis(100)).await;
    }

    /// Lets `duration` of virtual time pass, then checks the invariants.
    pub async fn advance(&self, duration: Duration) {
        tokio::time::sleep(duration).await;
        self.check();
    }

    /// Injects `fault`.
    pub async fn inject(&self, fault: Fault) {
        self.trace.record(Event::FaultInjected {
            fault: fault.to_string(),
        });
        match fault {
            Fault::KillNode(node) => self.cluster.kill(node, false),
            Fault::CrashNode(node) => self.cluster.kill(node, true),
            Fault::RestartNode(node) => self.cluster.restart(node).await,
            Fault::FailCommits { node, count } => self.cluster.disk(node).faults().fail_next_commits(count),
            Fault::FailLoads { node, count } => self.cluster.disk(node).faults().fail_next_loads(count),
            Fault::FailReads { node, count } => self.cluster.disk(node).faults().fail_next_reads(count),
            Fault::FailStorage(node) => self.cluster.disk(node).faults().fail_all(),
            Fault::Partition(a, b) => {
                let (a, b) = (self.cluster.network_id(a), self.cluster.network_id(b));
                NetSim::current().clog_link(a, b);
                NetSim::current().clog_link(b, a);
            }
            Fault::OneWay { from, to } => {
                NetSim::current().clog_link(self.cluster.network_id(from), self.cluster.network_id(to));
            }
            Fault::Isolate(node) => NetSim::current().clog_node(self.cluster.network_id(node)),
            Fault::Latency { min_ms, max_ms } => {
                NetSim::current().update_config(|config| {
                    config.send_latency = Duration::from_millis(min_ms)..Duration::from_millis(max_ms.max(min_ms + 1));
                });
                self.record_latency();
            }
            Fault::PacketLoss { percent } => NetSim::current().update_config(|config| {
                config.packet_loss_rate = f64::from(percent) / 100.0;
            }),
            Fault::LlmLatency { ms } => self.llm_faults.set_latency(Duration::from_millis(ms)),
            Fault::LlmFail { count } => self.llm_faults.fail_next(count),
            Fault::ToolFail { count } => self.tool_faults.fail_next(count),
        }
        self.check();
    }

    /// Heals the network only (links, latency, loss), in the middle of a phase.
    pub fn heal_network_now(&self) {
        self.trace.record(Event::FaultInjected {
            fault: "heal the network".to_string(),
        });
        self.heal_network();
        self.check();
    }

    fn heal_network(&self) {
        let net = NetSim::current();
        let ids: Vec<_> = (0..=self.cluster.len())
            .map(|node| self.cluster.network_id(node))
            .collect();
        for a in &ids {
            net.unclog_node(*a);
            for b in &ids {
                net.unclog_link(*a, *b);
            }
        }
        net.update_config(|config| *config = madsim::net::Config::default());
        self.record_latency();
    }

    /// Tells the trace the network's longest one-way latency: a record of the network's
    /// configuration for failure reports. (DeadlineMonotone no longer uses it: remote
    /// deadlines are absolute since the transport's clock handshake, so no transit is
    /// allowed.)
    fn record_latency(&self) {
        let mut longest = Duration::ZERO;
        NetSim::current().update_config(|config| longest = config.send_latency.end);
        let us = u64::try_from(longest.as_micros()).unwrap_or(u64::MAX);
        self.trace.record(Event::LinkLatencyMax { us });
    }

    /// Heals every fault: links reconnect, latency and loss return to madsim's
    /// defaults, storage failures stop, killed nodes restart.
    pub async fn heal(&self) {
        self.heal_network();
        self.llm_faults.heal();
        self.tool_faults.heal();
        for node in 1..=self.cluster.len() {
            self.cluster.disk(node).faults().heal();
            if !self.cluster.is_alive(node) {
                self.cluster.restart(node).await;
            }
        }
        self.trace.record(Event::FaultsHealed);
        self.check();
    }

    /// Waits for every background request. Each must resolve by its deadline; one that
    /// has not resolved `LIVENESS_GRACE` after the longest timeout is left pending, and
    /// [`Sim::finish`] reports it as a hang (EveryCallResolves).
    pub async fn drain(&mut self) -> Vec<Outcome> {
        let bound = self.longest_timeout + LIVENESS_GRACE;
        let started = tokio::time::Instant::now();
        let mut outcomes = Vec::new();
        for task in std::mem::take(&mut self.pending) {
            let left = bound.saturating_sub(started.elapsed());
            match tokio::time::timeout(left, task).await {
                Ok(Ok(outcome)) => outcomes.push(outcome),
                Ok(Err(join_error)) => panic!("a request task failed: {join_error}"),
                Err(_) => {}
            }
        }
        self.check();
        outcomes
    }

    /// Sends `op` to `key` until it succeeds (at most `attempts` times, 50 ms apart):
    /// after a heal, links come back only when madsim's TCP retransmission backoff
    /// expires, as real TCP's would.
    pub async fn request_until_ok(&mut self, key: &str, op: ProbeOp, timeout: Duration, attempts: u32) -> Outcome {
        let mut outcome = self.request(key, op.clone(), timeout).await;
        for _ in 1..attempts {
            if outcome.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            outcome = self.request(key, op.clone(), timeout).await;
        }
        outcome
    }

    /// Audits every probe in `keys` through the runtime (TurnWritesAtomic), retrying
    /// transient failures until one audit of each succeeds.
    pub async fn audit(&mut self, keys: &[&str]) {
        for key in keys {
            for _ in 0..20 {
                if self.request(key, ProbeOp::Audit, Duration::from_secs(2)).await.is_ok() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    /// Reads every probe in `keys` through the runtime (NoAckedStateLost compares each
    /// read with the acknowledged floor), retrying transient failures.
    pub async fn read_back(&mut self, keys: &[&str]) -> Vec<u64> {
        let mut values = Vec::new();
        for key in keys {
            for attempt in 0..20 {
                match self.request(key, ProbeOp::Get, Duration::from_secs(2)).await {
                    Ok(ProbeReply::Count(value)) => {
                        values.push(value);
                        break;
                    }
                    outcome => {
                        assert!(attempt < 19, "probe {key} could not be read after healing: {outcome:?}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        }
        values
    }

    /// The violations found so far.
    pub fn violations(&self) -> Vec<Violation> {
        self.trace.violations()
    }

    /// Fails the run (with its replay command) if any invariant is violated, unless a
    /// planted bug is expected.
    ///
    /// # Panics
    /// On the first violation.
    pub fn check(&self) {
        if self.config.expect_violation.is_some() {
            return;
        }
        if let Some(first) = self.trace.violations().first() {
            panic!("invariant violated: {first}");
        }
    }

    /// Ends the run: end-of-run checks (nothing pending), the final verdict, and the
    /// report line with the trace hash (also appended to `$TROUPE_DST_REPORT`).
    ///
    /// # Panics
    /// If an invariant is violated; in a planted-bug run, if the expected invariant was
    /// *not* violated.
    pub async fn finish(mut self) -> Report {
        // Liveness: wait out every deadline still running, so whatever is pending now
        // is a hang, not work in progress.
        self.quiesce().await;
        self.trace.record(Event::Phase { name: "finish" });
        self.trace.finish();
        self.finished = true;
        // Before the verdict, so that a failing run's trace is written too.
        if let Err(error) = self.write_trace_file() {
            panic!("{error}");
        }
        let report = Report {
            scenario: self.scenario,
            seed: self.seed,
            trace_hash: self.trace.hash(),
            events: self.trace.len(),
            virtual_us: self.trace.clock().now_us(),
            violations: self.trace.violations(),
            tolerated: self.trace.tolerated(),
        };
        let verdict = match self.config.expect_violation {
            None => {
                self.check();
                "ok".to_string()
            }
            Some(expected) => {
                let caught = report.violations.iter().find(|v| v.invariant == expected);
                match caught {
                    Some(violation) => format!("caught planted bug: {violation}"),
                    None => panic!(
                        "the planted bug was NOT caught: expected a {expected} violation, found {:?}",
                        report.violations
                    ),
                }
            }
        };
        let tolerated: Vec<String> = report
            .tolerated
            .iter()
            .map(|(name, count)| format!("{name}:{count}"))
            .collect();
        let line = format!(
            "dst scenario={}::{} seed={} trace_hash={:016x} events={} virtual_ms={:.3} known_issues={} verdict={}",
            self.scenario.test,
            self.scenario.name,
            self.seed,
            report.trace_hash,
            report.events,
            report.virtual_us as f64 / 1000.0,
            if tolerated.is_empty() {
                "none".to_string()
            } else {
                tolerated.join(",")
            },
            verdict
        );
        println!("{line}");
        if let Ok(path) = std::env::var("TROUPE_DST_REPORT") {
            use std::io::Write;
            if let Ok(mut file) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
                let _ = writeln!(file, "{line}");
            }
        }
        replay::unregister();
        report
    }

    /// With `TROUPE_TRACE_OUT=DIR` set, writes the whole trace to
    /// `DIR/<test>__<scenario>__<seed>.ndjson` (see [`Trace::write_ndjson`]) for trace
    /// validation against the TLA+ model (`scripts/trace-check`); a run that fails
    /// writes what it recorded up to the failure (from `Drop`). Nothing when unset.
    fn write_trace_file(&self) -> Result<(), String> {
        let Some(dir) = std::env::var_os("TROUPE_TRACE_OUT") else {
            return Ok(());
        };
        let dir = std::path::PathBuf::from(dir);
        let path = dir.join(format!(
            "{}__{}__{}.ndjson",
            self.scenario.test, self.scenario.name, self.seed
        ));
        std::fs::create_dir_all(&dir)
            .and_then(|()| self.trace.write_ndjson(&path))
            .map_err(|error| format!("could not write the trace to {}: {error}", path.display()))
    }

    /// The replay command of this run.
    pub fn replay_command(&self) -> String {
        replay_command(self.scenario, self.seed)
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        if !self.finished {
            // Unwinding from a failure (the hook has printed the replay command), or a
            // scenario that forgot finish(): either way this run is over. Its trace so
            // far is written if asked for; an error is ignored (no panic while unwinding).
            let _ = self.write_trace_file();
            replay::unregister();
        }
    }
}
