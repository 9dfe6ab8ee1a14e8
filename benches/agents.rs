//! Agent-layer benchmarks, in one run so the ratios are meaningful.
//!
//! - `agent ask vs plain invoke`: a plain runtime invoke of an echo actor (the floor);
//!   an agent that answers in one scripted model step; an agent that asks another
//!   agent through `call_agent` (two agent turns, three model steps, admission, the
//!   wait-for edge, JSON log writes and snapshots committed to the in-memory store).
//! - `call_agent by store`: the same `call_agent` round trip committed to SQLite, the
//!   embedded default: in memory (the store's own work: statements, rows, its mutex and
//!   blocking task) and in a file (WAL, `synchronous = FULL`: each of the round trip's
//!   three commits waits for the disk).
//! - `call admission`: one `admit_call` decision at depth 2 (target: < 1 µs).
//! - `notify and delegate`: the durable fire-and-forget between two agents `a` and `b`
//!   (`benches/support/scripted_agents.rs`: each answers an inbox entry in one scripted
//!   model step), with the plain invoke floor again: `notify_as` from `a` to `b` until
//!   `b`'s turn on it has ended, one at a time and [`NOTIFY_BATCH`] back to back (per
//!   notification); `delegate` from `a` to `b` until `a`'s turn on the result has ended.
//!   Ends are seen by an observer (`TurnEnded`), no polling and no timer. On the one
//!   thread, what remains of a notification after that end (the commit of `b`'s turn,
//!   the delivery report to `a`) runs before the next one's work: the time per
//!   notification holds all of it.
//!
//! Every timed loop runs in a spawned task ([`in_task`]), as a server's handler would.
//!
//! Run: `cargo bench -p troupe-bench --bench agents` (shorter measurement when `CI` is set). Where the
//! `call_agent` case's time goes, measured: docs/architecture.md ("Where an agent call's
//! time goes").

// Benches measure wall-clock time by design; the determinism lints are for library code.
#![allow(clippy::disallowed_methods, missing_docs)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Bencher, Criterion};
use troupe::agent::limits::{AGENT_INBOX_CAPACITY, AGENT_OUTBOX_CAPACITY};
use troupe::agent::AgentSystem;
use troupe::core::limits::AGENT_CALL_TIMEOUT_MS_DEFAULT;
use troupe::core::{admit_call, ActorId, ActorKind, AdmissionRequest, CallContext, Deadline};
use troupe::runtime::{Actor, ActorBox, ActorError, KindConfig, Runtime, SqliteStore, StateStore, Turn};

#[path = "support/scripted_agents.rs"]
mod scripted_agents;

struct Echo;

impl Actor for Echo {
    async fn handle(&mut self, _turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        Ok(payload)
    }
}

fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn long_lived() -> KindConfig {
    KindConfig::default().with_idle_timeout(Duration::from_secs(3_600))
}

/// Runs `timed` in a task spawned on `rt` (as a server's request handler would) and
/// returns its output, as benches/runtime.rs and benches/paired.rs time their cases: in
/// `block_on`'s own future, on current_thread, every wake-up first polls the I/O driver
/// (a syscall), which inflated this bench's plain-invoke floor (711 ns against 447 ns in
/// the paired bench on 2026-12-04) and so flattered the agent rows' ratios.
fn in_task<F>(rt: &tokio::runtime::Runtime, timed: F) -> F::Output
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    rt.block_on(async move { tokio::spawn(timed).await.unwrap() })
}

fn agent_system() -> AgentSystem {
    scripted_agents::asker_and_answerer(long_lived())
}

/// The floor of both agent groups: a plain runtime invoke of an echo actor.
const PLAIN_INVOKE: &str = "plain runtime invoke of an echo actor";

fn plain_invoke(rt: &tokio::runtime::Runtime, b: &mut Bencher<'_>) {
    let runtime = rt.block_on(async {
        let runtime = Runtime::builder()
            .register(
                ActorKind::new("echo").unwrap(),
                |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> { Ok(ActorBox::new(Echo)) },
                long_lived(),
            )
            .unwrap()
            .start();
        let target = ActorId::new("echo", "e").unwrap();
        runtime
            .invoke(
                &target,
                Bytes::from_static(b"x"),
                runtime.deadline_in(Duration::from_secs(10)),
            )
            .await
            .unwrap();
        runtime
    });
    let runtime = Arc::new(runtime);
    let target = ActorId::new("echo", "e").unwrap();
    b.iter_custom(|iters| {
        let (runtime, target) = (Arc::clone(&runtime), target.clone());
        in_task(rt, async move {
            let start = Instant::now();
            for _ in 0..iters {
                let deadline = runtime.deadline_in(Duration::from_secs(10));
                black_box(
                    runtime
                        .invoke(&target, Bytes::from_static(b"x"), deadline)
                        .await
                        .unwrap(),
                );
            }
            start.elapsed()
        })
    });
}

