//! The messages on the wire. A client opens each connection with a [`Hello`], the
//! server answers [`HelloAck`] (the clock handshake, see [`ClockSync`]); then the client
//! sends [`WireRequest`]s and the server answers [`WireResponse`]s. A client may send
//! another [`Hello`] at any time to refresh its clock bound, and a [`WireCancel`] for a
//! request whose caller stopped waiting (no answer). A server that stops (its node
//! leaving) stops reading, writes the replies it has, then [`GoingAway`], and closes.

use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use troupe_core::limits::INVOKE_TIMEOUT_MS_MAX;
use troupe_core::{ActorId, CallContext, Deadline, InvokeError, TraceId};

use super::clock_sync::ClockSync;
use super::{CALL_CHAIN_LENGTH_MAX, WIRE_PROTOCOL_VERSION};
use crate::IdempotencyKey;

/// The first field of every [`Hello`] and [`HelloAck`]: "TRPE". A peer that is not a
/// Troupe transport fails the handshake with a clear cause.
pub(crate) const WIRE_MAGIC: u32 = u32::from_be_bytes(*b"TRPE");

/// A frame from client to server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum ClientMessage {
    /// Must be the first frame of a connection; may be repeated.
    Hello(Hello),
    Request(WireRequest),
    /// A deadlock probe (one way: no answer).
    Probe(Probe),
    /// The caller of an earlier request on this connection stopped waiting (one way: no
    /// answer). Since protocol version 4.
    Cancel(WireCancel),
}

/// The caller of request `request_id` (sent earlier on the same connection) stopped
/// waiting: its future was dropped before the reply (its turn ended, it gave up). The
/// server drops the call, which cancels the callee's turn (rolled back, nothing
/// committed) or, if it has not started, keeps it from running. A cancel for a request
/// that already ended, or that the server never saw, is ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct WireCancel {
    pub(crate) request_id: u64,
}

/// A frame from server to client.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum ServerMessage {
    HelloAck(HelloAck),
    Response(WireResponse),
    /// The server's last frame on a connection it closes because it is stopping (its
    /// node leaving). Since protocol version 7; the last variant, so the others keep
    /// their encoding.
    GoingAway(GoingAway),
}

/// The server stopped reading this connection and is closing it: it read the first
/// `requests_read` request frames the client wrote on it, and no other. A request
/// written later was never read, so it did not run; one of the first `requests_read`
/// may have run, and is answered by a `Response` before this frame if its reply was
/// ready, otherwise never.
///
/// Requests are counted in the order their frames were written, not by request id:
/// a client numbers requests when it makes them and may queue them in another order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct GoingAway {
    pub(crate) requests_read: u64,
}

/// The client's side of the clock handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Hello {
    /// [`WIRE_MAGIC`].
    pub(crate) magic: u32,
    /// The client's [`WIRE_PROTOCOL_VERSION`].
    pub(crate) version: u16,
    /// The client's clock when it encoded this hello, in microseconds.
    pub(crate) client_now_us: u64,
}

/// The server's answer to a [`Hello`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct HelloAck {
    /// [`WIRE_MAGIC`].
    pub(crate) magic: u32,
    /// The server's [`WIRE_PROTOCOL_VERSION`]; on a mismatch the server closes the
    /// connection after this answer.
    pub(crate) version: u16,
    /// The hello's `client_now_us`, echoed.
    pub(crate) client_now_us: u64,
    /// The server's clock when it read the hello, in microseconds.
    pub(crate) server_now_us: u64,
}

impl Hello {
    /// This build's hello, sent at `now` on the client's clock.
    pub(crate) fn new(now: Deadline) -> Self {
        Self {
            magic: WIRE_MAGIC,
            version: WIRE_PROTOCOL_VERSION,
            client_now_us: now.as_micros(),
        }
    }

