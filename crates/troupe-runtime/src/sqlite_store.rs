//! The embedded durable [`StateStore`]: one SQLite file that a user can open with `sqlite3`.
//!
//! Owns the file and its schema:
//!
//! ```text
//! actor_state (kind, key, state)             PRIMARY KEY (kind, key)             one state blob per actor
//! actor_entry (kind, key, entry_key, value)  PRIMARY KEY (kind, key, entry_key)  the actor's key-value space
//! actor_owner (kind, key, fence)             PRIMARY KEY (kind, key)             the actor's newest fence (v2)
//! troupe_meta (name, value)                  PRIMARY KEY (name)                  the store's identity (see below)
//! PRAGMA user_version = SQLITE_SCHEMA_VERSION
//! ```
//!
//! **Identity.** A file keeps its identity ([`SqliteStore::identity`]) in `troupe_meta`,
//! written once, when the store creates its schema in the file:
//! `sqlite:<microseconds since the Unix epoch at creation>:<the file's canonical path
//! then>`, read from the runtime's [`crate::Clock`] (the simulator's wall clock under
//! madsim). So the identity survives a move or a rename of the file, a copy keeps it,
//! and two files created at one path one after another (deleted in between) differ, as
//! long as the wall clock moved between their creations. A file that has Troupe's
//! schema but no identity yet (created before identities were stored) gets
//! `sqlite:<its canonical path>` on its first open, the identity computed from its path
//! before: a cluster name bound to it stays bound to it. Adding `troupe_meta` keeps
//! the schema version (older builds open such a file and ignore the table).
//!
//! Guarantees:
//! - a commit is one SQLite transaction: its state and all its writes become visible, and
//!   durable, together or not at all; a commit refused by [`TurnCommit::validate`] touches
//!   nothing;
//! - fencing holds across processes and across stores opened on one file: a claim bumps
//!   the actor's row in `actor_owner` and reads its state in one `BEGIN IMMEDIATE`
//!   transaction, and a commit compares its fence with that row in the same write
//!   transaction that applies it, so the comparison and the writes cannot be split by
//!   another writer;
//! - a commit that returned `Ok` survives a crash or power loss: the file runs in WAL
//!   journal mode with `synchronous = FULL`;
//! - a file written by a newer Troupe (a higher `user_version`) is refused with
//!   [`StoreError::Backend`] rather than read or migrated by guess;
//! - an operation that waited for another connection's lock on the file (another
//!   process, `sqlite3`) longer than the busy timeout (`SQLITE_BUSY_TIMEOUT_MS`) fails
//!   with [`StoreError::Unavailable`] ("database is locked"), having written nothing,
//!   and the runtime tries it again within the request's deadline; every other SQLite
//!   error is [`StoreError::Backend`];
//! - [`StateStore::scan`] matches prefixes byte for byte, so `%` and `_` in keys are
//!   ordinary characters, and keys are ordered as bytes, the same order as Rust's `str`.
//!
//! Every operation runs on a blocking thread through `tokio::task::spawn_blocking`
//! (inline under madsim); clones share one connection behind a mutex, so operations on
//! one store run one at a time. Dropping an operation's future does not stop its
//! blocking work: a commit whose caller gave up may still be applied, whole.
//!
//! Version 1 files (no `actor_owner`) are upgraded in place when opened: the table is
//! created empty, and each actor's first claim issues [`Fence::FIRST`].
//!
//! Determinism under the simulator (`--cfg madsim`), where two runs of one seed must
//! draw the same random numbers at the same virtual times:
//! - rusqlite's statement cache hashes SQL with `ahash`, whose process-wide seeds come
//!   from `getrandom` on first use; madsim serves `getrandom` from the simulation's
//!   generator, so the first simulation in a process drew once more than the next, and
//!   every SQLite-backed test failed `MADSIM_TEST_CHECK_DETERMINISM`. Under the simulator
//!   statements are prepared afresh instead ([`prepared`]).
//! - SQLite's own generator seeds from `/dev/urandom`; what it randomizes (WAL salts,
//!   journal nonces, temporary file names, `random()`) reaches only the file's bytes,
//!   never a result, a timing or a draw of this store. Still, so that it cannot, opening
//!   a store under the simulator reseeds it with a number drawn from the simulation.
//!   That generator is global to the process: simulations running in one process at once
//!   (`MADSIM_TEST_JOBS` > 1) share it.
//!
//! Deliberately not done: no connection pool, no caching of states in memory, no
//! fault injection (use [`crate::MemoryStore`] for that).

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use async_trait::async_trait;
use bytes::Bytes;
use rusqlite::{params, CachedStatement, Connection, OptionalExtension, Statement, TransactionBehavior};
use troupe_core::ActorId;

use crate::state_store::{
    check_key, Claimed, Fence, FencedClaim, StateChange, StateStore, StoreError, StoreOperation, TurnCommit,
    STATE_SCAN_LIMIT_MAX,
};

/// The schema version this code writes and reads, stored in `PRAGMA user_version`.
/// Version 2 added `actor_owner`.
const SQLITE_SCHEMA_VERSION: i64 = 2;

/// Longest identity a store keeps ([`SqliteStore::identity`]), in bytes: a longer path
/// is cut from its start. The limit of a cluster's store identity (troupe-etcd's
/// `STORE_IDENTITY_LENGTH_MAX`), so that every identity a store gives is one a cluster
/// takes.
pub const SQLITE_IDENTITY_LENGTH_MAX_BYTES: usize = 1_024;

/// The row of `troupe_meta` that holds the identity.
const SQLITE_META_IDENTITY: &str = "identity";

/// Creates `troupe_meta` where it is missing (every file before identities).
const SQLITE_META_SCHEMA: &str = "
    CREATE TABLE IF NOT EXISTS troupe_meta (
        name  TEXT NOT NULL PRIMARY KEY,
        value TEXT NOT NULL
    ) WITHOUT ROWID;
";

/// How long an operation waits for a lock held by another process (say, `sqlite3`).
const SQLITE_BUSY_TIMEOUT_MS: u64 = 5_000;
/// How many times opening tries to switch a file that other connections hold to WAL
/// journal mode, in attempts, waiting for their write lock between two (see
/// `switch_to_wal`).
const SQLITE_JOURNAL_MODE_ATTEMPTS_MAX: u32 = 1_000;

const SQLITE_SCHEMA: &str = "
    CREATE TABLE IF NOT EXISTS actor_state (
        kind  TEXT NOT NULL,
        key   TEXT NOT NULL,
        state BLOB NOT NULL,
        PRIMARY KEY (kind, key)
    ) WITHOUT ROWID;
    CREATE TABLE IF NOT EXISTS actor_entry (
        kind      TEXT NOT NULL,
        key       TEXT NOT NULL,
        entry_key TEXT NOT NULL,
        value     BLOB NOT NULL,
        PRIMARY KEY (kind, key, entry_key)
    ) WITHOUT ROWID;
    CREATE TABLE IF NOT EXISTS actor_owner (
        kind  TEXT NOT NULL,
        key   TEXT NOT NULL,
        fence INTEGER NOT NULL,
        PRIMARY KEY (kind, key)
    ) WITHOUT ROWID;
";

/// Issues the actor's next fence: 1 for its first claim, one more than the last after.
const CLAIM_NEXT_FENCE: &str = "INSERT INTO actor_owner (kind, key, fence) VALUES (?1, ?2, 1)
    ON CONFLICT (kind, key) DO UPDATE SET fence = fence + 1 RETURNING fence";
/// Makes `?3` the actor's fence if it is newer than the one it has (or it has none);
/// returns the fence only if it was set.
const CLAIM_GIVEN_FENCE: &str = "INSERT INTO actor_owner (kind, key, fence) VALUES (?1, ?2, ?3)
    ON CONFLICT (kind, key) DO UPDATE SET fence = excluded.fence WHERE fence < excluded.fence RETURNING fence";
