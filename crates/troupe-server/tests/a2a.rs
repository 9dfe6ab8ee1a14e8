//! A2A v1.0 (JSON-RPC binding) end to end: a real `troupe_server::serve` on
//! 127.0.0.1:0, the real `AgentSystem` on the scripted model, and real HTTP requests
//! (reqwest) in the wire format the official `a2a-sdk` 1.3.0 client sends. Every method,
//! the task lifecycle (blocking, streamed, waiting, canceled, subscribed), Troupe's chain
//! and depth rules on arrival, and every error code.
//!
//! Normal build only: HTTP is not simulated (the crate is empty under madsim).
#![cfg(not(madsim))]

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use troupe_agent::{AgentEvent, ScriptRule, ScriptedLlm};
use troupe_runtime::KindConfig;
use troupe_server::limits::A2A_TASKS_WAITING_PER_AGENT_MAX;
use troupe_server::ServerConfig;

#[path = "support/a2a_records.rs"]
mod a2a_records;
mod support;
use support::{gauge, Harness, TEST_WAIT_MS_MAX};

/// How long the `slow` agent's model takes, in milliseconds.
const SLOW_TURN_MS: u64 = 3_000;
const TOKEN: &str = "a2a-test-token-0123456789";

fn script() -> ScriptedLlm {
    ScriptedLlm::new()
        .rule(ScriptRule::agent("echo").reply("echo: {input}"))
        .rule(
            ScriptRule::agent("slow")
                .reply("slow done")
                .latency(Duration::from_millis(SLOW_TURN_MS)),
        )
        .rule(ScriptRule::agent("broken").fail("the model is down"))
}

async fn start_with(kind: KindConfig) -> Harness {
    let config = ServerConfig {
        token: Some(TOKEN.to_string()),
        ..ServerConfig::default()
    };
    Harness::start(support::agents(script(), &["echo", "slow", "broken"], kind), config).await
}

async fn start() -> Harness {
    start_with(KindConfig::default()).await
}

impl Harness {
    /// POSTs `body` (raw) to `/a2a/{agent}` with the token: the status and the text.
    async fn raw(&self, agent: &str, body: String) -> (u16, reqwest::header::HeaderMap, String) {
        let response = self
            .http
            .post(format!("{}/a2a/{agent}", self.base))
            .bearer_auth(TOKEN)
            .header("content-type", "application/json")
            .header("A2A-Version", "1.0")
            .body(body)
            .send()
            .await
            .expect("the server answers");
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        (status, headers, response.text().await.unwrap())
    }

    /// One JSON-RPC call: the response object (status 200 checked).
    async fn call(&self, agent: &str, method: &str, params: Value) -> Value {
        let body = json!({"jsonrpc": "2.0", "id": "r1", "method": method, "params": params});
        let (status, _, text) = self.raw(agent, body.to_string()).await;
        assert_eq!(status, 200, "{method}: {text}");
        let value: Value = serde_json::from_str(&text).unwrap_or_else(|error| panic!("not JSON ({error}): {text}"));
        assert_eq!(value["jsonrpc"], "2.0", "{value}");
        assert_eq!(value["id"], "r1", "{value}");
        value
    }

    /// A call that must succeed: its result.
    async fn ok(&self, agent: &str, method: &str, params: Value) -> Value {
        let value = self.call(agent, method, params).await;
        assert!(value.get("error").is_none(), "{method}: {value}");
        value["result"].clone()
    }

    /// A call that must fail: its error code and message.
    async fn error(&self, agent: &str, method: &str, params: Value) -> (i64, String) {
        let value = self.call(agent, method, params).await;
        assert!(value.get("result").is_none(), "{method}: {value}");
        (
            value["error"]["code"].as_i64().expect("an error code"),
            value["error"]["message"].as_str().unwrap().to_string(),
        )
    }

    /// A streamed call: the `result` of every SSE message, in order.
    async fn stream(&self, agent: &str, method: &str, params: Value) -> Vec<Value> {
        let body = json!({"jsonrpc": "2.0", "id": 9, "method": method, "params": params});
        let (status, headers, text) = self.raw(agent, body.to_string()).await;
        assert_eq!(status, 200, "{text}");
        assert_eq!(headers["content-type"], "text/event-stream", "{text}");
        text.split("\n\n")
            .filter_map(|block| {
                let data: Vec<&str> = block.lines().filter_map(|line| line.strip_prefix("data: ")).collect();
                (!data.is_empty()).then(|| data.join("\n"))
            })
            .map(|data| {
                let value: Value = serde_json::from_str(&data).unwrap();
                assert_eq!(value["id"], 9, "{value}");
                value["result"].clone()
            })
            .collect()
    }
}

/// A message with an id of its own (a message sent again with the same id is the task
/// it started).
fn message(text: &str) -> Value {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    json!({"messageId": format!("m{n}"), "role": "ROLE_USER", "parts": [{"text": text}]})
}

fn send_params(text: &str) -> Value {
    json!({"message": message(text)})
}

