//! Remote agents through the Rust API: declared on the builder, they appear to the
//! model like local agents under the organisation's rules, and the organisation's
//! admission applies to them by their local id before anything is sent. (Calls over
//! HTTP between two servers: `crates/troupe-cli/tests/remote_agents.rs`.)
//!
//! Runs in both builds: `cargo test -p troupe-agent --test remote_agents` (tokio,
//! paused time) and under `RUSTFLAGS="--cfg madsim"` (the simulator). No call here
//! reaches the network.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use troupe_agent::{
    AgentEvent, AgentSpec, AgentSystem, AgentSystemError, BehaviourMode, CallApproval, ContactKind, Link, Membership,
    OrgPolicy, RemoteAgent, RemoteAgentError, ScriptRule, ScriptedLlm,
};

/// A loopback URL no test sends to: every call here is refused before sending.
const UNUSED_URL: &str = "http://127.0.0.1:9/a2a/analyst";

fn start(llm: &ScriptedLlm) -> AgentSystem {
    AgentSystem::builder()
        .llm(Arc::new(llm.clone()))
        .agent(AgentSpec::new("a").role("the a"))
        .agent(AgentSpec::new("b").role("the b"))
        .remote_agent(RemoteAgent::new("hq", UNUSED_URL).role("analyses for HQ"))
        .remote_agent(RemoteAgent::new("far", UNUSED_URL))
        .start()
        .expect("the system starts")
}

/// Goal: a remote agent is listed to the model like a local one, with its role, only
/// when the organisation lets the agent reach it. Method: enforced policy with links
/// a–b and a–hq; read a's system prompt and tool descriptions.
#[tokio::test(start_paused = true)]
async fn a_reachable_remote_agent_is_listed_like_a_local_one() {
    let llm = ScriptedLlm::new().rule(ScriptRule::any_agent().reply("ok"));
    let system = start(&llm);
    assert_eq!(system.remote_agents().len(), 2);
    system.set_org_policy(OrgPolicy::Enforced).await.unwrap();
    system.add_link(Link::new("a", "b")).await.unwrap();
    system.add_link(Link::new("a", "hq")).await.unwrap();
    system.ask("a", "hi").await.unwrap();
    let request = &llm.requests_of("a")[0];
    let prompt = &request.messages[0].content;
    assert!(prompt.contains("- b: the b\n- hq: analyses for HQ"), "{prompt}");
    assert!(!prompt.contains("far"), "{prompt}");
    let call_agent = request.tools.iter().find(|tool| tool.name == "call_agent").unwrap();
    assert!(
        call_agent.description.ends_with(" Agents you may contact: b, hq."),
        "{}",
        call_agent.description
    );
    system.shutdown().await;
}

/// Goal: the organisation's rules apply to a remote agent by its local id, before
/// anything is sent. Method: enforced policy, no link to `far`; a's model calls it.
#[tokio::test(start_paused = true)]
async fn a_remote_agent_without_a_link_is_not_permitted_and_nothing_is_sent() {
    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("a").on_tool_result().reply("{tool_result}"))
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("")
                .call("call_agent", json!({"agent_id": "far", "message": "hello"})),
        );
    let system = start(&llm);
    system.set_org_policy(OrgPolicy::Enforced).await.unwrap();
    let reply = system.ask("a", "go").await.unwrap();
    assert!(
        reply.text.contains("call not permitted: a may not ask far"),
        "{}",
        reply.text
    );
    system.shutdown().await;
}

/// Goal: an agent whose calls needing approval are sent as tasks
/// (`CallApproval::Delegate`) still waits in its turn when the call is to a remote
/// agent, which cannot be sent a task: the approval is an `ask`, and denying it refuses
/// the call (nothing is sent). Method: `a` supervised, its model calls `hq`; the
/// approval is denied while the call waits.
#[tokio::test(start_paused = true)]
async fn a_call_to_a_remote_agent_needing_approval_waits_in_the_turn_even_when_calls_go_as_tasks() {
    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("a").on_tool_result().reply("{tool_result}"))
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("")
                .call("call_agent", json!({"agent_id": "hq", "message": "hello"})),
        );
    let system = AgentSystem::builder()
        .llm(Arc::new(llm.clone()))
        .agent(AgentSpec::new("a").call_approval(CallApproval::Delegate))
        .remote_agent(RemoteAgent::new("hq", UNUSED_URL))
        .start()
        .expect("the system starts");
    let supervised = Membership {
        manager: None,
        mode: BehaviourMode::Supervised,
    };
    system.set_membership("a", supervised).await.unwrap();
    let mut events = system.subscribe();
    let client = system.client();
    let asked = tokio::spawn(async move { client.ask("a", "go").await });
    let requested = async {
        loop {
            if let AgentEvent::ApprovalRequested { id, kind, .. } = events.recv().await.unwrap() {
                break (id, kind);
            }
        }
    };
    let (id, kind) = tokio::time::timeout(Duration::from_secs(10), requested)
        .await
        .expect("the call asks for an approval");
    assert_eq!(kind, ContactKind::Ask, "a call, not a task");
    system.deny(id).await.unwrap();
    let reply = asked.await.unwrap().unwrap();
    assert!(
        reply
            .text
            .contains(&format!("a may not ask hq: approval {id} was denied")),
        "{}",
        reply.text
    );
    assert_eq!(system.pending("a").await.unwrap(), (0, 0), "no task was queued");
    system.shutdown().await;
}

