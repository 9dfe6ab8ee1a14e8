//! [`Signal`]: a flag that is set once and wakes everyone waiting for it.
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