fn text_of(parts: &Value) -> String {
    parts
        .as_array()
        .unwrap()
        .iter()
        .map(|part| part["text"].as_str().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_card_is_public_and_describes_the_agent() {
    let server = start().await;
    let address = server.base.trim_start_matches("http://").to_string();
    let response = server
        .http
        .get(format!("{}/a2a/echo/.well-known/agent-card.json", server.base))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200, "no token needed for the card");
    let card: Value = response.json().await.unwrap();
    assert_eq!(card["name"], "echo");
    assert_eq!(card["description"], "the echo agent");
    assert_eq!(card["capabilities"]["streaming"], true);
    assert_eq!(card["capabilities"]["pushNotifications"], false);
    assert_eq!(
        card["supportedInterfaces"][0]["url"],
        format!("http://{address}/a2a/echo")
    );
    assert_eq!(card["supportedInterfaces"][0]["protocolBinding"], "JSONRPC");
    assert_eq!(card["supportedInterfaces"][0]["protocolVersion"], "1.0");
    assert_eq!(card["defaultInputModes"], json!(["text/plain"]));
    assert_eq!(card["skills"][0]["id"], "echo");
    assert_eq!(
        card["securitySchemes"]["bearer"]["httpAuthSecurityScheme"]["scheme"],
        "Bearer"
    );
    assert_eq!(
        card["securityRequirements"],
        json!([{"schemes": {"bearer": {"list": []}}}])
    );

    let unknown = server
        .http
        .get(format!("{}/a2a/nobody/.well-known/agent-card.json", server.base))
        .send()
        .await
        .unwrap();
    assert_eq!(unknown.status(), 404);

    // The JSON-RPC endpoint needs the token.
    let anonymous = server
        .http
        .post(format!("{}/a2a/echo", server.base))
        .header("content-type", "application/json")
        .body(json!({"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": "x"}}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), 401);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocking_send_completes_and_get_and_list_read_it_back() {
    let server = start().await;
    let result = server.ok("echo", "SendMessage", send_params("hello")).await;
    let task = &result["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    assert_eq!(text_of(&task["status"]["message"]["parts"]), "echo: hello");
    assert_eq!(task["status"]["message"]["role"], "ROLE_AGENT");
    assert_eq!(text_of(&task["artifacts"][0]["parts"]), "echo: hello");
    assert_eq!(task["metadata"]["troupe"]["agent"], "echo");
    assert_eq!(task["metadata"]["troupe"]["reply"]["steps"], 1);
    let id = task["id"].as_str().unwrap().to_string();
    let context = task["contextId"].as_str().unwrap().to_string();
    assert_eq!(task["history"][0]["taskId"], id.as_str());
    assert_eq!(task["history"][0]["contextId"], context.as_str());

    let got = server.ok("echo", "GetTask", json!({"id": id})).await;
    assert_eq!(got["status"]["state"], "TASK_STATE_COMPLETED");
    assert_eq!(got["history"].as_array().unwrap().len(), 2);
    let short = server
        .ok("echo", "GetTask", json!({"id": id, "historyLength": 1}))
        .await;
    assert_eq!(short["history"].as_array().unwrap().len(), 1);
    assert_eq!(short["history"][0]["role"], "ROLE_AGENT");
    // Tasks are per agent.
    let (code, _) = server.error("slow", "GetTask", json!({"id": id})).await;
    assert_eq!(code, -32001);

    // A second task in the same context, a third in another; pages of one.
    let mut params = send_params("again");
    params["message"]["contextId"] = json!(context);
    let second = server.ok("echo", "SendMessage", params).await;
    assert_eq!(second["task"]["contextId"], context.as_str());
    server.ok("echo", "SendMessage", send_params("third")).await;
    let all = server.ok("echo", "ListTasks", json!({})).await;
    assert_eq!(all["totalSize"], 3);
    assert_eq!(all["tasks"].as_array().unwrap().len(), 3);
    assert!(all["tasks"][0].get("artifacts").is_none(), "no artifacts unless asked");
    assert_eq!(all["nextPageToken"], "");
    let in_context = server.ok("echo", "ListTasks", json!({"contextId": context})).await;
    assert_eq!(in_context["totalSize"], 2);
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let page = server
            .ok(
                "echo",
                "ListTasks",
                json!({"pageSize": 1, "pageToken": token, "includeArtifacts": true}),
            )
            .await;
        assert_eq!(page["tasks"].as_array().unwrap().len(), 1, "{page}");
        assert!(page["tasks"][0]["artifacts"].is_array());
        seen.push(page["tasks"][0]["id"].as_str().unwrap().to_string());
        token = page["nextPageToken"].as_str().unwrap().to_string();
        if token.is_empty() {
            break;
        }
    }
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert_eq!(seen[2], id, "newest first");
    let completed = server
        .ok("echo", "ListTasks", json!({"status": "TASK_STATE_COMPLETED"}))
        .await;
    assert_eq!(completed["totalSize"], 3);
    let working = server
        .ok("echo", "ListTasks", json!({"status": "TASK_STATE_WORKING"}))
        .await;
    assert_eq!(working["totalSize"], 0);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_send_sends_the_task_its_reply_and_its_end() {
    let server = start().await;
    let events = server
        .stream("echo", "SendStreamingMessage", send_params("stream me"))
        .await;
    assert!(events.len() >= 3, "{events:?}");
    assert_eq!(
        events[0]["task"]["status"]["state"], "TASK_STATE_SUBMITTED",
        "{events:?}"
    );
    let id = events[0]["task"]["id"].as_str().unwrap();
    let artifact = events
        .iter()
        .find(|event| event.get("artifactUpdate").is_some())
        .expect("an artifact update");
    assert_eq!(
        text_of(&artifact["artifactUpdate"]["artifact"]["parts"]),
        "echo: stream me"
    );
    assert_eq!(artifact["artifactUpdate"]["taskId"], id);
    assert_eq!(artifact["artifactUpdate"]["lastChunk"], true);
    let last = events.last().unwrap();
    assert_eq!(
        last["statusUpdate"]["status"]["state"], "TASK_STATE_COMPLETED",
        "{events:?}"
    );
    assert_eq!(last["statusUpdate"]["taskId"], id);

    // A failing model: the stream ends with the failed state and its reason.
    let failed = server.stream("broken", "SendStreamingMessage", send_params("hi")).await;
    let last = failed.last().unwrap();
    assert_eq!(
        last["statusUpdate"]["status"]["state"], "TASK_STATE_FAILED",
        "{failed:?}"
    );
    assert!(
        text_of(&last["statusUpdate"]["status"]["message"]["parts"]).contains("agent_failed"),
        "{last}"
    );
    assert!(failed.iter().all(|event| event.get("artifactUpdate").is_none()));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_task_cancels_running_one_does_not_and_subscribers_see_its_end() {
    let server = start().await;
    let mut params = send_params("first");
    params["configuration"] = json!({"returnImmediately": true});
    let first = server.ok("slow", "SendMessage", params.clone()).await["task"].clone();
    params["message"] = message("second");
    let second = server.ok("slow", "SendMessage", params).await["task"].clone();
    assert_eq!(first["status"]["state"], "TASK_STATE_SUBMITTED");
    assert_eq!(second["status"]["state"], "TASK_STATE_SUBMITTED");
    let first_id = first["id"].as_str().unwrap().to_string();
    let second_id = second["id"].as_str().unwrap().to_string();

    // The first takes the lane (working), the second waits behind it.
    tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
        while server.ok("slow", "GetTask", json!({"id": first_id})).await["status"]["state"] != "TASK_STATE_WORKING" {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the first task starts");
    let canceled = server.ok("slow", "CancelTask", json!({"id": second_id})).await;
    assert_eq!(canceled["status"]["state"], "TASK_STATE_CANCELED", "{canceled}");
    let (code, message) = server.error("slow", "CancelTask", json!({"id": first_id})).await;
    assert_eq!(code, -32002, "{message}");
    assert!(message.contains("working"), "{message}");
    let (code, _) = server.error("slow", "CancelTask", json!({"id": "slow-task-404"})).await;
    assert_eq!(code, -32001);

    // Subscribing to the running task: the task, then its reply and its end.
    let events = server.stream("slow", "SubscribeToTask", json!({"id": first_id})).await;
    assert_eq!(events[0]["task"]["status"]["state"], "TASK_STATE_WORKING", "{events:?}");
    let last = events.last().unwrap();
    assert_eq!(
        last["statusUpdate"]["status"]["state"], "TASK_STATE_COMPLETED",
        "{events:?}"
    );
    assert_eq!(
        text_of(&last["statusUpdate"]["status"]["message"]["parts"]),
        "slow done"
    );

    // Ended tasks: not cancelable, not subscribable, and the canceled one never ran.
    let (code, _) = server.error("slow", "CancelTask", json!({"id": first_id})).await;
    assert_eq!(code, -32002);
    let (code, _) = server.error("slow", "SubscribeToTask", json!({"id": first_id})).await;
    assert_eq!(code, -32004);
    let (code, _) = server.error("slow", "SubscribeToTask", json!({"id": "nope"})).await;
    assert_eq!(code, -32001);
    let still = server.ok("slow", "GetTask", json!({"id": second_id})).await;
    assert_eq!(still["status"]["state"], "TASK_STATE_CANCELED");
    assert!(still.get("artifacts").is_some_and(|artifacts| artifacts == &json!([])));
    let log = server.system().conversation_log("slow").await.unwrap();
    assert!(
        log.iter().all(|entry| !entry.content.contains("second")),
        "the canceled task's message never reached the agent: {log:?}"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chain_and_depth_in_metadata_are_checked_on_arrival() {
    let server = start().await;
    let with = |troupe: Value| {
        let mut params = send_params("hop");
        params["message"]["metadata"] = json!({ "troupe": troupe });
        params
    };
    let cycle = server
        .ok("echo", "SendMessage", with(json!({"chain": ["a", "echo"], "depth": 2})))
        .await;
    assert_eq!(cycle["task"]["status"]["state"], "TASK_STATE_REJECTED", "{cycle}");
    assert!(text_of(&cycle["task"]["status"]["message"]["parts"]).contains("cycle"));
    let deep = server
        .ok("echo", "SendMessage", with(json!({"chain": ["a"], "depth": 6})))
        .await;
    assert_eq!(deep["task"]["status"]["state"], "TASK_STATE_REJECTED", "{deep}");
    assert!(text_of(&deep["task"]["status"]["message"]["parts"]).contains("depth 6"));
    // Numbers as doubles (a protobuf Struct's), a chain without the target: answered.
    let fine = server
        .ok(
            "echo",
            "SendMessage",
            with(json!({"chain": ["a", "b"], "depth": 2.0, "timeout_ms": 5000.0})),
        )
        .await;
    assert_eq!(fine["task"]["status"]["state"], "TASK_STATE_COMPLETED", "{fine}");
    assert_eq!(fine["task"]["metadata"]["troupe"]["chain"], json!(["a", "b"]));
    assert_eq!(fine["task"]["metadata"]["troupe"]["depth"], 2);
    assert_eq!(fine["task"]["metadata"]["troupe"]["timeout_ms"], 5_000);
    // A caller with more time than the server allows is clipped, not refused.
    let long = server
        .ok(
            "echo",
            "SendMessage",
            with(json!({"chain": ["a"], "depth": 1, "timeout_ms": 10_000_000_u64})),
        )
        .await;
    assert_eq!(long["task"]["status"]["state"], "TASK_STATE_COMPLETED", "{long}");
    assert_eq!(
        long["task"]["metadata"]["troupe"]["timeout_ms"],
        troupe_server::limits::SERVER_MESSAGE_TIMEOUT_MS_MAX
    );
    for bad in [
        json!({"depth": -1}),
        json!({"depth": 1.5}),
        json!({"chain": "a"}),
        json!({"unknown": 1}),
        json!({"timeout_ms": 0}),
        json!({"chain": ["a", "b", "c", "d", "e", "f", "g"]}),
        json!({"chain": ["a", "b"], "depth": 1}),
    ] {
        let (code, message) = server.error("echo", "SendMessage", with(bad.clone())).await;
        assert_eq!(code, -32602, "{bad}: {message}");
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_a2a_error_codes() {
    let server = start().await;
    // Not JSON; not a request; a batch.
    for (body, expected) in [
        ("{not json".to_string(), -32700),
        (json!({"id": 1, "method": "GetTask"}).to_string(), -32600),
        (
            json!([{"jsonrpc": "2.0", "id": 1, "method": "GetTask"}]).to_string(),
            -32600,
        ),
        (
            json!({"jsonrpc": "2.0", "id": {}, "method": "GetTask"}).to_string(),
            -32600,
        ),
    ] {
        let (status, _, text) = server.raw("echo", body.clone()).await;
        assert_eq!(status, 200, "{text}");
        let value: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(value["error"]["code"], expected, "{body}: {text}");
        assert_eq!(value["id"], Value::Null);
    }
    let cases = [
        ("message/send", json!({}), -32601),
        ("SendMessage", json!({}), -32602),
        (
            "SendMessage",
            json!({"message": {"messageId": "m", "role": "ROLE_AGENT", "parts": [{"text": "x"}]}}),
            -32602,
        ),
        (
            "SendMessage",
            json!({"message": {"messageId": "m", "role": "ROLE_USER", "parts": []}}),
            -32602,
        ),
        (
            "SendMessage",
            json!({"message": {"messageId": "", "role": "ROLE_USER", "parts": [{"text": "x"}]}}),
            -32602,
        ),
        (
            "SendMessage",
            json!({"message": {"messageId": "m", "role": "ROLE_USER", "parts": [{"data": {"a": 1}}]}}),
            -32005,
        ),
        (
            "SendMessage",
            json!({"message": message("x"), "configuration": {"acceptedOutputModes": ["image/png"]}}),
            -32005,
        ),
        (
            "SendMessage",
            json!({"message": message("x"), "configuration": {"taskPushNotificationConfig": {"url": "http://x"}}}),
            -32003,
        ),
        (
            "SendMessage",
            json!({"message": {"messageId": "m", "role": "ROLE_USER", "taskId": "echo-task-77", "parts": [{"text": "x"}]}}),
            -32001,
        ),
        (
            "SendMessage",
            json!({"message": {"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "x".repeat(troupe_server::limits::SERVER_MESSAGE_SIZE_MAX_BYTES + 1)}]}}),
            -32602,
        ),
        ("GetTask", json!({}), -32602),
        ("GetTask", json!({"id": "nope"}), -32001),
        ("ListTasks", json!({"pageSize": 0}), -32602),
        ("ListTasks", json!({"pageSize": 101}), -32602),
        ("ListTasks", json!({"pageToken": "abc"}), -32602),
        ("ListTasks", json!({"status": "TASK_STATE_BORED"}), -32602),
        ("ListTasks", json!({"statusTimestampAfter": "2026-01-01"}), -32602),
        ("CreateTaskPushNotificationConfig", json!({}), -32003),
        ("GetExtendedAgentCard", json!({}), -32007),
    ];
    for (method, params, expected) in cases {
        let (code, message) = server.error("echo", method, params.clone()).await;
        assert_eq!(code, expected, "{method} {params}: {message}");
        assert!(!message.is_empty());
    }
    // A task id given back to continue it: not supported.
    let done = server.ok("echo", "SendMessage", send_params("one")).await;
    let mut params = send_params("two");
    params["message"]["taskId"] = done["task"]["id"].clone();
    let (code, _) = server.error("echo", "SendMessage", params).await;
    assert_eq!(code, -32004);

    // A protocol version not served.
    let response = server
        .http
        .post(format!("{}/a2a/echo", server.base))
        .bearer_auth(TOKEN)
        .header("content-type", "application/json")
        .header("A2A-Version", "0.3")
        .body(json!({"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": "x"}}).to_string())
        .send()
        .await
        .unwrap();
    let value: Value = response.json().await.unwrap();
    assert_eq!(value["error"]["code"], -32009, "{value}");

    // An unknown agent is not an endpoint.
    let (status, _, _) = server
        .raw(
            "nobody",
            json!({"jsonrpc": "2.0", "id": 1, "method": "GetTask"}).to_string(),
        )
        .await;
    assert_eq!(status, 404);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_lane_is_a_retryable_429() {
    let server = start().await;
    // Each its own message (the same one sent again would be the task it started).
    let params = || {
        let mut params = send_params("queue");
        params["configuration"] = json!({"returnImmediately": true});
        params
    };
    // One running (or about to) and the lane's limit waiting behind it.
    for _ in 0..=A2A_TASKS_WAITING_PER_AGENT_MAX {
        server.ok("slow", "SendMessage", params()).await;
    }
    let body = || json!({"jsonrpc": "2.0", "id": 3, "method": "SendMessage", "params": params()}).to_string();
    let (status, headers, text) = server.raw("slow", body()).await;
    // The first may not have left the lane's waiting count yet: then one more fits.
    let (status, headers, text) = if status == 200 {
        server.raw("slow", body()).await
    } else {
        (status, headers, text)
    };
    assert_eq!(status, 429, "{text}");
    assert_eq!(headers["retry-after"], "1");
    let value: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(value["error"]["code"], -32000, "{value}");
    assert_eq!(value["id"], 3);
    server.stop().await;
}

/// Goal: an agent whose mailbox is full answers a blocking send with a retryable error
/// (HTTP 429, `Retry-After`, -32000), and the task records why it failed. Method:
/// mailbox capacity 1; a REST message runs a slow turn (seen on the event stream), a
/// second REST message takes the one queue slot, then the A2A send finds it full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_mailbox_is_a_retryable_429() {
    let server = Arc::new(start_with(KindConfig::default().with_mailbox_capacity(1)).await);
    let mut events = server.system().subscribe();
    let rest = |text: &'static str| {
        let server = Arc::clone(&server);
        tokio::spawn(async move {
            server
                .http
                .post(format!("{}/v1/agents/slow/messages", server.base))
                .bearer_auth(TOKEN)
                .header("content-type", "application/json")
                .body(json!({ "text": text }).to_string())
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        })
    };
    let running = rest("a");
    wait_for(
        &mut events,
        |event| matches!(event, AgentEvent::TurnStarted { agent, .. } if agent.key() == "slow"),
    )
    .await;
    let queued = rest("b");
    wait_for(
        &mut events,
        |event| matches!(event, AgentEvent::CallStarted { parent: None, target, .. } if target.key() == "slow"),
    )
    .await;
    // The call was announced just before its enqueue: give the enqueue a moment.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let params = send_params("c");
    let body = json!({"jsonrpc": "2.0", "id": 5, "method": "SendMessage", "params": params.clone()});
    let (status, headers, text) = server.raw("slow", body.to_string()).await;
    assert_eq!(status, 429, "{text}");
    assert_eq!(headers["retry-after"], "1");
    let value: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(value["error"]["code"], -32000, "{value}");
    assert_eq!(running.await.unwrap(), 200);
    assert_eq!(queued.await.unwrap(), 200);
    let failed = server
        .ok("slow", "ListTasks", json!({"status": "TASK_STATE_FAILED"}))
        .await;
    assert_eq!(failed["totalSize"], 1, "{failed}");
    assert!(
        text_of(&failed["tasks"][0]["status"]["message"]["parts"]).starts_with("busy"),
        "{failed}"
    );
    // The client was told to retry: the same message sent again is a new task, which
    // the agent, no longer busy, runs.
    let again = server.ok("slow", "SendMessage", params).await;
    assert_eq!(again["task"]["status"]["state"], "TASK_STATE_COMPLETED", "{again}");
    assert_ne!(again["task"]["id"], failed["tasks"][0]["id"], "{again}");
    Arc::into_inner(server).unwrap().stop().await;
}

/// Goal: the server keeps at most `a2a_tasks_kept` A2A tasks: a new task lets the
/// oldest ended one go, and with it its agent's record of it (the agent's external task,
/// and the mark that made its message id return it), so neither grows for good; the
/// message of a task let go, sent again, is a new task that runs again. Method: a
/// server keeping 2 tasks; 3 messages to `echo`, then the first again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_let_go_to_make_room_is_forgotten_by_its_agent_too() {
    let config = ServerConfig {
        token: Some(TOKEN.to_string()),
        ..ServerConfig::default()
    }
    .a2a_tasks_kept(2);
    let server = Harness::start(
        support::agents(script(), &["echo", "slow", "broken"], KindConfig::default()),
        config,
    )
    .await;
    let params: Vec<Value> = ["first job", "second job", "third job"]
        .iter()
        .map(|text| send_params(text))
        .collect();
    let mut ids = Vec::new();
    for params in &params {
        let task = server.ok("echo", "SendMessage", params.clone()).await["task"].clone();
        assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
        ids.push(task["id"].as_str().unwrap().to_string());
    }
    let (code, message) = server.error("echo", "GetTask", json!({"id": ids[0]})).await;
    assert_eq!(code, -32001, "the first task was let go: {message}");
    let listed = server.ok("echo", "ListTasks", json!({})).await;
    assert_eq!(listed["totalSize"], 2, "{listed}");
    // The agent forgets its record in the background (behind its running turn).
    let attachments = || async {
        let inner = server.system().external_tasks("echo", None, 100).await.unwrap();
        inner.into_iter().map(|task| task.attachment).collect::<Vec<_>>()
    };
    let mut kept = attachments().await;
    for _ in 0..(TEST_WAIT_MS_MAX / support::POLL_MS) {
        if kept.len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(support::POLL_MS)).await;
        kept = attachments().await;
    }
    assert_eq!(
        kept,
        [ids[1].clone(), ids[2].clone()],
        "the agent's records of the kept tasks only"
    );

    // Sent again, the first message is a new task (its first was let go), run again.
    let again = server.ok("echo", "SendMessage", params[0].clone()).await["task"].clone();
    assert_ne!(again["id"], ids[0].as_str(), "{again}");
    assert_eq!(again["status"]["state"], "TASK_STATE_COMPLETED", "{again}");
    let log = server.system().conversation_log("echo").await.unwrap();
    let asked = log
        .iter()
        .filter(|entry| entry.role == troupe_agent::Role::User && entry.content.contains("first job"))
        .count();
    assert_eq!(asked, 2, "{log:?}");
    server.stop().await;
}

/// Goal: a message sent again (same `messageId`, same parts: a client retrying after a
/// lost answer) is the task it started, blocking, returning at once or streamed, and
/// the agent runs it once; the same id with other parts is refused (-32602) and starts
/// nothing. Method: three sends of one message to `echo` and one to `slow` while its
/// first send still runs, then the tasks, the agent's external tasks and its log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_sent_again_is_the_task_it_started_and_its_agent_runs_it_once() {
    let server = start().await;
    let params = send_params("only once");
    let first = server.ok("echo", "SendMessage", params.clone()).await["task"].clone();
    assert_eq!(first["status"]["state"], "TASK_STATE_COMPLETED", "{first}");
    let again = server.ok("echo", "SendMessage", params.clone()).await["task"].clone();
    assert_eq!(again["id"], first["id"], "{again}");
    assert_eq!(text_of(&again["artifacts"][0]["parts"]), "echo: only once");
    let mut immediate = params.clone();
    immediate["configuration"] = json!({"returnImmediately": true});
    let at_once = server.ok("echo", "SendMessage", immediate).await["task"].clone();
    assert_eq!(at_once["id"], first["id"], "{at_once}");
    let streamed = server.stream("echo", "SendStreamingMessage", params.clone()).await;
    assert_eq!(streamed[0]["task"]["id"], first["id"], "{streamed:?}");

    let mut other = params.clone();
    other["message"]["parts"] = json!([{"text": "something else"}]);
    let (code, message) = server.error("echo", "SendMessage", other).await;
    assert_eq!(code, -32602, "{message}");
    assert!(message.contains("messageId"), "{message}");

    let listed = server.ok("echo", "ListTasks", json!({})).await;
    assert_eq!(listed["totalSize"], 1, "{listed}");
    let inner = server.system().external_tasks("echo", None, 100).await.unwrap();
    assert_eq!(inner.len(), 1, "{inner:?}");
    let log = server.system().conversation_log("echo").await.unwrap();
    let asked = |text: &str| {
        log.iter()
            .filter(|entry| entry.role == troupe_agent::Role::User && entry.content.contains(text))
            .count()
    };
    assert_eq!(asked("only once"), 1);
    assert_eq!(asked("something else"), 0);

    // Sent again while its task still runs: the same task, which ends once.
    let mut slow = send_params("take your time");
    slow["configuration"] = json!({"returnImmediately": true});
    let running = server.ok("slow", "SendMessage", slow.clone()).await["task"].clone();
    let blocking = server.ok("slow", "SendMessage", send_params_of(&slow)).await["task"].clone();
    assert_eq!(blocking["id"], running["id"], "{blocking}");
    assert_eq!(blocking["status"]["state"], "TASK_STATE_COMPLETED", "{blocking}");
    let listed = server.ok("slow", "ListTasks", json!({})).await;
    assert_eq!(listed["totalSize"], 1, "{listed}");
    server.stop().await;
}

/// `params` without its configuration: the same message, sent blocking.
fn send_params_of(params: &Value) -> Value {
    json!({"message": params["message"].clone()})
}

/// Goal: concurrent A2A sends to one agent on the multi-thread runtime each make one
/// A2A task with one outcome, and each is one Troupe task the agent ran once. Method:
/// 16 blocking sends at once to `echo`, then the tasks, the agent's external tasks and
/// its log.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_sends_to_one_agent_each_make_one_task_and_one_outcome() {
    const SENDS: usize = 16;
    let server = Arc::new(start().await);
    let mut handles = Vec::new();
    for n in 0..SENDS {
        let server = Arc::clone(&server);
        handles.push(tokio::spawn(async move {
            let mut params = send_params(&format!("job-{n}."));
            params["message"]["messageId"] = json!(format!("concurrent-{n}"));
            let task = server.ok("echo", "SendMessage", params).await["task"].clone();
            (n, task)
        }));
    }
    let mut ids = std::collections::BTreeSet::new();
    for handle in handles {
        let (n, task) = handle.await.unwrap();
        assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
        assert_eq!(text_of(&task["artifacts"][0]["parts"]), format!("echo: job-{n}."));
        assert!(ids.insert(task["id"].as_str().unwrap().to_string()), "{task}");
    }
    let listed = server.ok("echo", "ListTasks", json!({"pageSize": 100})).await;
    assert_eq!(listed["totalSize"], SENDS, "{listed}");
    let inner = server.system().external_tasks("echo", None, 100).await.unwrap();
    assert_eq!(inner.len(), SENDS);
    assert!(inner
        .iter()
        .all(|task| task.state == troupe_agent::TaskState::Completed));
    let log = server.system().conversation_log("echo").await.unwrap();
    for n in 0..SENDS {
        let asked = log
            .iter()
            .filter(|entry| entry.role == troupe_agent::Role::User && entry.content.contains(&format!("job-{n}.")))
            .count();
        assert_eq!(asked, 1, "job-{n}.");
    }
    Arc::into_inner(server).unwrap().stop().await;
}

async fn wait_for(events: &mut tokio::sync::broadcast::Receiver<AgentEvent>, wanted: impl Fn(&AgentEvent) -> bool) {
    tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
        loop {
            if let Ok(event) = events.recv().await {
                if wanted(&event) {
                    return;
                }
            }
        }
    })
    .await
    .expect("the event comes");
}

/// Goal: an agent card's interface URL reaches that agent whatever its id holds: an
/// agent id may hold `?`, `#`, `%` or spaces (only `/` and control characters are
/// refused), and the card's URL is where an A2A client sends every request. Before, the
/// id went into the URL as it is: for agent `x?y` the client's requests went to agent
/// `x` (the rest became a query), for `a%41` to agent `aA`.
/// Method: agents `x`, `x?y`, `aA`, `a%41` and `two words`, each answering its own
/// name; each one's card is read at its escaped path, and a blocking `SendMessage`
/// posted to the card's URL must be answered by that agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_cards_url_reaches_its_agent_whatever_its_id_holds() {
    let ids = ["x", "x?y", "aA", "a%41", "two words"];
    let mut llm = ScriptedLlm::new();
    for id in ids {
        llm = llm.rule(ScriptRule::agent(id).reply(format!("I am {id}")));
    }
    let server = Harness::start(
        support::agents(llm, &ids, KindConfig::default()),
        ServerConfig::default(),
    )
    .await;
    for id in ["x?y", "a%41", "two words"] {
        let mut card_url = reqwest::Url::parse(&server.base).unwrap();
        card_url
            .path_segments_mut()
            .unwrap()
            .extend(["a2a", id, ".well-known", "agent-card.json"]);
        let response = server.http.get(card_url).send().await.unwrap();
        assert_eq!(response.status(), 200, "the card of {id:?}");
        let card: Value = response.json().await.unwrap();
        assert_eq!(card["name"], id, "{card}");
        let url = card["supportedInterfaces"][0]["url"].as_str().unwrap().to_string();
        let body = json!({"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": send_params("who?")});
        let response = server
            .http
            .post(&url)
            .header("content-type", "application/json")
            .header("A2A-Version", "1.0")
            .body(body.to_string())
            .send()
            .await
            .unwrap_or_else(|error| panic!("{id:?}: the card's URL {url:?} is not usable: {error}"));
        let status = response.status().as_u16();
        let text = response.text().await.unwrap();
        assert_eq!(status, 200, "{id:?} through {url:?}: {text}");
        let answer: Value = serde_json::from_str(&text).unwrap();
        let task = &answer["result"]["task"];
        assert_eq!(
            text_of(&task["artifacts"][0]["parts"]),
            format!("I am {id}"),
            "{id:?} through {url:?}: {answer}"
        );
    }
    server.stop().await;
}

/// Goal: an A2A message is bounded as a whole, not only its text: everything besides
/// the parts' text (ids, metadata, extensions) is at most
/// `A2A_MESSAGE_FIELDS_SIZE_MAX_BYTES` of JSON, or the send is invalid params naming
/// the limit and no task is made. Each task keeps its message (10,000 tasks by
/// default, in memory and in the store) and every `GetTask` and `ListTasks` page (100
/// tasks) sends it back; before, a 32 KiB text could come with up to the body limit
/// (256 KiB) of metadata, kept and sent back with every read.
/// Method: a message with 100,000 bytes of metadata and one just over the limit are
/// refused (-32602, the limit named) and `ListTasks` stays empty; one just within the
/// limit, and one with the longest text, are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_with_more_than_its_texts_worth_of_other_fields_is_invalid_params() {
    use troupe_server::limits::{A2A_MESSAGE_FIELDS_SIZE_MAX_BYTES, SERVER_MESSAGE_SIZE_MAX_BYTES};
    let server = start().await;
    // The message's JSON without its text: `{"messageId":"mN","role":"ROLE_USER","parts":[{"text":""}],"metadata":{"junk":""}}`
    let with_junk = |junk: usize| {
        let mut message = message("hi");
        message["metadata"] = json!({"junk": "j".repeat(junk)});
        let fields = {
            let mut without_text = message.clone();
            without_text["parts"][0]["text"] = json!("");
            without_text.to_string().len()
        };
        (json!({"message": message}), fields)
    };
    for junk in [100_000, A2A_MESSAGE_FIELDS_SIZE_MAX_BYTES] {
        let (params, fields) = with_junk(junk);
        assert!(fields > A2A_MESSAGE_FIELDS_SIZE_MAX_BYTES);
        let (code, text) = server.error("echo", "SendMessage", params).await;
        assert_eq!(code, -32602, "{text}");
        assert!(
            text.contains(&fields.to_string()) && text.contains(&A2A_MESSAGE_FIELDS_SIZE_MAX_BYTES.to_string()),
            "{text}"
        );
    }
    let listed = server.ok("echo", "ListTasks", json!({})).await;
    assert_eq!(listed["tasks"], json!([]), "no task was made: {listed}");
    let (params, fields) = with_junk(A2A_MESSAGE_FIELDS_SIZE_MAX_BYTES - 200);
    assert!(fields <= A2A_MESSAGE_FIELDS_SIZE_MAX_BYTES);
    let result = server.ok("echo", "SendMessage", params).await;
    assert_eq!(result["task"]["status"]["state"], "TASK_STATE_COMPLETED", "{result}");
    let longest = "t".repeat(SERVER_MESSAGE_SIZE_MAX_BYTES);
    let result = server.ok("echo", "SendMessage", send_params(&longest)).await;
    assert_eq!(result["task"]["status"]["state"], "TASK_STATE_COMPLETED", "{result}");
    server.stop().await;
}

/// Goal: a deleted agent's A2A tasks are gone: the server keeps nothing of them, in
/// memory or in the store, so create/delete cycles do not grow it, and an agent made
/// again under the same id starts with no tasks (before: every agent id ever used kept
/// its lane, its tasks, its message ids and its store writer's fence for good, and a
/// new agent of that id listed the old one's tasks). Method: an agent created over
/// REST gets a task, is deleted and created again: `ListTasks` is empty, `GetTask` of
/// the old task is -32001, the store holds no record of it; then 40 cycles of
/// create, send (completed), delete, each under a new id, leave `/metrics` showing no
/// A2A task and no agent tracked by the A2A layer (only `echo` is left, with none).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_agents_a2a_tasks_are_gone_and_create_delete_cycles_leave_nothing() {
    let llm = ScriptedLlm::new().rule(ScriptRule::any_agent().reply("heard: {input}"));
    let config = ServerConfig::default().token(TOKEN);
    let server = Harness::start(support::agents(llm, &["echo"], KindConfig::default()), config).await;
    let create = |id: String| {
        let server = &server;
        async move {
            let (status, body) = server.post("/v1/agents", json!({"id": id})).await;
            assert_eq!(status, 201, "create {id}: {body}");
        }
    };
    let delete = |id: String| {
        let server = &server;
        async move {
            let (status, body) = server
                .send(reqwest::Method::DELETE, &format!("/v1/agents/{id}"), None)
                .await;
            assert_eq!(status, 204, "delete {id}: {body}");
        }
    };

    create("again".to_string()).await;
    let first = server.ok("again", "SendMessage", send_params("first life")).await;
    assert_eq!(first["task"]["status"]["state"], "TASK_STATE_COMPLETED", "{first}");
    let old_task = first["task"]["id"].as_str().unwrap().to_string();
    delete("again".to_string()).await;
    create("again".to_string()).await;
    let listed = server.ok("again", "ListTasks", json!({})).await;
    assert_eq!(
        listed["totalSize"], 0,
        "a new agent of a deleted one's id has no tasks: {listed}"
    );
    let (code, text) = server.error("again", "GetTask", json!({"id": old_task})).await;
    assert_eq!(code, -32001, "{text}");
    let store = Arc::clone(server.system().runtime().store());
    let key_space = troupe_core::ActorId::new("troupe-a2a", "again").unwrap();
    let stored = store.scan(&key_space, "task/", None, 16).await.unwrap();
    assert!(
        stored.is_empty(),
        "the deleted agent's task records are still stored: {stored:?}"
    );
    delete("again".to_string()).await;

    for cycle in 0..40 {
        let id = format!("cycle-{cycle}");
        create(id.clone()).await;
        let sent = server.ok(&id, "SendMessage", send_params("hello")).await;
        assert_eq!(sent["task"]["status"]["state"], "TASK_STATE_COMPLETED", "{sent}");
        delete(id).await;
    }
    let metrics = server
        .request(reqwest::Method::GET, "/metrics")
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(gauge(&metrics, "troupe_a2a_tasks_kept"), 0, "{metrics}");
    assert_eq!(gauge(&metrics, "troupe_a2a_agents_tracked"), 0, "{metrics}");
    server.stop().await;
}

