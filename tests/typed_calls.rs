//! Typed calls from inside a turn (`ActorRef::ask_from`, `ActorRef::tell_from`, with a
//! reference from `Turn::actor_ref`): they are calls of that turn, under the call rules
//! (depth + 1, the caller in the chain, cycles refused with the chain, the deadline
//! clipped to the caller's), values in process and bincode bytes through a router.
//! Both builds (paused tokio time, or the simulator); the multi-thread variant runs in
//! the normal build.

use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use troupe::core::{ActorId, ActorKind, CallRefused, InvokeError};
use troupe::runtime::{
    Actor, ActorBox, ActorError, IdempotencyKey, KindConfig, Runtime, RuntimeHandle, TellRoute, Turn, TurnCall,
    TurnCallRouter, TypedActor, WaitEdge,
};

const RELAY: &str = "relay";
const SECONDS_5: Duration = Duration::from_secs(5);
const SECONDS_5_US: u64 = 5_000_000;

/// What a relay does with a message.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum Hop {
    /// Reply with where this turn runs.
    Where,
    /// Ask relay `0` for `1` from this turn (`ask_from`), waiting at most `2` ms, and
    /// reply with its answer.
    Ask(String, Box<Hop>, u64),
    /// Tell relay `0` a `Note` from this turn (`tell_from`), then reply as `Where`.
    Tell(String),
    /// Record where this turn runs among the notes, then reply as `Where`.
    Note,
    /// Ask the actor `x` of kind `0` for `Where` from this turn (a kind that is not a
    /// relay's: the reference is refused).
    AskKind(String),
    /// Add this much to the relay's `added`, then reply as `Where`.
    Add(u64),
    /// Send relay `to` an `Add(1)` from this turn (a tell if `tell`, else an ask), under
    /// the idempotency key `key` (none if empty), then fail the turn.
    AddThenFail { to: String, key: String, tell: bool },
    /// Reply as `Where`; a message that cannot be encoded (it crosses as a value only).
    Opaque(NoWire),
}

/// A value with no wire form: encoding it fails.
#[derive(Debug, Clone, Deserialize)]
struct NoWire;

impl Serialize for NoWire {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom("NoWire has no wire form"))
    }
}

/// Where a relay's turn ran, and the notes it has.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Place {
    key: String,
    depth: u32,
    chain: Vec<String>,
    deadline_us: u64,
    notes: Vec<(u32, Vec<String>)>,
    added: u64,
}

#[derive(Default, Serialize, Deserialize)]
struct Relay {
    /// (depth, chain keys) of each `Note` turn, in order.
    notes: Vec<(u32, Vec<String>)>,
    /// The sum of the `Add`s.
    added: u64,
}

impl Relay {
    fn place(&self, turn: &Turn) -> Place {
        let context = turn.context();
        Place {
            key: turn.id().key().to_string(),
            depth: context.depth(),
            chain: context.chain().iter().map(|id| id.key().to_string()).collect(),
            deadline_us: turn.deadline().as_micros(),
            notes: self.notes.clone(),
            added: self.added,
        }
    }
}

impl TypedActor for Relay {
    type Message = Hop;
    /// The place, or why the call this turn made failed (a typed error, as it came).
    type Reply = Result<Place, InvokeError>;

