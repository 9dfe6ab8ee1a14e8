//! A notification left pending by a process that died: acknowledged by agent `b` of a
//! first process, which stops reaching the data before `b`'s turn on it commits. What a
//! second process on the same data must process, exactly once.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use troupe_agent::{AgentSpec, AgentSystem, ChatMessage, Role, ScriptedLlm};
use troupe_runtime::MemoryStore;

use crate::gate_store::GateStore;

/// The pending notification's id.
pub(crate) const NOTIFICATION_ID: &str = "m-1";

/// A system with agent `b` on `store` and the model `llm`.
pub(crate) fn start(llm: &ScriptedLlm, store: Arc<GateStore>) -> AgentSystem {
    AgentSystem::builder()
        .store(store)
        .llm(Arc::new(llm.clone()))
        .agent(AgentSpec::new("b"))
        .start()
        .expect("the system starts")
}

/// How often `log` holds the pending notification as a user message.
pub(crate) fn notifications(log: &[ChatMessage]) -> usize {
    let needle = format!("[notification {NOTIFICATION_ID}");
    log.iter()
        .filter(|m| m.role == Role::User && m.content.contains(&needle))
        .count()
}

/// A first process on `data` acknowledges the notification to `b`, then dies (its store
/// refuses everything) before `b`'s turn on it can commit: `llm` must take longer than
/// this returns to answer it.
pub(crate) async fn leave_a_notification_pending(llm: &ScriptedLlm, data: &MemoryStore) {
    let first_store = GateStore::new(Arc::new(data.clone()), false);
    let first = start(llm, Arc::clone(&first_store));
    first
        .notify_with_id("b", NOTIFICATION_ID, "hello", None)
        .await
        .expect("the notification is acknowledged");
    first_store.dead.store(true, Ordering::SeqCst);
    drop(first);
}
