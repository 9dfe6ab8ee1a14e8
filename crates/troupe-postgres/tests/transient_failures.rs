//! `PostgresStore`'s failures that pass: which errors are `StoreError::Unavailable`
//! (tried again by the runtime within the request's deadline) and which stay `Backend`;
//! and a commit whose connection dies around its `COMMIT` (an outcome the store cannot
//! see) made again by the runtime and held once. Each test starts a throwaway server
//! (see `support/postgres_server.rs`); every await is bounded.
//!
//! Run with `cargo nextest run -p troupe-postgres --test transient_failures`.
#![cfg(not(madsim))]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use troupe_core::{ActorId, InvokeError};
use troupe_postgres::{tokio_postgres, PostgresStore};
use troupe_runtime::{StateChange, StateStore, StoreError, StoreOperation, TurnCommit};

#[path = "support/postgres_server.rs"]
mod postgres_server;
use postgres_server::TestServer;
#[path = "../../troupe-runtime/tests/support/turn_counter.rs"]
mod turn_counter;
use turn_counter::{turn_counter_runtime, TURN_COUNTER_KIND};

/// Bound on any single step of a test, in milliseconds.
const STEP_TIMEOUT_MS: u64 = 15_000;
/// The simple-query message of a transaction's `COMMIT` as tokio-postgres sends it:
/// `Q`, its length (4 + 7) and the text with its NUL.
const COMMIT_MESSAGE: &[u8] = b"Q\0\0\0\x0bCOMMIT\0";
/// How long the proxy lets the server run a `COMMIT` it forwarded before it cuts the
/// connection, in milliseconds.
const COMMIT_RUN_MS: u64 = 300;

async fn bounded<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_millis(STEP_TIMEOUT_MS), future)
        .await
        .unwrap_or_else(|_| panic!("{what} did not end within {STEP_TIMEOUT_MS} ms"))
}

fn bytes(text: &str) -> Bytes {
    Bytes::copy_from_slice(text.as_bytes())
}

fn is_unavailable(result: &Result<impl std::fmt::Debug, StoreError>, operation: StoreOperation) -> bool {
    matches!(result, Err(StoreError::Unavailable { operation: failed, .. }) if *failed == operation)
}

/// Goal: with the server stopped, every operation of a store that was connected fails
/// `Unavailable` (connection closed, then refused), and once it is started again the
/// same store serves again; an SQL error is still `Backend`. Method: stop the server
/// (`pg_ctl stop -m fast`) under a connected store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_server_is_unavailable_and_an_sql_error_is_not() {
    let server = TestServer::start("transient-stopped");
    let config = server.create_database("stopped").await;
    let store = bounded("connecting", PostgresStore::connect(&config))
        .await
        .expect("connect");
    let owner = ActorId::new("counter", "c").expect("an actor id");
    let fence = bounded("a claim", store.claim(&owner)).await.expect("claim").fence;
    let commit = |text: &str| TurnCommit {
        state: StateChange::Set(bytes(text)),
        writes: vec![("k".to_string(), Some(bytes(text)))],
    };
    bounded("a commit", store.commit(&owner, fence, commit("1")))
        .await
        .expect("commit");
    tokio::task::block_in_place(|| server.stop());
    for round in 0..2 {
        let claimed = bounded("a claim", store.claim(&ActorId::new("counter", "d").unwrap())).await;
        assert!(
            is_unavailable(&claimed, StoreOperation::Claim),
            "round {round}: {claimed:?}"
        );
        let committed = bounded("a commit", store.commit(&owner, fence, commit("2"))).await;
        assert!(
            is_unavailable(&committed, StoreOperation::Commit),
            "round {round}: {committed:?}"
        );
        let loaded = bounded("a load", store.load(&owner)).await;
        assert!(
            is_unavailable(&loaded, StoreOperation::Load),
            "round {round}: {loaded:?}"
        );
        let read = bounded("a get", store.get(&owner, "k")).await;
        assert!(is_unavailable(&read, StoreOperation::Get), "round {round}: {read:?}");
        let error = committed.expect_err("failed");
        assert!(error.is_transient(), "{error}");
    }
    tokio::task::block_in_place(|| server.start_again());
    bounded("a commit", store.commit(&owner, fence, commit("2")))
        .await
        .expect("the same store commits once the server is back");
    assert_eq!(store.load(&owner).await.expect("load"), Some(bytes("2")));
    // Not transient: an SQL error (a table this store does not make).
    let (client, connection) = tokio_postgres::connect(&config, tokio_postgres::NoTls)
        .await
        .expect("connect");
    let connection = tokio::spawn(connection);
    client
        .batch_execute("DROP TABLE troupe_actor_entry")
        .await
        .expect("drop a table");
    let read = bounded("a get", store.get(&owner, "k")).await;
    assert!(
        matches!(
            read,
            Err(StoreError::Backend {
                operation: StoreOperation::Get,
                ..
            })
        ),
        "{read:?}"
    );
    drop(client);
    connection.await.expect("the connection task").expect("the connection");
}

