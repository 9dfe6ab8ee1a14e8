//! Wall-clock ratios to the raw-tokio floor, measured in pairs: a block of floor
//! iterations, then a block of Troupe iterations, in the same task, over and over. Each
//! block takes well under a millisecond, so a pair's two blocks see the same machine;
//! the ratio of each pair is taken, and the median over the pairs is reported with the
//! spread between its quartiles.
//!
//! Why: `scripts/bench-table` times the floor and Troupe in separate criterion
//! benchmarks, seconds apart, and on the shared 2-core machine the load moves between
//! them (its runs spread 12-224 % from 2026-11-27 to 2026-11-29, and it refused to
//! write the README's table five times). A load that lasts longer than a pair slows both
//! blocks alike and leaves their ratio alone; only the ratio's own spread is left to read.
//! The order inside a pair alternates, so neither side always runs first.
//!
//! Cases (each on a current_thread runtime and a multi_thread one with 2 workers, in a
//! spawned task as `benches/runtime.rs` runs them):
//! - `invoke`: `RuntimeHandle::invoke_within` of an active echo actor, against an mpsc
//!   send and a oneshot reply;
//! - `typed ask`: `ActorRef::ask` of an active typed echo actor, the same floor;
//! - `typed tell`: `TELL_BATCH` `ActorRef::tell`s then one `ask`, against as many
//!   bounded mpsc sends then one request-reply; reported per message;
//! - `typed tell, floor reading the clock`: the same tells, against a floor whose every
//!   send also reads the clock once, as a deadline per message needs (26 ns a reading
//!   on the 2-core machine, 2026-12-05, against a raw send of about 70 ns);
//! - `typed tell_by`: the same with `ActorRef::tell_by` under one deadline computed per
//!   batch (one clock reading for the batch instead of one per message);
//! - `ractor call!` and `kameo ask`: the same echo on the libraries users would pick
//!   instead (benches/support/peers.rs), against the invoke's floor, so that they are
//!   compared with Troupe in the same way;
//! - `ractor cast` and `kameo tell`: those libraries' fire-and-forget, `TELL_BATCH`
//!   messages then one request-reply, against the typed tell's floor (neither carries a
//!   deadline; ractor's mailbox is unbounded, kameo's bounded at 64 as Troupe's);
//! - `agent one step` and `call_agent`: an agent that answers in one scripted model
//!   step, and an agent that asks another through `call_agent` (two agent turns, three
//!   model steps, in-memory store: `benches/support/scripted_agents.rs`, as
//!   `benches/agents.rs` measures them), against a plain Troupe invoke of the echo
//!   actor: issue 11's agent-level floor. The floor's block makes
//!   [`FLOOR_INVOKES_PER_AGENT_ASK`] invokes per agent ask, so both blocks last long
//!   enough to time; the ratio is per operation;
//! - `cold` (current_thread only): the first invoke of a never-seen actor id (its task
//!   spawned, its state loaded, its first turn), against spawning the floor's server
//!   task and its first round trip; both sides keep what they started alive, and the
//!   ids are made before the clock starts, as in `benches/runtime.rs`; both start in
//!   heap memory touched before the run (`benches/support/heap.rs`: in fresh memory the
//!   floor's larger servers page-fault about twice as often as Troupe's activations).
//!
//! Run: `cargo bench -p troupe-bench --bench paired` (prints a markdown table; `scripts/paired-ratios`
//! runs it several times and combines the runs).

// A bench measures wall time; the determinism lints are for the library.
#![allow(clippy::disallowed_methods, missing_docs)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::mpsc;
use troupe::agent::AgentSystem;
use troupe::core::{ActorId, ActorKind};
use troupe::runtime::{ActorRef, KindConfig, Runtime, RuntimeHandle};

#[path = "support/echo.rs"]
mod echo;
#[path = "support/floor.rs"]
mod floor;
#[path = "support/heap.rs"]
mod heap;
#[path = "support/peers.rs"]
mod peers;
// The agents of `benches/agents.rs`; the notify and delegate ones are not used here.
#[allow(dead_code)]
#[path = "support/scripted_agents.rs"]
mod scripted_agents;

use echo::{relay_runtime, ECHO_IDLE_TIMEOUT};
use floor::{
    floor_round_trip, floor_tell_batch, spawn_floor_server, spawn_relay_floor_server, spawn_tell_floor_server, Request,
    Told, TypedEcho,
};

