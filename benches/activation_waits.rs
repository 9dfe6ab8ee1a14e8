//! The longest waits while a runtime activates 1.2 million actors, one after another.
//!
//! Each first invoke of a new id is timed; the run prints the median, the 99th and
//! 99.99th percentiles, and the longest waits with the number of activations before
//! them. A table that outgrows its room moves its entries while the invoke that made it
//! grow waits: with one hash table each for the activation table, the route map and the
//! memory store, the invoke at 917,504 (7/8 of 2^20) waited 1.24–1.33 s on the 2-core
//! machine (2026-12-03); with the tables split in 64 shards (`IdMap`,
//! crates/troupe-runtime/src/fast_hash.rs), 19–27 ms. Wall time, not a test: run it on a
//! quiet machine. It starts in heap memory touched before (benches/support/heap.rs), and
//! holds about 1.6 GB at its end.
//!
//! Run: `cargo bench -p troupe-bench --bench activation_waits`.

// A bench measures wall time.
#![allow(missing_docs, clippy::disallowed_methods)]

use std::time::{Duration, Instant};

use bytes::Bytes;
use troupe::core::ActorId;

#[path = "support/echo.rs"]
mod echo;
#[path = "support/heap.rs"]
mod heap;

/// Actors activated (past 917,504, where a table of 2^20 slots grows).
const ACTIVATIONS: u64 = 1_200_000;
/// The longest waits printed.
const LONGEST_SHOWN: usize = 10;

fn main() {
    heap::touch_heap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        // In a spawned task, as a server's request handler would run.
        tokio::spawn(async {
            let runtime = echo::echo_runtime();
            let handle = runtime.handle();
            let ids: Vec<ActorId> = (0..ACTIVATIONS)
                .map(|key| ActorId::new("echo", key.to_string()).unwrap())
                .collect();
            let mut waits: Vec<(Duration, usize)> = Vec::with_capacity(ids.len());
            let start = Instant::now();
            for (before, id) in ids.iter().enumerate() {
                let invoked = Instant::now();
                handle
                    .invoke_within(id, Bytes::from_static(b"x"), Duration::from_secs(30))
                    .await
                    .unwrap();
                waits.push((invoked.elapsed(), before));
            }
            let total = start.elapsed();
            waits.sort_unstable();
            let at = |fraction: f64| waits[((waits.len() - 1) as f64 * fraction) as usize].0;
            println!(
                "{ACTIVATIONS} activations in {total:.2?}: median {:.2?}, p99 {:.2?}, p99.99 {:.2?}",
                at(0.5),
                at(0.99),
                at(0.9999)
            );
            println!("longest waits (activations before it: wait):");
            for (wait, before) in waits.iter().rev().take(LONGEST_SHOWN) {
                println!("  {before}: {wait:.2?}");
            }
            // The runtime's 1.2 million actors go with the process rather than one by one.
            std::mem::forget(runtime);
        })
        .await
        .unwrap();
    });
}