/// Goal: an A2A task id is never given twice to one agent id, across a delete and a
/// restart: an agent deleted, then created again under its id after a restart on the
/// same SQLite file, runs a new turn for a new message and answers it. Before, the task
/// numbers restarted from the records read at start (none of the deleted agent's: the
/// delete took them), so the new task was given the deleted one's id, which the agent's
/// inbox (kept across the delete) deduplicates: it answered with the old task's outcome
/// and ran nothing. Method: a server on an SQLite file; create `again`, a completed
/// task, delete it, stop; a second server on the file; create `again`, send a new
/// message: a new task id, the new text's answer, and a model call of `again` in the
/// second server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_id_is_not_given_again_after_its_agent_is_deleted_and_the_server_restarts() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("troupe.db");
    let start = |llm: Arc<ScriptedLlm>| {
        let store = Arc::new(troupe_runtime::SqliteStore::open(&path).expect("the SQLite file opens"));
        let builder = troupe_agent::AgentSystem::builder()
            .llm(llm as _)
            .store(store as _)
            .agent(troupe_agent::AgentSpec::new("echo"));
        Harness::start(builder, ServerConfig::default().token(TOKEN))
    };
    let script = || Arc::new(ScriptedLlm::new().rule(ScriptRule::any_agent().reply("heard: {input}")));

    let first = start(script()).await;
    let (status, body) = first.post("/v1/agents", json!({"id": "again"})).await;
    assert_eq!(status, 201, "create: {body}");
    let old = first.ok("again", "SendMessage", send_params("first life")).await;
    assert_eq!(old["task"]["status"]["state"], "TASK_STATE_COMPLETED", "{old}");
    assert_eq!(
        text_of(&old["task"]["artifacts"][0]["parts"]),
        "heard: first life",
        "{old}"
    );
    let (status, body) = first.send(reqwest::Method::DELETE, "/v1/agents/again", None).await;
    assert_eq!(status, 204, "delete: {body}");
    first.stop().await;

    let llm = script();
    let second = start(Arc::clone(&llm)).await;
    let (status, body) = second.post("/v1/agents", json!({"id": "again"})).await;
    assert_eq!(status, 201, "create again: {body}");
    let new = second.ok("again", "SendMessage", send_params("second life")).await;
    assert_ne!(new["task"]["id"], old["task"]["id"], "a task id given again: {new}");
    assert_eq!(
        text_of(&new["task"]["artifacts"][0]["parts"]),
        "heard: second life",
        "the new message is answered, not the deleted agent's: {new}"
    );
    assert_eq!(llm.requests_of("again").len(), 1, "one turn of the new agent ran");
    second.stop().await;
}

