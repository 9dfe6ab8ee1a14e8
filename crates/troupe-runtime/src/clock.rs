//! The runtime's monotonic clock, read from `tokio::time` (virtual under madsim).

use std::time::Duration;

use troupe_core::Deadline;

/// Converts between [`Deadline`]s (microseconds since the clock's epoch) and
/// `tokio::time::Instant`s. Copy it freely; all copies share the epoch.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    epoch: tokio::time::Instant,
}

impl Clock {
    /// A clock whose epoch is now.
    pub fn new() -> Self {
        Self { epoch: tokio::time::Instant::now() }
    }

    /// The current time.
    pub fn now(&self) -> Deadline {
        let elapsed = tokio::time::Instant::now().saturating_duration_since(self.epoch);
        Deadline::from_micros(u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX))
    }

    /// The deadline `duration` from now.
    pub fn deadline_in(&self, duration: Duration) -> Deadline {
        Deadline::after(self.now(), duration)
    }

    /// The `tokio::time::Instant` of `deadline`, for `tokio::time::timeout_at`.
    pub fn instant(&self, deadline: Deadline) -> tokio::time::Instant {
        // Far-future deadlines are capped so the addition cannot overflow.
        const HORIZON_US: u64 = 100 * 365 * 24 * 3_600 * 1_000_000;
        self.epoch + Duration::from_micros(deadline.as_micros().min(HORIZON_US))
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}
