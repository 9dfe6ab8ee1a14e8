//! A typed actor: `cargo run --example typed_actor` prints `total = 42`.
use std::time::Duration;
use troupe::core::{ActorId, ActorKind};
use troupe::runtime::{ActorError, KindConfig, Runtime, Turn, TypedActor};

#[derive(Default, serde::Serialize, serde::Deserialize)]
struct Counter(u64); // the actor is its state, saved with bincode after each turn

impl TypedActor for Counter {
    type Message = u64; // how much to add
    type Reply = u64; // the new total
    async fn handle(&mut self, _turn: &mut Turn, add: u64) -> Result<u64, ActorError> {
        self.0 += add;
        Ok(self.0)
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let runtime = Runtime::builder()
        .register_typed::<Counter>(ActorKind::new("counter")?, KindConfig::default())?
        .start();
    let counter = runtime.actor_ref::<Counter>(ActorId::new("counter", "c1")?)?;
    let tells = (0..20).map(|_| counter.tell(2, Duration::from_secs(5))); // fire-and-forget
    futures::future::try_join_all(tells).await?; // (`tell_by` shares one deadline: README)
    println!("total = {}", counter.ask(2, Duration::from_secs(5)).await?);
    runtime.shutdown().await;
    Ok(())
}
