//! The node's lease as the node sees it: until when it may trust it, and whether it is
//! lost; and the keep-alive task that renews it.
//!
//! ```text
//! every interval: sent = now ── keep-alive ──► etcd ── ttl ──►  valid_until = sent + ttl − slack
//!               an error, a closed stream  →  reopen the stream, again within the request timeout
//!               no answer within the request timeout  →  a new round on a new stream at once
//!               etcd says the lease is gone (ttl ≤ 0, NotFound)  →  lost: ExpiredOnServer
//!               now ≥ valid_until (mid-round too)                 →  lost: NotRenewedInTime
//!               lost, whoever found it  →  no more keep-alives (the round in flight is
//!                                          dropped); revoke, within one request timeout
//! ```
//!
//! The interval is TTL/3, or less so that a renewal is sent while one request timeout
//! and `ETCD_RENEWAL_HEADROOM_MS` of validity are left (`EtcdConfig::keep_alive_interval`).
//!
//! The server expires the lease no earlier than `ttl − slack` after it received the
//! renewal, which is after `sent`; so while `now < valid_until` the lease is alive on
//! the server (clocks are assumed to run at the same rate). Once lost, a lease is never
//! trusted again: the node must join anew.
//!
//! A write under the lease starts only if it ends, one request timeout later, before
//! `valid_until`. When the last confirmed renewal leaves less than that while the lease
//! is still valid (the next renewal is late: a loaded node, a slow etcd), the write
//! waits for the renewal ([`LeaseStanding::wait_for_write`]) rather than being refused,
//! at most until `valid_until`, where the lease is lost if no renewal came.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use etcd_client::{LeaseClient, LeaseKeepAliveStream, LeaseKeeper};
use tokio::sync::Notify;
use tokio::time::Instant;
use troupe_runtime::Latch;

use crate::config::{ETCD_LEASE_EXPIRY_SLACK_MS, ETCD_RETRY_PAUSE_MS};
use crate::error::LeaseLostReason;

/// The lease's standing, shared by the placement handles and the keep-alive task.
#[derive(Debug)]
pub(crate) struct LeaseStanding {
    valid_until: Mutex<Instant>,
    lost: Latch<LeaseLostReason>,
    /// Woken whenever a confirmed renewal moves `valid_until` on.
    renewals: Notify,
}

impl LeaseStanding {
    pub(crate) fn new(valid_until: Instant) -> Self {
        Self {
            valid_until: Mutex::new(valid_until),
            lost: Latch::new(),
            renewals: Notify::new(),
        }
    }

    fn valid_until_guard(&self) -> MutexGuard<'_, Instant> {
        self.valid_until.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Until when the lease is known to be alive on the server.
    pub(crate) fn valid_until(&self) -> Instant {
        *self.valid_until_guard()
    }

    /// Why the lease is lost, if it is.
    pub(crate) fn lost(&self) -> Option<LeaseLostReason> {
        self.lost.get()
    }

    /// Records a renewal confirmed by the server; never moves the bound back. Wakes
    /// every write waiting for a renewal ([`LeaseStanding::wait_for_write`]).
    pub(crate) fn renewed(&self, valid_until: Instant) {
        let moved = {
            let mut current = self.valid_until_guard();
            let moved = valid_until > *current;
            if moved {
                *current = valid_until;
            }
            moved
        };
        if moved {
            self.renewals.notify_waiters();
        }
    }

