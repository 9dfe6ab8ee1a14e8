//! Typed actors calling typed actors: a till asks a ledger from inside its turn.
//! Run it with `cargo run --example typed_calls`; it prints `balance = 15`.
use std::time::Duration;

use serde::{Deserialize, Serialize};
use troupe::core::{ActorId, ActorKind};
use troupe::runtime::{ActorError, KindConfig, Runtime, Turn, TypedActor};

const TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Default, Serialize, Deserialize)]
struct Ledger {
    balance: i64,
}

impl TypedActor for Ledger {
    type Message = i64; // an amount to add
    type Reply = i64; // the new balance

    async fn handle(&mut self, _turn: &mut Turn, amount: i64) -> Result<i64, ActorError> {
        self.balance += amount;
        Ok(self.balance)
    }
}

/// Takes a sale and books it in the ledger named by its own key.
#[derive(Default, Serialize, Deserialize)]
struct Till;

impl TypedActor for Till {
    type Message = i64; // a sale
    type Reply = i64; // the ledger's balance after it

    async fn handle(&mut self, turn: &mut Turn, sale: i64) -> Result<i64, ActorError> {
        let ledger = turn.actor_ref::<Ledger>(ActorId::new("ledger", turn.id().key())?)?;
        // A call of this turn: depth + 1, cycle check, deadline within this turn's.
        Ok(ledger.ask_from(turn.caller(), sale, TIMEOUT).await?)
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let runtime = Runtime::builder()
        .register_typed::<Ledger>(ActorKind::new("ledger")?, KindConfig::default())?
        .register_typed::<Till>(ActorKind::new("till")?, KindConfig::default())?
        .start();
    let till = runtime.actor_ref::<Till>(ActorId::new("till", "shop")?)?;
    till.ask(10, TIMEOUT).await?;
    let balance = till.ask(5, TIMEOUT).await?;
    println!("balance = {balance}");
    assert_eq!(balance, 15);
    runtime.shutdown().await;
    Ok(())
}
