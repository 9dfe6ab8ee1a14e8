//! The raw-tokio floor the runtime benchmarks compare with (a task that owns an mpsc
//! receiver and answers each request over its oneshot), and the typed echo actor.

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};
use troupe::runtime::{ActorError, Turn, TypedActor};

/// One request to the floor's server: a payload and where to answer it.
pub(crate) type Request = (Bytes, oneshot::Sender<Bytes>);

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

/// One request-reply round trip to a floor server.
pub(crate) async fn floor_round_trip(sender: &mpsc::Sender<Request>) {
    let (reply, answer) = oneshot::channel();
    sender.send((Bytes::from_static(b"x"), reply)).await.unwrap();
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