    /// Why this hello cannot be served, if it cannot.
    pub(crate) fn refusal(&self) -> Option<String> {
        if self.magic != WIRE_MAGIC {
            return Some(format!(
                "the peer is not a Troupe transport client (magic {:#010x})",
                self.magic
            ));
        }
        if self.version != WIRE_PROTOCOL_VERSION {
            return Some(format!(
                "the client speaks transport protocol version {}, this server {WIRE_PROTOCOL_VERSION}",
                self.version
            ));
        }
        None
    }

    /// The answer, with the server's clock reading `now`.
    pub(crate) fn ack(&self, now: Deadline) -> HelloAck {
        HelloAck {
            magic: WIRE_MAGIC,
            version: WIRE_PROTOCOL_VERSION,
            client_now_us: self.client_now_us,
            server_now_us: now.as_micros(),
        }
    }
}

impl HelloAck {
    /// The clock bound this answer gives, received at `received` on the client's clock.
    ///
    /// # Errors
    /// Why the handshake failed: not a Troupe server, or another protocol version.
    pub(crate) fn clock_sync(&self, received: Deadline) -> Result<ClockSync, String> {
        if self.magic != WIRE_MAGIC {
            return Err(format!(
                "the peer is not a Troupe transport server (magic {:#010x})",
                self.magic
            ));
        }
        if self.version != WIRE_PROTOCOL_VERSION {
            return Err(format!(
                "the server speaks transport protocol version {}, this client {WIRE_PROTOCOL_VERSION}",
                self.version
            ));
        }
        Ok(ClockSync::from_handshake(
            Deadline::from_micros(self.client_now_us),
            Deadline::from_micros(self.server_now_us),
            received,
        ))
    }
}

/// One invocation, as sent by a client.
///
/// The context travels as its parts: the deadline already translated to the server's
/// clock (conservatively, see [`ClockSync::server_deadline`]), depth and chain as is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct WireRequest {
    /// Chosen by the client, unique per client; the response carries it back.
    pub(crate) request_id: u64,
    pub(crate) target: ActorId,
    pub(crate) payload: Bytes,
    pub(crate) depth: u32,
    pub(crate) chain: Vec<ActorId>,
    /// The deadline on the server's clock, in microseconds since its epoch.
    pub(crate) deadline_us: u64,
    /// The actor whose turn waits on this call, if any.
    pub(crate) caller: Option<ActorId>,
    /// The request's trace id, if its root set one (since protocol version 4).
    pub(crate) trace_id: Option<TraceId>,
    /// A fire-and-forget message (`tell`, since protocol version 4): the server answers
    /// as soon as the target's runtime accepted it (an empty reply) or refused it, not
    /// when its turn ends; the turn's own reply goes nowhere.
    pub(crate) tell: bool,
    /// The request's idempotency key, if it is one attempt of a keyed request (since
    /// protocol version 5): the server runs it as a keyed turn (a recorded reply is
    /// answered unrun). Checked on receipt ([`WireRequest::idempotency_key`]); never set
    /// on a tell.
    pub(crate) key: Option<String>,
}

/// A deadlock probe of the cluster's edge chasing, sent node to node with no answer:
/// `initiator`'s turn waits on call `initiator_call` (an id of `initiator_node`'s
/// runtime), and the waits go on along `path` (the initiator first) to `at`, an actor
/// hosted by the receiving node. The transport carries it; the cluster layer reads it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Probe {
    /// The actor whose call started the probe.
    pub initiator: ActorId,
    /// The node that hosts the initiator and knows its call ids.
    pub initiator_node: String,
    /// The initiator's call (unique in its node's runtime).
    pub initiator_call: u64,
    /// The actors the probe went through, the initiator first.
    pub path: Vec<ActorId>,
    /// The actor to look at next, hosted by the receiving node.
    pub at: ActorId,
}

/// The outcome of one invocation, as sent back by a server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct WireResponse {
    pub(crate) request_id: u64,
    pub(crate) result: Result<Bytes, InvokeError>,
}