/// The actor's newest fence.
const SELECT_FENCE: &str = "SELECT fence FROM actor_owner WHERE kind = ?1 AND key = ?2";
/// The actor's state blob.
const SELECT_STATE: &str = "SELECT state FROM actor_state WHERE kind = ?1 AND key = ?2";

/// An actor's entries from a lower bound on, in key order; `?3` is the bound.
const SCAN_FROM: &str = "SELECT entry_key, value FROM actor_entry
    WHERE kind = ?1 AND key = ?2 AND entry_key >= ?3 ORDER BY entry_key LIMIT ?4";
/// As [`SCAN_FROM`], but strictly after the bound.
const SCAN_STRICTLY_AFTER: &str = "SELECT entry_key, value FROM actor_entry
    WHERE kind = ?1 AND key = ?2 AND entry_key > ?3 ORDER BY entry_key LIMIT ?4";

/// The most actors whose newest fence a store remembers for [`StateStore::check_fence`]
/// (actors); past it the memory is forgotten whole, and checks read again.
const FENCE_CHECK_REMEMBERED_MAX: usize = 4_096;

/// A [`StateStore`] in one SQLite file; clones share the same connection.
#[derive(Clone)]
pub struct SqliteStore {
    connection: Arc<Mutex<Connection>>,
    /// The identity stored in the file, read when it was opened.
    identity: Arc<str>,
    /// What [`StateStore::check_fence`] has read, locked only while `connection` is.
    fences: Arc<Mutex<FenceMemory>>,
}

/// The newest fences [`StateStore::check_fence`] has read, valid while no other
/// connection has committed: `PRAGMA data_version` changes exactly when one has (SQLite
/// documents it so, in WAL mode too), and this connection's own claims forget what they
/// change. So a check whose actor's fence was read since costs the pragma alone, and
/// reads no table.
#[derive(Default)]
struct FenceMemory {
    /// `PRAGMA data_version` when `newest` was read; `None` before the first check.
    data_version: Option<i64>,
    /// Actor (kind, key) → its newest fence as read (`None`: never claimed).
    newest: std::collections::BTreeMap<(String, String), Option<i64>>,
    /// Reads of `actor_owner` made by checks, for tests.
    reads: u64,
}

impl FenceMemory {
    /// The actor's newest fence: remembered, if no other connection has committed since
    /// (`data_version` is the connection's now), else read with `read` and remembered.
    fn newest(
        &mut self,
        data_version: i64,
        actor: (String, String),
        read: impl FnOnce(&str, &str) -> rusqlite::Result<Option<i64>>,
    ) -> rusqlite::Result<Option<i64>> {
        if self.data_version != Some(data_version) {
            self.newest.clear();
            self.data_version = Some(data_version);
        }
        if let Some(newest) = self.newest.get(&actor) {
            return Ok(*newest);
        }
        let newest = read(&actor.0, &actor.1)?;
        self.reads += 1;
        if self.newest.len() >= FENCE_CHECK_REMEMBERED_MAX {
            self.newest.clear();
        }
        self.newest.insert(actor, newest);
        Ok(newest)
    }

    /// Forgets the actor's fence: this connection has just claimed it (a change that
    /// `data_version` does not show to the connection that made it).
    fn forget(&mut self, kind: &str, key: &str) {
        self.newest.remove(&(kind.to_string(), key.to_string()));
    }
}

fn fence_memory_lock(fences: &Mutex<FenceMemory>) -> MutexGuard<'_, FenceMemory> {
    fences.lock().unwrap_or_else(PoisonError::into_inner)
}

impl SqliteStore {
    /// Opens the store in the file at `path`, creating the file and its schema if needed.
    ///
    /// The file is switched to WAL journal mode with `synchronous = FULL`, so a commit
    /// that returned `Ok` survives a crash. Opening does blocking I/O; call it at startup
    /// or from a blocking task.
    ///
    /// `path` must name a file: the empty path (to SQLite, a private temporary
    /// database), `:memory:` and a path starting with `file:` (an SQLite URI, which may
    /// name a database in memory) are refused, since nothing committed to them would
    /// outlive the store. [`SqliteStore::open_in_memory`] makes a store in memory.
    ///
    /// # Errors
    /// [`StoreError::Backend`] with operation `"open"` if `path` names no file of its own
    /// (see above), if the file cannot be opened or is not an SQLite database, or if its
    /// schema version is newer than this code knows.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        check_path(path.as_ref())?;
        from_connection_seed_randomness();
        let connection = Connection::open(path.as_ref()).map_err(|e| open_error("opening the file", e))?;
        // Before anything that locks: another store may be writing to the file, and
        // switching the journal mode or checking the schema must wait for it, not fail.
        connection
            .busy_timeout(std::time::Duration::from_millis(SQLITE_BUSY_TIMEOUT_MS))
            .map_err(|e| open_error("setting the busy timeout", e))?;
        let journal_mode = switch_to_wal(&connection)?;
        if !journal_mode.eq_ignore_ascii_case("wal") {
            // Rollback journaling with synchronous = FULL is still durable, only slower.
            tracing::warn!(
                path = %path.as_ref().display(),
                journal_mode,
                "sqlite store could not switch to wal journal mode"
            );
        }
        // The file exists now: its canonical path names it whatever path opened it.
        let canonical = std::fs::canonicalize(path.as_ref())
            .map_err(|error| open_error_io("resolving the file's canonical path", &error))?;
        Self::from_connection(connection, &canonical.display().to_string())
    }

    /// An empty store that lives in memory only, for tests. Its identity is
    /// `sqlite:<microseconds at creation>::memory:`.
    ///
    /// # Errors
    /// [`StoreError::Backend`] with operation `"open"` if SQLite cannot create it.
    pub fn open_in_memory() -> Result<Self, StoreError> {
        from_connection_seed_randomness();
        Self::from_connection(
            Connection::open_in_memory().map_err(|e| open_error("creating the in-memory database", e))?,
            ":memory:",
        )
    }

    /// The identity stored in the file (see the module documentation): `sqlite:<creation
    /// time in microseconds>:<canonical path at creation>` for a file this build
    /// created, `sqlite:<canonical path at its first open>` for one created before
    /// identities were stored. Every store opened on one file gives the same identity,
    /// whatever path named it, and keeps giving it after the file is moved; for
    /// `troupe_etcd::EtcdConfig::with_store_identity` (through
    /// `troupe_cluster::store_identity`).
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// `name`: the file's canonical path, or `:memory:`.
    fn from_connection(mut connection: Connection, name: &str) -> Result<Self, StoreError> {
        connection
            .pragma_update(None, "synchronous", "FULL")
            .map_err(|e| open_error("setting synchronous = FULL", e))?;
        connection
            .busy_timeout(std::time::Duration::from_millis(SQLITE_BUSY_TIMEOUT_MS))
            .map_err(|e| open_error("setting the busy timeout", e))?;
        let identity = from_connection_create_schema(&mut connection, name)?;
        Ok(Self {
            identity: Arc::from(identity),
            connection: Arc::new(Mutex::new(connection)),
            fences: Arc::default(),
        })
    }

    /// Runs `work` with the connection on a blocking thread.
    ///
    /// madsim marks `spawn_blocking` deprecated because it runs the closure inline as a
    /// task, blocking the simulated node. That is acceptable here: SQLite is not simulated
    /// (the simulator uses [`crate::MemoryStore`]), and the code path stays the same.
    #[cfg_attr(madsim, allow(deprecated))]
    async fn run<T, F>(&self, operation: StoreOperation, work: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> rusqlite::Result<T> + Send + 'static,
    {
        let connection = Arc::clone(&self.connection);
        tokio::task::spawn_blocking(move || work(&mut run_lock(&connection)))
            .await
            .map_err(|error| StoreError::Backend {
                operation,
                cause: error.to_string(),
            })?
            .map_err(|error| operation_error(operation, &error))
    }
}

