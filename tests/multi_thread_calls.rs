//! The call path's guarantees on tokio's multi-thread runtime, where embedders run it:
//! wait-for edges that follow the call (no false `DeadlockDetected`), crossing calls
//! that refuse exactly one, and callers that give up cancelling their callees.
//!
//! Normal build only: the simulator has one thread; its own scenarios are the
//! `dst_*` files.

#![cfg(not(madsim))]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use troupe::core::{ActorId, ActorKind, CallRefused, InvokeError};
use troupe::runtime::{
    Actor, ActorBox, ActorError, KindConfig, Runtime, RuntimeEvent, RuntimeHandle, RuntimeObserver, Turn,
};

const KIND: &str = "node";

fn node(key: &str) -> ActorId {
    ActorId::new(KIND, key).unwrap()
}

/// One request: call `next` (if any) with its own plan, optionally spending `work_ms`
/// in small sleeps before replying, and writing to state when done.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Plan {
    nonce: u64,
    next: Option<(String, Box<Plan>)>,
    /// Also call this actor from a spawned task that outlives the turn.
    spawn_call: Option<String>,
    work_ms: u64,
    timeout_ms: u64,
    /// Meet the other side of a crossing at this barrier before calling.
    barrier: bool,
}

impl Plan {
    fn leaf(nonce: u64) -> Self {
        Self {
            nonce,
            next: None,
            spawn_call: None,
            work_ms: 0,
            timeout_ms: 5_000,
            barrier: false,
        }
    }
}

/// What the actors saw, stamped with one global sequence.
#[derive(Debug, Clone)]
enum Seen {
    Issued {
        nonce: u64,
        caller: String,
        target: String,
        seq: u64,
    },
    Returned {
        nonce: u64,
        result: Result<(), InvokeError>,
        seq: u64,
    },
    Served {
        nonce: u64,
        seq: u64,
    },
    WorkStep {
        actor: String,
    },
    SpawnedCallEnded {
        result: Result<(), InvokeError>,
    },
}

#[derive(Default)]
struct Log {
    seq: AtomicU64,
    seen: Mutex<Vec<Seen>>,
}

impl Log {
    fn next(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::SeqCst)
    }
    fn push(&self, seen: Seen) {
        self.seen.lock().unwrap().push(seen);
    }
    fn all(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
    fn work_steps(&self, actor: &str) -> usize {
        self.all()
            .iter()
            .filter(|s| matches!(s, Seen::WorkStep { actor: a } if a == actor))
            .count()
    }
}

struct Node {
    key: String,
    count: u64,
    log: Arc<Log>,
    barrier: Arc<tokio::sync::Barrier>,
}

impl Actor for Node {
    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        let plan: Plan = serde_json::from_slice(&payload).map_err(|e| ActorError::failed(e.to_string()))?;
        if plan.barrier {
            // The normal build only (this file), where a replay is not promised (see
            // clippy.toml on `Barrier::wait`).
            #[allow(clippy::disallowed_methods)]
            self.barrier.wait().await;
        }
        if let Some(target) = &plan.spawn_call {
            let caller = turn.caller().clone();
            let log = Arc::clone(&self.log);
            let target = node(target);
            let inner = Plan {
                work_ms: 2_000,
                ..Plan::leaf(0)
            };
            tokio::spawn(async move {
                let payload = Bytes::from(serde_json::to_vec(&inner).unwrap());
                let result = caller.call(&target, payload, Duration::from_secs(10)).await.map(|_| ());
                log.push(Seen::SpawnedCallEnded { result });
            });
            // Let the spawned call reach the callee before this turn ends.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if let Some((target, next)) = &plan.next {
            let seq = self.log.next();
            self.log.push(Seen::Issued {
                nonce: next.nonce,
                caller: self.key.clone(),
                target: target.clone(),
                seq,
            });
            let payload = Bytes::from(serde_json::to_vec(next).unwrap());
            let result = turn
                .invoke(&node(target), payload, Duration::from_millis(plan.timeout_ms))
                .await;
            let seq = self.log.next();
            self.log.push(Seen::Returned {
                nonce: next.nonce,
                result: result.map(|_| ()),
                seq,
            });
        }
        for _ in 0..plan.work_ms / 10 {
            self.log.push(Seen::WorkStep {
                actor: self.key.clone(),
            });
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let seq = self.log.next();
        self.log.push(Seen::Served { nonce: plan.nonce, seq });
        self.count += 1;
        Ok(Bytes::new())
    }

