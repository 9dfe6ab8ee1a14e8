//! Trying a store operation again after the store failed for a moment
//! ([`StoreError::Unavailable`]: a connection refused or closed, a server restarting, a
//! file locked by another process): the claim that starts an activation (it loads the
//! actor's state too: `StateStore::claim` returns it), the commit that ends a turn, the
//! save at deactivation, and the reads inside a turn (`Turn::get`, `Turn::scan`,
//! `Turn::check_fence`); and, through [`crate::RuntimeHandle::retry_store`], the store
//! operations of code outside any turn that serve a request (an API's reads of a
//! conversation, a server's own records such as its A2A tasks). Only the store operation
//! is repeated, never the turn, and only on the failure's branch: an operation that
//! succeeds at once costs nothing more.
//!
//! ```text
//! try ──ok──► done
//!  │ Unavailable (any other error: returned at once)
//!  ▼
//! runtime aborted, mailbox closed (claim, commit), or under STORE_RETRY_LEFT_MS_MIN of
//!  │ the deadline left?                      yes → the last error
//!  ▼ no
//! pause: STORE_RETRY_PAUSE_MS_FIRST, doubling up to STORE_RETRY_PAUSE_MS_MAX, and at
//!  │     most half of what is left of the deadline
//!  ▼
//! try again (RuntimeCounters::store_retries + 1) ──► as from the top
//! ```
//!
//! Deadlines: for a claim, the oldest queued request's; for a commit or a read inside a
//! turn, the turn's request's (a told message's turn: its own); for the save at
//! deactivation, which serves no request, [`STORE_RETRY_DEACTIVATION_MS_MAX`] from its
//! first failure; for an operation outside a turn, the deadline its caller gives
//! (`retry_store`'s: the request it serves, or a bound named by the caller where it
//! serves none). No try starts after the deadline, and a pause never reaches it. A
//! try in flight is not cut: it ends by the store's own timeouts, as the first try does
//! (a commit already inside the store when the caller gives up completes, see
//! `activation.rs`). The tries stop before the next one when the runtime is aborted
//! (dropped, or its shutdown grace over; the abort also ends a pause at once: the
//! activation's task is dropped at its next `.await`, so a save being tried again never
//! stretches a shutdown past its grace) or, for a claim or a commit, when the
//! activation's mailbox is closed (a shutdown, a deactivation ordered from outside): a
//! closed mailbox is seen within one pause, at most [`STORE_RETRY_PAUSE_MS_MAX`]. The
//! save at deactivation and a turn's reads do not look at the mailbox: the save runs
//! because it is closed, and a turn runs to its end once started, as it does when no
//! read fails. An operation outside a turn has no mailbox either: it stops at its
//! deadline, or before its next try once the runtime is aborted (its pause is not cut:
//! it is not an activation's task, so the abort is seen within one pause, at most
//! [`STORE_RETRY_PAUSE_MS_MAX`]). A graceful shutdown does not stop it: the request it
//! serves is still being answered.
//!
//! What may be tried again is the caller's to judge, as for the runtime's own: a read
//! (it changes nothing); a claim (one the store applied unseen costs only a fence, the
//! next claim issues a newer one); a commit only when the same commit, under the same
//! fence, with the same absolute writes, is made again (one applied unseen is then
//! either applied again to the same effect, or refused `Fenced` because someone claimed
//! since), as `activation.rs` makes a turn's.
//!
//! Deliberately not done: no random jitter (runs replay under the simulator; a store's
//! connection pool already bounds how many of its operations reach the server at once).

use std::future::Future;
use std::time::Duration;

use troupe_core::{ActorId, Deadline};

use crate::handle::{Counters, Shared};
use crate::mailbox::Mailbox;
use crate::StoreError;

/// The pause before the second try of a store operation that failed for a moment, in
/// milliseconds; each later pause doubles the one before, up to
/// [`STORE_RETRY_PAUSE_MS_MAX`].
pub const STORE_RETRY_PAUSE_MS_FIRST: u64 = 10;
/// The longest pause between two tries of a store operation, in milliseconds: a store
/// back from an outage is found within this much (and a closed mailbox too).
pub const STORE_RETRY_PAUSE_MS_MAX: u64 = 250;
/// Less than this left before the deadline, in milliseconds, and no further try starts:
/// the last error then reaches the caller before its own timer ends its wait (tokio's
/// timers fire on whole milliseconds, so pauses cut finer would land on the deadline's
/// tick with the caller's).
const STORE_RETRY_LEFT_MS_MIN: u64 = 10;