/// Refuses a path that SQLite opens as something other than a file of its own: the empty
/// path (a private temporary database, deleted when closed), `:memory:`, and a path
/// starting with `file:` (read as a URI, since rusqlite opens with `SQLITE_OPEN_URI`:
/// `file:x?mode=memory` is a database in memory). A file whose name merely contains
/// these (`./:memory:`, `/data/file:x`) is a file, and is accepted.
fn check_path(path: &Path) -> Result<(), StoreError> {
    let bytes = path.as_os_str().as_encoded_bytes();
    let cause = if bytes.is_empty() {
        "an empty path opens a temporary database that is deleted when it is closed"
    } else if bytes == b":memory:" {
        "\":memory:\" opens a database in memory"
    } else if bytes.starts_with(b"file:") {
        "a path starting with \"file:\" is read as an SQLite URI"
    } else {
        return Ok(());
    };
    Err(StoreError::Backend {
        operation: StoreOperation::Open,
        cause: format!(
            "the path {path:?} names no file of its own: {cause}, so nothing would outlive the store \
             (use SqliteStore::open_in_memory for a store in memory)"
        ),
    })
}

/// Creates the schema in a fresh file, checks the version of an existing one; returns
/// the file's identity, stored now if it had none (see the module documentation).
/// `name` is the file's canonical path (or `:memory:`).
fn from_connection_create_schema(connection: &mut Connection, name: &str) -> Result<String, StoreError> {
    // IMMEDIATE: a deferred transaction that reads the version and then writes the
    // schema fails at once if another store wrote in between, instead of waiting.
    let transaction = connection
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(|e| open_error("locking the file to check its schema", e))?;
    let version: i64 = transaction
        .query_row("PRAGMA user_version", [], |row| row.get(0))
        .map_err(|e| open_error("reading the schema version", e))?;
    if version > SQLITE_SCHEMA_VERSION {
        return Err(StoreError::Backend {
            operation: StoreOperation::Open,
            cause: format!(
                "schema version {version} is newer than version {SQLITE_SCHEMA_VERSION}, \
                 the newest this build of troupe understands"
            ),
        });
    }
    if version < SQLITE_SCHEMA_VERSION {
        transaction
            .execute_batch(SQLITE_SCHEMA)
            .map_err(|e| open_error("creating the schema", e))?;
        transaction
            .pragma_update(None, "user_version", SQLITE_SCHEMA_VERSION)
            .map_err(|e| open_error("setting the schema version", e))?;
    }
    transaction
        .execute_batch(SQLITE_META_SCHEMA)
        .map_err(|e| open_error("creating troupe_meta", e))?;
    let stored: Option<String> = transaction
        .query_row(
            "SELECT value FROM troupe_meta WHERE name = ?1",
            [SQLITE_META_IDENTITY],
            |row| row.get(0),
        )
        .optional()
        .map_err(|e| open_error("reading the store's identity", e))?;
    let identity = match stored {
        Some(identity) => identity,
        None => {
            // A file without Troupe's schema (version 0) is created now; one with it
            // was created before identities were stored, and keeps the identity its
            // path gave it then.
            let created_us = (version == 0).then(|| crate::Clock::new().now().as_micros());
            let identity = new_identity(created_us, name);
            transaction
                .execute(
                    "INSERT INTO troupe_meta (name, value) VALUES (?1, ?2)",
                    [SQLITE_META_IDENTITY, identity.as_str()],
                )
                .map_err(|e| open_error("storing the store's identity", e))?;
            identity
        }
    };
    transaction
        .commit()
        .map_err(|e| open_error("committing the schema", e))?;
    Ok(identity)
}

/// The identity of a file named `name` (its canonical path), created at `created_us`
/// (microseconds since the Unix epoch), or created before identities were stored
/// (`None`): `sqlite:<created_us>:<name>` or `sqlite:<name>`, cut to
/// [`SQLITE_IDENTITY_LENGTH_MAX_BYTES`] by dropping the start of `name`.
fn new_identity(created_us: Option<u64>, name: &str) -> String {
    let prefix = match created_us {
        Some(created_us) => format!("sqlite:{created_us}:"),
        None => "sqlite:".to_string(),
    };
    let room = SQLITE_IDENTITY_LENGTH_MAX_BYTES.saturating_sub(prefix.len());
    let mut start = name.len().saturating_sub(room);
    while !name.is_char_boundary(start) {
        start += 1;
    }
    format!("{prefix}{}", &name[start..])
}

/// Switches the file to WAL journal mode (a no-op if it is in it already) and returns
/// the mode it is in. SQLite does not call the busy handler for this pragma: while
/// another connection holds the file (opening it, committing, or closing it, which
/// checkpoints), it fails at once with `database is locked`, whatever the busy timeout.
/// So after such a failure, opening waits for the other connection through a statement
/// that does call the busy handler (taking and releasing the write lock:
/// `BEGIN IMMEDIATE`, `ROLLBACK`), and tries again, up to
/// [`SQLITE_JOURNAL_MODE_ATTEMPTS_MAX`] times. (Two runtimes opening one file at once
/// failed this way in 14 of 60 runs of
/// `racing_runtimes_on_one_sqlite_file_lose_no_acknowledged_increment`.)
fn switch_to_wal(connection: &Connection) -> Result<String, StoreError> {
    let mut attempts = 1;
    loop {
        match connection.query_row("PRAGMA journal_mode = WAL", [], |row| row.get::<_, String>(0)) {
            Ok(mode) => return Ok(mode),
            Err(rusqlite::Error::SqliteFailure(failure, _))
                if failure.code == rusqlite::ErrorCode::DatabaseBusy && attempts < SQLITE_JOURNAL_MODE_ATTEMPTS_MAX =>
            {
                attempts += 1;
                // Waits (busy handler, up to the busy timeout) while another connection
                // writes; the next attempt then usually finds the file free.
                connection
                    .execute_batch("BEGIN IMMEDIATE; ROLLBACK;")
                    .map_err(|error| open_error("waiting for the file's write lock", error))?;
            }
            Err(error) => return Err(open_error("switching to WAL journal mode", error)),
        }
    }
}

/// The error of an operation on an open store: [`StoreError::Unavailable`] if another
/// connection held the file's lock for longer than the busy timeout
/// (`SQLITE_BUSY_TIMEOUT_MS`), since the operation may succeed once it lets go (the
/// transaction was rolled back: nothing of it was written); else
/// [`StoreError::Backend`].
fn operation_error(operation: StoreOperation, error: &rusqlite::Error) -> StoreError {
    let cause = error.to_string();
    match error.sqlite_error_code() {
        Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked) => {
            StoreError::Unavailable { operation, cause }
        }
        _ => StoreError::Backend { operation, cause },
    }
}

/// An I/O error of opening the store, naming the step that failed.
fn open_error_io(at: &str, error: &std::io::Error) -> StoreError {
    StoreError::Backend {
        operation: StoreOperation::Open,
        cause: format!("{at}: {error}"),
    }
}

/// An error of opening the store, naming the step that failed.
fn open_error(at: &str, error: rusqlite::Error) -> StoreError {
    StoreError::Backend {
        operation: StoreOperation::Open,
        cause: format!("{at}: {error}"),
    }
}

