//! External tasks' call context (`ExternalTaskRequest::chain` and `depth`) as an
//! embedder gives it to `AgentClient::delegate_external` directly, without the A2A
//! server's `TroupeCallMetadata::check` in front: an inconsistent one is refused with a
//! typed error and nothing is kept, instead of panicking in `CallContext::continued`.
//!
//! Runs in both builds: `cargo test -p troupe-agent --test external_context` (tokio with
//! paused time) and under madsim (`RUSTFLAGS="--cfg madsim"`).

use std::sync::Arc;

use troupe_agent::{AgentSpec, AgentSystem, ExternalTaskRequest, InboxError, ScriptRule, ScriptedLlm};
use troupe_core::limits::AGENT_CALL_DEPTH_MAX;
use troupe_core::InvokeError;
use troupe_runtime::MemoryStore;

fn start() -> AgentSystem {
    let llm = ScriptedLlm::new().rule(ScriptRule::agent("echo").reply("echo: {input}"));
    AgentSystem::builder()
        .store(Arc::new(MemoryStore::new()))
        .llm(Arc::new(llm))
        .agent(AgentSpec::new("echo"))
        .start()
        .expect("the system starts")
}

fn request(msg_id: &str, chain: &[&str], depth: u32) -> ExternalTaskRequest {
    ExternalTaskRequest {
        origin: "test".to_string(),
        msg_id: msg_id.to_string(),
        text: "hello".to_string(),
        chain: chain.iter().map(ToString::to_string).collect(),
        depth,
        ..ExternalTaskRequest::default()
    }
}

/// Goal: a request whose depth is below its chain's length (every agent in the chain
/// is one call deeper), whose chain holds a string that is no agent id, or whose chain
/// is longer than any call tree, is refused with `InboxError::Invoke(Rejected)` naming
/// the field, and nothing is kept (no record, no inbox entry); a consistent one is still
/// accepted. Before the check the first request panicked the caller's task in
/// `CallContext::continued` ("a chain of 2 actors cannot arrive at depth 1").
#[tokio::test(start_paused = true)]
async fn an_external_request_whose_depth_is_below_its_chain_is_refused_not_a_panic() {
    let system = start();
    let longest = AGENT_CALL_DEPTH_MAX as usize + 1;
    let too_long: Vec<String> = (0..=longest).map(|n| format!("a{n}")).collect();
    let too_long: Vec<&str> = too_long.iter().map(String::as_str).collect();
    let refused = [
        (request("bad-1", &["a", "b"], 1), "depth"),
        (request("bad-2", &["a"], 0), "depth"),
        (request("bad-3", &["", "b"], 2), "not an agent id"),
        (request("bad-4", &too_long, u32::MAX), "more than the limit"),
    ];
    for (request, names) in refused {
        let shown = format!("{:?} at depth {}", request.chain, request.depth);
        match system.delegate_external("echo", request).await {
            Err(InboxError::Invoke(InvokeError::Rejected { target, reason })) => {
                assert_eq!(target.key(), "echo", "{shown}");
                assert!(reason.contains(names), "{shown}: {reason}");
            }
            other => panic!("{shown}: expected a rejection, got {other:?}"),
        }
    }
    assert!(system.external_tasks("echo", None, 10).await.unwrap().is_empty());
    assert_eq!(system.pending("echo").await.unwrap(), (0, 0));

    let accepted = system
        .delegate_external("echo", request("good", &["a", "b"], 2))
        .await
        .expect("a consistent context is accepted");
    let task = system.external_task("echo", &accepted).await.unwrap().unwrap();
    assert_eq!((task.chain, task.depth), (vec!["a".to_string(), "b".to_string()], 2));
    system.shutdown().await;
}
