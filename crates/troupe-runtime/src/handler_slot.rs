//! An actor's handler future without a heap allocation per turn: one block of memory
//! per activation, reused by every turn whose future has the same layout (all of an
//! actor's turns do: `Actor::handle`'s future, or a typed actor's, is always the same
//! type). A block larger than its actor's `Actor::TURN_FUTURE_KEPT_BYTES_MAX` (by default
//! `HANDLER_SLOT_KEPT_BYTES_MAX`) is freed when its turn ends.
//!
//! ```text
//! turn 1: HandlerSlot::place_with(make) ─► allocates the block, writes the future in ─► InSlot
//! InSlot polled where it lies (the block never moves while a future lives in it)
//! InSlot dropped ─► the future is dropped in place; the block stays for turn 2
//! activation ends ─► the slot (in the `ActorBox`) frees the block
//! ```
//!
//! Why not a `Box` per turn: a boxed future is a `malloc` and a `free` per message,
//! about 127 instructions of a typed ask's 3,500 (callgrind, 2026-11-28). Why not a
//! crate's reusable box (`tokio_util::sync::ReusableBoxFuture`): it keeps one lifetime
//! for all its futures, and a turn's future borrows the actor and the turn, for that
//! turn only.
//!
//! The safety argument, in one place:
//! - A future is written into the block by [`HandlerSlot::place_with`], which borrows the
//!   slot mutably for as long as the returned [`InSlot`] lives: nothing else can place
//!   a future, move the block or free it meanwhile. So the future stays where it was
//!   written until it is dropped, which is what pinning it requires.
//! - [`InSlot`]'s drop drops the future in place and marks the slot free. An `InSlot`
//!   that is leaked (`mem::forget`) never drops its future; the slot then still reads
//!   occupied, and the next `place` or the slot's own drop leaves that block alone
//!   (leaked with it) rather than reuse or free memory that a pinned future still owns.
//! - A block is written only with a future of exactly the layout it was allocated for;
//!   a future of another layout gets a new block (the old one, unoccupied, is freed).
//! - The slot's table (`SlotVTable`: layout, poll, drop) is the one of the future
//!   placed last, set together with it; the block is freed with the table's layout,
//!   which changes only for a future of the same layout or after the old block was
//!   freed. An [`InSlot`] polls through the table's poll, cast back to the type it had:
//!   `place_with` returns `InSlot<'_, F::Output>` with `VTableOf::<F>`'s table, and the
//!   slot stays borrowed by it, so no other future's table can replace it meanwhile.
//!
//! Checked under Miri (2026-11-28; not in CI, which installs no nightly toolchain):
//! `cargo +nightly miri test -p troupe-runtime --lib handler_slot::tests::turns_reuse`
//! reports no undefined behaviour and no leak; the leak test passes with
//! `MIRIFLAGS=-Zmiri-ignore-leaks` (its leaked future and block are the point of it).

use std::alloc::{self, Layout};
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::ptr::NonNull;
use std::task::{Context, Poll};

/// Bytes of the largest handler future whose block a slot keeps for the next turn, unless
/// the actor says otherwise (`Actor::TURN_FUTURE_KEPT_BYTES_MAX`, whose default this
/// is). A larger future's block is freed when its turn ends: an idle activation holds at
/// most this much for its handler.
pub const HANDLER_SLOT_KEPT_BYTES_MAX: usize = 1024;

/// Memory for one handler future at a time, reused from turn to turn.
pub(crate) struct HandlerSlot {
    /// The block, once a future was placed (dangling and unallocated for a zero-sized
    /// future).
    block: Option<NonNull<u8>>,
    /// What the slot knows of the future placed last: its layout (the block's), and how
    /// to poll and drop it. One static per future type ([`VTableOf`]), so that an
    /// [`InSlot`] is a single pointer, to the slot (see [`InSlot`]).
    vtable: &'static SlotVTable,
    /// Whether a future lives in the block: set by `place`, cleared by its `InSlot`'s
    /// drop. Still set after an `InSlot` was leaked (see the module's safety argument).
    occupied: bool,
    /// The largest block kept when its turn ends, in bytes (set at each `place`; a
    /// `u32` so that it fits beside `occupied` without growing the slot).
    kept_max: u32,
}

