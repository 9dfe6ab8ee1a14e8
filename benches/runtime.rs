//! Runtime benchmarks against a raw tokio floor, in one run so ratios are meaningful.
//!
//! - `hot invoke round trip`: invoke an active, stateless actor and await the reply,
//!   against a raw tokio mpsc + oneshot request/reply on the same runtime, and the same
//!   floor waiting under `tokio::time::timeout` (every troupe invoke has a deadline).
//! - `cold activation and first reply`: invoke a never-seen actor id (spawn its task,
//!   load from the store, first turn), against a bare tokio spawn + first reply; each
//!   side in a spawned task, keeping at most `COLD_LIVE_MAX` (100,000) alive at a time
//!   (since 2026-12-02; before, millions, and in `block_on`'s own future), in heap
//!   memory touched before the group starts (since 2026-12-03: `benches/support/heap.rs`).
//! - `routing with N activated actors`: the hot round trip while the activation table
//!   holds 1k … 1M actors; it should stay flat.
//!
//! - Each round-trip, fire-and-forget and cold case also runs the same echo actor on
//!   ractor and kameo (benches/support/peers.rs), so the table compares libraries
//!   measured together.
//!
//! Run: `cargo bench -p troupe-bench --bench runtime` (smaller sizes when `CI` is set).

// criterion_group! generates an undocumented function; a bench measures wall time.
#![allow(missing_docs, clippy::disallowed_methods)]

use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use tokio::sync::{mpsc, oneshot};
use troupe::core::{ActorId, ActorKind};
use troupe::runtime::{KindConfig, Runtime};

#[path = "support/echo.rs"]
mod echo;
#[path = "support/floor.rs"]
mod floor;
#[path = "support/heap.rs"]
mod heap;
#[path = "support/peers.rs"]
mod peers;

use echo::echo_runtime;
use floor::{floor_round_trip, floor_tell_batch, spawn_floor_server, spawn_tell_floor_server, Request, TypedEcho};

fn current_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn echo(key: u64) -> ActorId {
    ActorId::new("echo", key.to_string()).unwrap()
}

fn multi_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Runs `iters` rounds of `round` in a task spawned on `rt` (as a server's request
/// handler would), not in `block_on`'s own future: on current_thread, a `block_on`
/// future that is woken makes the scheduler poll the I/O driver (a syscall) before it
/// runs again, which a spawned task does not pay on every round.
fn time_in_task<S, F, Fut>(rt: &tokio::runtime::Runtime, iters: u64, state: &S, round: F) -> Duration
where
    S: Clone + Send + 'static,
    F: Fn(S) -> Fut + Send + Copy + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let state = state.clone();
    rt.block_on(async move {
        tokio::spawn(async move {
            let start = Instant::now();
            for _ in 0..iters {
                round(state.clone()).await;
            }
            start.elapsed()
        })
        .await
        .unwrap()
    })
}

fn hot_round_trip(c: &mut Criterion) {
    for (flavor, rt) in [
        ("current_thread", current_thread()),
        ("multi_thread (2 workers)", multi_thread()),
    ] {
        let mut group = c.benchmark_group(format!("hot invoke round trip, {flavor}"));
        // Set-up happens once, outside the closures: criterion calls them many times.
        let sender = rt.block_on(async { spawn_floor_server() });
        let runtime = rt.block_on(async { echo_runtime() });
        let handle = runtime.handle();
        group.bench_function("raw tokio mpsc + oneshot (floor)", |b| {
            b.iter_custom(|iters| {
                time_in_task(&rt, iters, &sender, |sender| async move {
                    let (reply, answer) = oneshot::channel();
                    sender.send((Bytes::from_static(b"x"), reply)).await.unwrap();
                    answer.await.unwrap();
                })
            });
        });
        let target = echo(0);
        rt.block_on(async {
            runtime
                .invoke(&target, Bytes::new(), runtime.deadline_in(Duration::from_secs(5)))
                .await
                .unwrap();
        });
        group.bench_function("raw tokio mpsc + oneshot + timeout (floor with a deadline)", |b| {
            b.iter_custom(|iters| {
                time_in_task(&rt, iters, &sender, |sender| async move {
                    let (reply, answer) = oneshot::channel();
                    sender.send((Bytes::from_static(b"x"), reply)).await.unwrap();
                    tokio::time::timeout(Duration::from_secs(5), answer)
                        .await
                        .unwrap()
                        .unwrap();
                })
            });
        });
        let state = (handle, target.clone());
        group.bench_function("troupe invoke of an active actor", |b| {
            b.iter_custom(|iters| {
                time_in_task(&rt, iters, &state, |(handle, target)| async move {
                    handle
                        .invoke_within(&target, Bytes::from_static(b"x"), Duration::from_secs(5))
                        .await
                        .unwrap();
                })
            });
        });
        let ractor = rt.block_on(peers::ractor_echo::spawn());
        group.bench_function("ractor call! of an active actor", |b| {
            b.iter_custom(|iters| {
                time_in_task(&rt, iters, &ractor, |actor| async move {
                    peers::ractor_echo::ask(&actor, Bytes::from_static(b"x")).await;
                })
            });
        });
        let kameo = rt.block_on(async { peers::kameo_echo::spawn() });
        group.bench_function("kameo ask of an active actor", |b| {
            b.iter_custom(|iters| {
                time_in_task(&rt, iters, &kameo, |actor| async move {
                    peers::kameo_echo::ask(&actor, Bytes::from_static(b"x")).await;
                })
            });
        });
        group.finish();
        rt.block_on(runtime.shutdown());
    }
}