impl WireRequest {
    /// The request for `context`, whose deadline is on the client's clock, which reads
    /// `now`; `sync` translates it to the server's clock.
    pub(crate) fn new(
        request_id: u64,
        target: ActorId,
        payload: Bytes,
        context: &CallContext,
        caller: Option<ActorId>,
        sync: &ClockSync,
        now: Deadline,
    ) -> Self {
        Self {
            request_id,
            target,
            payload,
            depth: context.depth(),
            chain: context.chain().to_vec(),
            deadline_us: sync.server_deadline(context.deadline(), now).as_micros(),
            caller,
            trace_id: context.trace_id(),
            tell: false,
            key: None,
        }
    }

    /// The request's idempotency key, checked: `None` for an unkeyed request. A tell may
    /// carry one (since 2026-12-01: `TransportClient::tell_keyed`).
    ///
    /// # Errors
    /// [`InvokeError::Rejected`] (the request must not run) if the key is not a valid
    /// [`IdempotencyKey`].
    pub(crate) fn idempotency_key(&self) -> Result<Option<IdempotencyKey>, InvokeError> {
        let Some(key) = &self.key else {
            return Ok(None);
        };
        IdempotencyKey::new(key)
            .map(Some)
            .map_err(|error| InvokeError::Rejected {
                target: self.target.clone(),
                reason: format!("the request's idempotency key is malformed: {error}"),
            })
    }

