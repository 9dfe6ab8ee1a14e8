//! Memory per idle activated actor, measured with a counting global allocator: the
//! live heap after activating 100 000 actors (each answered one request and sits idle
//! in its task), minus the heap before, divided by the count. A bare tokio task with a
//! bounded mpsc mailbox is measured the same way as the floor, and so are the same echo
//! actor on ractor and kameo (benches/support/peers.rs).
//!
//! Run: `cargo bench -p troupe-bench --bench memory` (10 000 actors when `CI` is set).

// A bench measures wall time.
#![allow(clippy::disallowed_methods)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};
use troupe::core::{ActorId, ActorKind};
use troupe::runtime::{ActorBox, ActorError, KindConfig, Runtime};

#[path = "support/echo.rs"]
mod echo;
// Its fire-and-forget messages are for the time benches.
#[allow(dead_code)]
#[path = "support/peers.rs"]
mod peers;

use echo::{echo_runtime, Echo};

/// The memory target per idle activated actor, in bytes (issue: <= 1,800 B).
const TARGET_BYTES_PER_ACTOR: u64 = 1_800;

struct Counting;

static LIVE_BYTES: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE_BYTES.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE_BYTES.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE_BYTES.fetch_add(new_size as isize - layout.size() as isize, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn live() -> isize {
    LIVE_BYTES.load(Ordering::Relaxed)
}

async fn troupe_bytes_per_actor(count: u64) -> f64 {
    let runtime = echo_runtime();
    // Warm the runtime (first activation, table allocation patterns) before measuring.
    let warm = ActorId::new("echo", "warm").unwrap();
    runtime
        .invoke(&warm, Bytes::new(), runtime.deadline_in(Duration::from_secs(60)))
        .await
        .unwrap();
    let ids: Vec<ActorId> = (0..count)
        .map(|k| ActorId::new("echo", k.to_string()).unwrap())
        .collect();
    let before = live();
    for id in &ids {
        runtime
            .invoke(id, Bytes::new(), runtime.deadline_in(Duration::from_secs(60)))
            .await
            .unwrap();
    }
    assert_eq!(runtime.stats().await.unwrap().activations as u64, count + 1);
    let after = live();
    (after - before) as f64 / count as f64
}

async fn tokio_bytes_per_task(count: u64) -> f64 {
    let before = live();
    let mut senders = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let (sender, mut receiver) = mpsc::channel::<(Bytes, oneshot::Sender<Bytes>)>(64);
        tokio::spawn(async move {
            while let Some((payload, reply)) = receiver.recv().await {
                let _ = reply.send(payload);
            }
        });
        let (reply, answer) = oneshot::channel();
        sender.send((Bytes::new(), reply)).await.unwrap();
        answer.await.unwrap();
        senders.push(sender);
    }
    let after = live();
    (after - before) as f64 / count as f64
}

/// Live heap per idle ractor actor that answered one call.
async fn ractor_bytes_per_actor(count: u64) -> f64 {
    let warm = peers::ractor_echo::spawn().await;
    peers::ractor_echo::ask(&warm, Bytes::new()).await;
    let before = live();
    let mut actors = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let actor = peers::ractor_echo::spawn().await;
        peers::ractor_echo::ask(&actor, Bytes::new()).await;
        actors.push(actor);
    }
    let after = live();
    (after - before) as f64 / count as f64
}

/// Live heap per idle kameo actor that answered one ask.
async fn kameo_bytes_per_actor(count: u64) -> f64 {
    let warm = peers::kameo_echo::spawn();
    peers::kameo_echo::ask(&warm, Bytes::new()).await;
    let before = live();
    let mut actors = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let actor = peers::kameo_echo::spawn();
        peers::kameo_echo::ask(&actor, Bytes::new()).await;
        actors.push(actor);
    }
    let after = live();
    (after - before) as f64 / count as f64
}

/// The resident set of this process, in bytes (Linux: /proc/self/statm), if known.
fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4_096)
}

/// Activates `count` idle actors on one runtime and reports time, heap and RSS.
async fn many_idle_actors(count: u64) {
    let runtime = Runtime::builder()
        .register(
            ActorKind::new("echo").unwrap(),
            |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> { Ok(ActorBox::new(Echo)) },
            KindConfig::default().with_idle_timeout(Duration::from_secs(3_600)),
        )
        .unwrap()
        .start();
    let (heap_before, rss_before) = (live(), rss_bytes().unwrap_or(0));
    let start = std::time::Instant::now();
    for key in 0..count {
        let id = ActorId::new("echo", key.to_string()).unwrap();
        runtime
            .invoke_within(&id, Bytes::new(), Duration::from_secs(60))
            .await
            .unwrap();
        if (key + 1) % (count / 10).max(1) == 0 {
            eprintln!("  {} actors activated, {:.1} s", key + 1, start.elapsed().as_secs_f64());
        }
    }
    let took = start.elapsed();
    assert_eq!(runtime.stats().await.unwrap().activations as u64, count);
    let heap = (live() - heap_before) as f64 / count as f64;
    let rss = rss_bytes().unwrap_or(0).saturating_sub(rss_before) as f64 / count as f64;
    println!(
        "{count} idle actors activated in {:.1} s ({:.0} activations/s): heap {heap:.0} bytes/actor, RSS growth {rss:.0} bytes/actor, RSS total {} MiB",
        took.as_secs_f64(),
        count as f64 / took.as_secs_f64(),
        rss_bytes().unwrap_or(0) / (1 << 20)
    );
}

fn current_thread_rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --benches` passes nothing: run small then.
    let benching = std::env::args().any(|a| a == "--bench");
    // `cargo bench -p troupe-bench --bench memory -- --million`: one million idle actors on one node.
    if std::env::args().any(|a| a == "--million") {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(many_idle_actors(1_000_000));
        return;
    }
    let count: u64 = if std::env::var_os("CI").is_some() || !benching {
        10_000
    } else {
        100_000
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let floor = rt.block_on(tokio_bytes_per_task(count));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let troupe = rt.block_on(troupe_bytes_per_actor(count));
    let ractor = current_thread_rt().block_on(ractor_bytes_per_actor(count));
    let kameo = current_thread_rt().block_on(kameo_bytes_per_actor(count));
    println!("memory per idle activated actor ({count} actors)");
    println!("  ractor actor (one call answered): {ractor:>8.0} bytes");
    println!("  kameo actor (one ask answered): {kameo:>8.0} bytes");
    println!("  bare tokio task + mpsc mailbox (floor): {floor:>8.0} bytes");
    println!("  troupe activation (table entry, task, mailbox): {troupe:>8.0} bytes");
    println!(
        "  ratio: {:.2}x; target <= {TARGET_BYTES_PER_ACTOR} bytes: {}",
        troupe / floor,
        if troupe <= TARGET_BYTES_PER_ACTOR as f64 {
            "met"
        } else {
            "NOT met"
        }
    );
}