/// Messages per batch in the fire-and-forget benchmark: below the default mailbox
/// capacity, so no tell is refused with `Busy`.
const TELL_BATCH: u64 = 32;

/// Fire-and-forget: a batch of `TELL_BATCH` messages, then one request-reply as the
/// barrier that shows all were handled; reported per message. The floor does the same
/// with a raw bounded mpsc send to a task that drains it (no reply channel per message:
/// until 2026-12-01 each carried a oneshot the task answered, which made the floor about
/// 330 instructions a message heavier than a send).
fn tell_and_typed(c: &mut Criterion) {
    for (flavor, rt) in [
        ("current_thread", current_thread()),
        ("multi_thread (2 workers)", multi_thread()),
    ] {
        let mut group = c.benchmark_group(format!("tell and typed ask, {flavor}"));
        let sender = rt.block_on(async { spawn_floor_server() });
        let tell_sender = rt.block_on(async { spawn_tell_floor_server() });
        let runtime = rt.block_on(async {
            Runtime::builder()
                .register_typed::<TypedEcho>(
                    ActorKind::new("typed").unwrap(),
                    KindConfig::default().with_idle_timeout(Duration::from_secs(3_600)),
                )
                .unwrap()
                .start()
        });
        let typed = runtime
            .actor_ref::<TypedEcho>(ActorId::new("typed", "0").unwrap())
            .unwrap();
        rt.block_on(async { typed.ask(0, Duration::from_secs(5)).await.unwrap() });
        group.throughput(criterion::Throughput::Elements(TELL_BATCH));
        group.bench_function("raw tokio bounded mpsc send, batch + barrier (floor)", |b| {
            b.iter_custom(|iters| {
                time_in_task(&rt, iters, &tell_sender, |sender| async move {
                    floor_tell_batch(&sender, TELL_BATCH).await;
                })
            });
        });
        group.bench_function("troupe typed tell, batch + barrier", |b| {
            b.iter_custom(|iters| {
                time_in_task(&rt, iters, &typed, |typed| async move {
                    for i in 0..TELL_BATCH {
                        typed.tell(i, Duration::from_secs(5)).await.unwrap();
                    }
                    typed.ask(0, Duration::from_secs(5)).await.unwrap();
                })
            });
        });
        // The peers' fire-and-forget, the same batch and barrier (no deadline on either).
        let ractor = rt.block_on(peers::ractor_echo::spawn());
        group.bench_function("ractor cast, batch + barrier", |b| {
            b.iter_custom(|iters| {
                time_in_task(&rt, iters, &ractor, |actor| async move {
                    peers::ractor_echo::tell_batch(&actor, TELL_BATCH).await;
                })
            });
        });
        let kameo = rt.block_on(async { peers::kameo_echo::spawn() });
        group.bench_function("kameo tell, batch + barrier", |b| {
            b.iter_custom(|iters| {
                time_in_task(&rt, iters, &kameo, |actor| async move {
                    peers::kameo_echo::tell_batch(&actor, TELL_BATCH).await;
                })
            });
        });
        group.throughput(criterion::Throughput::Elements(1));
        group.bench_function("raw tokio mpsc + oneshot (floor)", |b| {
            b.iter_custom(|iters| {
                time_in_task(&rt, iters, &sender, |sender| async move {
                    let (reply, answer) = oneshot::channel();
                    sender.send((Bytes::from_static(b"x"), reply)).await.unwrap();
                    answer.await.unwrap();
                })
            });
        });
        group.bench_function("troupe typed ask of an active actor", |b| {
            b.iter_custom(|iters| {
                time_in_task(&rt, iters, &typed, |typed| async move {
                    typed.ask(7, Duration::from_secs(5)).await.unwrap();
                })
            });
        });
        group.finish();
        rt.block_on(runtime.shutdown());
    }
}

