//! Single activation under contention: many callers hit one cold actor at once while
//! it activates, idles out and reactivates. Property-tested over interleavings: under
//! madsim each case runs in a fresh simulator with its own seed (madsim shuffles task
//! order by seed); in the normal build on a multi-threaded tokio runtime.
//!
//! The activation log must be exactly a sequence of whole activations, each resuming
//! the count the previous one ended with. Under madsim (exact virtual time) the number
//! of activations must also fit the idle rule: an actor idle for a whole idle timeout
//! (measured in periods from its activation) is deactivated, so a gap between two
//! callers longer than two idle timeouts always ends an activation, and one shorter
//! than one idle timeout never does.

#[path = "support/actors.rs"]
mod actors;

use std::sync::Arc;
use std::time::Duration;

use actors::{count, counter, op, with_counters, EventLog, Op};
use proptest::prelude::*;
use troupe::runtime::{KindConfig, MemoryStore, Runtime};

struct Outcome {
    max_concurrent: usize,
    /// The actor's activations and deactivations, in order.
    lifecycle: Vec<actors::Event>,
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
        lifecycle: log
            .events()
            .into_iter()
            .filter(|event| !matches!(event, actors::Event::TurnStarted(_)))
            .collect(),
        failures,
        final_count,
        callers,
    }
}

/// The activations the idle rule allows for callers at `delays_ms` with an idle timeout
/// of `idle_ms`, as (fewest, most): every gap between consecutive callers longer than
/// two idle timeouts starts a new activation, and only gaps of at least one can. (A
/// caller's sleep lasts at least 1 ms under madsim, as a tokio timer's does: a delay of
/// 0 calls at 1 ms.)
fn activations_allowed(delays_ms: &[u64], idle_ms: u64) -> (usize, usize) {
    let mut sorted: Vec<u64> = delays_ms.iter().map(|delay| (*delay).max(1)).collect();
    sorted.sort_unstable();
    let gaps: Vec<u64> = sorted.windows(2).map(|pair| pair[1] - pair[0]).collect();
    let certain = gaps.iter().filter(|gap| **gap > 2 * idle_ms).count();
    let possible = gaps.iter().filter(|gap| **gap >= idle_ms).count();
    (1 + certain, 1 + possible)
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
        let allowed = activations_allowed(&delays_ms, idle_ms);
        let outcome = run_case(seed, delays_ms, idle_ms);
        prop_assert_eq!(outcome.max_concurrent, 1, "seed {}: two activations alive at once", seed);
        prop_assert!(outcome.failures.is_empty(), "seed {}: {:?}", seed, outcome.failures);
        prop_assert_eq!(outcome.final_count, outcome.callers as u64, "seed {}: lost adds", seed);
        // Exactly whole activations (the last one ended by the shutdown), each resuming
        // the count the previous one ended with, and the last ending with every add.
        let mut expected = Vec::new();
        let mut resumed = 0;
        for (index, event) in outcome.lifecycle.iter().enumerate() {
            if index % 2 == 0 {
                expected.push(actors::Event::Activated("hot".to_string(), resumed));
            } else if let actors::Event::Deactivated(_, count) = event {
                resumed = *count;
                expected.push(actors::Event::Deactivated("hot".to_string(), resumed));
            } else {
                expected.push(actors::Event::Deactivated("hot".to_string(), resumed));
            }
        }
        prop_assert_eq!(&outcome.lifecycle, &expected, "seed {}: not whole activations resuming their state", seed);
        prop_assert_eq!(outcome.lifecycle.len() % 2, 0, "seed {}: an activation never ended: {:?}", seed, outcome.lifecycle);
        prop_assert_eq!(
            outcome.lifecycle.last(),
            Some(&actors::Event::Deactivated("hot".to_string(), outcome.callers as u64)),
            "seed {}", seed
        );
        let activations = outcome.lifecycle.len() / 2;
        if cfg!(madsim) {
            prop_assert!(
                allowed.0 <= activations && activations <= allowed.1,
                "seed {}: {} activations, the idle rule allows {:?}", seed, activations, allowed
            );
        }
    }
}
