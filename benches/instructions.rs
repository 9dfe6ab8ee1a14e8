//! The hot paths of issue 11's targets as plain loops, for counting instructions (not
//! time): `bash scripts/instr-count` runs each case under valgrind's callgrind at two
//! iteration counts and divides the difference of the totals by the difference of the
//! counts, so start-up and warm-up cancel out. Instruction counts do not move with the
//! machine's load, which wall-clock ratios on a shared 2-core machine do (docs/
//! architecture.md, "Checked again (2026-11-27)").
//!
//! Each Troupe case has its raw-tokio floor written the same way (a task that owns an
//! mpsc receiver and answers over a oneshot), current_thread, run in a spawned task as
//! the criterion benches do (`benches/runtime.rs`: `time_in_task`).
//!
//! Run one case: `cargo bench -p troupe-bench --bench instructions -- CASE ITERATIONS`
//! (cases: see [`CASES`]). Without a case (`cargo bench` passes only `--bench`) it runs
//! every case a few times, as a smoke test.

// A bench is not library code: the determinism lints are for the runtime.
#![allow(clippy::disallowed_methods, missing_docs)]

use std::time::Duration;

use bytes::Bytes;
use tokio::sync::oneshot;
use troupe::core::{ActorId, ActorKind};
use troupe::runtime::{ActorError, KindConfig, Runtime, Turn, TypedActor};

#[path = "support/echo.rs"]
mod echo;
#[path = "support/floor.rs"]
mod floor;
#[path = "support/peers.rs"]
mod peers;
#[path = "support/scripted_agents.rs"]
mod scripted_agents;

use echo::{echo_runtime, relay_runtime, ECHO_IDLE_TIMEOUT};
use floor::{
    floor_round_trip, floor_tell_batch, spawn_floor_server, spawn_relay_floor_server, spawn_tell_floor_server,
    TypedEcho,
};

/// The cases, each with what one iteration is.
const CASES: [(&str, &str); 21] = [
    (
        "invoke-floor",
        "mpsc send + oneshot reply (the raw-tokio floor of an invoke)",
    ),
    ("invoke", "RuntimeHandle::invoke_within of an active echo actor"),
    ("typed-ask", "ActorRef::ask of an active typed echo actor"),
    (
        "relay-floor",
        "a request to a task that asks another task and answers with its reply (the relay's floor)",
    ),
    (
        "relay",
        "RuntimeHandle::invoke_within of an active relay actor, whose turn calls an echo actor (Turn::invoke)",
    ),
    (
        "typed-relay",
        "ActorRef::ask of an active typed relay, whose turn asks a typed echo (ActorRef::ask_from)",
    ),
    ("tell-floor", "TELL_BATCH bounded mpsc sends, then one request-reply"),
    ("tell", "TELL_BATCH ActorRef::tell, then one ActorRef::ask"),
    (
        "tell-by",
        "TELL_BATCH ActorRef::tell_by under one deadline, then one ActorRef::ask",
    ),
    ("ractor", "ractor call! of an active echo actor (a peer library)"),
    ("kameo", "kameo ask of an active echo actor (a peer library)"),
    (
        "ractor-tell",
        "TELL_BATCH ractor casts, then one call! (a peer library)",
    ),
    ("kameo-tell", "TELL_BATCH kameo tells, then one ask (a peer library)"),
    ("agent-step", "an agent that answers in one scripted model step"),
    ("call-agent", "an agent that asks another through call_agent"),
    (
        "notify",
        "AgentClient::notify_as from a to b, until b's turn on it ended",
    ),
    (
        "notify-batch",
        "NOTIFY_BATCH AgentClient::notify_as from a to b, until b's turns on all ended",
    ),
    (
        "delegate",
        "AgentClient::delegate from a to b, until a's turn on the result ended",
    ),
    (
        "plain-invoke",
        "invoke of an echo actor through Runtime::invoke (call-agent's floor)",
    ),
    (
        "cold-floor",
        "spawn the floor's server and make its first round trip, the server kept alive",
    ),
    (
        "cold",
        "the first invoke of a new actor id (ids made before), the actor kept active",
    ),
];

/// Messages per batch in the fire-and-forget cases (as in `benches/runtime.rs`).
const TELL_BATCH: u64 = 32;

/// Notifications per batch in the `notify-batch` case (as in `benches/agents.rs`).
const NOTIFY_BATCH: u64 = 32;

/// Iterations per case when run as a smoke test (no case named).
const SMOKE_ITERATIONS: u64 = 20;

/// Each request's timeout: longer than any run.
const TIMEOUT: Duration = Duration::from_secs(60);

