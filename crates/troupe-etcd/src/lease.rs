//! The node's lease as the node sees it: until when it may trust it, and whether it is
//! lost; and the keep-alive task that renews it.
//!
//! ```text
//! every TTL/3:  sent = now ── keep-alive ──► etcd ── ttl ──►  valid_until = sent + ttl − slack
//!               an error, a closed stream  →  reopen the stream, again within the request timeout
//!               no answer within the request timeout  →  reopen the stream next round
//!               etcd says the lease is gone (ttl ≤ 0, NotFound)  →  lost: ExpiredOnServer
//!               now ≥ valid_until                                 →  lost: NotRenewedInTime
//! ```
//!
//! The server expires the lease no earlier than `ttl − slack` after it received the
//! renewal, which is after `sent`; so while `now < valid_until` the lease is alive on
//! the server (clocks are assumed to run at the same rate). Once lost, a lease is never
//! trusted again: the node must join anew.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use etcd_client::{LeaseClient, LeaseKeepAliveStream, LeaseKeeper};
use tokio::time::Instant;
use troupe_runtime::Latch;

use crate::config::{ETCD_LEASE_EXPIRY_SLACK_MS, ETCD_RETRY_PAUSE_MS};
use crate::error::LeaseLostReason;

/// The lease's standing, shared by the placement handles and the keep-alive task.
#[derive(Debug)]
pub(crate) struct LeaseStanding {
    valid_until: Mutex<Instant>,
    lost: Latch<LeaseLostReason>,
}

impl LeaseStanding {
    pub(crate) fn new(valid_until: Instant) -> Self {
        Self {
            valid_until: Mutex::new(valid_until),
            lost: Latch::new(),
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

    /// Records a renewal confirmed by the server; never moves the bound back.
    fn renewed(&self, valid_until: Instant) {
        let mut current = self.valid_until_guard();
        if valid_until > *current {
            *current = valid_until;
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

/// Renews `lease` until it is lost; runs as a task of its own, aborted when the
/// placement is dropped.
pub(crate) async fn keep_alive(
    standing: Arc<LeaseStanding>,
    mut client: LeaseClient,
    lease: i64,
    granted_ttl_s: i64,
    interval: Duration,
    request_timeout: Duration,
) {
    let mut stream: Option<(LeaseKeeper, LeaseKeepAliveStream)> = None;
    loop {
        let sent = tokio::time::Instant::now();
        // A failed renewal (a dead endpoint, a broken stream) is tried again on a new
        // stream within the request timeout: with one etcd member down, a stream opened
        // on it fails and the next one may reach a live member.
        let renew_until_answered = async {
            loop {
                match renew(&mut client, lease, granted_ttl_s, &mut stream).await {
                    Renewal::Failed => {
                        stream = None;
                        tokio::time::sleep(Duration::from_millis(ETCD_RETRY_PAUSE_MS)).await;
                    }
                    answered => return answered,
                }
            }
        };
        let renewal = match tokio::time::timeout(request_timeout, renew_until_answered).await {
            Ok(renewal) => renewal,
            Err(_elapsed) => Renewal::Failed,
        };
        match renewal {
            Renewal::Renewed(ttl_s) if ttl_s > 0 => {
                standing.renewed(trusted_until(sent, ttl_s, granted_ttl_s));
            }
            Renewal::Renewed(_) | Renewal::Gone => {
                standing.lose(LeaseLostReason::ExpiredOnServer);
                return;
            }
            Renewal::Failed => {
                tracing::debug!(lease, "etcd lease renewal failed; retrying on a new stream");
                stream = None;
            }
        }
        let valid_until = standing.valid_until();
        if tokio::time::Instant::now() >= valid_until {
            standing.lose(LeaseLostReason::NotRenewedInTime);
            return;
        }
        tokio::time::sleep_until((sent + interval).min(valid_until)).await;
        if tokio::time::Instant::now() >= standing.valid_until() && standing.lost().is_none() {
            // The next renewal may still succeed, but the bound has passed: from here on
            // the server may have expired the lease.
            standing.lose(LeaseLostReason::NotRenewedInTime);
            return;
        }
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
}
