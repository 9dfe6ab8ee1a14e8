//! A PostgreSQL [`StateStore`](troupe_runtime::StateStore) for Troupe: runtimes on several
//! machines share one database, and fencing keeps a stale activation from overwriting
//! a newer one's state.
//!
//! See [`PostgresStore`] for the schema, the guarantees and the limits. Built only for the
//! real runtime: under the simulator (`--cfg madsim`) this crate is empty.

#[cfg(not(madsim))]
mod postgres_store;

#[cfg(not(madsim))]
pub use postgres_store::{
    HolderError, PostgresStore, POSTGRES_BATCH_BYTES_MAX, POSTGRES_CONNECT_TIMEOUT_MS, POSTGRES_POOL_SIZE,
    POSTGRES_POOL_WAIT_TIMEOUT_MS, POSTGRES_SCHEMA_VERSION,
};
#[cfg(not(madsim))]
pub use tokio_postgres;