/// Asks `typed/0` (a [`TypedEcho`]) from its turn with the message it got, and answers
/// with the echo's reply: the typed relay's round trip is a typed ask plus one typed
/// call from a turn (`Turn::actor_ref`, `ActorRef::ask_from`), as written in a handler.
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct TypedRelay;

impl TypedActor for TypedRelay {
    type Message = u64;
    type Reply = u64;

    async fn handle(&mut self, turn: &mut Turn, message: u64) -> Result<u64, ActorError> {
        let echo = turn.actor_ref::<TypedEcho>(ActorId::new("typed", "0")?)?;
        Ok(echo.ask_from(turn.caller(), message, TIMEOUT).await?)
    }
}

/// A runtime with the typed kinds `typed` ([`TypedEcho`]) and `typed-relay`.
fn typed_runtime() -> Runtime {
    Runtime::builder()
        .register_typed::<TypedEcho>(
            ActorKind::new("typed").unwrap(),
            KindConfig::default().with_idle_timeout(ECHO_IDLE_TIMEOUT),
        )
        .unwrap()
        .register_typed::<TypedRelay>(
            ActorKind::new("typed-relay").unwrap(),
            KindConfig::default().with_idle_timeout(ECHO_IDLE_TIMEOUT),
        )
        .unwrap()
        .start()
}

