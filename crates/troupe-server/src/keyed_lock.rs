//! Async locks by key: one `tokio` mutex per key that someone holds or waits for, none
//! kept for the others. The server's changes to one agent's definition (create, replace,
//! delete) are serialized by the agent's id ([`KeyedLocks::lock`]), so a change to one
//! agent never waits for another's (a delete waits for the agent's running turn).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

/// The locks, by key.
#[derive(Default)]
pub(crate) struct KeyedLocks {
    held: Mutex<HashMap<String, Slot>>,
}

/// One key's mutex and how many uses (holders and waiters) it has.
struct Slot {
    lock: Arc<tokio::sync::Mutex<()>>,
    /// Counted under the map's lock: the key is forgotten when it drops to 0. Counted,
    /// not read from the `Arc`'s strong count: a waiter's clone of the `Arc` lives in its
    /// `lock_owned` future, which a cut waiter may drop after its [`Entry`] (the order in
    /// which a dropped future drops what it holds), and that key would then be kept.
    uses: usize,
}

/// Holds the lock of one key; dropping it unlocks it.
pub(crate) struct KeyedGuard<'a> {
    _guard: tokio::sync::OwnedMutexGuard<()>,
    _entry: Entry<'a>,
}

/// A use of one key's mutex (a holder or a waiter): when the last use goes, the key's
/// mutex is forgotten. A waiter whose future is dropped (its request cut) goes too.
struct Entry<'a> {
    locks: &'a KeyedLocks,
    key: String,
}

impl Drop for Entry<'_> {
    fn drop(&mut self) {
        let mut held = self.locks.held.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(slot) = held.get_mut(&self.key) {
            slot.uses -= 1;
            if slot.uses == 0 {
                held.remove(&self.key);
            }
        }
    }
}

impl KeyedLocks {
    /// Waits for the lock of `key`, then holds it until the guard is dropped.
    pub(crate) async fn lock(&self, key: &str) -> KeyedGuard<'_> {
        let lock = {
            let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
            let slot = held.entry(key.to_string()).or_insert_with(|| Slot {
                lock: Arc::default(),
                uses: 0,
            });
            slot.uses += 1;
            Arc::clone(&slot.lock)
        };
        let entry = Entry {
            locks: self,
            key: key.to_string(),
        };
        let guard = lock.lock_owned().await;
        KeyedGuard {
            _guard: guard,
            _entry: entry,
        }
    }

    /// How many keys have a mutex now (held or waited for).
    #[cfg(test)]
    fn keys(&self) -> usize {
        self.held.lock().unwrap_or_else(PoisonError::into_inner).len()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Goal: a key's lock excludes only the same key, and nothing is kept of a key once
    /// it is unlocked, also when a waiter is cut while it waits.
    #[tokio::test(start_paused = true)]
    async fn a_key_excludes_only_itself_and_is_forgotten_when_unused() {
        let locks = KeyedLocks::default();
        let a = locks.lock("a").await;
        let b = tokio::time::timeout(Duration::from_millis(10), locks.lock("b")).await;
        assert!(b.is_ok(), "another key is not held up");
        let again = tokio::time::timeout(Duration::from_millis(10), locks.lock("a")).await;
        assert!(again.is_err(), "the same key waits");
        drop(b);
        assert_eq!(locks.keys(), 1, "b is forgotten; the cut waiter of a left nothing more");
        drop(a);
        assert_eq!(locks.keys(), 0, "a is forgotten");
        let a = tokio::time::timeout(Duration::from_millis(10), locks.lock("a")).await;
        assert!(a.is_ok(), "a can be locked again");
        drop(a);
        assert_eq!(locks.keys(), 0);
    }

    /// Polls `future` once (it registers as a waiter), leaving it pending.
    async fn poll_once<F: std::future::Future + Unpin>(future: &mut F) {
        tokio::select! {
            biased;
            _ = future => panic!("the lock was free"),
            () = tokio::task::yield_now() => {}
        }
    }

    /// Goal: the last waiter of a key, cut while it waits (its request dropped after the
    /// holder let go), leaves nothing in the map. Method: `CUT_WAITERS` keys, each held,
    /// waited for once, let go by its holder, then its waiter dropped; the map counted.
    #[tokio::test(start_paused = true)]
    async fn cut_last_waiters_leave_no_keys_behind() {
        /// How many keys get a cut waiter.
        const CUT_WAITERS: usize = 100;
        let locks = KeyedLocks::default();
        for index in 0..CUT_WAITERS {
            let key = format!("agent-{index}");
            let holder = locks.lock(&key).await;
            let mut waiter = Box::pin(locks.lock(&key));
            poll_once(&mut waiter).await;
            drop(holder);
            drop(waiter);
        }
        assert_eq!(locks.keys(), 0, "keys left by {CUT_WAITERS} cut waiters");
        // A waiter cut while the holder still holds leaves nothing either.
        let holder = locks.lock("a").await;
        let mut waiter = Box::pin(locks.lock("a"));
        poll_once(&mut waiter).await;
        drop(waiter);
        drop(holder);
        assert_eq!(locks.keys(), 0);
    }

    /// Goal: on the multi-thread runtime, tasks locking a few keys and aborted at any
    /// point (holding, waiting, or not yet started) leave no key behind, and the keys
    /// still exclude. Method: `ABORTED_TASKS` tasks over `SHARED_KEYS` keys, every other
    /// one aborted at once, the rest run to their end; then the map is counted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn aborted_lockers_on_many_threads_leave_no_keys_behind() {
        /// How many tasks lock.
        const ABORTED_TASKS: usize = 400;
        /// How many keys they share.
        const SHARED_KEYS: usize = 4;
        let locks = Arc::new(KeyedLocks::default());
        let inside = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for index in 0..ABORTED_TASKS {
            let (locks, inside) = (Arc::clone(&locks), Arc::clone(&inside));
            let key = format!("agent-{}", index % SHARED_KEYS);
            tasks.push(tokio::spawn(async move {
                let _guard = locks.lock(&key).await;
                if index % SHARED_KEYS == 0 {
                    assert_eq!(
                        inside.fetch_add(1, std::sync::atomic::Ordering::SeqCst),
                        0,
                        "one holder"
                    );
                    tokio::task::yield_now().await;
                    inside.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                }
                tokio::task::yield_now().await;
            }));
        }
        for (index, task) in tasks.iter().enumerate() {
            if index % 2 == 1 {
                task.abort();
            }
        }
        for task in tasks {
            if let Err(error) = task.await {
                assert!(error.is_cancelled(), "{error}");
            }
        }
        assert_eq!(locks.keys(), 0, "keys left by aborted lockers");
    }
}
