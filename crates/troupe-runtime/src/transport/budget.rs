//! [`ByteBudget`]: the bytes one connection may hold buffered at once.
//!
//! A budget is a semaphore of bytes. Whoever buffers a frame (the server's reader for a
//! request until its turn ends, either side's writer queue for a frame until it is
//! written) first takes that many bytes from the connection's budget and gives them
//! back when the frame is gone. Waiting for bytes is backpressure: the server stops
//! reading the connection, a client caller waits (within its deadline). Every frame
//! fits an empty budget (`CONNECTION_BYTES_IN_FLIGHT_MAX_BYTES` is at least one whole
//! frame), and the semaphore is fair (first come, first served), so a large frame is
//! never starved by small ones.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::CONNECTION_BYTES_IN_FLIGHT_MAX_BYTES;

/// The bytes one connection may hold buffered, and a gauge of the bytes held (shared by
/// every connection of a server or client, for its stats).
#[derive(Debug, Clone)]
pub(crate) struct ByteBudget {
    bytes: Arc<Semaphore>,
    held_bytes: Arc<AtomicUsize>,
}

/// Bytes taken from a [`ByteBudget`]; given back when dropped.
#[derive(Debug)]
pub(crate) struct BytesPermit {
    _bytes: OwnedSemaphorePermit,
    size_bytes: usize,
    held_bytes: Arc<AtomicUsize>,
}

impl Drop for BytesPermit {
    fn drop(&mut self) {
        self.held_bytes.fetch_sub(self.size_bytes, Ordering::Relaxed);
    }
}

/// An encoded frame queued for a connection's writer, holding its bytes of the budget
/// until it has been written (and dropped).
#[derive(Debug)]
pub(crate) struct BudgetedFrame {
    pub(crate) frame: Bytes,
    pub(crate) _permit: BytesPermit,
}

impl AsRef<[u8]> for BudgetedFrame {
    fn as_ref(&self) -> &[u8] {
        &self.frame
    }
}

impl ByteBudget {
    /// A budget of [`CONNECTION_BYTES_IN_FLIGHT_MAX_BYTES`] for one connection, counted
    /// into `held_bytes`.
    pub(crate) fn for_connection(held_bytes: Arc<AtomicUsize>) -> Self {
        Self {
            bytes: Arc::new(Semaphore::new(CONNECTION_BYTES_IN_FLIGHT_MAX_BYTES)),
            held_bytes,
        }
    }

    /// Takes `size_bytes` from the budget, waiting until that many are free.
    ///
    /// # Panics
    /// If `size_bytes` exceeds [`CONNECTION_BYTES_IN_FLIGHT_MAX_BYTES`] (a frame over
    /// the frame limit is refused before it is budgeted, so this is a programmer error).
    ///
    /// # Cancel safety
    /// Cancel safe: a cancelled wait takes nothing and keeps no place in the queue.
    pub(crate) async fn acquire(&self, size_bytes: usize) -> BytesPermit {
        assert!(
            size_bytes <= CONNECTION_BYTES_IN_FLIGHT_MAX_BYTES,
            "a frame of {size_bytes} bytes exceeds the connection budget of {CONNECTION_BYTES_IN_FLIGHT_MAX_BYTES} bytes"
        );
        let count = u32::try_from(size_bytes).expect("the connection budget fits a u32");
        let permit = Arc::clone(&self.bytes)
            .acquire_many_owned(count)
            .await
            .expect("a connection's byte budget is never closed");
        self.permit(permit, size_bytes)
    }

    /// Takes `size_bytes` from the budget if they are free now.
    pub(crate) fn try_acquire(&self, size_bytes: usize) -> Option<BytesPermit> {
        let count = u32::try_from(size_bytes).ok()?;
        let permit = Arc::clone(&self.bytes).try_acquire_many_owned(count).ok()?;
        Some(self.permit(permit, size_bytes))
    }

    fn permit(&self, permit: OwnedSemaphorePermit, size_bytes: usize) -> BytesPermit {
        self.held_bytes.fetch_add(size_bytes, Ordering::Relaxed);
        BytesPermit {
            _bytes: permit,
            size_bytes,
            held_bytes: Arc::clone(&self.held_bytes),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_held_until_the_permit_drops_and_an_overdraft_is_refused() {
        let gauge = Arc::new(AtomicUsize::new(0));
        let budget = ByteBudget::for_connection(Arc::clone(&gauge));
        let most = budget.try_acquire(CONNECTION_BYTES_IN_FLIGHT_MAX_BYTES - 10).unwrap();
        assert_eq!(gauge.load(Ordering::Relaxed), CONNECTION_BYTES_IN_FLIGHT_MAX_BYTES - 10);
        assert!(budget.try_acquire(11).is_none());
        let rest = budget.try_acquire(10).unwrap();
        assert_eq!(gauge.load(Ordering::Relaxed), CONNECTION_BYTES_IN_FLIGHT_MAX_BYTES);
        drop(most);
        drop(rest);
        assert_eq!(gauge.load(Ordering::Relaxed), 0);
        assert!(budget.try_acquire(CONNECTION_BYTES_IN_FLIGHT_MAX_BYTES).is_some());
    }
}