/// A TCP proxy between the store and the server that, once armed, cuts the connection
/// that sends a `COMMIT`: after forwarding it and giving the server
/// [`COMMIT_RUN_MS`] to run it (the commit is applied, its answer lost), or without
/// forwarding it (the server rolls the transaction back). Either way the store sees its
/// connection closed under the `COMMIT`, and cannot tell which.
struct CuttingProxy {
    port: u16,
    /// `Some(forward)` while armed.
    armed: Arc<Mutex<Option<bool>>>,
    cuts: Arc<AtomicU64>,
    accepting: tokio::task::JoinHandle<()>,
}

impl CuttingProxy {
    async fn start(server_port: u16) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("an address").port();
        let armed: Arc<Mutex<Option<bool>>> = Arc::default();
        let cuts: Arc<AtomicU64> = Arc::default();
        let accepting = tokio::spawn({
            let (armed, cuts) = (Arc::clone(&armed), Arc::clone(&cuts));
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    let server = tokio::net::TcpStream::connect(("127.0.0.1", server_port))
                        .await
                        .expect("connect to the server");
                    tokio::spawn(Self::relay(client, server, Arc::clone(&armed), Arc::clone(&cuts)));
                }
            }
        });
        Self {
            port,
            armed,
            cuts,
            accepting,
        }
    }

    async fn relay(
        client: tokio::net::TcpStream,
        server: tokio::net::TcpStream,
        armed: Arc<Mutex<Option<bool>>>,
        cuts: Arc<AtomicU64>,
    ) {
        let (mut client_read, mut client_write) = client.into_split();
        let (mut server_read, mut server_write) = server.into_split();
        // Set before a `COMMIT` is forwarded: from then on no answer reaches the client.
        let muted = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let answers = tokio::spawn({
            let muted = Arc::clone(&muted);
            async move {
                let mut buffer = vec![0_u8; 64 * 1024];
                loop {
                    let read = match server_read.read(&mut buffer).await {
                        Ok(0) | Err(_) => break,
                        Ok(read) => read,
                    };
                    if muted.load(Ordering::SeqCst) || client_write.write_all(&buffer[..read]).await.is_err() {
                        break;
                    }
                }
                // Stays open, unanswered, until the relay cuts it.
                std::future::pending::<()>().await;
                drop(client_write);
            }
        });
        let mut buffer = vec![0_u8; 64 * 1024];
        loop {
            let read = match client_read.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(read) => read,
            };
            let chunk = &buffer[..read];
            let commits = chunk
                .windows(COMMIT_MESSAGE.len())
                .any(|window| window == COMMIT_MESSAGE);
            let cut = if commits { armed.lock().unwrap().take() } else { None };
            match cut {
                None => {
                    if server_write.write_all(chunk).await.is_err() {
                        break;
                    }
                }
                Some(forward) => {
                    muted.store(true, Ordering::SeqCst);
                    if forward {
                        let _ = server_write.write_all(chunk).await;
                        tokio::time::sleep(Duration::from_millis(COMMIT_RUN_MS)).await;
                    }
                    // The answer is never relayed: both sides are closed.
                    answers.abort();
                    cuts.fetch_add(1, Ordering::SeqCst);
                    return;
                }
            }
        }
        answers.abort();
    }

    fn config(&self, database: &str) -> String {
        format!("host=127.0.0.1 port={} user=troupe dbname={database}", self.port)
    }

    fn arm(&self, forward: bool) {
        *self.armed.lock().unwrap() = Some(forward);
    }
}