    /// Waits until a write of at most `request` may start under the lease: until a
    /// request started now ends before `valid_until`. Returns at once if it may; else
    /// (the last confirmed renewal leaves less than one request, the next one is late)
    /// waits for a confirmed renewal that leaves enough, at most until `valid_until`,
    /// where the lease is lost ([`LeaseLostReason::NotRenewedInTime`]). The wait is
    /// thus shorter than `request` itself: the time the caller budgets for one request
    /// to etcd. No lock is held across it.
    ///
    /// Safety: the wait changes nothing the node believes. `valid_until` moves on only
    /// when the keep-alive task records a renewal the server confirmed (`sent + ttl −
    /// slack`, no later than the server can expire the lease); the wait sends nothing
    /// and writes nothing; after it the same check as before any wait decides, so a
    /// write still starts only if it ends before `valid_until`. A node whose renewal
    /// never lands stops at `valid_until` exactly as it would without the wait: the
    /// waiting write is refused there and the lease is marked lost, and a lost lease
    /// is never trusted again.
    ///
    /// Returns whether the write had to wait.
    ///
    /// # Errors
    /// Why the lease is lost, if it is or becomes lost before a write may start.
    pub(crate) async fn wait_for_write(&self, request: Duration) -> Result<bool, LeaseLostReason> {
        let mut waited = false;
        loop {
            // Created before `valid_until` is read: `notify_waiters` wakes every
            // `Notified` created before it, polled or not, so a renewal recorded
            // between the read and the wait below still wakes this one.
            let renewed = self.renewals.notified();
            if let Some(reason) = self.lost() {
                return Err(reason);
            }
            let now = tokio::time::Instant::now();
            let valid_until = self.valid_until();
            if now >= valid_until {
                self.lose(LeaseLostReason::NotRenewedInTime);
                return Err(self.lost().unwrap_or(LeaseLostReason::NotRenewedInTime));
            }
            if now + request <= valid_until {
                return Ok(waited);
            }
            waited = true;
            tracing::debug!(
                left_ms = (valid_until - now).as_millis(),
                request_ms = request.as_millis(),
                "the lease's renewal is late; a write waits for it"
            );
            // Biased: an unbiased select! draws its first branch from tokio's
            // thread-local generator, which outlives a simulated run
            // (tests/determinism_guard.rs). Every branch leads to the checks above.
            tokio::select! {
                biased;
                _reason = self.wait_lost() => {}
                () = renewed => {}
                () = tokio::time::sleep_until(valid_until) => {}
            }
        }
    }

    /// Marks the lease lost (the first reason wins) and wakes every waiter.
    pub(crate) fn lose(&self, reason: LeaseLostReason) {
        if self.lost.set(reason.clone()) {
            tracing::warn!(?reason, "etcd lease lost");
        }
    }

    /// Waits until the lease is lost, and says why.
    pub(crate) async fn wait_lost(&self) -> LeaseLostReason {
        self.lost.wait().await
    }
}

/// What one renewal found.
enum Renewal {
    /// The server renewed the lease for this many seconds.
    Renewed(i64),
    /// The server says the lease does not exist.
    Gone,
    /// No answer, or the stream broke: try again on a new stream.
    Failed,
}

/// Until when a lease that etcd said, at `sent` or later, has `ttl_s` seconds left may
/// be trusted: `sent + ttl − slack`, the TTL taken as at most `granted_ttl_s` (what the
/// grant gave, itself at most what the node asked for). The answer is the server's; a
/// TTL beyond the grant (or near `i64::MAX`, past any instant) is never trusted, and a
/// TTL of zero or less trusts nothing beyond `sent`.
pub(crate) fn trusted_until(sent: Instant, ttl_s: i64, granted_ttl_s: i64) -> Instant {
    let ttl = Duration::from_secs(ttl_s.min(granted_ttl_s).max(0).unsigned_abs());
    let slack = Duration::from_millis(ETCD_LEASE_EXPIRY_SLACK_MS);
    sent + ttl.saturating_sub(slack)
}

