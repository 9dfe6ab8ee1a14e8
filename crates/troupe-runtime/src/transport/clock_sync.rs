//! [`ClockSync`]: what a client knows about its server's clock, from one handshake.
//!
//! Each runtime's [`Clock`](crate::Clock) counts from its own epoch (when the runtime
//! started), so a [`Deadline`] means nothing on another node until it is translated. A
//! handshake gives a bound: the client reads its clock (`sent`), the server reads its
//! own (`server_now`) when the hello arrives, the client reads its clock again when the
//! answer arrives (`received`). The server's reading happened somewhere inside
//! `[sent, received]` on the client's clock, so the offset `server - client` lies in
//! `[server_now - received, server_now - sent]`: an estimate
//! `server_now - (sent + rtt / 2)` within `rtt / 2` either way.
//!
//! A deadline is translated with the LOWER end of that interval, minus the rounding of
//! the two microsecond readings and a clock-rate drift allowance that grows with the
//! age of the sample, and minus the connection's return allowance (see
//! [`RoundTrips`](super::round_trips::RoundTrips), set by
//! [`ClockSync::with_return_allowance`]). The server therefore sees a deadline that is
//! never later than the caller's (a request can only get less time, never more), and
//! earlier by the time the handshake's answer took to come back (at most its round
//! trip), plus the allowances: the host answers early enough for its answer to travel
//! back.

use troupe_core::Deadline;

use super::{CLOCK_DRIFT_PPM_MAX, CLOCK_ROUNDING_US};

/// A bound on a server's clock relative to a client's, from one handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ClockSync {
    /// The smallest possible `server - client` offset, in microseconds.
    offset_min_us: i128,
    /// The width of the offset interval (the handshake's round trip), in microseconds.
    round_trip_us: u64,
    /// When the handshake's answer arrived, on the client's clock.
    received: Deadline,
    /// Taken off every translated deadline so the host's answer has time to travel
    /// back, in microseconds (0 until [`ClockSync::with_return_allowance`]).
    return_allowance_us: u64,
}

impl ClockSync {
    /// The bound given by a hello sent at `sent`, read by the server at `server_now` (on
    /// its clock), answered and received at `received` (on the client's clock).
    pub(crate) fn from_handshake(sent: Deadline, server_now: Deadline, received: Deadline) -> Self {
        // A clock never runs backwards; tolerate it anyway (the interval only widens).
        let received = received.max(sent);
        Self {
            offset_min_us: i128::from(server_now.as_micros()) - i128::from(received.as_micros()),
            round_trip_us: received.as_micros() - sent.as_micros(),
            received,
            return_allowance_us: 0,
        }
    }

    /// This bound, taking `return_allowance_us` off every translated deadline (in place
    /// of the allowance it took before).
    pub(crate) fn with_return_allowance(self, return_allowance_us: u64) -> Self {
        Self {
            return_allowance_us,
            ..self
        }
    }

    /// The time this deadline translation keeps for the host's answer to travel back,
    /// in microseconds.
    pub(crate) fn return_allowance_us(&self) -> u64 {
        self.return_allowance_us
    }

    /// The handshake's round trip, in microseconds.
    pub(crate) fn round_trip_us(&self) -> u64 {
        self.round_trip_us
    }

    /// The offset estimate `server - client` (the middle of the interval), in microseconds.
    pub(crate) fn offset_estimate_us(&self) -> i128 {
        self.offset_min_us + i128::from(self.round_trip_us / 2)
    }

    /// The estimate's error bound (half the round trip), in microseconds.
    pub(crate) fn error_bound_us(&self) -> u64 {
        self.round_trip_us.div_ceil(2)
    }

    /// How old this sample is at `now` (client clock).
    pub(crate) fn age_us(&self, now: Deadline) -> u64 {
        now.as_micros().saturating_sub(self.received.as_micros())
    }

    /// Whichever of `self` and `other` gives later (more generous, still conservative)
    /// translations at `now`: the larger offset lower bound once each sample's drift
    /// allowance is taken off.
    pub(crate) fn tighter(self, other: ClockSync, now: Deadline) -> ClockSync {
        if other.bound_at_us(now) > self.bound_at_us(now) {
            other
        } else {
            self
        }
    }

    /// The offset lower bound at `now`, drift allowance taken off, in microseconds.
    fn bound_at_us(&self, now: Deadline) -> i128 {
        self.offset_min_us - i128::from(self.drift_us(now))
    }

    /// The drift allowance at `now`: [`CLOCK_DRIFT_PPM_MAX`] of the sample's age.
    fn drift_us(&self, now: Deadline) -> u64 {
        self.age_us(now).saturating_mul(CLOCK_DRIFT_PPM_MAX).div_ceil(1_000_000)
    }

