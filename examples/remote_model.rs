//! An agent whose model is reached over HTTP with `OpenAiClient`, the client for any
//! OpenAI-compatible chat-completions endpoint. So that it runs anywhere (CI included)
//! with no API key and no network, the example starts a tiny fake provider on
//! `127.0.0.1` first; point `OpenAiConfig::base_url` and `api_key` at a real provider
//! (or use `OpenAiConfig::from_env()`) and nothing else changes.
//!
//! The answer is streamed (`stream: true`, server-sent events): a `StreamObserver`
//! prints the tokens as they arrive, and the client assembles them, tool-call deltas
//! included, into one reply. The fake model first calls the agent's `add` tool, then
//! answers with its result.
//!
//! Run it with `cargo run --example remote_model`. It prints the streamed tokens, the
//! tool call and the agent's answer.

#[cfg(not(madsim))]
#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    use std::io::Write;
    use std::sync::Arc;

    use troupe::agent::{AgentSpec, AgentSystem, OpenAiClient, OpenAiConfig, StreamDelta, Tool, ToolExecutionContext};
    use troupe::core::ActorId;
    use troupe::json;

    let base_url = fake_provider::start().await?;

    let mut config = OpenAiConfig::new("sk-fake-key-for-the-local-server");
    config.base_url = base_url;
    config.model = "fake-model".to_owned();
    config.stream = true;
    // The client reads deadlines on a clock; made before the system starts, its epoch is
    // a little earlier than the runtime's, so its budgets err on the short side.
    let clock = troupe::runtime::Clock::new();
    let print_tokens = |_agent: &ActorId, delta: &StreamDelta<'_>| {
        if let StreamDelta::Text(text) = delta {
            print!("{text}");
            let _ = std::io::stdout().flush();
        }
    };
    let llm = OpenAiClient::new(config, clock)?.with_stream_observer(Arc::new(print_tokens));

    let add = Tool::from_fn(
        "add",
        "adds two integers",
        json!({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
               "required": ["a", "b"]}),
        |_context: ToolExecutionContext, arguments| async move {
            let sum = arguments["a"].as_i64().unwrap_or(0) + arguments["b"].as_i64().unwrap_or(0);
            println!("tool add({}, {}) = {sum}", arguments["a"], arguments["b"]);
            Ok(sum.to_string())
        },
    );
    let system = AgentSystem::builder()
        .llm(Arc::new(llm))
        .tool(add)
        .agent(AgentSpec::new("accountant").role("adds numbers with the add tool"))
        .start()?;
    let reply = system.ask("accountant", "What is 40 + 2?").await?;
    println!();
    println!("accountant: {}", reply.text);
    assert_eq!(reply.text, "The sum is 42.");
    system.shutdown().await;
    Ok(())
}

/// A fake OpenAI-compatible provider: `POST /v1/chat/completions` with `stream: true`.
/// It answers a chat whose last message is from the user with a call of `add(40, 2)`,
/// and a chat whose last message is a tool result with a sentence holding that result,
/// streamed a few words at a time.
#[cfg(not(madsim))]
mod fake_provider {
    use axum::http::header;
    use axum::response::IntoResponse;
    use axum::routing::post;
    use axum::Json;
    use serde_json::{json, Value};

    /// Starts the server on a free loopback port; returns its base URL.
    pub(crate) async fn start() -> std::io::Result<String> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let address = listener.local_addr()?;
        let app = axum::Router::new().route("/v1/chat/completions", post(chat_completions));
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(format!("http://{address}/v1"))
    }

    fn chunk(delta: Value) -> String {
        format!("data: {}\n\n", json!({"choices": [{"index": 0, "delta": delta}]}))
    }

    async fn chat_completions(Json(request): Json<Value>) -> impl IntoResponse {
        let messages = request["messages"].as_array().cloned().unwrap_or_default();
        let last = messages.last().cloned().unwrap_or(Value::Null);
        let mut events = Vec::new();
        if last["role"] == "tool" {
            let result = last["content"].as_str().unwrap_or_default().to_owned();
            for word in ["The ", "sum ", "is ", &format!("{result}.")] {
                events.push(chunk(json!({"content": word})));
            }
        } else {
            events.push(chunk(
                json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                "function": {"name": "add", "arguments": "{\"a\": 40,"}}]}),
            ));
            events.push(chunk(
                json!({"tool_calls": [{"index": 0, "function": {"arguments": " \"b\": 2}"}}]}),
            ));
        }
        events.push(format!(
            "data: {}\n\n",
            json!({"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 6, "total_tokens": 36}})
        ));
        events.push("data: [DONE]\n\n".to_owned());
        ([(header::CONTENT_TYPE, "text/event-stream")], events.concat())
    }
}

/// The simulator build has no HTTP; the example does nothing there.
#[cfg(madsim)]
fn main() {}