// SAFETY: the slot owns plain memory; a future lives in it only while an `InSlot`
// borrows the slot, and only `Send` futures are placed.
unsafe impl Send for HandlerSlot {}

/// A future's layout and its poll and drop, with its type erased: what a slot needs to
/// run and end the future in its block.
struct SlotVTable {
    layout: Layout,
    /// `poll_in::<F>`, an `unsafe fn(NonNull<u8>, &mut Context<'_>) -> Poll<F::Output>`
    /// with its output type erased; only the `InSlot<'_, F::Output>` that `place_with`
    /// returned with this table calls it, as that type again.
    poll: unsafe fn(),
    /// `drop_in::<F>`.
    drop: unsafe fn(NonNull<u8>),
}

/// The [`SlotVTable`] of futures of type `F`.
struct VTableOf<F>(PhantomData<F>);

impl<F: Future> VTableOf<F> {
    const VTABLE: SlotVTable = SlotVTable {
        layout: Layout::new::<F>(),
        // SAFETY: a cast between function pointer types; see `SlotVTable::poll` for
        // where it is cast back.
        poll: unsafe {
            std::mem::transmute::<unsafe fn(NonNull<u8>, &mut Context<'_>) -> Poll<F::Output>, unsafe fn()>(
                poll_in::<F>,
            )
        },
        drop: drop_in::<F>,
    };
}

/// Polls the `F` in `block`.
///
/// # Safety
/// `block` holds a live `F` that stays where it is until it is dropped.
unsafe fn poll_in<F: Future>(block: NonNull<u8>, cx: &mut Context<'_>) -> Poll<F::Output> {
    // SAFETY: the caller's promise: a live `F`, pinned where it lies.
    unsafe { Pin::new_unchecked(block.cast::<F>().as_mut()) }.poll(cx)
}

/// Drops the `F` in `block`, in place.
///
/// # Safety
/// `block` holds a live `F`, dropped only here and only once.
unsafe fn drop_in<F>(block: NonNull<u8>) {
    // SAFETY: the caller's promise.
    unsafe { block.cast::<F>().as_ptr().drop_in_place() }
}

/// The table of an empty slot: a zero-sized layout, so nothing is ever freed with it.
/// (`Pending` is never placed, only named: no future is in a slot with this table.)
const EMPTY: &SlotVTable = &VTableOf::<std::future::Pending<()>>::VTABLE;

impl HandlerSlot {
    /// An empty slot: it allocates at its first `place`.
    pub(crate) const fn new() -> Self {
        Self {
            block: None,
            vtable: EMPTY,
            occupied: false,
            kept_max: 0,
        }
    }

