//! The ids of one step's tool calls are present and distinct in what an agent sends
//! back and keeps, whatever its model client returned: a provider refuses a tool call
//! with an empty id, and cannot pair results with calls that share one.
//!
//! Method: a model client of the test's own (any `LlmClient`, not only the OpenAI one)
//! that answers the first request with calls whose ids are empty or repeated, and
//! records the next request. Runs in both builds: `cargo nextest run -p troupe-agent
//! --test tool_call_ids` and the madsim build (the ids made must be the same on every
//! run, as the simulator's determinism needs).

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use serde_json::{json, Value};
use troupe_agent::{
    AgentSpec, AgentSystem, ChatMessage, LlmClient, LlmError, LlmReply, LlmRequest, Role, Tool, ToolCall,
};

/// Answers the first request with `calls`, every later one with "done"; keeps every
/// request.
struct OddIds {
    calls: Vec<(&'static str, &'static str)>,
    requests: Mutex<Vec<LlmRequest>>,
}

#[async_trait]
impl LlmClient for OddIds {
    async fn complete(&self, request: LlmRequest) -> Result<LlmReply, LlmError> {
        let first = {
            let mut requests = self.requests.lock().unwrap();
            requests.push(request);
            requests.len() == 1
        };
        if !first {
            return Ok(LlmReply::new(ChatMessage::new(Role::Assistant, "done")));
        }
        let mut message = ChatMessage::new(Role::Assistant, "");
        message.tool_calls = self
            .calls
            .iter()
            .map(|(id, city)| ToolCall {
                id: (*id).to_owned(),
                name: "lookup".to_owned(),
                arguments: json!({"city": city}),
            })
            .collect();
        Ok(LlmReply::new(message))
    }
}

fn lookup() -> Tool {
    Tool::from_fn(
        "lookup",
        "Looks up the weather of a city.",
        json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
        |_context, arguments: Value| async move { Ok(format!("weather in {}", arguments["city"].as_str().unwrap_or("?"))) },
    )
}

/// The ids the second request carries for the step's calls, after checking each result
/// follows under its own call's id with its own call's answer.
async fn ids_sent_back(calls: Vec<(&'static str, &'static str)>) -> Vec<String> {
    let llm = Arc::new(OddIds {
        calls: calls.clone(),
        requests: Mutex::new(Vec::new()),
    });
    let system = AgentSystem::builder()
        .llm(llm.clone())
        .tool(lookup())
        .agent(AgentSpec::new("bob"))
        .start()
        .unwrap();
    assert_eq!(system.ask("bob", "weather?").await.unwrap().text, "done");
    let requests = llm.requests.lock().unwrap().clone();
    assert_eq!(requests.len(), 2);
    let messages = requests[1].messages.to_vec();
    let position = messages
        .iter()
        .position(|message| message.role == Role::Assistant)
        .expect("the calling message is sent back");
    let ids: Vec<String> = messages[position]
        .tool_calls
        .iter()
        .map(|call| call.id.clone())
        .collect();
    let results = &messages[position + 1..];
    assert_eq!(results.len(), calls.len());
    for (index, (id, result)) in ids.iter().zip(results).enumerate() {
        assert!(!id.is_empty(), "call {index}: {ids:?}");
        assert_eq!(
            ids.iter().filter(|other| *other == id).count(),
            1,
            "{id:?} repeats: {ids:?}"
        );
        assert_eq!(result.tool_call_id.as_deref(), Some(id.as_str()), "result {index}");
        assert_eq!(
            result.content,
            format!("weather in {}", calls[index].1),
            "result {index}"
        );
    }
    system.shutdown().await;
    ids
}

/// Empty ids, a repeated id, and a provider id that looks like a made one: every call
/// goes back with an id of its own (a present first id kept as the provider's), the
/// same on every run. Before, `""`, `""`, `"dup"`, `"dup"` were sent back.
#[tokio::test]
async fn empty_and_repeated_ids_are_sent_back_distinct_and_the_same_every_run() {
    let calls = vec![
        ("", "Oslo"),
        ("dup", "Rome"),
        ("dup", "Paris"),
        ("call_1_0", "Lima"),
        ("", "Bergen"),
    ];
    let ids = ids_sent_back(calls.clone()).await;
    assert_eq!(ids[1], "dup");
    assert_eq!(ids[3], "call_1_0", "a provider's own id is kept when it is the first");
    assert_eq!(ids, ids_sent_back(calls).await);
}

/// Well-formed ids are sent back as the provider gave them.
#[tokio::test]
async fn distinct_ids_are_kept_as_given() {
    let ids = ids_sent_back(vec![("c1", "Oslo"), ("c2", "Rome")]).await;
    assert_eq!(ids, ["c1", "c2"]);
}
