//! Absolute deadlines on the runtime's clock (monotonic, anchored on the wall clock).

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// An instant on the runtime's clock, in microseconds since the Unix epoch.
///
/// The runtime reads its clock from `tokio::time`, anchored on one reading of the wall
/// clock when the clock is made (`troupe_runtime::Clock`), so under madsim deadlines are
/// virtual time, and a deadline stored by one process means the same instant to another.
/// A deadline is absolute: a child call carries its parent's deadline or an earlier one,
/// never a fresh budget, so a chain of calls can never outlive its root. Clocks of two
/// nodes differ by their machines' skew: the transport translates a deadline to the
/// peer's clock through a bound on the offset measured at connection time, rounded so
/// the remote deadline is never later than the local one.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Deadline {
    at_us: u64,
}

impl Deadline {
    /// The instant `at_us` microseconds after the Unix epoch.
    pub const fn from_micros(at_us: u64) -> Self {
        Self { at_us }
    }

    /// Microseconds since the Unix epoch.
    pub const fn as_micros(self) -> u64 {
        self.at_us
    }

    /// The instant `elapsed` after the Unix epoch, in whole microseconds (rounded down),
    /// saturating at the end of time.
    #[inline]
    pub fn since_epoch(elapsed: Duration) -> Self {
        Self {
            at_us: whole_micros(elapsed),
        }
    }

    /// The instant `duration` after `now`, saturating at the end of time.
    #[inline]
    pub fn after(now: Deadline, duration: Duration) -> Self {
        Self {
            at_us: now.at_us.saturating_add(whole_micros(duration)),
        }
    }

    /// Time left from `now` until this deadline; zero once it has passed.
    pub fn remaining(self, now: Deadline) -> Duration {
        Duration::from_micros(self.at_us.saturating_sub(now.at_us))
    }

    /// The time left until this deadline at `now`, in whole milliseconds (rounded down);
    /// 0 once it has passed. What timeout errors report as `timeout_ms`.
    pub fn remaining_ms(self, now: Deadline) -> u64 {
        self.at_us.saturating_sub(now.at_us) / 1_000
    }

    /// Whether this deadline has passed at `now` (a deadline equal to `now` has passed).
    pub fn has_passed(self, now: Deadline) -> bool {
        self.at_us <= now.at_us
    }

    /// This deadline, or [`crate::limits::INVOKE_TIMEOUT_MS_MAX`] after `now` if that is
    /// earlier: the deadline of a root request made at `now` with a deadline its caller
    /// chose (one further away would let its turn, or a cluster node's search for the
    /// owner, run unbounded).
    #[inline]
    pub fn cut_to_longest_invoke(self, now: Deadline) -> Deadline {
        self.min(Deadline::after(
            now,
            Duration::from_millis(crate::limits::INVOKE_TIMEOUT_MS_MAX),
        ))
    }

    /// The earlier of two deadlines.
    pub fn min(self, other: Deadline) -> Deadline {
        if other.at_us < self.at_us {
            other
        } else {
            self
        }
    }
}

/// `duration` in whole microseconds, saturating at `u64::MAX`: the value of
/// `u64::try_from(duration.as_micros()).unwrap_or(u64::MAX)` in `u64` arithmetic, without
/// that `u128` product and conversion (every call reads the clock and makes a deadline:
/// 17 instructions of a round trip's 3,109, callgrind).
#[inline]
fn whole_micros(duration: Duration) -> u64 {
    duration
        .as_secs()
        .saturating_mul(1_000_000)
        .saturating_add(u64::from(duration.subsec_micros()))
}

impl fmt::Debug for Deadline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Deadline({}.{:06}s)", self.at_us / 1_000_000, self.at_us % 1_000_000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: the `u64` conversion gives what the `u128` one gave, at the edges: below a
    /// microsecond, at a whole second, the largest value that fits, one past it, and
    /// `Duration::MAX`.
    #[test]
    fn whole_micros_agrees_with_the_u128_conversion() {
        let fits = Duration::from_micros(u64::MAX);
        for duration in [
            Duration::ZERO,
            Duration::from_nanos(999),
            Duration::from_nanos(1_000),
            Duration::from_nanos(1_999_999_999),
            Duration::from_secs(1),
            Duration::new(18_446_744_073_709, 551_615_999),
            fits,
            fits + Duration::from_micros(1),
            Duration::new(u64::MAX / 1_000_000 + 1, 0),
            Duration::MAX,
        ] {
            let wide = u64::try_from(duration.as_micros()).unwrap_or(u64::MAX);
            assert_eq!(whole_micros(duration), wide, "{duration:?}");
            assert_eq!(Deadline::since_epoch(duration).as_micros(), wide, "{duration:?}");
        }
    }

    #[test]
    fn remaining_saturates_at_zero_and_passed_includes_equality() {
        let now = Deadline::from_micros(1_000);
        let deadline = Deadline::after(now, Duration::from_millis(2));
        assert_eq!(deadline.remaining(now), Duration::from_millis(2));
        assert_eq!(deadline.remaining(Deadline::from_micros(10_000)), Duration::ZERO);
        assert_eq!(deadline.remaining_ms(now), 2);
        assert_eq!(
            Deadline::from_micros(2_999).remaining_ms(Deadline::from_micros(0)),
            2,
            "rounded down"
        );
        assert_eq!(deadline.remaining_ms(Deadline::from_micros(10_000)), 0);
        assert_eq!(
            Deadline::from_micros(u64::MAX).remaining_ms(Deadline::from_micros(0)),
            u64::MAX / 1_000
        );
        assert!(deadline.has_passed(deadline));
        assert!(!deadline.has_passed(now));
        assert_eq!(Deadline::after(deadline, Duration::MAX).as_micros(), u64::MAX);
    }
}
