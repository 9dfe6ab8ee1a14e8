//! An agent's log in the store: one entry per turn, keyed by the number of its last
//! message, and logs written one message per entry (before 2026-11-29) still read back.
//!
//! - A turn's messages are one entry, a JSON array exactly as `serde_json` writes the
//!   list; the full log, the window and the model's next prompt read back through it
//!   after a restart.
//! - A turn past `AGENT_LOG_ENTRY_CLOSE_BYTES` is split, and a message left alone in
//!   an entry is stored as the object it was before.
//! - A store written one message per entry (the old form) reads back the same: log,
//!   window, the model's prompt after a restart; new turns are appended after it.
//!
//! Runs in both builds: `cargo test -p troupe-agent --test log_entries` and
//! `CARGO_TARGET_DIR=target/madsim RUSTFLAGS="--cfg madsim" cargo test -p troupe-agent
//! --test log_entries`.

use std::sync::Arc;

use bytes::Bytes;
use serde_json::json;
use troupe_agent::limits::{
    AGENT_HISTORY_WINDOW_DEFAULT, AGENT_LOG_ENTRY_CLOSE_BYTES, AGENT_TOOL_RESULT_SIZE_MAX_BYTES,
};
use troupe_agent::{AgentSpec, AgentSystem, ChatMessage, Role, ScriptRule, ScriptedLlm, Tool};
use troupe_core::ActorId;
use troupe_runtime::{MemoryStore, StateChange, StateStore, TurnCommit};

/// Turns asked in the restart tests: 4 messages each, more than the window holds.
const TURNS: usize = 20;

/// An agent that calls `echo` with its input, then answers with what it read.
fn echoing_llm() -> ScriptedLlm {
    ScriptedLlm::new()
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("")
                .call("echo", json!({"text": "{input}"})),
        )
        .rule(ScriptRule::agent("a").on_tool_result().reply("read: {tool_result}"))
}

/// A tool that returns its `text` argument, `repeat` times over.
fn echo_tool(repeat: usize) -> Tool {
    Tool::from_fn(
        "echo",
        "Returns its text.",
        json!({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}),
        move |_context, arguments| async move { Ok(arguments["text"].as_str().unwrap_or_default().repeat(repeat)) },
    )
}

fn start(llm: &ScriptedLlm, store: Arc<MemoryStore>, tool: Tool) -> AgentSystem {
    AgentSystem::builder()
        .store(store)
        .llm(Arc::new(llm.clone()))
        .tool(tool)
        .agent(AgentSpec::new("a"))
        .start()
        .expect("the system starts")
}

fn agent() -> ActorId {
    ActorId::new("agent", "a").expect("a valid id")
}

async fn log_entries(store: &MemoryStore) -> Vec<(String, Bytes)> {
    store
        .scan(&agent(), "log/", None, troupe_runtime::STATE_SCAN_LIMIT_MAX)
        .await
        .expect("the scan")
}

fn contents(messages: &[ChatMessage]) -> Vec<String> {
    messages.iter().map(|message| message.content.clone()).collect()
}

/// The log's messages as the test expects them: `turns` turns of the echoing agent.
fn expected_log(turns: usize) -> Vec<(Role, String)> {
    (0..turns)
        .flat_map(|turn| {
            [
                (Role::User, format!("q{turn}")),
                (Role::Assistant, String::new()),
                (Role::Tool, format!("q{turn}")),
                (Role::Assistant, format!("read: q{turn}")),
            ]
        })
        .collect()
}

fn roles_and_contents(messages: &[ChatMessage]) -> Vec<(Role, String)> {
    messages
        .iter()
        .map(|message| (message.role, message.content.clone()))
        .collect()
}

/// The echoing agent on a new memory store, after `TURNS` turns ("q0", "q1", ...).
async fn after_turns() -> (ScriptedLlm, Arc<MemoryStore>, AgentSystem) {
    let llm = echoing_llm();
    let store = Arc::new(MemoryStore::new());
    let system = start(&llm, store.clone(), echo_tool(1));
    for turn in 0..TURNS {
        let reply = system.ask("a", &format!("q{turn}")).await.unwrap();
        assert_eq!(reply.text, format!("read: q{turn}"));
    }
    (llm, store, system)
}

