//! The trace: every observable event of a simulated run, stamped with virtual time,
//! hashed as it is recorded, and fed to the invariants at once.
//!
//! The hash (FNV-1a 64, the `fnv` crate, over each event and its time) is what the determinism test
//! compares between two runs of one seed, and what every report prints with the seed.

use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use fnv::FnvHasher;

use crate::invariants::{Invariants, Violation};
use crate::probe::{AuditGroup, RefusalKind};

/// Reads virtual time (madsim's clock under `--cfg madsim`) relative to the start of
/// the run, in microseconds. One clock for every node: madsim's time is global.
#[derive(Debug, Clone, Copy)]
pub struct TraceClock {
    epoch: tokio::time::Instant,
}

impl TraceClock {
    /// A clock whose zero is now.
    pub fn new() -> Self {
        Self {
            epoch: tokio::time::Instant::now(),
        }
    }

    /// Microseconds since the clock's zero.
    pub fn now_us(&self) -> u64 {
        u64::try_from(
            tokio::time::Instant::now()
                .saturating_duration_since(self.epoch)
                .as_micros(),
        )
        .unwrap_or(u64::MAX)
    }

    /// The trace time `remaining` from now.
    pub fn after_us(&self, remaining: std::time::Duration) -> u64 {
        self.now_us()
            .saturating_add(u64::try_from(remaining.as_micros()).unwrap_or(u64::MAX))
    }
}

impl Default for TraceClock {
    fn default() -> Self {
        Self::new()
    }
}