/// Renews `lease` until it is lost, then revokes it; runs as a task of its own,
/// aborted when the placement is dropped (the lease then ends by its TTL, as a crashed
/// node's does).
///
/// Once the lease is lost, whoever found it (this task at `valid_until`, a write that
/// waited for a late renewal, a request etcd answered "not found"), the task sends no
/// more keep-alives at once: the round in flight is dropped with its stream and no new
/// one is opened. A renewal answered after the loss would otherwise be recorded and
/// the task would go on renewing a lease the node no longer trusts, so etcd kept it,
/// and the node's actors unplaceable by any other node, for as long as the node ran.
/// Then it revokes the lease ([`revoke_lost`]) unless etcd already said it is gone.
pub(crate) async fn keep_alive(
    standing: Arc<LeaseStanding>,
    mut client: LeaseClient,
    lease: i64,
    granted_ttl_s: i64,
    interval: Duration,
    request_timeout: Duration,
) {
    let reason = renew_until_lost(&standing, &mut client, lease, granted_ttl_s, interval, request_timeout).await;
    match reason {
        // Gone on etcd already; or leaving, which revokes it itself.
        LeaseLostReason::ExpiredOnServer | LeaseLostReason::Left => {}
        LeaseLostReason::NotRenewedInTime => revoke_lost(&mut client, lease, request_timeout).await,
    }
}

/// Marks the lease lost for `reason` and answers why it is lost (the first reason wins).
fn lose_now(standing: &LeaseStanding, reason: LeaseLostReason) -> LeaseLostReason {
    standing.lose(reason.clone());
    standing.lost().unwrap_or(reason)
}

/// The keep-alive rounds, until the lease is lost; answers why. Every wait of it also
/// ends when the lease is lost elsewhere or its validity ends, so that no keep-alive is
/// sent, and no answer recorded, after the node stopped trusting the lease.
async fn renew_until_lost(
    standing: &LeaseStanding,
    client: &mut LeaseClient,
    lease: i64,
    granted_ttl_s: i64,
    interval: Duration,
    request_timeout: Duration,
) -> LeaseLostReason {
    let mut stream: Option<(LeaseKeeper, LeaseKeepAliveStream)> = None;
    loop {
        let sent = tokio::time::Instant::now();
        // Only this task moves `valid_until` on, so it stays put during the round.
        let valid_until = standing.valid_until();
        // A failed renewal (a dead endpoint, a broken stream) is tried again on a new
        // stream within the request timeout: with one etcd member down, a stream opened
        // on it fails and the next one may reach a live member.
        let renew_until_answered = async {
            loop {
                match renew(client, lease, granted_ttl_s, &mut stream).await {
                    Renewal::Failed => {
                        stream = None;
                        tokio::time::sleep(Duration::from_millis(ETCD_RETRY_PAUSE_MS)).await;
                    }
                    answered => return answered,
                }
            }
        };
        // Biased (tests/determinism_guard.rs): a loss found elsewhere wins; an answer
        // ready together with the validity's end still counts (it was sent before).
        let renewal = tokio::select! {
            biased;
            reason = standing.wait_lost() => return reason,
            renewal = tokio::time::timeout(request_timeout, renew_until_answered) => {
                renewal.unwrap_or(Renewal::Failed)
            }
            () = tokio::time::sleep_until(valid_until) => {
                return lose_now(standing, LeaseLostReason::NotRenewedInTime);
            }
        };
        // After a renewed round the next comes one interval after this one was sent;
        // after a failed one, at once (after the retry pause): waiting for the interval
        // left a 3 s lease with 500 ms requests no second try before its validity ended.
        let next = match renewal {
            Renewal::Renewed(ttl_s) if ttl_s > 0 => {
                if let Some(reason) = standing.lost() {
                    // Lost while the answer was on its way: never trusted again.
                    return reason;
                }
                standing.renewed(trusted_until(sent, ttl_s, granted_ttl_s));
                sent + interval
            }
            Renewal::Renewed(_) | Renewal::Gone => return lose_now(standing, LeaseLostReason::ExpiredOnServer),
            Renewal::Failed => {
                tracing::debug!(lease, "etcd lease renewal failed; retrying on a new stream");
                stream = None;
                tokio::time::Instant::now() + Duration::from_millis(ETCD_RETRY_PAUSE_MS)
            }
        };
        let valid_until = standing.valid_until();
        if tokio::time::Instant::now() >= valid_until {
            return lose_now(standing, LeaseLostReason::NotRenewedInTime);
        }
        tokio::select! {
            biased;
            reason = standing.wait_lost() => return reason,
            () = tokio::time::sleep_until(next.min(valid_until)) => {}
        }
        if tokio::time::Instant::now() >= standing.valid_until() {
            // The next renewal may still succeed, but the bound has passed: from here on
            // the server may have expired the lease.
            return lose_now(standing, LeaseLostReason::NotRenewedInTime);
        }
    }
}