    async fn handle(&mut self, turn: &mut Turn, hop: Hop) -> Result<Self::Reply, ActorError> {
        match hop {
            Hop::Where | Hop::Opaque(NoWire) => Ok(Ok(self.place(turn))),
            Hop::Ask(key, next, ms) => {
                let target = turn.actor_ref::<Relay>(ActorId::new(RELAY, key)?)?;
                Ok(target
                    .ask_from(turn.caller(), *next, Duration::from_millis(ms))
                    .await
                    .and_then(|answer| answer))
            }
            Hop::Add(n) => {
                self.added += n;
                Ok(Ok(self.place(turn)))
            }
            Hop::AddThenFail { to, key, tell } => {
                let target = turn.actor_ref::<Relay>(ActorId::new(RELAY, to)?)?;
                let caller = turn.caller();
                let sent = match (IdempotencyKey::new(&key).ok(), tell) {
                    (Some(key), true) => target.tell_keyed_from(caller, &key, Hop::Add(1), SECONDS_5).await,
                    (Some(key), false) => target
                        .ask_keyed_from(caller, &key, Hop::Add(1), SECONDS_5)
                        .await
                        .map(|_| ()),
                    (None, true) => target.tell_from(caller, Hop::Add(1), SECONDS_5).await,
                    (None, false) => target.ask_from(caller, Hop::Add(1), SECONDS_5).await.map(|_| ()),
                };
                sent?;
                Err(ActorError::failed("failed after its call"))
            }
            Hop::AskKind(kind) => {
                let target = turn.actor_ref::<Relay>(ActorId::new(kind, "x")?)?;
                Ok(target.ask_from(turn.caller(), Hop::Where, SECONDS_5).await?)
            }
            Hop::Tell(key) => {
                let target = turn.actor_ref::<Relay>(ActorId::new(RELAY, key)?)?;
                Ok(match target.tell_from(turn.caller(), Hop::Note, SECONDS_5).await {
                    Ok(()) => Ok(self.place(turn)),
                    Err(error) => Err(error),
                })
            }
            Hop::Note => {
                let place = self.place(turn);
                self.notes.push((place.depth, place.chain));
                Ok(Ok(self.place(turn)))
            }
        }
    }
}

fn relay(key: &str) -> ActorId {
    ActorId::new(RELAY, key).unwrap()
}

/// A plain bytes actor: a typed reference to it is refused.
struct Echo;

impl Actor for Echo {
    async fn handle(&mut self, _turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        Ok(payload)
    }
}

fn start() -> Runtime {
    Runtime::builder()
        .register_typed::<Relay>(ActorKind::new(RELAY).unwrap(), KindConfig::default())
        .unwrap()
        .register(
            ActorKind::new("echo").unwrap(),
            |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> { Ok(ActorBox::new(Echo)) },
            KindConfig::default(),
        )
        .unwrap()
        .start()
}

fn ask_of(to: &str, next: Hop, ms: u64) -> Hop {
    Hop::Ask(to.to_string(), Box::new(next), ms)
}

/// Asks relay `key` `hop` from outside, under 5 s, and returns the place it answers.
async fn ask(rt: &Runtime, key: &str, hop: Hop) -> Result<Place, InvokeError> {
    let reference = rt.actor_ref::<Relay>(relay(key)).unwrap();
    reference
        .ask(hop, SECONDS_5)
        .await
        .expect("the outside ask is answered")
}

fn keys(chain: &[&str]) -> Vec<String> {
    chain.iter().map(|key| (*key).to_string()).collect()
}

