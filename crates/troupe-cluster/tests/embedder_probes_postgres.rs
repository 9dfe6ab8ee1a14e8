//! The production pairing probed from outside: two `ClusterNode`s on a real etcd and
//! one real PostgreSQL database (each node its own `PostgresStore`, as two processes),
//! on tokio's multi-thread runtime, with the store's own fence log as the witness.
//!
//! Run with `cargo nextest run -p troupe-cluster --test embedder_probes_postgres`.
#![cfg(not(madsim))]

#[path = "../../troupe-etcd/tests/support/etcd_server.rs"]
mod etcd_server;
#[path = "../../troupe-postgres/tests/support/postgres_server.rs"]
mod postgres_server;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use etcd_server::{TestEtcd, TEST_LEASE_TTL_S};
use postgres_server::TestServer;
use tokio::time::Instant;
use troupe_cluster::{ClusterError, ClusterNode};
use troupe_core::{ActorId, ActorKind, InvokeError};
use troupe_etcd::LeaseLostReason;
use troupe_postgres::{tokio_postgres, PostgresStore};
use troupe_runtime::{Actor, ActorBox, ActorError, KindConfig, RuntimeBuilder, Turn};

/// Bound on any single await that is not a call, in milliseconds.
const STEP_TIMEOUT_MS: u64 = 15_000;
/// Deadline of each call, in milliseconds.
const CALL_TIMEOUT_MS: u64 = 2_000;
/// Actors the traffic goes to.
const ACTORS: usize = 4;
/// Concurrent callers on each node.
const CALLERS_PER_NODE: usize = 4;
/// How long the traffic runs before and after the revoke, in milliseconds.
const TRAFFIC_BEFORE_MS: u64 = 800;
const TRAFFIC_AFTER_MS: u64 = 2_500;
/// Allowance for a loaded 2-core machine on top of a bound a test checks, in ms.
const SCHEDULING_ALLOWANCE_MS: u64 = 2_000;

/// Counts its calls; `slow` sleeps 150 ms first (a turn in flight when the lease goes).
struct Counter {
    node: String,
    count: u64,
}

impl Actor for Counter {
    async fn handle(&mut self, _turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        if payload.as_ref() == b"slow" {
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        self.count += 1;
        Ok(Bytes::from(format!("{}:{}", self.node, self.count)))
    }

    fn snapshot(&self) -> Result<Option<Bytes>, ActorError> {
        Ok(Some(Bytes::from(self.count.to_string())))
    }
}

fn counter_runtime(node: &str) -> RuntimeBuilder {
    let node = node.to_string();
    troupe_runtime::Runtime::builder()
        .register(
            ActorKind::new("counter").expect("a kind name"),
            move |_id: &ActorId, saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
                let count = saved
                    .map(|bytes| std::str::from_utf8(&bytes).ok().and_then(|text| text.parse().ok()))
                    .map(|count| count.ok_or_else(|| ActorError::failed("the saved count is not a number")))
                    .transpose()?
                    .unwrap_or(0);
                Ok(ActorBox::new(Counter {
                    node: node.clone(),
                    count,
                }))
            },
            KindConfig::default(),
        )
        .expect("register the counter")
}

fn counter(index: usize) -> ActorId {
    ActorId::new("counter", format!("c{index}")).expect("an actor id")
}

async fn bounded<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_millis(STEP_TIMEOUT_MS), future)
        .await
        .unwrap_or_else(|_| panic!("{what} did not end within {STEP_TIMEOUT_MS} ms"))
}

fn parse_reply(reply: &[u8]) -> (String, u64) {
    let text = std::str::from_utf8(reply).expect("a text reply");
    let (node, count) = text.rsplit_once(':').expect("node:count");
    (node.to_string(), count.parse().expect("a count"))
}

async fn start_node(etcd: &TestEtcd, name: &str, database: &str) -> ClusterNode {
    let store = bounded("connecting a store", PostgresStore::connect(database))
        .await
        .expect("connect the store")
        .with_holder(name)
        .expect("a holder name")
        .with_commit_log(true);
    bounded(
        "starting a node",
        ClusterNode::start(
            etcd.config(name, ""),
            "127.0.0.1:0".parse().expect("an address"),
            counter_runtime(name),
            store,
        ),
    )
    .await
    .unwrap_or_else(|error| panic!("start {name}: {error}"))
}

