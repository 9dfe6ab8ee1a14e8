//! The agent actor: an LLM-driven virtual actor of kind `"agent"`.
//!
//! One turn handles one inbound [`AgentRequest`]:
//!
//! ```text
//! decode request ─► user message ─► loop (≤ AGENT_TURN_STEPS_MAX model steps) {
//!     no tokens left in the turn's budget? → reply BudgetExhausted, commit nothing
//!     prompt = system prompt + directory of peers + history window + this turn's messages
//!     model.complete(prompt, tool specs, max_tokens = tokens left)   clipped to the
//!         turn's deadline; its reported usage is charged to the budget
//!     no tool calls? → final answer, stop
//!     run this step's tool calls concurrently (each charged one tool call, validated,
//!         clipped to the deadline; calls to agents take a reserved grant)
//!     append the tool results }
//! ─► append this turn's messages to the log (`log/{seq:020}`, one write each) and to
//!    the bounded window in the snapshot ─► reply (capped at AGENT_REPLY_SIZE_MAX_BYTES)
//! ```
//!
//! The runtime commits the log writes and the snapshot atomically after the turn, so a
//! failed, timed-out or cancelled turn leaves no trace of its messages. State and log are
//! JSON (tool arguments are arbitrary JSON), readable with `sqlite3` in the SQLite store.
//!
//! The parts: `spec` (what an agent is, and the directory), `wire` (request and reply),
//! `shared` (what all agents of a system share), `state` (the saved counters, the log
//! and the window), `turn_loop` (one conversation turn); this file is the actor itself:
//! the factory, activation, and the dispatch of each command to its turn.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use troupe_core::{truncate_utf8, ActorId};
use troupe_runtime::{Actor, ActorBox, ActorError, ActorFactory, AnyValue, Turn};

use crate::inbox::AgentCommand;
use crate::limits::AGENT_MESSAGE_SIZE_MAX_BYTES;
use crate::AgentEvent;

mod shared;
mod spec;
mod state;
mod turn_loop;
mod wire;

pub(crate) use shared::{AgentShared, MentionDelivery, RecordQueued};
pub use spec::{
    agent_id, AgentCatalog, AgentDirectory, AgentSpec, AgentSpecError, CallApproval, ContextWindow, ModelSettings,
    AGENT_KIND,
};
pub(crate) use state::{
    close_log_entry, decode_log_entry, log_key, seq_key, window_messages, AgentState, BoxCounters, SavedAgent,
};
pub(crate) use turn_loop::{Conversation, TurnError};
pub use wire::{AgentReply, AgentRequest};

/// Builds agents from the directory and their snapshots.
pub(crate) struct AgentFactory {
    pub(crate) shared: Arc<AgentShared>,
}

impl ActorFactory for AgentFactory {
    fn create(&self, id: &ActorId, saved: Option<Bytes>) -> Result<ActorBox, ActorError> {
        self.shared.require_attached(id)?;
        let spec = match self.shared.directory.get(id.key()) {
            Some(spec) => spec,
            // A removed agent with stored state: a draining activation (its commands
            // run no model; see `AgentActor::draining`), so its boxes are not stranded.
            None if saved.is_some() && self.shared.defined.was_removed(id.key()) => AgentSpec::new(id.key()),
            // Removed with nothing stored: nothing to drain; refused saying so.
            None if self.shared.defined.was_removed(id.key()) => {
                return Err(ActorError::rejected(crate::inbox_turns::removed_refusal(id.key())))
            }
            None => {
                return Err(ActorError::rejected(format!(
                    "agent {} is not in the directory",
                    id.key()
                )))
            }
        };
        let saved = match saved {
            Some(bytes) => Some(
                SavedAgent::decode(&bytes)
                    .map_err(|cause| ActorError::failed(format!("the state of {id} cannot be decoded: {cause}")))?,
            ),
            None => None,
        };
        let state = AgentState::new(spec, saved);
        Ok(ActorBox::new(AgentActor {
            id: id.clone(),
            state,
            shared: Arc::clone(&self.shared),
            relaying: std::collections::BTreeSet::new(),
            process_told: std::collections::BTreeMap::new(),
            memo: crate::inbox::RecordMemos::default(),
            resumed: false,
            prompt: None,
            spec_generation: None,
            draining: false,
        }))
    }
}

/// One activation of one agent.
pub(crate) struct AgentActor {
    pub(crate) id: ActorId,
    pub(crate) state: AgentState,
    pub(crate) shared: Arc<AgentShared>,
    /// Outbox seqs a delivery task of this activation is delivering.
    pub(crate) relaying: std::collections::BTreeSet<u64>,
    /// Inbox seqs whose `Process` this activation has told itself, with that message's
    /// deadline: until it passes, the message is in this activation's mailbox (or has
    /// run, which removes the seq), so a resume need not tell it again (each extra
    /// `Process` is a turn that reads its entry and finds it gone). A message dropped
    /// unrun at its deadline leaves a seq whose deadline has passed, which no longer
    /// counts; a rebuilt or new activation starts with none.
    pub(crate) process_told: std::collections::BTreeMap<u64, troupe_core::Deadline>,
    /// Its inbox's records as decoded, by the bytes stored (see `inbox::RecordMemos`).
    pub(crate) memo: crate::inbox::RecordMemos,
    /// Whether this activation has re-scheduled the entries its snapshot says are
    /// pending (its first request does, so an agent activated on another node, after its
    /// owner died, resumes the work the dead node's in-memory wake-ups held).
    pub(crate) resumed: bool,
    /// The system message and tool specs last built, with what they were built from.
    pub(crate) prompt: Option<turn_loop::PromptCache>,
    /// The directory's generation read before `state.spec` was last taken from it
    /// (`None`: not yet in this activation): while it is unchanged, so is the spec.
    spec_generation: Option<u64>,
    /// Whether this agent was not in the directory at this command's turn (removed):
    /// the turn runs no model. An ask is refused; an inbox entry not yet worked is
    /// ended instead (a task rejected back to its sender, once; a notification or a
    /// result dropped, logged); its outbox is relayed as ever. Read again at each
    /// command: an agent defined again while its drain runs works the entries left.
    pub(crate) draining: bool,
}

