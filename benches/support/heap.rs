//! A heap whose pages are already in memory, for the cold cases.
//!
//! A cold case keeps what it starts alive, so each new task or actor takes memory the
//! process has not used before, and the first touch of each 4 KiB page is a page fault
//! that the kernel serves by zeroing it. Measured on the 2-core machine (2026-12-03,
//! `benches/paired.rs`'s cold case, `/usr/bin/time -v`): the floor's servers, 2,088 B
//! each when idle, took 0.57 minor faults per spawn, and its spawn and first reply read
//! about 1,900 ns in fresh memory against 650–1,200 ns in memory touched before; Troupe's
//! activations, 1,261 B each, fault about half as often, so in fresh memory the ratio
//! read 1.3x–1.6x, in touched memory 1.9x–2.5x. Page faults are a matter of how much
//! memory each side keeps, which `benches/memory.rs` measures on its own; the cold rows
//! are about the work of starting, so they run in memory already touched.
//!
//! [`touch_heap`] allocates [`COLD_HEAP_BYTES`] in small blocks, writes them and frees
//! them, after telling glibc's allocator not to give freed memory back to the system
//! (`M_TRIM_THRESHOLD`), so that later small allocations reuse those pages. Elsewhere
//! than on glibc it only touches and frees the blocks (the allocator may return them).

/// Heap touched before the cold cases (bytes): more than the paired cold case keeps
/// alive on both sides together (11,000 floor servers and 11,000 activations, about
/// 40 MB), and than a criterion generation of floor servers (`COLD_LIVE_MAX` of them,
/// about 210 MB).
pub(crate) const COLD_HEAP_BYTES: usize = 512 << 20;

/// The size of the blocks the heap is touched in (bytes): small enough to come from the
/// heap itself, not from a mapping of their own, as a task's or an actor's allocations do.
const TOUCH_BLOCK_BYTES: usize = 1024;

/// Touches [`COLD_HEAP_BYTES`] of heap and keeps it for later allocations (see the
/// module's doc).
pub(crate) fn touch_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only sets one of glibc's allocator parameters; called before any
    // thread of the bench starts.
    unsafe {
        libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX);
    }
    let blocks: Vec<Box<[u8; TOUCH_BLOCK_BYTES]>> = (0..COLD_HEAP_BYTES / TOUCH_BLOCK_BYTES)
        .map(|index| Box::new([index as u8; TOUCH_BLOCK_BYTES]))
        .collect();
    drop(std::hint::black_box(blocks));
}
