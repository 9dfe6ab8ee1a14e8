//! A2A task records written straight into a store before a server starts on it, as a
//! server stores them (key space `troupe-a2a/{agent}`): in the form of the versions
//! before status times were kept (no `state_since_micros`) unless the test adds one.
//!
//! Included by the A2A test files with `#[path = "support/a2a_records.rs"] mod
//! a2a_records;` (the other test files do not need it).
#![allow(dead_code)]

use axum::body::Bytes;
use serde_json::{json, Value};
use troupe_core::ActorId;
use troupe_runtime::{StateChange, StateStore, TurnCommit};

/// Task `seq` of `agent`, numbered by cluster node `node` (None: a single server), in
/// `state` (Troupe's name: `"Completed"`, `"Working"`, ...), started by a message of
/// `text` (its id `stored-m{seq}`, or `stored-{node}-m{seq}`, which the tests' own
/// messages do not use) and answered `reply`: its store key and its record.
pub(crate) fn stored_task(
    agent: &str,
    node: Option<&str>,
    seq: u64,
    state: &str,
    text: &str,
    reply: Option<&str>,
) -> (String, Value) {
    let (id, context_id, message_id, key) = match node {
        Some(node) => (
            format!("{agent}-task-{node}-{seq}"),
            format!("{agent}-context-{node}-{seq}"),
            format!("stored-{node}-m{seq}"),
            format!("task/{node}/{seq:020}"),
        ),
        None => (
            format!("{agent}-task-{seq}"),
            format!("{agent}-context-{seq}"),
            format!("stored-m{seq}"),
            format!("task/{seq:020}"),
        ),
    };
    let mut record = json!({
        "id": id,
        "seq": seq,
        "agent": agent,
        "context_id": context_id,
        "state": state,
        "request": {
            "messageId": message_id,
            "role": "ROLE_USER",
            "parts": [{"text": text}],
            "taskId": id,
            "contextId": context_id,
        },
        "reply": reply,
        "reply_meta": null,
        "reason": null,
        "chain": [],
        "depth": 0,
        "timeout_ms": 10_000,
        "busy": false,
        "trace_id": "",
    });
    if let Some(node) = node {
        record["node"] = json!(node);
    }
    (key, record)
}

/// Writes `records` ([`stored_task`]s) to `agent`'s A2A key space in `store`.
pub(crate) async fn write_records(store: &dyn StateStore, agent: &str, records: &[(String, Value)]) {
    let id = ActorId::new("troupe-a2a", agent).unwrap();
    let claimed = store.claim(&id).await.unwrap();
    let writes = records
        .iter()
        .map(|(key, record)| (key.clone(), Some(Bytes::from(record.to_string()))))
        .collect();
    let commit = TurnCommit {
        state: StateChange::Unchanged,
        writes,
    };
    store.commit(&id, claimed.fence, commit).await.unwrap();
}