/// Goal: two plain servers (not cluster nodes) on one store never give one agent's A2A
/// task id twice: each number is reserved in the store before it is given (before:
/// each server counted on its own from the `seq_next` it read at its agent's first
/// task, so with sends alternating between them the third task was numbered as the
/// second, `echo-task-1` on both, and the agent, whose inbox deduplicates external
/// tasks by id, answered it with the other server's task's outcome and ran nothing).
/// Method: two servers, each its own `AgentSystem`, on one SQLite file; blocking sends
/// alternate between them: four answered by the agent (each must be answered with its
/// own text; one the other runtime's claim fenced off is answered 503 `fenced`, as the
/// server answers `fenced` (429 until 2026-12-07), to send again, and is sent again), then enough
/// rejected ones (a chain that holds the agent: no turn, a task
/// all the same) that each server uses up its first block of numbers and reserves
/// another, while the other reserves between; every id, and every context id, differs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_on_one_store_never_give_one_agents_task_id_twice() {
    use troupe_server::limits::A2A_TASK_NUMBERS_RESERVED;
    /// Times one message is sent, at most, until a task of it is answered.
    const SENDS_PER_MESSAGE_MAX: usize = 3;
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("troupe.db");
    let servers = [server_on_file(&path).await, server_on_file(&path).await];
    let mut ids = std::collections::HashSet::new();
    let mut contexts = std::collections::HashSet::new();
    let mut take = |task: &Value, turn: usize| {
        let id = task["id"].as_str().expect("a task id").to_string();
        let context = task["contextId"].as_str().expect("a context id").to_string();
        assert!(ids.insert(id.clone()), "send {turn}: task id {id} given twice: {task}");
        assert!(
            contexts.insert(context.clone()),
            "send {turn}: context id {context} given twice: {task}"
        );
    };

    for (turn, text) in ["one", "two", "three", "four"].into_iter().enumerate() {
        // The two runtimes fence each other's activation of `echo`: the first turn on
        // a server after the other's is fenced off (nothing committed, the stale
        // activation closed) and answered 503 `fenced` with Retry-After (the server's
        // status for it; 429 until 2026-12-07); the message sent again (a new task) is
        // answered.
        let mut answered = None;
        for _ in 0..SENDS_PER_MESSAGE_MAX {
            let body = json!({"jsonrpc": "2.0", "id": "r1", "method": "SendMessage", "params": send_params(text)});
            let (status, headers, answer) = servers[turn % 2].raw("echo", body.to_string()).await;
            if status == 503 {
                assert!(answer.contains("fenced"), "send {turn}: {answer}");
                assert!(headers.get("retry-after").is_some(), "send {turn}: {headers:?}");
                continue;
            }
            assert_eq!(status, 200, "send {turn}: {answer}");
            let value: Value = serde_json::from_str(&answer).unwrap();
            let task = value["result"]["task"].clone();
            take(&task, turn);
            assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "send {turn}: {task}");
            answered = Some(task);
            break;
        }
        let task = answered.unwrap_or_else(|| panic!("send {turn} never answered"));
        assert_eq!(
            text_of(&task["artifacts"][0]["parts"]),
            format!("heard: {text}"),
            "send {turn} is answered for its own message: {task}"
        );
    }
    let rejected = usize::try_from(A2A_TASK_NUMBERS_RESERVED).unwrap() * 2 + 8;
    for turn in 4..4 + rejected {
        let mut params = send_params("hop");
        params["message"]["metadata"] = json!({"troupe": {"chain": ["a", "echo"], "depth": 2}});
        let result = servers[turn % 2].ok("echo", "SendMessage", params).await;
        assert_eq!(result["task"]["status"]["state"], "TASK_STATE_REJECTED", "{result}");
        take(&result["task"], turn);
    }
    assert!(ids.len() >= 4 + rejected, "{} ids", ids.len());
    let [first, second] = servers;
    first.stop().await;
    second.stop().await;
}

