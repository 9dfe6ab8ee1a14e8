//! The demo organisation behind `troupe demo`, as a library so tests can run it.
//!
//! Five agents, each a virtual actor with its own model turns and tools:
//!
//! ```text
//! user ─► coordinator ─┬─► researcher ─► analyst ─✗─► coordinator   (refused: cycle)
//!                      └─► archivist (slow, asked with a 1.5 s timeout: times out)
//! ```
//!
//! On the scripted model the story is fixed: the coordinator fans out to the researcher
//! and the archivist in one step, the researcher asks the analyst, the analyst tries to
//! ask the coordinator back (refused at once: the coordinator is waiting up the chain),
//! and the archivist is too slow for its timeout. Then the user notifies the coordinator
//! that the brief is out (fire-and-forget, persisted in its inbox); in its own turn it
//! delegates a review to the critic and notifies the researcher, and the critic's review
//! comes back to it as a new turn. On a real model the same agents and prompts run, and
//! the model decides.

#![warn(missing_docs)]

/// `println!` that never panics: a failed write to stdout (its reader went away, as in
/// `troupe demo | head -1`, or a log pipe that died under `troupe serve`) is ignored, so
/// the program goes on (a demo to its end, a server serving) and exits as it would have.
/// Until 2026-12-06 `println!` panicked there ("failed printing to stdout: Broken pipe"),
/// exit code 101. While `troupe serve` or `troupe node` runs its stdout queue
/// (`log_lines::LogLines::stdout`), it never blocks either: the line goes through the
/// queue (`log_lines::stdout_text`); elsewhere (`troupe demo`) a slow reader holds it, as
/// it should.
#[macro_export]
macro_rules! outln {
    () => {{
        $crate::out_text(::std::format_args!("\n"));
    }};
    ($($arg:tt)*) => {{
        $crate::out_text(::std::format_args!("{}\n", ::std::format_args!($($arg)*)));
    }};
}

/// `print!` that never panics, as [`outln!`].
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => {{
        $crate::out_text(::std::format_args!($($arg)*));
    }};
}

/// What [`outln!`] and [`out!`] write with: through the stdout queue when one runs
/// (`log_lines::stdout_text`); directly otherwise, and under the simulator.
#[doc(hidden)]
pub fn out_text(text: std::fmt::Arguments<'_>) {
    #[cfg(not(madsim))]
    log_lines::stdout_text(text);
    #[cfg(madsim)]
    {
        use std::io::Write as _;
        let _ = write!(std::io::stdout(), "{text}");
    }
}

/// `eprintln!` that never panics (a failed write to stderr is ignored, as [`outln!`])
/// and, while `troupe serve` or `troupe node` runs its log queue, never blocks: the line
/// goes through the queue (`log_lines::stderr_line`).
#[macro_export]
macro_rules! errln {
    ($($arg:tt)*) => {{
        $crate::errln_line(::std::format_args!($($arg)*));
    }};
}

/// What [`errln!`] writes with: through the log queue when one runs
/// (`log_lines::stderr_line`); directly under the simulator, which has no queue.
#[doc(hidden)]
pub fn errln_line(line: std::fmt::Arguments<'_>) {
    #[cfg(not(madsim))]
    log_lines::stderr_line(line);
    #[cfg(madsim)]
    {
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), "{line}");
    }
}

/// The refusal of `flag ADDR` (`--bind`, `--listen`, `--http`) that cannot be listened
/// on, saying what to do: "--bind 127.0.0.1:8080: cannot listen there (Address already in
/// use (os error 98)); another process listens there: stop it, or give --bind another
/// port (port 0 picks a free one)".
pub fn listen_refusal(flag: &str, addr: std::net::SocketAddr, error: &std::io::Error) -> String {
    let hint = match error.kind() {
        std::io::ErrorKind::AddrInUse => format!("another process listens there: stop it, or give {flag} another port"),
        std::io::ErrorKind::PermissionDenied => format!("ports under 1024 need privileges: give {flag} another port"),
        _ => format!("give {flag} an address of this machine"),
    };
    format!("{flag} {addr}: cannot listen there ({error}); {hint} (port 0 picks a free one)")
}

mod cli;
#[cfg(not(madsim))]
pub mod log_lines;
#[cfg(not(madsim))]
pub mod node;
mod org_demo;
#[cfg(not(madsim))]
pub mod signals;

