//! The PostgreSQL [`StateStore`]: one database shared by every runtime, fenced per actor.

use std::collections::BTreeMap;
use std::error::Error as StdError;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime};
use tokio_postgres::types::ToSql;
use tokio_postgres::NoTls;
use troupe_core::ActorId;
use troupe_runtime::{
    check_key, Claimed, Fence, FencedClaim, StateChange, StateStore, StoreError, StoreOperation, TurnCommit,
    STATE_SCAN_LIMIT_MAX,
};

/// The schema version this code writes and reads, stored in `troupe_schema.version`.
pub const POSTGRES_SCHEMA_VERSION: i64 = 2;

/// Connections one store keeps open at most (its pool's size), in connections. An
/// operation waits for a free connection when all are busy.
pub const POSTGRES_POOL_SIZE: usize = 8;

/// How long an operation waits for a free pooled connection before it fails, in
/// milliseconds.
pub const POSTGRES_POOL_WAIT_TIMEOUT_MS: u64 = 30_000;

/// How long opening one connection may take, in milliseconds, unless the connection
/// configuration sets its own `connect_timeout`.
pub const POSTGRES_CONNECT_TIMEOUT_MS: u64 = 10_000;

/// Most bytes of keys and values one `INSERT` statement of a commit carries; a commit
/// with more is sent as several statements (in its one transaction). Keeps each message
/// well under PostgreSQL's 1 GiB limit on one message and one value.
pub const POSTGRES_BATCH_BYTES_MAX: usize = 64 * 1024 * 1024;

/// The key of the transaction-level advisory lock that serializes schema creation
/// between stores connecting at once ("troupe" in ASCII).
const SCHEMA_LOCK_KEY: i64 = 0x7472_6f75_7065;

const CREATE_SCHEMA_TABLE: &str = "CREATE TABLE IF NOT EXISTS troupe_schema (version BIGINT NOT NULL)";

const CREATE_TABLES: &str = "
    CREATE TABLE troupe_actor_state (
        kind TEXT NOT NULL, key TEXT NOT NULL, state BYTEA NOT NULL,
        PRIMARY KEY (kind, key));
    CREATE TABLE troupe_actor_entry (
        kind TEXT NOT NULL, key TEXT NOT NULL, entry_key BYTEA NOT NULL, value BYTEA NOT NULL,
        PRIMARY KEY (kind, key, entry_key));
    CREATE TABLE troupe_actor_owner (
        kind TEXT NOT NULL, key TEXT NOT NULL, fence BIGINT NOT NULL,
        PRIMARY KEY (kind, key));";

/// Version 2 adds the fence log (version 1 databases are migrated by running this).
const CREATE_FENCE_LOG: &str = "
    CREATE TABLE troupe_fence_log (
        id BIGSERIAL PRIMARY KEY, event TEXT NOT NULL,
        kind TEXT NOT NULL, key TEXT NOT NULL, fence BIGINT NOT NULL,
        holder TEXT, at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp());
    CREATE INDEX troupe_fence_log_actor ON troupe_fence_log (kind, key, id);";

/// Logs the fence a claim just set (run after the claim's upsert, in its transaction,
/// under the owner row's lock, so the log's ids per actor follow the lock's order).
const LOG_CLAIM_OF_OWNER_ROW: &str = "
    INSERT INTO troupe_fence_log (event, kind, key, fence, holder)
    SELECT 'claim', kind, key, fence, $3 FROM troupe_actor_owner WHERE kind = $1 AND key = $2";

/// Logs one claim or commit under a given fence, in the claim's or commit's transaction.
const LOG_FENCE: &str = "INSERT INTO troupe_fence_log (event, kind, key, fence, holder) VALUES ($1, $2, $3, $4, $5)";

/// Issues the actor's next fence: 1 for an actor never claimed, else one more than the
/// newest. Takes the owner row's lock until the claim's transaction ends.
const CLAIM_NEXT_FENCE: &str = "
    INSERT INTO troupe_actor_owner (kind, key, fence) VALUES ($1, $2, 1)
    ON CONFLICT (kind, key) DO UPDATE SET fence = troupe_actor_owner.fence + 1
    RETURNING fence";
/// Makes `$3` the actor's fence if it is newer than the one it has (or it has none);
/// returns the fence only if it was set. Takes the owner row's lock either way (an
/// `ON CONFLICT DO UPDATE` locks the conflicting row even when its `WHERE` is false).
const CLAIM_GIVEN_FENCE: &str = "
    INSERT INTO troupe_actor_owner (kind, key, fence) VALUES ($1, $2, $3)
    ON CONFLICT (kind, key) DO UPDATE SET fence = EXCLUDED.fence WHERE troupe_actor_owner.fence < EXCLUDED.fence
    RETURNING fence";

