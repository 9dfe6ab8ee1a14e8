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
        Self {
            epoch: tokio::time::Instant::now(),
        }
    }

    /// The current time.
    pub fn now(&self) -> Deadline {
        let elapsed = tokio::time::Instant::now().saturating_duration_since(self.epoch);
        Deadline::from_micros(u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX))
    }

    /// The `tokio::time::Instant` of `deadline`, without reading the clock: for timers
    /// armed at an absolute instant (`tokio::time::sleep_until`).
    pub fn instant_of(&self, deadline: Deadline) -> tokio::time::Instant {
        self.epoch + Duration::from_micros(deadline.as_micros())
    }

    /// The deadline `duration` from now.
    pub fn deadline_in(&self, duration: Duration) -> Deadline {
        Deadline::after(self.now(), duration)
    }

    /// Runs `future` until `deadline`; `Err` if the deadline passes first (at once if it
    /// already has).
    ///
    /// # Errors
    /// [`tokio::time::error::Elapsed`] when the deadline passes first.
    pub async fn run_until<F: std::future::Future>(
        &self,
        deadline: Deadline,
        future: F,
    ) -> Result<F::Output, tokio::time::error::Elapsed> {
        // madsim's tokio has no `timeout_at`; a relative timeout from the same clock
        // reading is equivalent.
        self.run_until_from(self.now(), deadline, future).await
    }

    /// As [`Clock::run_until`], with the current time already read as `now`.
    ///
    /// # Errors
    /// [`tokio::time::error::Elapsed`] when the deadline passes first.
    pub async fn run_until_from<F: std::future::Future>(
        &self,
        now: Deadline,
        deadline: Deadline,
        future: F,
    ) -> Result<F::Output, tokio::time::error::Elapsed> {
        tokio::time::timeout(deadline.remaining(now), future).await
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}
