//! An activation's mailbox: a bounded queue of envelopes from callers (and the
//! dispatcher) to the activation's task, with the count of messages ever put into it.
//!
//! One lock guards the queue, the count, whether the mailbox is open and the task's
//! waker: a delivery takes it once. A receipt that finds its batch empty takes it once
//! and takes everything queued in that one critical section (the queue is swapped with
//! the receiver's empty batch; the buffers change places, no envelope moves), then hands
//! the batch's messages out without the lock, so a burst's messages cost the receiver one
//! lock, not one each. A message is taken out of the batch where it lies, by the
//! activation's loop itself (`poll_ready`, then `take_ready`), not returned through the
//! wait's output: each move of a 120-byte envelope through a return value was a copy the
//! processor read back right after writing it (see "Twenty-ninth pass" in
//! docs/architecture.md). The receiver alone publishes how many messages it has taken
//! out (`Mailbox::taken`, one writer, stored rather than atomically added), and a
//! delivery's bound counts what is
//! delivered and not yet taken: messages in the receiver's batch count as queued, as
//! before (see "The mailbox's batch" in docs/architecture.md). (It replaced a tokio bounded `mpsc`
//! channel behind a route's own lock: a delivery took the route's lock, then the
//! channel's semaphore and its block list's atomics, and every receipt gave its permit
//! back under the semaphore's waiter lock; see docs/architecture.md, "The mailbox".)
//! The count is what the idle handshake compares (`Routes` in handle.rs): it changes
//! with the queue, under the same lock, so the dispatcher's compare-and-close excludes
//! every delivery without a second lock.
//!
//! ```text
//! callers' fast path ─┐
//!                     ├─► Mailbox::deliver ─► [lock: open? full? push, delivered += 1,
//! dispatcher ─────────┘                        take the waker] ─► wake the task
//! activation's task ─► MailboxReceiver::poll_ready ─► ready if its batch holds one, or
//!                                                     [lock: swap the queue in as the
//!                                                     batch, or closed when closed and
//!                                                     empty, or keep the waker]
//!                   ─► MailboxReceiver::take_ready ─► the batch's front, in place
//! dispatcher ─► Route dropped / close_if_delivered ─► closed: the task drains, then None
//! ```
//!
//! Memory: one allocation per activation (this state), plus the queue's buffer. The
//! queue holds the envelopes themselves (up to
//! [`ENVELOPE_BYTES_MAX`](crate::envelope::ENVELOPE_BYTES_MAX) = 120 bytes each), not
//! boxes of them, so a message costs no allocation of its own: a box per message was a
//! `malloc` and a `free` each, and beyond glibc's per-thread cache of 7 blocks (a batch
//! of tells) about 110 instructions a message (callgrind, 2026-11-29). The buffer is
//! made with the activation's first message, with room for the messages it opens with
//! (usually one), grows with bursts, is given back down to [`MAILBOX_SLOTS_KEPT`] once
//! the queue empties, and down to [`MAILBOX_SLOTS_KEPT_IDLE`] at the idle timer. The
//! queue and the batch trade buffers at each receipt, so an actor that has received more
//! than one message holds two (one slot each for an actor called one at a time) until its
//! idle timer gives the batch's back.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

use crate::envelope::Envelope;

/// Queue slots a mailbox keeps once it has emptied after a burst (an envelope's
/// [`ENVELOPE_BYTES_MAX`](crate::envelope::ENVELOPE_BYTES_MAX) bytes each, 7,680 B for
/// 64): the rest of its buffer is given back, so an actor that once took a burst of
/// thousands of messages does not hold their room. A default mailbox never holds more.
/// A smaller number made a mailbox that keeps filling up, as a batch of tells does, give
/// its room back and grow it again at every batch (8 slots: about 1,000 instructions
/// more per batch of 33, callgrind, 2026-11-29); what an idle actor keeps is
/// [`MAILBOX_SLOTS_KEPT_IDLE`] instead.
pub(crate) const MAILBOX_SLOTS_KEPT: usize = troupe_core::limits::MAILBOX_CAPACITY_DEFAULT;

