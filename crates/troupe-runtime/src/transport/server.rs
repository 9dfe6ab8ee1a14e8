//! [`TransportServer`]: accepts connections and runs their requests on a runtime.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, Semaphore};
use troupe_core::InvokeError;

use super::frame::{encode_frame, read_frame, write_frames, FrameError};
use super::wire::WIRE_MAGIC;
use super::wire::{ClientMessage, Hello, ServerMessage, WireRequest, WireResponse};
use super::{ACCEPT_RETRY_DELAY_MS, SERVER_REQUESTS_IN_FLIGHT_MAX, WRITE_QUEUE_CAPACITY};
use crate::RuntimeHandle;

/// How long a server waits for its answer to a refused hello (another protocol version)
/// to be written before it closes the connection, in milliseconds.
const HANDSHAKE_REFUSAL_LINGER_MS: u64 = 100;

/// Serves the actors of one runtime to other nodes over TCP.
///
/// One task accepts connections; one task per connection answers the client's clock
/// handshake, then reads request frames and writes response frames; one task per request
/// invokes the actor, so a slow actor never blocks the other requests of its connection. Responses go to the connection's writer
/// through a bounded queue of [`WRITE_QUEUE_CAPACITY`] frames.
///
/// A request whose deadline (sent on this runtime's clock) has passed when it is read is
/// answered [`InvokeError::Timeout`] and never runs.
///
/// When a connection closes, the calls it carried are abandoned on the runtime: a
/// request that has not started never runs, a running turn finishes (within its
/// deadline) and its reply is dropped, and wait-for edges are released at once.
///
/// Dropping the server stops accepting and closes every connection at once; clients
/// then fail their pending calls with [`InvokeError::Unreachable`].
#[derive(Debug)]
pub struct TransportServer {
    local_address: SocketAddr,
    /// Dropped with the server; every task of the server watches it.
    _stop: watch::Sender<()>,
}

impl TransportServer {
    /// Binds `address` and serves `handle`'s actors on it.
    ///
    /// # Errors
    /// The bind error (address in use, not available).
    pub async fn bind(address: SocketAddr, handle: RuntimeHandle) -> io::Result<Self> {
        let listener = TcpListener::bind(address).await?;
        Self::serve(listener, handle)
    }

    /// Serves `handle`'s actors on connections accepted from `listener`.
    ///
    /// # Errors
    /// If the listener's local address cannot be read.
    ///
    /// # Panics
    /// Outside a tokio (or madsim) runtime.
    pub fn serve(listener: TcpListener, handle: RuntimeHandle) -> io::Result<Self> {
        let local_address = listener.local_addr()?;
        let (stop, stopped) = watch::channel(());
        tokio::spawn(accept_connections(listener, handle, stopped));
        Ok(Self {
            local_address,
            _stop: stop,
        })
    }

    /// The address the server listens on (with the real port if it bound port 0).
    pub fn local_address(&self) -> SocketAddr {
        self.local_address
    }
}

async fn accept_connections(listener: TcpListener, handle: RuntimeHandle, mut stopped: watch::Receiver<()>) {
    loop {
        let accepted = tokio::select! {
            biased;
            _ = stopped.changed() => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                tracing::debug!(%peer, "transport connection accepted");
                tokio::spawn(serve_connection(stream, peer, handle.clone(), stopped.clone()));
            }
            Err(error) => {
                // Usually out of file descriptors; pause rather than spin.
                tracing::warn!(%error, "transport accept failed");
                tokio::select! {
                    biased;
                    _ = stopped.changed() => return,
                    () = tokio::time::sleep(Duration::from_millis(ACCEPT_RETRY_DELAY_MS)) => {}
                }
            }
        }
    }
}

