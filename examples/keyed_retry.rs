//! A request that is safe to send again: an account actor on SQLite adds each deposit to
//! its balance, and every deposit carries an idempotency key (its deposit id). The same
//! deposit sent twice (as a client does when it lost the first reply or timed out) is
//! applied once: the second attempt gets the first one's reply, and so does an attempt
//! after the runtime restarted on the same file. A deposit under a new key is applied.
//! Deposits that arrive as fire-and-forget messages from a queue that may deliver one
//! twice are told under their id (`tell_keyed`): the duplicate changes nothing.
//!
//! Run it with `cargo run --example keyed_retry`. It prints each reply and the balance.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use troupe::core::{ActorId, ActorKind};
use troupe::runtime::{Actor, ActorBox, ActorError, IdempotencyKey, KindConfig, Runtime, SqliteStore, Turn};
use troupe::Bytes;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// A balance in cents, saved after every turn; a message is a deposit in cents (text).
struct Account(u64);

impl Actor for Account {
    async fn handle(&mut self, _turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        let cents: u64 = std::str::from_utf8(&payload)
            .ok()
            .and_then(|text| text.parse().ok())
            .ok_or_else(|| ActorError::rejected("a deposit is a number of cents"))?;
        self.0 += cents;
        Ok(Bytes::from(format!("deposited {cents}, balance {}", self.0)))
    }

    fn snapshot(&self) -> Result<Option<Bytes>, ActorError> {
        Ok(Some(Bytes::copy_from_slice(&self.0.to_le_bytes())))
    }
}

fn start(path: &Path) -> Result<Runtime, Error> {
    let runtime = Runtime::builder()
        .store(Arc::new(SqliteStore::open(path)?))
        .register(
            ActorKind::new("account")?,
            |_: &ActorId, saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
                let cents = match saved {
                    Some(bytes) => u64::from_le_bytes(
                        bytes[..]
                            .try_into()
                            .map_err(|_| ActorError::rejected("a saved balance is 8 bytes"))?,
                    ),
                    None => 0,
                };
                Ok(ActorBox::new(Account(cents)))
            },
            KindConfig::default(),
        )?
        .start();
    Ok(runtime)
}

async fn deposit(runtime: &Runtime, account: &ActorId, deposit_id: &str, cents: u64) -> Result<String, Error> {
    let key = IdempotencyKey::new(deposit_id)?;
    let deadline = runtime.deadline_in(Duration::from_secs(5));
    let reply = runtime
        .invoke_keyed(account, &key, Bytes::from(cents.to_string()), deadline)
        .await?;
    Ok(String::from_utf8(reply.to_vec())?)
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let directory = tempfile::tempdir()?;
    let path = directory.path().join("accounts.sqlite3");
    let account = ActorId::new("account", "alice")?;

    let runtime = start(&path)?;
    let first = deposit(&runtime, &account, "deposit-1", 500).await?;
    println!("deposit-1:       {first}");
    let again = deposit(&runtime, &account, "deposit-1", 500).await?;
    println!("deposit-1 again: {again}");
    assert_eq!(again, first, "the retry gets the first attempt's reply");
    println!(
        "deposit-2:       {}",
        deposit(&runtime, &account, "deposit-2", 250).await?
    );
    runtime.shutdown().await;

    let runtime = start(&path)?;
    let again = deposit(&runtime, &account, "deposit-2", 250).await?;
    println!("after a restart, deposit-2 again: {again}");
    assert_eq!(again, "deposited 250, balance 750", "a retry is answered, not applied");
    println!(
        "deposit-3:       {}",
        deposit(&runtime, &account, "deposit-3", 100).await?
    );

    // A queue delivers deposit-4 twice: told under its id, it is applied once.
    let key = IdempotencyKey::new("deposit-4")?;
    for _ in 0..2 {
        let deadline = runtime.deadline_in(Duration::from_secs(5));
        runtime.tell_keyed(&account, &key, Bytes::from("50"), deadline).await?;
    }
    // Sent after the tells, into the same mailbox: it runs after them.
    let balance = deposit(&runtime, &account, "deposit-5", 0).await?;
    println!("deposit-4 told twice, then deposit-5 of 0: {balance}");
    assert_eq!(balance, "deposited 0, balance 900", "deposit-4 applied once");
    runtime.shutdown().await;
    Ok(())
}