async fn check_asks_from_a_turn_are_its_calls() {
    let rt = start();
    let before = rt.handle().now().as_micros();

    // a asks b with 60 s: b runs at depth 1 with a in its chain, under a deadline
    // clipped to a's (5 s from the outside ask), not 60 s.
    let place = ask(&rt, "a", ask_of("b", Hop::Where, 60_000)).await.unwrap();
    assert_eq!(
        (place.key.as_str(), place.depth, place.chain.clone()),
        ("b", 1, keys(&["a"]))
    );
    let after = rt.handle().now().as_micros();
    assert!(place.deadline_us <= after + SECONDS_5_US, "{place:?} after {after}");
    assert!(place.deadline_us >= before + SECONDS_5_US, "{place:?} before {before}");

    // a → b → c, b asking with 1 s: c gets b's 1 s, the tighter one.
    let place = ask(&rt, "a", ask_of("b", ask_of("c", Hop::Where, 1_000), 60_000))
        .await
        .unwrap();
    assert_eq!(
        (place.key.as_str(), place.depth, place.chain.clone()),
        ("c", 2, keys(&["a", "b"]))
    );
    let after = rt.handle().now().as_micros();
    assert!(place.deadline_us <= after + 1_000_000, "{place:?} after {after}");

    // In process the message crosses as a value: one with no wire form arrives.
    let place = ask(&rt, "a", ask_of("b", Hop::Opaque(NoWire), 1_000)).await.unwrap();
    assert_eq!((place.key.as_str(), place.depth), ("b", 1));

    // a → b → a: refused at b's admission, with the whole chain; a did not run again.
    let refused = ask(&rt, "a", ask_of("b", ask_of("a", Hop::Where, 1_000), 60_000)).await;
    assert_eq!(
        refused,
        Err(InvokeError::Refused(CallRefused::CycleDetected {
            chain: vec![relay("a"), relay("b"), relay("a")],
        }))
    );
    // An id the turn cannot build is a rejected request; a reference to a kind that is
    // not registered (or not for this type) fails the turn; both with the reason.
    let rejected = rt
        .actor_ref::<Relay>(relay("a"))
        .unwrap()
        .ask(ask_of("bad\u{7}key", Hop::Where, 1_000), SECONDS_5)
        .await
        .unwrap_err();
    assert!(
        matches!(&rejected, InvokeError::Rejected { reason, .. } if reason.contains("which is not allowed")),
        "{rejected:?}"
    );
    for (kind, cause) in [
        ("nope", "no actor kind `nope` is registered"),
        ("echo", "registered as untyped"),
    ] {
        let failed = rt
            .actor_ref::<Relay>(relay("a"))
            .unwrap()
            .ask(Hop::AskKind(kind.to_string()), SECONDS_5)
            .await
            .unwrap_err();
        assert!(
            matches!(&failed, InvokeError::ActorFailed { cause: text, .. } if text.contains(cause)),
            "{failed:?}"
        );
    }

    // An actor asking itself is a cycle too.
    let refused = ask(&rt, "a", ask_of("a", Hop::Where, 1_000)).await;
    assert_eq!(
        refused,
        Err(InvokeError::Refused(CallRefused::CycleDetected {
            chain: vec![relay("a"), relay("a")],
        }))
    );
    rt.shutdown().await;
}

/// Goal: a typed ask from a turn (`ask_from`) is a call of that turn: depth + 1, the
/// caller in the chain, the deadline clipped to the caller's, and a cycle refused with
/// the chain.
#[tokio::test(start_paused = true)]
async fn typed_asks_from_a_turn_are_its_calls() {
    check_asks_from_a_turn_are_its_calls().await;
}

#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_asks_from_a_turn_are_its_calls_on_the_multi_thread_runtime() {
    check_asks_from_a_turn_are_its_calls().await;
}

/// Goal: a typed tell from a turn (`tell_from`) runs at depth + 1 with the caller in its
/// chain, before a later message to the same actor; one to the actor itself runs after
/// its turn, at its own depth.
#[tokio::test(start_paused = true)]
async fn typed_tells_from_a_turn_run_as_its_messages() {
    check_tells_from_a_turn_run_as_its_messages().await;
}

#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_tells_from_a_turn_run_as_its_messages_on_the_multi_thread_runtime() {
    check_tells_from_a_turn_run_as_its_messages().await;
}

async fn check_tells_from_a_turn_run_as_its_messages() {
    let rt = start();
    let told = ask(&rt, "a", Hop::Tell("b".to_string())).await.unwrap();
    assert_eq!((told.key.as_str(), told.depth), ("a", 0));
    let b = ask(&rt, "b", Hop::Where).await.unwrap();
    assert_eq!(b.notes, vec![(1, keys(&["a"]))]);

    // From a turn at depth 1 (a → b, b tells c): c's note is at depth 2.
    ask(&rt, "a", ask_of("b", Hop::Tell("c".to_string()), 1_000))
        .await
        .unwrap();
    let c = ask(&rt, "c", Hop::Where).await.unwrap();
    assert_eq!(c.notes, vec![(2, keys(&["a", "b"]))]);

    // To itself: after this turn, at this turn's depth and chain.
    ask(&rt, "d", Hop::Tell("d".to_string())).await.unwrap();
    let d = ask(&rt, "d", Hop::Where).await.unwrap();
    assert_eq!(d.notes, vec![(0, Vec::new())]);
    rt.shutdown().await;
}

/// A router that runs every call and tell here, counting them.
struct CountingRouter {
    handle: RuntimeHandle,
    calls: Mutex<u32>,
    tells: Mutex<u32>,
}

