//! `AgentClient::conversation_log_page`: a page of an agent's conversation log is the
//! same slice of it that the whole log gives, for every end and size (past the end, at
//! the start, empty), and reading it scans no more log entries than the page has
//! messages, however long the log (what the server's history endpoint pages with).
//! Both builds; real agents, the model scripted (it really emits the tool calls).

#[path = "support/forwarding_store.rs"]
mod forwarding_store;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use forwarding_store::{forwarding_state_store, ForwardingStore};
use serde_json::json;
use troupe_agent::{AgentSpec, AgentSystem, ScriptRule, ScriptedLlm};
use troupe_core::ActorId;
use troupe_runtime::{MemoryStore, StateStore, StoreError, StoreOperation};

/// A memory store that counts the log entries its scans return.
#[derive(Default)]
struct CountingStore {
    inner: MemoryStore,
    log_entries_scanned: AtomicUsize,
}

#[async_trait]
impl ForwardingStore for CountingStore {
    type Inner = MemoryStore;

    fn inner(&self) -> &MemoryStore {
        &self.inner
    }

    async fn forward_scan(
        &self,
        actor: &ActorId,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Bytes)>, StoreError> {
        let page = self.inner.scan(actor, prefix, after, limit).await?;
        if prefix == "log/" {
            self.log_entries_scanned.fetch_add(page.len(), Ordering::SeqCst);
        }
        Ok(page)
    }
}

forwarding_state_store!(CountingStore);

/// Turns of the boss: every third asks the worker (a log entry of four messages: the
/// question, the call, its result, the answer), the others answer at once (two).
const TURNS: usize = 30;

#[tokio::test(start_paused = true)]
async fn a_page_is_the_logs_slice_and_reads_only_its_entries() {
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("boss")
                .on_user_containing("ask")
                .call("call_agent", json!({"agent_id": "worker", "message": "{input}"})),
        )
        .rule(
            ScriptRule::agent("boss")
                .on_tool_result()
                .reply("worker said {tool_result}"),
        )
        .rule(ScriptRule::agent("boss").reply("fine: {input}"))
        .rule(ScriptRule::agent("worker").reply("done: {input}"));
    let store = Arc::new(CountingStore::default());
    let system = AgentSystem::builder()
        .llm(Arc::new(llm))
        .store(Arc::clone(&store) as Arc<dyn StateStore>)
        .agent(AgentSpec::new("boss"))
        .agent(AgentSpec::new("worker"))
        .start()
        .expect("the system starts");

    // Nothing logged yet: an empty page of an empty log.
    let empty = system.conversation_log_page("boss", None, 10).await.unwrap();
    assert_eq!((empty.total, empty.start, empty.messages.len()), (0, 0, 0));

    for turn in 0..TURNS {
        let text = if turn % 3 == 0 {
            format!("ask {turn}")
        } else {
            format!("plain {turn}")
        };
        system.ask("boss", &text).await.unwrap();
    }
    let log = system.conversation_log("boss").await.unwrap();
    let total = log.len();
    assert_eq!(
        total,
        TURNS / 3 * 4 + (TURNS - TURNS / 3) * 2,
        "four messages an ask, two a plain turn"
    );

    let ends = (0..=total + 3).map(Some).chain([None, Some(usize::MAX)]);
    for before in ends {
        for limit in [0, 1, 2, 3, 5, total, total + 10] {
            store.log_entries_scanned.store(0, Ordering::SeqCst);
            let page = system
                .conversation_log_page("boss", before.map(|before| before as u64), limit)
                .await
                .unwrap();
            let scanned = store.log_entries_scanned.load(Ordering::SeqCst);
            let end = before.unwrap_or(total).min(total);
            let start = end.saturating_sub(limit);
            let what = format!("before {before:?}, limit {limit}");
            assert_eq!(page.total, total as u64, "{what}");
            assert_eq!(page.start, start as u64, "{what}");
            assert_eq!(page.messages, log[start..end], "{what}");
            assert!(
                scanned <= end - start,
                "{what}: {scanned} log entries scanned for a page of {} messages",
                end - start
            );
        }
    }
    // The whole log reads every entry: what a page read before it existed.
    store.log_entries_scanned.store(0, Ordering::SeqCst);
    system.conversation_log("boss").await.unwrap();
    assert_eq!(store.log_entries_scanned.load(Ordering::SeqCst), TURNS);

    // Not an agent id: refused as `conversation_log` refuses it, naming why.
    match system.conversation_log_page("", None, 10).await {
        Err(StoreError::Backend {
            operation: StoreOperation::Decode,
            cause,
        }) => assert!(cause.contains("empty"), "{cause}"),
        other => panic!("expected the empty id refused, got {other:?}"),
    }
}
