//! Watching what agents do: the [`AgentObserver`] hook and a [`CallRecorder`] that turns
//! the events into a call tree.
//!
//! The agent layer reports every call (from outside, and every `call_agent`, admitted or
//! refused), the start of every turn, and every activation and deactivation of an agent
//! (from the runtime's `on_activate`/`on_deactivate` hooks). Every `call_agent` that
//! reports `CallStarted` reports exactly one `CallFinished`, even when its caller's turn
//! is cut while the call is in flight ([`CallOutcome::Cancelled`]). Observers are called synchronously on the
//! agent's task, so they must be quick and must not block; the recorder only pushes to a
//! vector. Times are on the runtime's clock (virtual under madsim).

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use troupe_core::{ActorId, CallRefused, Deadline, InvokeError, TraceId};

use crate::inbox::{MessageKind, TaskState};
use crate::TokenUsage;

/// How a call ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallOutcome {
    /// The callee replied with this many bytes of text.
    Replied {
        /// Length of the reply text, in bytes.
        bytes: usize,
    },
    /// Admission refused the call; nothing was sent.
    Refused(CallRefused),
    /// The organisation refused the call (links, permissions, approval); nothing was
    /// sent.
    NotPermitted(crate::NotPermitted),
    /// The call was sent and failed (timed out, the callee failed, ...).
    Failed(InvokeError),
    /// Anything else (an invalid agent id, a reply that could not be decoded).
    Other {
        /// What went wrong.
        cause: String,
    },
    /// The call needed approval and was sent as delegated task `task_id` instead
    /// ([`crate::CallApproval::Delegate`]); its answer comes back as the task's result.
    SentAsTask {
        /// The task.
        task_id: String,
    },
    /// The caller stopped waiting before the call ended: its turn was cut (its deadline
    /// passed, or the runtime dropped it) while the call was in flight. The callee's turn
    /// runs under a deadline no later than the caller's, so it is cancelled by then too
    /// and commits nothing.
    Cancelled,
}

impl CallOutcome {
    /// A short label: `ok`, `refused`, `not permitted`, `timeout`, `failed`,
    /// `sent as task`, `cancelled`.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Replied { .. } => "ok",
            Self::Refused(_) => "refused",
            Self::NotPermitted(_) => "not permitted",
            Self::Failed(InvokeError::Timeout { .. }) => "timeout",
            Self::Failed(_) | Self::Other { .. } => "failed",
            Self::SentAsTask { .. } => "sent as task",
            Self::Cancelled => "cancelled",
        }
    }
}