/// Queue slots a mailbox keeps once its actor has received nothing for a whole idle
/// timer period (checked at the idle timer, so once per period, never per message):
/// one envelope's room, which an actor called by one caller at a time never outgrows.
pub(crate) const MAILBOX_SLOTS_KEPT_IDLE: usize = 1;

/// What became of one delivery attempt into a mailbox.
pub(crate) enum Delivery {
    Delivered,
    /// The mailbox is full; its capacity. (The envelope comes back boxed: only a
    /// refused one pays for the box.)
    Full(Box<Envelope>, usize),
    /// The mailbox is closed (its activation is ending, or its task has ended).
    Closed(Box<Envelope>),
}

/// The mailbox's sending side, shared by the route map's entry and typed refs' caches.
pub(crate) struct Mailbox {
    state: Mutex<MailboxState>,
    /// The most messages it holds at once: delivered and not yet taken by the receiver
    /// (its batch included).
    capacity: usize,
    /// Messages the receiver has taken out, written by it alone (a store of its own
    /// count, not an atomic add) and read by deliveries under the lock. A delivery that
    /// reads it just before the receiver takes one more sees the mailbox one fuller than
    /// it is, as it would have had it taken the lock a moment earlier.
    taken: AtomicU64,
}

struct MailboxState {
    /// The envelopes themselves, not boxes: a message costs no allocation of its own
    /// (see the module doc).
    queue: VecDeque<Envelope>,
    /// Messages ever put into it (the idle handshake's count).
    delivered: u64,
    /// Closed by the dispatcher (the activation deactivates, is fenced or ended) or by
    /// its task (it failed to start, or ended): no more deliveries.
    open: bool,
    /// The task's waker, while it waits for a message.
    waker: Option<Waker>,
}

/// A queue holding just `envelope`, in its box's block: a `Box<T>` is the block of a
/// `Box<[T]>` of one element, which becomes a `Vec` and then a `VecDeque` without
/// reallocating (both conversions are documented not to). A cold activation then costs one
/// allocation and one free fewer (`scripts/instr-count cold`), and its queue has room for
/// exactly one message, as before.
fn queue_of_one(envelope: Box<Envelope>) -> VecDeque<Envelope> {
    let raw = Box::into_raw(envelope);
    // SAFETY: `raw` comes from `Box::into_raw` of a `Box<Envelope>`, so it is valid, owned
    // and allocated by the global allocator with `Layout::new::<Envelope>()`. A slice of
    // one `Envelope` has that same layout (its size is one element's, a multiple of the
    // alignment), so the block is a valid `Box<[Envelope]>` of length 1, freed with the
    // layout it was allocated with.
    let one: Box<[Envelope]> = unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(raw, 1)) };
    VecDeque::from(one.into_vec())
}

impl Mailbox {
    /// An open mailbox of `capacity` holding `messages` (counted as delivered), and its
    /// receiving side.
    ///
    /// It may open with more than `capacity` (accepted told messages carried over a
    /// crash, see `CARRIED_OVER_MAX_MAILBOXES`): it then refuses deliveries as full until
    /// it has fewer than `capacity`.
    ///
    /// # Panics
    /// If `messages` are more than `CARRIED_OVER_MAX_MAILBOXES` times `capacity`.
    pub(crate) fn open(
        capacity: usize,
        messages: impl ExactSizeIterator<Item = Box<Envelope>>,
    ) -> (Arc<Self>, MailboxReceiver) {
        assert!(
            messages.len() <= capacity.saturating_mul(crate::dispatcher::CARRIED_OVER_MAX_MAILBOXES),
            "{} messages for a mailbox of {capacity}",
            messages.len()
        );
        // Room for exactly the messages it opens with (usually one): an actor that only
        // ever has one message at a time, as one called by a single caller, never grows
        // it, and keeps one envelope's room while idle.
        let mut messages = messages;
        let queue: VecDeque<Envelope> = match messages.len() {
            // The usual case, a first message: the queue takes its box's block as its
            // buffer, rather than a new one into which the envelope is copied.
            1 => queue_of_one(messages.next().expect("one message")),
            _ => messages.map(|envelope| *envelope).collect(),
        };
        let mailbox = Arc::new(Self {
            state: Mutex::new(MailboxState {
                delivered: queue.len() as u64,
                queue,
                open: true,
                waker: None,
            }),
            capacity,
            taken: AtomicU64::new(0),
        });
        let receiver = MailboxReceiver {
            mailbox: Arc::clone(&mailbox),
            batch: VecDeque::new(),
            taken: 0,
        };
        (mailbox, receiver)
    }

