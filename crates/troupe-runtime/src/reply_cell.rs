//! The reply channel of one request: a cell the callee writes the reply into once and
//! the caller takes it from, with each side able to see the other go away.
//!
//! ```text
//! channel() ─► (ReplySender in the envelope, ReplyReceiver in the caller's wait)
//! callee: send(reply) ─► caller: try_recv / poll_recv ─► Ok(reply)
//! caller gives up: drop(ReplyReceiver) ─► callee: is_closed / poll_closed ─► cancel the turn
//! callee's activation ends unanswered: drop(ReplySender) ─► caller: Closed
//! both ends gone ─► the cell goes back to this thread's pool (or is freed)
//! ```
//!
//! Why not tokio's `oneshot`: this is what it does, for one type, with its block reused.
//! A typed ask spent about 400 instructions of its 3,268 on the channel (callgrind,
//! 2026-11-29: the allocation, the send, the receive, the free): its block is a `malloc`
//! and a `free` per request, and the receive frees it through `Arc`'s slow path. Here a
//! request takes a block from a per-thread pool of [`POOL_CELLS_MAX`] cells and gives it
//! back when both ends are gone (see docs/architecture.md, "Tenth pass").
//!
//! The safety argument, in one place:
//! - **The value has one writer, then one reader.** The sender writes it before it sets
//!   `SENT` (with `SENDER_GONE`, in one read-modify-write with release ordering) and never
//!   touches the cell's value again; the receiver reads it only after it saw `SENT` with
//!   acquire ordering. A value nobody took is dropped when the cell is released.
//! - **The cell lives while either end does.** `ends` counts the ends that still hold it
//!   (2, then 1, then 0). An end announces that it is gone in `state` first, wakes the
//!   other side's waiter after, and only then gives up its count: so a wake never touches
//!   a cell that was released meanwhile. The end that brings `ends` to 0 (acquire-release,
//!   so it sees everything the other end wrote) releases the cell: it drops an untaken
//!   value and both wakers, resets the cell and pools or frees it.
//! - **No lost wake-up.** A waiter registers its waker (`atomic_waker::AtomicWaker`, the
//!   smol project's crate, which handles a registration racing a wake) and then looks at
//!   `state` again; the other side sets its bit and then wakes. So either the waiter's
//!   second look sees the bit, or the wake finds the waker.
//!
//! Checked under Miri with its data-race detector (see the tests' doc); the tests run in
//! CI on both runtimes' threads.

use std::cell::{RefCell, UnsafeCell};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU8, Ordering};
use std::task::{Context, Poll};

use atomic_waker::AtomicWaker;

use crate::envelope::Reply;

/// The most idle reply cells a thread keeps for its next requests (one cell is about
/// 100 bytes). A thread that waits on more requests at once than this allocates the rest
/// and frees them when they end.
pub(crate) const POOL_CELLS_MAX: usize = 32;

/// The sender has written the value.
const SENT: u8 = 0b001;
/// The sender is gone (after sending, or dropped without).
const SENDER_GONE: u8 = 0b010;
/// The receiver is gone.
const RECEIVER_GONE: u8 = 0b100;

struct Cell {
    /// `SENT`, `SENDER_GONE`, `RECEIVER_GONE`.
    state: AtomicU8,
    /// The ends that still hold the cell.
    ends: AtomicU8,
    value: UnsafeCell<Option<Reply>>,
    /// The caller waiting for the reply, once it had to wait.
    receiver_waker: AtomicWaker,
    /// The callee's turn watching for its caller to go, once it had to wait.
    sender_waker: AtomicWaker,
}

impl Cell {
    fn new() -> Self {
        Self {
            state: AtomicU8::new(0),
            ends: AtomicU8::new(2),
            value: UnsafeCell::new(None),
            receiver_waker: AtomicWaker::new(),
            sender_waker: AtomicWaker::new(),
        }
    }
}

thread_local! {
    /// Released cells, reset, for this thread's next requests. Boxes, not cells: the
    /// point is to reuse their blocks.
    #[allow(clippy::vec_box)]
    static POOL: RefCell<Vec<Box<Cell>>> = const { RefCell::new(Vec::new()) };
}

/// A new reply channel.
pub(crate) fn channel() -> (ReplySender, ReplyReceiver) {
    let cell = POOL
        .try_with(|pool| pool.borrow_mut().pop())
        .ok()
        .flatten()
        .unwrap_or_else(|| Box::new(Cell::new()));
    let cell = NonNull::from(Box::leak(cell));
    (ReplySender { cell }, ReplyReceiver { cell })
}