    fn snapshot(&self) -> Result<Option<Bytes>, ActorError> {
        Ok(Some(Bytes::from(self.count.to_le_bytes().to_vec())))
    }
}

#[derive(Default)]
struct Events(Mutex<Vec<RuntimeEvent>>);

impl RuntimeObserver for Events {
    fn on_event(&self, event: &RuntimeEvent) {
        self.0.lock().unwrap().push(event.clone());
    }
}

impl Events {
    fn all(&self) -> Vec<RuntimeEvent> {
        self.0.lock().unwrap().clone()
    }
}

fn start(log: &Arc<Log>, barrier_parties: usize, events: &Arc<Events>) -> Runtime {
    let log = Arc::clone(log);
    let barrier = Arc::new(tokio::sync::Barrier::new(barrier_parties));
    let factory = move |id: &ActorId, saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
        let count = saved
            .map(|b| u64::from_le_bytes(b[..8].try_into().unwrap()))
            .unwrap_or(0);
        Ok(ActorBox::new(Node {
            key: id.key().to_string(),
            count,
            log: Arc::clone(&log),
            barrier: Arc::clone(&barrier),
        }))
    };
    Runtime::builder()
        .observer(Arc::clone(events) as Arc<dyn RuntimeObserver>)
        .register(
            ActorKind::new(KIND).unwrap(),
            factory,
            KindConfig::default().with_mailbox_capacity(1_024),
        )
        .unwrap()
        .start()
}

async fn ask(rt: &RuntimeHandle, key: &str, plan: &Plan, timeout: Duration) -> Result<Bytes, InvokeError> {
    rt.invoke(
        &node(key),
        Bytes::from(serde_json::to_vec(plan).unwrap()),
        rt.deadline_in(timeout),
    )
    .await
}

/// A tiny deterministic generator for the workload (seeded, no OS randomness).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % n
    }
}

/// Goal: two independent requests whose turns call each other at the same moment (A
/// waits on B while B waits on A) refuse exactly one call, with the cycle, and the other
/// completes; on the multi-thread runtime, 200 times. Method: both turns meet at a
/// barrier, then call each other.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crossing_calls_on_the_multi_thread_runtime_refuse_exactly_one_with_the_cycle() {
    let log = Arc::new(Log::default());
    let events = Arc::new(Events::default());
    let rt = start(&log, 2, &events);
    for round in 0..200u64 {
        let cross = |to: &str, nonce: u64| Plan {
            nonce,
            next: Some((to.to_string(), Box::new(Plan::leaf(nonce + 1)))),
            barrier: true,
            ..Plan::leaf(nonce)
        };
        let (a, b) = (rt.handle(), rt.handle());
        let plan_a = cross("b", round * 10);
        let plan_b = cross("a", round * 10 + 5);
        let left = tokio::spawn(async move { ask(&a, "a", &plan_a, Duration::from_secs(10)).await });
        let right = tokio::spawn(async move { ask(&b, "b", &plan_b, Duration::from_secs(10)).await });
        assert!(left.await.unwrap().is_ok());
        assert!(right.await.unwrap().is_ok());
        let seen = log.all();
        let returned = |nonce: u64| {
            seen.iter()
                .find_map(|s| match s {
                    Seen::Returned { nonce: n, result, .. } if *n == nonce => Some(result.clone()),
                    _ => None,
                })
                .unwrap_or_else(|| panic!("round {round}: call {nonce} never returned"))
        };
        let outcomes = [returned(round * 10 + 1), returned(round * 10 + 6)];
        let refused: Vec<_> = outcomes.iter().filter(|r| r.is_err()).collect();
        assert_eq!(
            refused.len(),
            1,
            "round {round}: exactly one of the crossing calls is refused: {outcomes:?}"
        );
        let cycle = match refused[0] {
            Err(InvokeError::DeadlockDetected { cycle }) => cycle.clone(),
            other => panic!("round {round}: the refusal is a deadlock with its cycle, got {other:?}"),
        };
        let expected = if outcomes[0].is_err() {
            vec![node("a"), node("b"), node("a")]
        } else {
            vec![node("b"), node("a"), node("b")]
        };
        assert_eq!(cycle, expected, "round {round}");
    }
    assert_eq!(rt.counters().deadlocks_refused, 200);
    assert_eq!(rt.stats().await.unwrap().wait_for_edges, 0, "every edge was released");
    rt.shutdown().await;
}