/// The most tasks (or actors) a kept-alive cold case holds alive at once: past it, the
/// next call of the case starts on a new runtime and the old one, with all it kept, is
/// dropped before the clock starts. Without the cap, criterion's calls kept millions
/// alive (gigabytes, allocated as the clock ran), and a run's times depended on how
/// readily the system handed out fresh memory: on 2026-12-02 the floor read 8,389 ns in
/// the first of five runs and 1,668–1,829 ns in the others.
const COLD_LIVE_MAX: u64 = 100_000;

/// A current_thread runtime with what a kept-alive cold case started on it, replaced
/// whole once it would hold more than [`COLD_LIVE_MAX`] (a single call may pass the cap
/// by itself: only criterion's warm-up makes calls that large).
struct Generation<T> {
    rt: tokio::runtime::Runtime,
    kept: Vec<T>,
}

impl<T> Generation<T> {
    fn new() -> Self {
        Self {
            rt: current_thread(),
            kept: Vec::new(),
        }
    }

    /// Makes room for `iters` more, outside the timed region: a new runtime if they
    /// would pass the cap (the old one's tasks are dropped with it).
    /// Whether `iters` more would pass the cap (a new runtime is then due).
    fn is_full_for(&self, iters: u64) -> bool {
        self.kept.len() as u64 + iters > COLD_LIVE_MAX && !self.kept.is_empty()
    }

    fn make_room(&mut self, iters: u64) {
        if self.is_full_for(iters) {
            {
                let _entered = self.rt.enter();
                self.kept.clear();
            }
            self.rt = current_thread();
        }
    }

    /// Runs `rounds` (given what is kept, returning its time and what is kept then) in a
    /// task spawned on the generation's runtime, as [`time_in_task`] does.
    fn time_in_task<F, Fut>(&mut self, rounds: F) -> Duration
    where
        T: Send + 'static,
        F: FnOnce(Vec<T>) -> Fut,
        Fut: std::future::Future<Output = (Duration, Vec<T>)> + Send + 'static,
    {
        let kept = std::mem::take(&mut self.kept);
        let (elapsed, kept) = self
            .rt
            .block_on(async move { tokio::spawn(rounds(kept)).await.unwrap() });
        self.kept = kept;
        elapsed
    }
}

fn cold_activation(c: &mut Criterion) {
    // Every side starts in memory touched before, not in pages faulted in as it starts
    // (benches/support/heap.rs).
    heap::touch_heap();
    let rt = current_thread();
    let mut group = c.benchmark_group("cold activation and first reply");
    group.bench_function("bare tokio spawn + first reply, task ends after (floor)", |b| {
        b.iter_custom(|iters| {
            time_in_task(&rt, iters, &(), |()| async {
                floor_round_trip(&spawn_floor_server()).await;
            })
        });
    });
    // Both sides keep what they activate alive, as an activated actor stays alive, up to
    // `COLD_LIVE_MAX` at a time each.
    let mut floor_servers = Generation::new();
    group.bench_function("bare tokio spawn + first reply, task kept alive (floor)", |b| {
        b.iter_custom(|iters| {
            floor_servers.make_room(iters);
            floor_servers.time_in_task(|mut kept| async move {
                let start = Instant::now();
                for _ in 0..iters {
                    let sender = spawn_floor_server();
                    floor_round_trip(&sender).await;
                    kept.push(sender);
                }
                (start.elapsed(), kept)
            })
        });
    });
    drop(floor_servers);
    // Troupe keeps its actors in its runtime: a generation is a runtime, shut down (its
    // actors deactivated) before the next one starts.
    let mut troupe = Generation::new();
    let mut runtime = Some(troupe.rt.block_on(async { echo_runtime() }));
    let mut next_key = 0u64;
    group.bench_function("troupe first invoke of a new actor id", |b| {
        b.iter_custom(|iters| {
            if troupe.is_full_for(iters) {
                if let Some(old) = runtime.take() {
                    troupe.rt.block_on(old.shutdown());
                }
                troupe.make_room(iters);
                runtime = Some(troupe.rt.block_on(async { echo_runtime() }));
            }
            let handle = runtime.as_ref().expect("a runtime per generation").handle();
            // Ids are built before the clock starts: the floor has no ids to build.
            let ids: Vec<ActorId> = (0..iters).map(|i| echo(next_key + i)).collect();
            next_key += iters;
            troupe.time_in_task(|mut kept| async move {
                let start = Instant::now();
                for id in &ids {
                    handle
                        .invoke_within(id, Bytes::from_static(b"x"), Duration::from_secs(5))
                        .await
                        .unwrap();
                }
                let elapsed = start.elapsed();
                kept.extend(std::iter::repeat_n((), ids.len()));
                (elapsed, kept)
            })
        });
    });
    if let Some(runtime) = runtime.take() {
        troupe.rt.block_on(runtime.shutdown());
    }
    drop(troupe);
    // The libraries, each keeping its actors alive as Troupe does.
    let mut ractors = Generation::new();
    group.bench_function("ractor spawn + first call, actor kept alive", |b| {
        b.iter_custom(|iters| {
            ractors.make_room(iters);
            ractors.time_in_task(|mut kept| async move {
                let start = Instant::now();
                for _ in 0..iters {
                    let actor = peers::ractor_echo::spawn().await;
                    peers::ractor_echo::ask(&actor, Bytes::from_static(b"x")).await;
                    kept.push(actor);
                }
                (start.elapsed(), kept)
            })
        });
    });
    drop(ractors);
    let mut kameos = Generation::new();
    group.bench_function("kameo spawn + first ask, actor kept alive", |b| {
        b.iter_custom(|iters| {
            kameos.make_room(iters);
            kameos.time_in_task(|mut kept| async move {
                let start = Instant::now();
                for _ in 0..iters {
                    let actor = peers::kameo_echo::spawn();
                    peers::kameo_echo::ask(&actor, Bytes::from_static(b"x")).await;
                    kept.push(actor);
                }
                (start.elapsed(), kept)
            })
        });
    });
    drop(kameos);
    group.finish();
}