/// Runs `iterations` of `case` (after one warm-up iteration that activates what the
/// case calls) in a task spawned on a current_thread runtime.
async fn run(case: &str, iterations: u64) {
    let task = match case {
        "invoke-floor" => {
            let sender = spawn_floor_server();
            tokio::spawn(async move {
                for _ in 0..iterations {
                    let (reply, answer) = oneshot::channel();
                    sender.send((Bytes::from_static(b"x"), reply)).await.unwrap();
                    answer.await.unwrap();
                }
            })
        }
        "invoke" | "plain-invoke" => {
            let runtime = echo_runtime();
            let target = ActorId::new("echo", "0").unwrap();
            let handle = runtime.handle();
            let within = case == "invoke";
            handle
                .invoke_within(&target, Bytes::from_static(b"x"), TIMEOUT)
                .await
                .unwrap();
            tokio::spawn(async move {
                for _ in 0..iterations {
                    if within {
                        handle
                            .invoke_within(&target, Bytes::from_static(b"x"), TIMEOUT)
                            .await
                            .unwrap();
                    } else {
                        let deadline = runtime.deadline_in(TIMEOUT);
                        runtime
                            .invoke(&target, Bytes::from_static(b"x"), deadline)
                            .await
                            .unwrap();
                    }
                }
            })
        }
        "relay-floor" => {
            let sender = spawn_relay_floor_server(spawn_floor_server());
            floor_round_trip(&sender).await;
            tokio::spawn(async move {
                for _ in 0..iterations {
                    floor_round_trip(&sender).await;
                }
            })
        }
        "relay" => {
            let runtime = relay_runtime();
            let target = ActorId::new("relay", "0").unwrap();
            let handle = runtime.handle();
            handle
                .invoke_within(&target, Bytes::from_static(b"x"), TIMEOUT)
                .await
                .unwrap();
            tokio::spawn(async move {
                let _runtime = runtime;
                for _ in 0..iterations {
                    handle
                        .invoke_within(&target, Bytes::from_static(b"x"), TIMEOUT)
                        .await
                        .unwrap();
                }
            })
        }
        "typed-relay" => {
            let runtime = typed_runtime();
            let relay = runtime
                .actor_ref::<TypedRelay>(ActorId::new("typed-relay", "0").unwrap())
                .unwrap();
            relay.ask(0, TIMEOUT).await.unwrap();
            tokio::spawn(async move {
                let _runtime = runtime;
                for message in 0..iterations {
                    relay.ask(message, TIMEOUT).await.unwrap();
                }
            })
        }
        "typed-ask" | "tell" | "tell-by" => {
            let runtime = typed_runtime();
            let typed = runtime
                .actor_ref::<TypedEcho>(ActorId::new("typed", "0").unwrap())
                .unwrap();
            typed.ask(0, TIMEOUT).await.unwrap();
            let (tell, tell_by) = (case == "tell", case == "tell-by");
            tokio::spawn(async move {
                let _runtime = runtime;
                for _ in 0..iterations {
                    if tell {
                        for message in 0..TELL_BATCH {
                            typed.tell(message, TIMEOUT).await.unwrap();
                        }
                    }
                    if tell_by {
                        let deadline = typed.deadline_in(TIMEOUT);
                        for message in 0..TELL_BATCH {
                            typed.tell_by(message, deadline).await.unwrap();
                        }
                    }
                    typed.ask(7, TIMEOUT).await.unwrap();
                }
            })
        }
        "tell-floor" => {
            let sender = spawn_tell_floor_server();
            tokio::spawn(async move {
                for _ in 0..iterations {
                    floor_tell_batch(&sender, TELL_BATCH).await;
                }
            })
        }
        "ractor" | "ractor-tell" => {
            let actor = peers::ractor_echo::spawn().await;
            peers::ractor_echo::ask(&actor, Bytes::from_static(b"x")).await;
            let tell = case == "ractor-tell";
            tokio::spawn(async move {
                for _ in 0..iterations {
                    if tell {
                        peers::ractor_echo::tell_batch(&actor, TELL_BATCH).await;
                    } else {
                        peers::ractor_echo::ask(&actor, Bytes::from_static(b"x")).await;
                    }
                }
            })
        }
        "kameo" | "kameo-tell" => {
            let actor = peers::kameo_echo::spawn();
            peers::kameo_echo::ask(&actor, Bytes::from_static(b"x")).await;
            let tell = case == "kameo-tell";
            tokio::spawn(async move {
                for _ in 0..iterations {
                    if tell {
                        peers::kameo_echo::tell_batch(&actor, TELL_BATCH).await;
                    } else {
                        peers::kameo_echo::ask(&actor, Bytes::from_static(b"x")).await;
                    }
                }
            })
        }
        "agent-step" | "call-agent" => {
            let system =
                scripted_agents::asker_and_answerer(KindConfig::default().with_idle_timeout(ECHO_IDLE_TIMEOUT));
            let agent = if case == "agent-step" { "answerer" } else { "asker" };
            system.ask(agent, "warm up").await.unwrap();
            tokio::spawn(async move {
                for _ in 0..iterations {
                    let reply = system.ask(agent, "what is 6 x 7?").await.unwrap();
                    assert_eq!(reply.text, "42");
                }
            })
        }
        "notify" | "notify-batch" | "delegate" => {
            let (system, a_turns, b_turns) =
                scripted_agents::notifier_and_worker(KindConfig::default().with_idle_timeout(ECHO_IDLE_TIMEOUT));
            scripted_agents::notify_and_wait(&system, &b_turns, 1).await;
            let task = scripted_agents::delegate_and_wait(&system, &a_turns).await;
            scripted_agents::assert_completed(&system, &task).await;
            let notifications = match case {
                "notify" => 1,
                "notify-batch" => NOTIFY_BATCH,
                _ => 0,
            };
            tokio::spawn(async move {
                let mut task = task;
                for _ in 0..iterations {
                    if notifications > 0 {
                        scripted_agents::notify_and_wait(&system, &b_turns, notifications).await;
                    } else {
                        task = scripted_agents::delegate_and_wait(&system, &a_turns).await;
                    }
                }
                scripted_agents::assert_completed(&system, &task).await;
            })
        }
        "cold-floor" => tokio::spawn(async move {
            // Kept alive, as an activated actor stays active.
            let mut servers = Vec::with_capacity(iterations as usize);
            for _ in 0..iterations {
                let sender = spawn_floor_server();
                floor_round_trip(&sender).await;
                servers.push(sender);
            }
        }),
        "cold" => {
            let runtime = echo_runtime();
            // The ids are made before the loop, but their cost grows with the count, so
            // the difference of two counts keeps it: two allocations and a few hundred
            // instructions of each iteration are the bench's, not the runtime's.
            let ids: Vec<ActorId> = (0..iterations)
                .map(|key| ActorId::new("echo", key.to_string()).unwrap())
                .collect();
            // `Runtime::invoke`, as benches/runtime.rs's cold case calls it (and not
            // `invoke_within`: a second caller of that one here changed how the compiler
            // inlined the `invoke` case's, which moved its count by 60 instructions).
            tokio::spawn(async move {
                for id in &ids {
                    let deadline = runtime.deadline_in(TIMEOUT);
                    runtime.invoke(id, Bytes::from_static(b"x"), deadline).await.unwrap();
                }
            })
        }
        other => {
            let names: Vec<&str> = CASES.iter().map(|(name, _)| *name).collect();
            panic!("unknown case {other:?}: one of {names:?}");
        }
    };
    task.await.unwrap();
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|arg| arg != "--bench").collect();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    match args.as_slice() {
        [case, iterations] => {
            let iterations: u64 = iterations
                .parse()
                .unwrap_or_else(|_| panic!("ITERATIONS must be a whole number, not {iterations:?}"));
            runtime.block_on(run(case, iterations));
        }
        [] => {
            for (case, what) in CASES {
                println!("{case}: {what} (x{SMOKE_ITERATIONS})");
                runtime.block_on(run(case, SMOKE_ITERATIONS));
            }
        }
        _ => panic!("usage: cargo bench -p troupe-bench --bench instructions -- CASE ITERATIONS"),
    }
}
