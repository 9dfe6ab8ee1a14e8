//! `PostgresStore` probed as an embedder runs it: the database server restarted under
//! load (every connection lost, then the server back), and a database that is not
//! there. Each test starts a throwaway server (see `support/postgres_server.rs`); every
//! await is bounded.
//!
//! Run with `cargo nextest run -p troupe-postgres --test embedder_probes`.
#![cfg(not(madsim))]

use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;
use troupe_core::ActorId;
use troupe_postgres::PostgresStore;
use troupe_runtime::{Fence, StateChange, StateStore, StoreError, StoreOperation, TurnCommit};

#[path = "support/postgres_server.rs"]
mod postgres_server;
use postgres_server::TestServer;

/// Bound on any single store operation of a test, in milliseconds.
const STEP_TIMEOUT_MS: u64 = 15_000;
/// Writers committing at once in the restart test.
const WRITERS: usize = 4;
/// How long after the server is back every writer must have committed again, in ms.
const RECOVERY_BOUND_MS: u64 = 3_000;
/// Commits each writer makes after the restart before it stops.
const COMMITS_AFTER_RESTART: u64 = 20;

async fn bounded<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_millis(STEP_TIMEOUT_MS), future)
        .await
        .unwrap_or_else(|_| panic!("{what} did not end within {STEP_TIMEOUT_MS} ms"))
}

fn count_commit(count: u64) -> TurnCommit {
    TurnCommit {
        state: StateChange::Set(Bytes::from(count.to_string())),
        writes: Vec::new(),
    }
}

/// What one writer saw: the highest count acknowledged, the highest attempted, and
/// the commits that failed.
struct Written {
    acknowledged: u64,
    attempted: u64,
    failures: usize,
    first_success_after_restart: Option<Instant>,
}