/// Goal: every `DeadlockDetected` names a cycle of calls that were all open at once;
/// wait-for edges end when the callee replies, not when the caller's future ends (that
/// lag refused legitimate calls on the multi-thread runtime). Method: 8 drivers send
/// 400 requests each to 5 actors; each request is a chain of 1 to 3 calls between
/// random actors (crossings and reversals are frequent). Each actor stamps, with one
/// global sequence, when it issued a call, when it got the result and when it finished
/// serving a request. A refused call c0 from X1 to X2 with cycle [X1, X2, …, Xn, X1]
/// is a true refusal only if for every other edge Xk → Xk+1 there is a call from Xk to
/// Xk+1 that was issued before c0 returned and that Xk+1 had not finished serving
/// before c0 was issued.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_deadlock_refusal_names_a_cycle_that_did_not_exist_under_concurrent_crossing_calls() {
    const ACTORS: [&str; 5] = ["a", "b", "c", "d", "e"];
    const DRIVERS: u64 = 8;
    const REQUESTS_PER_DRIVER: u64 = 400;
    let log = Arc::new(Log::default());
    let events = Arc::new(Events::default());
    let rt = start(&log, 1, &events);
    let nonces = Arc::new(AtomicU64::new(1));
    let mut drivers = Vec::new();
    for driver in 0..DRIVERS {
        let handle = rt.handle();
        let nonces = Arc::clone(&nonces);
        drivers.push(tokio::spawn(async move {
            let mut rng = Lcg(driver + 17);
            for _ in 0..REQUESTS_PER_DRIVER {
                let hops = 1 + rng.below(3);
                let mut keys = vec![ACTORS[rng.below(5) as usize]];
                for _ in 0..hops {
                    let previous = *keys.last().unwrap();
                    let mut next = ACTORS[rng.below(5) as usize];
                    while next == previous {
                        next = ACTORS[rng.below(5) as usize];
                    }
                    keys.push(next);
                }
                let mut plan = Plan::leaf(nonces.fetch_add(1, Ordering::SeqCst));
                for key in keys[1..].iter().rev() {
                    let nonce = nonces.fetch_add(1, Ordering::SeqCst);
                    plan = Plan {
                        next: Some((key.to_string(), Box::new(plan))),
                        ..Plan::leaf(nonce)
                    };
                }
                // Every request resolves; refusals are recorded by the actors.
                ask(&handle, keys[0], &plan, Duration::from_secs(30)).await.unwrap();
            }
        }));
    }
    for driver in drivers {
        driver.await.unwrap();
    }
    let seen = log.all();
    let mut issued = Vec::new();
    let mut returned = std::collections::HashMap::new();
    let mut served = std::collections::HashMap::new();
    for s in &seen {
        match s {
            Seen::Issued {
                nonce,
                caller,
                target,
                seq,
            } => issued.push((*nonce, caller.clone(), target.clone(), *seq)),
            Seen::Returned { nonce, result, seq } => {
                returned.insert(*nonce, (result.clone(), *seq));
            }
            Seen::Served { nonce, seq } => {
                served.insert(*nonce, *seq);
            }
            _ => {}
        }
    }
    let mut deadlocks = 0;
    let mut false_refusals = Vec::new();
    for (nonce, caller, target, issued_at) in &issued {
        let (result, returned_at) = &returned[nonce];
        let Err(InvokeError::DeadlockDetected { cycle }) = result else {
            continue;
        };
        deadlocks += 1;
        assert_eq!(cycle.first(), Some(&node(caller)));
        assert_eq!(cycle.last(), Some(&node(caller)));
        assert_eq!(cycle.get(1), Some(&node(target)));
        for pair in cycle[1..].windows(2) {
            let (from, to) = (pair[0].key(), pair[1].key());
            let open = issued.iter().any(|(other, c, t, at)| {
                c == from
                    && t == to
                    && at < returned_at
                    && served.get(other).is_none_or(|done| done > issued_at)
                    && returned.get(other).is_none_or(|(_, back)| back > issued_at)
            });
            if !open {
                false_refusals.push((nonce, cycle.clone(), from.to_string(), to.to_string()));
            }
        }
    }
    let refused_by_chain = returned
        .values()
        .filter(|(result, _)| matches!(result, Err(InvokeError::Refused(CallRefused::CycleDetected { .. }))))
        .count();
    println!(
        "{} calls, {deadlocks} refused as deadlocks, {refused_by_chain} by the chain check, {} false refusals",
        issued.len(),
        false_refusals.len()
    );
    assert!(
        false_refusals.is_empty(),
        "refusals naming edges that were not open: {false_refusals:?}"
    );
    assert_eq!(rt.counters().deadlocks_refused, deadlocks);
    assert_eq!(rt.stats().await.unwrap().wait_for_edges, 0, "every edge was released");
    rt.shutdown().await;
}