impl Drop for CuttingProxy {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

/// The `commit` rows of `owner` in the fence log.
async fn logged_commits(config: &str, owner: &ActorId) -> i64 {
    let (client, connection) = tokio_postgres::connect(config, tokio_postgres::NoTls)
        .await
        .expect("connect");
    let connection = tokio::spawn(connection);
    let row = client
        .query_one(
            "SELECT count(*) FROM troupe_fence_log WHERE event = 'commit' AND kind = $1 AND key = $2",
            &[&owner.kind().as_str(), &owner.key()],
        )
        .await
        .expect("count the log's rows");
    drop(client);
    connection.await.expect("the connection task").expect("the connection");
    row.get(0)
}

/// The scenario: a runtime on a store behind the proxy; the second turn's `COMMIT` is
/// cut (forwarded first or not); the runtime makes the commit again and the caller gets
/// the turn's answer. Returns the `commit` rows logged for the two turns.
async fn a_cut_commit_is_made_again_and_held_once(forward: bool) -> i64 {
    let name = if forward { "applied" } else { "rolled_back" };
    let server = TestServer::start(&format!("transient-cut-{name}"));
    let direct = server.create_database(name).await;
    let proxy = CuttingProxy::start(server.port()).await;
    let store = bounded("connecting", PostgresStore::connect(&proxy.config(name)))
        .await
        .expect("connect through the proxy")
        .with_commit_log(true);
    let turns = Arc::new(AtomicU64::new(0));
    let runtime = turn_counter_runtime(Arc::new(store.clone()), &turns);
    let owner = ActorId::new(TURN_COUNTER_KIND, "c").expect("an actor id");
    let inc = || async {
        let reply = bounded(
            "a call",
            runtime.invoke_within(&owner, Bytes::from_static(b"inc"), Duration::from_secs(10)),
        )
        .await;
        reply.map(|reply| String::from_utf8(reply.to_vec()).expect("text"))
    };
    assert_eq!(inc().await, Ok("1".to_string()));
    proxy.arm(forward);
    let answer: Result<String, InvokeError> = inc().await;
    assert_eq!(
        answer,
        Ok("2".to_string()),
        "forward {forward}: the caller gets the turn's answer"
    );
    assert_eq!(proxy.cuts.load(Ordering::SeqCst), 1, "the COMMIT was cut");
    assert_eq!(turns.load(Ordering::SeqCst), 2, "the turn ran once");
    assert!(runtime.handle().counters().store_retries >= 1);
    assert_eq!(store.load(&owner).await.expect("load"), Some(bytes("2")));
    assert_eq!(store.get(&owner, "last").await.expect("get"), Some(bytes("2")));
    assert_eq!(inc().await, Ok("3".to_string()), "the activation goes on");
    runtime.shutdown().await;
    logged_commits(&direct, &owner).await
}

/// Goal: a commit whose `COMMIT` reached the server but whose answer was lost (the
/// connection cut after the server ran it) is made again by the runtime under the same
/// fence, and the store holds it once: the caller gets the turn's answer, the count is
/// 2 (not 3), the turn ran once. The fence log shows that the first `COMMIT` was
/// applied: it holds the second turn's commit twice (1 + 2 + 1 rows for three turns),
/// as `PostgresStore`'s documentation says. Before the runtime tried again, the call
/// failed `StorageFailed` while its commit was in the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_whose_answer_is_lost_is_made_again_and_held_once() {
    assert_eq!(a_cut_commit_is_made_again_and_held_once(true).await, 4);
}

/// Goal: the same when the `COMMIT` never reached the server (cut before it): the
/// server rolled the transaction back, the runtime's second try applies it, once (one
/// row per turn in the fence log).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_cut_before_its_commit_reached_the_server_is_made_again_once() {
    assert_eq!(a_cut_commit_is_made_again_and_held_once(false).await, 3);
}
