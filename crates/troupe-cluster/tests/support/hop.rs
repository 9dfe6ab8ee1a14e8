//! A `hop` actor for calls from turns across nodes: its request names the actors to
//! call in turn, and its reply says where it ran, how much time its turn had, and what
//! its own call returned, the typed error included.
//!
//! Request: `ping` (answers the node's name: used to place the actor on a node),
//! `trace` (answers `<node>|<the turn's trace id, or none>`), or
//! `<sleep_ms>;<key>,<key>,...`: sleep, then call `hop:<first key>` with `0;<the rest>`
//! (a leaf, with no key, calls nobody; a key `counter=<key>` calls that counter; a key
//! `slowcounter=<key>@<node>` calls that counter with `slow@<node>`, which sleeps
//! `SLOW_TURN_MS` before counting where `<node>` serves it; a key `trace=<key>` sends
//! `trace` to `hop:<key>`; a key `tellslow=<key>@<node>` tells that counter `slow@<node>`
//! and does not wait for it: the outcome is `told`). Reply: `<node>|<turn's remaining ms>|<outcome>`,
//! the outcome being `leaf`, `ok(<the callee's reply>)`, `deadlock:<k>><k>>...` (the
//! cycle's keys) or `error:<kind>`.

use std::time::Duration;

use bytes::Bytes;
use troupe_core::{ActorId, ActorKind, CallRefused, InvokeError};
use troupe_runtime::{Actor, ActorBox, ActorError, KindConfig, RuntimeBuilder, Turn};

/// The timeout each hop asks for its call, in milliseconds: longer than any test's
/// deadline, so the turn's own deadline clips it.
pub(crate) const HOP_CALL_TIMEOUT_MS: u64 = 60_000;

struct Hop {
    node: String,
}

/// The name of an error kind, as a hop reports it.
pub(crate) fn kind_of(error: &InvokeError) -> String {
    match error {
        InvokeError::Refused(CallRefused::CycleDetected { .. }) => "CycleDetected".into(),
        InvokeError::Refused(CallRefused::DepthExceeded { .. }) => "DepthExceeded".into(),
        InvokeError::Refused(other) => format!("Refused({other})"),
        InvokeError::DeadlockDetected { .. } => "DeadlockDetected".into(),
        InvokeError::Timeout { .. } => "Timeout".into(),
        InvokeError::Unreachable { .. } => "Unreachable".into(),
        InvokeError::Cancelled { .. } => "Cancelled".into(),
        InvokeError::StorageFailed { .. } => "StorageFailed".into(),
        other => format!("other({other})"),
    }
}

impl Actor for Hop {
    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        if payload.as_ref() == b"ping" {
            return Ok(Bytes::from(self.node.clone()));
        }
        if payload.as_ref() == b"trace" {
            let trace = turn
                .context()
                .trace_id()
                .map_or_else(|| "none".to_string(), |trace| trace.to_string());
            return Ok(Bytes::from(format!("{}|{trace}", self.node)));
        }
        let remaining_ms = turn.deadline().remaining_ms(turn.now());
        let text = std::str::from_utf8(&payload).map_err(|_| ActorError::rejected("not text"))?;
        let (sleep_ms, keys) = text
            .split_once(';')
            .ok_or_else(|| ActorError::rejected("expected <sleep_ms>;<keys>"))?;
        let sleep_ms: u64 = sleep_ms.parse().map_err(|_| ActorError::rejected("bad sleep"))?;
        if sleep_ms > 0 {
            tokio::time::sleep(Duration::from_millis(sleep_ms)).await;
        }
        let outcome = match keys.split_once(',').map_or((keys, ""), |(first, rest)| (first, rest)) {
            ("", _) => "leaf".to_string(),
            (first, _) if first.starts_with("tellslow=") => {
                let slow = &first["tellslow=".len()..];
                let (key, node) = slow
                    .split_once('@')
                    .ok_or_else(|| ActorError::rejected("expected tellslow=<key>@<node>"))?;
                let counter = ActorId::new("counter", key).expect("an actor id");
                let told = turn
                    .caller()
                    .tell(
                        &counter,
                        Bytes::from(format!("slow@{node}")),
                        Duration::from_millis(HOP_CALL_TIMEOUT_MS),
                    )
                    .await;
                match told {
                    Ok(()) => "told".to_string(),
                    Err(error) => format!("error:{}", kind_of(&error)),
                }
            }
            (first, rest) => {
                let (target, request) = match first.strip_prefix("slowcounter=") {
                    Some(slow) => {
                        let (key, node) = slow
                            .split_once('@')
                            .ok_or_else(|| ActorError::rejected("expected slowcounter=<key>@<node>"))?;
                        let counter = ActorId::new("counter", key).expect("an actor id");
                        (counter, Bytes::from(format!("slow@{node}")))
                    }
                    None => match first.strip_prefix("trace=") {
                        Some(key) => (hop(key), Bytes::from_static(b"trace")),
                        None => (target_of(first), Bytes::from(format!("0;{rest}"))),
                    },
                };
                match turn
                    .invoke(&target, request, Duration::from_millis(HOP_CALL_TIMEOUT_MS))
                    .await
                {
                    Ok(reply) => format!("ok({})", String::from_utf8_lossy(&reply)),
                    Err(InvokeError::DeadlockDetected { cycle }) => {
                        let keys: Vec<&str> = cycle.iter().map(ActorId::key).collect();
                        format!("deadlock:{}", keys.join(">"))
                    }
                    Err(error) => format!("error:{}", kind_of(&error)),
                }
            }
        };
        Ok(Bytes::from(format!("{}|{remaining_ms}|{outcome}", self.node)))
    }
}

