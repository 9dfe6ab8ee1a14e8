//! Test actors shared by the integration tests: a counter that can sleep, fail, write
//! to its key-value space and call other actors, and a log of activations.

#![allow(dead_code, unreachable_pub)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use troupe::core::{ActorId, ActorKind};
use troupe::runtime::{Actor, ActorBox, ActorError, KindConfig, RuntimeBuilder, Turn};

/// What a test asks a counter to do.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Op {
    /// Add to the count and reply with the new count.
    Add(u64),
    /// Reply with the count.
    Get,
    /// Sleep this many milliseconds, then add one.
    SlowAdd(u64),
    /// Add, buffer a write, then fail: nothing of it may stick.
    AddThenFail(u64),
    /// Buffer a write of `value` under `key` and add one.
    Put { key: String, value: String },
    /// Call `target` with `op` (timeout in ms) and reply with its answer.
    Call {
        target: String,
        op: Box<Op>,
        timeout_ms: u64,
        after_ms: u64,
    },
}

/// A call to counter `target` with `op`.
pub fn call(target: &str, inner: Op, timeout_ms: u64, after_ms: u64) -> Op {
    Op::Call {
        target: target.to_string(),
        op: Box::new(inner),
        timeout_ms,
        after_ms,
    }
}

/// Encodes an op.
pub fn op(op: Op) -> Bytes {
    Bytes::from(bincode::serialize(&op).unwrap())
}

/// Decodes a counter's reply.
pub fn count(reply: Bytes) -> u64 {
    bincode::deserialize(&reply).unwrap()
}

/// What happened to which activation, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Activated(String, u64),
    TurnStarted(String),
    Deactivated(String, u64),
}

/// A shared, ordered log of activation events.
#[derive(Clone, Default)]
pub struct EventLog(Arc<Mutex<Vec<Event>>>);

impl EventLog {
    pub fn push(&self, event: Event) {
        self.0.lock().unwrap().push(event);
    }
    pub fn events(&self) -> Vec<Event> {
        self.0.lock().unwrap().clone()
    }
    pub fn activations_of(&self, key: &str) -> usize {
        self.events()
            .iter()
            .filter(|e| matches!(e, Event::Activated(k, _) if k == key))
            .count()
    }
    /// The most activations of one actor alive at the same moment, over the log.
    pub fn max_concurrent_activations(&self) -> usize {
        let mut live: std::collections::BTreeMap<String, usize> = Default::default();
        let mut max = 0;
        for event in self.events() {
            match event {
                Event::Activated(key, _) => {
                    let n = live.entry(key).or_default();
                    *n += 1;
                    max = max.max(*n);
                }
                Event::Deactivated(key, _) => *live.entry(key).or_default() -= 1,
                Event::TurnStarted(_) => {}
            }
        }
        max
    }
}

pub struct Counter {
    key: String,
    count: u64,
    log: EventLog,
}

impl Actor for Counter {
    async fn on_activate(&mut self, _id: &ActorId) -> Result<(), ActorError> {
        self.log.push(Event::Activated(self.key.clone(), self.count));
        Ok(())
    }

    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        self.log.push(Event::TurnStarted(self.key.clone()));
        let op: Op = bincode::deserialize(&payload).map_err(|e| ActorError::failed(e.to_string()))?;
        match op {
            Op::Add(n) => self.count += n,
            Op::Get => {}
            Op::SlowAdd(ms) => {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                self.count += 1;
            }
            Op::AddThenFail(n) => {
                self.count += n;
                turn.put("doomed", Bytes::from_static(b"x"))?;
                return Err(ActorError::failed("planned failure"));
            }
            Op::Put { key, value } => {
                turn.put(key, Bytes::from(value))?;
                self.count += 1;
            }
            Op::Call {
                target,
                op: inner,
                timeout_ms,
                after_ms,
            } => {
                if after_ms > 0 {
                    tokio::time::sleep(Duration::from_millis(after_ms)).await;
                }
                let target = ActorId::new("counter", target).unwrap();
                let reply = turn
                    .invoke(&target, self::op(*inner), Duration::from_millis(timeout_ms))
                    .await?;
                return Ok(reply);
            }
        }
        Ok(Bytes::from(bincode::serialize(&self.count).unwrap()))
    }

    async fn on_deactivate(&mut self, _id: &ActorId) -> Result<(), ActorError> {
        self.log.push(Event::Deactivated(self.key.clone(), self.count));
        Ok(())
    }

    fn snapshot(&self) -> Result<Option<Bytes>, ActorError> {
        Ok(Some(Bytes::from(bincode::serialize(&self.count).unwrap())))
    }
}

/// The counter kind.
pub fn counter_kind() -> ActorKind {
    ActorKind::new("counter").unwrap()
}

/// The id of counter `key`.
pub fn counter(key: &str) -> ActorId {
    ActorId::new("counter", key).unwrap()
}

/// Registers the counter kind with `config`, logging into `log`.
pub fn with_counters(builder: RuntimeBuilder, config: KindConfig, log: &EventLog) -> RuntimeBuilder {
    let log = log.clone();
    builder
        .register(
            counter_kind(),
            move |id: &ActorId, saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
                let count = match saved {
                    Some(bytes) => bincode::deserialize(&bytes).map_err(|e| ActorError::failed(e.to_string()))?,
                    None => 0,
                };
                Ok(ActorBox::new(Counter {
                    key: id.key().to_string(),
                    count,
                    log: log.clone(),
                }))
            },
            config,
        )
        .unwrap()
}