/// Waits (at most `TEST_WAIT_MS_MAX`) until `server` answers 200 for `path`: a server's
/// directory reads another process's changes within `DIRECTORY_REFRESH_MS`. Panics
/// with `never` if it does not.
async fn until_agent_shown(server: &Harness, path: &str, never: &str) {
    let waited = tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
        while server.get(path).await.0 != 200 {
            tokio::time::sleep(Duration::from_millis(support::POLL_MS)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "{never}");
}

/// A server with its own `AgentSystem` (agent `echo` on a model that answers "heard:
/// {input}") on the SQLite file at `path`, which other servers may share.
async fn server_on_file(path: &std::path::Path) -> Harness {
    let store = Arc::new(troupe_runtime::SqliteStore::open(path).expect("the SQLite file opens"));
    let llm = Arc::new(ScriptedLlm::new().rule(ScriptRule::any_agent().reply("heard: {input}")));
    let builder = troupe_agent::AgentSystem::builder()
        .llm(llm as _)
        .store(store as _)
        .agent(troupe_agent::AgentSpec::new("echo"));
    Harness::start(builder, ServerConfig::default().token(TOKEN)).await
}

/// Goal: when another process sharing the store deletes an agent, this server lets
/// that agent's A2A tasks go at the agent's next A2A request (the request that finds
/// the agent gone): its tasks leave memory (`/metrics`) and the store, and an agent
/// made again under the id does not show them. Method: two servers on one SQLite file;
/// `gone` is created on the first and gets a completed task there; the second deletes
/// it (its registry holds none of the first's tasks, so its own delete removes none of
/// them); a `GetTask` of the old task through the first is 404 once its directory has
/// read the delete (within `DIRECTORY_REFRESH_MS`); then the first holds no A2A task and
/// tracks no agent, the store holds no record of `gone`'s, and after `gone` is created
/// again the old task is -32001 on the first and `ListTasks` is empty. With the prune
/// removed (`forget` not called from the request that finds the agent gone) the first
/// still holds the task: checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_deleted_by_another_process_has_its_a2a_tasks_let_go_at_its_next_request() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("troupe.db");
    let here = server_on_file(&path).await;
    let elsewhere = server_on_file(&path).await;
    let metrics = |server: &Harness| {
        let request = server
            .request(reqwest::Method::GET, "/metrics")
            .bearer_auth(TOKEN)
            .send();
        async move { request.await.unwrap().text().await.unwrap() }
    };

    let (status, body) = here.post("/v1/agents", json!({"id": "gone"})).await;
    assert_eq!(status, 201, "create: {body}");
    let sent = here.ok("gone", "SendMessage", send_params("before")).await;
    assert_eq!(sent["task"]["status"]["state"], "TASK_STATE_COMPLETED", "{sent}");
    let old_task = sent["task"]["id"].as_str().unwrap().to_string();
    let shown = metrics(&here).await;
    assert_eq!(gauge(&shown, "troupe_a2a_tasks_kept"), 1, "{shown}");

    // The other process reads the definition, then deletes it.
    until_agent_shown(&elsewhere, "/v1/agents/gone", "the other server never saw `gone`").await;
    let (status, body) = elsewhere.send(reqwest::Method::DELETE, "/v1/agents/gone", None).await;
    assert_eq!(status, 204, "delete elsewhere: {body}");

    // This server's next A2A request for `gone` finds it gone (once its directory has
    // read the delete) and lets its tasks go.
    let get_old = json!({"jsonrpc": "2.0", "id": "r1", "method": "GetTask", "params": {"id": old_task}});
    let waited = tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
        loop {
            let (status, _, text) = here.raw("gone", get_old.to_string()).await;
            if status == 404 {
                return text;
            }
            assert_eq!(status, 200, "{text}");
            tokio::time::sleep(Duration::from_millis(support::POLL_MS)).await;
        }
    })
    .await;
    let text = waited.expect("the delete made elsewhere reaches this server's lookups");
    assert!(text.contains("agent_not_found"), "{text}");
    let shown = metrics(&here).await;
    assert_eq!(
        gauge(&shown, "troupe_a2a_tasks_kept"),
        0,
        "the deleted agent's task is still held: {shown}"
    );
    assert_eq!(gauge(&shown, "troupe_a2a_agents_tracked"), 0, "{shown}");
    let store = Arc::clone(here.system().runtime().store());
    let key_space = troupe_core::ActorId::new("troupe-a2a", "gone").unwrap();
    let stored = store.scan(&key_space, "task/", None, 16).await.unwrap();
    assert!(
        stored.is_empty(),
        "the deleted agent's task records are still stored: {stored:?}"
    );

    // Made again (elsewhere), the agent has none of the old one's tasks here.
    let (status, body) = elsewhere.post("/v1/agents", json!({"id": "gone"})).await;
    assert_eq!(status, 201, "create again: {body}");
    until_agent_shown(&here, "/v1/agents/gone", "this server never saw `gone` made again").await;
    let (code, message) = here.error("gone", "GetTask", json!({"id": old_task})).await;
    assert_eq!(code, -32001, "{message}");
    let listed = here.ok("gone", "ListTasks", json!({})).await;
    assert_eq!(listed["totalSize"], 0, "{listed}");
    here.stop().await;
    elsewhere.stop().await;
}