/// Revokes a lease the node found lost, best effort, within one request timeout, so
/// that etcd deletes its membership record and every placement under it now and other
/// nodes may place its actors at once, instead of one TTL after the last keep-alive
/// etcd received (with etcd's answers lost or late but the node's requests getting
/// through, that is up to a TTL after the node stopped trusting the lease, time in
/// which nobody serves those actors).
///
/// Safe: the node stopped using the lease before this runs. Every write under it
/// starts only while the lease is not lost and ends before `valid_until`
/// ([`LeaseStanding::wait_for_write`]), a bound computed conservatively (from the send
/// time of the last renewal etcd confirmed, minus `ETCD_LEASE_EXPIRY_SLACK_MS`), no
/// later than etcd could expire it anyway; the runtime stops serving on `lease_lost`,
/// and a commit racing that is refused by the store once another node claimed the actor
/// with the newer fence its placement carries, exactly as after an expiry. A write
/// still in flight reaching etcd after the revoke finds the lease gone and is refused.
/// A revoke that fails (etcd unreachable both ways, or the request timeout passes)
/// changes nothing: the lease ends by its TTL, as before. A rejoin
/// (`EtcdPlacement::rejoin_unless_in_use`) aborts this task and revokes the lease
/// again itself (a second revoke is "not found"), then takes a new lease.
async fn revoke_lost(client: &mut LeaseClient, lease: i64, request_timeout: Duration) {
    let revoke = async {
        loop {
            match client.revoke(lease).await {
                Ok(_) => return "revoked",
                Err(error) if crate::etcd_placement::says_lease_gone(&error) => return "gone already",
                Err(error) => {
                    tracing::debug!(%error, lease = format_args!("{lease:x}"), "revoking the lost lease failed; trying again");
                    tokio::time::sleep(Duration::from_millis(ETCD_RETRY_PAUSE_MS)).await;
                }
            }
        }
    };
    match tokio::time::timeout(request_timeout, revoke).await {
        Ok(outcome) => tracing::info!(
            lease = format_args!("{lease:x}"),
            outcome,
            "the lost etcd lease is revoked"
        ),
        Err(_elapsed) => tracing::info!(
            lease = format_args!("{lease:x}"),
            timeout_ms = request_timeout.as_millis(),
            "no answer to the lost etcd lease's revoke in time; it ends by its TTL if the revoke did not reach etcd"
        ),
    }
}