    /// Rebuilds the call context on the receiving clock, which reads `now`: root with the
    /// sent deadline (capped at `now +` [`INVOKE_TIMEOUT_MS_MAX`]), then one
    /// [`CallContext::child`] per actor of the chain, so depth and chain come out exactly
    /// as they were sent, and the trace id as sent.
    ///
    /// # Errors
    /// - [`InvokeError::Timeout`] if the deadline has already passed: the request arrived
    ///   after its caller gave up (held up by a partition or packet loss) and must not run.
    /// - [`InvokeError::Rejected`] if the chain is longer than [`CALL_CHAIN_LENGTH_MAX`] or
    ///   the depth does not match it; such a context was not built by [`CallContext`].
    pub(crate) fn context(&self, now: Deadline) -> Result<CallContext, InvokeError> {
        let rejected = |reason: String| InvokeError::Rejected {
            target: self.target.clone(),
            reason,
        };
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
        let deadline = Deadline::from_micros(self.deadline_us)
            .min(Deadline::after(now, Duration::from_millis(INVOKE_TIMEOUT_MS_MAX)));
        if deadline.has_passed(now) {
            return Err(InvokeError::Timeout {
                target: self.target.clone(),
                timeout_ms: 0,
            });
        }
        let mut context = CallContext::root(deadline);
        if let Some(trace_id) = self.trace_id {
            context = context.with_trace_id(trace_id);
        }
        for waiting in &self.chain {
            context = context.child(waiting.clone(), deadline);
        }
        assert_eq!(context.depth(), self.depth, "a replayed chain must give the sent depth");
        assert_eq!(
            context.chain(),
            &self.chain[..],
            "a replayed chain must be the sent one"
        );
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
    use crate::transport::{CLOCK_DRIFT_PPM_MAX, CLOCK_ROUNDING_US};

    fn actor(key: &str) -> ActorId {
        ActorId::new("agent", key).unwrap()
    }

    fn sync(client_sent_us: u64, server_now_us: u64, client_received_us: u64) -> ClockSync {
        Hello::new(Deadline::from_micros(client_sent_us))
            .ack(Deadline::from_micros(server_now_us))
            .clock_sync(Deadline::from_micros(client_received_us))
            .unwrap()
    }

    #[test]
    fn a_context_rebuilt_on_another_clock_keeps_depth_chain_and_an_absolute_deadline() {
        // The server's clock reads 2 s less than the client's; the handshake took 4 ms.
        let sync = sync(10_000_000, 8_002_000, 10_004_000);
        // Sent 1 s after the handshake ended.
        let sent_at = Deadline::from_micros(11_004_000);
        let root = CallContext::root(Deadline::after(sent_at, Duration::from_millis(800)));
        let trace = TraceId::new(0xfeed);
        let context = root
            .with_trace_id(trace)
            .child(actor("a"), Deadline::from_micros(u64::MAX))
            .child(actor("b"), Deadline::after(sent_at, Duration::from_millis(500)));
        let request = WireRequest::new(
            9,
            actor("c"),
            Bytes::from_static(b"x"),
            &context,
            Some(actor("b")),
            &sync,
            sent_at,
        );
        // 11.504 s on the client is 9.504 s on the server, minus the error bound (the
        // whole 4 ms round trip could have been on the way back: 2 ms more than the
        // estimate), rounding, and 1 s of drift allowance.
        let expected_us = 9_504_000 - 2_000 - CLOCK_ROUNDING_US - CLOCK_DRIFT_PPM_MAX;
        assert_eq!(request.deadline_us, expected_us);

        // However late it arrives, it keeps that deadline: the transit is not given back.
        let received_at = Deadline::from_micros(9_400_000);
        let rebuilt = request.context(received_at).unwrap();
        assert_eq!(rebuilt.depth(), 2);
        assert_eq!(rebuilt.chain(), &[actor("a"), actor("b")]);
        assert_eq!(rebuilt.deadline(), Deadline::from_micros(expected_us));
        assert_eq!(rebuilt.trace_id(), Some(trace), "the trace id crosses");
    }

    #[test]
    fn a_request_arriving_after_its_deadline_is_refused_as_timeout() {
        let sync = sync(0, 0, 0);
        let context = CallContext::root(Deadline::from_micros(50_000));
        let request = WireRequest::new(
            1,
            actor("c"),
            Bytes::new(),
            &context,
            None,
            &sync,
            Deadline::from_micros(0),
        );
        assert!(request.context(Deadline::from_micros(49_000)).is_ok());
        let late = request.context(Deadline::from_micros(50_000));
        assert!(
            matches!(late, Err(InvokeError::Timeout { timeout_ms: 0, .. })),
            "{late:?}"
        );
    }

    #[test]
    fn a_far_deadline_is_capped_on_arrival() {
        let sync = sync(0, 0, 0);
        let context = CallContext::root(Deadline::from_micros(u64::MAX));
        let request = WireRequest::new(
            1,
            actor("c"),
            Bytes::new(),
            &context,
            None,
            &sync,
            Deadline::from_micros(0),
        );
        let now = Deadline::from_micros(7);
        let rebuilt = request.context(now).unwrap();
        assert_eq!(
            rebuilt.deadline(),
            Deadline::after(now, Duration::from_millis(INVOKE_TIMEOUT_MS_MAX))
        );
    }

    #[test]
    fn a_foreign_or_other_version_peer_fails_the_handshake_clearly() {
        let mut hello = Hello::new(Deadline::from_micros(1));
        assert_eq!(hello.refusal(), None);
        hello.version = WIRE_PROTOCOL_VERSION + 1;
        assert!(hello.refusal().unwrap().contains("protocol version"));
        hello.magic = 0x4854_5450; // "HTTP"
        assert!(hello.refusal().unwrap().contains("not a Troupe transport client"));

        let mut ack = Hello::new(Deadline::from_micros(1)).ack(Deadline::from_micros(2));
        ack.version = 1;
        assert!(ack
            .clock_sync(Deadline::from_micros(3))
            .unwrap_err()
            .contains("protocol version 1"));
        ack.magic = 0;
        assert!(ack
            .clock_sync(Deadline::from_micros(3))
            .unwrap_err()
            .contains("not a Troupe transport server"));
    }

    /// A peer of version 4 knows no idempotency key (added in 5), one of version 5 no
    /// `InvokeError::ConnectionBusy` (added in 6), one of version 6 no `GoingAway`
    /// (added in 7: a client of version 6 could not decode it, and would take a leaving
    /// node's unread requests for requests that may have run), one of version 7 no
    /// `StoreError::Unavailable` on the wire (added in 8: it could not decode it, and
    /// sent it as `Backend`): all are refused at the handshake, in either role, with
    /// both versions in the refusal.
    #[test]
    fn a_peer_of_an_older_version_is_refused_at_the_handshake() {
        assert_eq!(
            WIRE_PROTOCOL_VERSION, 8,
            "version 8 encodes StoreError::Unavailable as itself"
        );
        for old in [3, 4, 5, 6, 7] {
            let mut hello = Hello::new(Deadline::from_micros(1));
            hello.version = old;
            let refusal = hello.refusal().expect("an older client is refused");
            assert!(refusal.contains(&format!("version {old}, this server 8")), "{refusal}");
            let mut ack = Hello::new(Deadline::from_micros(1)).ack(Deadline::from_micros(2));
            ack.version = old;
            let refusal = ack.clock_sync(Deadline::from_micros(3)).unwrap_err();
            assert!(refusal.contains(&format!("version {old}, this client 8")), "{refusal}");
        }
    }

    /// `GoingAway` is a new variant at the end: the hello's answer and a response keep
    /// the encoding of version 6 (variant 0 and 1), and the new frame is small.
    #[test]
    fn going_away_is_appended_and_keeps_the_other_server_frames_encoding() {
        use crate::transport::frame::encode_frame;
        use crate::transport::FRAME_HEADER_SIZE_BYTES;

        let ack = encode_frame(&ServerMessage::HelloAck(
            Hello::new(Deadline::from_micros(1)).ack(Deadline::from_micros(2)),
        ))
        .unwrap();
        assert_eq!(ack[FRAME_HEADER_SIZE_BYTES], 0, "HelloAck is variant 0");
        let response = encode_frame(&ServerMessage::Response(WireResponse {
            request_id: 1,
            result: Ok(Bytes::new()),
        }))
        .unwrap();
        assert_eq!(response[FRAME_HEADER_SIZE_BYTES], 1, "Response is variant 1");
        let going_away = encode_frame(&ServerMessage::GoingAway(GoingAway {
            requests_read: u64::MAX,
        }))
        .unwrap();
        assert_eq!(going_away[FRAME_HEADER_SIZE_BYTES], 2, "GoingAway is variant 2");
        assert!(going_away.len() - FRAME_HEADER_SIZE_BYTES <= 10, "{}", going_away.len());
    }

    /// Goal: a response that says the host's store failed for a moment crosses the wire
    /// as `StorageFailed { source: Unavailable }` (protocol version 8), so the caller's
    /// node answers it as transient; version 7 sent it as `Backend` (this test failed:
    /// `left: ... source: Backend { operation: Commit, cause: "connection refused" }`).
    /// Method: the frame codec both ways, as the server writes and the client reads.
    #[tokio::test]
    async fn a_store_unavailable_on_the_host_crosses_the_wire_as_itself() {
        use crate::transport::frame::{encode_frame, read_frame};
        use crate::transport::FRAME_SIZE_MAX_BYTES;
        use troupe_core::{StoreError, StoreOperation};

        let sent = ServerMessage::Response(WireResponse {
            request_id: 9,
            result: Err(InvokeError::StorageFailed {
                target: actor("c"),
                source: StoreError::Unavailable {
                    operation: StoreOperation::Commit,
                    cause: "connection refused".to_string(),
                },
            }),
        });
        let frame = encode_frame(&sent).unwrap();
        let mut reader: &[u8] = &frame;
        let received: ServerMessage = read_frame(&mut reader, FRAME_SIZE_MAX_BYTES).await.unwrap();
        assert_eq!(received, sent);
        let ServerMessage::Response(WireResponse { result: Err(error), .. }) = received else {
            panic!("not an error response: {received:?}");
        };
        assert!(error.is_transient(), "{error}");
    }

    #[test]
    fn a_requests_key_is_checked_on_receipt() {
        let now = Deadline::from_micros(0);
        let context = CallContext::root(Deadline::from_micros(10));
        let mut request = WireRequest::new(1, actor("c"), Bytes::new(), &context, None, &sync(0, 0, 0), now);
        assert_eq!(request.idempotency_key().unwrap(), None, "unkeyed");
        request.key = Some("order-7".to_string());
        assert_eq!(
            request.idempotency_key().unwrap(),
            Some(IdempotencyKey::new("order-7").unwrap())
        );
        for malformed in [
            String::new(),
            "a\nb".to_string(),
            "k".repeat(crate::IDEMPOTENCY_KEY_LENGTH_MAX_BYTES + 1),
        ] {
            request.key = Some(malformed);
            let refused = request.idempotency_key().unwrap_err();
            assert!(
                matches!(&refused, InvokeError::Rejected { reason, .. } if reason.contains("idempotency key is malformed")),
                "{refused:?}"
            );
        }
        // A tell carries its key as an invoke does (a keyed tell).
        request.key = Some("order-7".to_string());
        request.tell = true;
        assert_eq!(
            request.idempotency_key().unwrap(),
            Some(IdempotencyKey::new("order-7").unwrap())
        );
    }

    /// The key rides at the end of the request: an unkeyed request costs one byte more
    /// than in version 4 (the `None`).
    #[test]
    fn an_unkeyed_request_costs_one_byte_for_its_key() {
        use crate::transport::frame::encode_frame;
        let now = Deadline::from_micros(0);
        let context = CallContext::root(Deadline::from_micros(10));
        let mut request = WireRequest::new(1, actor("c"), Bytes::new(), &context, None, &sync(0, 0, 0), now);
        let unkeyed = encode_frame(&ClientMessage::Request(request.clone())).unwrap().len();
        request.key = Some("k".to_string());
        let keyed = encode_frame(&ClientMessage::Request(request)).unwrap().len();
        assert_eq!(keyed - unkeyed, 2, "Some, then the key's length and its byte");
    }

    #[test]
    fn the_largest_hello_and_answer_fit_the_handshake_frame_limit() {
        use crate::transport::frame::encode_frame;
        use crate::transport::{FRAME_HEADER_SIZE_BYTES, HANDSHAKE_FRAME_SIZE_MAX_BYTES};

        let mut hello = Hello::new(Deadline::from_micros(u64::MAX));
        hello.version = u16::MAX;
        let mut ack = hello.ack(Deadline::from_micros(u64::MAX));
        ack.version = u16::MAX;
        let hello = encode_frame(&ClientMessage::Hello(hello)).unwrap();
        let ack = encode_frame(&ServerMessage::HelloAck(ack)).unwrap();
        assert!(hello.len() - FRAME_HEADER_SIZE_BYTES <= HANDSHAKE_FRAME_SIZE_MAX_BYTES);
        assert!(ack.len() - FRAME_HEADER_SIZE_BYTES <= HANDSHAKE_FRAME_SIZE_MAX_BYTES);
        assert_eq!(
            ack.len() - FRAME_HEADER_SIZE_BYTES,
            27,
            "variant, magic, version and two clocks"
        );
    }

    #[test]
    fn a_forged_depth_or_overlong_chain_is_rejected() {
        let now = Deadline::from_micros(0);
        let context = CallContext::root(Deadline::from_micros(10));
        let mut request = WireRequest::new(1, actor("c"), Bytes::new(), &context, None, &sync(0, 0, 0), now);
        request.depth = 3;
        assert!(matches!(request.context(now), Err(InvokeError::Rejected { .. })));
        request.chain = (0..=CALL_CHAIN_LENGTH_MAX).map(|i| actor(&i.to_string())).collect();
        request.depth = u32::try_from(request.chain.len()).unwrap();
        assert!(matches!(request.context(now), Err(InvokeError::Rejected { .. })));
    }
}