/// Under the simulator, reseeds SQLite's process-wide generator from the simulation;
/// see the module documentation. Outside the simulator this does nothing.
#[cfg(madsim)]
fn from_connection_seed_randomness() {
    use std::os::raw::c_int;

    use rusqlite::ffi;

    // Outside a simulation (a test opening a store before starting one) any fixed seed
    // keeps the run reproducible.
    let drawn: u32 = match madsim::runtime::Handle::try_current() {
        Ok(_) => madsim::rand::random(),
        Err(_) => SQLITE_PRNG_SEED_OUTSIDE_SIMULATION,
    };
    // Zero would mean "seed from the operating system".
    let seed = c_int::from_ne_bytes(drawn.max(1).to_ne_bytes());
    // SAFETY: SQLITE_TESTCTRL_PRNG_SEED takes an int and a database handle; with a null
    // handle it only stores the seed in SQLite's global configuration and resets the
    // generator, which reseeds from it on its next use. The bundled SQLite is built
    // without SQLITE_UNTESTABLE, so the test control exists.
    let code = unsafe {
        ffi::sqlite3_test_control(
            ffi::SQLITE_TESTCTRL_PRNG_SEED,
            seed,
            std::ptr::null_mut::<ffi::sqlite3>(),
        )
    };
    assert_eq!(code, ffi::SQLITE_OK, "sqlite refused to seed its generator");
}

#[cfg(not(madsim))]
fn from_connection_seed_randomness() {}

/// The seed of SQLite's generator for a store opened under `--cfg madsim` but outside
/// a running simulation.
#[cfg(madsim)]
const SQLITE_PRNG_SEED_OUTSIDE_SIMULATION: u32 = 0x7472_6f75;

/// A prepared statement: from rusqlite's statement cache, or prepared afresh.
enum Prepared<'connection> {
    Cached(CachedStatement<'connection>),
    Fresh(Statement<'connection>),
}

impl<'connection> std::ops::Deref for Prepared<'connection> {
    type Target = Statement<'connection>;

    fn deref(&self) -> &Self::Target {
        match self {
            Self::Cached(statement) => statement,
            Self::Fresh(statement) => statement,
        }
    }
}

impl std::ops::DerefMut for Prepared<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        match self {
            Self::Cached(statement) => statement,
            Self::Fresh(statement) => statement,
        }
    }
}

/// Prepares `sql`, through rusqlite's statement cache except under the simulator.
///
/// The cache finds statements by hashing their SQL with `ahash`, whose process-wide
/// seeds are drawn, the first time anything hashes, through `getrandom`; madsim
/// intercepts `getrandom` and serves it from the simulation's generator. So the first
/// simulation in a process to use the cache draws from its generator once more than any
/// later one: two runs of one seed differ (`MADSIM_TEST_CHECK_DETERMINISM` fails) and a
/// seed of a `MADSIM_TEST_NUM` batch does not replay alone. Preparing afresh hashes
/// nothing; it costs microseconds per statement, which only the simulator pays.
fn prepared<'connection>(connection: &'connection Connection, sql: &str) -> rusqlite::Result<Prepared<'connection>> {
    if cfg!(madsim) {
        connection.prepare(sql).map(Prepared::Fresh)
    } else {
        connection.prepare_cached(sql).map(Prepared::Cached)
    }
}

/// A fence as stored in `actor_owner`; a token that no claim can have issued (zero or
/// negative, say after a hand edit of the file) is a backend error, not a panic.
fn fence_from_column(operation: StoreOperation, token: i64) -> Result<Fence, StoreError> {
    u64::try_from(token)
        .ok()
        .and_then(Fence::from_token)
        .ok_or_else(|| StoreError::Backend {
            operation,
            cause: format!("actor_owner holds fence {token}, which no claim issues"),
        })
}

/// Applies a commit's change to the state blob inside its transaction.
fn commit_state(
    transaction: &rusqlite::Transaction<'_>,
    kind: &str,
    key: &str,
    change: &StateChange,
) -> rusqlite::Result<()> {
    match change {
        StateChange::Unchanged => {}
        StateChange::Set(state) => {
            prepared(
                transaction,
                "INSERT INTO actor_state (kind, key, state) VALUES (?1, ?2, ?3)
                     ON CONFLICT (kind, key) DO UPDATE SET state = excluded.state",
            )?
            .execute(params![kind, key, state.as_ref()])?;
        }
        StateChange::Deleted => {
            prepared(transaction, "DELETE FROM actor_state WHERE kind = ?1 AND key = ?2")?
                .execute(params![kind, key])?;
        }
    }
    Ok(())
}

/// What a commit transaction found.
enum CommitOutcome {
    /// The fence was the newest; the commit is applied.
    Applied,
    /// The fence was not the newest; nothing was written. The newest token, if any.
    Fenced(Option<i64>),
}

fn run_lock(connection: &Mutex<Connection>) -> MutexGuard<'_, Connection> {
    // A panic while holding the lock leaves no half-done transaction behind: rusqlite
    // rolls back a dropped transaction, so the connection is safe to keep using.
    connection.lock().unwrap_or_else(PoisonError::into_inner)
}

/// An actor's id as the two columns that store it.
fn actor_columns(actor: &ActorId) -> (String, String) {
    (actor.kind().as_str().to_string(), actor.key().to_string())
}

#[async_trait]
impl FencedClaim for SqliteStore {
    async fn claim_with_fence(&self, actor: &ActorId, fence: Fence) -> Result<Claimed, StoreError> {
        let (kind, key) = actor_columns(actor);
        let Ok(token) = i64::try_from(fence.token()) else {
            return Err(StoreError::Backend {
                operation: StoreOperation::Claim,
                cause: format!("{fence} does not fit the fence column (at most {})", i64::MAX),
            });
        };
        let fences = Arc::clone(&self.fences);
        let (accepted, current, state) = self
            .run(StoreOperation::Claim, move |connection| {
                // Forgotten first, so that a claim that fails part-way forgets it too.
                fence_memory_lock(&fences).forget(&kind, &key);
                // IMMEDIATE, as in `claim`: the check and the update are one step.
                let transaction = connection.transaction_with_behavior(TransactionBehavior::Immediate)?;
                let accepted: Option<i64> = prepared(&transaction, CLAIM_GIVEN_FENCE)?
                    .query_row(params![kind, key, token], |row| row.get(0))
                    .optional()?;
                let (current, state) = if accepted.is_some() {
                    let state: Option<Vec<u8>> = prepared(&transaction, SELECT_STATE)?
                        .query_row(params![kind, key], |row| row.get(0))
                        .optional()?;
                    (None, state)
                } else {
                    let current: Option<i64> = prepared(&transaction, SELECT_FENCE)?
                        .query_row(params![kind, key], |row| row.get(0))
                        .optional()?;
                    (current, None)
                };
                transaction.commit()?;
                Ok((accepted.is_some(), current, state))
            })
            .await?;
        if !accepted {
            return Err(StoreError::Fenced {
                actor: actor.clone(),
                held: fence,
                current: current
                    .map(|token| fence_from_column(StoreOperation::Claim, token))
                    .transpose()?,
            });
        }
        Ok(Claimed {
            fence,
            state: state.map(Bytes::from),
        })
    }
}

#[async_trait]
impl StateStore for SqliteStore {
    async fn claim(&self, actor: &ActorId) -> Result<Claimed, StoreError> {
        let (kind, key) = actor_columns(actor);
        let fences = Arc::clone(&self.fences);
        let (token, state) = self
            .run(StoreOperation::Claim, move |connection| {
                // Forgotten first, so that a claim that fails part-way forgets it too.
                fence_memory_lock(&fences).forget(&kind, &key);
                // IMMEDIATE takes the write lock up front: a claim in another process waits
                // (busy timeout) instead of failing when the read would have to upgrade.
                let transaction = connection.transaction_with_behavior(TransactionBehavior::Immediate)?;
                let token: i64 =
                    prepared(&transaction, CLAIM_NEXT_FENCE)?.query_row(params![kind, key], |row| row.get(0))?;
                let state: Option<Vec<u8>> = prepared(&transaction, SELECT_STATE)?
                    .query_row(params![kind, key], |row| row.get(0))
                    .optional()?;
                transaction.commit()?;
                Ok((token, state))
            })
            .await?;
        Ok(Claimed {
            fence: fence_from_column(StoreOperation::Claim, token)?,
            state: state.map(Bytes::from),
        })
    }

