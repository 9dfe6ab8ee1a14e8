//! The runtime's clock is anchored on the wall clock (`clock.rs`): a reading is
//! microseconds since the Unix epoch, so a deadline stored by one process means the same
//! instant to the next one (a restart) or to another node. Tests may read the wall clock;
//! under madsim it is the simulator's, so these also show the anchor is virtual there.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use troupe_core::Deadline;
use troupe_runtime::{Clock, DeadlinePassed};

// The wall clock is what these tests compare the runtime's clock with.
#[allow(clippy::disallowed_methods)]
fn wall_us() -> u64 {
    let since = SystemTime::now().duration_since(UNIX_EPOCH).expect("after 1970");
    u64::try_from(since.as_micros()).expect("fits")
}

/// Goal: a clock made now reads the wall clock (not zero, as a clock counting from its
/// runtime's start did until 2026-12-06). Method: the wall clock read just before and
/// just after the clock is made and read; the reading lies between them, but for the
/// whole microseconds each read drops (1 µs each side).
#[tokio::test]
async fn a_clock_reads_the_wall_clock_when_it_is_made() {
    let before = wall_us();
    let clock = Clock::new();
    let read = clock.now().as_micros();
    let after = wall_us();
    assert!(
        before.saturating_sub(1) <= read && read <= after + 1,
        "read {read} µs, the wall clock {before}..={after}"
    );
}

/// Goal: two clocks made apart read the same time, as a process and the one restarted
/// after it must (a stored deadline then means the same instant to both). Under madsim
/// the second clock is made 500 virtual seconds later (the DST sweep stops a seed at
/// 600) and the two agree to the microsecond the anchors' truncation allows; with real
/// time they are made 50 ms apart and agree within 20 ms (each is made from two reads,
/// monotonic then wall, which a loaded machine can separate).
#[tokio::test]
async fn two_clocks_made_apart_read_the_same_time() {
    let first = Clock::new();
    let apart = if cfg!(madsim) {
        Duration::from_secs(500)
    } else {
        Duration::from_millis(50)
    };
    tokio::time::sleep(apart).await;
    let second = Clock::new();
    let (a, b) = (first.now().as_micros(), second.now().as_micros());
    let tolerance_us = if cfg!(madsim) { 1 } else { 20_000 };
    assert!(
        a.abs_diff(b) <= tolerance_us,
        "first {a} µs, second {b} µs: {} µs apart",
        a.abs_diff(b)
    );
}

/// Goal: a deadline from before a clock's anchor (stored by an earlier process, or by an
/// older version whose clock counted from zero) has passed for it: waiting for it ends at
/// once, with the deadline's error, and its instant is not in the future. Method: one
/// hour before the clock's reading, and zero.
#[tokio::test]
async fn a_deadline_before_the_anchor_has_passed() {
    let clock = Clock::new();
    let hour_ago = Deadline::from_micros(clock.now().as_micros() - 3_600_000_000);
    for earlier in [hour_ago, Deadline::from_micros(0)] {
        assert!(earlier.has_passed(clock.now()), "{earlier:?}");
        assert!(clock.instant_of(earlier) <= tokio::time::Instant::now(), "{earlier:?}");
        let waited = tokio::time::timeout(
            Duration::from_secs(10),
            clock.until(earlier, std::future::pending::<()>()),
        )
        .await;
        assert_eq!(waited, Ok(Err(DeadlinePassed)), "{earlier:?}");
    }
}
