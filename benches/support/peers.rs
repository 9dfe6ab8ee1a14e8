//! The same echo actor written with the Rust actor libraries users would pick instead of
//! Troupe (ractor, kameo), so the benchmarks measure them in the same run as Troupe and
//! the raw-tokio floor. Each is written the way its own documentation shows: a request
//! with a reply port (ractor's `call!`), a message with a reply (kameo's `ask`).

use bytes::Bytes;

/// ractor: an actor whose one message carries a reply port.
pub(crate) mod ractor_echo {
    use super::Bytes;
    use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

    /// The actor; it holds no state.
    pub(crate) struct Echo;

    /// Its one message: echo the payload back through the port.
    pub(crate) enum Message {
        /// The payload and the reply port.
        Echo(Bytes, RpcReplyPort<Bytes>),
    }

    impl Actor for Echo {
        type Msg = Message;
        type State = ();
        type Arguments = ();

        async fn pre_start(&self, _myself: ActorRef<Message>, _args: ()) -> Result<(), ActorProcessingErr> {
            Ok(())
        }

        async fn handle(
            &self,
            _myself: ActorRef<Message>,
            message: Message,
            _state: &mut (),
        ) -> Result<(), ActorProcessingErr> {
            let Message::Echo(payload, reply) = message;
            let _ = reply.send(payload);
            Ok(())
        }
    }

    /// Spawns one unnamed echo actor.
    pub(crate) async fn spawn() -> ActorRef<Message> {
        let (actor, _handle) = Actor::spawn(None, Echo, ()).await.expect("ractor spawn");
        actor
    }

    /// One request-reply round trip.
    pub(crate) async fn ask(actor: &ActorRef<Message>, payload: Bytes) -> Bytes {
        ractor::call!(actor, Message::Echo, payload).expect("ractor call")
    }
}

/// kameo: an actor that handles `Bytes` with a `Bytes` reply.
pub(crate) mod kameo_echo {
    use super::Bytes;
    use kameo::actor::{ActorRef, Spawn};
    use kameo::message::{Context, Message};

    /// The actor; it holds no state.
    #[derive(kameo::Actor)]
    pub(crate) struct Echo;

    /// The reply: kameo replies must implement its `Reply` trait, which `Bytes` does not.
    #[derive(kameo::Reply)]
    pub(crate) struct Echoed(pub(crate) Bytes);

    impl Message<Bytes> for Echo {
        type Reply = Echoed;

        async fn handle(&mut self, payload: Bytes, _ctx: &mut Context<Self, Echoed>) -> Echoed {
            Echoed(payload)
        }
    }

    /// Spawns one echo actor.
    pub(crate) fn spawn() -> ActorRef<Echo> {
        <Echo as Spawn>::spawn(Echo)
    }

    /// One request-reply round trip.
    pub(crate) async fn ask(actor: &ActorRef<Echo>, payload: Bytes) -> Bytes {
        actor.ask(payload).await.expect("kameo ask").0
    }
}