/// Goal: a node whose etcd lease is revoked while its turns run commits nothing beside
/// the new owner, on PostgreSQL: the database's own fence log shows, per actor, claims
/// with strictly growing fences and every commit under the newest claim's fence by the
/// node that claimed it; no count is acknowledged twice; the node's embedder sees
/// `fenced_off` (`ExpiredOnServer`) within the bound, and calls through it keep being
/// served by the new owner. Method: 4 counters placed on A; 4 callers on each node call
/// them (every third call slow) for 0.8 s; A's lease is revoked through etcd directly;
/// the traffic goes on 2.5 s; then the log is audited.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_revoked_node_never_commits_beside_the_new_owner_on_postgres() {
    let etcd = TestEtcd::start("probe-pg-revoke").await;
    let server = TestServer::start("probe-cluster-revoke");
    let database = server.create_database("cluster").await;
    let a = start_node(&etcd, "node-a", &database).await;
    let b = start_node(&etcd, "node-b", &database).await;
    for index in 0..ACTORS {
        let deadline = a.handle().deadline_in(Duration::from_millis(CALL_TIMEOUT_MS));
        let reply = bounded(
            "a first call",
            a.invoke(&counter(index), Bytes::from_static(b"inc"), deadline),
        )
        .await
        .expect("A serves its actors");
        assert_eq!(parse_reply(&reply), ("node-a".to_string(), 1));
    }

    let stop = Arc::new(AtomicBool::new(false));
    let mut callers = tokio::task::JoinSet::new();
    for node in [&a, &b] {
        for caller in 0..CALLERS_PER_NODE {
            let client = node.client();
            let stop = Arc::clone(&stop);
            callers.spawn(async move {
                let mut acks = Vec::new();
                let mut errors = Vec::new();
                let mut round = caller;
                while !stop.load(Ordering::SeqCst) {
                    round += 1;
                    let target = counter(round % ACTORS);
                    let payload = if round % 3 == 0 { "slow" } else { "inc" };
                    let deadline = client.deadline_in(Duration::from_millis(CALL_TIMEOUT_MS));
                    let called = tokio::time::timeout(
                        Duration::from_millis(CALL_TIMEOUT_MS + SCHEDULING_ALLOWANCE_MS),
                        client.invoke(&target, Bytes::from(payload), deadline),
                    )
                    .await
                    .unwrap_or_else(|_| panic!("a call through {} outlived its deadline", client.node()));
                    match called {
                        Ok(reply) => acks.push((target, parse_reply(&reply))),
                        Err(error) => {
                            errors.push(error);
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    }
                }
                (client.node().to_string(), acks, errors)
            });
        }
    }
    tokio::time::sleep(Duration::from_millis(TRAFFIC_BEFORE_MS)).await;
    let mut admin = etcd_client::Client::connect([etcd.endpoint()], None)
        .await
        .expect("an admin client");
    bounded("the revoke", admin.lease_revoke(a.placement().lease()))
        .await
        .expect("revoke A's lease");
    let revoked_at = Instant::now();
    let reason = tokio::time::timeout(
        Duration::from_millis(TEST_LEASE_TTL_S * 1_000 + SCHEDULING_ALLOWANCE_MS),
        a.fenced_off(),
    )
    .await
    .expect("A reports that it was fenced off");
    assert_eq!(reason, LeaseLostReason::ExpiredOnServer);
    eprintln!("A fenced off {} ms after the revoke", revoked_at.elapsed().as_millis());
    tokio::time::sleep(Duration::from_millis(TRAFFIC_AFTER_MS)).await;
    stop.store(true, Ordering::SeqCst);

    let mut acks: BTreeMap<String, BTreeSet<u64>> = BTreeMap::new();
    let mut served_late: BTreeMap<String, usize> = BTreeMap::new();
    let mut error_kinds: BTreeMap<String, usize> = BTreeMap::new();
    while let Some(joined) = bounded("the callers", callers.join_next()).await {
        let (caller, caller_acks, errors) = joined.expect("a caller task");
        for (target, (served_by, count)) in caller_acks {
            assert!(
                acks.entry(target.to_string()).or_default().insert(count),
                "{target}: count {count} acknowledged twice (through {caller}, served by {served_by})"
            );
            *served_late.entry(served_by).or_default() += 1;
        }
        for error in errors {
            assert!(
                error.is_transient() || matches!(error, InvokeError::StorageFailed { .. }),
                "through {caller}: {error}"
            );
            *error_kinds.entry(format!("through {caller}: {error}")).or_default() += 1;
        }
    }
    eprintln!("acknowledged per serving node: {served_late:?}; errors: {error_kinds:?}");
    assert!(
        served_late.get("node-b").copied().unwrap_or(0) > 0,
        "B took the actors over"
    );

    // The witness: the database's fence log, per actor, in lock order.
    let (client, connection) = tokio_postgres::connect(&database, tokio_postgres::NoTls)
        .await
        .expect("connect an auditor");
    let connection = tokio::spawn(connection);
    for index in 0..ACTORS {
        let actor = counter(index);
        let rows = client
            .query(
                "SELECT event, fence, holder FROM troupe_fence_log WHERE kind = $1 AND key = $2 ORDER BY id",
                &[&actor.kind().as_str(), &actor.key()],
            )
            .await
            .expect("read the fence log");
        let mut newest: Option<(i64, String)> = None;
        let mut commits = 0_u64;
        for row in &rows {
            let (event, fence, holder): (String, i64, Option<String>) = (row.get(0), row.get(1), row.get(2));
            let holder = holder.expect("every row names its node");
            match event.as_str() {
                "claim" => {
                    if let Some((previous, _)) = &newest {
                        assert!(fence > *previous, "{actor}: claim {fence} after {previous}");
                    }
                    newest = Some((fence, holder));
                }
                "commit" => {
                    assert_eq!(
                        newest.as_ref(),
                        Some(&(fence, holder.clone())),
                        "{actor}: a commit by {holder} under {fence} was not under the newest claim"
                    );
                    commits += 1;
                }
                other => panic!("{actor}: an event {other}"),
            }
        }
        let state = client
            .query_opt(
                "SELECT state FROM troupe_actor_state WHERE kind = $1 AND key = $2",
                &[&actor.kind().as_str(), &actor.key()],
            )
            .await
            .expect("read the state")
            .map(|row| String::from_utf8(row.get::<_, Vec<u8>>(0)).expect("text"))
            .expect("a state");
        let state: u64 = state.parse().expect("a count");
        let acknowledged = acks.get(&actor.to_string()).cloned().unwrap_or_default();
        assert_eq!(commits, state, "{actor}: one commit per count");
        assert!(
            acknowledged.iter().all(|count| *count <= state),
            "{actor}: an acknowledged count above the stored {state}"
        );
        let claims = rows.iter().filter(|row| row.get::<_, String>(0) == "claim").count();
        eprintln!(
            "{actor}: {state} commits, {claims} claims, {} acknowledged",
            acknowledged.len() + 1
        );
    }
    drop(client);
    let _ = connection.await;
    bounded("b leaves", b.leave()).await.expect("b leaves");
    drop(a);
}