/// Pairs measured per hot case, after [`WARM_UP_PAIRS`] that are not.
const PAIRS: usize = 2_000;

/// Pairs run and discarded first: caches, the allocator and the actors settle.
const WARM_UP_PAIRS: usize = 200;

/// Pairs measured in the cold case (each block starts new actors that stay alive, so
/// fewer: 11,000 actors and as many floor tasks in all).
const COLD_PAIRS: usize = 500;

/// Cold pairs run and discarded first.
const COLD_WARM_UP_PAIRS: usize = 50;

/// First messages per block in the cold case.
const COLD_STARTS_PER_BLOCK: u64 = 20;

/// Round trips per block in the request-reply cases: about 100-500 µs a block here.
const ROUND_TRIPS_PER_BLOCK: u64 = 200;

/// Batches per block in the tell case (each `TELL_BATCH` tells and an ask).
const BATCHES_PER_BLOCK: u64 = 8;

/// Messages per batch in the fire-and-forget case (as in `benches/runtime.rs`).
const TELL_BATCH: u64 = 32;

/// Agent asks per block in the agent cases (about 3-15 µs each here).
const AGENT_ASKS_PER_BLOCK: u64 = 20;

/// Plain invokes the floor's block makes per agent ask (the floor is one invoke).
const FLOOR_INVOKES_PER_AGENT_ASK: u64 = 10;

/// Pairs measured in the agent cases (each agent ask adds to its agents' stored logs).
const AGENT_PAIRS: usize = 1_000;

/// Agent pairs run and discarded first.
const AGENT_WARM_UP_PAIRS: usize = 100;

/// Each request's timeout: longer than any run.
const TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Case {
    Invoke,
    TypedAsk,
    Relay,
    TypedTell,
    TypedTellStamped,
    TypedTellBy,
    Ractor,
    Kameo,
    RactorTell,
    KameoTell,
    AgentStep,
    CallAgent,
    Cold,
}

impl Case {
    fn name(self) -> &'static str {
        match self {
            Case::Invoke => "invoke (invoke_within)",
            Case::TypedAsk => "typed ask",
            Case::Relay => {
                "call from a turn (invoke of an actor whose turn calls another; floor: a task that asks another)"
            }
            Case::TypedTell => "typed tell (per message, batch of 32 + an ask)",
            Case::TypedTellStamped => {
                "typed tell, against a floor whose every send also reads the clock (per message, batch of 32 + an ask)"
            }
            Case::TypedTellBy => "typed tell_by (per message, one deadline per batch of 32 + an ask)",
            Case::Ractor => "ractor call! (a peer library, same floor as invoke)",
            Case::Kameo => "kameo ask (a peer library, same floor as invoke)",
            Case::RactorTell => "ractor cast (a peer library, per message, batch of 32 + a call!; floor as typed tell)",
            Case::KameoTell => "kameo tell (a peer library, per message, batch of 32 + an ask; floor as typed tell)",
            Case::AgentStep => "agent answers in one scripted model step (floor: a plain Troupe invoke)",
            Case::CallAgent => "agent asks an agent through `call_agent` (floor: a plain Troupe invoke)",
            Case::Cold => "cold: first message to a new actor (floor: spawn, task kept alive)",
        }
    }

    /// Iterations per block, and operations per iteration (for the per-operation time).
    fn shape(self) -> (u64, u64) {
        match self {
            Case::Invoke | Case::TypedAsk | Case::Relay | Case::Ractor | Case::Kameo => (ROUND_TRIPS_PER_BLOCK, 1),
            Case::TypedTell | Case::TypedTellStamped | Case::TypedTellBy | Case::RactorTell | Case::KameoTell => {
                (BATCHES_PER_BLOCK, TELL_BATCH + 1)
            }
            Case::AgentStep | Case::CallAgent => (AGENT_ASKS_PER_BLOCK, 1),
            Case::Cold => (COLD_STARTS_PER_BLOCK, 1),
        }
    }

    /// The floor's operations per iteration (the library's are `shape().1`).
    fn floor_per_iteration(self) -> u64 {
        match self {
            Case::AgentStep | Case::CallAgent => FLOOR_INVOKES_PER_AGENT_ASK,
            _ => self.shape().1,
        }
    }

    /// Pairs discarded, then pairs measured.
    fn pairs(self) -> (usize, usize) {
        match self {
            Case::Cold => (COLD_WARM_UP_PAIRS, COLD_PAIRS),
            Case::AgentStep | Case::CallAgent => (AGENT_WARM_UP_PAIRS, AGENT_PAIRS),
            _ => (WARM_UP_PAIRS, PAIRS),
        }
    }
}