    async fn load(&self, actor: &ActorId) -> Result<Option<Bytes>, StoreError> {
        let (kind, key) = actor_columns(actor);
        self.run(StoreOperation::Load, move |connection| {
            prepared(connection, SELECT_STATE)?
                .query_row(params![kind, key], |row| row.get::<_, Vec<u8>>(0))
                .optional()
        })
        .await
        .map(|state| state.map(Bytes::from))
    }

    async fn commit(&self, actor: &ActorId, fence: Fence, commit: TurnCommit) -> Result<(), StoreError> {
        commit.validate()?;
        let (kind, key) = actor_columns(actor);
        let outcome = self
            .run(StoreOperation::Commit, move |connection| {
                // IMMEDIATE: the fence is read under the write lock, so no claim can come
                // between the check and the writes.
                let transaction = connection.transaction_with_behavior(TransactionBehavior::Immediate)?;
                let current: Option<i64> = prepared(&transaction, SELECT_FENCE)?
                    .query_row(params![kind, key], |row| row.get(0))
                    .optional()?;
                if current != i64::try_from(fence.token()).ok() {
                    // Dropping the transaction rolls it back; it wrote nothing.
                    return Ok(CommitOutcome::Fenced(current));
                }
                commit_state(&transaction, &kind, &key, &commit.state)?;
                for (entry_key, value) in &commit.writes {
                    match value {
                        Some(value) => prepared(
                            &transaction,
                            "INSERT INTO actor_entry (kind, key, entry_key, value)
                             VALUES (?1, ?2, ?3, ?4)
                             ON CONFLICT (kind, key, entry_key) DO UPDATE SET value = excluded.value",
                        )?
                        .execute(params![kind, key, entry_key, value.as_ref()])?,
                        None => prepared(
                            &transaction,
                            "DELETE FROM actor_entry WHERE kind = ?1 AND key = ?2 AND entry_key = ?3",
                        )?
                        .execute(params![kind, key, entry_key])?,
                    };
                }
                // Dropping the transaction on an error above rolls all of it back.
                transaction.commit()?;
                Ok(CommitOutcome::Applied)
            })
            .await?;
        match outcome {
            CommitOutcome::Applied => Ok(()),
            CommitOutcome::Fenced(current) => Err(StoreError::Fenced {
                actor: actor.clone(),
                held: fence,
                current: current
                    .map(|token| fence_from_column(StoreOperation::Commit, token))
                    .transpose()?,
            }),
        }
    }

    /// `PRAGMA data_version`, and a read of the actor's fence only when another
    /// connection has committed since this store last read it ([`FenceMemory`]).
    async fn check_fence(&self, actor: &ActorId, fence: Fence) -> Result<(), StoreError> {
        let columns = actor_columns(actor);
        let fences = Arc::clone(&self.fences);
        // A check is the fence comparison of a commit, without its writes.
        let current = self
            .run(StoreOperation::Commit, move |connection| {
                let data_version: i64 = prepared(connection, "PRAGMA data_version")?.query_row([], |row| row.get(0))?;
                fence_memory_lock(&fences).newest(data_version, columns, |kind, key| {
                    prepared(connection, SELECT_FENCE)?
                        .query_row(params![kind, key], |row| row.get(0))
                        .optional()
                })
            })
            .await?;
        if current == i64::try_from(fence.token()).ok() {
            return Ok(());
        }
        Err(StoreError::Fenced {
            actor: actor.clone(),
            held: fence,
            current: current
                .map(|token| fence_from_column(StoreOperation::Commit, token))
                .transpose()?,
        })
    }

    async fn get(&self, actor: &ActorId, key: &str) -> Result<Option<Bytes>, StoreError> {
        check_key(key)?;
        let (kind, actor_key) = actor_columns(actor);
        let entry_key = key.to_string();
        self.run(StoreOperation::Get, move |connection| {
            prepared(
                connection,
                "SELECT value FROM actor_entry WHERE kind = ?1 AND key = ?2 AND entry_key = ?3",
            )?
            .query_row(params![kind, actor_key, entry_key], |row| row.get::<_, Vec<u8>>(0))
            .optional()
        })
        .await
        .map(|value| value.map(Bytes::from))
    }