/// Goal: a caller that stops waiting cancels its callee's turn and the callee's whole
/// subtree: no further work, nothing committed. Method: a root request to A, which calls
/// B, which calls C; C works in 10 ms steps for 2 s. The root caller drops its future
/// after 100 ms. All three turns must be abandoned (rolled back, no commit), C must stop
/// stepping at once, and the observer must see each abandonment and no commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_caller_that_gives_up_cancels_its_callees_whole_subtree_and_nothing_commits() {
    let log = Arc::new(Log::default());
    let events = Arc::new(Events::default());
    let rt = start(&log, 1, &events);
    let c = Plan {
        work_ms: 2_000,
        ..Plan::leaf(3)
    };
    let b = Plan {
        next: Some(("c".into(), Box::new(c))),
        ..Plan::leaf(2)
    };
    let a = Plan {
        next: Some(("b".into(), Box::new(b))),
        ..Plan::leaf(1)
    };
    let gave_up = tokio::time::timeout(Duration::from_millis(100), ask(&rt, "a", &a, Duration::from_secs(10))).await;
    assert!(gave_up.is_err(), "the caller gave up first");
    let steps_at_give_up = log.work_steps("c");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let steps_later = log.work_steps("c");
    assert!(steps_at_give_up >= 1, "C was working when the caller gave up");
    assert!(
        steps_later <= steps_at_give_up + 1,
        "C stopped within one step: {steps_at_give_up} steps then {steps_later}"
    );
    let counters = rt.counters();
    assert_eq!(counters.turns_abandoned, 3, "{counters:?}");
    let events = events.all();
    assert!(
        !events.iter().any(|e| matches!(e, RuntimeEvent::TurnCommitting { .. })),
        "{events:?}"
    );
    let abandoned: Vec<String> = events
        .iter()
        .filter_map(|e| match e {
            RuntimeEvent::TurnAbandoned { actor, .. } => Some(actor.key().to_string()),
            _ => None,
        })
        .collect();
    assert_eq!(abandoned.len(), 3);
    for key in ["a", "b", "c"] {
        assert!(abandoned.contains(&key.to_string()), "{key} abandoned: {abandoned:?}");
    }
    // Nothing was committed: each actor's count is still 0 (a fresh activation reads it).
    for key in ["a", "b", "c"] {
        assert_eq!(
            rt.store().load(&node(key)).await.unwrap(),
            None,
            "{key} committed nothing"
        );
    }
    assert_eq!(rt.stats().await.unwrap().wait_for_edges, 0);
    rt.shutdown().await;
}

/// Goal: a call made from a task the turn spawned ends when the turn ends (its callee
/// is cancelled), and a call made after the turn ended is refused. Method: A's turn
/// spawns a task that calls B (2 s of work) and returns after 50 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_call_from_a_task_that_outlives_its_turn_is_cancelled_when_the_turn_ends() {
    let log = Arc::new(Log::default());
    let events = Arc::new(Events::default());
    let rt = start(&log, 1, &events);
    let a = Plan {
        spawn_call: Some("b".into()),
        ..Plan::leaf(1)
    };
    ask(&rt, "a", &a, Duration::from_secs(10)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let ended: Vec<_> = log
        .all()
        .into_iter()
        .filter_map(|s| match s {
            Seen::SpawnedCallEnded { result } => Some(result),
            _ => None,
        })
        .collect();
    assert_eq!(ended, vec![Err(InvokeError::Cancelled { target: node("b") })]);
    assert!(log.work_steps("b") <= 10, "B stopped soon after A's turn ended");
    assert_eq!(rt.counters().turns_abandoned, 1);
    assert_eq!(rt.store().load(&node("b")).await.unwrap(), None, "B committed nothing");
    rt.shutdown().await;
}
