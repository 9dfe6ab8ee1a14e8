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
    #[inline]
    pub fn now(&self) -> Deadline {
        Deadline::since_epoch(tokio::time::Instant::now().saturating_duration_since(self.epoch))
    }

    /// The `tokio::time::Instant` of `deadline`, without reading the clock: for timers
    /// armed at an absolute instant (`tokio::time::sleep_until`).
    pub fn instant_of(&self, deadline: Deadline) -> tokio::time::Instant {
        self.epoch + Duration::from_micros(deadline.as_micros())
    }

    /// Whether `deadline` has passed now: as `deadline.has_passed(self.now())`, without
    /// turning the current instant into a [`Deadline`]. The clock's instant is compared
    /// with the deadline's instead, which spares the subtraction of two instants (about
    /// 50 instructions of a read's 100, callgrind). The same answer: a deadline of `d`
    /// microseconds has passed when the whole microseconds elapsed are at least `d`, that
    /// is when at least `d` microseconds have elapsed. A deadline past the clock's range
    /// never passes.
    pub(crate) fn has_passed(&self, deadline: Deadline) -> bool {
        match self.epoch.checked_add(Duration::from_micros(deadline.as_micros())) {
            Some(at) => tokio::time::Instant::now() >= at,
            None => false,
        }
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
    ///
    /// The clock is read here, when the future is made, not when it is first polled.
    /// Not an `async fn`: that would move `future` into a state of its own, and again
    /// into the timer's, a copy of its whole size each (callgrind, 2026-11-30: the
    /// agent's model loop, run under one timer, paid 900 instructions a `call_agent`
    /// round trip in such copies).
    #[inline]
    pub fn run_until<F: std::future::Future>(
        &self,
        deadline: Deadline,
        future: F,
    ) -> impl std::future::Future<Output = Result<F::Output, tokio::time::error::Elapsed>> {
        // madsim's tokio has no `timeout_at`; a relative timeout from the same clock
        // reading is equivalent.
        self.run_until_from(self.now(), deadline, future)
    }

    /// As [`Clock::run_until`], with the current time already read as `now`.
    ///
    /// # Errors
    /// [`tokio::time::error::Elapsed`] when the deadline passes first.
    #[inline]
    pub fn run_until_from<F: std::future::Future>(
        &self,
        now: Deadline,
        deadline: Deadline,
        future: F,
    ) -> impl std::future::Future<Output = Result<F::Output, tokio::time::error::Elapsed>> {
        tokio::time::timeout(deadline.remaining(now), future)
    }
}

/// Whether tokio's cooperative budget lets the current task's next resource poll through
/// (a refused poll returns `Pending` without registering the task's waker). The
/// simulator has no such budget: always `true` there.
#[inline]
pub(crate) fn coop_budget_left() -> bool {
    #[cfg(not(madsim))]
    let left = tokio::task::coop::has_budget_remaining();
    #[cfg(madsim)]
    let left = true;
    left
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: `Clock::has_passed` answers exactly as `Deadline::has_passed` on a reading of
    /// the clock, at the boundary (a deadline equal to now has passed, one a microsecond
    /// later has not), between whole microseconds, and for a deadline past the clock's
    /// range. Method: paused time, moved by sleeps of odd lengths; the clock does not move
    /// between the two readings.
    #[tokio::test(start_paused = true)]
    async fn has_passed_agrees_with_a_reading_of_the_clock() {
        let clock = Clock::new();
        for step in [0, 1, 999, 1_000, 1_234_567] {
            tokio::time::sleep(Duration::from_nanos(step)).await;
            let now = clock.now();
            let at = now.as_micros();
            for deadline in [0, at.saturating_sub(1), at, at + 1, at + 1_000, u64::MAX] {
                let deadline = Deadline::from_micros(deadline);
                assert_eq!(
                    clock.has_passed(deadline),
                    deadline.has_passed(now),
                    "deadline {deadline:?} at {now:?}"
                );
            }
        }
    }
}