const SELECT_STATE: &str = "SELECT state FROM troupe_actor_state WHERE kind = $1 AND key = $2";

const SELECT_FENCE: &str = "SELECT fence FROM troupe_actor_owner WHERE kind = $1 AND key = $2";

/// The fence check of a commit: the row lock keeps any claim out until the commit's
/// transaction ends, so no claim comes between the check and the writes.
const SELECT_FENCE_FOR_UPDATE: &str = "SELECT fence FROM troupe_actor_owner WHERE kind = $1 AND key = $2 FOR UPDATE";

const UPSERT_STATE: &str = "
    INSERT INTO troupe_actor_state (kind, key, state) VALUES ($1, $2, $3)
    ON CONFLICT (kind, key) DO UPDATE SET state = EXCLUDED.state";

const DELETE_STATE: &str = "DELETE FROM troupe_actor_state WHERE kind = $1 AND key = $2";

const UPSERT_ENTRIES: &str = "
    INSERT INTO troupe_actor_entry (kind, key, entry_key, value)
    SELECT $1, $2, entry_key, value FROM unnest($3::bytea[], $4::bytea[]) AS written (entry_key, value)
    ON CONFLICT (kind, key, entry_key) DO UPDATE SET value = EXCLUDED.value";

const DELETE_ENTRIES: &str =
    "DELETE FROM troupe_actor_entry WHERE kind = $1 AND key = $2 AND entry_key = ANY($3::bytea[])";

const SELECT_ENTRY: &str = "SELECT value FROM troupe_actor_entry WHERE kind = $1 AND key = $2 AND entry_key = $3";

/// `BYTEA` compares byte by byte, the order of Rust's `str`; keys with a prefix sort
/// together right from the prefix itself, so a scan reads from its lower bound on and
/// stops at the first key without the prefix.
const SCAN_FROM: &str = "
    SELECT entry_key, value FROM troupe_actor_entry
    WHERE kind = $1 AND key = $2 AND entry_key >= $3 ORDER BY entry_key LIMIT $4";

const SCAN_STRICTLY_AFTER: &str = "
    SELECT entry_key, value FROM troupe_actor_entry
    WHERE kind = $1 AND key = $2 AND entry_key > $3 ORDER BY entry_key LIMIT $4";

/// Why a holder name was refused ([`PostgresStore::with_holder`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HolderError {
    /// The name has a NUL byte, which PostgreSQL text cannot store.
    #[error(
        "the holder name {holder:?} has a NUL byte at byte {position}, which PostgreSQL text cannot store; \
         give a name without one"
    )]
    ContainsNul {
        /// The name given.
        holder: String,
        /// The byte offset of its first NUL.
        position: usize,
    },
}

impl From<HolderError> for StoreError {
    /// As a [`StoreError::Backend`] of [`StoreOperation::Open`], for a caller that
    /// reports every failure to open a store as one.
    fn from(error: HolderError) -> Self {
        StoreError::Backend {
            operation: StoreOperation::Open,
            cause: error.to_string(),
        }
    }
}

