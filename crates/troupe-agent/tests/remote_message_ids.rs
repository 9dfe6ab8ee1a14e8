//! The A2A message a `call_agent` to a remote agent sends is named for that call alone:
//! a Troupe server (and any A2A server that deduplicates) takes a message id it has
//! seen as the task it already started (`Resent`: the first task's answer; or
//! `MessageIdReused` when the text differs), so an id a calling process makes again
//! (after its restart, or in another process of the same agents) gets the answer to
//! another question. The message it sends must also pass the receiver's checks
//! whatever the calling agent's id (message id within
//! `AGENT_MESSAGE_ID_LENGTH_MAX_BYTES`, metadata within its limits).
//!
//! Normal build only (real HTTP on loopback; under madsim remote agents are not
//! reachable): `cargo test -p troupe-agent --test remote_message_ids`.
#![cfg(not(madsim))]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use troupe_agent::limits::AGENT_MESSAGE_ID_LENGTH_MAX_BYTES;
use troupe_agent::{AgentSpec, AgentSystem, RemoteAgent, ScriptRule, ScriptedLlm, TroupeCallMetadata};
use troupe_runtime::SqliteStore;

/// What the loopback A2A endpoint was sent: each message's id, its text and its
/// `metadata`.
#[derive(Debug, Clone)]
struct Sent {
    message_id: String,
    text: String,
    metadata: Value,
}

/// An A2A endpoint that answers every message with a completed task, "answer to
/// {text}", and, as a Troupe server does, answers a message id it has seen with the
/// task it started for it.
async fn deduplicating_endpoint(sent: Arc<Mutex<Vec<Sent>>>) -> (String, tokio::task::JoinHandle<()>) {
    let answered: Arc<Mutex<BTreeMap<String, String>>> = Arc::default();
    let endpoint = axum::routing::post(move |body: String| {
        let (sent, answered) = (Arc::clone(&sent), Arc::clone(&answered));
        async move {
            let request: Value = serde_json::from_str(&body).unwrap();
            let message = &request["params"]["message"];
            let message_id = message["messageId"].as_str().unwrap().to_string();
            let text = message["parts"][0]["text"].as_str().unwrap().to_string();
            sent.lock().unwrap().push(Sent {
                message_id: message_id.clone(),
                text: text.clone(),
                metadata: message["metadata"].clone(),
            });
            let answer = answered
                .lock()
                .unwrap()
                .entry(message_id)
                .or_insert_with(|| format!("answer to {text}"))
                .clone();
            json!({
                "jsonrpc": "2.0",
                "id": request["id"],
                "result": {"task": {
                    "id": "t",
                    "status": {"state": "TASK_STATE_COMPLETED"},
                    "artifacts": [{"parts": [{"text": answer}]}],
                }},
            })
            .to_string()
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, axum::Router::new().route("/a2a/hq", endpoint)).await;
    });
    (format!("http://{address}/a2a/hq"), server)
}

/// One process of the agents `agents` on the SQLite file `path`, each asking `hq` what
/// it is asked.
fn process(path: &std::path::Path, url: &str, agents: &[&str]) -> AgentSystem {
    let mut llm = ScriptedLlm::new();
    let mut builder = AgentSystem::builder();
    for agent in agents {
        llm = llm
            .rule(ScriptRule::agent(*agent).on_tool_result().reply("{tool_result}"))
            .rule(
                ScriptRule::agent(*agent)
                    .on_user_containing("")
                    .call("call_agent", json!({"agent_id": "hq", "message": "{input}"})),
            );
        builder = builder.agent(AgentSpec::new(*agent));
    }
    builder
        .store(Arc::new(SqliteStore::open(path).expect("the store opens")))
        .llm(Arc::new(llm))
        .remote_agent(RemoteAgent::new("hq", url))
        .start()
        .expect("the system starts")
}

async fn ask(system: &AgentSystem, agent: &str, text: &str) -> String {
    tokio::time::timeout(Duration::from_secs(20), system.ask(agent, text))
        .await
        .expect("the ask ends within 20 s")
        .expect("the ask is answered")
        .text
}

/// Goal: each remote call is a new message to the remote agent, also after the calling
/// process restarted and from a second process on the same store, so each question
/// gets its own answer; and the message passes a Troupe receiver's checks for an agent
/// with a long id. Method: agent `a` asks remote `hq` (a loopback endpoint that
/// deduplicates by message id as a Troupe server does) in a first process, which then
/// shuts down, in a second one on the same SQLite file, and in a third running beside
/// the second; an agent whose id is 250 bytes asks too. Before the fix every process
/// named its calls `{agent}-call-{n}.{agent}-call-{n}` from a counter starting at 1,
/// so the second process's question "q2" got "answer to q1" (the three processes named
/// a's call alike, 17 bytes), and the long id's message id (515 bytes) and metadata
/// (its trace id over 256 bytes) were over a Troupe receiver's limits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_remote_call_is_a_new_message_across_restarts_and_processes() {
    let sent: Arc<Mutex<Vec<Sent>>> = Arc::default();
    let (url, server) = deduplicating_endpoint(Arc::clone(&sent)).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agents.sqlite3");
    let long = "l".repeat(250);

    let first = process(&path, &url, &["a", &long]);
    assert_eq!(ask(&first, "a", "q1").await, "answer to q1");
    first.shutdown().await;

    let second = process(&path, &url, &["a", &long]);
    let third = process(&path, &url, &["a", &long]);
    assert_eq!(ask(&second, "a", "q2").await, "answer to q2");
    assert_eq!(ask(&third, "a", "q3").await, "answer to q3");
    assert_eq!(ask(&second, &long, "q4").await, "answer to q4");
    second.shutdown().await;
    third.shutdown().await;
    server.abort();

    let sent = sent.lock().unwrap().clone();
    let texts: Vec<&str> = sent.iter().map(|sent| sent.text.as_str()).collect();
    assert_eq!(texts, ["q1", "q2", "q3", "q4"]);
    let mut ids: Vec<&str> = sent.iter().map(|sent| sent.message_id.as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 4, "message ids made twice: {sent:#?}");
    for sent in &sent {
        assert!(
            sent.message_id.len() <= AGENT_MESSAGE_ID_LENGTH_MAX_BYTES,
            "a message id of {} bytes, over a Troupe receiver's {AGENT_MESSAGE_ID_LENGTH_MAX_BYTES}",
            sent.message_id.len()
        );
        let metadata = sent.metadata.as_object();
        let checked = TroupeCallMetadata::from_metadata(metadata);
        assert!(
            matches!(checked, Ok(Some(_))),
            "the receiver refuses the metadata: {checked:?}"
        );
    }
}