/// Something that happened in a simulated run. Actors are named by their full id
/// (`probe/a`); nodes by number (1-based). Times are trace microseconds.
///
/// Serialized (for [`Trace::write_ndjson`]) as one flat JSON object tagged by `kind`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(tag = "kind")]
pub enum Event {
    /// The harness entered a phase (`setup`, `safety`, `liveness`, `check`).
    Phase {
        /// The phase.
        name: &'static str,
    },
    /// A node's runtime started (first start or restart).
    NodeStarted {
        /// The node.
        node: u32,
    },
    /// A node was killed: every task on it died, its memory is gone.
    NodeKilled {
        /// The node.
        node: u32,
    },
    /// A node's disk lost what it had not flushed.
    DiskCrashed {
        /// The node whose disk crashed (0 for the shared disk).
        node: u32,
    },
    /// A fault was injected.
    FaultInjected {
        /// What, in words.
        fault: String,
    },
    /// Every fault was healed.
    FaultsHealed,
    /// A caller on `node`'s runtime stopped waiting for `request` before its reply
    /// (`RuntimeEvent::RequestAbandoned`).
    RequestAbandoned {
        /// The node whose runtime the request was made on.
        node: u32,
        /// The actor called.
        target: String,
        /// The request's id within that runtime incarnation.
        request: u64,
    },
    /// `actor`'s turn for `request` on `node` decided to commit
    /// (`RuntimeEvent::TurnCommitting`).
    TurnCommitting {
        /// The node.
        node: u32,
        /// The actor.
        actor: String,
        /// The request the turn handled.
        request: u64,
    },
    /// `actor`'s turn for `request` on `node` was cancelled because its caller stopped
    /// waiting; it committed nothing (`RuntimeEvent::TurnAbandoned`). The handler may
    /// have been dropped mid-turn, so no `TurnEnded` need precede it.
    TurnAbandoned {
        /// The node.
        node: u32,
        /// The actor.
        actor: String,
        /// The request the turn handled.
        request: u64,
    },
    /// The longest one-way link latency the network is now configured with.
    LinkLatencyMax {
        /// In microseconds.
        us: u64,
    },
    /// An activation ran `on_activate`.
    Activated {
        /// Where.
        node: u32,
        /// Which actor.
        actor: String,
        /// Its count as loaded.
        count: u64,
    },
    /// An activation ran `on_deactivate`.
    Deactivated {
        /// Where.
        node: u32,
        /// Which actor.
        actor: String,
        /// Its count at the end.
        count: u64,
    },
    /// A turn started under a context.
    TurnStarted {
        /// Where.
        node: u32,
        /// Which actor.
        actor: String,
        /// The context's depth.
        depth: u32,
        /// The context's chain, outermost first.
        chain: Vec<String>,
        /// The context's deadline, as trace time.
        deadline_us: u64,
        /// The deadline of the caller (the root request or the calling turn).
        parent_deadline_us: u64,
        /// Whether the request crossed the network (from the client or another node).
        remote: bool,
    },
    /// A turn's handler returned (before its commit).
    TurnEnded {
        /// Where.
        node: u32,
        /// Which actor.
        actor: String,
        /// Whether the handler succeeded.
        ok: bool,
    },
    /// A probe's call to another actor was admitted.
    CallAdmitted {
        /// The call's id.
        call: u64,
        /// The calling actor.
        caller: String,
        /// The called actor.
        target: String,
        /// The callee's depth.
        depth: u32,
        /// The callee's chain.
        chain: Vec<String>,
        /// The callee's deadline, as trace time.
        deadline_us: u64,
        /// The caller's own deadline, as trace time.
        parent_deadline_us: u64,
    },
    /// A probe's call was refused by admission before anything was sent.
    CallRefused {
        /// The calling actor.
        caller: String,
        /// The actor it wanted.
        target: String,
        /// Why.
        reason: RefusalKind,
    },
    /// An agent's `call_agent` was refused by admission.
    AgentCallRefused {
        /// The trace id of the call.
        call: u64,
        /// Why.
        reason: RefusalKind,
    },
    /// A client was told an agent's answer to `text`.
    AgentAcked {
        /// The agent.
        agent: String,
        /// The message it answered.
        text: String,
    },
    /// The user messages found in an agent's committed conversation log.
    AgentLogRead {
        /// The agent.
        agent: String,
        /// Every user message in the log, oldest first.
        user_texts: Vec<String>,
    },
    /// A caller's turn began waiting on a call.
    WaitBegin {
        /// The call's id.
        call: u64,
        /// Who waits.
        caller: String,
        /// On whom.
        target: String,
        /// The node whose dispatcher routes the call (the target's host).
        host: u32,
    },
    /// The wait ended (reply, error, timeout or the caller was cancelled).
    WaitEnd {
        /// The call's id.
        call: u64,
        /// How, in words.
        outcome: String,
    },
    /// A client sent a request.
    RequestSent {
        /// The request's id.
        request: u64,
        /// The actor.
        target: String,
        /// Its deadline, as trace time.
        deadline_us: u64,
    },
    /// A client's request resolved.
    RequestResolved {
        /// The request's id.
        request: u64,
        /// How, in words.
        outcome: String,
    },
    /// A client asked to add `amount`.
    AddSent {
        /// The request's id.
        request: u64,
        /// The actor.
        actor: String,
        /// How much.
        amount: u64,
    },
    /// The runtime acknowledged an add: the count is now `value`.
    AddAcked {
        /// The request's id.
        request: u64,
        /// The actor.
        actor: String,
        /// The count after the add.
        value: u64,
    },
    /// A client asked for the count.
    GetSent {
        /// The request's id.
        request: u64,
        /// The actor.
        actor: String,
    },
    /// The runtime answered a get.
    GetReplied {
        /// The request's id.
        request: u64,
        /// The actor.
        actor: String,
        /// The count read.
        value: u64,
    },
    /// An audit read an actor's batches back through the runtime.
    Audited {
        /// The actor.
        actor: String,
        /// Batches its state counts.
        batches: u64,
        /// What its key-value space holds.
        groups: Vec<AuditGroup>,
    },
}

