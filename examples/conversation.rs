//! A group conversation of a person and two agents: the person's post mentions
//! `@writer`, whose reply mentions `@reviewer`, whose reply ends the exchange. Each
//! mention is delivered through the agent's durable inbox and runs one turn of it; the
//! reply is appended to the conversation, in order, with whom it answers. A mention
//! back to an agent already in the chain would be a cycle and is refused as a note.
//! The model is the scripted one (no API key, no network).
//!
//! Run it with `cargo run --example conversation`. It prints the conversation.

use std::sync::Arc;
use std::time::Duration;

use troupe::agent::{AgentSpec, AgentSystem, ConversationKind, Participant, ScriptRule, ScriptedLlm, Sender};

/// How long the program waits for the agents' replies, at most.
const WAIT_MS: u64 = 10_000;
/// The messages the exchange ends with: the post and the two replies.
const MESSAGES: usize = 3;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("writer")
                .on_user_containing("announcement")
                .reply("Draft: \"Troupe 0.1 is out.\" @reviewer can you check it?"),
        )
        .rule(
            ScriptRule::agent("reviewer")
                .on_user_containing("check")
                .reply("Looks good, ship it."),
        );
    let system = AgentSystem::builder()
        .llm(Arc::new(llm))
        .agent(AgentSpec::new("writer").role("writes announcements"))
        .agent(AgentSpec::new("reviewer").role("reviews what the writer drafts"))
        .start()?;

    let participants = vec![
        Participant::Human("hugo".into()),
        Participant::Agent("writer".into()),
        Participant::Agent("reviewer".into()),
    ];
    system
        .create_conversation("launch", participants, ConversationKind::Group)
        .await?;
    // The message id makes the post safe to send again: a retry appends nothing.
    let posted = system
        .post_message(
            "launch",
            Sender::Human("hugo".into()),
            "hugo-1",
            "@writer please draft the release announcement",
        )
        .await?;
    println!("hugo's post is message {}", posted.seq);

    // The replies come in their own turns; read until the exchange is complete.
    let messages = tokio::time::timeout(Duration::from_millis(WAIT_MS), async {
        loop {
            let messages = system.read_messages("launch", None, MESSAGES).await?;
            if messages.len() == MESSAGES {
                return Ok::<_, troupe::agent::ConversationError>(messages);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await??;
    for message in messages {
        let answers = message
            .reply_to
            .map(|seq| format!(" (answers {seq})"))
            .unwrap_or_default();
        println!("{} {:?}{answers}: {}", message.seq, message.sender, message.text);
    }
    println!("writer is in: {:?}", system.conversations_of("writer").await?);
    system.shutdown().await;
    Ok(())
}