/// Asks `a` "again" and returns its model's last prompt, without the system message.
async fn prompt_after_asking_again(system: &AgentSystem, llm: &ScriptedLlm) -> Vec<(Role, String)> {
    assert_eq!(system.ask("a", "again").await.unwrap().text, "read: again");
    let request = llm.requests_of("a").pop().expect("a model request");
    let prompt: Vec<ChatMessage> = request.messages.iter().cloned().collect();
    roles_and_contents(&prompt)
        .into_iter()
        .filter(|(role, _)| *role != Role::System)
        .collect()
}

/// The window a restarted agent must read: the last `AGENT_HISTORY_WINDOW_DEFAULT` messages
/// from the first user message among them.
fn expected_window(log: &[(Role, String)]) -> Vec<(Role, String)> {
    let last = &log[log.len().saturating_sub(AGENT_HISTORY_WINDOW_DEFAULT)..];
    let first_user = last
        .iter()
        .position(|(role, _)| *role == Role::User)
        .unwrap_or(last.len());
    last[first_user..].to_vec()
}

/// Goal: a turn is one log entry that `serde_json` would write for its messages, and
/// the log reads back whole after a restart: the full log, the window, and the window
/// in the model's next prompt. Method: 20 turns of 4 messages (80, more than the
/// 64-message window) on a memory store; read the entries; restart on the same store.
#[tokio::test]
async fn a_turn_is_one_log_entry_and_the_log_reads_back_after_a_restart() {
    let (llm, store, system) = after_turns().await;
    system.shutdown().await;

    let entries = log_entries(&store).await;
    let keys: Vec<String> = entries.iter().map(|(key, _)| key.clone()).collect();
    let expected_keys: Vec<String> = (0..TURNS).map(|turn| format!("log/{:020}", 4 * turn + 3)).collect();
    assert_eq!(keys, expected_keys, "one entry per turn, keyed by its last message");
    let log = expected_log(TURNS);
    for (turn, (key, value)) in entries.iter().enumerate() {
        let messages: Vec<ChatMessage> = serde_json::from_slice(value).expect("an entry is a JSON array of messages");
        assert_eq!(roles_and_contents(&messages), log[4 * turn..4 * turn + 4], "{key}");
        assert_eq!(
            value.as_ref(),
            serde_json::to_vec(&messages).unwrap(),
            "{key} is serde_json's encoding"
        );
    }

    let system = start(&llm, store.clone(), echo_tool(1));
    assert_eq!(roles_and_contents(&system.conversation_log("a").await.unwrap()), log);
    let window = expected_window(&log);
    assert_eq!(window.len(), AGENT_HISTORY_WINDOW_DEFAULT);
    assert_eq!(roles_and_contents(&system.history_window("a").await.unwrap()), window);

    // The reactivated agent's model sees the window read from the entries.
    let from_window = prompt_after_asking_again(&system, &llm).await;
    let mut expected: Vec<(Role, String)> = window;
    expected.extend([
        (Role::User, "again".to_string()),
        (Role::Assistant, String::new()),
        (Role::Tool, "again".to_string()),
    ]);
    assert_eq!(from_window, expected, "the model's prompt after the restart");
    system.shutdown().await;
}