pub use cli::{
    Cli, Command, DemoArgs, LogFormat, NodeArgs, ServeArgs, NODE_CLUSTER_DEFAULT, NODE_LEASE_TTL_MS_DEFAULT,
    SERVE_BIND_DEFAULT, SERVE_LOG_DROPPED_REPORT_MS, SERVE_LOG_FILTER_DEFAULT, SERVE_LOG_FLUSH_WAIT_MS,
    SERVE_LOG_LINES_BUFFERED_MAX, SERVE_SECOND_SIGNAL_SHUTDOWN_WAIT_MS,
};
pub use org_demo::{org_demo_script, run_org_demo, Contact, OrgDemoReport, ORG_DEMO_ASK_TIMEOUT_MS, ORG_DEMO_WAIT_MS};

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use troupe_agent::{
    AgentCallError, AgentEvent, AgentReply, AgentSpec, AgentSystem, AgentSystemError, CallNode, CallOutcome,
    CallRecorder, LlmClient, ScriptRule, ScriptedLlm, TaskState,
};
use troupe_runtime::{RuntimeCounters, StateStore};

/// What the user asks the coordinator.
pub const DEMO_QUESTION: &str = "Prepare a short brief on grid-scale battery storage.";
/// How long the user waits for the coordinator, in milliseconds.
pub const DEMO_ASK_TIMEOUT_MS: u64 = 240_000;
/// What the user then sends the coordinator as a notification (fire-and-forget): in its
/// own turn, its model delegates a review to the critic and notifies the researcher.
pub const DEMO_HANDOFF: &str = "The report is ready: get it reviewed and tell the researcher.";
/// How long the demo waits for the delegated review to come back, in milliseconds.
pub const DEMO_HANDOFF_TIMEOUT_MS: u64 = 60_000;
/// The timeout the coordinator gives the slow archivist, in milliseconds.
pub const DEMO_ARCHIVIST_TIMEOUT_MS: u64 = 1_500;

/// The organisation's agents.
pub fn demo_agents(model: &str) -> Vec<AgentSpec> {
    let spec = |id: &str, role: &str, prompt: &str| {
        AgentSpec::new(id)
            .role(role)
            .system_prompt(prompt)
            .model(model)
            .max_steps(4)
    };
    vec![
        spec(
            "coordinator",
            "plans the work and writes the final brief",
            "You coordinate a small research team. For every request, ask the researcher for \
             findings and the archivist for past reports (give the archivist timeout_ms 1500), \
             in the same step, then write a brief of at most three sentences from their answers. \
             When told a report is ready, delegate a review to the critic and notify the \
             researcher.",
        ),
        spec(
            "researcher",
            "finds facts and asks the analyst for numbers",
            "You are a researcher. Ask the analyst for the key numbers, then summarise them in \
             two sentences.",
        ),
        spec(
            "analyst",
            "analyses numbers",
            "You are an analyst. Before answering, ask the coordinator which region to focus on; \
             if that is not possible, answer with global figures in one sentence.",
        ),
        spec(
            "archivist",
            "searches old reports, slowly",
            "You are an archivist. Answer with the titles of relevant past reports, or say there \
             are none.",
        ),
        spec(
            "critic",
            "reviews briefs on request",
            "You review briefs in one sentence.",
        ),
    ]
}

/// The agents `troupe serve` serves and the scripted model they think with when no real
/// model is configured: for now the demo's organisation. The one place that decides
/// what `troupe serve` serves; a configuration file loader replaces it. The script ends
/// with a rule for any agent, so that an agent created over the API answers too
/// (`{agent} heard: {input}`).
pub fn serve_organisation(model: &str) -> (Vec<AgentSpec>, ScriptedLlm) {
    let script = demo_script().rule(
        ScriptRule::any_agent()
            .on_user_containing("")
            .reply("{agent} heard: {input}"),
    );
    (demo_agents(model), script)
}