/// What both sides of a case need, made once per runtime.
#[derive(Clone)]
struct Targets {
    floor: mpsc::Sender<Request>,
    /// The relay case's floor: a server that asks `floor`'s kind of server.
    relay_floor: mpsc::Sender<Request>,
    /// The tell cases' floor: a server that only receives (its batch's closing request
    /// aside).
    tell_floor: mpsc::Sender<Told>,
    handle: RuntimeHandle,
    echo: ActorId,
    relay: ActorId,
    typed: ActorRef<TypedEcho>,
    ractor: ractor::ActorRef<peers::ractor_echo::Message>,
    kameo: kameo::actor::ActorRef<peers::kameo_echo::Echo>,
    agents: Arc<AgentSystem>,
}

/// A block of the floor; in the cold case, the servers it started (kept alive by the
/// caller, outside the timed block).
async fn floor_block(case: Case, targets: &Targets, iterations: u64) -> Vec<mpsc::Sender<Request>> {
    if case == Case::Cold {
        let mut started = Vec::with_capacity(iterations as usize);
        for _ in 0..iterations {
            let sender = spawn_floor_server();
            floor_round_trip(&sender).await;
            started.push(sender);
        }
        return started;
    }
    for _ in 0..iterations {
        if case == Case::TypedTellStamped {
            stamped_floor_tell_batch(&targets.tell_floor, TELL_BATCH).await;
            continue;
        }
        if matches!(
            case,
            Case::TypedTell | Case::TypedTellBy | Case::RactorTell | Case::KameoTell
        ) {
            floor_tell_batch(&targets.tell_floor, TELL_BATCH).await;
            continue;
        }
        if matches!(case, Case::AgentStep | Case::CallAgent) {
            for _ in 0..FLOOR_INVOKES_PER_AGENT_ASK {
                targets
                    .handle
                    .invoke_within(&targets.echo, Bytes::from_static(b"x"), TIMEOUT)
                    .await
                    .unwrap();
            }
            continue;
        }
        if case == Case::Relay {
            floor_round_trip(&targets.relay_floor).await;
            continue;
        }
        floor_round_trip(&targets.floor).await;
    }
    Vec::new()
}

/// As `floor_tell_batch`, with the one thing a told message with a timeout needs that a
/// raw send does not: a reading of the clock for its deadline (`Instant::now()` plus
/// the timeout, kept from being optimized away). Troupe's `tell` reads the clock once
/// per message for the same reason; this floor shows what is left of its ratio once
/// that reading is on both sides (`tell_by`, whose caller reads the clock once per
/// batch, is the other way to see it).
async fn stamped_floor_tell_batch(sender: &mpsc::Sender<Told>, count: u64) {
    for _ in 0..count {
        std::hint::black_box(Instant::now() + TIMEOUT);
        sender.send((Bytes::from_static(b"x"), None)).await.unwrap();
    }
    let (reply, answer) = tokio::sync::oneshot::channel();
    sender.send((Bytes::from_static(b"x"), Some(reply))).await.unwrap();
    answer.await.unwrap();
}