/// Goal: a turn that writes more than `AGENT_LOG_ENTRY_CLOSE_BYTES` is split into
/// entries of about that size, and a message left alone in an entry is stored as a
/// single object, as before. Method: one turn calls `echo` 16 times in one step, each
/// result 16 KiB (256 KiB of results): the entry closes before the answer.
#[tokio::test]
async fn a_turn_past_the_entry_size_is_split_and_a_lone_message_is_an_object() {
    let mut rule = ScriptRule::agent("a").on_user_containing("");
    for _ in 0..16 {
        rule = rule.call("echo", json!({"text": "0123456789abcdef"}));
    }
    let llm = ScriptedLlm::new()
        .rule(rule)
        .rule(ScriptRule::agent("a").on_tool_result().reply("done"));
    let store = Arc::new(MemoryStore::new());
    // 16 bytes repeated to the tool result's size.
    let system = start(&llm, store.clone(), echo_tool(AGENT_TOOL_RESULT_SIZE_MAX_BYTES / 16));
    assert_eq!(system.ask("a", "go").await.unwrap().text, "done");
    system.shutdown().await;

    let entries = log_entries(&store).await;
    let keys: Vec<&str> = entries.iter().map(|(key, _)| key.as_str()).collect();
    // user, assistant with 16 calls, 16 results (messages 0..=17), then the answer (18).
    assert_eq!(keys, [format!("log/{:020}", 17), format!("log/{:020}", 18)]);
    let first: Vec<ChatMessage> = serde_json::from_slice(&entries[0].1).unwrap();
    assert_eq!(first.len(), 18);
    assert!(entries[0].1.len() >= AGENT_LOG_ENTRY_CLOSE_BYTES, "closed at the size");
    assert!(first[2..]
        .iter()
        .all(|result| result.content.len() == AGENT_TOOL_RESULT_SIZE_MAX_BYTES));
    let answer: ChatMessage = serde_json::from_slice(&entries[1].1).expect("a lone message is an object");
    assert_eq!(answer.content, "done");
    assert_eq!(entries[1].1.as_ref(), serde_json::to_vec(&answer).unwrap());

    let system = start(&llm, store.clone(), echo_tool(AGENT_TOOL_RESULT_SIZE_MAX_BYTES / 16));
    let log = system.conversation_log("a").await.unwrap();
    assert_eq!(log.len(), 19);
    assert_eq!(contents(&log[18..]), ["done"]);
    assert_eq!(system.history_window("a").await.unwrap(), log);
    system.shutdown().await;
}

/// Goal: a log written one message per entry, as every store was before 2026-11-29,
/// reads back the same, and new turns append after it. Method: run 20 turns, rewrite
/// the store's log as one entry per message (`log/{n:020}` holding message `n` as a JSON
/// object), restart: the log, the window and the model's prompt are as before; one more
/// turn is appended as one entry after the old ones.
#[tokio::test]
async fn a_log_written_one_message_per_entry_reads_back_and_grows() {
    let (llm, store, system) = after_turns().await;
    let messages = system.conversation_log("a").await.unwrap();
    system.shutdown().await;

    // The old form, written under a fence of its own (as a process of that time would).
    let mut writes: Vec<(String, Option<Bytes>)> = log_entries(&store)
        .await
        .into_iter()
        .map(|(key, _)| (key, None))
        .collect();
    for (number, message) in messages.iter().enumerate() {
        writes.push((
            format!("log/{number:020}"),
            Some(Bytes::from(serde_json::to_vec(message).unwrap())),
        ));
    }
    let fence = store.claim(&agent()).await.expect("the claim").fence;
    let commit = TurnCommit {
        state: StateChange::Unchanged,
        writes,
    };
    store
        .commit(&agent(), fence, commit)
        .await
        .expect("the rewrite commits");
    assert_eq!(log_entries(&store).await.len(), 4 * TURNS, "one entry per message now");

    let system = start(&llm, store.clone(), echo_tool(1));
    let log = expected_log(TURNS);
    assert_eq!(roles_and_contents(&system.conversation_log("a").await.unwrap()), log);
    let window = expected_window(&log);
    assert_eq!(roles_and_contents(&system.history_window("a").await.unwrap()), window);
    let seen = prompt_after_asking_again(&system, &llm).await;
    assert_eq!(
        seen[..window.len()],
        window[..],
        "the model's prompt starts with the old window"
    );
    system.shutdown().await;

    let entries = log_entries(&store).await;
    assert_eq!(
        entries.len(),
        4 * TURNS + 1,
        "the new turn is one entry after the old ones"
    );
    assert_eq!(entries.last().unwrap().0, format!("log/{:020}", 4 * TURNS + 3));
    let mut grown = log;
    grown.extend([
        (Role::User, "again".to_string()),
        (Role::Assistant, String::new()),
        (Role::Tool, "again".to_string()),
        (Role::Assistant, "read: again".to_string()),
    ]);
    let system = start(&llm, store.clone(), echo_tool(1));
    assert_eq!(roles_and_contents(&system.conversation_log("a").await.unwrap()), grown);
    system.shutdown().await;
}
