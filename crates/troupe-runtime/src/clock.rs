//! The runtime's clock: monotonic, read from `tokio::time` (virtual under madsim), and
//! anchored on the wall clock once, when it is made, so its readings mean the same thing
//! in every process (a deadline stored by one runtime and read by another).

use std::time::Duration;

use troupe_core::Deadline;

/// Converts between [`Deadline`]s (microseconds since the Unix epoch, counted on this
/// process's monotonic clock from one reading of the wall clock) and
/// `tokio::time::Instant`s. Copy it freely; all copies share the anchor.
///
/// Why anchored on the wall clock: deadlines are stored (an inbox entry's, a delegated
/// task's due time, a retention's end) and read again by another runtime, after a
/// restart or by another node of a cluster. Until 2026-12-06 a clock counted from its
/// runtime's start, so a stored deadline read by a restarted runtime was late by the old
/// runtime's age, and read by an older node it was early
/// (`a_due_time_stored_before_a_restart_keeps_its_real_time`, simulated). Now two clocks
/// agree to the skew of their machines' wall clocks at their anchors (NTP keeps it to
/// milliseconds). Within a process the clock stays monotonic: the wall clock is read
/// once, when the clock is made, so a step of the wall clock later (NTP, an operator)
/// moves no deadline of a running runtime. Across the wire the transport still measures
/// the peers' offset at each connection (`transport`), so a remote call's deadline never
/// depends on the skew. Under madsim the wall clock is the simulator's (it replaces
/// `clock_gettime`), seeded like everything else: every node of a simulated world reads
/// one wall clock, and a restarted node goes on from it.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    epoch: tokio::time::Instant,
    // The wall clock at `epoch`, in whole microseconds since the Unix epoch.
    epoch_us: u64,
}

impl Clock {
    /// A clock whose anchor is now: the monotonic clock and the wall clock read together.
    pub fn new() -> Self {
        let epoch = tokio::time::Instant::now();
        Self::anchored(epoch, wall_clock_us())
    }

    /// A clock reading `epoch_us` microseconds (since the Unix epoch) at `epoch`: for
    /// tests that place a clock at a chosen time, as a restarted process would be.
    pub fn anchored(epoch: tokio::time::Instant, epoch_us: u64) -> Self {
        Self { epoch, epoch_us }
    }

    /// The current time.
    #[inline]
    pub fn now(&self) -> Deadline {
        Deadline::after(
            Deadline::from_micros(self.epoch_us),
            tokio::time::Instant::now().saturating_duration_since(self.epoch),
        )
    }

    /// The `tokio::time::Instant` of `deadline`, without reading the clock: for timers
    /// armed at an absolute instant (`tokio::time::sleep_until`).
    /// A deadline before the clock's anchor (stored by an earlier process) gives the
    /// anchor's instant or an earlier one: passed either way.
    pub fn instant_of(&self, deadline: Deadline) -> tokio::time::Instant {
        match deadline.as_micros().checked_sub(self.epoch_us) {
            Some(after) => self.epoch + Duration::from_micros(after),
            None => self.before_epoch(self.epoch_us - deadline.as_micros()),
        }
    }

    /// Whether `deadline` has passed now: as `deadline.has_passed(self.now())`, without
    /// turning the current instant into a [`Deadline`]. The clock's instant is compared
    /// with the deadline's instead, which spares the subtraction of two instants (about
    /// 50 instructions of a read's 100, callgrind). The same answer: a deadline of `d`
    /// microseconds has passed when the whole microseconds elapsed are at least `d`, that
    /// is when at least `d` microseconds have elapsed. A deadline past the clock's range
    /// never passes.
    pub(crate) fn has_passed(&self, deadline: Deadline) -> bool {
        match self.checked_instant_of(deadline) {
            Some(at) => tokio::time::Instant::now() >= at,
            None => false,
        }
    }