async fn renew(
    client: &mut LeaseClient,
    lease: i64,
    granted_ttl_s: i64,
    stream: &mut Option<(LeaseKeeper, LeaseKeepAliveStream)>,
) -> Renewal {
    let Some((keeper, responses)) = stream else {
        // Opening the stream sends one keep-alive and reads its answer (the real client
        // and the simulator alike); the real client refuses a lease the server reports
        // gone, so an error here is either that or a failed connection.
        return match client.keep_alive(lease).await {
            Ok(opened) => {
                *stream = Some(opened);
                Renewal::Renewed(granted_ttl_s)
            }
            Err(error) if crate::etcd_placement::says_lease_gone(&error) => Renewal::Gone,
            Err(_) => Renewal::Failed,
        };
    };
    if keeper.keep_alive().await.is_err() {
        return Renewal::Failed;
    }
    match responses.message().await {
        Ok(Some(response)) => Renewal::Renewed(response.ttl()),
        Ok(None) => Renewal::Failed,
        Err(error) if crate::etcd_placement::says_lease_gone(&error) => Renewal::Gone,
        Err(_) => Renewal::Failed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_ttl_past_the_grant_is_trusted_only_as_far_as_the_grant() {
        let sent = tokio::time::Instant::now();
        let slack = Duration::from_millis(ETCD_LEASE_EXPIRY_SLACK_MS);
        let granted = sent + Duration::from_secs(10) - slack;
        // Within the grant: as etcd says.
        assert_eq!(trusted_until(sent, 6, 10), sent + Duration::from_secs(6) - slack);
        assert_eq!(trusted_until(sent, 10, 10), granted);
        // Beyond it, up to the largest TTL etcd's answer can carry: the grant's (this
        // overflowed the instant and panicked the keep-alive task for i64::MAX).
        for ttl_s in [11, 1_000_000, i64::MAX / 2, i64::MAX] {
            assert_eq!(trusted_until(sent, ttl_s, 10), granted, "{ttl_s}");
        }
        // Nothing left: trusted no later than sent.
        for ttl_s in [0, -1, i64::MIN] {
            assert_eq!(trusted_until(sent, ttl_s, 10), sent, "{ttl_s}");
        }
    }

    /// Writers that meet a lease with less than one request of validity left.
    const WAITING_WRITERS: usize = 16;
    /// The request time the writers ask for, in milliseconds.
    const WRITE_REQUEST_MS: u64 = 500;
    /// Validity left when the writers start, in milliseconds: less than one request.
    const VALIDITY_LEFT_MS: u64 = 300;
    /// When the renewal lands, after the writers started, in milliseconds.
    const RENEWAL_AFTER_MS: u64 = 100;

    /// Spawns the writers; each answers what its wait returned and when.
    fn writers(
        standing: &Arc<LeaseStanding>,
    ) -> Vec<tokio::task::JoinHandle<(Result<bool, LeaseLostReason>, Instant)>> {
        (0..WAITING_WRITERS)
            .map(|_| {
                let standing = Arc::clone(standing);
                tokio::spawn(async move {
                    let result = standing.wait_for_write(Duration::from_millis(WRITE_REQUEST_MS)).await;
                    (result, tokio::time::Instant::now())
                })
            })
            .collect()
    }

    /// Goal: writers on threads of their own that find less than one request of
    /// validity wait for the renewal and start once it lands, none earlier (no writer
    /// starts on the old validity) and none missed (each wakes, however its check and
    /// the renewal interleave: a missed wake-up would sleep until the old validity's
    /// end). Method: 16 writers, 300 ms of validity, 500 ms requests; a renewal 100 ms
    /// later records 10 s; every writer gets `Ok` after the renewal was recorded and
    /// before the old validity ended, and the lease is not lost.
    #[cfg_attr(not(madsim), tokio::test(flavor = "multi_thread", worker_threads = 2))]
    #[cfg_attr(madsim, tokio::test)]
    async fn writers_waiting_for_a_late_renewal_all_start_once_it_lands_and_none_before() {
        let started = tokio::time::Instant::now();
        let standing = Arc::new(LeaseStanding::new(started + Duration::from_millis(VALIDITY_LEFT_MS)));
        let writers = writers(&standing);
        tokio::time::sleep(Duration::from_millis(RENEWAL_AFTER_MS)).await;
        let renewed_at = tokio::time::Instant::now();
        standing.renewed(renewed_at + Duration::from_secs(10));
        for writer in writers {
            let (result, at) = writer.await.expect("the writer");
            assert_eq!(result, Ok(true), "the writer waited");
            assert!(at >= renewed_at, "a writer started before the renewal");
            assert!(
                at < started + Duration::from_millis(VALIDITY_LEFT_MS),
                "a writer missed the renewal and slept until the old validity's end"
            );
        }
        assert_eq!(standing.lost(), None);
    }

    /// Goal: a writer waiting for a renewal that never comes is refused at the end of
    /// the lease's validity, not before and not much later, and the lease is lost from
    /// then on. Method: 16 writers, 300 ms of validity, 500 ms requests, no renewal;
    /// every writer gets `NotRenewedInTime` at or after the validity's end, and within
    /// one request of it (real time on a busy machine); a renewal recorded afterwards
    /// does not bring the lease back.
    #[cfg_attr(not(madsim), tokio::test(flavor = "multi_thread", worker_threads = 2))]
    #[cfg_attr(madsim, tokio::test)]
    async fn writers_waiting_for_a_renewal_that_never_comes_are_refused_at_the_leases_end() {
        let started = tokio::time::Instant::now();
        let valid_until = started + Duration::from_millis(VALIDITY_LEFT_MS);
        let standing = Arc::new(LeaseStanding::new(valid_until));
        for writer in writers(&standing) {
            let (result, now) = writer.await.expect("the writer");
            assert_eq!(result, Err(LeaseLostReason::NotRenewedInTime));
            assert!(
                now >= valid_until,
                "refused {:?} before the lease's end",
                valid_until - now
            );
            assert!(
                now - valid_until < Duration::from_millis(WRITE_REQUEST_MS),
                "refused {:?} after the lease's end",
                now - valid_until
            );
        }
        assert_eq!(standing.lost(), Some(LeaseLostReason::NotRenewedInTime));
        standing.renewed(tokio::time::Instant::now() + Duration::from_secs(10));
        let late = standing.wait_for_write(Duration::from_millis(WRITE_REQUEST_MS)).await;
        assert_eq!(late, Err(LeaseLostReason::NotRenewedInTime), "a lost lease stays lost");
    }

    /// Goal: a writer waiting for a renewal learns at once that the lease was lost
    /// (etcd said it is gone), without waiting for the validity's end. Method: 300 ms
    /// of validity, 500 ms requests; the lease is lost `ExpiredOnServer` 100 ms in;
    /// every writer is refused with that reason before the validity ends.
    #[cfg_attr(not(madsim), tokio::test(flavor = "multi_thread", worker_threads = 2))]
    #[cfg_attr(madsim, tokio::test)]
    async fn writers_waiting_for_a_renewal_are_refused_as_soon_as_the_lease_is_lost() {
        let started = tokio::time::Instant::now();
        let valid_until = started + Duration::from_millis(VALIDITY_LEFT_MS);
        let standing = Arc::new(LeaseStanding::new(valid_until));
        let writers = writers(&standing);
        tokio::time::sleep(Duration::from_millis(RENEWAL_AFTER_MS)).await;
        standing.lose(LeaseLostReason::ExpiredOnServer);
        for writer in writers {
            let (result, at) = writer.await.expect("the writer");
            assert_eq!(result, Err(LeaseLostReason::ExpiredOnServer));
            assert!(at < valid_until, "a writer waited for the lease's end");
        }
    }

    /// Goal: with more than a request's worth of validity left, a writer starts at
    /// once. Method: 100 ms more validity than one request; the wait ends well within
    /// those 100 ms, not at the validity's end.
    #[tokio::test]
    async fn a_writer_with_a_request_of_validity_left_starts_at_once() {
        let started = tokio::time::Instant::now();
        let standing = LeaseStanding::new(started + Duration::from_millis(WRITE_REQUEST_MS + RENEWAL_AFTER_MS));
        assert_eq!(
            standing.wait_for_write(Duration::from_millis(WRITE_REQUEST_MS)).await,
            Ok(false),
            "no wait"
        );
        assert!(
            started.elapsed() < Duration::from_millis(RENEWAL_AFTER_MS),
            "the writer waited"
        );
    }
}