fn ask_vs_invoke(c: &mut Criterion) {
    let rt = current_thread();
    let mut group = c.benchmark_group("agent ask vs plain invoke");
    if std::env::var_os("CI").is_some() {
        group
            .measurement_time(Duration::from_secs(2))
            .warm_up_time(Duration::from_millis(500));
    }
    group.bench_function(PLAIN_INVOKE, |b| plain_invoke(&rt, b));
    group.bench_function("agent answers in one scripted model step", |b| {
        let system = rt.block_on(async {
            let system = agent_system();
            system.ask("answerer", "warm up").await.unwrap();
            Arc::new(system)
        });
        b.iter_custom(|iters| {
            let system = Arc::clone(&system);
            in_task(&rt, async move {
                let start = Instant::now();
                for _ in 0..iters {
                    black_box(system.ask("answerer", "what is 6 x 7?").await.unwrap());
                }
                start.elapsed()
            })
        });
    });
    group.bench_function("agent asks another agent through call_agent", |b| {
        let system = rt.block_on(async {
            let system = agent_system();
            system.ask("asker", "warm up").await.unwrap();
            Arc::new(system)
        });
        b.iter_custom(|iters| {
            let system = Arc::clone(&system);
            in_task(&rt, async move {
                let start = Instant::now();
                for _ in 0..iters {
                    let reply = system.ask("asker", "what is 6 x 7?").await.unwrap();
                    assert_eq!(reply.text, "42");
                }
                start.elapsed()
            })
        });
    });
    group.finish();
}

fn admission(c: &mut Criterion) {
    let mut group = c.benchmark_group("call admission");
    let (a, b, target) = (
        ActorId::new("agent", "a").unwrap(),
        ActorId::new("agent", "b").unwrap(),
        ActorId::new("agent", "c").unwrap(),
    );
    let far = Deadline::from_micros(3_600_000_000);
    let context = CallContext::root(far).child(a, far).child(b.clone(), far);
    group.bench_function("admit_call at depth 2", |bench| {
        bench.iter(|| {
            black_box(admit_call(AdmissionRequest {
                caller: black_box(&b),
                context: black_box(&context),
                target: black_box(&target),
                target_known: true,
                calls_in_flight: 3,
                requested_timeout_ms: Some(AGENT_CALL_TIMEOUT_MS_DEFAULT),
                now: Deadline::from_micros(1_000),
            }))
        });
    });
    group.finish();
}

/// `call_agent` round trips of the two scripted agents on `store`.
fn call_agent_round_trips(rt: &tokio::runtime::Runtime, store: Arc<dyn StateStore>, iters: u64) -> Duration {
    let system = rt.block_on(async {
        let system = scripted_agents::asker_and_answerer_on(store, long_lived());
        system.ask("asker", "warm up").await.unwrap();
        Arc::new(system)
    });
    let elapsed = in_task(rt, {
        let system = Arc::clone(&system);
        async move {
            let start = Instant::now();
            for _ in 0..iters {
                let reply = system.ask("asker", "what is 6 x 7?").await.unwrap();
                assert_eq!(reply.text, "42");
            }
            start.elapsed()
        }
    });
    let Ok(system) = Arc::try_unwrap(system) else {
        unreachable!("the timed task ended and dropped its reference")
    };
    rt.block_on(system.shutdown());
    elapsed
}

