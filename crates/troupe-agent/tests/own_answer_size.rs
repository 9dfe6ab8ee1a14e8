//! An agent keeps its own answer as its caller gets it: cut to
//! `AGENT_REPLY_SIZE_MAX_BYTES` on a character boundary, in its log and in its history
//! window, so a provider's oversized answer does not go into every later prompt.
//!
//! Runs in both builds: `cargo test -p troupe-agent --test own_answer_size`.

use std::sync::Arc;

use troupe_agent::limits::AGENT_REPLY_SIZE_MAX_BYTES;
use troupe_agent::{AgentSpec, AgentSystem, Role, ScriptRule, ScriptedLlm};
use troupe_runtime::MemoryStore;

/// Goal: an answer of 8 MiB (a misbehaving provider) is kept by the agent as its caller
/// gets it: at most `AGENT_REPLY_SIZE_MAX_BYTES`, cut on a character boundary, in the
/// log entry and in the prompt of the next turn. Method: a scripted model answers
/// "huge" with one ASCII byte and then two-byte characters (so the limit falls inside
/// one), and "next" with "ok"; then the agent's log and its next prompt are read.
#[tokio::test(start_paused = true)]
async fn an_agents_own_oversized_answer_is_kept_cut_to_the_reply_limit() {
    let huge = format!("a{}", "é".repeat(4 * 1024 * 1024));
    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("a").on_user_containing("huge").reply(huge.clone()))
        .rule(ScriptRule::agent("a").on_user_containing("next").reply("ok"));
    let system = AgentSystem::builder()
        .store(Arc::new(MemoryStore::new()))
        .llm(Arc::new(llm.clone()))
        .agent(AgentSpec::new("a"))
        .start()
        .expect("the system starts");

    let reply = system.ask("a", "answer huge").await.unwrap();
    assert!(reply.truncated);
    assert!(reply.text.len() <= AGENT_REPLY_SIZE_MAX_BYTES);
    assert!(huge.starts_with(&reply.text));
    assert_eq!(
        reply.text.len(),
        AGENT_REPLY_SIZE_MAX_BYTES - 1,
        "cut at the last whole character"
    );

    let log = system.conversation_log("a").await.unwrap();
    let kept = log
        .iter()
        .rfind(|message| message.role == Role::Assistant)
        .expect("the answer is logged");
    assert_eq!(
        kept.content.len(),
        reply.text.len(),
        "the log keeps what the caller got"
    );
    assert_eq!(kept.content, reply.text);

    assert_eq!(system.ask("a", "next").await.unwrap().text, "ok");
    let prompt = llm.requests_of("a").pop().expect("a model request");
    let shown = prompt
        .messages
        .iter()
        .find(|message| message.role == Role::Assistant)
        .expect("the earlier answer is in the window");
    assert_eq!(
        shown.content.len(),
        reply.text.len(),
        "the next prompt holds the cut answer"
    );
    let prompt_bytes: usize = prompt.messages.iter().map(|message| message.content.len()).sum();
    assert!(
        prompt_bytes < 2 * AGENT_REPLY_SIZE_MAX_BYTES,
        "the next prompt holds {prompt_bytes} bytes"
    );
    system.shutdown().await;
}