/// A [`StateStore`] on a PostgreSQL database, shared by every runtime that connects to it.
///
/// Schema (created by [`PostgresStore::connect`] if absent, in one transaction under an
/// advisory lock, so stores connecting at once do not race):
///
/// ```text
/// troupe_actor_state (kind TEXT, key TEXT, state BYTEA)                   PRIMARY KEY (kind, key)
/// troupe_actor_entry (kind TEXT, key TEXT, entry_key BYTEA, value BYTEA)  PRIMARY KEY (kind, key, entry_key)
/// troupe_actor_owner (kind TEXT, key TEXT, fence BIGINT)                  PRIMARY KEY (kind, key)
/// troupe_fence_log (id BIGSERIAL, event TEXT, kind TEXT, key TEXT,         PRIMARY KEY (id)
///                   fence BIGINT, holder TEXT, at TIMESTAMPTZ)
/// troupe_schema (version BIGINT)                                          one row: POSTGRES_SCHEMA_VERSION
/// ```
///
/// The fence log records every accepted claim (`event = 'claim'`), and every accepted
/// commit (`event = 'commit'`) if the store was built [`PostgresStore::with_commit_log`],
/// each with its fence, the store's [`PostgresStore::with_holder`] name and the database
/// clock (`clock_timestamp()`). The row is written in the claim's or commit's own
/// transaction under the actor's owner row lock, so it exists exactly when the claim or
/// commit was accepted, and per actor the ids follow the order the lock was granted in:
/// an audit can check that fences only grow and that no commit was accepted under a
/// fence older than a claim before it. The log is never pruned by Troupe: a claim adds
/// one row per activation (and a logged commit one per turn); delete old rows by `at`
/// as needed. A version 1 database is migrated to version 2 (the log is added) at
/// connect.
///
/// Guarantees:
/// - a claim is one transaction: an `INSERT … ON CONFLICT DO UPDATE … RETURNING` bumps the
///   actor's owner row (taking its row lock), then the state is read, after the lock was
///   taken, so it sees every commit that was accepted before the claim;
/// - a commit is one transaction: it reads the owner row `FOR UPDATE` and compares the
///   fence; if the fence is not the newest it is refused with [`StoreError::Fenced`]
///   (`held`: the commit's fence, `current`: the newest, or `None` for an actor never
///   claimed) and rolled back, writing nothing; else the state change and every write
///   are applied and committed together. Under the row lock no claim can come between
///   the check and the writes, in this process or any other;
/// - a commit that returned `Ok` is as durable as the server's `synchronous_commit`
///   setting makes it (on by default: flushed to the server's WAL);
/// - a database whose schema a newer Troupe wrote (a higher `troupe_schema.version`) is
///   refused with [`StoreError::Backend`] rather than read or migrated by guess;
/// - keys are `BYTEA`, so any Rust string is a key (NUL too), prefixes match byte for
///   byte and keys are ordered as bytes, the same order as Rust's `str`;
/// - every database error is a [`StoreError::Backend`] naming the operation, or, if it
///   passes (the connection refused, reset or closed, the server shutting down or
///   starting up, out of connection slots, a serialization failure or deadlock, no pooled
///   connection in time), a [`StoreError::Unavailable`] with the same text, which the
///   runtime tries again within the request's deadline; opening fails with `Backend`
///   only; none panics;
/// - a commit whose connection failed after its `COMMIT` was sent (`Unavailable`) may
///   have been applied; made again under the same fence it leaves the store as one
///   application would, since its writes are absolute values (or it is refused
///   `Fenced` if the actor was claimed since). A commit made again waits on the owner
///   row's lock for the first one's transaction, if the server still runs it, so the
///   two never interleave. With [`PostgresStore::with_commit_log`], a commit whose first
///   `COMMIT` was applied unseen and that is made again is logged twice, under the same
///   fence.
///
/// A commit's writes are applied in order by keeping the last write per key: a delete
/// and an upsert statement, each for many keys, whatever the number of writes (an
/// upsert is split at [`POSTGRES_BATCH_BYTES_MAX`]). Round trips: a commit takes three
/// (`BEGIN`; the fence check pipelined with the writes; `COMMIT`), a claim three
/// (`BEGIN`; the fence bump pipelined with the state read; `COMMIT`), an empty commit
/// one (it only reads the fence), a read one.
///
/// Clones share one pool of at most [`POSTGRES_POOL_SIZE`] connections. Connections are
/// plain TCP or Unix sockets (`NoTls`): put the database on a trusted network, or in
/// front of it a TLS proxy. Dropping an operation's future rolls its transaction back,
/// unless its `COMMIT` was already sent.
#[derive(Clone)]
pub struct PostgresStore {
    pool: Pool,
    /// Written in the fence log's `holder` column.
    holder: Option<Arc<str>>,
    /// Whether accepted commits are written to the fence log too.
    log_commits: bool,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let status = self.pool.status();
        f.debug_struct("PostgresStore")
            .field("pool_size", &status.size)
            .field("pool_available", &status.available)
            .field("holder", &self.holder)
            .field("log_commits", &self.log_commits)
            .finish()
    }
}

impl PostgresStore {
    /// Connects to the database that `config` names, either a URL
    /// (`postgresql://user@host:port/db`) or `key=value` pairs (`host=… port=… user=…
    /// dbname=…`), and creates the schema if the database has none.
    ///
    /// # Errors
    /// [`StoreError::Backend`] with [`StoreOperation::Open`] if `config` does not parse,
    /// no connection can be made, the schema cannot be created, or the database holds a
    /// schema version newer than [`POSTGRES_SCHEMA_VERSION`].
    pub async fn connect(config: &str) -> Result<Self, StoreError> {
        let config: tokio_postgres::Config = config.parse().map_err(backend(StoreOperation::Open))?;
        Self::connect_with_config(config).await
    }

