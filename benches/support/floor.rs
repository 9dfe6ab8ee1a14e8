//! The raw-tokio floor the runtime benchmarks compare with (a task that owns an mpsc
//! receiver and answers each request over its oneshot; for `tell`, a task that only
//! receives, with a request closing each batch), and the typed echo actor.

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};
use troupe::runtime::{ActorError, Turn, TypedActor};

/// One request to the floor's server: a payload and where to answer it.
pub(crate) type Request = (Bytes, oneshot::Sender<Bytes>);

/// One message to the tell floor's server: a payload and, for the batch's closing
/// request only, where to answer it.
pub(crate) type Told = (Bytes, Option<oneshot::Sender<Bytes>>);

/// Spawns the floor's server on the current runtime; it answers every request with its
/// payload until the sender is dropped.
pub(crate) fn spawn_floor_server() -> mpsc::Sender<Request> {
    let (sender, mut receiver) = mpsc::channel::<Request>(64);
    tokio::spawn(async move {
        while let Some((payload, reply)) = receiver.recv().await {
            let _ = reply.send(payload);
        }
    });
    sender
}

/// Spawns the relay floor's server: for every request it asks `next` (a floor server)
/// with the payload, over a new oneshot, and answers with `next`'s reply: the raw-tokio
/// shape of an actor whose turn calls another actor. (Not every bench that includes
/// this file uses it.)
#[allow(dead_code)]
pub(crate) fn spawn_relay_floor_server(next: mpsc::Sender<Request>) -> mpsc::Sender<Request> {
    let (sender, mut receiver) = mpsc::channel::<Request>(64);
    tokio::spawn(async move {
        while let Some((payload, reply)) = receiver.recv().await {
            let (asked, answer) = oneshot::channel();
            if next.send((payload, asked)).await.is_err() {
                break;
            }
            if let Ok(answered) = answer.await {
                let _ = reply.send(answered);
            }
        }
    });
    sender
}

/// Spawns the tell floor's server: it receives every message and answers the ones
/// that carry a reply channel (the request that closes a batch), until the sender is
/// dropped. Its own channel, so the invoke's floor keeps its message type.
pub(crate) fn spawn_tell_floor_server() -> mpsc::Sender<Told> {
    let (sender, mut receiver) = mpsc::channel::<Told>(64);
    tokio::spawn(async move {
        while let Some((payload, reply)) = receiver.recv().await {
            if let Some(reply) = reply {
                let _ = reply.send(payload);
            }
        }
    });
    sender
}

/// One request-reply round trip to a floor server.
pub(crate) async fn floor_round_trip(sender: &mpsc::Sender<Request>) {
    let (reply, answer) = oneshot::channel();
    sender.send((Bytes::from_static(b"x"), reply)).await.unwrap();
    answer.await.unwrap();
}

/// A batch of `count` told messages to a tell floor's server, each a raw bounded mpsc
/// send with nothing to answer, then one request-reply that shows all were received.
pub(crate) async fn floor_tell_batch(sender: &mpsc::Sender<Told>, count: u64) {
    for _ in 0..count {
        sender.send((Bytes::from_static(b"x"), None)).await.unwrap();
    }
    let (reply, answer) = oneshot::channel();
    sender.send((Bytes::from_static(b"x"), Some(reply))).await.unwrap();
    answer.await.unwrap();
}

/// Answers every message with the message itself; stateless.
#[derive(Default, serde::Serialize, serde::Deserialize)]
pub(crate) struct TypedEcho;

impl TypedActor for TypedEcho {
    type Message = u64;
    type Reply = u64;

    async fn handle(&mut self, _turn: &mut Turn, message: u64) -> Result<u64, ActorError> {
        Ok(message)
    }
}