/// A block of the library; in the cold case, the first invoke of each of `new_ids`.
async fn troupe_block(case: Case, targets: &Targets, iterations: u64, new_ids: &[ActorId]) {
    if case == Case::Cold {
        for id in new_ids {
            targets
                .handle
                .invoke_within(id, Bytes::from_static(b"x"), TIMEOUT)
                .await
                .unwrap();
        }
        return;
    }
    for _ in 0..iterations {
        match case {
            Case::Invoke => {
                targets
                    .handle
                    .invoke_within(&targets.echo, Bytes::from_static(b"x"), TIMEOUT)
                    .await
                    .unwrap();
            }
            Case::TypedAsk => {
                targets.typed.ask(7, TIMEOUT).await.unwrap();
            }
            Case::Relay => {
                targets
                    .handle
                    .invoke_within(&targets.relay, Bytes::from_static(b"x"), TIMEOUT)
                    .await
                    .unwrap();
            }
            Case::TypedTell | Case::TypedTellStamped => {
                for message in 0..TELL_BATCH {
                    targets.typed.tell(message, TIMEOUT).await.unwrap();
                }
                targets.typed.ask(7, TIMEOUT).await.unwrap();
            }
            Case::TypedTellBy => {
                // One clock reading for the batch.
                let deadline = targets.typed.deadline_in(TIMEOUT);
                for message in 0..TELL_BATCH {
                    targets.typed.tell_by(message, deadline).await.unwrap();
                }
                targets.typed.ask(7, TIMEOUT).await.unwrap();
            }
            Case::Ractor => {
                peers::ractor_echo::ask(&targets.ractor, Bytes::from_static(b"x")).await;
            }
            Case::Kameo => {
                peers::kameo_echo::ask(&targets.kameo, Bytes::from_static(b"x")).await;
            }
            Case::RactorTell => peers::ractor_echo::tell_batch(&targets.ractor, TELL_BATCH).await,
            Case::KameoTell => peers::kameo_echo::tell_batch(&targets.kameo, TELL_BATCH).await,
            Case::AgentStep => {
                let reply = targets.agents.ask("answerer", "what is 6 x 7?").await.unwrap();
                assert_eq!(reply.text, "42");
            }
            Case::CallAgent => {
                let reply = targets.agents.ask("asker", "what is 6 x 7?").await.unwrap();
                assert_eq!(reply.text, "42");
            }
            Case::Cold => unreachable!("handled above"),
        }
    }
}

/// What the cold case keeps between pairs: the next new actor's key, and the floor's
/// servers, kept alive as activated actors stay alive.
#[derive(Default)]
struct Started {
    next_key: u64,
    floor_servers: Vec<mpsc::Sender<Request>>,
}

/// The nanoseconds of one block of each side, floor first.
async fn pair(case: Case, targets: &Targets, troupe_first: bool, started: &mut Started) -> (f64, f64) {
    let (iterations, _) = case.shape();
    // New ids are made before the clock starts: the floor has no ids to make.
    let new_ids: Vec<ActorId> = if case == Case::Cold {
        let first = started.next_key;
        started.next_key += iterations;
        (first..started.next_key)
            .map(|key| ActorId::new("echo", format!("cold-{key}")).unwrap())
            .collect()
    } else {
        Vec::new()
    };
    let mut servers = Vec::new();
    let time_floor = async {
        let start = Instant::now();
        servers = floor_block(case, targets, iterations).await;
        start.elapsed().as_secs_f64() * 1e9
    };
    let time_troupe = async {
        let start = Instant::now();
        troupe_block(case, targets, iterations, &new_ids).await;
        start.elapsed().as_secs_f64() * 1e9
    };
    let times = if troupe_first {
        let troupe = time_troupe.await;
        (time_floor.await, troupe)
    } else {
        let floor = time_floor.await;
        (floor, time_troupe.await)
    };
    started.floor_servers.extend(servers);
    times
}

/// One case's result: the medians of the per-operation times and of the pairs' ratios,
/// and the ratio's quartiles.
struct Measured {
    floor_ns: f64,
    troupe_ns: f64,
    ratio: f64,
    ratio_q1: f64,
    ratio_q3: f64,
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    let at = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[at]
}

async fn measure(case: Case, targets: Targets) -> Measured {
    let (iterations, per) = case.shape();
    let operations = (iterations * per) as f64;
    let floor_operations = (iterations * case.floor_per_iteration()) as f64;
    let (warm_up, pairs) = case.pairs();
    let mut started = Started::default();
    for index in 0..warm_up {
        pair(case, &targets, index % 2 == 1, &mut started).await;
    }
    let mut floors = Vec::with_capacity(pairs);
    let mut troupes = Vec::with_capacity(pairs);
    let mut ratios = Vec::with_capacity(pairs);
    for index in 0..pairs {
        let (floor, troupe) = pair(case, &targets, index % 2 == 1, &mut started).await;
        floors.push(floor / floor_operations);
        troupes.push(troupe / operations);
        ratios.push((troupe / operations) / (floor / floor_operations));
    }
    for values in [&mut floors, &mut troupes, &mut ratios] {
        values.sort_by(f64::total_cmp);
    }
    Measured {
        floor_ns: quantile(&floors, 0.5),
        troupe_ns: quantile(&troupes, 0.5),
        ratio: quantile(&ratios, 0.5),
        ratio_q1: quantile(&ratios, 0.25),
        ratio_q3: quantile(&ratios, 0.75),
    }
}