/// Something an agent did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum AgentEvent {
    /// The organisation decided whether `from` may contact `to` (see
    /// [`crate::Organisation::decide`]); reported for every contact the runtime's own
    /// admission let through, on the organisation of `org_version`.
    ContactDecided {
        /// The sender.
        from: ActorId,
        /// The target.
        to: ActorId,
        /// Ask, delegate or notify.
        kind: crate::ContactKind,
        /// The version of the organisation the decision was made on.
        org_version: u64,
        /// Whether it was let through.
        permitted: bool,
        /// When.
        at: Deadline,
    },
    /// A contact needs approval: [`crate::AgentClient::approve`] or
    /// [`crate::AgentClient::deny`] approval `id`. Reported when the approval is listed
    /// ([`crate::Approval::listed`]): at once for a call that waits in its turn; for a
    /// delegation, notification or mention once the turn that queued it committed and
    /// its delivery waits for it (never, for one whose turn was cut or rolled back).
    ApprovalRequested {
        /// The approval's id.
        id: u64,
        /// The sender.
        from: ActorId,
        /// The target.
        to: ActorId,
        /// Ask, delegate or notify.
        kind: crate::ContactKind,
        /// When.
        at: Deadline,
    },
    /// Approval `approval.id` was approved or denied ([`crate::AgentClient::approve`],
    /// [`crate::AgentClient::deny`]), or marked expired because the call that waited
    /// for it in its turn stopped waiting ([`crate::Organisation::abandon_approval`]);
    /// `approval` is the record as resolved.
    ApprovalResolved {
        /// The record, with its new state.
        approval: crate::Approval,
        /// When.
        at: Deadline,
    },
    /// The organisation was changed through [`crate::AgentClient`] (a link, a
    /// permission rule, a membership, the policy, an approval's resolution or a config
    /// applied) and committed; `version` is its version after the change. Pending
    /// approvals recorded by admission are reported as [`AgentEvent::ApprovalRequested`]
    /// instead.
    OrgChanged {
        /// The organisation's version after the change.
        version: u64,
        /// When.
        at: Deadline,
    },
    /// A message (notification, task, task result or cancellation) was acknowledged by
    /// its target: it is persisted in the target's inbox (or was a duplicate).
    MessageSent {
        /// Its id.
        msg_id: String,
        /// The sending agent; `None` from outside.
        from: Option<ActorId>,
        /// The target.
        to: ActorId,
        /// What it is.
        kind: MessageKind,
        /// When the acknowledgement arrived.
        at: Deadline,
    },
    /// An agent's inbox took in a message (`duplicate`: it had it already; nothing new
    /// was kept). Reported by the appending turn, before its commit.
    MessageReceived {
        /// Its id.
        msg_id: String,
        /// The receiving agent.
        agent: ActorId,
        /// What it is.
        kind: MessageKind,
        /// Whether it was seen before.
        duplicate: bool,
        /// When.
        at: Deadline,
    },
    /// An agent delegated a task (reported by the delegating turn, before its commit).
    DelegationStarted {
        /// The task.
        task_id: String,
        /// The delegator.
        from: ActorId,
        /// The delegatee.
        to: ActorId,
        /// When.
        at: Deadline,
    },
    /// A delegation reached its final state at the delegator: completed, failed,
    /// canceled or rejected (reported by the turn that records it, before its commit).
    DelegationFinished {
        /// The task.
        task_id: String,
        /// The delegator.
        from: ActorId,
        /// The delegatee.
        to: ActorId,
        /// The final state.
        state: TaskState,
        /// When.
        at: Deadline,
    },
    /// A call was made (and maybe refused at once; then `CallFinished` follows).
    CallStarted {
        /// Unique within one agent system.
        call: u64,
        /// The call whose turn made this one; `None` for a call from outside.
        parent: Option<u64>,
        /// The calling agent; `None` for a call from outside.
        caller: Option<ActorId>,
        /// The agent called.
        target: ActorId,
        /// The depth the callee runs at.
        depth: u32,
        /// When it started.
        at: Deadline,
    },
    /// A call ended.
    CallFinished {
        /// As in `CallStarted`.
        call: u64,
        /// How.
        outcome: CallOutcome,
        /// When.
        at: Deadline,
    },
    /// An agent started a turn.
    TurnStarted {
        /// The agent.
        agent: ActorId,
        /// The call it serves, if known.
        call: Option<u64>,
        /// Its depth.
        depth: u32,
        /// The agents waiting on it, outermost first.
        chain: Vec<ActorId>,
        /// Its deadline.
        deadline: Deadline,
        /// The trace id of the request it serves, if it has one.
        trace_id: Option<TraceId>,
        /// When it started.
        at: Deadline,
    },
    /// A model call of a turn answered (`step` counts from 1).
    ModelResponded {
        /// The agent.
        agent: ActorId,
        /// The call its turn serves, if known.
        call: Option<u64>,
        /// Which model step of the turn.
        step: u32,
        /// The tokens the provider reported for this call.
        usage: Option<TokenUsage>,
        /// How many of the model's tool calls the step keeps and runs: at most
        /// [`crate::limits::AGENT_TOOL_CALLS_PER_STEP_MAX`] (the ones after are skipped,
        /// and the step's last tool result says how many).
        tool_calls: usize,
        /// How many tool calls the model asked for in this step beyond
        /// [`crate::limits::AGENT_TOOL_CALLS_PER_STEP_MAX`]: neither run nor kept. The
        /// model asked for `tool_calls + tool_calls_dropped`; 0 when it asked for no more
        /// than the limit.
        tool_calls_dropped: usize,
        /// When the answer arrived.
        at: Deadline,
    },
    /// A tool call of a turn finished (`ok: false`: the model reads an error result).
    ToolFinished {
        /// The agent.
        agent: ActorId,
        /// The tool's name.
        tool: String,
        /// Whether it succeeded.
        ok: bool,
        /// When it finished.
        at: Deadline,
    },
    /// A turn ended with a reply (`ok`) or an error. A failed turn reports 0 steps and no
    /// usage; a turn cut by its deadline or its caller reports no end.
    TurnEnded {
        /// The agent.
        agent: ActorId,
        /// The call it served, if known.
        call: Option<u64>,
        /// Whether it replied.
        ok: bool,
        /// Model steps it took.
        steps: u32,
        /// Its model calls' tokens, summed.
        usage: TokenUsage,
        /// When it ended.
        at: Deadline,
    },
    /// An activation of an agent started: its state is loaded and it ran the runtime's
    /// `on_activate` hook; turns may follow. Until the matching `Deactivated`, this
    /// activation is live (a node that dies ends it without a `Deactivated`).
    Activated {
        /// The agent.
        agent: ActorId,
        /// When its `on_activate` ran.
        at: Deadline,
    },
    /// An activation of an agent is ending: it ran the runtime's `on_deactivate` hook
    /// (idle, or the runtime shutting down) after its last turn; it runs no more turns,
    /// and the runtime then saves its state and forgets it.
    Deactivated {
        /// The agent.
        agent: ActorId,
        /// When its `on_deactivate` ran.
        at: Deadline,
    },
}

