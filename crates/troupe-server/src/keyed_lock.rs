//! Async locks by key: one `tokio` mutex per key that someone holds or waits for, none
//! kept for the others. The server's changes to one agent's definition (create, replace,
//! delete) are serialized by the agent's id ([`KeyedLocks::lock`]), so a change to one
//! agent never waits for another's (a delete waits for the agent's running turn).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

/// The locks, by key.
#[derive(Default)]
pub(crate) struct KeyedLocks {
    held: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// Holds the lock of one key; dropping it unlocks it.
pub(crate) struct KeyedGuard<'a> {
    // Dropped before `entry`, whose drop may then find the key unused and forget it.
    _guard: tokio::sync::OwnedMutexGuard<()>,
    _entry: Entry<'a>,
}

/// A use of one key's mutex (a holder or a waiter): when the last use goes, the key's
/// mutex is forgotten. A waiter whose future is dropped (its request cut) goes too.
struct Entry<'a> {
    locks: &'a KeyedLocks,
    key: String,
    lock: Option<Arc<tokio::sync::Mutex<()>>>,
}

impl Drop for Entry<'_> {
    fn drop(&mut self) {
        let mut held = self.locks.held.lock().unwrap_or_else(PoisonError::into_inner);
        drop(self.lock.take());
        // Every other use cloned the mutex under this map's lock: one reference left (the
        // map's) means no one holds or waits for the key.
        if held.get(&self.key).is_some_and(|lock| Arc::strong_count(lock) == 1) {
            held.remove(&self.key);
        }
    }
}

impl KeyedLocks {
    /// Waits for the lock of `key`, then holds it until the guard is dropped.
    pub(crate) async fn lock(&self, key: &str) -> KeyedGuard<'_> {
        let lock = Arc::clone(
            self.held
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(key.to_string())
                .or_default(),
        );
        let entry = Entry {
            locks: self,
            key: key.to_string(),
            lock: Some(Arc::clone(&lock)),
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
}