/// How far the server's clock may stand from the wall clock in these tests, in
/// microseconds: the runtime's clock reads the wall clock once, at its start, and counts
/// on the monotonic clock from there, which NTP may slew (at most 500 ppm) away from it.
const WALL_CLOCK_SLACK_US: i128 = 100_000;

/// The wall clock in microseconds since the Unix epoch (library code reads the
/// runtime's clock instead).
#[allow(
    clippy::disallowed_methods,
    reason = "a test compares the server's status times with the wall clock"
)]
fn wall_clock_us() -> i128 {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("the wall clock is past 1970");
    i128::try_from(since.as_micros()).unwrap()
}

/// A task's `status.timestamp`, which must be there: its text and its time in
/// microseconds since the Unix epoch. Its form is checked: RFC 3339 in UTC with six
/// fractional digits, as protobuf writes a `Timestamp` in JSON.
fn status_time(task: &Value) -> (String, i128) {
    let text = task["status"]["timestamp"]
        .as_str()
        .unwrap_or_else(|| panic!("no status.timestamp: {task}"))
        .to_string();
    assert_eq!(text.len(), "2026-12-06T06:41:29.123456Z".len(), "{text}");
    assert!(text.ends_with('Z'), "{text}");
    let at = time::OffsetDateTime::parse(&text, &time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|error| panic!("{text:?} is not RFC 3339: {error}"));
    (text, at.unix_timestamp_nanos() / 1_000)
}