/// The scripted model that plays the demo's story.
pub fn demo_script() -> ScriptedLlm {
    let step = Duration::from_millis(150);
    ScriptedLlm::new()
        // The hand-off, after the ask: delegate and notify, then read the review.
        .rule(
            ScriptRule::agent("coordinator")
                .on_user_containing("get it reviewed")
                .call(
                    "delegate_to_agent",
                    json!({"agent_id": "critic", "message": "Review the brief we just wrote."}),
                )
                .call(
                    "notify_agent",
                    json!({"agent_id": "researcher", "message": "The brief is out; thanks for the findings."}),
                )
                .latency(step),
        )
        .rule(
            ScriptRule::agent("coordinator")
                .on_tool_result_containing("delegated as task")
                .reply("Review requested; researcher told.")
                .latency(step),
        )
        .rule(
            ScriptRule::agent("coordinator")
                .on_user_containing("you delegated is")
                .reply("Review received.")
                .latency(step),
        )
        .rule(
            ScriptRule::agent("researcher")
                .on_user_containing("[notification")
                .reply("Glad it helped.")
                .latency(step),
        )
        .rule(
            ScriptRule::agent("coordinator")
                .on_user_containing("brief")
                .call(
                    "call_agent",
                    json!({"agent_id": "researcher", "message": "Find the key facts for: {input}"}),
                )
                .call(
                    "call_agent",
                    json!({"agent_id": "archivist", "message": "Any past reports on: {input}",
                           "timeout_ms": DEMO_ARCHIVIST_TIMEOUT_MS}),
                )
                .latency(step),
        )
        .rule(
            ScriptRule::agent("coordinator")
                .on_tool_result()
                .reply("Brief. {tool_result}")
                .latency(step),
        )
        .rule(
            ScriptRule::agent("researcher")
                .on_user_containing("")
                .call(
                    "call_agent",
                    json!({"agent_id": "analyst", "message": "What are the key numbers?"}),
                )
                .latency(step * 2),
        )
        .rule(
            ScriptRule::agent("researcher")
                .on_tool_result()
                .reply("Findings: {tool_result}")
                .latency(step),
        )
        .rule(
            ScriptRule::agent("analyst")
                .on_user_containing("")
                .call(
                    "call_agent",
                    json!({"agent_id": "coordinator", "message": "Which region should I focus on?"}),
                )
                .latency(step),
        )
        .rule(
            ScriptRule::agent("analyst")
                .on_tool_result()
                .reply("Globally, lithium-ion pack prices fell by about 80% over the last decade.")
                .latency(step),
        )
        .rule(
            ScriptRule::agent("archivist")
                .reply("Reports: none found.")
                .latency(Duration::from_secs(4)),
        )
        .rule(ScriptRule::agent("critic").reply("Looks fine."))
}

/// What a demo run produced.
#[derive(Debug)]
pub struct DemoReport {
    /// The coordinator's answer to [`DEMO_QUESTION`].
    pub answer: Result<AgentReply, AgentCallError>,
    /// The recorded calls, as trees.
    pub calls: Vec<CallNode>,
    /// The call tree as text.
    pub tree: String,
    /// The runtime's counters at the end.
    pub counters: RuntimeCounters,
    /// (agent, messages in its conversation log) for every agent.
    pub log_lengths: Vec<(String, usize)>,
    /// The hand-off after the ask, one line per inbox event: notifications and the
    /// delegation, as the event stream reported them.
    pub handoff: Vec<String>,
    /// The final state of the delegated review, if it resolved in time.
    pub review: Option<TaskState>,
}

impl DemoReport {
    /// Every call in the trees, depth first.
    pub fn all_calls(&self) -> Vec<&CallNode> {
        fn walk<'a>(node: &'a CallNode, out: &mut Vec<&'a CallNode>) {
            out.push(node);
            for child in &node.children {
                walk(child, out);
            }
        }
        let mut out = Vec::new();
        for root in &self.calls {
            walk(root, &mut out);
        }
        out
    }

    /// How many calls ended with `label` (`ok`, `refused`, `timeout`, `failed`).
    pub fn count(&self, label: &str) -> usize {
        self.all_calls()
            .iter()
            .filter(|call| {
                call.finished
                    .as_ref()
                    .is_some_and(|(_, outcome)| outcome.label() == label)
            })
            .count()
    }

    /// Whether the scripted story happened: an answer, a refused cycle, a timeout.
    pub fn scripted_story_happened(&self) -> bool {
        let cycle = self.all_calls().iter().any(|call| {
            matches!(
                &call.finished,
                Some((_, CallOutcome::Refused(troupe_core::CallRefused::CycleDetected { .. })))
            )
        });
        self.answer.is_ok()
            && cycle
            && self.count("timeout") == 1
            && self.count("ok") == 3
            && self.review == Some(TaskState::Completed)
    }
}

