//! Single activation under contention: many callers hit one cold actor at once while
//! it activates, idles out and reactivates. Property-tested over interleavings: under
//! madsim each case runs in a fresh simulator with its own seed (madsim shuffles task
//! order by seed); in the normal build on a multi-threaded tokio runtime.

#[path = "support/actors.rs"]
mod actors;

use std::sync::Arc;
use std::time::Duration;

use actors::{count, counter, op, with_counters, EventLog, Op};
use proptest::prelude::*;
use troupe::runtime::{KindConfig, MemoryStore, Runtime};

struct Outcome {
    max_concurrent: usize,
    activations: usize,
    failures: Vec<String>,
    final_count: u64,
    callers: usize,
}

/// Each caller sleeps its delay, then adds 1 to the same actor. The idle timeout is a
/// few milliseconds, so deactivations race with new calls.
async fn contend(delays_ms: Vec<u64>, idle_ms: u64) -> Outcome {
    let log = EventLog::default();
    let config = KindConfig::default().with_idle_timeout(Duration::from_millis(idle_ms));
    let rt = with_counters(Runtime::builder().store(Arc::new(MemoryStore::new())), config, &log).start();
    let callers = delays_ms.len();
    let mut tasks = Vec::new();
    for delay in delays_ms {
        let handle = rt.handle();
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(delay)).await;
            handle
                .invoke(
                    &counter("hot"),
                    op(Op::Add(1)),
                    handle.deadline_in(Duration::from_secs(10)),
                )
                .await
        }));
    }
    let mut failures = Vec::new();
    for task in tasks {
        if let Err(error) = task.await.expect("caller task panicked") {
            failures.push(error.to_string());
        }
    }
    let final_count = count(
        rt.invoke(&counter("hot"), op(Op::Get), rt.deadline_in(Duration::from_secs(10)))
            .await
            .unwrap(),
    );
    rt.shutdown().await;
    Outcome {
        max_concurrent: log.max_concurrent_activations(),
        activations: log.activations_of("hot"),
        failures,
        final_count,
        callers,
    }
}

#[cfg(madsim)]
fn run_case(seed: u64, delays_ms: Vec<u64>, idle_ms: u64) -> Outcome {
    // A fresh simulator per case, outside proptest's thread, as madsim requires.
    #[allow(clippy::disallowed_methods)]
    let runner = std::thread::spawn(move || {
        let runtime = madsim::runtime::Runtime::with_seed_and_config(seed, madsim::Config::default());
        runtime.block_on(contend(delays_ms, idle_ms))
    });
    runner.join().expect("simulation panicked")
}

#[cfg(not(madsim))]
fn run_case(_seed: u64, delays_ms: Vec<u64>, idle_ms: u64) -> Outcome {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(contend(delays_ms, idle_ms))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Goal: at most one activation of an actor is ever alive, and no acknowledged add
    /// is lost across deactivations. Method: the activation hooks log every activation
    /// and deactivation; the log is replayed to find the most activations alive at once.
    #[test]
    fn single_activation_holds_when_many_callers_hit_one_cold_actor(
        seed in any::<u64>(),
        delays_ms in proptest::collection::vec(0u64..30, 2..40),
        idle_ms in 1u64..6,
    ) {
        let outcome = run_case(seed, delays_ms, idle_ms);
        prop_assert_eq!(outcome.max_concurrent, 1, "seed {}: two activations alive at once", seed);
        prop_assert!(outcome.failures.is_empty(), "seed {}: {:?}", seed, outcome.failures);
        prop_assert_eq!(outcome.final_count, outcome.callers as u64, "seed {}: lost adds", seed);
        prop_assert!(outcome.activations >= 1);
    }
}
