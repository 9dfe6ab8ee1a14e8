//! Agents in the simulation: the real agent layer (`troupe_agent`) on a simulated node,
//! thinking with a scripted model, plus the faults of the world around it.
//!
//! - [`AgentSetup`]: what a node's [`troupe_agent::AgentSystem`] is built from (model,
//!   agent definitions, tools, extra observers). Agents live on node 1
//!   ([`AGENT_NODE`]): `call_agent` routes through the local runtime only.
//! - [`FaultyLlm`]: wraps the scripted model with switchable latency and failures
//!   ([`LlmFaults`]): the "LLM latency" and "LLM error" faults.
//! - [`flaky_tool`]: a tool with switchable failures ([`ToolFaults`]): the "tool error"
//!   fault.
//! - [`TraceObserver`]: turns the agent layer's [`AgentEvent`]s into trace events, so
//!   the depth, chain, deadline, wait-for and liveness invariants check real agents, and
//!   SingleActivation checks their activations (the agent actor's real `on_activate` and
//!   `on_deactivate` hooks, recorded as the probes' `Activated`/`Deactivated`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{json, Value};
use troupe_agent::{
    AgentEvent, AgentObserver, AgentSpec, CallOutcome, LlmClient, LlmError, LlmReply, LlmRequest, Tool, ToolError,
    ToolExecutionContext,
};
use troupe_core::{CallRefused, Deadline};

use crate::probe::RefusalKind;
use crate::trace::{Event, Trace};

/// The node that hosts every agent.
pub const AGENT_NODE: u32 = 1;

/// What each incarnation of the agent node builds its agent system from. Everything
/// here lives outside the node (the model provider, the tools' world), so it survives a
/// node kill; only the agents' memory dies.
#[derive(Clone)]
pub struct AgentSetup {
    /// The model every agent uses (wrapped in [`FaultyLlm`] by the harness).
    pub llm: Arc<dyn LlmClient>,
    /// The agents.
    pub agents: Vec<AgentSpec>,
    /// Extra tools (besides `call_agent`).
    pub tools: Vec<Tool>,
    /// Extra observers (a test's `CallRecorder`).
    pub observers: Vec<Arc<dyn AgentObserver>>,
    /// The switches of the [`flaky_tool`] in `tools`, if any (the "tool error" fault).
    pub tool_faults: ToolFaults,
}

impl AgentSetup {
    /// A setup with `llm` and `agents`, the [`flaky_tool`] and no extra observers.
    pub fn new(llm: Arc<dyn LlmClient>, agents: Vec<AgentSpec>) -> Self {
        let tool_faults = ToolFaults::default();
        Self {
            llm,
            agents,
            tools: vec![flaky_tool(tool_faults.clone())],
            observers: Vec::new(),
            tool_faults,
        }
    }

    /// Adds an observer.
    pub fn observer(mut self, observer: Arc<dyn AgentObserver>) -> Self {
        self.observers.push(observer);
        self
    }
}

/// Switches for model faults. Cheap to clone; clones share the switches.
#[derive(Debug, Clone, Default)]
pub struct LlmFaults {
    latency_us: Arc<AtomicU64>,
    fail_next: Arc<AtomicU64>,
    injected: Arc<AtomicU64>,
}

impl LlmFaults {
    /// Every model answer takes `latency` longer.
    pub fn set_latency(&self, latency: Duration) {
        self.latency_us
            .store(u64::try_from(latency.as_micros()).unwrap_or(u64::MAX), Ordering::SeqCst);
    }

    /// The next `count` model requests fail with `LlmError::Injected`.
    pub fn fail_next(&self, count: u64) {
        self.fail_next.store(count, Ordering::SeqCst);
    }

    /// Stops every model fault.
    pub fn heal(&self) {
        self.set_latency(Duration::ZERO);
        self.fail_next(0);
    }

    /// How many model requests failed by injection.
    pub fn injected_count(&self) -> u64 {
        self.injected.load(Ordering::SeqCst)
    }
}

/// A model client with injectable latency and failures around a real (scripted) one.
pub struct FaultyLlm {
    inner: Arc<dyn LlmClient>,
    faults: LlmFaults,
}

impl FaultyLlm {
    /// Wraps `inner`, controlled by `faults`.
    pub fn new(inner: Arc<dyn LlmClient>, faults: LlmFaults) -> Self {
        Self { inner, faults }
    }
}

#[async_trait]
impl LlmClient for FaultyLlm {
    async fn complete(&self, request: LlmRequest) -> Result<LlmReply, LlmError> {
        let latency = self.faults.latency_us.load(Ordering::SeqCst);
        if latency > 0 {
            tokio::time::sleep(Duration::from_micros(latency)).await;
        }
        let fail = self
            .faults
            .fail_next
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| left.checked_sub(1))
            .is_ok();
        if fail {
            self.faults.injected.fetch_add(1, Ordering::SeqCst);
            return Err(LlmError::Injected {
                cause: "simulated provider outage".to_string(),
            });
        }
        self.inner.complete(request).await
    }
}

/// Switches for tool faults. Cheap to clone; clones share the switches.
#[derive(Debug, Clone, Default)]
pub struct ToolFaults {
    fail_next: Arc<AtomicU64>,
    injected: Arc<AtomicU64>,
    calls: Arc<AtomicU64>,
}

