//! [`RoundTrips`]: a connection's recent round trips, and the time it keeps for an
//! answer to travel back.
//!
//! A host ends its work by the deadline the request carries (its store retries stop
//! `STORE_RETRY_LEFT_MS_MIN` before it; a turn that ends at the deadline answers then),
//! and the answer still has to cross the network to a caller who stops waiting at its
//! own deadline. The clock translation ([`ClockSync`](super::clock_sync::ClockSync))
//! already makes the host's deadline earlier by the handshake's return leg, but one
//! sample of a jittery network is no bound on the next answer's trip: at the
//! simulator's default latency (1–10 ms a message) an answer slower than the handshake's
//! came after the caller had given up on 7 seeds in 200, and the call ended `Timeout`
//! instead of the host's answer.
//!
//! So the client also takes a return allowance off every request's deadline:
//! [`RETURN_ALLOWANCE_MS_MIN`] (the scheduling of the host's writer, the client's reader
//! and the caller's task, which no round trip shows: a loopback one takes microseconds)
//! plus how much the connection's last [`ROUND_TRIP_SAMPLES`] measured round trips (the
//! handshake's, then each clock refresh's, at most one a
//! [`CLOCK_RESYNC_INTERVAL_MS`](super::CLOCK_RESYNC_INTERVAL_MS) while calls are made)
//! differ, the largest minus the smallest; at most [`RETURN_ALLOWANCE_MS_MAX`] (one slow
//! sample, such as a hello held up by a stall, does not take more from every call). A
//! connection's first calls have one sample, no spread: the floor alone until the first
//! refresh, so a link that slows down right after its handshake is seen at that refresh.
//!
//! Why the spread and not the round trip itself: the translation already keeps one
//! return leg, so on a steady link (any latency) the answer's trip is covered and only
//! its jitter is not; an answer's trip exceeds the kept leg by at most how much one leg
//! varies, which shows as that much spread in the round trips. A whole round trip taken
//! off would cost a 100 ms link 200 ms of every call for nothing (the transport test
//! `a_short_first_deadline_does_not_stop_later_callers_from_connecting` has 20 ms to
//! spare there). A request's own round trip is not a sample: it includes the host's
//! work, which the client cannot tell from the network's time without a wire change.
//!
//! The allowance is kept up to date when a sample arrives, so a request pays for it with
//! one subtraction. It only ever shortens the host's deadline (a request never gets more
//! time than its caller), and it takes at most
//! [`RETURN_ALLOWANCE_SHARE_OF_LEFT_MAX_PERCENT`](super::RETURN_ALLOWANCE_SHARE_OF_LEFT_MAX_PERCENT)
//! of a request's time left: a short call is sent, its host given the rest.

use super::{RETURN_ALLOWANCE_MS_MAX, RETURN_ALLOWANCE_MS_MIN, ROUND_TRIP_SAMPLES};

/// A connection's last [`ROUND_TRIP_SAMPLES`] round trips and the return allowance they
/// give.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RoundTrips {
    /// The samples, in microseconds, oldest overwritten first; the first `len` are used.
    samples_us: [u64; ROUND_TRIP_SAMPLES],
    /// How many slots hold a sample.
    len: usize,
    /// Where the next sample goes.
    next: usize,
    /// The allowance the samples give (see [`RoundTrips::return_allowance_us`]).
    allowance_us: u64,
}

impl RoundTrips {
    /// The round trips of a connection whose handshake took `round_trip_us`.
    pub(crate) fn new(round_trip_us: u64) -> Self {
        let mut round_trips = Self {
            samples_us: [0; ROUND_TRIP_SAMPLES],
            len: 0,
            next: 0,
            allowance_us: RETURN_ALLOWANCE_MS_MIN * 1_000,
        };
        round_trips.record(round_trip_us);
        round_trips
    }

    /// Adds a measured round trip, forgetting the oldest of [`ROUND_TRIP_SAMPLES`].
    pub(crate) fn record(&mut self, round_trip_us: u64) {
        self.samples_us[self.next] = round_trip_us;
        self.next = (self.next + 1) % ROUND_TRIP_SAMPLES;
        self.len = (self.len + 1).min(ROUND_TRIP_SAMPLES);
        let samples = &self.samples_us[..self.len];
        let largest_us = samples.iter().copied().max().unwrap_or(0);
        let smallest_us = samples.iter().copied().min().unwrap_or(0);
        self.allowance_us =
            (RETURN_ALLOWANCE_MS_MIN * 1_000 + (largest_us - smallest_us)).min(RETURN_ALLOWANCE_MS_MAX * 1_000);
    }

    /// How much earlier than its caller's deadline (beyond the return leg the clock
    /// translation keeps) a request's host must answer for the answer to arrive in time,
    /// in microseconds: [`RETURN_ALLOWANCE_MS_MIN`] plus the spread of the recent round
    /// trips, at most [`RETURN_ALLOWANCE_MS_MAX`].
    pub(crate) fn return_allowance_us(&self) -> u64 {
        self.allowance_us
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_allowance_is_the_floor_plus_the_spread_of_the_recent_round_trips_up_to_the_ceiling() {
        let min_us = RETURN_ALLOWANCE_MS_MIN * 1_000;
        let max_us = RETURN_ALLOWANCE_MS_MAX * 1_000;
        // One sample, however slow (a steady 100 ms link): no spread, the floor.
        let mut round_trips = RoundTrips::new(200_000);
        assert_eq!(round_trips.return_allowance_us(), min_us);
        // A refresh 30 ms slower: the answer may be that much slower than the kept leg.
        round_trips.record(230_000);
        assert_eq!(round_trips.return_allowance_us(), min_us + 30_000);
        // A faster one widens the spread further while the slow one is recent.
        round_trips.record(195_000);
        assert_eq!(round_trips.return_allowance_us(), min_us + 35_000);
        // One held-up sample takes at most the ceiling.
        round_trips.record(4_000_000);
        assert_eq!(round_trips.return_allowance_us(), max_us);
        // Once ROUND_TRIP_SAMPLES steady samples followed, the others are forgotten.
        for _ in 0..ROUND_TRIP_SAMPLES - 1 {
            round_trips.record(200_000);
            assert_eq!(round_trips.return_allowance_us(), max_us, "still recent");
        }
        round_trips.record(200_000);
        assert_eq!(round_trips.return_allowance_us(), min_us);
        // Loopback: samples of tens of microseconds add as much to the floor.
        let mut loopback = RoundTrips::new(40);
        loopback.record(900);
        assert_eq!(loopback.return_allowance_us(), min_us + 860);
    }
}
