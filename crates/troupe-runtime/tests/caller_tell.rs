//! `Caller::tell` and `Caller::tell_self_in`: fire-and-forget from a turn, with the
//! call admission rules, and self-tells that run after the turn under its chain and
//! depth (or a persisted, at-least-as-restrictive context).
//!
//! Runs in both builds.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use troupe_core::{ActorId, ActorKind, CallContext, CallRefused, Deadline, InvokeError};
use troupe_runtime::{Actor, ActorBox, ActorError, KindConfig, Runtime, Turn};

const KIND: &str = "node";

fn node(key: &str) -> ActorId {
    ActorId::new(KIND, key).unwrap()
}

/// (actor, payload, depth, chain keys, deadline) of every turn, in start order.
type Seen = Arc<Mutex<Vec<(String, String, u32, Vec<String>, Deadline)>>>;
/// The outcome of every tell, as text.
type Outcomes = Arc<Mutex<Vec<String>>>;

struct Node {
    key: String,
    seen: Seen,
    outcomes: Outcomes,
}

impl Actor for Node {
    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        let text = String::from_utf8(payload.to_vec()).unwrap();
        let chain = turn.context().chain().iter().map(|id| id.key().to_string()).collect();
        self.seen.lock().unwrap().push((
            self.key.clone(),
            text.clone(),
            turn.context().depth(),
            chain,
            turn.deadline(),
        ));
        let parts: Vec<&str> = text.splitn(3, ':').collect();
        let caller = turn.caller().clone();
        let outcome = match parts.as_slice() {
            // Call `target` with `rest` and wait (puts this actor in the chain).
            ["hop", target, rest] => {
                let reply = turn
                    .invoke(&node(target), Bytes::from(rest.to_string()), Duration::from_secs(5))
                    .await;
                return reply.map_err(ActorError::Invoke);
            }
            ["tell", target, rest] => caller
                .tell(&node(target), Bytes::from(rest.to_string()), Duration::from_secs(10))
                .await
                .map(|()| "accepted".to_string()),
            ["root-self", rest] => caller
                .tell_self_in(Bytes::from(rest.to_string()), CallContext::root(turn.deadline()))
                .await
                .map(|()| "accepted".to_string()),
            ["same-self", rest] => caller
                .tell_self_in(Bytes::from(rest.to_string()), turn.context().clone())
                .await
                .map(|()| "accepted".to_string()),
            _ => return Ok(Bytes::new()),
        };
        let outcome = match outcome {
            Ok(text) => text,
            Err(InvokeError::Refused(CallRefused::CycleDetected { chain })) => {
                let keys: Vec<&str> = chain.iter().map(ActorId::key).collect();
                format!("cycle {}", keys.join(">"))
            }
            Err(InvokeError::Rejected { .. }) => "rejected".to_string(),
            Err(other) => format!("other {other}"),
        };
        self.outcomes.lock().unwrap().push(outcome);
        Ok(Bytes::new())
    }
}

fn start(seen: &Seen, outcomes: &Outcomes) -> Runtime {
    let (seen, outcomes) = (Arc::clone(seen), Arc::clone(outcomes));
    let factory = move |id: &ActorId, _saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
        Ok(ActorBox::new(Node {
            key: id.key().to_string(),
            seen: Arc::clone(&seen),
            outcomes: Arc::clone(&outcomes),
        }))
    };
    Runtime::builder()
        .register(ActorKind::new(KIND).unwrap(), factory, KindConfig::default())
        .unwrap()
        .start()
}

/// Goal: a tell to another actor runs it at depth + 1 with the teller in its chain and a
/// deadline clipped to the teller's turn; a self-tell runs after the turn with the same
/// depth and chain and its own, later deadline; a tell back up the chain is refused as
/// a cycle with nothing sent; `tell_self_in` refuses a looser context and accepts the
/// turn's own.
#[tokio::test(start_paused = true)]
async fn tells_follow_the_call_rules_and_self_tells_keep_the_chain() {
    let seen = Seen::default();
    let outcomes = Outcomes::default();
    let runtime = start(&seen, &outcomes);
    let second = Duration::from_secs(1);
    let now = runtime.now();
    let a_deadline = runtime.deadline_in(second);
    runtime
        .invoke(&node("a"), Bytes::from("hop:b:tell:c:done"), a_deadline)
        .await
        .unwrap();
    // Told turns run on their own: let each finish before the next request.
    tokio::time::sleep(Duration::from_millis(100)).await;
    runtime
        .invoke(
            &node("a"),
            Bytes::from("hop:b:tell:a:back"),
            runtime.deadline_in(second),
        )
        .await
        .unwrap();
    // Told turns run on their own: let each finish before the next request.
    tokio::time::sleep(Duration::from_millis(100)).await;
    runtime
        .invoke(
            &node("a"),
            Bytes::from("hop:b:tell:b:later"),
            runtime.deadline_in(second),
        )
        .await
        .unwrap();
    // Told turns run on their own: let each finish before the next request.
    tokio::time::sleep(Duration::from_millis(100)).await;
    runtime
        .invoke(
            &node("a"),
            Bytes::from("hop:b:root-self:x"),
            runtime.deadline_in(second),
        )
        .await
        .unwrap();
    // Told turns run on their own: let each finish before the next request.
    tokio::time::sleep(Duration::from_millis(100)).await;
    runtime
        .invoke(
            &node("a"),
            Bytes::from("hop:b:same-self:y"),
            runtime.deadline_in(second),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        *outcomes.lock().unwrap(),
        ["accepted", "cycle a>b>a", "accepted", "rejected", "accepted"]
    );
    let seen = seen.lock().unwrap().clone();
    let turns: Vec<(String, String, u32, Vec<String>)> = seen
        .iter()
        .map(|(actor, payload, depth, chain, _)| (actor.clone(), payload.clone(), *depth, chain.clone()))
        .collect();
    let turn = |actor: &str, payload: &str, depth: u32, chain: &[&str]| {
        (
            actor.to_string(),
            payload.to_string(),
            depth,
            chain.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        )
    };
    assert_eq!(
        turns,
        [
            turn("a", "hop:b:tell:c:done", 0, &[]),
            turn("b", "tell:c:done", 1, &["a"]),
            turn("c", "done", 2, &["a", "b"]),
            turn("a", "hop:b:tell:a:back", 0, &[]),
            turn("b", "tell:a:back", 1, &["a"]),
            turn("a", "hop:b:tell:b:later", 0, &[]),
            turn("b", "tell:b:later", 1, &["a"]),
            turn("b", "later", 1, &["a"]),
            turn("a", "hop:b:root-self:x", 0, &[]),
            turn("b", "root-self:x", 1, &["a"]),
            turn("a", "hop:b:same-self:y", 0, &[]),
            turn("b", "same-self:y", 1, &["a"]),
            turn("b", "y", 1, &["a"]),
        ]
    );
    // c's deadline is clipped to b's (which is a's); b's self-told turn has its own 10 s.
    let deadline_of = |i: usize| seen[i].4;
    assert!(deadline_of(2) <= deadline_of(1) && deadline_of(1) <= a_deadline);
    // b's turn (6) must reply within 1 s; its self-told turn (7) got 10 s from the tell.
    assert!(deadline_of(7) >= Deadline::after(deadline_of(6), Duration::from_secs(9)));
    assert!(deadline_of(7) <= Deadline::after(now, Duration::from_secs(11)));
    runtime.shutdown().await;
}