/// How long the save at deactivation (`on_deactivate`'s change, or a state change no
/// turn committed) is tried again while the store is unavailable, from its first
/// failure, in milliseconds. It serves no request, so it has no request's deadline; the
/// actor's next activation waits for it meanwhile (requests for it are held by the
/// dispatcher until this activation has ended), so it is short: under the default
/// shutdown grace, so a shutdown's saves are given up (and counted) before it cuts them.
pub const STORE_RETRY_DEACTIVATION_MS_MAX: u64 = 2_000;

const _: () = assert!(STORE_RETRY_DEACTIVATION_MS_MAX < crate::runtime::SHUTDOWN_GRACE_MS_DEFAULT);
const _: () = assert!(STORE_RETRY_DEACTIVATION_MS_MAX >= STORE_RETRY_PAUSE_MS_MAX);
const _: () = assert!(STORE_RETRY_PAUSE_MS_FIRST > 0);
const _: () = assert!(STORE_RETRY_PAUSE_MS_FIRST <= STORE_RETRY_PAUSE_MS_MAX);
const _: () = assert!(STORE_RETRY_LEFT_MS_MIN <= STORE_RETRY_PAUSE_MS_MAX);

/// What ends the tries of one store operation, other than its success or an error
/// that is not transient.
pub(crate) struct RetryBounds<'a> {
    pub(crate) shared: &'a Shared,
    /// The deadline of the request being served (for the save at deactivation: its
    /// own bound).
    pub(crate) deadline: Deadline,
    /// For a claim or a commit, the activation's mailbox: closed, the activation is to
    /// end, and nothing waits for this operation to be tried again. `None` for the save
    /// at deactivation and a turn's reads (see the module's comment).
    pub(crate) mailbox: Option<&'a Mailbox>,
    /// For the log.
    pub(crate) actor: &'a ActorId,
    /// For the log: what is tried ("claim", "commit", "deactivation save", "get",
    /// "scan", "check_fence", or what a caller of `retry_store` names).
    pub(crate) operation: &'a str,
}

impl RetryBounds<'_> {
    fn stopped(&self) -> bool {
        self.shared.aborted() || self.mailbox.is_some_and(Mailbox::is_closed)
    }

    /// Waits before the next try; `false` (at once, or after the pause) if none is to
    /// be made.
    async fn pause(&self, pause_ms: u64) -> bool {
        if self.stopped() {
            return false;
        }
        let now = self.shared.clock.now();
        let left_us = self.deadline.as_micros().saturating_sub(now.as_micros());
        if left_us < STORE_RETRY_LEFT_MS_MIN * 1_000 {
            return false;
        }
        let pause_us = pause_ms.saturating_mul(1_000).min(left_us / 2);
        tokio::time::sleep(Duration::from_micros(pause_us)).await;
        !self.stopped() && !self.shared.clock.has_passed(self.deadline)
    }
}

/// Tries `operation` again while it fails for a moment, within `bounds`; `first` is
/// the error of the try already made. Returns the first success, or the last error:
/// one that is not transient at once, else the last transient one when the bounds end
/// the tries.
pub(crate) async fn retry<T, F, Attempt>(
    bounds: RetryBounds<'_>,
    first: StoreError,
    mut operation: F,
) -> Result<T, StoreError>
where
    F: FnMut() -> Attempt,
    Attempt: Future<Output = Result<T, StoreError>>,
{
    let mut error = first;
    let mut pause_ms = STORE_RETRY_PAUSE_MS_FIRST;
    let mut tries: u32 = 1;
    while error.is_transient() && bounds.pause(pause_ms).await {
        Counters::add(&bounds.shared.counters.store_retries);
        tries += 1;
        tracing::debug!(actor = %bounds.actor, operation = %bounds.operation, try_number = tries, %error, "trying the store again");
        match operation().await {
            Ok(done) => return Ok(done),
            Err(next) => error = next,
        }
        pause_ms = pause_ms.saturating_mul(2).min(STORE_RETRY_PAUSE_MS_MAX);
    }
    if error.is_transient() {
        tracing::warn!(
            actor = %bounds.actor,
            operation = %bounds.operation,
            tries,
            %error,
            "the store stayed unavailable: giving up at the deadline, or as the activation or the runtime ends"
        );
    }
    Err(error)
}
