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
//! recorded message's `@mentions` are not delivered (`PostRequest::record`). Failed calls
//! are not recorded.

use std::time::Duration;

use troupe_core::Deadline;
use troupe_runtime::Caller;

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
    let bytes = caller.invoke_as_root(target, command.encode(), timeout).await?;
    match decode_conv_reply(&bytes)? {
        ConvReply::Error(error) => Err(error),
        other => Ok(other),
    }
}

/// Records `caller`'s question and `callee`'s answer of call `call` (answered at `at`)
/// in their direct conversation ([`crate::direct_conversation_id`]), creating it the first
/// time; returns the question's seq.
///
/// # Errors
/// [`ConversationError`] from the index or the conversation (the caller logs it).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn record_call(
    shared: &AgentShared,
    turn: &Caller,
    caller: &str,
    callee: &str,
    question: &str,
    answer: &str,
    call: u64,
    at: Deadline,
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
    // Unique per caller, call and instant (call ids restart with the process).
    let (mut micros, mut number) = (itoa::Buffer::new(), itoa::Buffer::new());
    let key = [
        "call:",
        caller,
        ":",
        micros.format(at.as_micros()),
        ":",
        number.format(call),
    ]
    .concat();
    let post = |sender: &str, suffix: &str, text: &str, reply_to: Option<u64>| PostRequest {
        sender: Sender::Agent(sender.to_string()),
        client_id: [key.as_str(), ":", suffix].concat(),
        text: text.to_string(),
        reply_to,
        chain: Vec::new(),
        note: None,
        strict: false,
        record: true,
    };
    // Question and answer in one request (one turn of the conversation): the answer
    // replies to the question's seq, which the conversation fills in.
    let exchange = ConvCommand::Exchange {
        question: post(caller, "q", question, None),
        answer: post(callee, "a", answer, None),
    };
    match request(turn, &target, exchange).await? {
        ConvReply::Posted(posted) => Ok(posted.seq),
        other => Err(ConversationError::Unavailable {
            cause: format!("unexpected reply {other:?}"),
        }),
    }
}