/// Starts `name` on `database` in `cluster` with the store's identity; the error as it is.
async fn start_with_identity(
    etcd: &TestEtcd,
    cluster: &str,
    name: &str,
    database: &str,
) -> (Result<ClusterNode, ClusterError>, String) {
    let store = bounded("connecting a store", PostgresStore::connect(database))
        .await
        .expect("connect the store");
    let identity = bounded("the store's identity", store.identity())
        .await
        .expect("the store's identity");
    let mut config = etcd.config(name, "").with_store_identity(identity.clone());
    config.cluster = cluster.to_string();
    let started = bounded(
        "starting a node",
        ClusterNode::start(
            config,
            "127.0.0.1:0".parse().expect("an address"),
            counter_runtime(name),
            store,
        ),
    )
    .await;
    (started, identity)
}

async fn call_counter(node: &ClusterNode, index: usize) -> (String, u64) {
    let deadline = node.handle().deadline_in(Duration::from_millis(CALL_TIMEOUT_MS));
    let reply = bounded(
        "a call",
        node.invoke(&counter(index), Bytes::from_static(b"inc"), deadline),
    )
    .await
    .expect("served");
    parse_reply(&reply)
}

/// Goal: two deployments that share a cluster name on one etcd, each with its own
/// PostgreSQL database, are told apart: the second one's node is refused at start with
/// `StoreMismatch` naming the cluster, both store identities and what to do, and the
/// first deployment goes on. Before, it started and joined the first deployment's
/// cluster: its calls went to the first deployment's nodes, which keep other state
/// (a call from it to c0 answered `node-a:2`, the first deployment's count). Method:
/// databases `one` and `two` on one server; node-a on `one` serves c0; node-x on `two`
/// under the same cluster name is refused; node-b on `one` through another connection
/// string (host `localhost`, another role) has the same identity, starts and reaches
/// c0; node-x starts under its own cluster name.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_deployment_under_the_same_cluster_name_is_refused_on_postgres() {
    let etcd = TestEtcd::start("probe-pg-two-deployments").await;
    let server = TestServer::start("probe-cluster-two-deployments");
    let one = server.create_database("one").await;
    let two = server.create_database("two").await;
    let cluster = etcd.config("node-a", "").cluster;
    let (a, identity_one) = start_with_identity(&etcd, &cluster, "node-a", &one).await;
    let a = a.expect("node-a binds the cluster to database one");
    assert_eq!(call_counter(&a, 0).await, ("node-a".to_string(), 1));

    let (refused, identity_two) = start_with_identity(&etcd, &cluster, "node-x", &two).await;
    assert_ne!(identity_one, identity_two, "two databases have two identities");
    match refused {
        Err(
            ref error @ ClusterError::StoreMismatch {
                cluster: ref named,
                ref recorded,
                ref store,
            },
        ) => {
            assert_eq!((named, recorded, store), (&cluster, &identity_one, &identity_two));
            let text = error.to_string();
            assert!(
                text.contains(&identity_one) && text.contains(&identity_two) && text.contains("--cluster"),
                "{text}"
            );
            eprintln!("{error}");
        }
        Err(other) => panic!("refused, but not as another store: {other}"),
        Ok(node) => panic!(
            "node-x on database two started in the cluster of database one; its call to c0 answered {:?}",
            call_counter(&node, 0).await
        ),
    }

    let other_role = one.replace("user=troupe", "user=node_b") + " password=b";
    {
        let (client, connection) = tokio_postgres::connect(&one, tokio_postgres::NoTls)
            .await
            .expect("connect as the superuser");
        let connection = tokio::spawn(connection);
        client
            .batch_execute("CREATE ROLE node_b LOGIN PASSWORD 'b'; GRANT ALL ON SCHEMA public TO node_b; GRANT ALL ON ALL TABLES IN SCHEMA public TO node_b")
            .await
            .expect("create a role");
        drop(client);
        connection.await.expect("the connection task").expect("the connection");
    }
    let other_host = other_role.replace("host=127.0.0.1", "host=localhost");
    let (b, identity_b) = start_with_identity(&etcd, &cluster, "node-b", &other_host).await;
    assert_eq!(
        identity_b, identity_one,
        "another host name and role, the same database"
    );
    let b = b.expect("node-b on database one starts");
    assert_eq!(call_counter(&b, 0).await, ("node-a".to_string(), 2));

    let (x, _) = start_with_identity(&etcd, &format!("{cluster}-two"), "node-x", &two).await;
    let x = x.expect("node-x starts under its own cluster name");
    assert_eq!(call_counter(&x, 0).await, ("node-x".to_string(), 1));
    for node in [a, b, x] {
        bounded("leaving", node.leave()).await.expect("leaves");
    }
}