/// Goal: a task's status carries A2A's `timestamp`, the time it entered its state by
/// the server's clock (which is anchored on the wall clock): a task answered at once
/// as `submitted` carries a time between wall-clock reads taken before and after the
/// send, the same task once completed a later one, which reads back unchanged; a
/// blocking send's completed task, a time within the send. Before, statuses carried no
/// time. Method: `echo`, one send returning at once, polled to its end, and one
/// blocking send.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tasks_status_carries_the_time_it_entered_its_state() {
    let server = start().await;
    let mut params = send_params("when");
    params["configuration"] = json!({"returnImmediately": true});
    let before = wall_clock_us();
    let submitted = server.ok("echo", "SendMessage", params).await["task"].clone();
    let after = wall_clock_us();
    assert_eq!(submitted["status"]["state"], "TASK_STATE_SUBMITTED", "{submitted}");
    let (_, submitted_at) = status_time(&submitted);
    assert!(
        (before - WALL_CLOCK_SLACK_US..=after + WALL_CLOCK_SLACK_US).contains(&submitted_at),
        "submitted at {submitted_at} µs, sent between {before} and {after}: {submitted}"
    );
    let id = submitted["id"].as_str().unwrap().to_string();
    let completed = tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
        loop {
            let task = server.ok("echo", "GetTask", json!({"id": id})).await;
            if task["status"]["state"] == "TASK_STATE_COMPLETED" {
                break task;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the task completes");
    let (completed_text, completed_at) = status_time(&completed);
    assert!(
        completed_at > submitted_at,
        "a new state, a new time: submitted {submitted}, completed {completed}"
    );
    assert!(completed_at <= wall_clock_us() + WALL_CLOCK_SLACK_US, "{completed}");
    let again = server.ok("echo", "GetTask", json!({"id": id})).await;
    assert_eq!(
        status_time(&again).0,
        completed_text,
        "the time a state began, not of the read"
    );

    let before = wall_clock_us();
    let blocking = server.ok("echo", "SendMessage", send_params("now")).await["task"].clone();
    let after = wall_clock_us();
    assert_eq!(blocking["status"]["state"], "TASK_STATE_COMPLETED", "{blocking}");
    let (_, blocking_at) = status_time(&blocking);
    assert!(
        (before - WALL_CLOCK_SLACK_US..=after + WALL_CLOCK_SLACK_US).contains(&blocking_at),
        "completed at {blocking_at} µs, sent between {before} and {after}: {blocking}"
    );
    server.stop().await;
}

/// Goal: a task's status time is stored with its record and read back after a restart;
/// a record stored by a version before it was kept (no time) loads and is served without
/// one; `ListTasks` with `statusTimestampAfter` keeps only the tasks whose status time
/// is at or after it (as the `a2a-sdk`'s own task stores compare), leaving out a task
/// without one, and a value that is not an RFC 3339 time is invalid params naming it.
/// Before, `statusTimestampAfter` was refused whatever its value (tasks carried no
/// time). Method: an older record written to a memory store before a server starts on
/// it; two blocking sends, listed with each one's time and others; the server stopped
/// and a second started on the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_times_are_stored_and_list_tasks_keeps_the_tasks_at_or_after_a_time() {
    let store = Arc::new(troupe_runtime::MemoryStore::new());
    // A record as the version before status times stored it.
    let older = a2a_records::stored_task("echo", None, 0, "Completed", "older", Some("echo: older"));
    a2a_records::write_records(&*store, "echo", &[older]).await;
    let start_on_store = || {
        let builder = support::agents(script(), &["echo"], KindConfig::default()).store(Arc::clone(&store) as _);
        Harness::start(builder, ServerConfig::default().token(TOKEN))
    };

    let server = start_on_store().await;
    let read_back = server.ok("echo", "GetTask", json!({"id": "echo-task-0"})).await;
    assert_eq!(read_back["status"]["state"], "TASK_STATE_COMPLETED", "{read_back}");
    assert!(read_back["status"].get("timestamp").is_none(), "{read_back}");
    let first = server.ok("echo", "SendMessage", send_params("first")).await["task"].clone();
    let (first_text, first_at) = status_time(&first);
    let second = server.ok("echo", "SendMessage", send_params("second")).await["task"].clone();
    let (second_text, second_at) = status_time(&second);
    assert!(second_at > first_at, "{first} {second}");
    let ids = |listed: &Value| -> Vec<String> {
        listed["tasks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|task| task["id"].as_str().unwrap().to_string())
            .collect()
    };
    let (first_id, second_id) = (first["id"].as_str().unwrap(), second["id"].as_str().unwrap());
    let all = server.ok("echo", "ListTasks", json!({})).await;
    assert_eq!(ids(&all), [second_id, first_id, "echo-task-0"], "{all}");
    let after = |time: &str| json!({"statusTimestampAfter": time});
    let since_second = server.ok("echo", "ListTasks", after(&second_text)).await;
    assert_eq!(ids(&since_second), [second_id], "{since_second}");
    assert_eq!(since_second["totalSize"], 1, "{since_second}");
    let since_first = server.ok("echo", "ListTasks", after(&first_text)).await;
    assert_eq!(ids(&since_first), [second_id, first_id], "{since_first}");
    // Any offset; a task without a time is left out.
    let since_2000 = server.ok("echo", "ListTasks", after("2000-01-01T02:00:00+02:00")).await;
    assert_eq!(ids(&since_2000), [second_id, first_id], "{since_2000}");
    let none = server.ok("echo", "ListTasks", after("9999-12-31T23:59:59Z")).await;
    assert_eq!(ids(&none), Vec::<String>::new(), "{none}");
    let (code, message) = server.error("echo", "ListTasks", after("yesterday")).await;
    assert_eq!(code, -32602, "{message}");
    assert!(message.contains("\"yesterday\""), "the value is named: {message}");
    let (code, message) = server
        .error("echo", "ListTasks", json!({"statusTimestampAfter": 1_796_000_000}))
        .await;
    assert_eq!(code, -32602, "{message}");
    assert!(message.contains("1796000000"), "the value is named: {message}");
    server.stop().await;

    let restarted = start_on_store().await;
    let first_again = restarted.ok("echo", "GetTask", json!({"id": first_id})).await;
    assert_eq!(status_time(&first_again).0, first_text, "stored with its record");
    let older_again = restarted.ok("echo", "GetTask", json!({"id": "echo-task-0"})).await;
    assert!(older_again["status"].get("timestamp").is_none(), "{older_again}");
    restarted.stop().await;
}

/// The ids of the tasks a `ListTasks` answered, in order.
fn listed_ids(listed: &Value) -> Vec<String> {
    listed["tasks"]
        .as_array()
        .unwrap_or_else(|| panic!("no tasks: {listed}"))
        .iter()
        .map(|task| task["id"].as_str().unwrap().to_string())
        .collect()
}

/// Polls `GetTask` of task `id` of `agent` until it is in `state` (an A2A state name),
/// for at most [`TEST_WAIT_MS_MAX`].
async fn until_state(server: &Harness, agent: &str, id: &str, state: &str) {
    tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
        while server.ok(agent, "GetTask", json!({"id": id})).await["status"]["state"] != state {
            tokio::time::sleep(Duration::from_millis(support::POLL_MS)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("task {id} was not {state} within {TEST_WAIT_MS_MAX} ms"));
}

/// Walks `ListTasks` of `agent` with `params` a page of `size` at a time from the first
/// page: the ids in the order listed, and the page tokens given. Every page is full but
/// the last, and says `total` tasks in all.
async fn walk_pages(server: &Harness, agent: &str, size: usize, total: usize) -> (Vec<String>, Vec<String>) {
    let mut seen = Vec::new();
    let mut tokens = Vec::new();
    let mut token = String::new();
    loop {
        let page = server
            .ok(agent, "ListTasks", json!({"pageSize": size, "pageToken": token}))
            .await;
        assert_eq!(page["totalSize"], total, "{page}");
        let ids = listed_ids(&page);
        token = page["nextPageToken"].as_str().unwrap().to_string();
        if !token.is_empty() {
            assert_eq!(ids.len(), size, "a page before the last is full: {page}");
            tokens.push(token.clone());
        }
        seen.extend(ids);
        assert!(seen.len() <= total, "more tasks than there are: {seen:?}");
        if token.is_empty() {
            return (seen, tokens);
        }
    }
}

/// Goal: `ListTasks` lists an agent's tasks as the `a2a-sdk` lists them: the task whose
/// state changed last first, not the task made last. A walk through the pages (each
/// token the place of its page's last task) goes on from that place: a task whose
/// state changes during the walk moves to the front and is skipped, and
/// `statusTimestampAfter` (the time of the first task listed) finds it. Before, tasks
/// were listed newest first by creation: t1, canceled after t3 was made, was listed
/// third (`[t3, t2, t1, t0]`). Method: `gated`'s model waits at a gate the test opens:
/// t0 runs (held), t1, t2 and t3 wait in the lane; t1 is canceled; then t2, during a
/// walk of pages of one; then the gate opens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_tasks_lists_the_task_whose_state_changed_last_first() {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let gated = support::Gated {
        script: ScriptedLlm::new().rule(ScriptRule::agent("gated").reply("gated: {input}")),
        gate: Arc::clone(&gate),
    };
    let builder = troupe_agent::AgentSystem::builder()
        .llm(Arc::new(gated))
        .kind_config(KindConfig::default())
        .agent(troupe_agent::AgentSpec::new("gated"));
    let server = Harness::start(builder, ServerConfig::default().token(TOKEN)).await;
    let mut ids = Vec::new();
    for text in ["t0", "t1", "t2", "t3"] {
        let mut params = send_params(text);
        params["configuration"] = json!({"returnImmediately": true});
        let task = server.ok("gated", "SendMessage", params).await["task"].clone();
        ids.push(task["id"].as_str().unwrap().to_string());
        if text == "t0" {
            until_state(&server, "gated", &ids[0], "TASK_STATE_WORKING").await;
        }
    }
    let [t0, t1, t2, t3] = [ids[0].as_str(), ids[1].as_str(), ids[2].as_str(), ids[3].as_str()];
    let canceled = server.ok("gated", "CancelTask", json!({"id": t1})).await;
    assert_eq!(canceled["status"]["state"], "TASK_STATE_CANCELED", "{canceled}");
    let listed = server.ok("gated", "ListTasks", json!({})).await;
    assert_eq!(
        listed_ids(&listed),
        [t1, t3, t2, t0],
        "the task whose state changed last first: {listed}"
    );
    let canceled_at = listed["tasks"][0]["status"]["timestamp"].as_str().unwrap().to_string();

    // A walk in pages of one; t2 is canceled after the first page.
    let page = server.ok("gated", "ListTasks", json!({"pageSize": 1})).await;
    assert_eq!(listed_ids(&page), [t1], "{page}");
    let canceled = server.ok("gated", "CancelTask", json!({"id": t2})).await;
    assert_eq!(canceled["status"]["state"], "TASK_STATE_CANCELED", "{canceled}");
    let mut seen = listed_ids(&page);
    let mut token = page["nextPageToken"].as_str().unwrap().to_string();
    while !token.is_empty() {
        let page = server
            .ok("gated", "ListTasks", json!({"pageSize": 1, "pageToken": token}))
            .await;
        assert_eq!(page["totalSize"], 4, "{page}");
        seen.extend(listed_ids(&page));
        token = page["nextPageToken"].as_str().unwrap().to_string();
        assert!(seen.len() <= 4, "{seen:?}");
    }
    assert_eq!(
        seen,
        [t1, t3, t0],
        "t2 moved ahead of the walk's place when it changed state: skipped"
    );
    let since = server
        .ok("gated", "ListTasks", json!({"statusTimestampAfter": canceled_at}))
        .await;
    assert_eq!(listed_ids(&since), [t2, t1], "what changed since: {since}");

    // t0 and then t3 run to their end: t3 changed state last.
    gate.add_permits(2);
    until_state(&server, "gated", t3, "TASK_STATE_COMPLETED").await;
    let listed = server.ok("gated", "ListTasks", json!({})).await;
    assert_eq!(listed_ids(&listed), [t3, t0, t2, t1], "{listed}");
    server.stop().await;
}

