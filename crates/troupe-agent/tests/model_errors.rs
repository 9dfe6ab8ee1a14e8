//! An agent whose model fails answers its caller with the model's error, typed: an
//! embedder's ask gets `AgentCallError::ModelFailed` carrying the `LlmError` (rate
//! limited? request too large? stopped early? timed out?), and a calling agent's
//! `call_agent` tool result names the error's kind for its model. A turn that fails
//! otherwise is still `ActorFailed`.
//!
//! Method: a model client that fails each request with a given `LlmError`; asks from
//! outside and `call_agent` from a scripted coordinator.
//!
//! Runs in both builds: `cargo nextest run -p troupe-agent --test model_errors`, and
//! under madsim (`RUSTFLAGS="--cfg madsim"`).

use std::sync::Arc;

use async_trait::async_trait;
use serde_json::json;
use troupe_agent::{
    AgentCallError, AgentSpec, AgentSystem, EarlyStop, LlmClient, LlmError, LlmReply, LlmRequest, LlmRouter,
    ModelFailed, ScriptRule, ScriptedLlm,
};
use troupe_core::InvokeError;

/// A model whose every answer is `error`.
struct Failing(LlmError);

#[async_trait]
impl LlmClient for Failing {
    async fn complete(&self, _request: LlmRequest) -> Result<LlmReply, LlmError> {
        Err(self.0.clone())
    }
}

/// Every kind of model failure an agent's turn can end with (`OverTokenLimit` is the
/// turn's budget exhausted, `budgets.rs`).
fn failures() -> Vec<LlmError> {
    vec![
        LlmError::Timeout { timeout_ms: 1_234 },
        LlmError::Provider {
            status: 429,
            body: "{\"error\": {\"message\": \"Rate limit reached: retry: later\"}}".into(),
            retry_after_ms: Some(2_000),
        },
        LlmError::Provider {
            status: 413,
            body: "request too large".into(),
            retry_after_ms: None,
        },
        LlmError::Provider {
            status: 400,
            body: "This model's maximum context length is 8192 tokens".into(),
            retry_after_ms: None,
        },
        LlmError::Provider {
            status: 503,
            body: String::new(),
            retry_after_ms: Some(0),
        },
        LlmError::Unreachable {
            cause: "connection refused".into(),
        },
        LlmError::Malformed {
            cause: "the response has no choices".into(),
        },
        LlmError::StoppedEarly {
            reason: EarlyStop::ContentFilter,
            finish_reason: "content_filter".into(),
            partial_bytes: 12,
        },
        LlmError::Injected {
            cause: "provider down".into(),
        },
    ]
}

/// A system whose agent `b` has `failing` for its model, and `coordinator`, on the
/// scripted model, which asks b with `call_agent` and answers with the tool's result.
fn system(failing: LlmError) -> AgentSystem {
    let scripted = ScriptedLlm::new()
        .rule(ScriptRule::agent("coordinator").on_tool_result().reply("{tool_result}"))
        .rule(ScriptRule::agent("coordinator").call("call_agent", json!({"agent_id": "b", "message": "{input}"})));
    let llm = LlmRouter::new(Arc::new(scripted)).route("b", Arc::new(Failing(failing)));
    AgentSystem::builder()
        .llm(Arc::new(llm))
        .agent(AgentSpec::new("coordinator"))
        .agent(AgentSpec::new("b"))
        .start()
        .expect("the system starts")
}

/// Goal: an ask to an agent whose model fails is matched by the model's error: the
/// variant and its fields (the provider's status and body), for every kind. Before,
/// each was `AgentCallError::Invoke(ActorFailed { cause: "the model failed: ..." })`,
/// text only.
#[tokio::test]
async fn an_ask_to_an_agent_whose_model_fails_is_matched_by_the_models_error() {
    for failing in failures() {
        let system = system(failing.clone());
        let answer = system.ask("b", "hi").await;
        match answer {
            Err(AgentCallError::ModelFailed(ModelFailed { agent, error })) => {
                assert_eq!(agent.key(), "b");
                assert_eq!(error, failing);
            }
            other => panic!("expected ModelFailed with {failing:?}, got {other:?}"),
        }
        assert!(
            system.conversation_log("b").await.unwrap().is_empty(),
            "a failed turn commits nothing"
        );
        system.shutdown().await;
    }
    // The usual match of an embedder: rate limited, with the provider's status.
    let system = system(LlmError::Provider {
        status: 429,
        body: "slow down".into(),
        retry_after_ms: Some(1_500),
    });
    let rate_limited = matches!(
        system.ask("b", "hi").await,
        Err(AgentCallError::ModelFailed(ModelFailed {
            error: LlmError::Provider {
                status: 429,
                retry_after_ms: Some(1_500),
                ..
            },
            ..
        }))
    );
    assert!(rate_limited);
    system.shutdown().await;
}

/// The `call_agent` test, on the runtime `call_agent_*` runs on.
async fn call_agent_names_the_kind() {
    for failing in failures() {
        let system = system(failing.clone());
        let reply = system.ask("coordinator", "hi").await.unwrap();
        let kind = format!("({})", failing.kind());
        assert!(
            reply.text.starts_with("error: ")
                && reply.text.contains(&kind)
                && reply.text.contains(&failing.to_string()),
            "the calling model reads {:?}, which should name {kind} and {failing}",
            reply.text
        );
        system.shutdown().await;
    }
}

/// Goal: `call_agent`'s tool result names the callee's model error and its kind
/// (`rate_limited`, `too_large`, `timeout`, ...) for the calling model. Before, it
/// read "call failed: agent/b failed: the model failed: ..." without a kind.
#[tokio::test]
async fn call_agent_tells_the_calling_model_the_kind_of_the_callees_model_error() {
    call_agent_names_the_kind().await;
}

/// [`call_agent_tells_the_calling_model_the_kind_of_the_callees_model_error`] on the
/// multi-thread runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn call_agent_tells_the_calling_model_the_kind_on_the_multi_thread_runtime() {
    call_agent_names_the_kind().await;
}

/// Goal: a turn that fails for another reason than its model (here: it used all its
/// model steps) is still `ActorFailed`, not a model failure.
#[tokio::test]
async fn a_turn_that_fails_otherwise_is_still_actor_failed() {
    let scripted = ScriptedLlm::new()
        .rule(ScriptRule::agent("b").call("call_agent", json!({"agent_id": "nobody", "message": "x"})));
    let spec = AgentSpec::new("b").max_steps(1);
    let system = AgentSystem::builder()
        .llm(Arc::new(scripted))
        .agent(spec)
        .start()
        .expect("the system starts");
    match system.ask("b", "hi").await {
        Err(AgentCallError::Invoke(InvokeError::ActorFailed { cause, .. })) => {
            assert!(cause.contains("used all 1 model steps"), "{cause}");
        }
        other => panic!("expected ActorFailed, got {other:?}"),
    }
    system.shutdown().await;
}
