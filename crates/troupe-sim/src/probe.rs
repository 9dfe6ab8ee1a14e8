//! The probe: a test actor that runs on the real runtime and records what it sees.
//!
//! It keeps a counter and a batch count as its state, writes batches of entries in one
//! turn, sleeps, fails, rejects, and calls other actors through call admission. Every
//! hook and turn records an [`Event`] with the node it runs on and the context it runs
//! under, which is what the invariants check.
//!
//! Calls go through [`AdmissionMode`]: `Real` is the turn's `Caller::admit` followed by
//! `Caller::invoke`, exactly what an agent's `call_agent` does; the other modes are
//! planted bugs for the tests that prove the invariants can fail (they use
//! `troupe_core::admit_call` with one rule broken, then `Caller::invoke_unchecked`,
//! which exists only with the runtime's `planted-bugs` feature).

use std::collections::BTreeMap;
use std::hash::Hasher;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use troupe_core::{admit_call, ActorId, ActorKind, AdmissionRequest, CallAdmitted, CallContext, CallRefused, Deadline};
use troupe_runtime::{Actor, ActorBox, ActorError, ActorFactory, Admitted, Clock, TransportClient, Turn};

use crate::trace::{Event, Trace};

/// The probe kind's name.
const PROBE_KIND: &str = "probe";
/// How long a probe's `on_deactivate` takes, in virtual time.
const PROBE_DEACTIVATION: Duration = Duration::from_millis(1);
/// Prefix of batch entries in a probe's key-value space.
const BATCH_PREFIX: &str = "b/";

/// The port every simulated node's transport server listens on.
pub const TRANSPORT_PORT: u16 = 7_000;

/// The owner of probe `key` among `nodes` nodes (1-based): FNV-1a of the key modulo the
/// node count. The simulation's stand-in for the directory.
pub fn owner_of(key: &str, nodes: u32) -> u32 {
    let mut hasher = fnv::FnvHasher::default();
    hasher.write(key.as_bytes());
    let hash = hasher.finish();
    (hash % u64::from(nodes.max(1))) as u32 + 1
}

/// The transport address of simulated node `node`.
pub fn node_address(node: u32) -> SocketAddr {
    let host = u8::try_from(node).expect("at most 255 nodes");
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, host)), TRANSPORT_PORT)
}

/// Routes a probe's calls: local targets through its own runtime, remote ones through
/// a [`TransportClient`] to their owner (one per peer, created on first use).
pub struct Router {
    node: u32,
    nodes: u32,
    clock: Clock,
    clients: Mutex<BTreeMap<u32, Arc<TransportClient>>>,
}

impl Router {
    /// The router of node `node` of `nodes`, on the runtime clock `clock`.
    pub fn new(node: u32, nodes: u32, clock: Clock) -> Self {
        Self {
            node,
            nodes,
            clock,
            clients: Mutex::new(BTreeMap::new()),
        }
    }

    /// The node hosting `target`: its owner for probes; this node for other kinds.
    pub fn host(&self, target: &ActorId) -> u32 {
        if *target.kind() == probe_kind() {
            owner_of(target.key(), self.nodes)
        } else {
            self.node
        }
    }

    fn client(&self, node: u32) -> Arc<TransportClient> {
        let mut clients = self.clients.lock().unwrap_or_else(PoisonError::into_inner);
        Arc::clone(
            clients
                .entry(node)
                .or_insert_with(|| Arc::new(TransportClient::new(node_address(node), self.clock))),
        )
    }
}

/// The probe kind.
pub fn probe_kind() -> ActorKind {
    ActorKind::new(PROBE_KIND).expect("a valid kind")
}

/// The id of probe `key`.
///
/// # Panics
/// If `key` is not a valid actor key.
pub fn probe(key: &str) -> ActorId {
    ActorId::new(PROBE_KIND, key).expect("a valid probe key")
}

/// How a probe admits its calls to other actors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AdmissionMode {
    /// The real thing: the turn's `Caller::admit`, then `Caller::invoke`.
    #[default]
    Real,
    /// Planted bug: a call refused for a cycle is made anyway (NoCycleInCallChain).
    BugSkipChainCheck,
    /// Planted bug: a call refused for depth is made anyway (DepthBounded).
    BugSkipDepthCheck,
    /// Planted bug: the callee gets a fresh 60 s budget instead of the clipped deadline,
    /// as a context rebuilt on the far side of a network would (DeadlineMonotone,
    /// EveryCallResolves).
    BugDeadlineGrows,
    /// Planted bug: the call is sent as a root invocation, so the dispatcher never sees
    /// the wait-for edge (WaitForGraphAcyclic).
    BugNoWaitForEdge,
}