    /// Like [`PostgresStore::connect`], with an already built configuration.
    ///
    /// # Errors
    /// As [`PostgresStore::connect`].
    pub async fn connect_with_config(mut config: tokio_postgres::Config) -> Result<Self, StoreError> {
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(Duration::from_millis(POSTGRES_CONNECT_TIMEOUT_MS));
        }
        let manager = Manager::from_config(
            config,
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(POSTGRES_POOL_SIZE)
            .wait_timeout(Some(Duration::from_millis(POSTGRES_POOL_WAIT_TIMEOUT_MS)))
            .create_timeout(Some(Duration::from_millis(POSTGRES_CONNECT_TIMEOUT_MS)))
            .runtime(Runtime::Tokio1)
            .build()
            .map_err(backend(StoreOperation::Open))?;
        let store = Self {
            pool,
            holder: None,
            log_commits: false,
        };
        store.create_schema().await?;
        Ok(store)
    }

    /// Names this store's claims (and logged commits) in the fence log's `holder`
    /// column, e.g. with the node's name.
    ///
    /// # Errors
    /// [`HolderError::ContainsNul`] if `holder` has a NUL byte, which a PostgreSQL
    /// `TEXT` column cannot store (every claim would fail with an encoding error); the
    /// store is dropped.
    pub fn with_holder(mut self, holder: impl Into<String>) -> Result<Self, HolderError> {
        let holder = holder.into();
        if let Some(position) = holder.bytes().position(|byte| byte == 0) {
            return Err(HolderError::ContainsNul { holder, position });
        }
        self.holder = Some(Arc::from(holder));
        Ok(self)
    }

    /// Also writes every accepted commit to the fence log (one more row per turn that
    /// writes, in the commit's transaction, pipelined with its other statements). Off
    /// by default; claims are always logged.
    pub fn with_commit_log(mut self, log_commits: bool) -> Self {
        self.log_commits = log_commits;
        self
    }

    /// This store's identity, for `troupe_etcd::EtcdConfig::with_store_identity`:
    /// `postgresql:<system_identifier>/<database>`, where `system_identifier` is the
    /// number `initdb` gave the server's data directory (`pg_control_system()`, readable
    /// by every role). Every connection to one database gives the same identity,
    /// whatever host name, port or user it uses; another database or another server
    /// gives another. A physical replica shares its primary's system identifier, so a
    /// failover to it keeps the identity; a dump restored into another server, or a
    /// renamed database, has a new one.
    ///
    /// # Errors
    /// [`StoreError::Backend`] with [`StoreOperation::Open`] if the server cannot be
    /// asked.
    pub async fn identity(&self) -> Result<String, StoreError> {
        let operation = StoreOperation::Open;
        let client = self.client(operation).await?;
        let row = client
            .query_one(
                "SELECT system_identifier::text, current_database()::text FROM pg_control_system()",
                &[],
            )
            .await
            .map_err(backend(operation))?;
        let system: String = row.try_get(0).map_err(backend(operation))?;
        let database: String = row.try_get(1).map_err(backend(operation))?;
        Ok(format!("postgresql:{system}/{database}"))
    }

    async fn create_schema(&self) -> Result<(), StoreError> {
        let operation = StoreOperation::Open;
        let mut client = self.client(operation).await?;
        let transaction = client.transaction().await.map_err(backend(operation))?;
        transaction
            .execute("SELECT pg_advisory_xact_lock($1)", &[&SCHEMA_LOCK_KEY])
            .await
            .map_err(backend(operation))?;
        transaction
            .batch_execute(CREATE_SCHEMA_TABLE)
            .await
            .map_err(backend(operation))?;
        let versions: Vec<i64> = transaction
            .query("SELECT version FROM troupe_schema", &[])
            .await
            .map_err(backend(operation))?
            .iter()
            .map(|row| row.try_get(0))
            .collect::<Result<_, _>>()
            .map_err(backend(operation))?;
        match versions.as_slice() {
            [] => {
                transaction
                    .batch_execute(CREATE_TABLES)
                    .await
                    .map_err(backend(operation))?;
                transaction
                    .batch_execute(CREATE_FENCE_LOG)
                    .await
                    .map_err(backend(operation))?;
                transaction
                    .execute(
                        "INSERT INTO troupe_schema (version) VALUES ($1)",
                        &[&POSTGRES_SCHEMA_VERSION],
                    )
                    .await
                    .map_err(backend(operation))?;
            }
            [version] if *version == POSTGRES_SCHEMA_VERSION => {}
            [1] => {
                transaction
                    .batch_execute(CREATE_FENCE_LOG)
                    .await
                    .map_err(backend(operation))?;
                transaction
                    .execute("UPDATE troupe_schema SET version = $1", &[&POSTGRES_SCHEMA_VERSION])
                    .await
                    .map_err(backend(operation))?;
            }
            [version] => {
                return Err(StoreError::Backend {
                    operation,
                    cause: format!(
                        "the database holds Troupe schema version {version}; this Troupe reads version \
                         {POSTGRES_SCHEMA_VERSION} only"
                    ),
                })
            }
            _ => {
                return Err(StoreError::Backend {
                    operation,
                    cause: format!("troupe_schema holds {} rows, not one", versions.len()),
                })
            }
        }
        transaction.commit().await.map_err(backend(operation))
    }

