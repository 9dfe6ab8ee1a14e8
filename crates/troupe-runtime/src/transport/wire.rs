//! The messages on the wire: [`WireRequest`] from client to server, [`WireResponse`] back.

use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use troupe_core::limits::INVOKE_TIMEOUT_MS_MAX;
use troupe_core::{ActorId, CallContext, Deadline, InvokeError};

use super::CALL_CHAIN_LENGTH_MAX;

/// One invocation, as sent by a client.
///
/// The context travels as its parts: the deadline as the time remaining when the frame
/// was encoded (a deadline is absolute on its own node's clock), depth and chain as is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct WireRequest {
    /// Chosen by the client, unique per client; the response carries it back.
    pub(crate) request_id: u64,
    pub(crate) target: ActorId,
    pub(crate) payload: Bytes,
    pub(crate) depth: u32,
    pub(crate) chain: Vec<ActorId>,
    pub(crate) remaining_us: u64,
    /// The actor whose turn waits on this call, if any.
    pub(crate) caller: Option<ActorId>,
}

/// The outcome of one invocation, as sent back by a server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct WireResponse {
    pub(crate) request_id: u64,
    pub(crate) result: Result<Bytes, InvokeError>,
}

impl WireRequest {
    /// The request for `context`, whose deadline is on the clock that reads `now`.
    pub(crate) fn new(
        request_id: u64,
        target: ActorId,
        payload: Bytes,
        context: &CallContext,
        caller: Option<ActorId>,
        now: Deadline,
    ) -> Self {
        let remaining = context.deadline().remaining(now);
        Self {
            request_id,
            target,
            payload,
            depth: context.depth(),
            chain: context.chain().to_vec(),
            remaining_us: u64::try_from(remaining.as_micros()).unwrap_or(u64::MAX),
            caller,
        }
    }

    /// Rebuilds the call context on the receiving clock, which reads `now`: root with the
    /// deadline `now + remaining` (capped at [`INVOKE_TIMEOUT_MS_MAX`]), then one
    /// [`CallContext::child`] per actor of the chain, so depth and chain come out exactly
    /// as they were sent.
    ///
    /// # Errors
    /// [`InvokeError::Rejected`] if the chain is longer than [`CALL_CHAIN_LENGTH_MAX`] or
    /// the depth does not match it; such a context was not built by [`CallContext`].
    pub(crate) fn context(&self, now: Deadline) -> Result<CallContext, InvokeError> {
        let rejected = |reason: String| InvokeError::Rejected { target: self.target.clone(), reason };
        if self.chain.len() > CALL_CHAIN_LENGTH_MAX {
            return Err(rejected(format!(
                "the call chain of {} actors exceeds the transport limit of {CALL_CHAIN_LENGTH_MAX}",
                self.chain.len()
            )));
        }
        if usize::try_from(self.depth).ok() != Some(self.chain.len()) {
            return Err(rejected(format!(
                "the call depth {} does not match the call chain of {} actors",
                self.depth,
                self.chain.len()
            )));
        }
        let remaining =
            Duration::from_micros(self.remaining_us).min(Duration::from_millis(INVOKE_TIMEOUT_MS_MAX));
        let deadline = Deadline::after(now, remaining);
        let mut context = CallContext::root(deadline);
        for waiting in &self.chain {
            context = context.child(waiting.clone(), deadline);
        }
        assert_eq!(context.depth(), self.depth, "a replayed chain must give the sent depth");
        assert_eq!(context.chain(), &self.chain[..], "a replayed chain must be the sent one");
        Ok(context)
    }

    /// The actor whose turn waits on this call: the named caller, else the end of the
    /// chain (a call from a turn always ends its chain with the calling actor).
    pub(crate) fn waiting_caller(&self) -> Option<&ActorId> {
        self.caller.as_ref().or(self.chain.last())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn actor(key: &str) -> ActorId {
        ActorId::new("agent", key).unwrap()
    }

    #[test]
    fn a_context_rebuilt_on_another_clock_keeps_depth_chain_and_remaining_time() {
        let sent_at = Deadline::from_micros(1_000_000);
        let root = CallContext::root(Deadline::after(sent_at, Duration::from_millis(800)));
        let context = root
            .child(actor("a"), Deadline::from_micros(u64::MAX))
            .child(actor("b"), Deadline::after(sent_at, Duration::from_millis(500)));
        let request =
            WireRequest::new(9, actor("c"), Bytes::from_static(b"x"), &context, Some(actor("b")), sent_at);
        assert_eq!(request.remaining_us, 500_000);

        let received_at = Deadline::from_micros(42);
        let rebuilt = request.context(received_at).unwrap();
        assert_eq!(rebuilt.depth(), 2);
        assert_eq!(rebuilt.chain(), &[actor("a"), actor("b")]);
        assert_eq!(rebuilt.deadline(), Deadline::after(received_at, Duration::from_millis(500)));
    }

    #[test]
    fn a_forged_depth_or_overlong_chain_is_rejected() {
        let now = Deadline::from_micros(0);
        let context = CallContext::root(Deadline::from_micros(10));
        let mut request = WireRequest::new(1, actor("c"), Bytes::new(), &context, None, now);
        request.depth = 3;
        assert!(matches!(request.context(now), Err(InvokeError::Rejected { .. })));
        request.chain = (0..=CALL_CHAIN_LENGTH_MAX).map(|i| actor(&i.to_string())).collect();
        request.depth = u32::try_from(request.chain.len()).unwrap();
        assert!(matches!(request.context(now), Err(InvokeError::Rejected { .. })));
    }
}