/// A probe's state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
struct ProbeState {
    count: u64,
    batches: u64,
}

/// What a probe is asked to do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ProbeOp {
    /// Add `amount` to the count; replies with the new count.
    Add {
        /// How much.
        amount: u64,
    },
    /// Reply with the count.
    Get,
    /// Sleep `ms` of virtual time, then do `then`.
    Sleep {
        /// How long.
        ms: u64,
        /// What next.
        then: Box<ProbeOp>,
    },
    /// Write `keys` entries of the next batch and count it, in one turn; with
    /// `fail_after`, fail after buffering that many entries (nothing may stick).
    Batch {
        /// Entries per batch.
        keys: u32,
        /// Fail after this many entries.
        fail_after: Option<u32>,
    },
    /// Scan the batch entries and reply with what is there and the batch count.
    Audit,
    /// After `delay_ms`, call `target` (`kind/key`) with `op`, asking for `timeout_ms`.
    Call {
        /// The callee, `kind/key`.
        target: String,
        /// What to ask it.
        op: Box<ProbeOp>,
        /// The timeout to ask for.
        timeout_ms: u64,
        /// Virtual time to wait before calling.
        delay_ms: u64,
    },
    /// Refuse the request (`ActorError::Rejected`).
    Reject,
    /// Fail the turn after adding 1 (the add must be rolled back).
    Fail,
}

impl ProbeOp {
    /// The operation that finally runs, and the actor (`kind/key`) it runs in if that
    /// is not the first receiver: follows `Call` and `Sleep`.
    pub fn leaf(&self) -> (Option<&str>, &ProbeOp) {
        let mut target = None;
        let mut op = self;
        loop {
            match op {
                ProbeOp::Call {
                    target: next,
                    op: inner,
                    ..
                } => {
                    target = Some(next.as_str());
                    op = inner;
                }
                ProbeOp::Sleep { then, .. } => op = then,
                _ => return (target, op),
            }
        }
    }

    /// A chain of calls through `hops` (probe keys), ending with `leaf` at the last hop.
    pub fn chain(hops: &[&str], leaf: ProbeOp, timeout_ms: u64) -> ProbeOp {
        hops.iter().rev().fold(leaf, |inner, hop| ProbeOp::Call {
            target: format!("{PROBE_KIND}/{hop}"),
            op: Box::new(inner),
            timeout_ms,
            delay_ms: 0,
        })
    }
}

/// A request with the deadline of whoever sent it (trace microseconds), so the callee
/// can check DeadlineMonotone against its own context.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeRequest {
    /// What to do.
    pub op: ProbeOp,
    /// The sender's deadline, as trace time.
    pub parent_deadline_us: u64,
    /// The sender's node (0 for the client node).
    pub sender_node: u32,
}

impl ProbeRequest {
    /// Encodes the request.
    pub fn encode(&self) -> Bytes {
        Bytes::from(bincode::serialize(self).expect("a probe request encodes"))
    }
}

/// Why admission refused a probe's call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RefusalKind {
    /// `CycleDetected`.
    Cycle,
    /// `DepthExceeded`.
    Depth,
    /// `AgentNotFound`.
    NotFound,
    /// `TooManyCalls`.
    TooManyCalls,
    /// `InvalidTimeout`.
    InvalidTimeout,
    /// `DeadlineExpired`.
    DeadlineExpired,
    /// `CallerTurnEnded`.
    CallerTurnEnded,
    /// `ShuttingDown`.
    ShuttingDown,
    /// `RootInvokeInsideTurn`.
    RootInvokeInsideTurn,
}

impl From<&CallRefused> for RefusalKind {
    fn from(refused: &CallRefused) -> Self {
        match refused {
            CallRefused::CycleDetected { .. } => Self::Cycle,
            CallRefused::DepthExceeded { .. } => Self::Depth,
            CallRefused::AgentNotFound { .. } => Self::NotFound,
            CallRefused::TooManyCalls { .. } => Self::TooManyCalls,
            CallRefused::InvalidTimeout { .. } => Self::InvalidTimeout,
            CallRefused::DeadlineExpired => Self::DeadlineExpired,
            CallRefused::CallerTurnEnded { .. } => Self::CallerTurnEnded,
            CallRefused::ShuttingDown => Self::ShuttingDown,
            CallRefused::RootInvokeInsideTurn => Self::RootInvokeInsideTurn,
        }
    }
}

