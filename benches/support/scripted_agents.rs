//! Scripted agents for the agent-layer benchmarks.
//!
//! - `asker` and `answerer`: `asker` asks `answerer` through `call_agent` and replies
//!   with its answer; `answerer` replies "42" in one step.
//! - `a` and `b`, for the durable fire-and-forget (`notify_as`, `delegate`): `b` answers
//!   whatever its inbox brings (a notification, a task) in one model step; `a` answers
//!   the result of a task it delegated in one model step. [`TurnsEnded`] tells the bench
//!   when an agent's turn on an inbox entry has ended.

use std::sync::Arc;

use serde_json::json;
use tokio::sync::watch;
use troupe::agent::{AgentEvent, AgentObserver, AgentSpec, AgentSystem, ScriptRule, ScriptedLlm, TaskState};
use troupe::runtime::{KindConfig, MemoryStore, StateStore};

/// The two agents on an in-memory store, their activations kept by `kind_config`.
pub(crate) fn asker_and_answerer(kind_config: KindConfig) -> AgentSystem {
    asker_and_answerer_on(Arc::new(MemoryStore::new()), kind_config)
}

/// The two agents on `store`, their activations kept by `kind_config`.
pub(crate) fn asker_and_answerer_on(store: Arc<dyn StateStore>, kind_config: KindConfig) -> AgentSystem {
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("asker")
                .on_user_containing("")
                .call("call_agent", json!({"agent_id": "answerer", "message": "{input}"})),
        )
        .rule(ScriptRule::agent("asker").on_tool_result().reply("{tool_result}"))
        .rule(ScriptRule::agent("answerer").reply("42"))
        .without_recording();
    AgentSystem::builder()
        .store(store)
        .llm(Arc::new(llm))
        .kind_config(kind_config)
        .agent(AgentSpec::new("asker"))
        .agent(AgentSpec::new("answerer"))
        .start()
        .unwrap()
}

/// Counts the ends of one agent's turns ([`AgentEvent::TurnEnded`]), for a bench to
/// wait on. Only inbox work makes an agent of [`notifier_and_worker`] converse (the
/// `notify_as` and `delegate` commands do not), so each end is one processed entry.
pub(crate) struct TurnsEnded {
    agent: String,
    /// Turns ended with a reply, turns ended with an error.
    ended: watch::Sender<(u64, u64)>,
}

impl TurnsEnded {
    pub(crate) fn of(agent: &str) -> Arc<Self> {
        Arc::new(Self {
            agent: agent.to_string(),
            ended: watch::Sender::new((0, 0)),
        })
    }

    /// How many of the agent's turns have ended so far.
    pub(crate) fn count(&self) -> u64 {
        let (ok, failed) = *self.ended.borrow();
        ok + failed
    }

    /// Waits until `count` of the agent's turns have ended (no timer: woken by the
    /// observer); panics if any of them failed.
    pub(crate) async fn until(&self, count: u64) {
        let mut ended = self.ended.subscribe();
        let (_, failed) = *ended.wait_for(|(ok, failed)| ok + failed >= count).await.unwrap();
        assert_eq!(failed, 0, "a turn of {} failed", self.agent);
    }
}

impl AgentObserver for TurnsEnded {
    fn on_event(&self, event: &AgentEvent) {
        if let AgentEvent::TurnEnded { agent, ok, .. } = event {
            if agent.key() == self.agent {
                self.ended.send_modify(|(oks, failed)| {
                    if *ok {
                        *oks += 1;
                    } else {
                        *failed += 1;
                    }
                });
            }
        }
    }
}

/// Agents `a` and `b` on an in-memory store, their activations kept by `kind_config`,
/// each with a [`TurnsEnded`] (returned in that order). `b` replies "42" to anything
/// (a notification or a task: one model step); `a` replies "seen" to the result of a
/// task it delegated (one model step).
pub(crate) fn notifier_and_worker(kind_config: KindConfig) -> (AgentSystem, Arc<TurnsEnded>, Arc<TurnsEnded>) {
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("you delegated is")
                .reply("seen"),
        )
        .rule(ScriptRule::agent("b").reply("42"))
        .without_recording();
    let (a_turns, b_turns) = (TurnsEnded::of("a"), TurnsEnded::of("b"));
    let system = AgentSystem::builder()
        .store(Arc::new(MemoryStore::new()))
        .llm(Arc::new(llm))
        .kind_config(kind_config)
        .observer(a_turns.clone())
        .observer(b_turns.clone())
        .agent(AgentSpec::new("a"))
        .agent(AgentSpec::new("b"))
        .start()
        .unwrap();
    (system, a_turns, b_turns)
}

/// What `a` sends `b` in the fire-and-forget benches.
const REQUEST: &str = "what is 6 x 7?";

/// Agent `a` notifies `b` `count` times back to back (`AgentClient::notify_as`: each
/// returns once the notification is committed to `a`'s outbox), then waits until `b`'s
/// turns on all of them have ended. `b` converses only on its inbox entries, and every
/// earlier call waited for its own, so the count before the sends is the base.
pub(crate) async fn notify_and_wait(system: &AgentSystem, b_turns: &TurnsEnded, count: u64) {
    let processed = b_turns.count() + count;
    for _ in 0..count {
        std::hint::black_box(system.notify_as("a", "b", REQUEST).await.unwrap());
    }
    b_turns.until(processed).await;
}

/// Agent `a` delegates a task to `b` (`AgentClient::delegate`: returns the task id once
/// the task is committed to `a`'s outbox) and waits until `a`'s turn on the task's result
/// has ended: `b` worked on it in a turn of its own, the result came back to `a`'s inbox
/// (the task's record at `a` is final from then on) and `a`'s model answered it. Returns
/// the task id.
pub(crate) async fn delegate_and_wait(system: &AgentSystem, a_turns: &TurnsEnded) -> String {
    let results = a_turns.count() + 1;
    let task = system.delegate("a", "b", REQUEST, None).await.unwrap();
    a_turns.until(results).await;
    task
}

/// Panics unless `a`'s committed record of task `task` (`AgentClient::task`) shows it
/// completed with `b`'s answer.
pub(crate) async fn assert_completed(system: &AgentSystem, task: &str) {
    let status = system
        .task("a", task)
        .await
        .unwrap()
        .expect("a keeps a record of its task");
    assert_eq!(status.state, TaskState::Completed, "task {task}: {status:?}");
    assert_eq!(status.result.as_deref(), Some("42"));
}