/// Gives up one end's hold on `cell`; the last end releases it.
///
/// # Safety
/// `cell` is held by the calling end, which does not touch it afterwards.
unsafe fn give_up(cell: NonNull<Cell>) {
    // SAFETY: the calling end still holds the cell, so it is alive.
    let last = unsafe { cell.as_ref() }.ends.fetch_sub(1, Ordering::AcqRel) == 1;
    if !last {
        return;
    }
    // SAFETY: both ends are gone, so this is the only reference; the cell was leaked
    // from a box by `channel`.
    let mut cell = unsafe { Box::from_raw(cell.as_ptr()) };
    // Reset: what nobody took and the wakers go now, not when the cell is next used.
    drop(cell.value.get_mut().take());
    drop(cell.receiver_waker.take());
    drop(cell.sender_waker.take());
    *cell.state.get_mut() = 0;
    *cell.ends.get_mut() = 2;
    let _ = POOL.try_with(|pool| {
        let mut pool = pool.borrow_mut();
        if pool.len() < POOL_CELLS_MAX {
            pool.push(cell);
        }
    });
}

/// The callee's end: sends the reply, or sees the caller go.
pub(crate) struct ReplySender {
    cell: NonNull<Cell>,
}

// SAFETY: the sender touches the value only before it sets `SENT`, and the cell's other
// fields are atomics; a `Reply` is `Send`.
unsafe impl Send for ReplySender {}
// SAFETY: a shared sender only reads `state`.
unsafe impl Sync for ReplySender {}

impl ReplySender {
    fn cell(&self) -> &Cell {
        // SAFETY: the sender holds the cell until it is dropped or sends.
        unsafe { self.cell.as_ref() }
    }

    /// Sends the reply; dropped if the receiver is gone.
    pub(crate) fn send(self, reply: Reply) {
        let cell = self.cell;
        std::mem::forget(self);
        // SAFETY: the sender holds the cell. The value is written before `SENT` is set
        // and the receiver reads it only after it saw `SENT`.
        let cell_ref = unsafe { cell.as_ref() };
        unsafe { *cell_ref.value.get() = Some(reply) };
        let before = cell_ref.state.fetch_or(SENT | SENDER_GONE, Ordering::AcqRel);
        if before & RECEIVER_GONE == 0 {
            cell_ref.receiver_waker.wake();
        }
        // SAFETY: the sender held the cell and touches it no more.
        unsafe { give_up(cell) };
    }

    /// Whether the receiver is gone.
    pub(crate) fn is_closed(&self) -> bool {
        self.cell().state.load(Ordering::Acquire) & RECEIVER_GONE != 0
    }

    /// Ready once the receiver is gone; else registers the task to be woken then.
    pub(crate) fn poll_closed(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.is_closed() {
            return Poll::Ready(());
        }
        self.cell().sender_waker.register(cx.waker());
        if self.is_closed() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

impl Drop for ReplySender {
    fn drop(&mut self) {
        let cell = self.cell();
        if cell.state.fetch_or(SENDER_GONE, Ordering::AcqRel) & RECEIVER_GONE == 0 {
            cell.receiver_waker.wake();
        }
        // SAFETY: the sender held the cell and touches it no more.
        unsafe { give_up(self.cell) };
    }
}

/// Why [`ReplyReceiver::try_recv`] had no reply.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum TryRecvError {
    /// Not yet: the sender is still there.
    Empty,
    /// Never: the sender went without sending (or the reply was taken already).
    Closed,
}

/// The caller's end: takes the reply.
pub(crate) struct ReplyReceiver {
    cell: NonNull<Cell>,
}

// SAFETY: the receiver touches the value only after it saw `SENT`, when the sender no
// longer does; the cell's other fields are atomics; a `Reply` is `Send`.
unsafe impl Send for ReplyReceiver {}
// SAFETY: a shared receiver gives access to nothing (every method takes `&mut self`).
unsafe impl Sync for ReplyReceiver {}

impl ReplyReceiver {
    fn cell(&self) -> &Cell {
        // SAFETY: the receiver holds the cell until it is dropped.
        unsafe { self.cell.as_ref() }
    }

