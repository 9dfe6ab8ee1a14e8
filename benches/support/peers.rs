//! The same echo actor written with the Rust actor libraries users would pick instead of
//! Troupe (ractor, kameo), so the benchmarks measure them in the same run as Troupe and
//! the raw-tokio floor. Each is written the way its own documentation shows: a request
//! with a reply port (ractor's `call!`), a message with a reply (kameo's `ask`); and, for
//! fire-and-forget, a message without one (ractor's `cast`, kameo's `tell`), sent in a
//! batch closed by a request-reply, as Troupe's typed `tell` is measured.
//!
//! Their mailboxes as each library makes them by default: kameo's is bounded (64
//! messages, as Troupe's), ractor's unbounded (a `cast` never waits for room).

use bytes::Bytes;

/// ractor: an actor whose one message carries a reply port.
pub(crate) mod ractor_echo {
    use super::Bytes;
    use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

    /// The actor; it holds no state.
    pub(crate) struct Echo;

    /// Its messages.
    pub(crate) enum Message {
        /// Echo the payload back through the port.
        Echo(Bytes, RpcReplyPort<Bytes>),
        /// A fire-and-forget message: handled, nothing answered.
        Told(u64),
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
            match message {
                Message::Echo(payload, reply) => {
                    let _ = reply.send(payload);
                }
                Message::Told(message) => {
                    std::hint::black_box(message);
                }
            }
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

    /// `count` messages sent with `cast`, then one `call!`: when it is answered, all of
    /// them were handled.
    pub(crate) async fn tell_batch(actor: &ActorRef<Message>, count: u64) {
        for message in 0..count {
            ractor::cast!(actor, Message::Told(message)).expect("ractor cast");
        }
        ask(actor, Bytes::from_static(b"x")).await;
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

    /// A fire-and-forget message: handled, nothing answered.
    pub(crate) struct Told(pub(crate) u64);

    impl Message<Told> for Echo {
        type Reply = ();

        async fn handle(&mut self, message: Told, _ctx: &mut Context<Self, ()>) {
            std::hint::black_box(message.0);
        }
    }

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

    /// `count` messages sent with `tell` (each waits for room in the bounded mailbox),
    /// then one `ask`: when it is answered, all of them were handled.
    pub(crate) async fn tell_batch(actor: &ActorRef<Echo>, count: u64) {
        for message in 0..count {
            actor.tell(Told(message)).await.expect("kameo tell");
        }
        ask(actor, Bytes::from_static(b"x")).await;
    }
}