    /// A pooled connection, for `operation`'s errors.
    async fn client(&self, operation: StoreOperation) -> Result<Object, StoreError> {
        self.pool.get().await.map_err(backend(operation))
    }
}

/// A backend error for `operation`, with the error's whole chain of causes (a
/// `tokio_postgres::Error` says only "db error" on its own): [`StoreError::Unavailable`]
/// if it is one that passes ([`is_transient`]) and the store is open, else
/// [`StoreError::Backend`]. Opening keeps `Backend` for every failure: a store that
/// cannot open is the embedder's to retry, and says why once.
fn backend<E: StdError + 'static>(operation: StoreOperation) -> impl Fn(E) -> StoreError {
    move |error| {
        let mut cause = error.to_string();
        let mut source = error.source();
        while let Some(inner) = source {
            cause.push_str(": ");
            cause.push_str(&inner.to_string());
            source = inner.source();
        }
        if operation != StoreOperation::Open && is_transient(&error) {
            StoreError::Unavailable { operation, cause }
        } else {
            StoreError::Backend { operation, cause }
        }
    }
}

/// Whether `error` is one that passes, so that the same operation may succeed if tried
/// again soon: the connection closed, refused, reset or timed out; the server shutting
/// down, starting up, out of connection slots; a transaction rolled back for a
/// serialization failure or a deadlock; no pooled connection in time. Any other error
/// (SQL, a constraint, a decode, a configuration) is not.
///
/// Whatever the step that failed, trying the operation again is safe: a claim that the
/// server applied unseen only wasted a fence (the next claim issues a newer one, and a
/// cluster node places the actor anew before it claims again), and a commit is a set of
/// absolute writes under one fence, so making it again leaves the store as one
/// application would (see [`StoreError::Unavailable`]).
fn is_transient(error: &(dyn StdError + 'static)) -> bool {
    if let Some(error) = error.downcast_ref::<tokio_postgres::Error>() {
        return postgres_error_is_transient(error);
    }
    if let Some(error) = error.downcast_ref::<deadpool_postgres::PoolError>() {
        return match error {
            deadpool_postgres::PoolError::Timeout(_) => true,
            deadpool_postgres::PoolError::Backend(error) => postgres_error_is_transient(error),
            deadpool_postgres::PoolError::PostCreateHook(deadpool_postgres::HookError::Backend(error)) => {
                postgres_error_is_transient(error)
            }
            _ => false,
        };
    }
    false
}

fn postgres_error_is_transient(error: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    if error.is_closed() {
        return true;
    }
    if let Some(code) = error.code() {
        return *code == SqlState::ADMIN_SHUTDOWN
            || *code == SqlState::CRASH_SHUTDOWN
            || *code == SqlState::CANNOT_CONNECT_NOW
            || *code == SqlState::TOO_MANY_CONNECTIONS
            || *code == SqlState::T_R_SERIALIZATION_FAILURE
            || *code == SqlState::T_R_DEADLOCK_DETECTED
            // Class 08, connection exception.
            || code.code().starts_with("08");
    }
    // An I/O error on the connection, or of connecting (a connect timeout is one too:
    // `TimedOut`).
    let mut source = StdError::source(error);
    while let Some(inner) = source {
        if let Some(io) = inner.downcast_ref::<std::io::Error>() {
            return matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionRefused
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::NotConnected
                    | std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::UnexpectedEof
                    | std::io::ErrorKind::TimedOut
                    | std::io::ErrorKind::Interrupted
            );
        }
        source = inner.source();
    }
    false
}

/// A fence read from `troupe_actor_owner`, which holds only fences a claim issued.
fn fence_from_column(operation: StoreOperation, token: i64) -> Result<Fence, StoreError> {
    u64::try_from(token)
        .ok()
        .and_then(Fence::from_token)
        .ok_or_else(|| StoreError::Backend {
            operation,
            cause: format!("troupe_actor_owner holds fence {token}, which no claim issues"),
        })
}

/// An entry key read back from its `BYTEA` column; every key was written from a `str`.
fn key_from_column(operation: StoreOperation, key: Vec<u8>) -> Result<String, StoreError> {
    String::from_utf8(key).map_err(|error| StoreError::Backend {
        operation,
        cause: format!("troupe_actor_entry holds a key that is not UTF-8: {error}"),
    })
}