    /// The reply if it has arrived, without registering anything.
    pub(crate) fn try_recv(&mut self) -> Result<Reply, TryRecvError> {
        let cell = self.cell();
        let state = cell.state.load(Ordering::Acquire);
        if state & SENT != 0 {
            // SAFETY: `SENT` was seen with acquire ordering: the sender wrote the value
            // before and touches it no more; this receiver is the only reader
            // (`&mut self`).
            return unsafe { &mut *cell.value.get() }.take().ok_or(TryRecvError::Closed);
        }
        if state & SENDER_GONE != 0 {
            return Err(TryRecvError::Closed);
        }
        Err(TryRecvError::Empty)
    }

    /// The reply, or `Err(())` if the sender went without one; else registers the task
    /// to be woken when either happens. A reply already there is taken without
    /// registering anything.
    pub(crate) fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Result<Reply, ()>> {
        let ready = |received: Result<Reply, TryRecvError>| match received {
            Ok(reply) => Some(Ok(reply)),
            Err(TryRecvError::Closed) => Some(Err(())),
            Err(TryRecvError::Empty) => None,
        };
        if let Some(received) = ready(self.try_recv()) {
            return Poll::Ready(received);
        }
        self.cell().receiver_waker.register(cx.waker());
        ready(self.try_recv()).map_or(Poll::Pending, Poll::Ready)
    }

    /// The reply, or `Err(())` if the sender went without one.
    #[cfg(test)]
    pub(crate) async fn recv(mut self) -> Result<Reply, ()> {
        std::future::poll_fn(|cx| self.poll_recv(cx)).await
    }
}

impl Drop for ReplyReceiver {
    fn drop(&mut self) {
        let cell = self.cell();
        if cell.state.fetch_or(RECEIVER_GONE, Ordering::AcqRel) & SENDER_GONE == 0 {
            cell.sender_waker.wake();
        }
        // SAFETY: the receiver held the cell and touches it no more.
        unsafe { give_up(self.cell) };
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::sync::{Arc, Barrier};
    use std::task::{Wake, Waker};

    use bytes::Bytes;
    use troupe_core::{ActorId, InvokeError};

    use super::*;
    use crate::envelope::Payload;

    fn reply(n: u8) -> Reply {
        Ok(Payload::Bytes(Bytes::from(vec![n; 3])))
    }

    fn bytes_of(reply: Reply) -> Vec<u8> {
        match reply {
            Ok(Payload::Bytes(bytes)) => bytes.to_vec(),
            _ => panic!("not a bytes reply"),
        }
    }

    /// Counts its wakes.
    struct CountingWaker(AtomicUsize);

    impl Wake for CountingWaker {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A waker that does nothing, for polls whose wake nobody checks.
    fn noop_context() -> Context<'static> {
        Context::from_waker(Waker::noop())
    }

    fn counting() -> (Arc<CountingWaker>, Waker) {
        let counter = Arc::new(CountingWaker(AtomicUsize::new(0)));
        (counter.clone(), Waker::from(counter))
    }

    /// Goal: a reply sent is taken once; the receiver does not see it before it is sent,
    /// and sees `Closed` after it was taken.
    #[test]
    fn a_reply_is_taken_once() {
        let (sender, mut receiver) = channel();
        assert_eq!(receiver.try_recv().err(), Some(TryRecvError::Empty));
        assert!(!sender.is_closed());
        sender.send(reply(7));
        assert_eq!(bytes_of(receiver.try_recv().unwrap()), vec![7; 3]);
        assert_eq!(receiver.try_recv().err(), Some(TryRecvError::Closed));
    }

    /// Goal: a sender dropped without sending closes the channel and wakes a receiver
    /// that waits; an error reply is a reply, not a closure.
    #[test]
    fn a_sender_gone_without_a_reply_closes_and_wakes() {
        let (sender, mut receiver) = channel();
        let (count, waker) = counting();
        assert!(receiver.poll_recv(&mut Context::from_waker(&waker)).is_pending());
        drop(sender);
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "the waiting receiver was woken");
        assert!(matches!(receiver.poll_recv(&mut noop_context()), Poll::Ready(Err(()))));

        let (sender, mut receiver) = channel();
        let target = ActorId::new("k", "a").unwrap();
        sender.send(Err(InvokeError::Cancelled { target }));
        assert!(matches!(
            receiver.poll_recv(&mut noop_context()),
            Poll::Ready(Ok(Err(InvokeError::Cancelled { .. })))
        ));
    }

