//! `call_agent` exchanges recorded into the pair's direct conversation, so its history
//! shows who asked what and what came back.
//!
//! ```text
//! call_agent(a → b) answered ─► (first time for the pair in this process)
//!     index: Register dm:a|b            conversation: Create Direct [a, b] (idempotent)
//!   ─► Exchange { Post { sender a, question, record }, Post { sender b, answer, reply_to, record } }
//!      (one turn of the conversation, not one per message)
//! ```
//!
//! Recording is best effort and happens after the answer arrived, inside the caller's
//! tool call: a failure is logged and does not change the call's result; a crash between
//! the answer and the record loses the record (the answer itself is not affected). A
//! record is sent once and never retried (the cluster's router sends a request again only
//! after `NotOwner`, when it did not run), so it is not deduplicated: it carries no client
//! id and writes no `id/` entry, which saves a store read and a write per message. A
//! recorded message's `@mentions` are not delivered (`PostRequest::record`). Failed calls
//! are not recorded.

use std::time::Duration;

use troupe_runtime::{AnyValue, Caller};

use crate::agent::AgentShared;
use crate::conversation::{
    conversation_actor, decode_conv_reply, index_actor, ConvCommand, ConvReply, ConversationError, ConversationKind,
    Participant, PostRequest, Sender,
};
use crate::limits::AGENT_DELIVERY_ACK_TIMEOUT_MS;

/// One request to the index or a conversation, as independent work of the calling
/// turn (not part of its call chain; within its deadline).
async fn request(
    caller: &Caller,
    target: &troupe_core::ActorId,
    command: ConvCommand,
) -> Result<ConvReply, ConversationError> {
    let timeout = Duration::from_millis(AGENT_DELIVERY_ACK_TIMEOUT_MS);
    // Within one process the command and the reply pass as values; a cluster node's
    // calls may cross to another process, so they go as bytes.
    let reply = if caller.routes_calls() {
        let bytes = caller.invoke_as_root(target, command.encode(), timeout).await?;
        decode_conv_reply(&bytes)?
    } else {
        caller
            .invoke_value_as_root(target, AnyValue::new(command), timeout)
            .await?
            .downcast::<ConvReply>()
            .map_err(|_| ConversationError::Unavailable {
                cause: "the conversation replied with something other than a ConvReply".to_string(),
            })?
    };
    match reply {
        ConvReply::Error(error) => Err(error),
        other => Ok(other),
    }
}

/// Records `caller`'s question and `callee`'s answer in their direct conversation
/// ([`crate::direct_conversation_id`]), creating it the first time; returns the
/// question's seq.
///
/// # Errors
/// [`ConversationError`] from the index or the conversation (the caller logs it).
pub(crate) async fn record_call(
    shared: &AgentShared,
    turn: &Caller,
    caller: &str,
    callee: &str,
    question: &str,
    answer: &str,
) -> Result<u64, ConversationError> {
    let id = crate::direct_conversation_id(caller, callee);
    let target = match shared.known_direct_conversation(&id) {
        Some(target) => target,
        None => {
            let target = conversation_actor(&id)?;
            let register = ConvCommand::Register {
                conversation: id.clone(),
                agents: vec![caller.to_string(), callee.to_string()],
            };
            request(turn, &index_actor(), register).await?;
            let participants = vec![
                Participant::Agent(caller.to_string()),
                Participant::Agent(callee.to_string()),
            ];
            let create = ConvCommand::Create {
                participants,
                kind: ConversationKind::Direct,
            };
            request(turn, &target, create).await?;
            shared.remember_direct_conversation(id, target.clone());
            target
        }
    };
    // Sent once, never retried: no client id (see `PostRequest::record`).
    let post = |sender: &str, text: &str| PostRequest {
        sender: Sender::Agent(sender.to_string()),
        client_id: String::new(),
        text: text.to_string(),
        reply_to: None,
        chain: Vec::new(),
        note: None,
        strict: false,
        record: true,
    };
    // Question and answer in one request (one turn of the conversation): the answer
    // replies to the question's seq, which the conversation fills in.
    let exchange = ConvCommand::Exchange {
        question: post(caller, question),
        answer: post(callee, answer),
    };
    match request(turn, &target, exchange).await? {
        ConvReply::Posted(posted) => Ok(posted.seq),
        other => Err(ConversationError::Unavailable {
            cause: format!("unexpected reply {other:?}"),
        }),
    }
}
