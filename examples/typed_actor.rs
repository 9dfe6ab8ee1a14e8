//! A typed actor: values in process, state committed with bincode after each turn.
//! Run it with `cargo run --example typed_actor`; it prints `total = 42`.
use std::time::Duration;

use serde::{Deserialize, Serialize};
use troupe::core::{ActorId, ActorKind};
use troupe::runtime::{ActorError, KindConfig, Runtime, Turn, TypedActor};

#[derive(Default, Serialize, Deserialize)]
struct Counter {
    total: u64,
}

impl TypedActor for Counter {
    type Message = u64; // how much to add
    type Reply = u64; // the new total

    async fn handle(&mut self, _turn: &mut Turn, add: u64) -> Result<u64, ActorError> {
        self.total += add;
        Ok(self.total)
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let kind = ActorKind::new("counter")?;
    let runtime = Runtime::builder()
        .register_typed::<Counter>(kind, KindConfig::default())?
        .start();
    let counter = runtime.actor_ref::<Counter>(ActorId::new("counter", "c1")?)?;
    counter.tell(30, Duration::from_secs(5)).await?; // fire-and-forget
    let by = counter.deadline_in(Duration::from_secs(5)); // one clock reading for a batch
    for _ in 0..5 {
        counter.tell_by(2, by).await?;
    }
    let total = counter.ask(2, Duration::from_secs(5)).await?;
    println!("total = {total}");
    runtime.shutdown().await;
    Ok(())
}
