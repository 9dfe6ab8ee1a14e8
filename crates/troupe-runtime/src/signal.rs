//! [`Signal`]: a flag that is set once and wakes everyone waiting for it; [`Latch`]: the
//! same with a value.
//!
//! Used for "the runtime is stopping at once" and "this turn has ended". Not tokio's
//! `watch`: it wakes its waiters in an order drawn from an unseeded random generator,
//! which breaks seed replay under madsim; `Notify` wakes them in list order.

use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::Notify;

/// Set once, never cleared; waiters are woken when it is set.
#[derive(Debug, Default)]
pub(crate) struct Signal {
    set: AtomicBool,
    notify: Notify,
}

impl Signal {
    /// Sets the flag and wakes every waiter.
    pub(crate) fn set(&self) {
        self.set.store(true, Ordering::Release);
        self.notify.notify_waiters();
    }

    /// Whether it has been set.
    pub(crate) fn is_set(&self) -> bool {
        self.set.load(Ordering::Acquire)
    }

    /// Resolves once it has been set (at once if it already has).
    pub(crate) async fn wait(&self) {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            // Registered before the flag is read, so a set between the two still wakes it.
            notified.as_mut().enable();
            if self.is_set() {
                return;
            }
            notified.await;
        }
    }
}

/// A value set at most once, and waited for: what a `watch` channel of `Option<T>` set
/// once would do, but its waiters are woken in the order they started waiting, so a
/// seed replays the same under the simulator (tokio's `watch` picks each waiter's queue
/// with its thread-local random generator, which carries over from one run to the next
/// in a process; `clippy.toml` forbids waiting on one).
#[derive(Debug)]
pub struct Latch<T> {
    value: std::sync::Mutex<Option<T>>,
    notify: Notify,
}

impl<T> Default for Latch<T> {
    fn default() -> Self {
        Self {
            value: std::sync::Mutex::new(None),
            notify: Notify::new(),
        }
    }
}

impl<T: Clone> Latch<T> {
    /// An unset latch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the value and wakes every waiter, unless it was set before (the first value
    /// stays); whether this call set it.
    pub fn set(&self, value: T) -> bool {
        {
            let mut slot = self.slot();
            if slot.is_some() {
                return false;
            }
            *slot = Some(value);
        }
        self.notify.notify_waiters();
        true
    }

    /// The value, if it has been set.
    pub fn get(&self) -> Option<T> {
        self.slot().clone()
    }

    /// The value, once it has been set (at once if it has).
    pub async fn wait(&self) -> T {
        loop {
            // Created before the value is read: `notify_waiters` wakes every `Notified`
            // created before it, polled or not, so a set between the two still wakes it.
            let notified = self.notify.notified();
            if let Some(value) = self.get() {
                return value;
            }
            notified.await;
        }
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Option<T>> {
        self.value.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::Latch;

    /// `count` tasks waiting on `latch`.
    fn spawn_waiters<T: Clone + Send + Sync + 'static>(
        latch: &Arc<Latch<T>>,
        count: usize,
    ) -> Vec<tokio::task::JoinHandle<T>> {
        (0..count)
            .map(|_| {
                let latch = Arc::clone(latch);
                tokio::spawn(async move { latch.wait().await })
            })
            .collect()
    }

    /// Waiters that started before and after the value was set all get the first value;
    /// a second set changes nothing.
    #[tokio::test]
    async fn a_latch_gives_every_waiter_the_first_value() {
        let latch = Arc::new(Latch::new());
        let early = spawn_waiters(&latch, 3);
        tokio::task::yield_now().await;
        assert_eq!(latch.get(), None);
        assert!(latch.set("first"));
        assert!(!latch.set("second"));
        for waiter in early {
            assert_eq!(waiter.await.unwrap(), "first");
        }
        assert_eq!(latch.wait().await, "first");
        assert_eq!(latch.get(), Some("first"));
    }

    /// On worker threads: waiters starting while two setters race, over many rounds,
    /// all end, each with the value that won (no wake-up lost between the read and the
    /// registration).
    #[cfg(not(madsim))]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn racing_setters_and_waiters_agree_on_worker_threads() {
        for _ in 0..200 {
            let latch = Arc::new(Latch::new());
            let waiters = spawn_waiters(&latch, 4);
            let setters: Vec<_> = [1_u32, 2]
                .into_iter()
                .map(|value| {
                    let latch = Arc::clone(&latch);
                    tokio::spawn(async move { latch.set(value) })
                })
                .collect();
            let mut won = 0;
            for setter in setters {
                won += u32::from(setter.await.unwrap());
            }
            assert_eq!(won, 1, "exactly one set takes effect");
            let value = latch.get().expect("set");
            for waiter in waiters {
                let got = tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
                    .await
                    .expect("a waiter was not woken")
                    .unwrap();
                assert_eq!(got, value);
            }
        }
    }
}
