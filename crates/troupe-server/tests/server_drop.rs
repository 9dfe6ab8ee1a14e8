//! Goal: a server that was used over every kind of route, then stopped, leaves nothing
//! of its agent system alive: the store and the model client are freed once `serve`
//! has returned and the system has shut down (an embedder that restarts its server in
//! one process must not keep every old system in memory).
//!
//! Method: the test keeps its own `Arc` of the store and of the scripted model. It sends
//! a REST message (plain and streamed), an A2A `SendMessage`, an OpenAI-compatible chat
//! completion, reads the topology, and holds an event stream open; then it stops the
//! server and shuts the system down. Within `RELEASE_WAIT_MS` the test's own `Arc`s
//! must be the only ones left; the failure names the counts.
#![cfg(not(madsim))]

mod support;

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use support::Harness;
use troupe_agent::{AgentSpec, AgentSystem, ScriptRule, ScriptedLlm};
use troupe_runtime::MemoryStore;
use troupe_server::ServerConfig;

/// How long the stopped system's tasks get to end (ms).
const RELEASE_WAIT_MS: u64 = 5_000;
/// How often the test looks at the counts meanwhile (ms).
const RELEASE_POLL_MS: u64 = 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_server_frees_its_agent_system() {
    let store = Arc::new(MemoryStore::new());
    let llm = Arc::new(ScriptedLlm::new().rule(ScriptRule::agent("echo").reply("echo: {input}")));
    let builder = AgentSystem::builder()
        .llm(Arc::clone(&llm) as _)
        .store(Arc::clone(&store) as _)
        .agent(AgentSpec::new("echo"));
    let server = Harness::start(builder, ServerConfig::default()).await;
    let events = server
        .request(reqwest::Method::GET, "/v1/events")
        .send()
        .await
        .expect("the event stream opens");
    assert_eq!(events.status().as_u16(), 200);

    let (status, body) = server.post("/v1/agents/echo/messages", json!({"text": "one"})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["text"], "echo: one", "{body}");
    let streamed = server
        .request(reqwest::Method::POST, "/v1/agents/echo/messages?stream=true")
        .header("content-type", "application/json")
        .body(json!({"text": "two"}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(streamed.status().as_u16(), 200);
    assert!(streamed.text().await.unwrap().contains("echo: two"));
    let rpc = json!({
        "jsonrpc": "2.0",
        "id": 1,
        "method": "SendMessage",
        "params": {"message": {"messageId": "m1", "role": "ROLE_USER", "parts": [{"text": "three"}]}},
    });
    let (status, body) = server.post("/a2a/echo", rpc).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.get("error").is_none(), "{body}");
    assert!(body.to_string().contains("echo: three"), "{body}");
    let chat = json!({"model": "echo", "messages": [{"role": "user", "content": "four"}]});
    let (status, body) = server.post("/v1/chat/completions", chat).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["message"]["content"], "echo: four", "{body}");
    let (status, topology): (u16, Value) = server.get("/v1/topology").await;
    assert_eq!(status, 200, "{topology}");
    assert!(Arc::strong_count(&store) > 1, "the running system holds the store");

    server.stop().await;
    // The event stream was ended by the shutdown.
    let rest = tokio::time::timeout(Duration::from_millis(RELEASE_WAIT_MS), events.text()).await;
    assert!(rest.is_ok(), "the event stream ends at shutdown");

    let deadline = tokio::time::Instant::now() + Duration::from_millis(RELEASE_WAIT_MS);
    while Arc::strong_count(&store) > 1 || Arc::strong_count(&llm) > 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{RELEASE_WAIT_MS} ms after the server stopped and its system shut down, something still \
             holds the store ({} references) and the model ({} references)",
            Arc::strong_count(&store),
            Arc::strong_count(&llm)
        );
        tokio::time::sleep(Duration::from_millis(RELEASE_POLL_MS)).await;
    }
}
