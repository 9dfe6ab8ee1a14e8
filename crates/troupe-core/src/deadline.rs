//! Absolute deadlines on the runtime's monotonic clock.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// An instant on the runtime's monotonic clock, in microseconds since the clock's epoch.
///
/// The runtime reads its clock from `tokio::time`, so under madsim deadlines are virtual
/// time. A deadline is absolute: a child call carries its parent's deadline or an earlier
/// one, never a fresh budget, so a chain of calls can never outlive its root. Clocks of
/// two nodes have different epochs: the transport translates a deadline to the peer's
/// clock through a bound on the offset measured at connection time, rounded so the
/// remote deadline is never later than the local one.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Deadline {
    at_us: u64,
}

impl Deadline {
    /// The instant `at_us` microseconds after the clock's epoch.
    pub const fn from_micros(at_us: u64) -> Self {
        Self { at_us }
    }

    /// Microseconds since the clock's epoch.
    pub const fn as_micros(self) -> u64 {
        self.at_us
    }

    /// The instant `duration` after `now`, saturating at the end of time.
    pub fn after(now: Deadline, duration: Duration) -> Self {
        let micros = u64::try_from(duration.as_micros()).unwrap_or(u64::MAX);
        Self {
            at_us: now.at_us.saturating_add(micros),
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

    /// The earlier of two deadlines.
    pub fn min(self, other: Deadline) -> Deadline {
        if other.at_us < self.at_us {
            other
        } else {
            self
        }
    }
}

impl fmt::Debug for Deadline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Deadline({}.{:06}s)", self.at_us / 1_000_000, self.at_us % 1_000_000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