    /// Moves `future` into the slot's block (allocated, or reallocated for another
    /// layout, only when needed) and returns it, to be polled where it lies. (The
    /// runtime places every turn with its actor's kept size: [`HandlerSlot::place_with`].)
    #[cfg(test)]
    pub(crate) fn place<'a, F>(&'a mut self, future: F) -> InSlot<'a, F::Output>
    where
        F: Future + Send + 'a,
    {
        self.place_with(HANDLER_SLOT_KEPT_BYTES_MAX, || future)
    }

    /// As `HandlerSlot::place` (tests only), with the future made by `make` once its block is
    /// ready, so that it can be written straight into the block rather than moved there,
    /// and its block kept after the turn if it is at most `kept_max` bytes.
    #[inline]
    pub(crate) fn place_with<'a, F>(&'a mut self, kept_max: usize, make: impl FnOnce() -> F) -> InSlot<'a, F::Output>
    where
        F: Future + Send + 'a,
    {
        self.kept_max = u32::try_from(kept_max).unwrap_or(u32::MAX);
        if self.occupied {
            // A leaked `InSlot`'s future still owns that block: leave it to it.
            self.block = None;
            self.occupied = false;
        }
        let vtable: &'static SlotVTable = &VTableOf::<F>::VTABLE;
        let layout = vtable.layout;
        let block = match self.block {
            Some(block) if self.vtable.layout == layout => block,
            _ => {
                // (Freed with the layout it was allocated with: the table is replaced
                // only below.)
                self.free();
                let block = if layout.size() == 0 {
                    NonNull::<F>::dangling().cast::<u8>()
                } else {
                    // SAFETY: the layout's size is not zero.
                    let memory = unsafe { alloc::alloc(layout) };
                    NonNull::new(memory).unwrap_or_else(|| alloc::handle_alloc_error(layout))
                };
                self.block = Some(block);
                block
            }
        };
        self.vtable = vtable;
        // SAFETY: the block is valid for writes of `layout`, which is `F`'s layout, and
        // holds no live value (not occupied).
        unsafe { block.cast::<F>().as_ptr().write(make()) };
        self.occupied = true;
        InSlot {
            slot: self,
            _output: PhantomData,
        }
    }

    /// Frees the block, if it is allocated and free.
    fn free(&mut self) {
        if let Some(block) = self.block.take() {
            if !self.occupied && self.vtable.layout.size() != 0 {
                // SAFETY: allocated with this layout by `place_with` (the table changes
                // only together with the block, or for a future of the same layout), and
                // no future lives in it.
                unsafe { alloc::dealloc(block.as_ptr(), self.vtable.layout) };
            }
        }
    }
}

impl Drop for HandlerSlot {
    fn drop(&mut self) {
        self.free();
    }
}

impl Default for HandlerSlot {
    fn default() -> Self {
        Self::new()
    }
}

/// A future living in a [`HandlerSlot`]'s block: polled in place, dropped in place.
///
/// One pointer, to the slot, which knows the block and the future's table: so a turn's
/// future comes back from the actor's vtable call in a register. (When it was the
/// future's own wide pointer and the slot's, 24 bytes, it came back through memory,
/// written as three words and read back at once as two halves of a 16-byte load, which
/// the processor cannot forward from the stores: perf, 2026-12-04; see "Thirtieth pass"
/// in docs/architecture.md.)
pub(crate) struct InSlot<'a, T> {
    /// The slot whose block holds the future, its table the future's, both unchanged for
    /// as long as this borrow lasts.
    slot: &'a mut HandlerSlot,
    _output: PhantomData<fn() -> T>,
}

// SAFETY: it owns a `Send` future (`place` takes only those) and borrows the slot, which
// is `Send`.
unsafe impl<T> Send for InSlot<'_, T> {}

impl<T> InSlot<'_, T> {
    /// The block of the slot's future.
    #[inline(always)]
    fn block(&self) -> NonNull<u8> {
        // SAFETY: `place_with` set the block before it made this `InSlot`, and nothing
        // takes it while this `InSlot` borrows the slot (only its own drop frees it).
        unsafe { self.slot.block.unwrap_unchecked() }
    }
}

impl<T> Future for InSlot<'_, T> {
    type Output = T;

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let this = self.get_mut();
        // SAFETY: the table is `VTableOf::<F>`'s for the future `F` that `place_with`
        // wrote into the block and that made this `InSlot<'_, F::Output>`, so `T` is
        // `F::Output` and this is `poll_in::<F>`'s own type. The future lives in the
        // block until this `InSlot` drops it, and the block does not move meanwhile (the
        // slot is borrowed by this `InSlot`).
        unsafe {
            let poll = std::mem::transmute::<unsafe fn(), unsafe fn(NonNull<u8>, &mut Context<'_>) -> Poll<T>>(
                this.slot.vtable.poll,
            );
            poll(this.block(), cx)
        }
    }
}