    async fn scan(
        &self,
        actor: &ActorId,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Bytes)>, StoreError> {
        check_key(prefix)?;
        let limit = limit.min(STATE_SCAN_LIMIT_MAX);
        if limit == 0 {
            return Ok(Vec::new());
        }
        let (kind, key) = actor_columns(actor);
        let prefix = prefix.to_string();
        // Keys that start with `prefix` sort together, right from `prefix` itself, and
        // TEXT compares bytewise; so the keys wanted are the first rows at or after the
        // lower bound, and the scan stops at the first key without the prefix. No LIKE:
        // it would treat `%` and `_` in the prefix as wildcards.
        let (lower_bound, select) = match after {
            Some(after) if after >= prefix.as_str() => (after.to_string(), SCAN_STRICTLY_AFTER),
            _ => (prefix.clone(), SCAN_FROM),
        };
        let limit = i64::try_from(limit).expect("a scan limit is at most STATE_SCAN_LIMIT_MAX");
        self.run(StoreOperation::Scan, move |connection| {
            let mut statement = prepared(connection, select)?;
            let rows = statement.query_map(params![kind, key, lower_bound, limit], |row| {
                Ok((row.get::<_, String>(0)?, row.get::<_, Vec<u8>>(1)?))
            })?;
            let mut entries = Vec::new();
            for row in rows {
                let (entry_key, value) = row?;
                if !entry_key.starts_with(prefix.as_str()) {
                    break;
                }
                entries.push((entry_key, Bytes::from(value)));
            }
            Ok(entries)
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    /// A directory of its own for one test (`tempfile`), removed when dropped; named after
    /// the test and the process, so that a leftover one tells whose it was.
    struct TestDirectory(tempfile::TempDir);

    impl TestDirectory {
        fn new(test_name: &str) -> Self {
            let directory = tempfile::Builder::new()
                .prefix(&format!("troupe-sqlite-store-{test_name}-{}-", std::process::id()))
                .tempdir()
                .expect("create the test directory");
            Self(directory)
        }

        fn file(&self) -> PathBuf {
            self.0.path().join("state.sqlite")
        }
    }

    fn agent(key: &str) -> ActorId {
        ActorId::new("agent", key).expect("a valid actor id")
    }

    /// Goal: a turn committed to a file is there after the store is closed and opened
    /// again. Method: commit state and an entry, drop every handle, open the file anew.
    #[tokio::test]
    async fn reopened_file_holds_the_committed_state_and_entries() {
        let directory = TestDirectory::new("reopened_file_holds_the_committed_state_and_entries");
        let actor = agent("a");
        {
            let store = SqliteStore::open(directory.file()).expect("open a new file");
            let fence = store.claim(&actor).await.expect("claim").fence;
            let commit = TurnCommit {
                state: StateChange::Set(Bytes::from_static(b"state one")),
                writes: vec![("note/1".to_string(), Some(Bytes::from_static(b"value one")))],
            };
            store.commit(&actor, fence, commit).await.expect("commit");
        }
        let store = SqliteStore::open(directory.file()).expect("reopen the file");
        assert_eq!(
            store.load(&actor).await.expect("load"),
            Some(Bytes::from_static(b"state one"))
        );
        assert_eq!(
            store.get(&actor, "note/1").await.expect("get"),
            Some(Bytes::from_static(b"value one"))
        );
    }

    /// Goal: a file written by a newer schema is refused, not misread. Method: raise
    /// `user_version` past ours with a plain connection, then open the file.
    #[tokio::test]
    async fn file_with_a_newer_schema_version_is_refused() {
        let directory = TestDirectory::new("file_with_a_newer_schema_version_is_refused");
        drop(SqliteStore::open(directory.file()).expect("open a new file"));
        {
            let connection = Connection::open(directory.file()).expect("open with rusqlite");
            connection
                .pragma_update(None, "user_version", SQLITE_SCHEMA_VERSION + 1)
                .expect("raise the schema version");
        }
        match SqliteStore::open(directory.file()) {
            Err(StoreError::Backend { operation, cause }) => {
                assert_eq!(operation, StoreOperation::Open);
                assert!(cause.contains("schema version 3"), "unexpected cause: {cause}");
            }
            Err(other) => panic!("expected a backend error, got {other:?}"),
            Ok(_) => panic!("a file with a newer schema version was opened"),
        }
    }

    /// Goal: a path that SQLite would not open as a file of its own is refused, so an
    /// empty path from a configuration does not silently give a store whose commits are
    /// lost when it closes. Method: the empty path (SQLite opens a private temporary
    /// database), `:memory:` (a database in memory), and a `file:` URI (read as a URI,
    /// here one of a database in memory), each refused with the reason, no file made.
    /// Before: each opened `Ok`.
    #[tokio::test]
    async fn paths_that_name_no_durable_file_are_refused() {
        for (path, cause) in [
            (
                "",
                "an empty path opens a temporary database that is deleted when it is closed",
            ),
            (":memory:", "\":memory:\" opens a database in memory"),
            (
                "file:troupe-state?mode=memory",
                "a path starting with \"file:\" is read as an SQLite URI",
            ),
        ] {
            let opened = SqliteStore::open(path);
            let expected = StoreError::Backend {
                operation: StoreOperation::Open,
                cause: format!(
                    "the path {path:?} names no file of its own: {cause}, so nothing would outlive the store \
                     (use SqliteStore::open_in_memory for a store in memory)"
                ),
            };
            assert_eq!(opened.err(), Some(expected), "{path:?}");
        }
        // A file whose name only contains those words is a file.
        let directory = TestDirectory::new("paths_that_name_no_durable_file_are_refused");
        let file = directory.0.path().join("file:memory:");
        drop(SqliteStore::open(&file).expect("open a file named like a URI in a directory"));
        assert!(file.exists());
    }

    /// Goal: opening a file twice keeps the schema version and the data. Method: open,
    /// reopen, read `user_version` directly.
    #[tokio::test]
    async fn reopening_keeps_the_schema_version() {
        let directory = TestDirectory::new("reopening_keeps_the_schema_version");
        drop(SqliteStore::open(directory.file()).expect("open a new file"));
        drop(SqliteStore::open(directory.file()).expect("reopen the file"));
        let connection = Connection::open(directory.file()).expect("open with rusqlite");
        let version: i64 = connection
            .query_row("PRAGMA user_version", [], |row| row.get(0))
            .expect("read user_version");
        assert_eq!(version, SQLITE_SCHEMA_VERSION);
        let journal_mode: String = connection
            .query_row("PRAGMA journal_mode", [], |row| row.get(0))
            .expect("read journal_mode");
        assert_eq!(journal_mode, "wal");
    }

    /// Goal: a commit that fails inside SQLite, after some of its rows were written, is
    /// rolled back whole. Method: a trigger aborts the insert of one key; the commit also
    /// carries a new state, a new key and a delete that come before it.
    #[tokio::test]
    async fn commit_failing_midway_in_sqlite_leaves_nothing_of_it_visible() {
        let store = SqliteStore::open_in_memory().expect("open in memory");
        let actor = agent("a");
        let fence = store.claim(&actor).await.expect("claim").fence;
        let first = TurnCommit {
            state: StateChange::Set(Bytes::from_static(b"A")),
            writes: vec![("kept".to_string(), Some(Bytes::from_static(b"1")))],
        };
        store.commit(&actor, fence, first).await.expect("first commit");
        run_lock(&store.connection)
            .execute_batch(
                "CREATE TRIGGER poison BEFORE INSERT ON actor_entry
                 WHEN NEW.entry_key = 'poison'
                 BEGIN SELECT RAISE(ABORT, 'poisoned key'); END;",
            )
            .expect("create the trigger");

        let failing = TurnCommit {
            state: StateChange::Set(Bytes::from_static(b"B")),
            writes: vec![
                ("new".to_string(), Some(Bytes::from_static(b"2"))),
                ("kept".to_string(), None),
                ("poison".to_string(), Some(Bytes::from_static(b"3"))),
            ],
        };
        match store.commit(&actor, fence, failing).await {
            Err(StoreError::Backend {
                operation: StoreOperation::Commit,
                cause,
            }) => {
                assert!(cause.contains("poisoned key"), "unexpected cause: {cause}");
            }
            other => panic!("expected a backend error from the commit, got {other:?}"),
        }
        assert_eq!(store.load(&actor).await.expect("load"), Some(Bytes::from_static(b"A")));
        assert_eq!(
            store.get(&actor, "kept").await.expect("get"),
            Some(Bytes::from_static(b"1"))
        );
        assert_eq!(store.get(&actor, "new").await.expect("get"), None);

        let next = TurnCommit {
            state: StateChange::Set(Bytes::from_static(b"C")),
            writes: vec![],
        };
        store
            .commit(&actor, fence, next)
            .await
            .expect("the connection still commits");
        assert_eq!(store.load(&actor).await.expect("load"), Some(Bytes::from_static(b"C")));
    }

    /// Goal: a file that is not a database is an error, not a panic or an empty store.
    #[test]
    fn file_that_is_not_a_database_is_refused() {
        let directory = TestDirectory::new("file_that_is_not_a_database_is_refused");
        std::fs::write(directory.file(), vec![b'x'; 4096]).expect("write garbage");
        assert!(matches!(
            SqliteStore::open(directory.file()),
            Err(StoreError::Backend {
                operation: StoreOperation::Open,
                ..
            })
        ));
    }

    /// Goal: a fence check reads the actor's fence only when another connection has
    /// committed since it last read it (`PRAGMA data_version`), and is right all the
    /// same: after another connection's claim, and after a claim through this one
    /// (which `data_version` does not show to it). Method: two stores on one file,
    /// counting the checks' reads.
    #[tokio::test]
    async fn a_fence_check_reads_again_only_after_a_commit_elsewhere_or_a_claim_here() {
        let directory = TestDirectory::new("a_fence_check_reads_again_only_after_a_commit_elsewhere_or_a_claim_here");
        let here = SqliteStore::open(directory.file()).expect("open");
        let elsewhere = SqliteStore::open(directory.file()).expect("open");
        let reads = || fence_memory_lock(&here.fences).reads;
        let actor = agent("a");
        let first = here.claim(&actor).await.expect("claim").fence;
        here.check_fence(&actor, first).await.expect("current");
        assert_eq!(reads(), 1);
        for _ in 0..3 {
            here.check_fence(&actor, first).await.expect("current");
        }
        assert_eq!(reads(), 1, "nothing committed elsewhere: no read");
        // A commit elsewhere, of another actor: read again, still current.
        elsewhere.claim(&agent("b")).await.expect("claim");
        here.check_fence(&actor, first).await.expect("current");
        assert_eq!(reads(), 2);
        // A claim elsewhere fences this one.
        let second = elsewhere.claim(&actor).await.expect("claim").fence;
        let fenced = |held: Fence, current: Fence| StoreError::Fenced {
            actor: actor.clone(),
            held,
            current: Some(current),
        };
        assert_eq!(here.check_fence(&actor, first).await, Err(fenced(first, second)));
        assert_eq!(reads(), 3);
        here.check_fence(&actor, second).await.expect("the newest is current");
        assert_eq!(reads(), 3);
        // A claim through this connection changes no data_version here: it forgets.
        let third = here.claim(&actor).await.expect("claim").fence;
        assert_eq!(here.check_fence(&actor, second).await, Err(fenced(second, third)));
        here.check_fence(&actor, third).await.expect("current");
        // And a given fence (claim_with_fence) through this connection too.
        let given = Fence::from_token(third.token() + 10).expect("a fence");
        here.claim_with_fence(&actor, given).await.expect("claim");
        assert_eq!(here.check_fence(&actor, third).await, Err(fenced(third, given)));
        // An actor never claimed has no current fence.
        assert_eq!(
            here.check_fence(&agent("never"), Fence::FIRST).await,
            Err(StoreError::Fenced {
                actor: agent("never"),
                held: Fence::FIRST,
                current: None
            })
        );
    }

    /// Goal: a file written by schema version 1 (before fences) opens, keeps its data,
    /// and issues the first fence on the first claim. Method: build a version 1 file by
    /// hand, open it, claim, commit under the fence.
    #[tokio::test]
    async fn version_one_file_is_upgraded_and_its_first_claim_issues_the_first_fence() {
        let directory = TestDirectory::new("version_one_file_is_upgraded_and_its_first_claim_issues_the_first_fence");
        {
            let connection = Connection::open(directory.file()).expect("open with rusqlite");
            connection
                .execute_batch(
                    "CREATE TABLE actor_state (kind TEXT NOT NULL, key TEXT NOT NULL, state BLOB NOT NULL,
                         PRIMARY KEY (kind, key)) WITHOUT ROWID;
                     CREATE TABLE actor_entry (kind TEXT NOT NULL, key TEXT NOT NULL, entry_key TEXT NOT NULL,
                         value BLOB NOT NULL, PRIMARY KEY (kind, key, entry_key)) WITHOUT ROWID;
                     INSERT INTO actor_state VALUES ('agent', 'a', x'7631');
                     PRAGMA user_version = 1;",
                )
                .expect("write a version 1 file");
        }
        let store = SqliteStore::open(directory.file()).expect("open a version 1 file");
        let actor = agent("a");
        let claimed = store.claim(&actor).await.expect("claim");
        assert_eq!(claimed.fence, Fence::FIRST);
        assert_eq!(claimed.state, Some(Bytes::from_static(b"v1")));
        let commit = TurnCommit {
            state: StateChange::Set(Bytes::from_static(b"v2")),
            writes: vec![],
        };
        store.commit(&actor, claimed.fence, commit).await.expect("commit");
        let version: i64 = run_lock(&store.connection)
            .query_row("PRAGMA user_version", [], |row| row.get(0))
            .expect("read user_version");
        assert_eq!(version, SQLITE_SCHEMA_VERSION);
        assert_eq!(store.load(&actor).await.expect("load"), Some(Bytes::from_static(b"v2")));
    }

    /// Goal: a store's identity is stored in its file: it survives a move and a rename of
    /// the file (before, the identity was `sqlite:<canonical path>`, and changed with
    /// the path), every store on the file gives it (named through a symbolic link too),
    /// and a file created later at the first one's path has another one.
    #[test]
    fn the_identity_is_stored_in_the_file_and_survives_a_move() {
        let directory = TestDirectory::new("the_identity_is_stored_in_the_file_and_survives_a_move");
        let first = directory.file();
        let identity = SqliteStore::open(&first)
            .expect("create the file")
            .identity()
            .to_string();
        let canonical = std::fs::canonicalize(&first).expect("the file's canonical path");
        let created_at_path = format!(":{}", canonical.display());
        assert!(
            identity.starts_with("sqlite:") && identity.ends_with(&created_at_path),
            "sqlite:<creation time>:<path>: {identity}"
        );
        let link = directory.0.path().join("link.sqlite");
        std::os::unix::fs::symlink(&first, &link).expect("a symbolic link");
        assert_eq!(
            SqliteStore::open(&link).expect("open through the link").identity(),
            identity
        );
        std::fs::remove_file(&link).expect("remove the link");

        let moved = directory.0.path().join("elsewhere");
        std::fs::create_dir(&moved).expect("another directory");
        let moved = moved.join("renamed.sqlite");
        std::fs::rename(&first, &moved).expect("move the file");
        let reopened = SqliteStore::open(&moved).expect("open the moved file");
        assert_eq!(reopened.identity(), identity, "the identity moved with the file");

        // The first path again, a new file: another identity (the wall clock moved).
        let recreated = SqliteStore::open(&first).expect("create a file at the first path");
        assert!(recreated.identity().ends_with(&created_at_path));
        assert_ne!(recreated.identity(), identity, "a new file at the same path");
    }

    /// Goal: a file created before identities were stored (Troupe's schema, no
    /// `troupe_meta`) gets the identity its path gave it before, `sqlite:<canonical
    /// path>`, on its first open, and keeps it afterwards, moved too; its data is kept.
    #[tokio::test]
    async fn a_file_from_before_identities_keeps_its_path_identity() {
        let directory = TestDirectory::new("a_file_from_before_identities_keeps_its_path_identity");
        let actor = agent("a");
        {
            let store = SqliteStore::open(directory.file()).expect("create the file");
            let claimed = store.claim(&actor).await.expect("claim");
            let commit = TurnCommit {
                state: StateChange::Set(Bytes::from_static(b"kept")),
                writes: vec![],
            };
            store.commit(&actor, claimed.fence, commit).await.expect("commit");
            run_lock(&store.connection)
                .execute_batch("DROP TABLE troupe_meta")
                .expect("make it a file from before identities");
        }
        let canonical = std::fs::canonicalize(directory.file()).expect("the canonical path");
        let legacy = format!("sqlite:{}", canonical.display());
        assert_eq!(SqliteStore::open(directory.file()).expect("open").identity(), legacy);
        let moved = directory.0.path().join("moved.sqlite");
        std::fs::rename(directory.file(), &moved).expect("move the file");
        let store = SqliteStore::open(&moved).expect("open the moved file");
        assert_eq!(
            store.identity(),
            legacy,
            "stored at the first open, kept after the move"
        );
        assert_eq!(
            store.load(&actor).await.expect("load"),
            Some(Bytes::from_static(b"kept"))
        );
    }

    /// Goal: an identity is at most `SQLITE_IDENTITY_LENGTH_MAX_BYTES` long (a cluster
    /// takes no longer one): a long path loses its start, at a character boundary.
    #[test]
    fn a_long_path_gives_an_identity_cut_from_its_start() {
        let name = format!("/{}/state.sqlite", "é".repeat(SQLITE_IDENTITY_LENGTH_MAX_BYTES));
        for created_us in [None, Some(1_796_597_160_510_844)] {
            let identity = new_identity(created_us, &name);
            assert!(identity.len() <= SQLITE_IDENTITY_LENGTH_MAX_BYTES, "{}", identity.len());
            assert!(
                identity.len() >= SQLITE_IDENTITY_LENGTH_MAX_BYTES - 1,
                "{}",
                identity.len()
            );
            assert!(identity.ends_with("é/state.sqlite"), "{identity}");
        }
        assert_eq!(new_identity(Some(7), "/a.db"), "sqlite:7:/a.db");
        assert_eq!(new_identity(None, "/a.db"), "sqlite:/a.db");
    }

    /// Goal: an owner row that no claim can have written is an error, not a panic.
    /// Method: claim, overwrite the owner row's fence with -5 by hand, commit.
    #[tokio::test]
    async fn owner_row_with_an_impossible_fence_is_a_backend_error() {
        let store = SqliteStore::open_in_memory().expect("open in memory");
        let actor = agent("a");
        let fence = store.claim(&actor).await.expect("claim").fence;
        run_lock(&store.connection)
            .execute("UPDATE actor_owner SET fence = -5", [])
            .expect("corrupt the owner row");
        match store.commit(&actor, fence, TurnCommit::default()).await {
            Err(StoreError::Backend {
                operation: StoreOperation::Commit,
                cause,
            }) => assert_eq!(cause, "actor_owner holds fence -5, which no claim issues"),
            other => panic!("expected a backend error, got {other:?}"),
        }
    }

    /// What SQLite's generator gives in a fresh simulation with `seed`: the first
    /// `random()` of a store opened in it.
    #[cfg(madsim)]
    fn sqlite_random_in_simulation(seed: u64) -> i64 {
        let runtime = madsim::runtime::Runtime::with_seed_and_config(seed, madsim::Config::default());
        runtime.block_on(async {
            let store = SqliteStore::open_in_memory().expect("open in memory");
            let random: i64 = run_lock(&store.connection)
                .query_row("SELECT random()", [], |row| row.get(0))
                .expect("select random()");
            random
        })
    }

    /// Goal: under the simulator, SQLite's randomness is a function of the simulation
    /// seed, so it cannot make two runs of one seed differ. Method: read SQLite's
    /// `random()` in fresh simulations: twice with one seed (equal, although the
    /// process-wide generator ran on in between), once with another (different).
    /// Without the reseeding, SQLite seeds once per process from `/dev/urandom` and the
    /// second read continues the sequence of the first, so they differ.
    #[cfg(madsim)]
    #[test]
    fn sqlite_randomness_under_the_simulator_follows_the_simulation_seed() {
        let first = sqlite_random_in_simulation(7);
        let again = sqlite_random_in_simulation(7);
        let other = sqlite_random_in_simulation(8);
        assert_eq!(first, again, "one seed, two different SQLite random() values");
        assert_ne!(first, other, "two seeds, one SQLite random() value");
    }

    /// Goal: SQLite's randomness, even where it reaches virtual time, replays exactly, so
    /// `MADSIM_TEST_CHECK_DETERMINISM=1` passes (without that variable this test runs
    /// once and checks nothing more than that it runs). Method: sleep for as many virtual
    /// microseconds as SQLite's `random()` says, then draw from the simulator: madsim's
    /// check compares every draw and its virtual time between two runs of one seed.
    #[cfg(madsim)]
    #[tokio::test]
    async fn sqlite_randomness_that_reaches_virtual_time_replays_under_the_determinism_check() {
        let store = SqliteStore::open_in_memory().expect("open in memory");
        for _ in 0..3 {
            let random: i64 = run_lock(&store.connection)
                .query_row("SELECT random()", [], |row| row.get(0))
                .expect("select random()");
            tokio::time::sleep(std::time::Duration::from_micros(random.unsigned_abs() % 1_000_000)).await;
            let _: u64 = madsim::rand::random();
        }
    }

    /// Sets the store's busy timeout short, for a test that waits it out.
    fn wait_for_locks_at_most(store: &SqliteStore, timeout: std::time::Duration) {
        run_lock(&store.connection)
            .busy_timeout(timeout)
            .expect("set the busy timeout");
    }

    /// Goal: an operation that waits out the busy timeout on another connection's lock
    /// (another process, `sqlite3`) fails `Unavailable` ("database is locked"), having
    /// written nothing, and succeeds once the lock is let go; an error that is not a
    /// lock stays `Backend`. Method: a second connection holds the write lock
    /// (`BEGIN IMMEDIATE`) while the store claims and commits.
    #[tokio::test]
    async fn waiting_out_another_connections_lock_is_unavailable_and_writes_nothing() {
        let directory = TestDirectory::new("waiting_out_another_connections_lock_is_unavailable_and_writes_nothing");
        let store = SqliteStore::open(directory.file()).expect("open");
        wait_for_locks_at_most(&store, std::time::Duration::from_millis(20));
        let actor = agent("a");
        let fence = store.claim(&actor).await.expect("claim").fence;
        let other = Connection::open(directory.file()).expect("open with rusqlite");
        other.execute_batch("BEGIN IMMEDIATE").expect("take the write lock");
        let commit = TurnCommit {
            state: StateChange::Set(Bytes::from_static(b"s")),
            writes: vec![("k".to_string(), Some(Bytes::from_static(b"v")))],
        };
        match store.commit(&actor, fence, commit.clone()).await {
            Err(
                error @ StoreError::Unavailable {
                    operation: StoreOperation::Commit,
                    ..
                },
            ) => {
                assert!(error.is_transient());
                assert!(error.to_string().contains("locked"), "{error}");
            }
            other => panic!("a commit behind another connection's lock: {other:?}"),
        }
        assert!(matches!(
            store.claim(&agent("b")).await,
            Err(StoreError::Unavailable {
                operation: StoreOperation::Claim,
                ..
            })
        ));
        other.execute_batch("ROLLBACK").expect("let go of the lock");
        assert_eq!(store.load(&actor).await.expect("load"), None, "nothing written");
        store
            .commit(&actor, fence, commit)
            .await
            .expect("made once the lock is let go");
        assert_eq!(store.load(&actor).await.expect("load"), Some(Bytes::from_static(b"s")));
        assert_eq!(
            operation_error(StoreOperation::Get, &rusqlite::Error::QueryReturnedNoRows),
            StoreError::Backend {
                operation: StoreOperation::Get,
                cause: rusqlite::Error::QueryReturnedNoRows.to_string(),
            }
        );
    }

    /// Goal: a runtime on a file that another connection holds locked for longer than
    /// the store waits serves the call once the lock is let go: the commit that met the
    /// lock is tried again (`RuntimeCounters::store_retries`), and the caller gets its
    /// answer, not `StorageFailed`. Before, the call failed "database is locked".
    #[tokio::test]
    async fn a_call_on_a_file_locked_for_a_while_is_served_once_the_lock_is_let_go() {
        use crate::{Actor, ActorBox, ActorError, KindConfig, Runtime, Turn};

        struct Counter(u64);
        impl Actor for Counter {
            async fn handle(&mut self, _turn: &mut Turn, _payload: Bytes) -> Result<Bytes, ActorError> {
                self.0 += 1;
                Ok(Bytes::from(self.0.to_string()))
            }
            fn snapshot(&self) -> Result<Option<Bytes>, ActorError> {
                Ok(Some(Bytes::from(self.0.to_string())))
            }
        }

        let directory = TestDirectory::new("a_call_on_a_file_locked_for_a_while_is_served_once_the_lock_is_let_go");
        let store = SqliteStore::open(directory.file()).expect("open");
        wait_for_locks_at_most(&store, std::time::Duration::from_millis(20));
        let runtime = Runtime::builder()
            .store(Arc::new(store.clone()))
            .register(
                troupe_core::ActorKind::new("counter").expect("a kind"),
                |_id: &ActorId, saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
                    let count = saved.map_or(0, |bytes| {
                        std::str::from_utf8(&bytes).expect("utf-8").parse().expect("a count")
                    });
                    Ok(ActorBox::new(Counter(count)))
                },
                KindConfig::default(),
            )
            .expect("register")
            .start();
        let id = ActorId::new("counter", "c").expect("an id");
        let inc = || runtime.invoke_within(&id, Bytes::from_static(b"inc"), std::time::Duration::from_secs(10));
        assert_eq!(inc().await, Ok(Bytes::from_static(b"1")));
        let other = Connection::open(directory.file()).expect("open with rusqlite");
        other.execute_batch("BEGIN IMMEDIATE").expect("take the write lock");
        let holder = tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            other.execute_batch("ROLLBACK").expect("let go of the lock");
        });
        assert_eq!(
            inc().await,
            Ok(Bytes::from_static(b"2")),
            "served once the lock was let go"
        );
        holder.await.expect("the holder ended");
        assert!(runtime.handle().counters().store_retries > 0, "the commit met the lock");
        assert_eq!(store.load(&id).await.expect("load"), Some(Bytes::from_static(b"2")));
        runtime.shutdown().await;
    }
}