    fn state(&self) -> MutexGuard<'_, MailboxState> {
        // Nothing panics while holding it (no envelope is dropped under it).
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Puts `envelope` into the mailbox and counts it, if it is open and not full, and
    /// wakes the task if it waits.
    pub(crate) fn deliver(&self, envelope: Envelope) -> Delivery {
        let waker = {
            let mut state = self.state();
            if !state.open {
                drop(state);
                return Delivery::Closed(Box::new(envelope));
            }
            // Delivered and not yet taken: the queue and what is left of the receiver's
            // batch (`taken` never exceeds `delivered`, which only grows).
            if state.delivered - self.taken.load(Ordering::Acquire) >= self.capacity as u64 {
                drop(state);
                return Delivery::Full(Box::new(envelope), self.capacity);
            }
            if state.queue.capacity() == 0 {
                // The receiver's emptied batch, swapped in as the queue: one slot, not
                // the four an empty `VecDeque` grows to.
                reserve_one(&mut state.queue);
            }
            state.queue.push_back(envelope);
            state.delivered += 1;
            state.waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
        Delivery::Delivered
    }

    /// Whether exactly `received` messages were ever put into it; if so, closes it in
    /// the same critical section (nothing can be delivered in between).
    pub(crate) fn close_if_delivered(&self, received: u64) -> bool {
        let state = self.state();
        if state.delivered != received {
            return false;
        }
        close_locked(state);
        true
    }

    /// Closes it: no more deliveries; the task takes what is queued, then sees the end.
    pub(crate) fn close(&self) {
        close_locked(self.state());
    }

    /// Whether it is closed (an activation stops trying its store again once it is:
    /// see `store_retry.rs`).
    pub(crate) fn is_closed(&self) -> bool {
        !self.state().open
    }
}

/// Gives back a queue's room beyond [`MAILBOX_SLOTS_KEPT`] (after a burst): out of line,
/// so that the receipt's path stays small.
#[cold]
#[inline(never)]
fn shrink_after_burst(queue: &mut VecDeque<Envelope>) {
    queue.shrink_to(MAILBOX_SLOTS_KEPT);
}

/// Makes room for one envelope in a queue that has none: out of line, as it happens once
/// per activation (or after an idle period's trim), not per message.
#[cold]
#[inline(never)]
fn reserve_one(queue: &mut VecDeque<Envelope>) {
    queue.reserve_exact(1);
}

/// Closes the mailbox whose lock is `state`, then wakes its task (after the lock is let
/// go) so that it sees the end once it has taken what is queued.
fn close_locked(mut state: MutexGuard<'_, MailboxState>) {
    state.open = false;
    let waker = state.waker.take();
    drop(state);
    if let Some(waker) = waker {
        waker.wake();
    }
}

/// The mailbox's receiving side, owned by the activation's task. Dropping it closes the
/// mailbox and drops what is still queued (those callers see their reply channel close).
pub(crate) struct MailboxReceiver {
    mailbox: Arc<Mailbox>,
    /// Messages taken out of the queue together and not yet handed out, oldest first.
    batch: VecDeque<Envelope>,
    /// Messages handed out (published in `Mailbox::taken`).
    taken: u64,
}

impl MailboxReceiver {
    /// The next message; `None` once the mailbox is closed and empty. Spends a unit of
    /// tokio's cooperative budget per message, as tokio's channels do: a task that keeps
    /// finding messages yields after the budget (128), so senders on other workers cannot
    /// keep it from yielding (the simulator has no budget).
    pub(crate) fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<Envelope>> {
        self.poll_ready(cx).map(|ready| ready.then(|| self.take_ready()))
    }

