//! `call_agent` exchanges recorded into the pair's direct conversation, so its history
//! shows who asked what and what came back.
//!
//! ```text
//! call_agent(a → b) answered ─► (first time for the pair in this process, awaited)
//!     index: Register dm:a|b            conversation: Create Direct [a, b] (idempotent)
//!   ─► queued in this process: (Post { sender a, question, record },
//!                               Post { sender b, answer, record })   the call goes on
//!   ─► CALL_RECORD_FLUSH_DELAY_MS later, one tell: FlushRecords
//!   ─► one turn of the conversation stores every exchange queued by then, each one
//!      entry (question, then the answer replying to it), in one commit
//! ```
//!
//! Recording is best effort and happens after the answer arrived: a failure is logged
//! and does not change the call's result; a crash before the conversation's turn
//! committed loses the records (at most [`CALL_RECORD_FLUSH_DELAY_MS`] of them, and the
//! answer itself is not affected). [`crate::AgentSystem::shutdown`] and a read through
//! the API ([`crate::AgentClient::read_messages`]) store what waits first; another
//! process on the same store sees a record once it is stored. A record is sent once
//! and never retried, so it is not deduplicated: it carries no client id and writes no
//! `id/` entry. A recorded message's `@mentions` are not delivered
//! (`PostRequest::record`). Failed calls are not recorded. On a cluster node the
//! exchange is one awaited request instead (`ConvCommand::Exchange`): the conversation
//! may live on another node, which this process's queue does not reach.

use std::sync::Arc;
use std::time::Duration;

use troupe_core::ActorId;
use troupe_runtime::{AnyValue, Caller, RuntimeHandle};

use crate::agent::{AgentShared, RecordQueued};
use crate::conversation::{
    conversation_actor, decode_conv_reply, index_actor, ConvCommand, ConvReply, ConversationError, ConversationKind,
    Participant, PostRequest, Sender,
};
use crate::limits::{AGENT_DELIVERY_ACK_TIMEOUT_MS, CALL_RECORDS_PENDING_MAX, CALL_RECORD_FLUSH_DELAY_MS};

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
                store_unavailable: false,
                cause: "the conversation replied with something other than a ConvReply".to_string(),
            })?
    };
    match reply {
        ConvReply::Error(error) => Err(error),
        other => Ok(other),
    }
}

/// Records `caller`'s question and `callee`'s answer in their direct conversation
/// ([`crate::direct_conversation_id`]), creating it the first time (that part is awaited).
///
/// Within one process the exchange is queued ([`AgentShared::queue_call_record`]) and
/// the call goes on at once: the conversation is woken [`CALL_RECORD_FLUSH_DELAY_MS`]
/// later and stores every exchange queued by then in one turn, so a record costs the
/// call neither a conversation turn nor a commit on its path, and concurrent calls
/// between a pair share one commit. On a cluster node (whose conversation may live on
/// another node) the exchange is one awaited request, as before.
///
/// # Errors
/// [`ConversationError`] from the index or the conversation, or when the exchange was
/// dropped because [`crate::limits::CALL_RECORDS_PENDING_MAX`] wait already (the
/// caller logs it).
pub(crate) async fn record_call(
    shared: &Arc<AgentShared>,
    turn: &Caller,
    caller: &str,
    callee: &str,
    question: &str,
    answer: &str,
) -> Result<(), ConversationError> {
    let target = match shared.known_direct_conversation(caller, callee) {
        Some(target) => target,
        None => {
            let id = crate::direct_conversation_id(caller, callee);
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
            shared.remember_direct_conversation(caller, callee, target.clone());
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
    let (question, answer) = (post(caller, question), post(callee, answer));
    if turn.routes_calls() {
        // Question and answer in one request (one turn of the conversation): the answer
        // replies to the question's seq, which the conversation fills in.
        return match request(turn, &target, ConvCommand::Exchange { question, answer }).await? {
            ConvReply::Posted(_) => Ok(()),
            other => Err(ConversationError::Unavailable {
                store_unavailable: false,
                cause: format!("unexpected reply {other:?}"),
            }),
        };
    }
    match shared.queue_call_record(&target, question, answer) {
        RecordQueued::Queued => Ok(()),
        RecordQueued::WakeConversation => {
            wake_later(Arc::clone(shared), target);
            Ok(())
        }
        RecordQueued::Dropped => Err(ConversationError::Unavailable {
            store_unavailable: false,
            cause: format!(
                "{CALL_RECORDS_PENDING_MAX} recorded exchanges already wait for {target}; this one is dropped"
            ),
        }),
    }
}

/// Tells `conversation` to store its waiting records, [`CALL_RECORD_FLUSH_DELAY_MS`]
/// from now, from a task of its own (outside the recording turn, which goes on). If the
/// system is gone by then, the records are lost (as a crash loses them); if the tell is
/// refused, the next record schedules another wake-up, and a read through the API or
/// the system's shutdown stores them.
fn wake_later(shared: Arc<AgentShared>, conversation: ActorId) {
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(CALL_RECORD_FLUSH_DELAY_MS)).await;
        let Some(runtime) = shared.runtime() else {
            return;
        };
        let deadline = runtime.deadline_in(Duration::from_millis(AGENT_DELIVERY_ACK_TIMEOUT_MS));
        if let Err(error) = runtime
            .tell(&conversation, ConvCommand::FlushRecords.encode(), deadline)
            .await
        {
            shared.call_record_wake_failed(&conversation);
            tracing::warn!(%conversation, %error, "could not wake the conversation to store recorded calls; the next record, a read or the shutdown will");
        }
    });
}

/// Asks `conversation` to store the exchanges this process recorded for it and that
/// still wait (the API's reads do, so a call's record is read once the call returned).
/// Nothing is asked if this process never recorded an exchange there.
///
/// # Errors
/// [`ConversationError::Unavailable`] if the conversation could not be asked.
pub(crate) async fn store_waiting_records(
    shared: &AgentShared,
    runtime: &RuntimeHandle,
    conversation: &ActorId,
    timeout: Duration,
) -> Result<(), ConversationError> {
    if !shared.records_calls_in(conversation) {
        return Ok(());
    }
    let deadline = runtime.deadline_in(timeout);
    let reply = runtime
        .invoke(conversation, ConvCommand::FlushRecords.encode(), deadline)
        .await?;
    match decode_conv_reply(&reply)? {
        ConvReply::Error(error) => Err(error),
        _ => Ok(()),
    }
}