impl<T> Drop for InSlot<'_, T> {
    fn drop(&mut self) {
        // SAFETY: the future was written by `place_with` and is dropped only here, once.
        unsafe { (self.slot.vtable.drop)(self.block()) };
        self.slot.occupied = false;
        if self.slot.vtable.layout.size() > self.slot.kept_max as usize {
            self.slot.free();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use super::*;

    /// A future that is pending once, then ready with `value`, and counts its drops.
    struct Counted {
        value: u64,
        polls: u8,
        drops: Arc<AtomicUsize>,
        _padding: [u64; 4],
    }

    impl Future for Counted {
        type Output = u64;

        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<u64> {
            self.polls += 1;
            if self.polls == 1 {
                cx.waker().wake_by_ref();
                Poll::Pending
            } else {
                Poll::Ready(self.value)
            }
        }
    }

    impl Drop for Counted {
        fn drop(&mut self) {
            self.drops.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn counted(value: u64, drops: &Arc<AtomicUsize>) -> Counted {
        Counted {
            value,
            polls: 0,
            drops: Arc::clone(drops),
            _padding: [0; 4],
        }
    }

    /// Goal: futures placed one after another run to their outputs in the same block
    /// (no new allocation per turn), and each is dropped exactly once: when it ends,
    /// and also when it is dropped before it ends (a cancelled turn).
    #[tokio::test]
    async fn turns_reuse_one_block_and_each_future_drops_once() {
        let drops = Arc::new(AtomicUsize::new(0));
        let mut slot = HandlerSlot::new();
        let mut blocks = Vec::new();
        for value in 0..5 {
            let placed = slot.place(counted(value, &drops));
            assert_eq!(placed.await, value);
            blocks.push(slot.block);
        }
        assert_eq!(drops.load(Ordering::Relaxed), 5);
        assert!(blocks.windows(2).all(|pair| pair[0] == pair[1]), "{blocks:?}");

        let placed = slot.place(counted(9, &drops));
        drop(placed);
        assert_eq!(drops.load(Ordering::Relaxed), 6, "a future dropped unfinished drops");
        assert_eq!(slot.place(async { 7_u64 }).await, 7, "another layout gets its block");
        assert_eq!(slot.place(async {}).await, (), "a zero-sized future needs none");
        assert_eq!(slot.place(counted(3, &drops)).await, 3);
        assert_eq!(drops.load(Ordering::Relaxed), 7);
    }

    /// Two futures of one layout but of different types: `Ready<u64>` and a future
    /// that returns its own `u64` plus one.
    struct PlusOne(Option<u64>);

    impl Future for PlusOne {
        type Output = u64;

        fn poll(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<u64> {
            Poll::Ready(self.0.take().expect("polled once") + 1)
        }
    }

    /// Goal: a block reused by a future of another type but the same layout runs that
    /// future, through its own table (poll and drop), not the previous future's.
    #[tokio::test]
    async fn a_block_reused_by_another_type_of_the_same_layout_runs_that_type() {
        assert_eq!(
            Layout::new::<PlusOne>(),
            Layout::new::<std::future::Ready<u64>>(),
            "the test needs two types of one layout"
        );
        let mut slot = HandlerSlot::new();
        assert_eq!(slot.place(std::future::ready(5_u64)).await, 5);
        let block = slot.block;
        assert_eq!(slot.place(PlusOne(Some(5))).await, 6, "the second type's poll ran");
        assert_eq!(slot.block, block, "one layout, one block");
        assert_eq!(slot.place(std::future::ready(7_u64)).await, 7);
        assert_eq!(slot.block, block);
    }

    /// Goal: the kept size rides in the slot's padding, and the future's layout in its
    /// static table: a slot is 24 bytes of every idle activation. A future in the slot
    /// is one pointer, so that the actor's vtable call returns it in a register.
    #[test]
    fn a_slot_is_24_bytes_and_a_placed_future_one_pointer() {
        assert_eq!(std::mem::size_of::<HandlerSlot>(), 24);
        assert_eq!(
            std::mem::size_of::<InSlot<'_, [u64; 8]>>(),
            std::mem::size_of::<usize>()
        );
    }

    /// Goal: an actor's own kept size (`Actor::TURN_FUTURE_KEPT_BYTES_MAX`) decides:
    /// a future over the default but within it keeps its block from turn to turn (the
    /// same block), and one over it is freed when its turn ends.
    #[tokio::test]
    async fn a_future_within_its_actors_kept_size_keeps_its_block() {
        const KEPT: usize = 4 * HANDLER_SLOT_KEPT_BYTES_MAX;
        let mut slot = HandlerSlot::new();
        let large = [3_u8; 2 * HANDLER_SLOT_KEPT_BYTES_MAX];
        let mut blocks = Vec::new();
        for _ in 0..3 {
            let len = slot.place_with(KEPT, || async move { large.len() }).await;
            assert_eq!(len, 2 * HANDLER_SLOT_KEPT_BYTES_MAX);
            assert!(
                slot.block.is_some(),
                "a future within its actor's kept size keeps its block"
            );
            blocks.push(slot.block);
        }
        assert!(blocks.windows(2).all(|pair| pair[0] == pair[1]), "{blocks:?}");
        let larger = [3_u8; KEPT + 1];
        let len = slot.place_with(KEPT, || async move { larger.len() }).await;
        assert_eq!(len, KEPT + 1);
        assert!(slot.block.is_none(), "a future over its actor's kept size was kept");
    }

    /// Goal: a future larger than `HANDLER_SLOT_KEPT_BYTES_MAX` runs in a block that is
    /// freed when it ends (finished or dropped), so an idle activation does not hold it;
    /// one of exactly that size keeps its block for the next turn.
    #[tokio::test]
    async fn a_large_future_block_is_freed_when_its_turn_ends() {
        let mut slot = HandlerSlot::new();
        let large = [7_u8; HANDLER_SLOT_KEPT_BYTES_MAX + 1];
        let sum = slot
            .place(async move { large.iter().map(|&b| u64::from(b)).sum::<u64>() })
            .await;
        assert_eq!(sum, 7 * (HANDLER_SLOT_KEPT_BYTES_MAX as u64 + 1));
        assert!(slot.block.is_none(), "a large future's block was kept");
        drop(slot.place(async move { large.len() }));
        assert!(slot.block.is_none(), "a dropped large future's block was kept");

        // `Ready` holds an `Option` of its value: a one-byte tag beside the array.
        type AtTheLimit = std::future::Ready<[u8; HANDLER_SLOT_KEPT_BYTES_MAX - 1]>;
        assert_eq!(std::mem::size_of::<AtTheLimit>(), HANDLER_SLOT_KEPT_BYTES_MAX);
        let placed: AtTheLimit = std::future::ready([1_u8; HANDLER_SLOT_KEPT_BYTES_MAX - 1]);
        assert_eq!(slot.place(placed).await[0], 1);
        assert_eq!(
            (slot.block.is_some(), slot.vtable.layout.size()),
            (true, HANDLER_SLOT_KEPT_BYTES_MAX)
        );
    }

    /// Goal: a leaked `InSlot` keeps its block (its future never dropped, its memory
    /// never reused): the next future gets a new block and runs.
    #[tokio::test]
    async fn a_leaked_future_keeps_its_block() {
        let drops = Arc::new(AtomicUsize::new(0));
        let mut slot = HandlerSlot::new();
        assert_eq!(slot.place(counted(1, &drops)).await, 1);
        let first = slot.block;
        std::mem::forget(slot.place(counted(2, &drops)));
        assert_eq!(slot.place(counted(3, &drops)).await, 3);
        assert_ne!(slot.block, first, "the leaked future's block was reused");
        assert_eq!(drops.load(Ordering::Relaxed), 2, "the leaked future was never dropped");
    }
}