    /// Whether a message is ready: `Ready(true)` when one is at the front of the batch,
    /// to be taken with [`MailboxReceiver::take_ready`]; `Ready(false)` once the mailbox
    /// is closed and empty. Spends tokio's cooperative budget as
    /// [`MailboxReceiver::poll_recv`] says.
    #[inline(always)]
    pub(crate) fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<bool> {
        #[cfg(not(madsim))]
        let coop = std::task::ready!(tokio::task::coop::poll_proceed(cx));
        if self.batch.is_empty() {
            // The batch's room beyond a full mailbox's goes back before it is swapped in
            // as the queue (see [`MAILBOX_SLOTS_KEPT`]).
            if self.batch.capacity() > MAILBOX_SLOTS_KEPT {
                shrink_after_burst(&mut self.batch);
            }
            let mut state = self.mailbox.state();
            if state.queue.is_empty() {
                if !state.open {
                    #[cfg(not(madsim))]
                    coop.made_progress();
                    return Poll::Ready(false);
                }
                if state.queue.capacity() > MAILBOX_SLOTS_KEPT {
                    shrink_after_burst(&mut state.queue);
                }
                // The waker is cloned only when it changed: a clone and its drop are an
                // atomic operation each on the task's reference count.
                if !state.waker.as_ref().is_some_and(|waker| waker.will_wake(cx.waker())) {
                    state.waker = Some(cx.waker().clone());
                }
                return Poll::Pending;
            }
            // All of it, one message or many: the queue's buffer goes with its messages
            // and the batch's (empty) one stays as the queue, so nothing is moved or
            // allocated here.
            std::mem::swap(&mut state.queue, &mut self.batch);
        }
        #[cfg(not(madsim))]
        coop.made_progress();
        Poll::Ready(true)
    }

    /// The message [`MailboxReceiver::poll_ready`] found, taken out of the batch where
    /// it lies.
    #[inline(always)]
    pub(crate) fn take_ready(&mut self) -> Envelope {
        let envelope = self.batch.pop_front().expect("poll_ready found a message");
        self.count_taken();
        envelope
    }

    /// Counts one message handed out, and publishes the count for the deliveries'
    /// bound. Release: a delivery that sees this count sees the slot free.
    #[inline(always)]
    fn count_taken(&mut self) {
        self.taken += 1;
        self.mailbox.taken.store(self.taken, Ordering::Release);
    }

    /// The next message; `None` once the mailbox is closed and empty.
    pub(crate) async fn recv(&mut self) -> Option<Envelope> {
        std::future::poll_fn(|cx| self.poll_recv(cx)).await
    }

    /// Gives back the queue's room beyond [`MAILBOX_SLOTS_KEPT_IDLE`] if it is empty:
    /// the activation calls it at its idle timer, so an actor that had a burst, then
    /// went quiet, holds one envelope's room, not the burst's.
    pub(crate) fn trim_idle(&mut self) {
        // The batch is empty between messages (the loop waited for one); the queue keeps
        // the idle room.
        if self.batch.is_empty() && self.batch.capacity() > 0 {
            self.batch = VecDeque::new();
        }
        let mut state = self.mailbox.state();
        if state.queue.is_empty() && state.queue.capacity() > MAILBOX_SLOTS_KEPT_IDLE {
            state.queue.shrink_to(MAILBOX_SLOTS_KEPT_IDLE);
        }
    }

    /// Closes the mailbox (the task failed to start): what is queued stays to be taken.
    pub(crate) fn close(&self) {
        self.mailbox.close();
    }

    /// Closes the mailbox and takes every message in it that was never handed out (the
    /// batch's, then the queue's, oldest first): for the crash notice of a task that
    /// ended without taking them, so that they go to the next activation. Cold: once
    /// per crash.
    #[cold]
    pub(crate) fn take_unrun(&mut self) -> Vec<Envelope> {
        let queued = {
            let mut state = self.mailbox.state();
            state.open = false;
            state.waker = None;
            std::mem::take(&mut state.queue)
        };
        std::mem::take(&mut self.batch).into_iter().chain(queued).collect()
    }