/// An event and when it happened.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Stamped {
    /// Trace time, in microseconds.
    pub at_us: u64,
    /// What happened.
    pub event: Event,
}

/// Events kept for the failure report.
const TRACE_TAIL_LENGTH: usize = 60;

struct Inner {
    events: Vec<Stamped>,
    hash: FnvHasher,
    invariants: Invariants,
    next_id: u64,
}

/// A shared, append-only trace. Clones record into the same trace.
#[derive(Clone)]
pub struct Trace {
    clock: TraceClock,
    inner: Arc<Mutex<Inner>>,
}

impl Trace {
    /// An empty trace checked by `invariants`, whose clock starts now.
    pub fn new(invariants: Invariants) -> Self {
        let inner = Inner {
            events: Vec::new(),
            hash: FnvHasher::default(),
            invariants,
            next_id: 1,
        };
        Self {
            clock: TraceClock::new(),
            inner: Arc::new(Mutex::new(inner)),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The trace's clock.
    pub fn clock(&self) -> TraceClock {
        self.clock
    }

    /// A fresh id for a request or call, unique in this trace.
    pub fn next_id(&self) -> u64 {
        let mut inner = self.lock();
        let id = inner.next_id;
        inner.next_id += 1;
        id
    }

    /// Records `event` now: stamps it, hashes it and runs every invariant over it.
    pub fn record(&self, event: Event) {
        let stamped = Stamped {
            at_us: self.clock.now_us(),
            event,
        };
        let mut inner = self.lock();
        stamped.hash(&mut inner.hash);
        inner.invariants.observe(&stamped);
        inner.events.push(stamped);
    }

    /// Runs every invariant's end-of-run check (liveness: nothing still pending).
    pub fn finish(&self) {
        let now = self.clock.now_us();
        self.lock().invariants.finish(now);
    }

    /// The hash of everything recorded so far.
    pub fn hash(&self) -> u64 {
        self.lock().hash.finish()
    }

    /// How many events were recorded.
    pub fn len(&self) -> usize {
        self.lock().events.len()
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every event so far.
    pub fn events(&self) -> Vec<Stamped> {
        self.lock().events.clone()
    }

    /// The violations found so far, first first.
    pub fn violations(&self) -> Vec<Violation> {
        self.lock().invariants.violations().to_vec()
    }

    /// Tolerated known-issue violations, by invariant.
    pub fn tolerated(&self) -> Vec<(&'static str, u64)> {
        self.lock().invariants.tolerated()
    }

    /// Writes every event so far to `path` as NDJSON: one JSON object per line, in
    /// trace order, `{"seq":N,"at_us":T,"kind":"…",…fields}` (the fields of [`Event`]).
    /// Test support: plain file IO outside the simulated clock, so it changes nothing
    /// in the run. Trace validation (`scripts/trace-check`) reads these files.
    ///
    /// # Errors
    /// If the file cannot be written.
    pub fn write_ndjson(&self, path: &std::path::Path) -> std::io::Result<()> {
        use std::io::Write;
        let events = self.events();
        let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
        for (seq, stamped) in events.iter().enumerate() {
            let mut object = serde_json::Map::new();
            object.insert("seq".to_string(), seq.into());
            object.insert("at_us".to_string(), stamped.at_us.into());
            if let serde_json::Value::Object(fields) = serde_json::to_value(&stamped.event)? {
                object.extend(fields);
            }
            serde_json::to_writer(&mut out, &object)?;
            out.write_all(b"\n")?;
        }
        out.flush()
    }

    /// The last events, one per line, for a failure report.
    pub fn tail(&self) -> String {
        let inner = self.lock();
        let start = inner.events.len().saturating_sub(TRACE_TAIL_LENGTH);
        inner.events[start..]
            .iter()
            .map(|s| format!("  {:>10.3} ms  {:?}", s.at_us as f64 / 1000.0, s.event))
            .collect::<Vec<_>>()
            .join("\n")
    }
}
