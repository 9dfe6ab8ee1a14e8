//! The typed errors of an invocation.

use serde::{Deserialize, Serialize};

use crate::{ActorId, CallRefused, StoreError};

/// Why an invocation did not produce a reply.
///
/// Serializable so a remote node can return it unchanged. Nothing in Troupe matches on
/// the `Display` text; match on the variant.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum InvokeError {
    /// The deadline passed before a reply arrived. The request was dropped unrun if it
    /// was still queued, and its turn cancelled and rolled back if it was running; but a
    /// turn that had finished and was committing when the deadline passed keeps its
    /// commit, so a timeout does not prove the request had no effect.
    ///
    /// Its text names the time allowed. With `timeout_ms` 0 (under a millisecond was
    /// left, or the time allowed is not known where the deadline was found passed) it
    /// says that the deadline passed, not "after 0 ms".
    #[error("invocation of {target} timed out{}", timed_out_text(*.timeout_ms))]
    Timeout {
        /// The actor invoked.
        target: ActorId,
        /// The time the caller allowed, in milliseconds.
        timeout_ms: u64,
    },
    /// The target's mailbox is full; nothing was queued. Retry later.
    #[error("{target} is busy: its mailbox of {capacity} messages is full")]
    Busy {
        /// The actor whose mailbox is full.
        target: ActorId,
        /// The mailbox capacity, in messages.
        capacity: usize,
    },
    /// No factory is registered for the target's kind.
    #[error("no actor kind {kind:?} is registered (invoked {target})")]
    ActorNotFound {
        /// The actor invoked.
        target: ActorId,
        /// Its unknown kind.
        kind: String,
    },
    /// The actor's turn returned an error; its writes were rolled back.
    #[error("{target} failed: {cause}")]
    ActorFailed {
        /// The actor that failed.
        target: ActorId,
        /// What the actor said went wrong.
        cause: String,
    },
    /// The actor, or the runtime on its behalf, refused the request without running it.
    #[error("{target} rejected the request: {reason}")]
    Rejected {
        /// The actor that refused.
        target: ActorId,
        /// Why.
        reason: String,
    },
    /// Claiming, reading or committing the actor's state failed; the caller's request
    /// did not take effect and the actor's last committed state is intact. The store's
    /// error is both in the message and, typed, in `source()`.
    ///
    /// With `source` [`StoreError::Fenced`], the activation that ran the turn is stale:
    /// the actor was claimed since by another activation (another runtime on the same
    /// store). That activation then fails every later turn with this same error, without
    /// committing, until it deactivates; the next request after that activates the actor
    /// again, from the newest committed state.
    #[error("storage failed for {target}: {source}")]
    StorageFailed {
        /// The actor whose state could not be claimed, read or committed.
        target: ActorId,
        /// The storage error.
        #[source]
        source: StoreError,
    },
    /// Waiting on this call would close a cycle of actors waiting on each other; nothing
    /// was queued. The cycle starts and ends with the caller.
    #[error("deadlock detected: {}", display_cycle(cycle))]
    DeadlockDetected {
        /// The actors in the cycle, caller first and last.
        cycle: Vec<ActorId>,
    },
    /// The node that hosts the target could not be reached, or the connection broke
    /// before a reply arrived. The request may or may not have run.
    #[error("{target} is unreachable: {cause}")]
    Unreachable {
        /// The actor invoked.
        target: ActorId,
        /// What failed (connect refused, connection reset, frame error).
        cause: String,
    },
    /// The dispatcher's command queue stayed full until the deadline.
    #[error("the dispatcher is overloaded: its queue of {capacity} commands is full")]
    DispatcherBusy {
        /// The queue capacity, in commands.
        capacity: usize,
    },
    /// The runtime has shut down, or is shutting down and accepts no new work: the
    /// request was not run, or its turn was cancelled and rolled back when the shutdown
    /// grace period ended.
    #[error("the runtime has shut down")]
    Shutdown,
    /// Admission refused a call from inside a turn (cycle in the chain, depth, unknown
    /// target, too many calls in flight, no time left, the calling turn has ended);
    /// nothing was sent.
    #[error("call refused: {0}")]
    Refused(#[from] CallRefused),
    /// The turn that made this call ended (it returned, failed or was itself cancelled)
    /// while the call was in flight: the call was abandoned and the callee's turn for it
    /// cancelled.
    #[error("the call to {target} was cancelled: the calling turn ended")]
    Cancelled {
        /// The actor called.
        target: ActorId,
    },
    /// The node that hosts the target already runs the most requests it runs at once for
    /// this caller's connection (the transport's `SERVER_REQUESTS_IN_FLIGHT_MAX`); the
    /// request was refused on arrival and never ran. Retry later. A client that keeps
    /// within its own limit meets this only when one of its cancels was lost or a reply
    /// is late. (Transport protocol version 6 and later; the last variant, so the others
    /// keep their index in bincode, which numbers variants.)
    #[error("{target}'s node is running {capacity} requests from this connection, its limit: the request was not run")]
    ConnectionBusy {
        /// The actor invoked.
        target: ActorId,
        /// The requests a connection may have running at once.
        capacity: usize,
    },
}

