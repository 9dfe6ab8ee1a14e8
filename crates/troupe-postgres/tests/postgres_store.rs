//! `PostgresStore` against a real PostgreSQL server that each test starts and stops.
//!
//! Each test runs `initdb` into a temporary directory and starts `postgres` on a free
//! loopback port with `pg_ctl` (stopped again when the test's [`TestServer`] is
//! dropped). The server binaries come from the Debian package `postgresql`: `pg_config
//! --bindir`, else `/usr/lib/postgresql/*/bin`. Without them every test here fails and
//! says to install the package; none is skipped. PostgreSQL refuses to run as root, so
//! when the tests run as root the server runs as the `postgres` user (which the package
//! creates), else as `nobody`, through `runuser`.
//!
//! The whole `troupe_runtime::conformance` suite runs against the store, each case on a
//! database of its own on one server; then the tests only a shared database makes
//! sense for: two stores (two processes) fencing each other, claims racing commits,
//! concurrent commits under one fence, two runtimes racing on one counter, rollback of
//! failed and dropped commits, schema versions, and a latency comparison with the
//! SQLite file store that prints its numbers.
//!
//! Run with `cargo nextest run -p troupe-postgres` (add `--no-capture` to see the
//! latencies).
#![cfg(not(madsim))]

use std::sync::Arc;

use tokio::time::Instant;
use troupe_core::{ActorId, ActorKind, InvokeError};
use troupe_postgres::{tokio_postgres, PostgresStore, POSTGRES_SCHEMA_VERSION};
use troupe_runtime::conformance::{
    actor, bytes, claim_with_fence_takes_newer_fences_and_refuses_older, delete, fenced, put, run_all, state_commit,
    strings, writes_commit,
};
use troupe_runtime::{
    Actor, ActorBox, ActorError, Fence, KindConfig, Runtime, RuntimeHandle, SqliteStore, StateStore, StoreError,
    StoreOperation, Turn,
};

#[path = "support/postgres_server.rs"]
mod postgres_server;
use postgres_server::{free_port, TestServer};

// ---------------------------------------------------------------------------------------
// The conformance suite
// ---------------------------------------------------------------------------------------

/// Goal: the PostgreSQL store keeps the whole `StateStore` contract. Method: every case
/// of `troupe_runtime::conformance`, each on a fresh database of one server.
#[tokio::test]
async fn postgres_store_passes_the_whole_conformance_suite() {
    let server = TestServer::start("conformance");
    let mut case_index = 0_usize;
    run_all(|_case_name| {
        case_index += 1;
        let database = format!("case_{case_index}");
        let server = &server;
        async move { server.store(&database).await }
    })
    .await;
}

// ---------------------------------------------------------------------------------------
// Two stores on one database
// ---------------------------------------------------------------------------------------

/// `claim_with_fence` (the claim under a cluster placement's fence): two stores on one
/// database, as two nodes, run the conformance case for external fences.
#[tokio::test]
async fn two_stores_take_newer_external_fences_and_refuse_older() {
    let server = TestServer::start("fenced-claim");
    let config = server.create_database("shared").await;
    let node_a = PostgresStore::connect(&config).await.expect("connect A");
    let node_b = PostgresStore::connect(&config).await.expect("connect B");
    claim_with_fence_takes_newer_fences_and_refuses_older(&node_a, &node_b).await;
}

/// Goal: a stale owner learns it is fenced from a check, before any commit: the first
/// store's fence check answers what its commit would (`Fenced`, naming the newer fence),
/// and the second's check passes. Before, the store answered every check `Ok` (the
/// trait's default), so a stale agent on PostgreSQL still called its model.
#[tokio::test]
async fn a_fence_check_on_a_second_store_refuses_the_stale_owner() {
    let server = TestServer::start("fence-check");
    let config = server.create_database("shared").await;
    let first = PostgresStore::connect(&config).await.expect("connect the first store");
    let second = PostgresStore::connect(&config).await.expect("connect the second store");
    let owner = actor("agent", "writer");
    let stale = first.claim(&owner).await.expect("claim").fence;
    first
        .check_fence(&owner, stale)
        .await
        .expect("the only claim is current");
    let newer = second.claim(&owner).await.expect("claim").fence;
    assert_eq!(
        first.check_fence(&owner, stale).await,
        Err(fenced(&owner, stale, Some(newer)))
    );
    second
        .check_fence(&owner, newer)
        .await
        .expect("the newest claim is current");
}