fn call_agent_by_store(c: &mut Criterion) {
    let rt = current_thread();
    let mut group = c.benchmark_group("call_agent by store");
    group.sample_size(20);
    if std::env::var_os("CI").is_some() {
        group
            .measurement_time(Duration::from_secs(3))
            .warm_up_time(Duration::from_millis(500));
    }
    group.bench_function("SQLite in memory", |b| {
        b.iter_custom(|iters| {
            let store = SqliteStore::open_in_memory().unwrap();
            call_agent_round_trips(&rt, Arc::new(store), iters)
        });
    });
    group.bench_function("SQLite file (WAL, synchronous = FULL)", |b| {
        b.iter_custom(|iters| {
            let directory = tempfile::tempdir().unwrap();
            let store = SqliteStore::open(directory.path().join("troupe.db")).unwrap();
            call_agent_round_trips(&rt, Arc::new(store), iters)
        });
    });
    group.finish();
}

/// Notifications `a` sends back to back before waiting for `b` to have processed them
/// all, in the batch case: within the inbox's and the outbox's capacity (entries).
const NOTIFY_BATCH: u64 = 32;
const _: () = assert!(NOTIFY_BATCH <= AGENT_INBOX_CAPACITY && NOTIFY_BATCH <= AGENT_OUTBOX_CAPACITY);

/// `a` and `b` (`scripted_agents::notifier_and_worker`), both activated and past their
/// first notification and task.
fn warm_notifier_and_worker(
    rt: &tokio::runtime::Runtime,
) -> (
    AgentSystem,
    Arc<scripted_agents::TurnsEnded>,
    Arc<scripted_agents::TurnsEnded>,
) {
    rt.block_on(async {
        let (system, a_turns, b_turns) = scripted_agents::notifier_and_worker(long_lived());
        scripted_agents::notify_and_wait(&system, &b_turns, 1).await;
        let task = scripted_agents::delegate_and_wait(&system, &a_turns).await;
        scripted_agents::assert_completed(&system, &task).await;
        (system, a_turns, b_turns)
    })
}

fn notify_and_delegate(c: &mut Criterion) {
    let rt = current_thread();
    let mut group = c.benchmark_group("notify and delegate");
    if std::env::var_os("CI").is_some() {
        group
            .measurement_time(Duration::from_secs(2))
            .warm_up_time(Duration::from_millis(500));
    }
    group.bench_function(PLAIN_INVOKE, |b| plain_invoke(&rt, b));
    group.bench_function("notify_as a to b, until b's turn on it ended", |bench| {
        let (system, _, b_turns) = warm_notifier_and_worker(&rt);
        let system = Arc::new(system);
        bench.iter_custom(|iters| {
            let (system, b_turns) = (Arc::clone(&system), Arc::clone(&b_turns));
            in_task(&rt, async move {
                let start = Instant::now();
                for _ in 0..iters {
                    scripted_agents::notify_and_wait(&system, &b_turns, 1).await;
                }
                start.elapsed()
            })
        });
    });
    let batch = format!("notify_as a to b, {NOTIFY_BATCH} back to back until b's turns on all ended, per notification");
    group.bench_function(batch, |bench| {
        let (system, _, b_turns) = warm_notifier_and_worker(&rt);
        let system = Arc::new(system);
        // One iteration is one notification: `iters` of them in batches.
        bench.iter_custom(|iters| {
            let (system, b_turns) = (Arc::clone(&system), Arc::clone(&b_turns));
            in_task(&rt, async move {
                let start = Instant::now();
                let mut sent = 0;
                while sent < iters {
                    let count = NOTIFY_BATCH.min(iters - sent);
                    scripted_agents::notify_and_wait(&system, &b_turns, count).await;
                    sent += count;
                }
                start.elapsed()
            })
        });
    });
    group.bench_function("delegate a to b, until a's turn on the result ended", |bench| {
        let (system, a_turns, _) = warm_notifier_and_worker(&rt);
        let system = Arc::new(system);
        bench.iter_custom(|iters| {
            let (system, a_turns) = (Arc::clone(&system), Arc::clone(&a_turns));
            in_task(&rt, async move {
                let start = Instant::now();
                let mut task = String::new();
                for _ in 0..iters {
                    task = scripted_agents::delegate_and_wait(&system, &a_turns).await;
                }
                let elapsed = start.elapsed();
                // Outside the timing: the last task's committed record.
                if !task.is_empty() {
                    scripted_agents::assert_completed(&system, &task).await;
                }
                elapsed
            })
        });
    });
    group.finish();
}

criterion_group!(
    benches,
    ask_vs_invoke,
    call_agent_by_store,
    admission,
    notify_and_delegate
);
criterion_main!(benches);