    /// The instant of `deadline`, or `None` past the clock's range (a deadline that
    /// never passes).
    fn checked_instant_of(&self, deadline: Deadline) -> Option<tokio::time::Instant> {
        match deadline.as_micros().checked_sub(self.epoch_us) {
            Some(after) => self.epoch.checked_add(Duration::from_micros(after)),
            None => Some(self.before_epoch(self.epoch_us - deadline.as_micros())),
        }
    }

    /// The instant `before_us` microseconds before the anchor, or the anchor itself if the
    /// monotonic clock does not reach that far back (it counts from the machine's boot):
    /// a time already passed either way.
    fn before_epoch(&self, before_us: u64) -> tokio::time::Instant {
        self.epoch
            .checked_sub(Duration::from_micros(before_us))
            .unwrap_or(self.epoch)
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

    /// Runs `future` until `deadline`, arming the deadline's timer only if `future` has
    /// to wait ([`Until`]); `Err(DeadlinePassed)` if the deadline passes first. Reads no
    /// clock: a future that finishes in its first poll costs no timer and no clock
    /// reading, even if the deadline has passed (as with [`Clock::run_until`], a ready
    /// future wins). With `None` (or a deadline past the clock's range) there is no
    /// deadline: the future runs to its end, in the same future type (a caller whose
    /// deadline is sometimes enforced elsewhere awaits one future either way).
    pub fn until<F: std::future::Future>(&self, deadline: impl Into<Option<Deadline>>, future: F) -> Until<F> {
        Until {
            future,
            at: deadline.into().and_then(|deadline| self.checked_instant_of(deadline)),
            timer: None,
        }
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

pin_project_lite::pin_project! {
    /// A future run until a deadline, whose timer is made only if the future has to
    /// wait: what [`Clock::until`] returns.
    ///
    /// Unlike `tokio::time::timeout` (what [`Clock::run_until`] uses), making it reads no
    /// clock (the deadline is an instant already) and builds no timer, so a future that
    /// finishes in its first poll (an agent turn whose model answers at once) never has
    /// one. Once the future returns `Pending`, the timer is made at the deadline's instant
    /// and polled after the future in every poll: the wait ends at the deadline as with
    /// `timeout`, and a future ready in the poll in which the timer fires still wins.
    #[must_use = "futures do nothing unless polled"]
    pub struct Until<F> {
        #[pin]
        future: F,
        // The deadline's instant; `None` past the clock's range (a deadline that never
        // passes: no timer).
        at: Option<tokio::time::Instant>,
        #[pin]
        timer: Option<tokio::time::Sleep>,
    }
}

/// The deadline of a [`Clock::until`] passed before its future finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the deadline passed")]
pub struct DeadlinePassed;

impl<F: std::future::Future> std::future::Future for Until<F> {
    type Output = Result<F::Output, DeadlinePassed>;

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        use std::task::Poll;
        let mut this = self.project();
        if let Poll::Ready(output) = this.future.poll(cx) {
            return Poll::Ready(Ok(output));
        }
        let Some(at) = *this.at else {
            return Poll::Pending;
        };
        if this.timer.is_none() {
            this.timer.set(Some(tokio::time::sleep_until(at)));
        }
        let timer = this.timer.as_pin_mut().expect("made just above");
        // As tokio's `timeout` does: a future that used up the task's cooperative budget
        // must not keep its deadline from firing, so the timer is then polled outside it.
        #[cfg(not(madsim))]
        if !coop_budget_left() {
            return std::pin::pin!(tokio::task::unconstrained(timer))
                .poll(cx)
                .map(|()| Err(DeadlinePassed));
        }
        timer.poll(cx).map(|()| Err(DeadlinePassed))
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

/// The wall clock, in whole microseconds since the Unix epoch (0 for a clock set before
/// it). The only read of the wall clock in library code (`tests/determinism_guard.rs`
/// allows this file and no other): once per [`Clock`], and under madsim the simulator's
/// wall clock, which it seeds (it replaces `clock_gettime`), so seed replay holds
/// (`crates/troupe-runtime/tests/clock_anchor.rs`).
fn wall_clock_us() -> u64 {
    #[allow(clippy::disallowed_methods)]
    let now = std::time::SystemTime::now();
    now.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| Deadline::since_epoch(since).as_micros())
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: `Clock::until` answers as `tokio::time::timeout` at the deadline would: a
    /// future ready in its first poll wins even past its deadline, one that waits past
    /// the deadline fails exactly at it, one that finishes before it succeeds, and with
    /// no deadline the future runs to its end. Method: paused time (virtual under
    /// madsim), times compared exactly but for the timer wheel's millisecond.
    #[tokio::test(start_paused = true)]
    async fn until_fails_at_the_deadline_only_a_future_that_waits_past_it() {
        let clock = Clock::new();
        tokio::time::sleep(Duration::from_millis(10)).await;
        let passed = clock.now();
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(clock.until(passed, async { 7 }).await, Ok(7), "a ready future wins");

        let deadline = clock.deadline_in(Duration::from_millis(100));
        let waited = clock.until(deadline, std::future::pending::<()>()).await;
        assert_eq!(waited, Err(DeadlinePassed));
        // At the deadline: not before it, and within the timer wheel's millisecond (the
        // deadline is whole microseconds from the clock's epoch, the timer an instant).
        let late = clock.now().as_micros().checked_sub(deadline.as_micros());
        assert!(
            late.is_some_and(|late| late < 1_000),
            "it fails at the deadline, {late:?} µs after it"
        );

        let started = tokio::time::Instant::now();
        let deadline = clock.deadline_in(Duration::from_millis(100));
        let slept = clock
            .until(deadline, tokio::time::sleep(Duration::from_millis(60)))
            .await;
        assert_eq!(slept, Ok(()));
        let about = |elapsed: Duration, expected: Duration| {
            elapsed >= expected && elapsed - expected < Duration::from_millis(1)
        };
        assert!(
            about(started.elapsed(), Duration::from_millis(60)),
            "{:?}",
            started.elapsed()
        );

        let started = tokio::time::Instant::now();
        let long = Duration::from_secs(60);
        assert_eq!(clock.until(None, tokio::time::sleep(long)).await, Ok(()));
        assert!(
            about(started.elapsed(), long),
            "no deadline: the future runs to its end"
        );
        let never = Deadline::from_micros(u64::MAX);
        assert_eq!(clock.until(never, tokio::time::sleep(long)).await, Ok(()));
    }

    /// Goal: the deadline fires on the multi-thread runtime, where the timer is polled
    /// from whichever worker runs the task. Method: real time, a 50 ms deadline on a
    /// future that never finishes, bounded by a 10 s outer timeout.
    #[cfg(not(madsim))]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn until_fails_at_the_deadline_on_the_multi_thread_runtime() {
        let clock = Clock::new();
        let started = tokio::time::Instant::now();
        let waited = tokio::time::timeout(
            Duration::from_secs(10),
            clock.until(
                clock.deadline_in(Duration::from_millis(50)),
                std::future::pending::<()>(),
            ),
        )
        .await;
        assert_eq!(waited, Ok(Err(DeadlinePassed)));
        assert!(started.elapsed() >= Duration::from_millis(50));
    }

    /// Goal: a future that spends the task's whole cooperative budget in every poll does
    /// not keep its deadline from firing (the timer is polled outside the budget, as
    /// tokio's `timeout` does; without that the timer is refused at every poll and never
    /// registered). Method: a loop of `consume_budget` under a 50 ms deadline, bounded by
    /// a 10 s outer timeout. Tokio's budget only: the simulator has none.
    #[cfg(not(madsim))]
    #[tokio::test]
    async fn until_fires_for_a_future_that_spends_the_whole_budget() {
        let clock = Clock::new();
        let busy = async {
            loop {
                tokio::task::consume_budget().await;
            }
        };
        let waited = tokio::time::timeout(
            Duration::from_secs(10),
            clock.until(clock.deadline_in(Duration::from_millis(50)), busy),
        )
        .await;
        assert_eq!(waited, Ok(Err(DeadlinePassed)));
    }

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