    /// The deadline of the oldest message not yet handed out, if there is one: what an
    /// activation's claim is tried again within (see `store_retry.rs`). Cold: only after
    /// a claim failed for a moment.
    #[cold]
    pub(crate) fn first_deadline(&self) -> Option<troupe_core::Deadline> {
        if let Some(envelope) = self.batch.front() {
            return Some(envelope.context.deadline());
        }
        self.mailbox
            .state()
            .queue
            .front()
            .map(|envelope| envelope.context.deadline())
    }

    /// The mailbox's sending side, for the task to close it from a turn's commit (the
    /// receiver itself is not `Sync`: its batch holds values that are only `Send`).
    pub(crate) fn mailbox(&self) -> &Mailbox {
        &self.mailbox
    }
}

impl Drop for MailboxReceiver {
    fn drop(&mut self) {
        let queued = {
            let mut state = self.mailbox.state();
            state.open = false;
            state.waker = None;
            std::mem::take(&mut state.queue)
        };
        // Dropped outside the lock, the batch's first (they came first): an envelope's
        // drop closes its reply channel, which wakes its caller.
        drop(std::mem::take(&mut self.batch));
        drop(queued);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use bytes::Bytes;
    use troupe_core::{CallContext, Deadline};

    use super::*;
    use crate::envelope::{EnvelopeSpan, Payload, ReplyTo};

    fn envelope(call: u64) -> Envelope {
        Envelope {
            payload: Payload::Bytes(Bytes::new()),
            context: CallContext::root(Deadline::from_micros(u64::MAX)).into(),
            reply: ReplyTo::Nobody,
            call,
            edge: false,
            span: EnvelopeSpan::new(tracing::Span::none()),
        }
    }

    fn delivered(delivery: Delivery) -> bool {
        matches!(delivery, Delivery::Delivered)
    }

    /// Goal: first in, first out; a full mailbox refuses with its capacity and gives the
    /// envelope back; the count counts deliveries (the initial messages included), and
    /// `close_if_delivered` closes only at the exact count.
    #[tokio::test]
    async fn fifo_bounded_and_counted() {
        let (mailbox, mut receiver) = Mailbox::open(3, [Box::new(envelope(0))].into_iter());
        assert!(delivered(mailbox.deliver(envelope(1))));
        assert!(delivered(mailbox.deliver(envelope(2))));
        match mailbox.deliver(envelope(3)) {
            Delivery::Full(back, capacity) => assert_eq!((back.call, capacity), (3, 3)),
            _ => panic!("a full mailbox took a message"),
        }
        assert_eq!(receiver.recv().await.unwrap().call, 0);
        assert!(delivered(mailbox.deliver(envelope(4))));
        for call in [1, 2, 4] {
            assert_eq!(receiver.recv().await.unwrap().call, call);
        }
        assert!(!mailbox.close_if_delivered(3), "4 were delivered, not 3");
        assert!(!mailbox.is_closed());
        assert!(mailbox.close_if_delivered(4));
        assert!(matches!(mailbox.deliver(envelope(5)), Delivery::Closed(back) if back.call == 5));
        assert!(receiver.recv().await.is_none());
    }

    /// Goal: messages the receiver took out together and has not handed out yet still
    /// count against the bound: a mailbox never holds more than its capacity, batch
    /// included, and each message handed out frees one place.
    #[tokio::test]
    async fn a_receiver_s_batch_counts_against_the_bound() {
        let (mailbox, mut receiver) = Mailbox::open(4, std::iter::empty());
        for call in 0..4 {
            assert!(delivered(mailbox.deliver(envelope(call))));
        }
        assert!(matches!(mailbox.deliver(envelope(4)), Delivery::Full(_, 4)));
        // The four are taken as one batch; the first is handed out.
        assert_eq!(receiver.recv().await.unwrap().call, 0);
        assert_eq!(receiver.batch.len(), 3);
        assert!(mailbox.state().queue.is_empty());
        assert!(delivered(mailbox.deliver(envelope(5))));
        assert!(
            matches!(mailbox.deliver(envelope(6)), Delivery::Full(_, 4)),
            "three in the batch and one queued fill a mailbox of four"
        );
        assert_eq!(receiver.recv().await.unwrap().call, 1);
        assert!(delivered(mailbox.deliver(envelope(7))));
        for call in [2, 3, 5, 7] {
            assert_eq!(receiver.recv().await.unwrap().call, call);
        }
        assert!(mailbox.close_if_delivered(6));
        assert!(receiver.recv().await.is_none());
    }

    /// Goal: a closed mailbox still hands over what it holds, then ends; a dropped
    /// receiver closes it and drops what was queued (their callers see the reply channel
    /// close).
    #[tokio::test]
    async fn closing_drains_and_a_dropped_receiver_drops_the_queue() {
        let (mailbox, mut receiver) = Mailbox::open(4, std::iter::empty());
        assert!(delivered(mailbox.deliver(envelope(1))));
        mailbox.close();
        assert!(matches!(mailbox.deliver(envelope(2)), Delivery::Closed(_)));
        assert_eq!(receiver.recv().await.unwrap().call, 1);
        assert!(receiver.recv().await.is_none());

        let (mailbox, receiver) = Mailbox::open(4, std::iter::empty());
        let (reply, waiting) = crate::reply_cell::channel();
        let mut queued = envelope(3);
        queued.reply = ReplyTo::Caller(reply);
        assert!(delivered(mailbox.deliver(queued)));
        drop(receiver);
        assert!(
            waiting.recv().await.is_err(),
            "the queued request's reply channel closed"
        );
        assert!(matches!(mailbox.deliver(envelope(4)), Delivery::Closed(_)));
    }

    /// Goal: a burst's room is given back once the queue empties, down to
    /// `MAILBOX_SLOTS_KEPT`.
    #[tokio::test]
    async fn a_burst_s_room_is_given_back() {
        let (mailbox, mut receiver) = Mailbox::open(1_000, std::iter::empty());
        for call in 0..1_000 {
            assert!(delivered(mailbox.deliver(envelope(call))));
        }
        for _ in 0..1_000 {
            receiver.recv().await.unwrap();
        }
        let waiting = tokio::time::timeout(Duration::from_millis(1), receiver.recv()).await;
        assert!(waiting.is_err(), "empty and open: the receiver waits");
        // The burst was taken as one batch, whose room went back once it had emptied.
        assert!(mailbox.state().queue.capacity() <= MAILBOX_SLOTS_KEPT);
        assert!(receiver.batch.capacity() <= MAILBOX_SLOTS_KEPT);
        // At the idle timer, down to one envelope's room; a queue that holds messages
        // keeps its room.
        receiver.trim_idle();
        assert!(mailbox.state().queue.capacity() <= MAILBOX_SLOTS_KEPT_IDLE);
        assert_eq!(receiver.batch.capacity(), 0);
        for call in 0..3 {
            assert!(delivered(mailbox.deliver(envelope(call))));
        }
        let room = mailbox.state().queue.capacity();
        assert!(room >= 3);
        receiver.trim_idle();
        assert_eq!(
            mailbox.state().queue.capacity(),
            room,
            "a queue with messages keeps its room"
        );
        for call in 0..3 {
            assert_eq!(receiver.recv().await.unwrap().call, call);
        }
    }

    /// Goal: a mailbox opened with its first message has room for exactly that one: an
    /// actor called by one caller at a time (the queue never holds two) never grows it.
    #[tokio::test]
    async fn a_mailbox_opened_with_one_message_keeps_room_for_one() {
        let (mailbox, mut receiver) = Mailbox::open(64, [Box::new(envelope(0))].into_iter());
        assert_eq!(mailbox.state().queue.capacity(), 1);
        for call in 1..100 {
            assert_eq!(receiver.recv().await.unwrap().call, call - 1);
            assert!(delivered(mailbox.deliver(envelope(call))));
            assert_eq!(mailbox.state().queue.capacity(), 1, "one at a time needs one slot");
        }
    }

    /// Goal: a mailbox opened with one message keeps it in the block of the box it came
    /// in (no allocation of its own), and that block serves as room for later messages:
    /// the queue and the batch trade buffers at each receipt, so every other message
    /// goes to it. Method: the envelope's address in its box, then in the queue; the
    /// messages delivered after the first alternate between that block and one other.
    #[tokio::test]
    async fn a_first_message_s_box_becomes_the_queue_s_room() {
        let first = Box::new(envelope(0));
        let at: *const Envelope = &*first;
        let (mailbox, mut receiver) = Mailbox::open(8, [first].into_iter());
        assert_eq!(mailbox.state().queue.as_slices().0.as_ptr(), at);
        assert_eq!(receiver.recv().await.unwrap().call, 0);
        assert!(delivered(mailbox.deliver(envelope(1))));
        let other = mailbox.state().queue.as_slices().0.as_ptr();
        assert_ne!(other, at, "the first block is the batch's now");
        for call in 1..10 {
            assert_eq!(receiver.recv().await.unwrap().call, call);
            assert!(delivered(mailbox.deliver(envelope(call + 1))));
            let expected = if call % 2 == 1 { at } else { other };
            assert_eq!(mailbox.state().queue.as_slices().0.as_ptr(), expected);
        }
    }

    fn mailbox_of(receiver: &MailboxReceiver) -> &Mailbox {
        &receiver.mailbox
    }

    /// Goal: on worker threads, messages from several senders all arrive, each sender's
    /// in its order, none twice, and a receiver that waits is always woken (a lost
    /// wake-up hangs the test until its timeout), and the receiver's batch and the queue
    /// together never exceed the bound. Method: 4 senders x 5,000 messages into
    /// a mailbox of 8 (so senders keep meeting a full one and retry), on 2 workers; then
    /// the count matches and the close-if-delivered handshake succeeds exactly then.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_senders_on_worker_threads_lose_nothing() {
        const SENDERS: u64 = 4;
        const EACH: u64 = 5_000;
        let (mailbox, mut receiver) = Mailbox::open(8, std::iter::empty());
        let full = Arc::new(AtomicUsize::new(0));
        let senders: Vec<_> = (0..SENDERS)
            .map(|sender| {
                let mailbox = Arc::clone(&mailbox);
                let full = Arc::clone(&full);
                tokio::spawn(async move {
                    for seq in 0..EACH {
                        let mut message = envelope(sender * EACH + seq);
                        loop {
                            match mailbox.deliver(message) {
                                Delivery::Delivered => break,
                                Delivery::Full(back, _) => {
                                    full.fetch_add(1, Ordering::Relaxed);
                                    message = *back;
                                    tokio::task::yield_now().await;
                                }
                                Delivery::Closed(_) => panic!("closed while sending"),
                            }
                        }
                    }
                })
            })
            .collect();
        let receiving = tokio::spawn(async move {
            let mut next = [0_u64; SENDERS as usize];
            for _ in 0..SENDERS * EACH {
                let call = receiver.recv().await.expect("open").call;
                // The receiver's batch counts against the bound: never more than 8
                // delivered and not yet handed out, whatever the senders do meanwhile.
                let held = receiver.batch.len() + mailbox_of(&receiver).state().queue.len();
                assert!(held <= 8, "{held} messages held by a mailbox of 8");
                let (sender, seq) = ((call / EACH) as usize, call % EACH);
                assert_eq!(seq, next[sender], "sender {sender}'s messages out of order");
                next[sender] += 1;
            }
            receiver
        });
        let mut receiver = tokio::time::timeout(Duration::from_secs(60), receiving)
            .await
            .expect("a waiting receiver was not woken")
            .unwrap();
        for sender in senders {
            sender.await.unwrap();
        }
        assert!(!mailbox.close_if_delivered(SENDERS * EACH - 1));
        assert!(mailbox.close_if_delivered(SENDERS * EACH));
        assert!(receiver.recv().await.is_none());
        assert!(full.load(Ordering::Relaxed) > 0, "the senders never met a full mailbox");
    }
}