fn runtime(flavor: &str) -> tokio::runtime::Runtime {
    let mut builder = if flavor == "current_thread" {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        builder.worker_threads(2);
        builder
    };
    builder.enable_all().build().unwrap()
}

fn main() {
    // `cargo bench` passes `--bench`; a filter, if any, picks cases by name.
    let filter: Vec<String> = std::env::args().skip(1).filter(|arg| !arg.starts_with("--")).collect();
    // The cold case starts its tasks and actors in memory touched before, not in pages
    // faulted in as they start (see benches/support/heap.rs).
    heap::touch_heap();
    println!("| case | runtime | floor | library | ratio (median of the pairs) | quartiles |");
    println!("|---|---|---|---|---|---|");
    for flavor in ["current_thread", "multi_thread (2 workers)"] {
        let rt = runtime(flavor);
        let (echo_runtime, typed_runtime, targets) = rt.block_on(async {
            // The echo kind and the relay kind, whose turns call `echo/0`.
            let echo_runtime = relay_runtime();
            let typed_runtime = Runtime::builder()
                .register_typed::<TypedEcho>(
                    ActorKind::new("typed").unwrap(),
                    KindConfig::default().with_idle_timeout(ECHO_IDLE_TIMEOUT),
                )
                .unwrap()
                .start();
            let echo = ActorId::new("echo", "0").unwrap();
            echo_runtime
                .handle()
                .invoke_within(&echo, Bytes::new(), TIMEOUT)
                .await
                .unwrap();
            let relay = ActorId::new("relay", "0").unwrap();
            echo_runtime
                .handle()
                .invoke_within(&relay, Bytes::new(), TIMEOUT)
                .await
                .unwrap();
            let relay_floor = spawn_relay_floor_server(spawn_floor_server());
            floor_round_trip(&relay_floor).await;
            let typed = typed_runtime
                .actor_ref::<TypedEcho>(ActorId::new("typed", "0").unwrap())
                .unwrap();
            typed.ask(0, TIMEOUT).await.unwrap();
            let agents =
                scripted_agents::asker_and_answerer(KindConfig::default().with_idle_timeout(ECHO_IDLE_TIMEOUT));
            agents.ask("asker", "warm up").await.unwrap();
            let targets = Targets {
                floor: spawn_floor_server(),
                relay_floor,
                tell_floor: spawn_tell_floor_server(),
                handle: echo_runtime.handle(),
                echo,
                relay,
                typed,
                ractor: peers::ractor_echo::spawn().await,
                kameo: peers::kameo_echo::spawn(),
                agents: Arc::new(agents),
            };
            (echo_runtime, typed_runtime, targets)
        });
        for case in [
            Case::Invoke,
            Case::TypedAsk,
            Case::Relay,
            Case::TypedTell,
            Case::TypedTellStamped,
            Case::TypedTellBy,
            Case::Ractor,
            Case::Kameo,
            Case::RactorTell,
            Case::KameoTell,
            Case::AgentStep,
            Case::CallAgent,
            Case::Cold,
        ] {
            // The cold case as `benches/runtime.rs` measures it: current_thread only.
            if case == Case::Cold && flavor != "current_thread" {
                continue;
            }
            if !filter.is_empty() && !filter.iter().any(|wanted| case.name().contains(wanted.as_str())) {
                continue;
            }
            let targets = targets.clone();
            // In a spawned task, as a server's request handler would run (see
            // `time_in_task` in benches/runtime.rs).
            let measured = rt.block_on(async move { tokio::spawn(measure(case, targets)).await.unwrap() });
            println!(
                "| {} | {flavor} | {:.0} ns | {:.0} ns | **{:.2}x** | {:.2}x-{:.2}x |",
                case.name(),
                measured.floor_ns,
                measured.troupe_ns,
                measured.ratio,
                measured.ratio_q1,
                measured.ratio_q3,
            );
        }
        drop((echo_runtime, typed_runtime));
    }
}
