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
use criterion::{criterion_group, criterion_main, Criterion};
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

fn agent_system() -> AgentSystem {
    scripted_agents::asker_and_answerer(long_lived())
}

fn ask_vs_invoke(c: &mut Criterion) {
    let rt = current_thread();
    let mut group = c.benchmark_group("agent ask vs plain invoke");
    if std::env::var_os("CI").is_some() {
        group
            .measurement_time(Duration::from_secs(2))
            .warm_up_time(Duration::from_millis(500));
    }
    group.bench_function("plain runtime invoke of an echo actor", |b| {
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
        let target = ActorId::new("echo", "e").unwrap();
        b.iter_custom(|iters| {
            rt.block_on(async {
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
    });
    group.bench_function("agent answers in one scripted model step", |b| {
        let system = rt.block_on(async {
            let system = agent_system();
            system.ask("answerer", "warm up").await.unwrap();
            system
        });
        b.iter_custom(|iters| {
            rt.block_on(async {
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
            system
        });
        b.iter_custom(|iters| {
            rt.block_on(async {
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
        system
    });
    let elapsed = rt.block_on(async {
        let start = Instant::now();
        for _ in 0..iters {
            let reply = system.ask("asker", "what is 6 x 7?").await.unwrap();
            assert_eq!(reply.text, "42");
        }
        start.elapsed()
    });
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

criterion_group!(benches, ask_vs_invoke, call_agent_by_store, admission);
criterion_main!(benches);