#[async_trait]
impl TurnCallRouter for CountingRouter {
    async fn call(&self, call: TurnCall) -> Result<Bytes, InvokeError> {
        *self.calls.lock().unwrap() += 1;
        self.handle
            .invoke_for_turn(&call.caller, &call.target, call.payload, call.context)
            .await
    }

    async fn tell(&self, call: TurnCall) -> TellRoute {
        *self.tells.lock().unwrap() += 1;
        TellRoute::Local(call)
    }

    fn path_leaves_node(&self, _remote_edges: Vec<WaitEdge>) {}
}

/// Goal: where a router takes a turn's calls (a cluster node), `ask_from` and
/// `tell_from` send bincode bytes through it, and the typed reply comes back, under the
/// same call rules.
#[tokio::test(start_paused = true)]
async fn typed_calls_from_a_turn_go_through_a_router_as_bytes() {
    let rt = start();
    let router = std::sync::Arc::new(CountingRouter {
        handle: rt.handle(),
        calls: Mutex::new(0),
        tells: Mutex::new(0),
    });
    assert!(rt.handle().set_turn_call_router(router.clone()).is_ok());

    let place = ask(&rt, "a", ask_of("b", Hop::Where, 60_000)).await.unwrap();
    assert_eq!((place.key.as_str(), place.depth, place.chain), ("b", 1, keys(&["a"])));
    assert_eq!(*router.calls.lock().unwrap(), 1);

    let refused = ask(&rt, "a", ask_of("b", ask_of("a", Hop::Where, 1_000), 60_000)).await;
    assert_eq!(
        refused,
        Err(InvokeError::Refused(CallRefused::CycleDetected {
            chain: vec![relay("a"), relay("b"), relay("a")],
        }))
    );
    // The refused call was never routed: admission comes first.
    assert_eq!(*router.calls.lock().unwrap(), 2);

    // Through a router the message goes as bytes: one with no wire form is refused
    // with nothing sent.
    let refused = ask(&rt, "a", ask_of("b", Hop::Opaque(NoWire), 1_000))
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, InvokeError::ActorFailed { target, cause }
            if target == &relay("b") && cause.contains("NoWire has no wire form")),
        "{refused:?}"
    );
    assert_eq!(*router.calls.lock().unwrap(), 2);

    ask(&rt, "a", Hop::Tell("c".to_string())).await.unwrap();
    assert_eq!(*router.tells.lock().unwrap(), 1);
    let c = ask(&rt, "c", Hop::Where).await.unwrap();
    assert_eq!(c.notes, vec![(1, keys(&["a"]))]);
    rt.shutdown().await;
}

/// Goal: a turn run again that sends the same keyed typed ask or tell from its turn
/// (`ask_keyed_from`, `tell_keyed_from`) applies the target's effect once; unkeyed
/// (`ask_from`, `tell_from`, the control) the effect lands each time.
#[tokio::test(start_paused = true)]
async fn a_turn_run_again_applies_its_keyed_typed_call_or_tell_once() {
    check_keyed_typed_calls_and_tells_land_once().await;
}

#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_run_again_applies_its_keyed_typed_call_or_tell_once_on_the_multi_thread_runtime() {
    check_keyed_typed_calls_and_tells_land_once().await;
}

async fn check_keyed_typed_calls_and_tells_land_once() {
    let rt = start();
    for (target, key, tell, landed) in [
        ("ask-keyed", "order-7", false, 1),
        ("ask-unkeyed", "", false, 2),
        ("tell-keyed", "order-8", true, 1),
        ("tell-unkeyed", "", true, 2),
    ] {
        for _ in 0..2 {
            let hop = Hop::AddThenFail {
                to: target.to_string(),
                key: key.to_string(),
                tell,
            };
            let failed = rt
                .actor_ref::<Relay>(relay("saga"))
                .unwrap()
                .ask(hop, SECONDS_5)
                .await
                .unwrap_err();
            assert!(
                matches!(&failed, InvokeError::ActorFailed { cause, .. } if cause.contains("failed after its call")),
                "{failed:?}"
            );
        }
        let place = ask(&rt, target, Hop::Where).await.unwrap();
        assert_eq!(place.added, landed, "{target}");
    }
    rt.shutdown().await;
}