/// Commits counts 1, 2, … for `owner` until `stop` says so and it made
/// [`COMMITS_AFTER_RESTART`] commits after `restarted` was set. A failed commit is
/// retried with the same count under a fresh claim (the failure may have been applied
/// or not: the claim reads which). Every error must be a typed transient one
/// (`Unavailable`, which the runtime tries again within the request's deadline).
async fn write(
    store: PostgresStore,
    owner: ActorId,
    restarted: tokio::sync::watch::Receiver<Option<Instant>>,
) -> Written {
    let mut fence: Option<Fence> = None;
    let mut written = Written {
        acknowledged: 0,
        attempted: 0,
        failures: 0,
        first_success_after_restart: None,
    };
    let mut after_restart = 0_u64;
    loop {
        let current = match fence {
            Some(fence) => fence,
            None => match bounded("a claim", store.claim(&owner)).await {
                Ok(claimed) => {
                    let saved: u64 = claimed
                        .state
                        .map(|bytes| std::str::from_utf8(&bytes).expect("text").parse().expect("a count"))
                        .unwrap_or(0);
                    assert!(
                        saved >= written.acknowledged && saved <= written.attempted,
                        "{owner}: the state says {saved}, acknowledged {}, attempted {}",
                        written.acknowledged,
                        written.attempted
                    );
                    written.acknowledged = saved;
                    fence = Some(claimed.fence);
                    claimed.fence
                }
                Err(error) => {
                    assert!(
                        matches!(
                            error,
                            StoreError::Unavailable {
                                operation: StoreOperation::Claim,
                                ..
                            }
                        ),
                        "{owner}: a claim failed with {error:?}"
                    );
                    written.failures += 1;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        let next = written.acknowledged + 1;
        written.attempted = written.attempted.max(next);
        match bounded("a commit", store.commit(&owner, current, count_commit(next))).await {
            Ok(()) => {
                written.acknowledged = next;
                if restarted.borrow().is_some() {
                    written.first_success_after_restart.get_or_insert_with(Instant::now);
                    after_restart += 1;
                    if after_restart >= COMMITS_AFTER_RESTART {
                        return written;
                    }
                }
            }
            Err(error) => {
                assert!(
                    matches!(
                        error,
                        StoreError::Unavailable {
                            operation: StoreOperation::Commit,
                            ..
                        }
                    ),
                    "{owner}: a commit failed with {error:?}"
                );
                written.failures += 1;
                fence = None;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

/// Goal: the database server restarted under load (`pg_ctl restart -m fast`: every
/// open connection closed, the data kept) costs only typed transient errors
/// (`StoreError::Unavailable`, until 2026-12-07 `Backend`) while it is down; once it is back, every writer commits again within a bound on the same store
/// (the pool replaces its dead connections), and no acknowledged commit is lost.
/// Method: 4 writers commit counts to 4 actors in a loop; the server restarts; each
/// writer must then commit 20 more counts; the stored count is checked against what
/// each writer was told.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_store_commits_again_after_its_server_restarts_and_loses_no_acknowledged_commit() {
    let server = TestServer::start("probe-restart");
    let store = server.store("restart").await;
    let (restarted_sender, restarted) = tokio::sync::watch::channel(None);
    let writers: Vec<_> = (0..WRITERS)
        .map(|index| {
            let owner = ActorId::new("counter", format!("w{index}")).expect("an actor id");
            tokio::spawn(write(store.clone(), owner.clone(), restarted.clone()))
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    tokio::task::block_in_place(|| server.restart());
    let back = Instant::now();
    restarted_sender.send_replace(Some(back));
    eprintln!(
        "the server restarted in {} ms",
        back.duration_since(started).as_millis()
    );

    for (index, writer) in writers.into_iter().enumerate() {
        let written = bounded("a writer", writer).await.expect("a writer task");
        let first = written
            .first_success_after_restart
            .expect("committed after the restart");
        let recovered = first.duration_since(back);
        eprintln!(
            "writer {index}: {} acknowledged, {} failures, committed again {} ms after the server was back",
            written.acknowledged,
            written.failures,
            recovered.as_millis()
        );
        assert!(
            recovered < Duration::from_millis(RECOVERY_BOUND_MS),
            "writer {index} committed again only {recovered:?} after the server was back"
        );
        let owner = ActorId::new("counter", format!("w{index}")).expect("an actor id");
        let stored = bounded("a load", store.load(&owner)).await.expect("load");
        assert_eq!(
            stored,
            Some(Bytes::from(written.acknowledged.to_string())),
            "writer {index}: the stored count is the last acknowledged one"
        );
    }
}

/// Goal: a store pointed at a database that does not exist, or as a user the server
/// does not know, fails to open at once with a typed error naming the cause (not at the
/// connect timeout). Method: both, on a running server.
#[tokio::test]
async fn a_missing_database_or_user_fails_to_open_at_once_naming_it() {
    let server = TestServer::start("probe-missing");
    let cases = [
        (server.config("no_such_database"), "no_such_database"),
        (
            server.config("postgres").replace("user=troupe", "user=no_such_user"),
            "no_such_user",
        ),
    ];
    for (config, named) in cases {
        let started = Instant::now();
        let result = bounded("connecting", PostgresStore::connect(&config)).await;
        let took = started.elapsed();
        match result {
            Err(StoreError::Backend {
                operation: StoreOperation::Open,
                ref cause,
            }) => assert!(
                cause.contains(named),
                "{config}: the cause does not name {named}: {cause}"
            ),
            Err(other) => panic!("{config}: {other}"),
            Ok(_) => panic!("{config}: opened"),
        }
        assert!(took < Duration::from_millis(2_000), "{config}: took {took:?}");
    }
}

/// Goal: `PostgresStore::identity` names the database, not the connection: two stores
/// on one database have one identity, another database on the same server another,
/// and it has the form `postgresql:<system_identifier>/<database>`. Method: stores on
/// databases `first` (twice, once through host `localhost`) and `second`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stores_identity_names_its_database_whatever_the_connection() {
    let server = TestServer::start("probe-identity");
    let first_config = server.create_database("first").await;
    let first = server.store_on(&first_config).await;
    let again = server
        .store_on(&first_config.replace("host=127.0.0.1", "host=localhost"))
        .await;
    let second = server.store("second").await;
    let identity = bounded("an identity", first.identity()).await.expect("identity");
    assert_eq!(
        bounded("an identity", again.identity()).await.expect("identity"),
        identity
    );
    let other = bounded("an identity", second.identity()).await.expect("identity");
    assert_ne!(other, identity);
    let (system, database) = identity
        .strip_prefix("postgresql:")
        .and_then(|rest| rest.split_once('/'))
        .unwrap_or_else(|| panic!("{identity:?} is not postgresql:<system>/<database>"));
    assert!(system.parse::<u64>().is_ok(), "{identity}");
    assert_eq!(database, "first");
    assert!(
        other.ends_with("/second") && other.starts_with(&format!("postgresql:{system}/")),
        "{other}"
    );
}