/// What one batch looks like in an audit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct AuditGroup {
    /// The batch number.
    pub batch: u64,
    /// Entries found.
    pub present: u32,
    /// Entries the batch wrote (each entry records it).
    pub expected: u32,
}

/// A probe's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ProbeReply {
    /// The count after the operation.
    Count(u64),
    /// An audit.
    Audit {
        /// The batch count in the state.
        batches: u64,
        /// The entries found, by batch.
        groups: Vec<AuditGroup>,
    },
    /// A call was refused by admission (nothing was sent).
    Refused(RefusalKind),
}

impl ProbeReply {
    /// Decodes a reply.
    ///
    /// # Panics
    /// If `bytes` is not a probe reply (a harness bug).
    pub fn decode(bytes: &[u8]) -> Self {
        bincode::deserialize(bytes).expect("a probe reply decodes")
    }

    fn encode(&self) -> Bytes {
        Bytes::from(bincode::serialize(self).expect("a probe reply encodes"))
    }
}

/// What every probe of one node shares.
#[derive(Clone)]
pub struct ProbeConfig {
    /// The node the probes run on (1-based).
    pub node: u32,
    /// Where they record.
    pub trace: Trace,
    /// How they admit calls.
    pub admission: AdmissionMode,
    /// How they reach other nodes; set once the node's runtime (and its clock) exists.
    pub router: Arc<OnceLock<Router>>,
}

/// Builds probes from their snapshots.
pub struct ProbeFactory {
    config: ProbeConfig,
}

impl ProbeFactory {
    /// A factory for probes configured by `config`.
    pub fn new(config: ProbeConfig) -> Self {
        Self { config }
    }
}

impl ActorFactory for ProbeFactory {
    fn create(&self, id: &ActorId, saved: Option<Bytes>) -> Result<ActorBox, ActorError> {
        let state = match saved {
            Some(bytes) => bincode::deserialize(&bytes).map_err(|error| ActorError::failed(error.to_string()))?,
            None => ProbeState::default(),
        };
        Ok(ActorBox::new(Probe {
            name: id.to_string(),
            state,
            config: self.config.clone(),
        }))
    }
}

struct Probe {
    name: String,
    state: ProbeState,
    config: ProbeConfig,
}

/// Records `WaitEnd` when the wait ends, however it ends (also when the caller's turn
/// is cancelled or its node killed and the future dropped).
struct WaitGuard {
    trace: Trace,
    call: u64,
    outcome: Option<String>,
}

impl Drop for WaitGuard {
    fn drop(&mut self) {
        let outcome = self.outcome.take().unwrap_or_else(|| "abandoned".to_string());
        self.trace.record(Event::WaitEnd {
            call: self.call,
            outcome,
        });
    }
}

/// The CallContext layout, for the forged-deadline planted bug only.
#[derive(Serialize)]
struct ForgedContext {
    depth: u32,
    chain: Vec<ActorId>,
    deadline: Deadline,
    trace_id: Option<troupe_core::TraceId>,
}

impl Probe {
    fn deadline_us(&self, turn: &Turn) -> u64 {
        self.trace_deadline_us(turn.deadline(), turn.now())
    }

    fn context_deadline_us(&self, turn: &Turn, context: &CallContext) -> u64 {
        self.trace_deadline_us(context.deadline(), turn.now())
    }

    /// `deadline` in trace time, `now` being the runtime clock's reading at the trace
    /// clock's now: a deadline already passed is recorded as the instant it was, not as
    /// now. (A local request may start up to a timer tick after its deadline, before its
    /// caller's timer ends the wait; recorded as now, such a turn's deadline looked later
    /// than its caller's, which DeadlineMonotone flagged at seed 276511766, 2026-11-28.)
    fn trace_deadline_us(&self, deadline: Deadline, now: Deadline) -> u64 {
        let clock = self.config.trace.clock();
        match deadline.as_micros().checked_sub(now.as_micros()) {
            Some(ahead) => clock.now_us().saturating_add(ahead),
            None => clock.now_us().saturating_sub(now.as_micros() - deadline.as_micros()),
        }
    }