/// One upsert statement's keys and values, in the same order.
type WriteBatch<'commit> = (Vec<&'commit [u8]>, Vec<&'commit [u8]>);

/// A commit's writes as the keys to delete and batches of keys and values to upsert, of
/// at most [`POSTGRES_BATCH_BYTES_MAX`] bytes each (unless one entry alone is larger).
/// The writes apply in order, so the last write to each key is the one that stays; each
/// key appears once, which `INSERT … ON CONFLICT DO UPDATE` requires of one statement.
fn write_batches(writes: &[(String, Option<Bytes>)]) -> (Vec<&[u8]>, Vec<WriteBatch<'_>>) {
    let mut last_writes: BTreeMap<&[u8], Option<&[u8]>> = BTreeMap::new();
    for (entry_key, value) in writes {
        last_writes.insert(entry_key.as_bytes(), value.as_deref());
    }
    let mut deleted = Vec::new();
    let mut batches: Vec<WriteBatch<'_>> = Vec::new();
    let mut batch_bytes = 0_usize;
    for (entry_key, value) in last_writes {
        let Some(value) = value else {
            deleted.push(entry_key);
            continue;
        };
        let entry_bytes = entry_key.len() + value.len();
        match batches.last_mut() {
            Some((keys, values)) if batch_bytes + entry_bytes <= POSTGRES_BATCH_BYTES_MAX => {
                keys.push(entry_key);
                values.push(value);
                batch_bytes += entry_bytes;
            }
            _ => {
                batches.push((vec![entry_key], vec![value]));
                batch_bytes = entry_bytes;
            }
        }
    }
    (deleted, batches)
}

#[async_trait]
impl FencedClaim for PostgresStore {
    async fn claim_with_fence(&self, actor: &ActorId, fence: Fence) -> Result<Claimed, StoreError> {
        let operation = StoreOperation::Claim;
        let Ok(token) = i64::try_from(fence.token()) else {
            return Err(StoreError::Backend {
                operation,
                cause: format!("{fence} does not fit the fence column (at most {})", i64::MAX),
            });
        };
        let (kind, key) = (actor.kind().as_str(), actor.key());
        let mut client = self.client(operation).await?;
        let transaction = client.transaction().await.map_err(backend(operation))?;
        let accepted = transaction
            .query_opt(CLAIM_GIVEN_FENCE, &[&kind, &key, &token])
            .await
            .map_err(backend(operation))?;
        if accepted.is_none() {
            let current: Option<i64> = transaction
                .query_opt(SELECT_FENCE, &[&kind, &key])
                .await
                .and_then(|row| row.map(|row| row.try_get(0)).transpose())
                .map_err(backend(operation))?;
            // Dropping the transaction rolls it back; it changed nothing.
            return Err(StoreError::Fenced {
                actor: actor.clone(),
                held: fence,
                current: current.map(|token| fence_from_column(operation, token)).transpose()?,
            });
        }
        // Read after the owner row's lock was granted, as in `claim`.
        let holder = self.holder.as_deref();
        let log_columns: [&(dyn ToSql + Sync); 5] = [&"claim", &kind, &key, &token, &holder];
        let actor_columns: [&(dyn ToSql + Sync); 2] = [&kind, &key];
        let (logged, state) = futures::join!(
            transaction.execute(LOG_FENCE, &log_columns),
            transaction.query_opt(SELECT_STATE, &actor_columns),
        );
        logged.map_err(backend(operation))?;
        let state: Option<Vec<u8>> = state
            .and_then(|row| row.map(|row| row.try_get(0)).transpose())
            .map_err(backend(operation))?;
        transaction.commit().await.map_err(backend(operation))?;
        Ok(Claimed {
            fence,
            state: state.map(Bytes::from),
        })
    }
}

