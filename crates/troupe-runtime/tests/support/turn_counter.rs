//! A counter that counts its turns, for the tests of a store that fails for a moment
//! (`tests/store_retries.rs` here, `troupe-postgres`'s `tests/transient_failures.rs`,
//! which include this file by its path): each turn adds one to the count, writes it
//! under the key `last` too (so its commits carry writes as well as a state) and replies
//! with it; every turn run is counted, so a test can tell a commit tried again from a
//! turn run again.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use troupe_core::{ActorId, ActorKind};
use troupe_runtime::{Actor, ActorBox, ActorError, KindConfig, Runtime, StateStore, Turn};

/// The kind the counters are registered under.
pub(crate) const TURN_COUNTER_KIND: &str = "counter";

/// Adds one to its count each turn; the count is its snapshot.
pub(crate) struct TurnCounter {
    count: u64,
    turns: Arc<AtomicU64>,
}

impl Actor for TurnCounter {
    async fn handle(&mut self, turn: &mut Turn, _payload: Bytes) -> Result<Bytes, ActorError> {
        self.turns.fetch_add(1, Ordering::SeqCst);
        self.count += 1;
        let count = Bytes::from(self.count.to_string());
        turn.put("last", count.clone())?;
        Ok(count)
    }

    fn snapshot(&self) -> Result<Option<Bytes>, ActorError> {
        Ok(Some(Bytes::from(self.count.to_string())))
    }
}

/// A runtime on `store` with the counters registered; every turn they run adds one to
/// `turns`.
pub(crate) fn turn_counter_runtime(store: Arc<dyn StateStore>, turns: &Arc<AtomicU64>) -> Runtime {
    let turns = Arc::clone(turns);
    Runtime::builder()
        .store(store)
        .register(
            ActorKind::new(TURN_COUNTER_KIND).expect("a kind"),
            move |_id: &ActorId, saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
                let count = saved.map_or(0, |saved| {
                    std::str::from_utf8(&saved)
                        .expect("a stored count is text")
                        .parse()
                        .expect("a stored count is a number")
                });
                Ok(ActorBox::new(TurnCounter {
                    count,
                    turns: Arc::clone(&turns),
                }))
            },
            KindConfig::default(),
        )
        .expect("register the counter")
        .start()
}