fn routing_is_flat(c: &mut Criterion) {
    let sizes: &[u64] = if std::env::var_os("CI").is_some() {
        &[1_000, 10_000]
    } else {
        &[1_000, 10_000, 100_000, 1_000_000]
    };
    let mut group = c.benchmark_group("hot invoke with N activated actors");
    group.sample_size(20);
    for &size in sizes {
        // The floor: N raw tokio tasks, each with its mailbox, reached by index (no
        // lookup). It shows what N live tasks cost in caches, apart from routing.
        let mut floor: Option<(tokio::runtime::Runtime, Vec<mpsc::Sender<Request>>)> = None;
        let mut index = 0u64;
        group.bench_with_input(
            BenchmarkId::new("raw tokio tasks by index (floor)", size),
            &size,
            |b, &size| {
                let (rt, senders) = floor.get_or_insert_with(|| {
                    let rt = current_thread();
                    let senders = rt.block_on(async { (0..size).map(|_| spawn_floor_server()).collect() });
                    (rt, senders)
                });
                b.iter_custom(|iters| {
                    rt.block_on(async {
                        let start = Instant::now();
                        for _ in 0..iters {
                            index = (index + 7_919) % size;
                            let (reply, answer) = oneshot::channel();
                            senders[index as usize]
                                .send((Bytes::from_static(b"x"), reply))
                                .await
                                .unwrap();
                            tokio::time::timeout(Duration::from_secs(5), answer)
                                .await
                                .unwrap()
                                .unwrap();
                        }
                        start.elapsed()
                    })
                });
            },
        );
        drop(floor);
        // Built on first use inside the closure, so a filtered-out size costs nothing.
        let mut setup: Option<(tokio::runtime::Runtime, Runtime, Vec<ActorId>)> = None;
        let mut key = 0u64;
        group.bench_with_input(BenchmarkId::new("troupe invoke by id", size), &size, |b, &size| {
            let (rt, runtime, ids) = setup.get_or_insert_with(|| {
                let rt = current_thread();
                let ids: Vec<ActorId> = (0..size).map(echo).collect();
                let runtime = rt.block_on(async {
                    let runtime = echo_runtime();
                    for id in &ids {
                        let deadline = runtime.deadline_in(Duration::from_secs(60));
                        runtime.invoke(id, Bytes::new(), deadline).await.unwrap();
                    }
                    assert_eq!(runtime.stats().await.unwrap().activations as u64, size);
                    runtime
                });
                (rt, runtime, ids)
            });
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let start = Instant::now();
                    for _ in 0..iters {
                        // Stride through the table so lookups are not all one hot entry.
                        key = (key + 7_919) % size;
                        let deadline = runtime.deadline_in(Duration::from_secs(5));
                        runtime
                            .invoke(&ids[key as usize], Bytes::from_static(b"x"), deadline)
                            .await
                            .unwrap();
                    }
                    start.elapsed()
                })
            });
        });
    }
    group.finish();
}

/// Shorter runs under `CI`.
fn config() -> Criterion {
    let quick = std::env::var_os("CI").is_some();
    Criterion::default()
        .warm_up_time(Duration::from_millis(if quick { 200 } else { 1_000 }))
        .measurement_time(Duration::from_millis(if quick { 500 } else { 3_000 }))
}

criterion_group! { name = benches; config = config(); targets = hot_round_trip, tell_and_typed, cold_activation, routing_is_flat }
criterion_main!(benches);