/// Goal: fencing holds between two stores on one database, as between two processes:
/// the second's claim fences off the first, whose commit (a zombie owner's) is refused
/// and leaves nothing visible, and no acknowledged update is lost. Method: two stores,
/// each with its own pool, act as two activations of one counter in the interleaving
/// that loses an update without fencing; then the first claims again and wins back.
#[tokio::test]
async fn second_store_fences_the_first_and_the_zombie_cannot_overwrite() {
    let server = TestServer::start("two-stores");
    let config = server.create_database("shared").await;
    let first = PostgresStore::connect(&config).await.expect("connect the first store");
    let second = PostgresStore::connect(&config).await.expect("connect the second store");
    let owner = actor("counter", "c");

    let first_claim = first.claim(&owner).await.expect("claim");
    assert_eq!((first_claim.fence, first_claim.state), (Fence::FIRST, None));
    first
        .commit(&owner, first_claim.fence, state_commit("1", vec![put("by", "first")]))
        .await
        .expect("the only claim commits");

    let second_claim = second.claim(&owner).await.expect("claim");
    assert_eq!(second_claim.fence, Fence::FIRST.next());
    assert_eq!(second_claim.state, Some(bytes("1")));
    second
        .commit(&owner, second_claim.fence, state_commit("2", vec![put("by", "second")]))
        .await
        .expect("the newest claim commits");

    // The zombie still believes the count is 1, and writes a key of its own too.
    let refused = first
        .commit(
            &owner,
            first_claim.fence,
            state_commit("2", vec![put("by", "first"), put("zombie", "was here")]),
        )
        .await;
    assert_eq!(
        refused,
        Err(fenced(&owner, first_claim.fence, Some(second_claim.fence)))
    );
    for reader in [&first, &second] {
        assert_eq!(reader.load(&owner).await.expect("load"), Some(bytes("2")));
        assert_eq!(reader.get(&owner, "by").await.expect("get"), Some(bytes("second")));
        assert_eq!(reader.get(&owner, "zombie").await.expect("get"), None);
    }
    // An empty commit of the zombie is refused as well.
    assert_eq!(
        first.commit(&owner, first_claim.fence, Default::default()).await,
        Err(fenced(&owner, first_claim.fence, Some(second_claim.fence)))
    );

    let reclaim = first.claim(&owner).await.expect("claim again");
    assert_eq!(reclaim.fence, Fence::FIRST.next().next());
    assert_eq!(reclaim.state, Some(bytes("2")));
    first
        .commit(&owner, reclaim.fence, state_commit("3", vec![]))
        .await
        .expect("the new claim commits");
    let refused = second
        .commit(&owner, second_claim.fence, state_commit("3", vec![put("zombie", "2")]))
        .await;
    assert_eq!(refused, Err(fenced(&owner, second_claim.fence, Some(reclaim.fence))));

    drop((first, second));
    let reader = PostgresStore::connect(&config).await.expect("connect a third store");
    // Three commits were acknowledged, each adding one: the count is 3.
    assert_eq!(reader.load(&owner).await.expect("load"), Some(bytes("3")));
    assert_eq!(reader.get(&owner, "zombie").await.expect("get"), None);
}

/// Goal: a commit racing a claim from another store is either applied before the claim
/// (and the claim returns it) or refused; never accepted yet missing from the claim's
/// state. Method: many rounds, each a zombie commit and a claim started at once on two
/// multi-threaded tasks with two stores.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn commit_racing_a_claim_is_either_seen_by_the_claim_or_refused() {
    const ROUNDS: usize = 200;
    let server = TestServer::start("claim-race");
    let config = server.create_database("shared").await;
    let first = Arc::new(PostgresStore::connect(&config).await.expect("connect"));
    let second = Arc::new(PostgresStore::connect(&config).await.expect("connect"));
    let owner = actor("counter", "raced");
    let mut fence = first.claim(&owner).await.expect("claim").fence;
    let (mut applied, mut refused) = (0_usize, 0_usize);
    for round in 0..ROUNDS {
        let value = format!("round {round}");
        let committer = {
            let (first, owner, value) = (Arc::clone(&first), owner.clone(), value.clone());
            tokio::spawn(async move { first.commit(&owner, fence, state_commit(&value, vec![])).await })
        };
        let claimer = {
            let (second, owner) = (Arc::clone(&second), owner.clone());
            tokio::spawn(async move { second.claim(&owner).await })
        };
        let committed = committer.await.expect("the commit task");
        let claimed = claimer.await.expect("the claim task").expect("claim");
        match committed {
            Ok(()) => {
                applied += 1;
                assert_eq!(
                    claimed.state,
                    Some(bytes(&value)),
                    "round {round}: an accepted commit is missing from the claim after it"
                );
            }
            Err(error) => {
                refused += 1;
                assert_eq!(error, fenced(&owner, fence, Some(claimed.fence)), "round {round}");
                assert_ne!(claimed.state, Some(bytes(&value)), "round {round}");
            }
        }
        // The next round's zombie commit is under the claim just made, by the first
        // store: reclaim there so that its fence is the newest again.
        fence = first.claim(&owner).await.expect("reclaim").fence;
    }
    println!("claim race: {applied} commits applied before the claim, {refused} refused");
}

