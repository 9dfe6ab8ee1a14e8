//! A runtime actor with persisted state: a counter that lives on SQLite (in a temporary
//! directory), activates on first call, and comes back with its count after the
//! runtime is shut down and started again on the same file. It uses only `troupe` (and
//! `tokio`): `troupe::Bytes` comes from the facade.
//!
//! Run it with `cargo run --example counter_actor`. It prints the count after each
//! visit, then the count read back by a second runtime.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use troupe::core::{ActorId, ActorKind};
use troupe::runtime::{Actor, ActorBox, ActorError, KindConfig, Runtime, SqliteStore, Turn};
use troupe::Bytes;

/// A counter whose value is saved after every turn.
struct Counter(u64);

impl Actor for Counter {
    async fn handle(&mut self, _turn: &mut Turn, _payload: Bytes) -> Result<Bytes, ActorError> {
        self.0 += 1;
        Ok(Bytes::from(self.0.to_string()))
    }

    fn snapshot(&self) -> Result<Option<Bytes>, ActorError> {
        Ok(Some(Bytes::copy_from_slice(&self.0.to_le_bytes())))
    }
}

/// A runtime with the `counter` kind, on the SQLite file at `path`.
fn start(path: &Path) -> Result<Runtime, Box<dyn std::error::Error + Send + Sync>> {
    let store = SqliteStore::open(path)?;
    let runtime = Runtime::builder()
        .store(Arc::new(store))
        .register(
            ActorKind::new("counter")?,
            |_: &ActorId, saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
                let count = match saved {
                    Some(bytes) => u64::from_le_bytes(
                        bytes[..]
                            .try_into()
                            .map_err(|_| ActorError::rejected("a saved count is 8 bytes"))?,
                    ),
                    None => 0,
                };
                Ok(ActorBox::new(Counter(count)))
            },
            KindConfig::default(),
        )?
        .start();
    Ok(runtime)
}

async fn visit(runtime: &Runtime, id: &ActorId) -> Result<String, Box<dyn std::error::Error + Send + Sync>> {
    let reply = runtime
        .invoke(id, Bytes::new(), runtime.deadline_in(Duration::from_secs(5)))
        .await?;
    Ok(String::from_utf8(reply.to_vec())?)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let directory = tempfile::tempdir()?;
    let path = directory.path().join("counter.sqlite3");
    let id = ActorId::new("counter", "visits")?;

    let runtime = start(&path)?;
    for _ in 0..3 {
        println!("visits: {}", visit(&runtime, &id).await?);
    }
    runtime.shutdown().await;

    let runtime = start(&path)?;
    println!(
        "after a restart on the same file, visits: {}",
        visit(&runtime, &id).await?
    );
    runtime.shutdown().await;
    Ok(())
}