impl InvokeError {
    /// Whether retrying the same request later may succeed: busy, overloaded, timed out,
    /// unreachable, or a storage failure that may pass: a turn fenced off by another
    /// activation of its actor (a [`StoreError::Fenced`] source: the stale activation
    /// closes, and a later request activates the actor again from its newest committed
    /// state), or a store that failed for a moment and was still down when the
    /// request's deadline ran out (a source for which [`StoreError::is_transient`],
    /// i.e. [`StoreError::Unavailable`]; the runtime tried it again meanwhile). Any
    /// other storage failure is not: it would fail the same way again, and retrying a
    /// failed store blindly can make it worse.
    ///
    /// An `Unavailable` store on another node arrives as itself (transport protocol
    /// version 8), so the answer is the same on the node that hosts the actor and on
    /// the node that called it. Before 2026-12-07 a `StorageFailed` whose source was
    /// `Unavailable` was not transient.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Busy { .. }
            | Self::DispatcherBusy { .. }
            | Self::ConnectionBusy { .. }
            | Self::Timeout { .. }
            | Self::Unreachable { .. } => true,
            Self::StorageFailed { source, .. } => matches!(source, StoreError::Fenced { .. }) || source.is_transient(),
            Self::ActorNotFound { .. }
            | Self::ActorFailed { .. }
            | Self::Rejected { .. }
            | Self::DeadlockDetected { .. }
            | Self::Shutdown
            | Self::Refused(_)
            | Self::Cancelled { .. } => false,
        }
    }
}

/// The end of a timeout's text: the time allowed, or that the deadline passed.
fn timed_out_text(timeout_ms: u64) -> String {
    if timeout_ms == 0 {
        ": its deadline passed".to_string()
    } else {
        format!(" after {timeout_ms} ms")
    }
}

fn display_cycle(cycle: &[ActorId]) -> String {
    cycle.iter().map(ToString::to_string).collect::<Vec<_>>().join(" -> ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_failure_keeps_the_store_error_as_its_source() {
        let store_error = StoreError::Injected {
            operation: crate::StoreOperation::Commit,
        };
        let error = InvokeError::StorageFailed {
            target: ActorId::new("agent", "a").unwrap(),
            source: store_error.clone(),
        };
        let source = std::error::Error::source(&error).expect("a storage failure has a source");
        assert_eq!(source.downcast_ref::<StoreError>(), Some(&store_error));
        assert_eq!(
            error.to_string(),
            "storage failed for agent/a: commit failed: injected fault"
        );
    }

    #[test]
    fn a_timeout_names_the_time_allowed_or_that_the_deadline_passed() {
        let target = ActorId::new("agent", "b").unwrap();
        let after = |timeout_ms| InvokeError::Timeout {
            target: target.clone(),
            timeout_ms,
        };
        assert_eq!(
            after(1_500).to_string(),
            "invocation of agent/b timed out after 1500 ms"
        );
        assert_eq!(
            after(0).to_string(),
            "invocation of agent/b timed out: its deadline passed"
        );
    }

    /// Goal: a turn fenced off by another activation is transient (a retry activates the
    /// actor again and can succeed, as `troupe serve` tells its clients with 503
    /// `fenced` and Retry-After), and other storage failures are not. Before 2026-12-06
    /// the fenced one was not (`is_transient` was false).
    #[test]
    fn a_fenced_turn_is_transient_and_other_storage_failures_are_not() {
        let target = ActorId::new("agent", "a").unwrap();
        let failed = |source| InvokeError::StorageFailed {
            target: target.clone(),
            source,
        };
        let fenced = failed(StoreError::Fenced {
            actor: target.clone(),
            held: crate::Fence::from_token(1).unwrap(),
            current: crate::Fence::from_token(2),
        });
        assert!(fenced.is_transient(), "{fenced}");
        let injected = failed(StoreError::Injected {
            operation: crate::StoreOperation::Commit,
        });
        assert!(!injected.is_transient(), "{injected}");
    }

    /// Goal: a storage failure whose store failed for a moment (`Unavailable`: the store
    /// was still down when the request's deadline ran out) is transient, as its source
    /// is; one whose store failed otherwise is not. Before 2026-12-07 it was not (this
    /// test failed at its first assertion).
    #[test]
    fn a_storage_failure_of_a_store_down_for_a_moment_is_transient() {
        let target = ActorId::new("agent", "a").unwrap();
        let failed = |source| InvokeError::StorageFailed {
            target: target.clone(),
            source,
        };
        let unavailable = failed(StoreError::Unavailable {
            operation: crate::StoreOperation::Commit,
            cause: "connection refused".to_string(),
        });
        assert!(unavailable.is_transient(), "{unavailable}");
        for source in [
            StoreError::Backend {
                operation: crate::StoreOperation::Commit,
                cause: "connection refused".to_string(),
            },
            StoreError::TooManyWrites { count: 2, limit: 1 },
            StoreError::NotOwner {
                actor: target.clone(),
                owner: None,
            },
        ] {
            let error = failed(source);
            assert!(!error.is_transient(), "{error}");
        }
    }

    #[test]
    fn deadlock_error_names_the_cycle_in_order() {
        let a = ActorId::new("agent", "a").unwrap();
        let b = ActorId::new("agent", "b").unwrap();
        let error = InvokeError::DeadlockDetected {
            cycle: vec![a.clone(), b, a],
        };
        assert_eq!(error.to_string(), "deadlock detected: agent/a -> agent/b -> agent/a");
    }
}