/// Runs the demo organisation on `store` with `llm`: asks the coordinator
/// [`DEMO_QUESTION`] and records every call.
///
/// # Errors
/// [`AgentSystemError`] if the system cannot start.
pub async fn run_demo(
    store: Arc<dyn StateStore>,
    llm: Arc<dyn LlmClient>,
    model: &str,
) -> Result<DemoReport, AgentSystemError> {
    let recorder = CallRecorder::new();
    let mut builder = AgentSystem::builder()
        .store(store)
        .llm(llm)
        .observer(Arc::new(recorder.clone()));
    for spec in demo_agents(model) {
        builder = builder.agent(spec);
    }
    let system = builder.start()?;
    let answer = system
        .ask_with_timeout("coordinator", DEMO_QUESTION, Duration::from_millis(DEMO_ASK_TIMEOUT_MS))
        .await;
    // Let abandoned turns (the archivist's) reach their deadline before reading counters.
    tokio::time::sleep(Duration::from_millis(DEMO_ARCHIVIST_TIMEOUT_MS)).await;
    let (handoff, review) = run_handoff(&system).await;
    let mut log_lengths = Vec::new();
    for spec in system.directory().list() {
        let length = system
            .conversation_log(&spec.id)
            .await
            .map(|log| log.len())
            .unwrap_or(0);
        log_lengths.push((spec.id, length));
    }
    let counters = system.runtime().counters();
    system.shutdown().await;
    Ok(DemoReport {
        answer,
        calls: recorder.call_trees(),
        tree: recorder.render_tree(),
        counters,
        log_lengths,
        handoff,
        review,
    })
}

/// Notifies the coordinator of [`DEMO_HANDOFF`] and follows the event stream until the
/// delegation it starts resolves (or [`DEMO_HANDOFF_TIMEOUT_MS`] passes).
async fn run_handoff(system: &AgentSystem) -> (Vec<String>, Option<TaskState>) {
    let mut events = system.subscribe();
    let mut lines = Vec::new();
    if let Err(error) = system.notify("coordinator", DEMO_HANDOFF).await {
        lines.push(format!("notify failed: {error}"));
        return (lines, None);
    }
    let follow = async {
        loop {
            match events.recv().await {
                Ok(AgentEvent::MessageReceived {
                    msg_id,
                    agent,
                    kind,
                    duplicate: false,
                    ..
                }) => lines.push(format!("{} received {kind:?} {msg_id}", agent.key())),
                Ok(AgentEvent::DelegationStarted { task_id, from, to, .. }) => {
                    lines.push(format!("{} delegated task {task_id} to {}", from.key(), to.key()));
                }
                Ok(AgentEvent::DelegationFinished {
                    task_id, from, state, ..
                }) => {
                    lines.push(format!("task {task_id} {} (back at {})", state.as_str(), from.key()));
                    return Some(state);
                }
                // The coordinator's turn on the hand-off failed (a model unreachable or
                // refusing the key): no review will come of it now. Until 2026-12-06 the
                // demo waited the whole DEMO_HANDOFF_TIMEOUT_MS (60 s) for it.
                Ok(AgentEvent::TurnEnded { agent, ok: false, .. }) if agent.key() == "coordinator" => {
                    lines.push(
                        "coordinator's turn on the notification failed (it stays in its inbox, to be tried again)"
                            .to_string(),
                    );
                    return None;
                }
                Ok(_) => {}
                Err(tokio::sync::broadcast::error::RecvError::Lagged(missed)) => {
                    lines.push(format!("(missed {missed} events)"));
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
            }
        }
    };
    let review = tokio::time::timeout(Duration::from_millis(DEMO_HANDOFF_TIMEOUT_MS), follow)
        .await
        .unwrap_or(None);
    // Let the coordinator's turn on the review (and the researcher's append, which races
    // with the delegation) finish before the logs are read; keep their events.
    tokio::time::sleep(Duration::from_secs(1)).await;
    while let Ok(event) = events.try_recv() {
        if let AgentEvent::MessageReceived {
            msg_id,
            agent,
            kind,
            duplicate: false,
            ..
        } = event
        {
            lines.push(format!("{} received {kind:?} {msg_id}", agent.key()));
        }
    }
    (lines, review)
}