#[async_trait]
impl StateStore for PostgresStore {
    async fn claim(&self, actor: &ActorId) -> Result<Claimed, StoreError> {
        let operation = StoreOperation::Claim;
        let (kind, key) = (actor.kind().as_str(), actor.key());
        let mut client = self.client(operation).await?;
        let transaction = client.transaction().await.map_err(backend(operation))?;
        let claim = transaction
            .prepare_cached(CLAIM_NEXT_FENCE)
            .await
            .map_err(backend(operation))?;
        let select = transaction
            .prepare_cached(SELECT_STATE)
            .await
            .map_err(backend(operation))?;
        // Pipelined, in this order (`join!` polls its futures in the order given, and
        // each sends its statement when first polled): the server runs the read after
        // the upsert, and under READ COMMITTED it reads a snapshot taken after the
        // owner row's lock was granted, so every commit accepted before this claim is
        // in it.
        let log = transaction
            .prepare_cached(LOG_CLAIM_OF_OWNER_ROW)
            .await
            .map_err(backend(operation))?;
        let actor_columns: [&(dyn ToSql + Sync); 2] = [&kind, &key];
        let holder = self.holder.as_deref();
        let log_columns: [&(dyn ToSql + Sync); 3] = [&kind, &key, &holder];
        let (token, state, logged) = futures::join!(
            transaction.query_one(&claim, &actor_columns),
            transaction.query_opt(&select, &actor_columns),
            transaction.execute(&log, &log_columns),
        );
        let token: i64 = token.and_then(|row| row.try_get(0)).map_err(backend(operation))?;
        logged.map_err(backend(operation))?;
        let state: Option<Vec<u8>> = state
            .and_then(|row| row.map(|row| row.try_get(0)).transpose())
            .map_err(backend(operation))?;
        transaction.commit().await.map_err(backend(operation))?;
        Ok(Claimed {
            fence: fence_from_column(operation, token)?,
            state: state.map(Bytes::from),
        })
    }

    async fn load(&self, actor: &ActorId) -> Result<Option<Bytes>, StoreError> {
        let operation = StoreOperation::Load;
        let client = self.client(operation).await?;
        let select = client.prepare_cached(SELECT_STATE).await.map_err(backend(operation))?;
        let state: Option<Vec<u8>> = client
            .query_opt(&select, &[&actor.kind().as_str(), &actor.key()])
            .await
            .and_then(|row| row.map(|row| row.try_get(0)).transpose())
            .map_err(backend(operation))?;
        Ok(state.map(Bytes::from))
    }

    async fn commit(&self, actor: &ActorId, fence: Fence, commit: TurnCommit) -> Result<(), StoreError> {
        let operation = StoreOperation::Commit;
        commit.validate()?;
        let (kind, key) = (actor.kind().as_str(), actor.key());
        let held = i64::try_from(fence.token()).ok();
        let mut client = self.client(operation).await?;
        let fenced = |current: Option<i64>| -> StoreError {
            match current.map(|token| fence_from_column(operation, token)).transpose() {
                Ok(current) => StoreError::Fenced {
                    actor: actor.clone(),
                    held: fence,
                    current,
                },
                Err(error) => error,
            }
        };

        if commit.is_empty() {
            // Nothing to write: a plain read of the newest fence is the whole check.
            drop(client);
            return self.check_fence(actor, fence).await;
        }

        let transaction = client.transaction().await.map_err(backend(operation))?;
        let check_statement = transaction
            .prepare_cached(SELECT_FENCE_FOR_UPDATE)
            .await
            .map_err(backend(operation))?;
        let (state_bytes, state_statement) = match &commit.state {
            StateChange::Unchanged => (None, None),
            StateChange::Set(state) => (Some(state.as_ref()), Some(UPSERT_STATE)),
            StateChange::Deleted => (None, Some(DELETE_STATE)),
        };
        let state_statement = match state_statement {
            Some(sql) => Some(transaction.prepare_cached(sql).await.map_err(backend(operation))?),
            None => None,
        };
        let log_statement = match (self.log_commits, held) {
            (true, Some(_)) => Some(
                transaction
                    .prepare_cached(LOG_FENCE)
                    .await
                    .map_err(backend(operation))?,
            ),
            _ => None,
        };
        let (deleted, batches) = write_batches(&commit.writes);
        let delete_statement = match deleted.is_empty() {
            true => None,
            false => Some(
                transaction
                    .prepare_cached(DELETE_ENTRIES)
                    .await
                    .map_err(backend(operation))?,
            ),
        };
        let upsert_statement = match batches.is_empty() {
            true => None,
            false => Some(
                transaction
                    .prepare_cached(UPSERT_ENTRIES)
                    .await
                    .map_err(backend(operation))?,
            ),
        };

        // The fence check and the writes are pipelined: sent together, run by the server
        // one after the other in this transaction. Whatever the order, the check's row
        // lock is held until the transaction ends, so a claim either came before the
        // check (which then sees its newer fence, and the writes are rolled back) or
        // waits for this commit (and then reads its writes).
        let actor_columns: [&(dyn ToSql + Sync); 2] = [&kind, &key];
        let check = transaction.query_opt(&check_statement, &actor_columns);
        let state_write = async {
            match (&state_statement, state_bytes) {
                (None, _) => Ok(0),
                (Some(statement), Some(state)) => transaction.execute(statement, &[&kind, &key, &state]).await,
                (Some(statement), None) => transaction.execute(statement, &[&kind, &key]).await,
            }
        };
        let entry_deletes = async {
            match &delete_statement {
                None => Ok(0),
                Some(statement) => transaction.execute(statement, &[&kind, &key, &deleted]).await,
            }
        };
        let entry_upserts = async {
            let mut rows = 0;
            if let Some(statement) = &upsert_statement {
                for (batch_keys, batch_values) in &batches {
                    rows += transaction
                        .execute(statement, &[&kind, &key, batch_keys, batch_values])
                        .await?;
                }
            }
            Ok::<_, tokio_postgres::Error>(rows)
        };
        let holder = self.holder.as_deref();
        let commit_logged = async {
            match (&log_statement, held) {
                (Some(statement), Some(token)) => {
                    transaction
                        .execute(statement, &[&"commit", &kind, &key, &token, &holder])
                        .await
                }
                _ => Ok(0),
            }
        };
        let (current, state_written, entries_deleted, entries_upserted, logged) =
            futures::join!(check, state_write, entry_deletes, entry_upserts, commit_logged);
        let current: Option<i64> = current
            .and_then(|row| row.map(|row| row.try_get(0)).transpose())
            .map_err(backend(operation))?;
        if current.is_none() || current != held {
            // Dropping the transaction rolls it back: none of the writes is visible.
            return Err(fenced(current));
        }
        state_written.map_err(backend(operation))?;
        entries_deleted.map_err(backend(operation))?;
        entries_upserted.map_err(backend(operation))?;
        logged.map_err(backend(operation))?;
        // Dropping the transaction on an error above rolls all of it back.
        transaction.commit().await.map_err(backend(operation))
    }