/// Goal: pages of `ListTasks` walk every task of the agent once, none missing, in the
/// `a2a-sdk`'s order: by status time, most recent first, tasks with the same time by id
/// compared as strings, greatest first (`echo-task-2` before `echo-task-11`), and the
/// tasks stored without a status time (by a version before 2026-12-06) last, by id
/// (`echo-task-9` before `echo-task-10`), in pages of 1 or 4; a task made between two
/// pages does not move the pages after it. Before, tasks were listed by number, newest
/// first (`11, 10, 9, 2` after the new ones). Method: four records written to the
/// store before the server starts (two with one status time in 2026-01, two without),
/// and two blocking sends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_tasks_pages_walk_every_task_once_in_the_sdks_order() {
    /// 2026-01-01T00:00:00Z, in microseconds since the Unix epoch.
    const JANUARY_US: u64 = 1_767_225_600_000_000;
    let store = Arc::new(troupe_runtime::MemoryStore::new());
    let timed = |seq: u64| {
        let (key, mut record) = a2a_records::stored_task("echo", None, seq, "Completed", "timed", Some("echo: timed"));
        record["state_since_micros"] = json!(JANUARY_US);
        (key, record)
    };
    let untimed = |seq: u64| a2a_records::stored_task("echo", None, seq, "Completed", "untimed", Some("echo: untimed"));
    a2a_records::write_records(&*store, "echo", &[timed(2), timed(11), untimed(9), untimed(10)]).await;
    let builder = support::agents(script(), &["echo"], KindConfig::default()).store(Arc::clone(&store) as _);
    let server = Harness::start(builder, ServerConfig::default().token(TOKEN)).await;
    let first = server.ok("echo", "SendMessage", send_params("first")).await["task"]["id"].clone();
    let second = server.ok("echo", "SendMessage", send_params("second")).await["task"]["id"].clone();
    let (first, second) = (first.as_str().unwrap(), second.as_str().unwrap());
    let expected = [
        second,
        first,
        "echo-task-2",
        "echo-task-11",
        "echo-task-9",
        "echo-task-10",
    ];

    let all = server.ok("echo", "ListTasks", json!({})).await;
    assert_eq!(listed_ids(&all), expected, "{all}");
    assert_eq!(all["totalSize"], 6, "{all}");
    assert_eq!(all["nextPageToken"], "", "{all}");
    let times: Vec<Option<&str>> = all["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|task| task["status"]["timestamp"].as_str())
        .collect();
    assert_eq!(
        times[2..],
        [
            Some("2026-01-01T00:00:00.000000Z"),
            Some("2026-01-01T00:00:00.000000Z"),
            None,
            None
        ],
        "{all}"
    );
    let (seen, _) = walk_pages(&server, "echo", 1, 6).await;
    assert_eq!(seen, expected, "pages of one");
    let (seen, _) = walk_pages(&server, "echo", 4, 6).await;
    assert_eq!(seen, expected, "pages of four");

    // A task made between two pages is listed first, ahead of the walk: the pages after
    // are as they were.
    let page = server.ok("echo", "ListTasks", json!({"pageSize": 2})).await;
    assert_eq!(listed_ids(&page), expected[..2], "{page}");
    let third = server.ok("echo", "SendMessage", send_params("third")).await["task"]["id"].clone();
    let mut token = page["nextPageToken"].as_str().unwrap().to_string();
    for wanted in [&expected[2..4], &expected[4..]] {
        let page = server
            .ok("echo", "ListTasks", json!({"pageSize": 2, "pageToken": token}))
            .await;
        assert_eq!(listed_ids(&page), wanted, "{page}");
        assert_eq!(page["totalSize"], 7, "{page}");
        token = page["nextPageToken"].as_str().unwrap().to_string();
    }
    assert_eq!(token, "", "the last page");
    let all = server.ok("echo", "ListTasks", json!({})).await;
    assert_eq!(listed_ids(&all)[0], third.as_str().unwrap(), "{all}");
    server.stop().await;
}

/// Goal: a `ListTasks` page token of the versions before 2026-12-06 (a task number,
/// `{seq}` or `{seq}.{node}`, a place in the order by number, which means nothing in the
/// order by status time) is invalid params naming it and saying what it is, and so is a
/// token this server did not write (one it wrote, altered). Before, `"2"` was a token
/// (the tasks numbered below 2). Method: `echo`, two blocking sends, pages of one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_token_of_the_versions_that_listed_by_number_is_refused_naming_it() {
    let server = start().await;
    for text in ["one", "two"] {
        server.ok("echo", "SendMessage", send_params(text)).await;
    }
    let (seen, tokens) = walk_pages(&server, "echo", 1, 2).await;
    assert_eq!(seen.len(), 2, "{seen:?}");
    // Tokens of the versions before 2026-12-06, and altered ones.
    for token in ["2", "12", "11.h1"] {
        let (code, message) = server.error("echo", "ListTasks", json!({"pageToken": token})).await;
        assert_eq!(code, -32602, "{token}: {message}");
        assert!(
            message.contains(&format!("{token:?}")) && message.contains("a Troupe server before 2026-12-06"),
            "the old token is named and said to be one: {message}"
        );
    }
    let timed_token = &tokens[0];
    let altered = [
        timed_token.to_uppercase(),
        format!("{timed_token}0"),
        timed_token.replacen('c', "c0", 1),
        timed_token.replacen('.', "x.", 1),
    ];
    for token in altered {
        let (code, message) = server.error("echo", "ListTasks", json!({"pageToken": token})).await;
        assert_eq!(code, -32602, "{token}: {message}");
        assert!(
            message.contains(&format!("\"pageToken\" {token:?} is not one this server gave")),
            "{message}"
        );
    }
    server.stop().await;
}

/// Goal: a task sent with Troupe's context and `timeout_ms` T that times out says
/// "timed out after T ms", the time its caller gave (as the runtime's own texts do,
/// `crates/troupe-agent/tests/timeout_texts.rs`). Until 2026-12-06 it named no time
/// ("timeout: invocation of agent/slow timed out: its deadline passed"; before the
/// runtime's texts were fixed, the time left when its turn was handed over, read from a
/// later clock: 199 ms for 200). Method: `slow` (a 3 s turn) asked with `timeout_ms` 200 and 350, blocking.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_task_names_the_timeout_its_caller_gave() {
    let server = start().await;
    for timeout_ms in [200_u64, 350] {
        let mut params = send_params("take your time");
        params["message"]["metadata"] = json!({"troupe": {"chain": ["a"], "depth": 1, "timeout_ms": timeout_ms}});
        let sent = server.ok("slow", "SendMessage", params).await;
        assert_eq!(sent["task"]["status"]["state"], "TASK_STATE_FAILED", "{sent}");
        let text = text_of(&sent["task"]["status"]["message"]["parts"]);
        assert!(
            text.contains(&format!("timed out after {timeout_ms} ms")),
            "timeout_ms {timeout_ms}: {text}"
        );
    }
    server.stop().await;
}