    /// Admits a call: in the real mode through the turn's caller handle (the admission
    /// every actor gets, returned as well so the call is made with it); in a planted-bug
    /// mode through `admit_call` with that bug's rule broken.
    fn admit(
        &self,
        turn: &Turn,
        target: &ActorId,
        timeout_ms: u64,
    ) -> Result<(CallAdmitted, Option<Admitted>), CallRefused> {
        if self.config.admission == AdmissionMode::Real {
            let real = turn.caller().admit(target, true, Some(timeout_ms))?;
            let admitted = CallAdmitted {
                child: real.child().clone(),
                timeout: real.timeout(),
            };
            return Ok((admitted, Some(real)));
        }
        let request = AdmissionRequest {
            caller: turn.id(),
            context: turn.context(),
            target,
            target_known: turn.caller().is_registered(target.kind()),
            calls_in_flight: 0,
            requested_timeout_ms: Some(timeout_ms),
            now: turn.now(),
        };
        let now = request.now;
        let forced = |context: &CallContext| {
            let child = context.child(
                turn.id().clone(),
                Deadline::after(now, Duration::from_millis(timeout_ms)),
            );
            let timeout = child.deadline().remaining(now);
            CallAdmitted { child, timeout }
        };
        match (self.config.admission, admit_call(request)) {
            (AdmissionMode::BugSkipChainCheck, Err(CallRefused::CycleDetected { .. })) => Ok(forced(turn.context())),
            (AdmissionMode::BugSkipDepthCheck, Err(CallRefused::DepthExceeded { .. })) => Ok(forced(turn.context())),
            (AdmissionMode::BugDeadlineGrows, Ok(admitted)) => {
                let forged = ForgedContext {
                    depth: admitted.child.depth(),
                    chain: admitted.child.chain().to_vec(),
                    deadline: Deadline::after(now, Duration::from_secs(60)),
                    trace_id: admitted.child.trace_id(),
                };
                let bytes = bincode::serialize(&forged).expect("a context encodes");
                let child: CallContext = bincode::deserialize(&bytes).expect("the forged context decodes");
                Ok(CallAdmitted {
                    timeout: child.deadline().remaining(now),
                    child,
                })
            }
            (_, decision) => decision,
        }
        .map(|admitted| (admitted, None))
    }

    async fn call(&self, turn: &Turn, target: &str, op: ProbeOp, timeout_ms: u64) -> Result<ProbeReply, ActorError> {
        let trace = &self.config.trace;
        let (kind, key) = target.split_once('/').unwrap_or((PROBE_KIND, target));
        let target = ActorId::new(kind, key).map_err(|error| ActorError::failed(error.to_string()))?;
        let (admitted, real_admission) = match self.admit(turn, &target, timeout_ms) {
            Ok(admitted) => admitted,
            Err(refused) => {
                let reason = RefusalKind::from(&refused);
                trace.record(Event::CallRefused {
                    caller: self.name.clone(),
                    target: target.to_string(),
                    reason,
                });
                return Ok(ProbeReply::Refused(reason));
            }
        };
        let call = trace.next_id();
        let deadline_us = self.context_deadline_us(turn, &admitted.child);
        let parent_deadline_us = self.deadline_us(turn);
        trace.record(Event::CallAdmitted {
            call,
            caller: self.name.clone(),
            target: target.to_string(),
            depth: admitted.child.depth(),
            chain: admitted.child.chain().iter().map(ToString::to_string).collect(),
            deadline_us,
            parent_deadline_us,
        });
        let payload = ProbeRequest {
            op,
            parent_deadline_us: deadline_us,
            sender_node: self.config.node,
        }
        .encode();
        let router = self
            .config
            .router
            .get()
            .expect("the router is set before any turn runs");
        let host = router.host(&target);
        trace.record(Event::WaitBegin {
            call,
            caller: self.name.clone(),
            target: target.to_string(),
            host,
        });
        let mut guard = WaitGuard {
            trace: trace.clone(),
            call,
            outcome: None,
        };
        let result = match self.config.admission {
            _ if host != router.node => {
                let client = router.client(host);
                let (context, caller) = match self.config.admission {
                    AdmissionMode::BugNoWaitForEdge => (CallContext::root(admitted.child.deadline()), None),
                    _ => (admitted.child, Some(turn.id())),
                };
                client.invoke(&target, payload, context, caller).await
            }
            AdmissionMode::BugNoWaitForEdge => {
                let timeout = admitted.child.deadline().remaining(turn.now());
                turn.caller().invoke_as_root(&target, payload, timeout).await
            }
            AdmissionMode::BugDeadlineGrows | AdmissionMode::BugSkipChainCheck | AdmissionMode::BugSkipDepthCheck => {
                turn.caller().invoke_unchecked(&target, payload, admitted.child).await
            }
            AdmissionMode::Real => match real_admission {
                Some(real) => turn.caller().invoke(real, payload).await,
                None => unreachable!("the real admission mode admits through the caller handle"),
            },
        };
        guard.outcome = Some(match &result {
            Ok(_) => "ok".to_string(),
            Err(error) => format!("{error:?}"),
        });
        drop(guard);
        Ok(ProbeReply::decode(&result?))
    }