/// Receives [`AgentEvent`]s. Called on the agent's task: keep it quick, and do not
/// panic (a cancelled call is reported from a drop guard, possibly while unwinding).
pub trait AgentObserver: Send + Sync + 'static {
    /// One event.
    fn on_event(&self, event: &AgentEvent);
}

/// Records every event; renders the call tree. Cheap to clone (shared log).
#[derive(Debug, Clone, Default)]
pub struct CallRecorder {
    events: Arc<Mutex<Vec<AgentEvent>>>,
}

impl AgentObserver for CallRecorder {
    fn on_event(&self, event: &AgentEvent) {
        self.events.lock().unwrap().push(event.clone());
    }
}

/// One call of a [`CallRecorder`]'s tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallNode {
    /// The call's id.
    pub call: u64,
    /// The caller (`None`: outside).
    pub caller: Option<ActorId>,
    /// The callee.
    pub target: ActorId,
    /// The callee's depth.
    pub depth: u32,
    /// When it started.
    pub started: Deadline,
    /// When it finished, and how; `None` while running.
    pub finished: Option<(Deadline, CallOutcome)>,
    /// Calls made by the callee's turn, in start order.
    pub children: Vec<CallNode>,
}

impl CallRecorder {
    /// A recorder with no events.
    pub fn new() -> Self {
        Self::default()
    }

    /// Every event so far, in order.
    pub fn events(&self) -> Vec<AgentEvent> {
        self.events.lock().unwrap().clone()
    }

    /// The calls as trees, roots (calls from outside, or whose parent is unknown) first
    /// in start order.
    pub fn call_trees(&self) -> Vec<CallNode> {
        let events = self.events();
        let mut nodes: Vec<(Option<u64>, CallNode)> = Vec::new();
        for event in &events {
            match event {
                AgentEvent::CallStarted {
                    call,
                    parent,
                    caller,
                    target,
                    depth,
                    at,
                } => nodes.push((
                    *parent,
                    CallNode {
                        call: *call,
                        caller: caller.clone(),
                        target: target.clone(),
                        depth: *depth,
                        started: *at,
                        finished: None,
                        children: Vec::new(),
                    },
                )),
                AgentEvent::CallFinished { call, outcome, at } => {
                    if let Some((_, node)) = nodes.iter_mut().find(|(_, node)| node.call == *call) {
                        node.finished = Some((*at, outcome.clone()));
                    }
                }
                _ => {}
            }
        }
        // Attach children to parents, last first so each parent is complete when moved.
        let known: Vec<u64> = nodes.iter().map(|(_, node)| node.call).collect();
        let mut roots = Vec::new();
        while let Some((parent, node)) = nodes.pop() {
            match parent.filter(|p| known.contains(p)) {
                Some(parent) => {
                    if let Some((_, parent_node)) = nodes.iter_mut().find(|(_, n)| n.call == parent) {
                        parent_node.children.insert(0, node);
                    } else {
                        roots.insert(0, node);
                    }
                }
                None => roots.insert(0, node),
            }
        }
        roots
    }

    /// The call tree as indented text: one line per call with its depth, duration and
    /// outcome (refusals and failures with their reason).
    pub fn render_tree(&self) -> String {
        let mut out = String::new();
        for root in self.call_trees() {
            render_node(&root, 0, &mut out);
        }
        out
    }
}

fn render_node(node: &CallNode, indent: usize, out: &mut String) {
    let caller = node
        .caller
        .as_ref()
        .map_or_else(|| "user".to_string(), |c| c.key().to_string());
    let (duration, outcome) = match &node.finished {
        Some((at, outcome)) => {
            let micros = at.as_micros().saturating_sub(node.started.as_micros());
            let detail = match outcome {
                CallOutcome::Replied { bytes } => format!("ok ({bytes} bytes)"),
                CallOutcome::Refused(reason) => format!("refused: {reason}"),
                CallOutcome::NotPermitted(refused) => format!("not permitted: {}", refused.reason),
                CallOutcome::Failed(error) => format!("{}: {error}", outcome.label()),
                CallOutcome::Other { cause } => format!("failed: {cause}"),
                CallOutcome::SentAsTask { task_id } => format!("sent as task {task_id}"),
                CallOutcome::Cancelled => "cancelled: the caller's turn was cut".to_string(),
            };
            (
                format!("{:>3}.{:03} s", micros / 1_000_000, (micros / 1_000) % 1_000),
                detail,
            )
        }
        None => ("running".to_string(), String::new()),
    };
    let _ = writeln!(
        out,
        "{:indent$}{caller} -> {}  [depth {}] {duration}  {outcome}",
        "",
        node.target.key(),
        node.depth,
        indent = indent * 2
    );
    for child in &node.children {
        render_node(child, indent + 1, out);
    }
}