/// Goal: a remote agent cannot take a local agent's id, and a bad URL is refused
/// naming it. Method: start systems with such remote agents.
#[tokio::test(start_paused = true)]
async fn the_builder_refuses_a_clashing_id_and_a_bad_url() {
    let llm = ScriptedLlm::new();
    let clash = AgentSystem::builder()
        .llm(Arc::new(llm.clone()))
        .agent(AgentSpec::new("a"))
        .remote_agent(RemoteAgent::new("a", UNUSED_URL))
        .start();
    assert!(
        matches!(clash, Err(AgentSystemError::Remote(RemoteAgentError::ClashesWithLocal { ref id })) if id == "a"),
        "{clash:?}"
    );
    let bad = AgentSystem::builder()
        .llm(Arc::new(llm))
        .remote_agent(RemoteAgent::new("hq", "127.0.0.1:8080/a2a/hq"))
        .start();
    let error = bad.expect_err("a URL without a scheme is refused").to_string();
    assert!(
        error.contains("\"127.0.0.1:8080/a2a/hq\"") && error.contains("http://"),
        "{error}"
    );
}

/// Goal: a call to a remote agent that waited in its turn for approval sends only the
/// time the caller has left after the wait, and gives up at the caller's deadline: a
/// child never gets more time than its parent has left. Method (normal build: a real
/// A2A endpoint on loopback that records the `metadata.troupe.timeout_ms` it is sent
/// and never answers, real time): `a` supervised calls `hq` with `timeout_ms` 3,000;
/// the approval is given 1.5 s later. The endpoint must be sent at most the 1.5 s left
/// (plus a slack), and the call must end by its deadline, 3 s after it was made, with
/// a timeout that names the 3,000 ms the caller gave.
#[cfg(not(madsim))]
#[tokio::test]
#[allow(clippy::disallowed_methods)] // wall-clock time: a real HTTP endpoint
async fn a_remote_call_that_waited_for_approval_sends_only_the_time_left() {
    const CALL_TIMEOUT_MS: u64 = 3_000;
    const APPROVED_AFTER_MS: u64 = 1_500;
    const SLACK_MS: u64 = 400;
    let sent: Arc<std::sync::Mutex<Vec<u64>>> = Arc::default();
    let recorded = Arc::clone(&sent);
    let endpoint = axum::routing::post(move |body: String| {
        let recorded = Arc::clone(&recorded);
        async move {
            let request: serde_json::Value = serde_json::from_str(&body).unwrap();
            let timeout_ms = request
                .pointer("/params/message/metadata/troupe/timeout_ms")
                .and_then(serde_json::Value::as_u64)
                .unwrap();
            recorded.lock().unwrap().push(timeout_ms);
            // Never answers in time.
            tokio::time::sleep(Duration::from_secs(30)).await;
            String::new()
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, axum::Router::new().route("/a2a/hq", endpoint)).await;
    });

    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("a").on_tool_result().reply("{tool_result}"))
        .rule(ScriptRule::agent("a").on_user_containing("").call(
            "call_agent",
            json!({"agent_id": "hq", "message": "hello", "timeout_ms": CALL_TIMEOUT_MS}),
        ));
    let system = AgentSystem::builder()
        .llm(Arc::new(llm))
        .agent(AgentSpec::new("a"))
        .remote_agent(RemoteAgent::new("hq", format!("http://{address}/a2a/hq")))
        .start()
        .expect("the system starts");
    let supervised = Membership {
        manager: None,
        mode: BehaviourMode::Supervised,
    };
    system.set_membership("a", supervised).await.unwrap();
    let mut events = system.subscribe();
    let client = system.client();
    let asked = tokio::spawn(async move { client.ask("a", "go").await });
    let requested = async {
        loop {
            if let AgentEvent::ApprovalRequested { id, .. } = events.recv().await.unwrap() {
                break id;
            }
        }
    };
    let id = tokio::time::timeout(Duration::from_secs(10), requested)
        .await
        .expect("the call asks for an approval");
    let called = std::time::Instant::now();
    tokio::time::sleep(Duration::from_millis(APPROVED_AFTER_MS)).await;
    system.approve(id).await.unwrap();
    let reply = asked.await.unwrap().unwrap();
    let took = called.elapsed();
    // The time the caller gave, not what was left when it was sent (before: "timed out
    // after 1499 ms").
    assert!(
        reply
            .text
            .contains(&format!("invocation of agent/hq timed out after {CALL_TIMEOUT_MS} ms")),
        "{}",
        reply.text
    );
    let sent = sent.lock().unwrap().clone();
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert!(
        sent[0] <= CALL_TIMEOUT_MS - APPROVED_AFTER_MS + SLACK_MS,
        "the remote agent was given {} ms, {APPROVED_AFTER_MS} ms after a call of {CALL_TIMEOUT_MS} ms",
        sent[0]
    );
    assert!(
        took < Duration::from_millis(CALL_TIMEOUT_MS + SLACK_MS),
        "the call ended {took:?} after it was made, past its {CALL_TIMEOUT_MS} ms"
    );
    system.shutdown().await;
    server.abort();
}
