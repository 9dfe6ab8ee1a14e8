//! A cluster node that takes an agent's A2A records over reads them all back: the tasks
//! other nodes numbered and stored (their records are in the shared store) are served
//! by `GetTask` and `ListTasks`, and one that had not ended is resumed and runs to its
//! end. A real `troupe_server::serve` with `ServerConfig::node`, the real `AgentSystem`
//! on the scripted model, a shared in-memory store holding the records a dead node
//! `h0` (and another, `h2`) wrote, in the stored format.
//!
//! The refusal while another live node holds the records, with etcd's placements, is
//! tested with `troupe node` processes (`crates/troupe-cli/tests/cluster_processes.rs`).
//!
//! Normal build only: HTTP is not simulated (the crate is empty under madsim).
#![cfg(not(madsim))]

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use serde_json::{json, Value};
use troupe_agent::{ScriptRule, ScriptedLlm};
use troupe_core::ActorId;
use troupe_runtime::{KindConfig, MemoryStore, StateChange, StateStore, TurnCommit};
use troupe_server::ServerConfig;

mod support;
use support::{Harness, POLL_MS, TEST_WAIT_MS_MAX};

/// A task record as a node stores it (`troupe-a2a/{agent}`, key `task/{node}/{seq}`).
fn record(node: &str, seq: u64, state: &str, text: &str, reply: Option<&str>) -> (String, Value) {
    let id = format!("echo-task-{node}-{seq}");
    let request = json!({
        "messageId": format!("{node}-m{seq}"),
        "role": "ROLE_USER",
        "parts": [{"text": text}],
        "taskId": id,
        "contextId": format!("echo-context-{node}-{seq}"),
    });
    let record = json!({
        "id": id,
        "seq": seq,
        "agent": "echo",
        "context_id": format!("echo-context-{node}-{seq}"),
        "state": state,
        "request": request,
        "reply": reply,
        "reply_meta": null,
        "reason": null,
        "chain": [],
        "depth": 0,
        "timeout_ms": 10_000,
        "busy": false,
        "trace_id": "",
        "node": node,
    });
    (format!("task/{node}/{seq:020}"), record)
}

async fn write_records(store: &MemoryStore, records: &[(String, Value)]) {
    let id = ActorId::new("troupe-a2a", "echo").unwrap();
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

async fn rpc(server: &Harness, method: &str, params: Value) -> Value {
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
    let (status, answer) = server.post("/a2a/echo", body).await;
    assert_eq!(status, 200, "{method}: {answer}");
    assert!(answer.get("error").is_none(), "{method}: {answer}");
    answer["result"].clone()
}

fn reply_text(task: &Value) -> &str {
    task["status"]["message"]["parts"][0]["text"]
        .as_str()
        .unwrap_or_default()
}

/// Goal: node h1, taking over agent `echo`'s A2A records, serves the tasks h0 and h2
/// numbered (one ended, read back as it was), resumes h0's task that was working when
/// h0 died (it completes with the agent's reply), numbers its own new task after all of
/// them, and lists them newest first a page at a time, telling apart two tasks two
/// nodes gave the same number. Method: write the records to the shared store first,
/// then start the server with `ServerConfig::node("h1")` and ask it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_taking_an_agents_a2a_records_over_serves_and_resumes_the_tasks_other_nodes_stored() {
    let store = MemoryStore::new();
    write_records(
        &store,
        &[
            record("h0", 0, "Completed", "first", Some("echo: first")),
            record("h0", 1, "Working", "resume me", None),
            record("h2", 1, "Completed", "from h2", Some("echo: from h2")),
        ],
    )
    .await;
    let builder = support::agents(
        ScriptedLlm::new().rule(ScriptRule::agent("echo").reply("echo: {input}")),
        &["echo"],
        KindConfig::default(),
    )
    .store(Arc::new(store));
    let server = Harness::start(builder, ServerConfig::default().node("h1".to_string())).await;

    let first = rpc(&server, "GetTask", json!({"id": "echo-task-h0-0"})).await;
    assert_eq!(first["status"]["state"], "TASK_STATE_COMPLETED", "{first}");
    assert_eq!(reply_text(&first), "echo: first", "{first}");

    // h0's working task is handed to the agent again and runs to its end here.
    let mut states = Vec::new();
    let mut polls = 0;
    let resumed = loop {
        let task = rpc(&server, "GetTask", json!({"id": "echo-task-h0-1"})).await;
        let state = task["status"]["state"].as_str().unwrap().to_string();
        if states.last() != Some(&state) {
            states.push(state.clone());
        }
        if state == "TASK_STATE_COMPLETED" {
            break task;
        }
        assert!(
            matches!(state.as_str(), "TASK_STATE_SUBMITTED" | "TASK_STATE_WORKING"),
            "{states:?}"
        );
        polls += 1;
        assert!(polls * POLL_MS < TEST_WAIT_MS_MAX, "never completed: {states:?}");
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    };
    assert_eq!(reply_text(&resumed), "echo: resume me", "{resumed}");

    // A new task is h1's, numbered after every task read back.
    let sent = rpc(
        &server,
        "SendMessage",
        json!({"message": {"messageId": "h1-new", "role": "ROLE_USER", "parts": [{"text": "new"}]}}),
    )
    .await;
    assert_eq!(sent["task"]["id"], "echo-task-h1-2", "{sent}");
    assert_eq!(reply_text(&sent["task"]), "echo: new", "{sent}");

    let all = rpc(&server, "ListTasks", json!({})).await;
    assert_eq!(all["totalSize"], 4, "{all}");
    let mut seen = Vec::new();
    let mut tokens = Vec::new();
    let mut token = String::new();
    loop {
        let page = rpc(&server, "ListTasks", json!({"pageSize": 1, "pageToken": token})).await;
        assert_eq!(page["tasks"].as_array().map(Vec::len), Some(1), "{page}");
        seen.push(page["tasks"][0]["id"].as_str().unwrap().to_string());
        token = page["nextPageToken"].as_str().unwrap().to_string();
        if token.is_empty() {
            break;
        }
        tokens.push(token.clone());
        assert!(seen.len() < 5, "{seen:?}");
    }
    assert_eq!(
        seen,
        ["echo-task-h1-2", "echo-task-h2-1", "echo-task-h0-1", "echo-task-h0-0"],
        "newest first, ties by node"
    );
    assert_eq!(tokens, ["2.h1", "1.h2", "1.h0"]);
    let (status, answer) = server
        .post(
            "/a2a/echo",
            json!({"jsonrpc": "2.0", "id": 2, "method": "ListTasks", "params": {"pageToken": "x.h0"}}),
        )
        .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        answer["error"]["code"], -32602,
        "a token this server did not give: {answer}"
    );
    server.stop().await;
}