    /// Goal: a receiver that waits is woken by the send, once, and then has the reply.
    #[test]
    fn a_send_wakes_a_waiting_receiver() {
        let (sender, mut receiver) = channel();
        let (count, waker) = counting();
        assert!(receiver.poll_recv(&mut Context::from_waker(&waker)).is_pending());
        sender.send(reply(1));
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        assert!(matches!(receiver.poll_recv(&mut noop_context()), Poll::Ready(Ok(_))));
    }

    /// Goal: the sender sees its receiver go, by `is_closed` and by a registered
    /// `poll_closed` that is woken; a reply sent to nobody is dropped, not kept.
    #[test]
    fn the_sender_sees_its_receiver_go() {
        let (mut sender, receiver) = channel();
        let (count, waker) = counting();
        assert!(sender.poll_closed(&mut Context::from_waker(&waker)).is_pending());
        drop(receiver);
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "the watching sender was woken");
        assert!(sender.is_closed());
        assert!(sender.poll_closed(&mut noop_context()).is_ready());

        let payload = Bytes::from(vec![9_u8; 4]);
        let (sender, receiver) = channel();
        drop(receiver);
        sender.send(Ok(Payload::Bytes(payload.clone())));
        assert!(payload.is_unique(), "the reply nobody took was dropped at once");
    }

    /// Goal: a released cell comes back reset: a request after a reply, after an
    /// abandonment and after a sender that went without replying each starts empty, and
    /// a waker registered on a cell is dropped at its release (no task kept alive by the
    /// pool). Up to `POOL_CELLS_MAX` cells are kept, the rest freed.
    #[test]
    fn a_pooled_cell_starts_again_empty() {
        for round in 0..3 {
            let (count, waker) = counting();
            let (mut sender, mut receiver) = channel();
            assert!(receiver.poll_recv(&mut Context::from_waker(&waker)).is_pending());
            assert!(sender.poll_closed(&mut Context::from_waker(&waker)).is_pending());
            match round {
                0 => {
                    sender.send(reply(round));
                    drop(receiver);
                }
                1 => {
                    drop(receiver);
                    drop(sender);
                }
                _ => {
                    drop(sender);
                    drop(receiver);
                }
            }
            drop(waker);
            assert_eq!(
                Arc::strong_count(&count),
                1,
                "round {round}: the cell let go of its wakers"
            );
            let (sender, mut receiver) = channel();
            assert_eq!(receiver.try_recv().err(), Some(TryRecvError::Empty), "round {round}");
            assert!(!sender.is_closed(), "round {round}");
        }
        let many: Vec<_> = (0..POOL_CELLS_MAX + 5).map(|_| channel()).collect();
        drop(many);
        assert_eq!(POOL.with(|pool| pool.borrow().len()), POOL_CELLS_MAX);
    }

    /// Goal: a reply crosses threads intact while the receiver races to take it and the
    /// sender to send, and a receiver dropped on one thread is seen by a sender that
    /// watches on another; no reply is lost or seen twice, no wake-up is lost. OS
    /// threads (scoped), not tasks: so that Miri's data-race detector can check it too
    /// (`cargo +nightly miri test -p troupe-runtime --lib reply_cell`).
    #[test]
    fn replies_cross_threads() {
        let rounds: u8 = if cfg!(miri) { 20 } else { 250 };
        for round in 0..rounds {
            for _ in 0..if cfg!(miri) { 1 } else { 40 } {
                let (sender, mut receiver) = channel();
                let start = Barrier::new(2);
                std::thread::scope(|scope| {
                    scope.spawn(|| {
                        start.wait();
                        sender.send(reply(round));
                    });
                    let (count, waker) = counting();
                    start.wait();
                    let got = loop {
                        match receiver.poll_recv(&mut Context::from_waker(&waker)) {
                            Poll::Ready(got) => break got,
                            // Registered and still nothing: only a wake may end the wait.
                            Poll::Pending => {
                                while count.0.load(Ordering::SeqCst) == 0 {
                                    std::hint::spin_loop();
                                }
                            }
                        }
                    };
                    assert_eq!(bytes_of(got.expect("the reply arrives")), vec![round; 3]);
                });

                let (mut sender, receiver) = channel();
                let start = Barrier::new(2);
                std::thread::scope(|scope| {
                    scope.spawn(|| {
                        start.wait();
                        drop(receiver);
                    });
                    let (count, waker) = counting();
                    start.wait();
                    while sender.poll_closed(&mut Context::from_waker(&waker)).is_pending() {
                        while count.0.load(Ordering::SeqCst) == 0 {
                            std::hint::spin_loop();
                        }
                    }
                });
            }
        }
    }
}