impl ToolFaults {
    /// The next `count` calls of the tool fail.
    pub fn fail_next(&self, count: u64) {
        self.fail_next.store(count, Ordering::SeqCst);
    }

    /// Stops every tool fault.
    pub fn heal(&self) {
        self.fail_next(0);
    }

    /// How many calls failed by injection.
    pub fn injected_count(&self) -> u64 {
        self.injected.load(Ordering::SeqCst)
    }

    /// How many calls the tool received.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }
}

/// The name of [`flaky_tool`].
pub const LOOKUP_TOOL_NAME: &str = "lookup";

/// A `lookup(key)` tool answering `value-of-<key>`, failing while `faults` says so.
pub fn flaky_tool(faults: ToolFaults) -> Tool {
    let schema = json!({
        "type": "object",
        "properties": { "key": { "type": "string" } },
        "required": ["key"]
    });
    Tool::new(LOOKUP_TOOL_NAME, "looks a key up", schema, FlakyTool { faults })
}

struct FlakyTool {
    faults: ToolFaults,
}

#[async_trait]
impl troupe_agent::ToolHandler for FlakyTool {
    async fn call(&self, _context: &ToolExecutionContext, arguments: Value) -> Result<String, ToolError> {
        self.faults.calls.fetch_add(1, Ordering::SeqCst);
        let fail = self
            .faults
            .fail_next
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| left.checked_sub(1));
        if fail.is_ok() {
            self.faults.injected.fetch_add(1, Ordering::SeqCst);
            return Err(ToolError::failed(LOOKUP_TOOL_NAME, "simulated tool outage"));
        }
        let key = arguments.get("key").and_then(Value::as_str).unwrap_or_default();
        Ok(format!("value-of-{key}"))
    }
}

#[derive(Default)]
struct Calls {
    /// Agent call id → (trace call id, parent agent call id).
    open: BTreeMap<u64, (u64, Option<u64>)>,
    /// Agent call id → the deadline of the turn serving it, in trace microseconds.
    turn_deadlines: BTreeMap<u64, u64>,
}

/// Maps agent events into the trace (see the module documentation).
pub struct TraceObserver {
    node: u32,
    trace: Trace,
    calls: Mutex<Calls>,
}

impl TraceObserver {
    /// An observer recording into `trace` for agents on `node`.
    pub fn new(node: u32, trace: Trace) -> Self {
        Self {
            node,
            trace,
            calls: Mutex::default(),
        }
    }

    fn trace_time(&self, deadline: Deadline, at: Deadline) -> u64 {
        self.trace.clock().after_us(deadline.remaining(at))
    }
}

impl AgentObserver for TraceObserver {
    fn on_event(&self, event: &AgentEvent) {
        let mut calls = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
        match event {
            AgentEvent::CallStarted {
                call,
                parent,
                caller,
                target,
                ..
            } => {
                let Some(caller) = caller else { return };
                let id = self.trace.next_id();
                calls.open.insert(*call, (id, *parent));
                // Every `call_agent` reports its end, even when its caller's turn is cut
                // (`CallOutcome::Cancelled`, from a drop guard that also runs when a
                // killed node's tasks are dropped): the wait must end explicitly, as a
                // probe's does, and one that never ends is a hang.
                self.trace.record(Event::WaitBegin {
                    call: id,
                    caller: caller.to_string(),
                    target: target.to_string(),
                    host: self.node,
                });
            }
            AgentEvent::CallFinished { call, outcome, .. } => {
                let Some((id, _)) = calls.open.remove(call) else { return };
                if let CallOutcome::Refused(refused) = outcome {
                    let reason = RefusalKind::from(refused);
                    if !matches!(refused, CallRefused::AgentNotFound { .. }) {
                        self.trace.record(Event::AgentCallRefused { call: id, reason });
                    }
                }
                self.trace.record(Event::WaitEnd {
                    call: id,
                    outcome: outcome.label().to_string(),
                });
            }
            AgentEvent::TurnStarted {
                agent,
                call,
                depth,
                chain,
                deadline,
                at,
                ..
            } => {
                let deadline_us = self.trace_time(*deadline, *at);
                let parent_deadline_us = call
                    .and_then(|call| calls.open.get(&call).and_then(|(_, parent)| *parent))
                    .and_then(|parent| calls.turn_deadlines.get(&parent).copied())
                    .unwrap_or(deadline_us);
                if let Some(call) = call {
                    calls.turn_deadlines.insert(*call, deadline_us);
                }
                self.trace.record(Event::TurnStarted {
                    node: self.node,
                    actor: agent.to_string(),
                    depth: *depth,
                    chain: chain.iter().map(ToString::to_string).collect(),
                    deadline_us,
                    parent_deadline_us,
                    remote: call.is_none(),
                });
            }
            // Agents have no counter: their activations record a count of 0.
            AgentEvent::Activated { agent, .. } => {
                self.trace.record(Event::Activated {
                    node: self.node,
                    actor: agent.to_string(),
                    count: 0,
                });
            }
            AgentEvent::Deactivated { agent, .. } => {
                self.trace.record(Event::Deactivated {
                    node: self.node,
                    actor: agent.to_string(),
                    count: 0,
                });
            }
            // Inbox traffic is not part of the simulator's trace yet.
            _ => {}
        }
    }
}