    /// `deadline` (client clock) on the server's clock, conservatively: never later than
    /// the true instant, assuming the two clocks' rates differ by at most
    /// [`CLOCK_DRIFT_PPM_MAX`] since the handshake, and earlier by the return allowance.
    /// `now` is the client's current time. Saturates at both ends of time; a deadline
    /// before the server's epoch becomes 0, which has passed there.
    pub(crate) fn server_deadline(&self, deadline: Deadline, now: Deadline) -> Deadline {
        if deadline.as_micros() == u64::MAX {
            // The end of time stays the end of time (the server caps it anyway).
            return deadline;
        }
        let at_us = i128::from(deadline.as_micros()) + self.bound_at_us(now)
            - i128::from(CLOCK_ROUNDING_US)
            - i128::from(self.return_allowance_us);
        Deadline::from_micros(u64::try_from(at_us.max(0)).unwrap_or(u64::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(us: u64) -> Deadline {
        Deadline::from_micros(us)
    }

    #[test]
    fn the_offset_is_bounded_by_the_round_trip_and_translation_is_conservative() {
        // The server's epoch is 5 s after the client's: server = client - 5_000_000.
        // Hello sent at client 10_000_000, one-way 3 ms out and 1 ms back: the server
        // reads 10_003_000 - 5_000_000 = 5_003_000; the ack arrives at 10_004_000.
        let sync = ClockSync::from_handshake(at(10_000_000), at(5_003_000), at(10_004_000));
        assert_eq!(sync.error_bound_us(), 2_000);
        let true_offset: i128 = -5_000_000;
        assert!((sync.offset_estimate_us() - true_offset).unsigned_abs() <= u128::from(sync.error_bound_us()));
        assert_eq!(sync.offset_estimate_us(), -4_999_000);

        // A deadline 100 ms after the handshake: truly at server 5_104_000; sent as
        // 4 ms (the asymmetric path) + rounding earlier.
        let deadline = at(10_104_000);
        let translated = sync.server_deadline(deadline, at(10_004_000));
        assert!(translated.as_micros() as i128 <= deadline.as_micros() as i128 + true_offset);
        assert_eq!(translated, at(5_104_000 - 1_000 - CLOCK_ROUNDING_US));
    }

    #[test]
    fn the_return_allowance_makes_the_hosts_deadline_earlier_by_exactly_that_much() {
        // As above: the server's clock 5 s behind, 3 ms out, 1 ms back.
        let sync = ClockSync::from_handshake(at(10_000_000), at(5_003_000), at(10_004_000));
        let (deadline, now) = (at(10_104_000), at(10_004_000));
        let without = sync.server_deadline(deadline, now);
        let with = sync.with_return_allowance(7_000).server_deadline(deadline, now);
        assert_eq!(without.as_micros() - with.as_micros(), 7_000);
        // The true instant on the server is 5_104_000: earlier by the return leg (1 ms),
        // the rounding and the allowance.
        assert_eq!(with, at(5_104_000 - 1_000 - CLOCK_ROUNDING_US - 7_000));
        // Setting it again replaces it; the end of time stays.
        let replaced = sync.with_return_allowance(7_000).with_return_allowance(2_000);
        assert_eq!(replaced.return_allowance_us(), 2_000);
        assert_eq!(replaced.server_deadline(at(u64::MAX), now), at(u64::MAX));
        // An allowance beyond the server's epoch: passed there, never wrapped.
        assert_eq!(
            sync.with_return_allowance(u64::MAX).server_deadline(deadline, now),
            at(0)
        );
    }

    #[test]
    fn a_deadline_before_the_servers_epoch_has_passed_there_and_the_end_of_time_stays() {
        let sync = ClockSync::from_handshake(at(10_000_000), at(1_000), at(10_002_000));
        assert_eq!(sync.server_deadline(at(9_000_000), at(10_002_000)), at(0));
        assert_eq!(sync.server_deadline(at(u64::MAX), at(10_002_000)), at(u64::MAX));
        // A server whose epoch is earlier than the client's: a positive offset.
        let sync = ClockSync::from_handshake(at(0), at(u64::MAX / 2), at(10));
        assert!(sync.server_deadline(at(u64::MAX - 1), at(10)).as_micros() == u64::MAX);
    }

    #[test]
    fn an_old_sample_gives_less_time_for_clock_drift() {
        let sync = ClockSync::from_handshake(at(0), at(500), at(1_000));
        let fresh = sync.server_deadline(at(2_000_000), at(1_000));
        let old = sync.server_deadline(at(2_000_000), at(1_000 + 1_000_000));
        assert_eq!(fresh.as_micros() - old.as_micros(), CLOCK_DRIFT_PPM_MAX);

        // A refresh with a wider round trip still wins once the old one has drifted enough.
        let now = at(1_000 + 1_000_000);
        let refreshed = ClockSync::from_handshake(at(1_000_000), at(1_000_300), at(1_001_000));
        assert_eq!(sync.tighter(refreshed, now), refreshed);
        assert_eq!(
            sync.tighter(refreshed, at(1_000)),
            sync,
            "a fresh narrow sample beats a wide one"
        );
    }
}