impl fmt::Debug for AgentActor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentActor")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl Actor for AgentActor {
    /// Its turns' futures are kilobytes: kept, not allocated at each turn (see
    /// [`crate::limits::AGENT_TURN_FUTURE_KEPT_BYTES_MAX`]).
    const TURN_FUTURE_KEPT_BYTES_MAX: usize = crate::limits::AGENT_TURN_FUTURE_KEPT_BYTES_MAX;

    async fn on_activate(&mut self, _id: &ActorId) -> Result<(), ActorError> {
        if self.shared.has_listeners() {
            self.shared.emit(&AgentEvent::Activated {
                agent: self.id.clone(),
                at: self.shared.now(),
            });
        }
        Ok(())
    }

    async fn on_deactivate(&mut self, _id: &ActorId) -> Result<(), ActorError> {
        if self.shared.has_listeners() {
            self.shared.emit(&AgentEvent::Deactivated {
                agent: self.id.clone(),
                at: self.shared.now(),
            });
        }
        Ok(())
    }

    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        let command = AgentCommand::decode(&payload)
            .map_err(|cause| ActorError::rejected(format!("not an agent request: {cause}")))?;
        match self.handle_command(turn, command).await? {
            Answer::Reply(reply) => Ok(reply.encode()),
            Answer::Bytes(bytes) => Ok(bytes),
        }
    }

    /// An ask from another agent's turn in this process (`call_agent`), passed as the
    /// [`AgentRequest`] itself and answered with the [`AgentReply`] itself: the same
    /// turn as [`Actor::handle`]'s for the encoded ask, without its encoding and
    /// decoding at either end.
    async fn handle_value(&mut self, turn: &mut Turn, message: AnyValue) -> Result<AnyValue, ActorError> {
        let request = message
            .downcast::<AgentRequest>()
            .map_err(|_| ActorError::rejected("an agent takes an AgentRequest as a value"))?;
        match self.handle_command(turn, AgentCommand::Ask(request)).await? {
            Answer::Reply(reply) => Ok(AnyValue::new(reply)),
            Answer::Bytes(bytes) => Ok(AnyValue::new(bytes)),
        }
    }

    fn snapshot(&self) -> Result<Option<Bytes>, ActorError> {
        Ok(Some(Bytes::from(self.state.saved().encode())))
    }
}

/// What a command's turn answers: an ask's reply, or the bytes of any other command's.
enum Answer {
    Reply(AgentReply),
    Bytes(Bytes),
}

impl AgentActor {
    /// One command's turn, however it arrived (encoded, or as a value).
    async fn handle_command(&mut self, turn: &mut Turn, command: AgentCommand) -> Result<Answer, ActorError> {
        self.state.load_window(turn).await?;
        self.resume_at_activation(turn, &command).await?;
        // One reading of the clock for both caches' ages.
        let now = turn.now();
        crate::org_store::ensure_loaded(&self.shared, now).await;
        crate::directory_store::ensure_fresh_at(&self.shared, now).await;
        // Before any delegation of this turn counts its open tasks (and before the
        // overdue ones are looked for: older records get their index keys first).
        self.migrate_task_index(turn, now).await?;
        self.resolve_overdue_tasks(turn, now).await?;
        // Read before the definition it guards: a change made meanwhile leaves a stale
        // generation, and the next turn reads the definition again.
        let generation = self.shared.directory.generation();
        if self.spec_generation != Some(generation) {
            if let Some(spec) = self.shared.directory.get(self.id.key()) {
                self.state.spec = spec;
                // Its history window may have shrunk.
                self.state.fit_window();
                // The prompt's parts are derived from the definition: build them again.
                self.prompt = None;
            }
            self.spec_generation = Some(generation);
        }
        self.draining = !self.shared.directory.contains(self.id.key());
        match command {
            AgentCommand::Ask(_) | AgentCommand::Enqueue(_) if self.draining => {
                Err(ActorError::rejected(crate::inbox_turns::removed_refusal(self.id.key())))
            }
            AgentCommand::Ask(request) => {
                let content = match &request.from {
                    Some(from) => {
                        let text = truncate_utf8(&request.text, AGENT_MESSAGE_SIZE_MAX_BYTES);
                        crate::org_prompt::message_from(&self.shared, self.id.key(), from.key(), text)
                    }
                    // The request's own text, cut in place (not copied).
                    None => {
                        let mut text = request.text;
                        text.truncate(truncate_utf8(&text, AGENT_MESSAGE_SIZE_MAX_BYTES).len());
                        text
                    }
                };
                let conversation = Conversation {
                    content,
                    call: request.call,
                    deadline: turn.deadline(),
                    budget: request.budget,
                    history: None,
                    allowed_ms: None,
                };
                let reply = self
                    .converse(turn, conversation)
                    .await
                    .map_err(TurnError::into_actor_error)?;
                Ok(Answer::Reply(reply))
            }
            other => self.handle_box(turn, other).await.map(Answer::Bytes),
        }
    }
}