/// Runs one connection until the peer closes it, a frame is bad, a write fails, or the
/// server is dropped. Reading and writing run in this one task, so when either ends the
/// socket is closed at once.
async fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    handle: RuntimeHandle,
    mut stopped: watch::Receiver<()>,
) {
    // Nagle would hold small replies back; failing to disable it only costs latency.
    let _ = stream.set_nodelay(true);
    let (mut reader, mut writer) = tokio::io::split(stream);
    let (responses, mut response_queue) = mpsc::channel::<Bytes>(WRITE_QUEUE_CAPACITY);
    let slots = Arc::new(Semaphore::new(SERVER_REQUESTS_IN_FLIGHT_MAX));
    let read_requests = async {
        // The first frame must be a hello: no request is served before the client
        // knows this runtime's clock.
        match read_frame::<ClientMessage, _>(&mut reader).await? {
            ClientMessage::Hello(hello) => answer_hello(&hello, &handle, &responses).await?,
            ClientMessage::Request(_) => {
                return Err(FrameError::Handshake {
                    cause: "the first frame was a request, not a hello (an older or foreign client?)".to_string(),
                })
            }
        }
        loop {
            let slot = Arc::clone(&slots)
                .acquire_owned()
                .await
                .expect("the connection's request semaphore is never closed");
            let request = match read_frame::<ClientMessage, _>(&mut reader).await? {
                ClientMessage::Request(request) => request,
                ClientMessage::Hello(hello) => {
                    answer_hello(&hello, &handle, &responses).await?;
                    continue;
                }
            };
            let handle = handle.clone();
            let responses = responses.clone();
            tokio::spawn(async move {
                let response = tokio::select! {
                    biased;
                    // The connection closed: nobody can receive the reply. Dropping the
                    // call abandons it (unrun if it has not started) and releases its
                    // wait-for edge now rather than at its deadline.
                    () = responses.closed() => return,
                    response = serve_connection_request(&handle, request) => response,
                };
                // The connection may close meanwhile; the reply is then dropped.
                let _ = responses.send(response).await;
                drop(slot);
            });
        }
    };
    let ended: Result<(), FrameError> = tokio::select! {
        biased;
        _ = stopped.changed() => Ok(()),
        read = read_requests => read,
        written = write_frames(&mut writer, &mut response_queue) => written,
    };
    match ended {
        Ok(()) | Err(FrameError::Closed) => tracing::debug!(%peer, "transport connection closed"),
        Err(error) => tracing::warn!(%peer, %error, "transport connection closed on error"),
    }
}

/// Answers a hello with this runtime's clock reading, read now (after the hello
/// arrived, before the answer leaves: inside the client's round trip). Queues the
/// answer behind replies already queued, which only widens the client's bound.
///
/// # Errors
/// [`FrameError::Handshake`] when the client is not a Troupe client or speaks another
/// protocol version; a client of another version is answered first, so it can report
/// both versions. [`FrameError::Closed`] if the connection's writer is gone.
async fn answer_hello(
    hello: &Hello,
    handle: &RuntimeHandle,
    responses: &mpsc::Sender<Bytes>,
) -> Result<(), FrameError> {
    let refusal = hello.refusal();
    // A foreign peer gets no answer; a Troupe client of another version gets ours.
    if refusal.is_none() || hello.magic == WIRE_MAGIC {
        let ack = encode_frame(&ServerMessage::HelloAck(hello.ack(handle.now())))?;
        if responses.send(ack).await.is_err() {
            return Err(FrameError::Closed);
        }
    }
    match refusal {
        None => Ok(()),
        Some(cause) => {
            // Give the writer (polled beside this reader) a moment to send the answer
            // before the connection closes.
            let linger = Duration::from_millis(HANDSHAKE_REFUSAL_LINGER_MS);
            let _ = tokio::time::timeout(linger, responses.closed()).await;
            Err(FrameError::Handshake { cause })
        }
    }
}

/// Runs one request on the runtime and encodes its response frame. A request whose
/// deadline has passed on this runtime's clock is answered `Timeout` without running.
async fn serve_connection_request(handle: &RuntimeHandle, request: WireRequest) -> Bytes {
    let request_id = request.request_id;
    let target = request.target.clone();
    let result = match request.context(handle.now()) {
        Err(refused) => Err(refused),
        Ok(context) => {
            let caller = request.waiting_caller().cloned();
            let payload = request.payload;
            match caller {
                Some(caller) => handle.invoke_from(&caller, &target, payload, context, None).await,
                None => handle.invoke(&target, payload, context.deadline()).await,
            }
        }
    };
    match encode_frame(&ServerMessage::Response(WireResponse { request_id, result })) {
        Ok(frame) => frame,
        Err(error) => {
            let cause = format!("the reply cannot be sent: {error}");
            let result = Err(InvokeError::ActorFailed { target, cause });
            encode_frame(&ServerMessage::Response(WireResponse { request_id, result }))
                .expect("a response holding only an error fits a frame")
        }
    }
}