    /// One read of the actor's newest fence (no row lock): what an empty commit checks.
    /// A round trip to the server, which a turn pays before its expensive work
    /// (`Turn::check_fence`) rather than after it.
    async fn check_fence(&self, actor: &ActorId, fence: Fence) -> Result<(), StoreError> {
        let operation = StoreOperation::Commit;
        let (kind, key) = (actor.kind().as_str(), actor.key());
        let held = i64::try_from(fence.token()).ok();
        let client = self.client(operation).await?;
        let select = client.prepare_cached(SELECT_FENCE).await.map_err(backend(operation))?;
        let current: Option<i64> = client
            .query_opt(&select, &[&kind, &key])
            .await
            .and_then(|row| row.map(|row| row.try_get(0)).transpose())
            .map_err(backend(operation))?;
        if current.is_some() && current == held {
            return Ok(());
        }
        let current = current.map(|token| fence_from_column(operation, token)).transpose()?;
        Err(StoreError::Fenced {
            actor: actor.clone(),
            held: fence,
            current,
        })
    }

    async fn get(&self, actor: &ActorId, key: &str) -> Result<Option<Bytes>, StoreError> {
        let operation = StoreOperation::Get;
        check_key(key)?;
        let client = self.client(operation).await?;
        let select = client.prepare_cached(SELECT_ENTRY).await.map_err(backend(operation))?;
        let value: Option<Vec<u8>> = client
            .query_opt(&select, &[&actor.kind().as_str(), &actor.key(), &key.as_bytes()])
            .await
            .and_then(|row| row.map(|row| row.try_get(0)).transpose())
            .map_err(backend(operation))?;
        Ok(value.map(Bytes::from))
    }

    async fn scan(
        &self,
        actor: &ActorId,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Bytes)>, StoreError> {
        let operation = StoreOperation::Scan;
        check_key(prefix)?;
        let limit = limit.min(STATE_SCAN_LIMIT_MAX);
        if limit == 0 {
            return Ok(Vec::new());
        }
        let (lower_bound, select) = match after {
            Some(after) if after >= prefix => (after, SCAN_STRICTLY_AFTER),
            _ => (prefix, SCAN_FROM),
        };
        let limit = i64::try_from(limit).map_err(backend(operation))?;
        let client = self.client(operation).await?;
        let select = client.prepare_cached(select).await.map_err(backend(operation))?;
        let rows = client
            .query(
                &select,
                &[&actor.kind().as_str(), &actor.key(), &lower_bound.as_bytes(), &limit],
            )
            .await
            .map_err(backend(operation))?;
        let mut entries = Vec::with_capacity(rows.len());
        for row in rows {
            let entry_key: Vec<u8> = row.try_get(0).map_err(backend(operation))?;
            if !entry_key.starts_with(prefix.as_bytes()) {
                break;
            }
            let value: Vec<u8> = row.try_get(1).map_err(backend(operation))?;
            entries.push((key_from_column(operation, entry_key)?, Bytes::from(value)));
        }
        Ok(entries)
    }
}