/// Registers the `hop` kind, whose replies name `node`, on `builder`.
pub(crate) fn with_hop(builder: RuntimeBuilder, node: &str) -> RuntimeBuilder {
    let node = node.to_string();
    builder
        .register(
            ActorKind::new("hop").expect("a kind name"),
            move |_id: &ActorId, _saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
                Ok(ActorBox::new(Hop { node: node.clone() }))
            },
            KindConfig::default(),
        )
        .expect("register the hop")
}

/// The actor a hop calls for `key`: `counter=<key>` is a counter, anything else a hop.
fn target_of(key: &str) -> ActorId {
    match key.strip_prefix("counter=") {
        Some(counter) => ActorId::new("counter", counter).expect("an actor id"),
        None => hop(key),
    }
}

pub(crate) fn hop(key: &str) -> ActorId {
    ActorId::new("hop", key).expect("an actor id")
}

/// One hop's reply, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HopReply {
    pub(crate) node: String,
    pub(crate) remaining_ms: u64,
    pub(crate) outcome: Outcome,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    Leaf,
    Ok(Box<HopReply>),
    Deadlock(Vec<String>),
    Error(String),
}

pub(crate) fn parse_hop(reply: &str) -> HopReply {
    let mut parts = reply.splitn(3, '|');
    let node = parts.next().expect("node").to_string();
    let remaining_ms = parts.next().expect("remaining").parse().expect("a number");
    let rest = parts.next().expect("outcome");
    let outcome = if rest == "leaf" {
        Outcome::Leaf
    } else if let Some(inner) = rest.strip_prefix("ok(").and_then(|text| text.strip_suffix(')')) {
        Outcome::Ok(Box::new(parse_hop(inner)))
    } else if let Some(cycle) = rest.strip_prefix("deadlock:") {
        Outcome::Deadlock(cycle.split('>').map(str::to_string).collect())
    } else if let Some(kind) = rest.strip_prefix("error:") {
        Outcome::Error(kind.to_string())
    } else {
        panic!("an unknown outcome {rest:?}");
    };
    HopReply {
        node,
        remaining_ms,
        outcome,
    }
}

/// Whether `cycle` (first and last the same) is a rotation of `expected` (the ring's
/// keys, once each).
pub(crate) fn is_rotation_of(cycle: &[String], expected: &[&str]) -> bool {
    if cycle.len() != expected.len() + 1 || cycle.first() != cycle.last() {
        return false;
    }
    let ring = &cycle[..expected.len()];
    (0..expected.len()).any(|shift| (0..expected.len()).all(|i| ring[i] == expected[(i + shift) % expected.len()]))
}