// ---------------------------------------------------------------------------------------
// Concurrency under one fence
// ---------------------------------------------------------------------------------------

/// Goal: concurrent commits of many tasks under one fence, on a multi-threaded runtime
/// and over every pooled connection, lose no write. Method: 32 tasks each commit 20
/// keys of their own, one commit per key, then every key is read back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_commits_under_one_fence_lose_no_write() {
    const TASKS: usize = 32;
    const COMMITS_PER_TASK: usize = 20;
    let server = TestServer::start("concurrent");
    let store = Arc::new(server.store("concurrent").await);
    let owner = actor("agent", "busy");
    let fence = store.claim(&owner).await.expect("claim").fence;
    let tasks: Vec<_> = (0..TASKS)
        .map(|task| {
            let (store, owner) = (Arc::clone(&store), owner.clone());
            tokio::spawn(async move {
                for index in 0..COMMITS_PER_TASK {
                    let key = format!("task{task:02}/{index:02}");
                    store
                        .commit(&owner, fence, writes_commit(vec![put(&key, &key)]))
                        .await
                        .expect("a commit under the newest fence");
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("a committing task");
    }
    let entries = store
        .scan(&owner, "task", None, TASKS * COMMITS_PER_TASK + 1)
        .await
        .expect("scan");
    assert_eq!(entries.len(), TASKS * COMMITS_PER_TASK);
    for (key, value) in entries {
        assert_eq!(value, bytes(&key));
    }
    let keys: Vec<String> = store
        .scan(&owner, "task07/", None, 100)
        .await
        .expect("scan")
        .into_iter()
        .map(|(key, _)| key)
        .collect();
    let expected: Vec<String> = (0..COMMITS_PER_TASK)
        .map(|index| format!("task07/{index:02}"))
        .collect();
    assert_eq!(keys, expected);
}

// ---------------------------------------------------------------------------------------
// Two runtimes on one database
// ---------------------------------------------------------------------------------------

/// A count, saved as text. Commands: `add` (one more), `get`; replies with the count.
struct Counter(u64);

impl Actor for Counter {
    async fn handle(&mut self, _turn: &mut Turn, payload: bytes::Bytes) -> Result<bytes::Bytes, ActorError> {
        match payload.as_ref() {
            b"add" => self.0 += 1,
            b"get" => {}
            other => return Err(ActorError::rejected(format!("unknown command {other:?}"))),
        }
        Ok(bytes(&self.0.to_string()))
    }

    fn snapshot(&self) -> Result<Option<bytes::Bytes>, ActorError> {
        Ok(Some(bytes(&self.0.to_string())))
    }
}

fn start_runtime(store: PostgresStore) -> Runtime {
    Runtime::builder()
        .store(Arc::new(store))
        .register(
            ActorKind::new("counter").expect("a valid kind"),
            |_: &ActorId, saved: Option<bytes::Bytes>| -> Result<ActorBox, ActorError> {
                let count = saved.map_or(0, |saved| {
                    std::str::from_utf8(&saved)
                        .expect("a count is text")
                        .parse()
                        .expect("a count is a number")
                });
                Ok(ActorBox::new(Counter(count)))
            },
            KindConfig::default(),
        )
        .expect("register the counter")
        .start()
}

async fn send(runtime: &RuntimeHandle, target: &ActorId, command: &str) -> Result<bytes::Bytes, InvokeError> {
    /// How long one request may take, in seconds.
    const INVOKE_DEADLINE_S: u64 = 60;
    let deadline = runtime.deadline_in(std::time::Duration::from_secs(INVOKE_DEADLINE_S));
    runtime.invoke(target, bytes(command), deadline).await
}

/// Goal: two runtimes (as on two machines) sharing one PostgreSQL database lose no
/// acknowledged increment of one counter: whenever one activates the counter, the
/// other's activation is fenced off, its commit refused as `Fenced`. Method: on worker
/// threads, both runtimes activate the counter, wait for each other, then send their
/// increments, each restarting itself after a refusal (so activations keep fencing each
/// other off); the committed count must equal the acknowledged increments.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_runtimes_on_one_database_lose_no_acknowledged_increment() {
    const INCREMENTS_PER_RUNTIME: u64 = 40;
    let server = TestServer::start("runtimes");
    let config = server.create_database("runtimes").await;
    let id = actor("counter", "c");
    let both_started = Arc::new(tokio::sync::Barrier::new(2));
    let race = |config: String, id: ActorId, both_started: Arc<tokio::sync::Barrier>| async move {
        let connect = || async { PostgresStore::connect(&config).await.expect("connect a store") };
        let mut runtime = start_runtime(connect().await);
        // Activating: the other runtime's activation may fence this one's first turn
        // off already; restart then, as after a refused increment.
        loop {
            match send(&runtime, &id, "get").await {
                Ok(_) => break,
                Err(InvokeError::StorageFailed {
                    source: StoreError::Fenced { .. },
                    ..
                }) => {
                    runtime.shutdown().await;
                    runtime = start_runtime(connect().await);
                }
                Err(other) => panic!("activating the counter failed with {other:?}"),
            }
        }
        // The normal build only (this file), where a replay is not promised (see
        // clippy.toml on `Barrier::wait`).
        #[allow(clippy::disallowed_methods)]
        both_started.wait().await;
        let (mut acknowledged, mut refused) = (0_u64, 0_u64);
        for _ in 0..INCREMENTS_PER_RUNTIME {
            tokio::task::yield_now().await;
            match send(&runtime, &id, "add").await {
                Ok(_) => acknowledged += 1,
                Err(InvokeError::StorageFailed {
                    source: StoreError::Fenced { .. },
                    ..
                }) => {
                    refused += 1;
                    runtime.shutdown().await;
                    runtime = start_runtime(connect().await);
                }
                Err(other) => panic!("an increment failed with {other:?}"),
            }
        }
        runtime.shutdown().await;
        (acknowledged, refused)
    };
    let first = tokio::spawn(race(config.clone(), id.clone(), Arc::clone(&both_started)));
    let second = tokio::spawn(race(config.clone(), id.clone(), both_started));
    // Either task's panic ends the test at once (the other would wait at the barrier).
    let (first, second) = tokio::try_join!(first, second).expect("both runtimes finish");
    println!("racing runtimes: (acknowledged, refused) per runtime: {first:?} {second:?}");
    assert_eq!(first.0 + first.1, INCREMENTS_PER_RUNTIME);
    assert_eq!(second.0 + second.1, INCREMENTS_PER_RUNTIME);
    let reader = PostgresStore::connect(&config).await.expect("connect a reader");
    let committed = reader.load(&id).await.expect("load");
    assert_eq!(committed, Some(bytes(&(first.0 + second.0).to_string())));
}

// ---------------------------------------------------------------------------------------
// Schema, keys and errors
// ---------------------------------------------------------------------------------------

/// Goal: connecting again keeps the data and the schema version; a database with a
/// newer schema version is refused, not misread. Method: connect, commit, connect
/// again, then raise the version by hand.
#[tokio::test]
async fn schema_is_kept_on_reconnect_and_a_newer_version_is_refused() {
    let server = TestServer::start("schema");
    let config = server.create_database("schema").await;
    let owner = actor("agent", "a");
    {
        let store = PostgresStore::connect(&config).await.expect("connect");
        let fence = store.claim(&owner).await.expect("claim").fence;
        store
            .commit(&owner, fence, state_commit("kept", vec![put("k", "v")]))
            .await
            .expect("commit");
    }
    let store = PostgresStore::connect(&config).await.expect("connect again");
    assert_eq!(store.load(&owner).await.expect("load"), Some(bytes("kept")));
    // The fence survives too: the next claim is the second.
    assert_eq!(store.claim(&owner).await.expect("claim").fence, Fence::FIRST.next());

    let (client, connection) = tokio_postgres::connect(&config, tokio_postgres::NoTls)
        .await
        .expect("connect directly");
    let connection = tokio::spawn(connection);
    let versions: Vec<i64> = client
        .query("SELECT version FROM troupe_schema", &[])
        .await
        .expect("read the version")
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(versions, vec![POSTGRES_SCHEMA_VERSION]);
    client
        .execute("UPDATE troupe_schema SET version = version + 1", &[])
        .await
        .expect("raise the version");
    drop(client);
    connection.await.expect("the connection task").expect("the connection");
    match PostgresStore::connect(&config).await {
        Err(StoreError::Backend { operation, cause }) => {
            assert_eq!(operation, StoreOperation::Open);
            assert!(
                cause.contains(&format!("schema version {}", POSTGRES_SCHEMA_VERSION + 1)),
                "unexpected cause: {cause}"
            );
        }
        Err(other) => panic!("expected a backend error, got {other:?}"),
        Ok(_) => panic!("a database with a newer schema version was opened"),
    }
}

/// The rows of `troupe_fence_log` for one actor, in id order: (event, fence, holder).
async fn fence_log_rows(config: &str, owner: &ActorId) -> Vec<(String, i64, Option<String>)> {
    let (client, connection) = tokio_postgres::connect(config, tokio_postgres::NoTls)
        .await
        .expect("connect directly");
    let connection = tokio::spawn(connection);
    let rows = client
        .query(
            "SELECT event, fence, holder FROM troupe_fence_log WHERE kind = $1 AND key = $2 ORDER BY id",
            &[&owner.kind().as_str(), &owner.key()],
        )
        .await
        .expect("read the fence log")
        .iter()
        .map(|row| (row.get(0), row.get(1), row.get(2)))
        .collect();
    drop(client);
    connection.await.expect("the connection task").expect("the connection");
    rows
}

/// Goal: the fence log holds exactly the accepted claims (both kinds of claim) and, for
/// a store built `with_commit_log(true)`, the accepted commits, each with its fence and
/// holder; nothing refused is logged. Method: store `a` (commits logged) and store `b`
/// (not) claim and commit in turn, with refusals in between; read the log.
#[tokio::test]
async fn fence_log_records_accepted_claims_and_logged_commits_only() {
    let server = TestServer::start("fence-log");
    let config = server.create_database("fencelog").await;
    let a = PostgresStore::connect(&config)
        .await
        .expect("connect a")
        .with_holder("a")
        .expect("a holder name")
        .with_commit_log(true);
    let b = PostgresStore::connect(&config)
        .await
        .expect("connect b")
        .with_holder("b")
        .expect("a holder name");
    let owner = actor("agent", "x");
    let first = a.claim(&owner).await.expect("claim").fence;
    a.commit(&owner, first, state_commit("1", vec![put("k", "1")]))
        .await
        .expect("commit under the newest fence");
    use troupe_runtime::FencedClaim as _;
    let ten = Fence::from_token(10).expect("a fence");
    b.claim_with_fence(&owner, ten).await.expect("a newer external fence");
    assert!(matches!(
        a.commit(&owner, first, state_commit("2", vec![])).await,
        Err(StoreError::Fenced { .. })
    ));
    let five = Fence::from_token(5).expect("a fence");
    assert!(matches!(
        b.claim_with_fence(&owner, five).await,
        Err(StoreError::Fenced { .. })
    ));
    b.commit(&owner, ten, state_commit("2", vec![put("k", "2")]))
        .await
        .expect("b commits, unlogged");
    let eleven = a.claim(&owner).await.expect("claim").fence;
    a.commit(&owner, eleven, state_commit("3", vec![]))
        .await
        .expect("commit under the newest fence");
    let expected: Vec<(String, i64, Option<String>)> = vec![
        ("claim".into(), 1, Some("a".into())),
        ("commit".into(), 1, Some("a".into())),
        ("claim".into(), 10, Some("b".into())),
        ("claim".into(), 11, Some("a".into())),
        ("commit".into(), 11, Some("a".into())),
    ];
    assert_eq!(fence_log_rows(&config, &owner).await, expected);
}

/// Goal: a holder name that PostgreSQL text cannot store (one with a NUL byte) is
/// refused when it is given, with `HolderError::ContainsNul` naming the name and where
/// the NUL is, instead of being taken and making every later claim fail with an
/// encoding error. Method: give a store such a name (refused), then a good one on a
/// fresh connection, which claims and is in the fence log.
#[tokio::test]
async fn a_holder_name_with_a_nul_byte_is_refused_when_given() {
    use troupe_postgres::HolderError;

    let server = TestServer::start("holder-nul");
    let config = server.create_database("holder").await;
    let refused = PostgresStore::connect(&config)
        .await
        .expect("connect")
        .with_holder("node\0one")
        .expect_err("a holder name with a NUL byte is refused");
    assert_eq!(
        refused,
        HolderError::ContainsNul {
            holder: "node\0one".into(),
            position: 4
        }
    );
    assert_eq!(
        refused.to_string(),
        "the holder name \"node\\0one\" has a NUL byte at byte 4, which PostgreSQL text cannot store; \
         give a name without one"
    );
    assert!(matches!(
        StoreError::from(refused),
        StoreError::Backend {
            operation: StoreOperation::Open,
            ..
        }
    ));
    let store = PostgresStore::connect(&config)
        .await
        .expect("connect")
        .with_holder("node-one")
        .expect("a name without a NUL byte is taken");
    let owner = actor("agent", "h");
    let fence = store.claim(&owner).await.expect("claim").fence;
    assert_eq!(
        fence_log_rows(&config, &owner).await,
        vec![(
            "claim".into(),
            i64::try_from(fence.token()).unwrap(),
            Some("node-one".into())
        )]
    );
}

/// Goal: a version 1 database (no fence log) is migrated to version 2 at connect,
/// keeping its data. Method: connect, commit, turn the database back into version 1 by
/// hand (drop the log, set the version), connect again, claim.
#[tokio::test]
async fn version_1_database_is_migrated_to_the_fence_log() {
    let server = TestServer::start("migrate");
    let config = server.create_database("migrate").await;
    let owner = actor("agent", "m");
    {
        let store = PostgresStore::connect(&config).await.expect("connect");
        let fence = store.claim(&owner).await.expect("claim").fence;
        store
            .commit(&owner, fence, state_commit("kept", vec![]))
            .await
            .expect("commit");
    }
    let (client, connection) = tokio_postgres::connect(&config, tokio_postgres::NoTls)
        .await
        .expect("connect directly");
    let connection = tokio::spawn(connection);
    client
        .batch_execute("DROP TABLE troupe_fence_log; UPDATE troupe_schema SET version = 1")
        .await
        .expect("make it version 1");
    let store = PostgresStore::connect(&config).await.expect("connect migrates");
    let version: i64 = client
        .query_one("SELECT version FROM troupe_schema", &[])
        .await
        .expect("read the version")
        .get(0);
    assert_eq!(version, POSTGRES_SCHEMA_VERSION);
    drop(client);
    connection.await.expect("the connection task").expect("the connection");
    let claimed = store.claim(&owner).await.expect("claim");
    assert_eq!(claimed.state, Some(bytes("kept")));
    assert_eq!(
        fence_log_rows(&config, &owner).await,
        vec![("claim".to_string(), 2, None)]
    );
}

/// Goal: an unreachable server and a malformed configuration are backend errors of
/// `open`, not panics. Method: connect to a closed port, and with a bad string.
#[tokio::test]
async fn unreachable_server_and_bad_configuration_are_open_errors() {
    let port = free_port();
    let unreachable = PostgresStore::connect(&format!("host=127.0.0.1 port={port} user=nobody dbname=x")).await;
    assert!(
        matches!(
            unreachable,
            Err(StoreError::Backend {
                operation: StoreOperation::Open,
                ..
            })
        ),
        "{unreachable:?}"
    );
    let malformed = PostgresStore::connect("host=127.0.0.1 port=not-a-number").await;
    assert!(
        matches!(
            malformed,
            Err(StoreError::Backend {
                operation: StoreOperation::Open,
                ..
            })
        ),
        "{malformed:?}"
    );
}

/// Goal: a key with a NUL character, which a PostgreSQL `TEXT` cannot hold, is stored
/// and scanned like any other (keys are `BYTEA`). Method: commit, get, scan.
#[tokio::test]
async fn keys_with_a_nul_character_are_stored_and_scanned() {
    let server = TestServer::start("nul");
    let store = server.store("nul").await;
    let owner = actor("agent", "a");
    let fence = store.claim(&owner).await.expect("claim").fence;
    store
        .commit(
            &owner,
            fence,
            writes_commit(vec![put("a\0b", "nul"), put("a", "plain")]),
        )
        .await
        .expect("commit");
    assert_eq!(store.get(&owner, "a\0b").await.expect("get"), Some(bytes("nul")));
    let keys: Vec<String> = store
        .scan(&owner, "a", None, 10)
        .await
        .expect("scan")
        .into_iter()
        .map(|(key, _)| key)
        .collect();
    assert_eq!(keys, strings(&["a", "a\0b"]));
}

/// A plain connection to `config`, for a test to change the database by hand; its
/// connection task runs until the client is dropped.
async fn direct_client(config: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(config, tokio_postgres::NoTls)
        .await
        .expect("connect directly");
    tokio::spawn(connection);
    client
}

/// Goal: a commit that fails inside PostgreSQL after some of its statements ran is
/// rolled back whole, and the store goes on committing. Method: a trigger raises on
/// the insert of the key `poison`; the commit also sets the state, adds a key and
/// deletes one, all pipelined with the fence check.
#[tokio::test]
async fn commit_failing_inside_postgres_leaves_nothing_of_it_visible() {
    let server = TestServer::start("poison");
    let config = server.create_database("poison").await;
    let store = PostgresStore::connect(&config).await.expect("connect");
    let owner = actor("agent", "a");
    let fence = store.claim(&owner).await.expect("claim").fence;
    store
        .commit(&owner, fence, state_commit("A", vec![put("kept", "1")]))
        .await
        .expect("first commit");
    direct_client(&config)
        .await
        .batch_execute(
            "CREATE FUNCTION poison() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 IF NEW.entry_key = convert_to('poison', 'UTF8') THEN RAISE EXCEPTION 'poisoned key'; END IF;
                 RETURN NEW;
             END $$;
             CREATE TRIGGER poison BEFORE INSERT ON troupe_actor_entry FOR EACH ROW EXECUTE FUNCTION poison();",
        )
        .await
        .expect("create the trigger");

    let failing = state_commit("B", vec![put("new", "2"), delete("kept"), put("poison", "3")]);
    match store.commit(&owner, fence, failing).await {
        Err(StoreError::Backend {
            operation: StoreOperation::Commit,
            cause,
        }) => assert!(cause.contains("poisoned key"), "unexpected cause: {cause}"),
        other => panic!("expected a backend error from the commit, got {other:?}"),
    }
    assert_eq!(store.load(&owner).await.expect("load"), Some(bytes("A")));
    assert_eq!(store.get(&owner, "kept").await.expect("get"), Some(bytes("1")));
    assert_eq!(store.get(&owner, "new").await.expect("get"), None);
    store
        .commit(&owner, fence, state_commit("C", vec![]))
        .await
        .expect("the store still commits");
    assert_eq!(store.load(&owner).await.expect("load"), Some(bytes("C")));
}

/// Goal: a commit whose caller gives up while it waits inside its transaction is rolled
/// back, and leaves no lock behind that would stall the next claim. Method: hold the
/// owner row's lock from another connection, so the commit blocks on its fence check;
/// drop the commit after 200 ms; release the lock; claim (bounded by 10 s) and read.
#[tokio::test]
async fn dropped_commit_is_rolled_back_and_holds_no_lock() {
    const COMMIT_WAIT_MS: u64 = 200;
    const CLAIM_WAIT_MS: u64 = 10_000;
    let server = TestServer::start("dropped");
    let config = server.create_database("dropped").await;
    let store = PostgresStore::connect(&config).await.expect("connect");
    let owner = actor("agent", "a");
    let fence = store.claim(&owner).await.expect("claim").fence;

    let locker = direct_client(&config).await;
    locker
        .batch_execute("BEGIN; SELECT fence FROM troupe_actor_owner FOR UPDATE")
        .await
        .expect("lock the owner row");
    let commit = store.commit(&owner, fence, state_commit("dropped", vec![put("k", "dropped")]));
    let outcome = tokio::time::timeout(std::time::Duration::from_millis(COMMIT_WAIT_MS), commit).await;
    assert!(
        outcome.is_err(),
        "the commit finished while the row was locked: {outcome:?}"
    );
    locker.batch_execute("ROLLBACK").await.expect("release the lock");

    let claim = tokio::time::timeout(std::time::Duration::from_millis(CLAIM_WAIT_MS), store.claim(&owner))
        .await
        .expect("a claim after the dropped commit is not blocked by its lock")
        .expect("claim");
    assert_eq!(claim.fence, fence.next());
    assert_eq!(claim.state, None);
    assert_eq!(store.get(&owner, "k").await.expect("get"), None);
}

// ---------------------------------------------------------------------------------------
// Latency, printed (no assertion on time)
// ---------------------------------------------------------------------------------------

/// Median and 99th percentile of `samples`, in microseconds.
fn percentiles(mut samples: Vec<u128>) -> (u128, u128) {
    samples.sort_unstable();
    let at = |fraction: f64| {
        let index = ((samples.len() - 1) as f64 * fraction).round() as usize;
        samples[index]
    };
    (at(0.5), at(0.99))
}

/// The latency of `COMMITS` single-key commits (one new key each, state unchanged)
/// under one fence, in microseconds each.
async fn commit_latencies(store: &dyn StateStore) -> Vec<u128> {
    const COMMITS: usize = 300;
    let owner = actor("agent", "timed");
    let fence = store.claim(&owner).await.expect("claim").fence;
    let mut samples = Vec::with_capacity(COMMITS);
    for index in 0..COMMITS {
        let key = format!("k{index:04}");
        let started = Instant::now();
        store
            .commit(&owner, fence, writes_commit(vec![put(&key, "v")]))
            .await
            .expect("commit");
        samples.push(started.elapsed().as_micros());
    }
    samples
}

/// Measures, and prints, the median and 99th percentile latency of single-key commits:
/// PostgreSQL on loopback (default durability: `fsync` and `synchronous_commit` on)
/// against the SQLite file store (WAL, `synchronous = FULL`). Asserts nothing about time.
#[tokio::test]
async fn commit_latency_of_postgres_and_sqlite_file_is_printed() {
    let server = TestServer::start("latency");
    let postgres = server.store("latency").await;
    let directory = tempfile::tempdir().expect("a directory for the SQLite file");
    let sqlite = SqliteStore::open(directory.path().join("state.sqlite")).expect("open a SQLite file");

    let config = server.config("latency");
    let (client, connection) = tokio_postgres::connect(&config, tokio_postgres::NoTls)
        .await
        .expect("connect directly");
    let connection = tokio::spawn(connection);
    let mut settings = Vec::new();
    for setting in ["server_version", "fsync", "synchronous_commit", "wal_sync_method"] {
        let rows = client
            .simple_query(&format!("SHOW {setting}"))
            .await
            .expect("show a setting");
        for row in rows {
            if let tokio_postgres::SimpleQueryMessage::Row(row) = row {
                settings.push(format!("{setting} = {}", row.get(0).unwrap_or("?")));
            }
        }
    }
    drop(client);
    connection.await.expect("the connection task").expect("the connection");

    let (postgres_median, postgres_p99) = percentiles(commit_latencies(&postgres).await);
    let (sqlite_median, sqlite_p99) = percentiles(commit_latencies(&sqlite).await);
    println!(
        "single-key commit latency, 300 commits each; postgres: {}",
        settings.join(", ")
    );
    println!("  postgres (loopback): median {postgres_median} us, p99 {postgres_p99} us");
    println!("  sqlite file:         median {sqlite_median} us, p99 {sqlite_p99} us");
}

/// The connections to `database` other than the asking one, as the server counts them.
async fn connections_to(observer: &tokio_postgres::Client, database: &str) -> i64 {
    observer
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
            &[&database],
        )
        .await
        .expect("read pg_stat_activity")
        .get(0)
}

/// Goal: a runtime on a `PostgresStore` that ends (shut down, or dropped) closes every
/// connection its store's pool opened: a process that restarts its runtime must not
/// leave connections open on the server until it runs out of them. Method: 16 counters
/// are incremented at once (so the pool opens several connections); the server must
/// then count that many connections to the database, and none within
/// `CLOSE_WAIT_MS` of the end. Once for a shutdown, once for a drop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_runtime_closes_its_stores_connections() {
    /// Counters incremented at once.
    const COUNTERS: usize = 16;
    /// How long the server gets to see the connections closed (ms).
    const CLOSE_WAIT_MS: u64 = 10_000;
    let server = TestServer::start("connections");
    let config = server.create_database("connections").await;
    let observer = direct_client(&config).await;
    for shut_down in [true, false] {
        let runtime = start_runtime(PostgresStore::connect(&config).await.expect("connect a store"));
        let handle = runtime.handle();
        let mut sends = tokio::task::JoinSet::new();
        for counter in 0..COUNTERS {
            let handle = handle.clone();
            sends.spawn(async move { send(&handle, &actor("counter", &format!("c{counter}")), "add").await });
        }
        while let Some(sent) = sends.join_next().await {
            sent.expect("a send task").expect("an increment");
        }
        drop(handle);
        let open = connections_to(&observer, "connections").await;
        assert!(
            open >= 2,
            "the pool opened several connections for concurrent turns: {open}"
        );
        if shut_down {
            runtime.shutdown().await;
        } else {
            drop(runtime);
        }
        let started = Instant::now();
        loop {
            let open = connections_to(&observer, "connections").await;
            if open == 0 {
                break;
            }
            assert!(
                started.elapsed() < std::time::Duration::from_millis(CLOSE_WAIT_MS),
                "{CLOSE_WAIT_MS} ms after the runtime ended (shut down: {shut_down}), {open} of its store's \
                 connections are still open"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
}