    fn run<'a>(
        &'a mut self,
        turn: &'a mut Turn,
        op: ProbeOp,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<ProbeReply, ActorError>> + Send + 'a>> {
        Box::pin(async move {
            match op {
                ProbeOp::Add { amount } => {
                    self.state.count += amount;
                    Ok(ProbeReply::Count(self.state.count))
                }
                ProbeOp::Get => Ok(ProbeReply::Count(self.state.count)),
                ProbeOp::Sleep { ms, then } => {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    self.run(turn, *then).await
                }
                ProbeOp::Batch { keys, fail_after } => {
                    let batch = self.state.batches;
                    for index in 0..keys {
                        if fail_after == Some(index) {
                            return Err(ActorError::failed("planned failure in the middle of a batch"));
                        }
                        let key = format!("{BATCH_PREFIX}{batch:010}/{index:04}");
                        turn.put(key, Bytes::from(keys.to_le_bytes().to_vec()))?;
                    }
                    self.state.batches += 1;
                    Ok(ProbeReply::Count(self.state.batches))
                }
                ProbeOp::Audit => {
                    let entries = turn.scan(BATCH_PREFIX, None, usize::MAX).await?;
                    let mut groups: BTreeMap<u64, AuditGroup> = BTreeMap::new();
                    for (key, value) in entries {
                        let batch = key[BATCH_PREFIX.len()..]
                            .split('/')
                            .next()
                            .and_then(|digits| digits.parse::<u64>().ok())
                            .unwrap_or(u64::MAX);
                        let expected = value
                            .get(..4)
                            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                            .unwrap_or(0);
                        let group = groups.entry(batch).or_insert(AuditGroup {
                            batch,
                            present: 0,
                            expected,
                        });
                        group.present += 1;
                    }
                    Ok(ProbeReply::Audit {
                        batches: self.state.batches,
                        groups: groups.into_values().collect(),
                    })
                }
                ProbeOp::Call {
                    target,
                    op,
                    timeout_ms,
                    delay_ms,
                } => {
                    if delay_ms > 0 {
                        tokio::time::sleep(Duration::from_millis(delay_ms)).await;
                    }
                    self.call(turn, &target, *op, timeout_ms).await
                }
                ProbeOp::Reject => Err(ActorError::rejected("the probe was told to reject")),
                ProbeOp::Fail => {
                    self.state.count += 1;
                    Err(ActorError::failed("the probe was told to fail"))
                }
            }
        })
    }
}

impl Actor for Probe {
    async fn on_activate(&mut self, _id: &ActorId) -> Result<(), ActorError> {
        self.config.trace.record(Event::Activated {
            node: self.config.node,
            actor: self.name.clone(),
            count: self.state.count,
        });
        Ok(())
    }

    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        let request: ProbeRequest =
            bincode::deserialize(&payload).map_err(|error| ActorError::failed(error.to_string()))?;
        let context = turn.context();
        self.config.trace.record(Event::TurnStarted {
            node: self.config.node,
            actor: self.name.clone(),
            depth: context.depth(),
            chain: context.chain().iter().map(ToString::to_string).collect(),
            deadline_us: self.deadline_us(turn),
            parent_deadline_us: request.parent_deadline_us,
            remote: request.sender_node != self.config.node,
        });
        let result = self.run(turn, request.op).await;
        self.config.trace.record(Event::TurnEnded {
            node: self.config.node,
            actor: self.name.clone(),
            ok: result.is_ok(),
        });
        result.map(|reply| reply.encode())
    }

    async fn on_deactivate(&mut self, _id: &ActorId) -> Result<(), ActorError> {
        // Deactivation takes time (an actor may flush or say goodbye); the activation is
        // live until it ends, which is when it is recorded. This widens the window in
        // which a second activation would overlap (SingleActivation).
        tokio::time::sleep(PROBE_DEACTIVATION).await;
        self.config.trace.record(Event::Deactivated {
            node: self.config.node,
            actor: self.name.clone(),
            count: self.state.count,
        });
        Ok(())
    }

    fn snapshot(&self) -> Result<Option<Bytes>, ActorError> {
        Ok(Some(Bytes::from(
            bincode::serialize(&self.state).expect("a probe state encodes"),
        )))
    }
}
