//! `troupe node` reviewed from outside, as an embedder runs a cluster of them: on a
//! throwaway etcd and PostgreSQL (the servers of crates/troupe-etcd's and
//! crates/troupe-postgres's tests, on loopback), what an operator sees when a node is
//! pointed at an etcd that cannot be reached or a database that does not exist, and a
//! rolling restart of every node (SIGTERM, then started again) under steady appends.
//! Normal build only (the node command is not built under madsim).
//!
//! Without `/usr/bin/etcd` (Debian `etcd-server`) or the PostgreSQL server binaries
//! (Debian `postgresql`) the tests fail and name the package; nothing is skipped.
#![cfg(not(madsim))]
// Real processes and real time only: the clients are OS threads doing blocking HTTP,
// timed with the wall clock.
#![allow(clippy::disallowed_methods)]

#[allow(dead_code)] // the helpers the etcd tests use and these do not
#[path = "../../troupe-etcd/tests/support/etcd_server.rs"]
mod etcd_server;
#[path = "../../troupe-postgres/tests/support/postgres_server.rs"]
mod postgres_server;
#[allow(dead_code)] // the helpers the serve tests use and these do not
mod support;

use std::collections::BTreeMap;
use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_server::TestEtcd;
use postgres_server::TestServer;
use serde_json::Value;
use troupe_postgres::tokio_postgres;

/// The nodes' lease, in milliseconds (etcd's shortest TTL, so the tests are quick).
const LEASE_TTL_MS: u64 = 3_000;
/// The longest a node refused at start may take to exit, in milliseconds: etcd's
/// requests time out after at most 1 s each, PostgreSQL's connect after 10 s.
const NODE_REFUSED_EXIT_MS_MAX: u64 = 15_000;
/// The longest a node may take to exit after SIGTERM, in milliseconds.
const NODE_STOP_MS_MAX: u64 = 20_000;
/// How often a child's exit is checked, in milliseconds.
const EXIT_POLL_MS: u64 = 10;
/// Read timeout of one HTTP request, in milliseconds (above the node's 30 s call
/// timeout).
const HTTP_READ_TIMEOUT_MS: u64 = 40_000;
/// Pause of a client after a failed request, in milliseconds.
const CLIENT_RETRY_PAUSE_MS: u64 = 20;
/// Longest the rolling restart test may run, in milliseconds.
const ROLLING_TEST_TIMEOUT_MS: u64 = 240_000;

/// `troupe node` on `etcd` and `postgres` as node `id` of cluster `cluster`, with a 3 s
/// lease, loopback ports of its own, commits in the fence log, no token, no model key and
/// both pipes piped.
fn node_command(etcd: &str, postgres: &str, id: &str, cluster: &str) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_troupe"));
    command
        .args(["node", "--etcd", etcd, "--postgres", postgres, "--node-id", id])
        .args(["--cluster", cluster, "--lease-ttl-ms", &LEASE_TTL_MS.to_string()])
        .args([
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
            "--fence-log-commits",
        ])
        .env_remove("TROUPE_TOKEN")
        .env_remove("OPENAI_API_KEY")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// `child`'s exit status, or `None` if it still runs `wait_ms` milliseconds later.
fn exited_within(child: &mut Child, wait_ms: u64) -> Option<std::process::ExitStatus> {
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(wait_ms) {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(EXIT_POLL_MS));
    }
    None
}

/// Runs `command` until it exits, killed (and the test failed) past
/// `NODE_REFUSED_EXIT_MS_MAX`: its exit code, stdout, stderr and how long it ran.
fn run_refused(command: &mut Command, what: &str) -> (Option<i32>, String, String, Duration) {
    let started = Instant::now();
    let mut child = command.spawn().unwrap();
    let status = exited_within(&mut child, NODE_REFUSED_EXIT_MS_MAX);
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let took = started.elapsed();
    let mut stdout = String::new();
    child.stdout.take().unwrap().read_to_string(&mut stdout).unwrap();
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    let Some(status) = status else {
        panic!(
            "{what}: still running {NODE_REFUSED_EXIT_MS_MAX} ms after its start\nstdout: {stdout}\nstderr: {stderr}"
        );
    };
    (status.code(), stdout, stderr, took)
}

/// Checks that a node refused at start exited 1 without serving or panicking, with one
/// `troupe: ` line that holds every one of `needles`; returns that line.
fn assert_refused(what: &str, outcome: &(Option<i32>, String, String, Duration), needles: &[&str]) -> String {
    let (code, stdout, stderr, took) = outcome;
    println!("{what}: exit {code:?} after {} ms: {}", took.as_millis(), stderr.trim());
    assert_eq!(*code, Some(1), "{what}: stdout {stdout}\nstderr {stderr}");
    assert!(!stdout.contains("listening on"), "{what}: {stdout}");
    assert!(!stderr.contains("panicked"), "{what}: {stderr}");
    let line = stderr
        .lines()
        .find(|line| line.starts_with("troupe: "))
        .unwrap_or_else(|| panic!("{what}: no `troupe: ` line: {stderr}"));
    for needle in needles {
        assert!(line.contains(needle), "{what}: {needle:?} not in: {line}");
    }
    line.to_string()
}

/// Goal: a node given an `--etcd` address where no etcd answers (nothing listens there;
/// a port that accepts and never answers; a server of another protocol, PostgreSQL)
/// exits 1 within `NODE_REFUSED_EXIT_MS_MAX`, without serving, in one line that names
/// `--etcd`, the address given and what to do. Method: a real PostgreSQL (the node
/// connects to it first), each wrong address in turn.
#[tokio::test]
async fn a_node_whose_etcd_cannot_be_reached_exits_1_naming_the_address_and_what_to_do() {
    let postgres = TestServer::start("review-etcd-unreachable");
    let database = postgres.create_database("review").await;
    let closed = format!("127.0.0.1:{}", etcd_server::free_port());
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_address = silent.local_addr().unwrap().to_string();
    let other_protocol = format!("127.0.0.1:{}", postgres.port());
    for (what, etcd) in [
        ("nothing listens", closed.as_str()),
        ("accepts and never answers", silent_address.as_str()),
        ("PostgreSQL's port", other_protocol.as_str()),
    ] {
        let outcome = run_refused(&mut node_command(etcd, &database, "lonely", "review"), what);
        assert_refused(
            what,
            &outcome,
            &["--etcd", etcd, "check that etcd runs", "start the node again"],
        );
    }
    drop(silent);
}

/// Goal: a node given a `--postgres` database that does not exist, or a role that does
/// not exist, exits 1 within `NODE_REFUSED_EXIT_MS_MAX` in one line naming
/// `--postgres` and what the server said (the database or role), without serving.
/// Method: a real PostgreSQL and a real etcd; the node pointed at a missing database,
/// then at a missing role.
#[tokio::test]
async fn a_node_given_a_missing_database_or_role_exits_1_naming_it() {
    let etcd = TestEtcd::start("review-missing-database").await;
    let postgres = TestServer::start("review-missing-database");
    let port = postgres.port();
    let missing_database = postgres.config("no_such_database");
    let missing_role = format!("host=127.0.0.1 port={port} user=no_such_role dbname=postgres");
    for (what, config, needle) in [
        ("a missing database", missing_database.as_str(), "no_such_database"),
        ("a missing role", missing_role.as_str(), "no_such_role"),
    ] {
        let outcome = run_refused(&mut node_command(&etcd.endpoint(), config, "lonely", "review"), what);
        assert_refused(what, &outcome, &["--postgres", needle, "check that PostgreSQL runs"]);
    }
}

/// Nodes of the rolling restart.
const ROLLING_NODES: usize = 3;
/// Conversations appended to at once during the rolling restart, one client each.
const ROLLING_CONVERSATIONS: usize = 4;
/// Acknowledged appends every conversation must get before each restart and at the end.
const ROLLING_ACKS_PER_STEP: usize = 20;
/// How long a node is out of the clients' rotation before its SIGTERM, in milliseconds,
/// so that no client starts a request to it after the signal.
const ROLLING_DRAIN_MS: u64 = 200;

/// An acknowledged append of the rolling restart.
#[derive(Debug, Clone)]
struct Acked {
    seq: u64,
    text: String,
    owner: String,
    at: Instant,
}

/// What one client of the rolling restart saw.
#[derive(Debug, Default)]
struct RollingLog {
    acks: Vec<Acked>,
    /// Failed appends: when, through which node, and the answer or I/O error.
    failures: Vec<(Instant, String, String)>,
}

/// Appends to `conversation` one message at a time, each through the next node of
/// `alive` (the first through the one at `first`), until `stop` or `deadline`; a failed
/// append is not sent again (the next one has a new text).
fn rolling_client(
    conversation: &str,
    first: usize,
    alive: &Mutex<Vec<String>>,
    stop: &AtomicBool,
    log: &Mutex<RollingLog>,
    deadline: Instant,
) {
    let path = format!("/v1/conversations/{conversation}/messages");
    for attempt in 0.. {
        if stop.load(Ordering::SeqCst) || Instant::now() > deadline {
            return;
        }
        let addr = {
            let alive = alive.lock().unwrap();
            alive[(first + attempt) % alive.len()].clone()
        };
        let text = format!("{conversation}-m{attempt}");
        let body = serde_json::json!({ "text": text }).to_string();
        match support::try_http_with_head(&addr, "POST", &path, &body, HTTP_READ_TIMEOUT_MS) {
            Ok((200, _, reply)) => {
                let reply: Value = serde_json::from_str(&reply).expect("a JSON answer");
                log.lock().unwrap().acks.push(Acked {
                    seq: reply["seq"].as_u64().expect("seq"),
                    text,
                    owner: reply["owner"].as_str().expect("owner").to_string(),
                    at: Instant::now(),
                });
            }
            outcome => {
                let answer = match outcome {
                    Ok((status, _, body)) => format!("{status} {body}"),
                    Err(error) => format!("I/O error: {error}"),
                };
                log.lock().unwrap().failures.push((Instant::now(), addr, answer));
                std::thread::sleep(Duration::from_millis(CLIENT_RETRY_PAUSE_MS));
            }
        }
    }
}

/// A running `troupe node`: the child, its stderr's reader, the rest of its stdout (held
/// so that the pipe stays open) and its HTTP address. Killed (SIGKILL) when dropped.
struct Node {
    child: Child,
    stderr: Option<std::thread::JoinHandle<String>>,
    _stdout: std::io::BufReader<std::process::ChildStdout>,
    http: String,
}

impl Node {
    /// Starts node `id` of `cluster` (see [`node_command`]) with `extra` flags, up to the
    /// address it prints.
    fn start(etcd: &str, database: &str, id: &str, cluster: &str, extra: &[&str]) -> Self {
        let (child, stderr, stdout, http) =
            support::spawn_serving(node_command(etcd, database, id, cluster).args(extra), "troupe node");
        Self {
            child,
            stderr: Some(stderr),
            _stdout: stdout,
            http,
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Per actor of the fence log: the accepted claims whose fence is not above the claim
/// before, and the accepted commits whose fence or holder is not the newest claim's
/// (two owners at once). Every row is one violation, as text.
async fn fence_log_violations(config: &str) -> (usize, Vec<String>) {
    let (client, connection) = tokio_postgres::connect(config, tokio_postgres::NoTls)
        .await
        .expect("connect to read the fence log");
    let connection = tokio::spawn(connection);
    let rows = client
        .query(
            "SELECT kind, key, id, event, fence, holder,
                    (SELECT c.fence FROM troupe_fence_log c
                      WHERE c.event = 'claim' AND c.kind = l.kind AND c.key = l.key AND c.id < l.id
                      ORDER BY c.id DESC LIMIT 1) AS fence_before,
                    (SELECT c.holder FROM troupe_fence_log c
                      WHERE c.event = 'claim' AND c.kind = l.kind AND c.key = l.key AND c.id < l.id
                      ORDER BY c.id DESC LIMIT 1) AS holder_before
               FROM troupe_fence_log l ORDER BY kind, key, id",
            &[],
        )
        .await
        .expect("read the fence log");
    let mut violations = Vec::new();
    for row in &rows {
        let (kind, key, id, event): (String, String, i64, String) = (row.get(0), row.get(1), row.get(2), row.get(3));
        let (fence, holder): (i64, Option<String>) = (row.get(4), row.get(5));
        let (fence_before, holder_before): (Option<i64>, Option<String>) = (row.get(6), row.get(7));
        let wrong = match event.as_str() {
            "claim" => fence_before.is_some_and(|before| fence <= before),
            "commit" => fence_before != Some(fence) || holder_before != holder,
            _ => true,
        };
        if wrong {
            violations.push(format!(
                "{kind}/{key} row {id}: {event} fence {fence} by {holder:?}; the claim before: fence {fence_before:?} by \
                 {holder_before:?}"
            ));
        }
    }
    drop(client);
    let _ = connection.await;
    (rows.len(), violations)
}

/// How much later than one lease a crashed node's conversations may be answered again,
/// in milliseconds: etcd checks expiry about every 500 ms, a call retries every 50 ms,
/// and the machine is shared.
const CRASH_RECOVERY_SLACK_MS: u64 = 3_000;

/// How a node of the rolling restart is stopped before it is started again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stop {
    /// SIGTERM, its exit (code 0) awaited; started again once another node answers for
    /// its conversations.
    Graceful,
    /// SIGKILL (a crash: its lease is left to expire), started again at once under its
    /// name, as a supervisor does.
    Crash,
}

/// Goal: a rolling restart of every node of a 3-node cluster, one at a time (SIGTERM,
/// wait for its exit, start it again under the same name), under steady appends through
/// every running node, loses no acknowledged message, and only ever has one owner per
/// conversation: every stopped node exits 0; every failed append is answered with a
/// status the docs call transient (`503`, `504`) and a JSON `error`, never an I/O error
/// (no request is sent to a node after its signal); every acknowledged message is
/// stored at its sequence number; in PostgreSQL's fence log, per conversation, claims'
/// fences strictly increase and every commit carries the fence and holder of the newest
/// claim. Also measured: how long after a stopping node's SIGTERM its conversations are
/// acknowledged by another node (docs/cluster.md: a stopped node's lease is revoked and
/// its placements go at once, so no lease has to run out: bound one lease).
/// Method: [`rolling_restart`] with [`Stop::Graceful`].
#[tokio::test(flavor = "multi_thread")]
async fn a_rolling_restart_of_every_node_under_appends_loses_nothing_and_keeps_one_owner() {
    rolling_restart(Stop::Graceful).await;
}

/// Goal: as the graceful rolling restart, with each node killed (SIGKILL) and started
/// again at once under its name, as a supervisor restarts a crashed process: its
/// conversations are answered again within a lease plus `CRASH_RECOVERY_SLACK_MS` of
/// the kill (the old incarnation's placements hold until its lease ends), every failed
/// append is `503`/`504` with a JSON `error`, no acknowledged message is lost, and the
/// fence log shows one owner at a time (the restarted incarnation claims with newer
/// fences). Method: [`rolling_restart`] with [`Stop::Crash`].
#[tokio::test(flavor = "multi_thread")]
async fn a_rolling_crash_restart_of_every_node_under_appends_loses_nothing_and_keeps_one_owner() {
    rolling_restart(Stop::Crash).await;
}

/// The rolling restart: etcd and PostgreSQL from the Debian packages; nodes `r0`..`r2`,
/// four client threads (one conversation each) sending through the running nodes in
/// turn; for each node: wait for `ROLLING_ACKS_PER_STEP` new acknowledgements per
/// conversation, take it out of the rotation, stop it as `stop` says
/// `ROLLING_DRAIN_MS` later, start it again and put it back; then the checks above.
async fn rolling_restart(stop_how: Stop) {
    let deadline = Instant::now() + Duration::from_millis(ROLLING_TEST_TIMEOUT_MS);
    let etcd = TestEtcd::start("review-rolling").await;
    let postgres = TestServer::start("review-rolling");
    let database = postgres.create_database("rolling").await;
    let endpoint = etcd.endpoint();
    let mut nodes: Vec<Node> = (0..ROLLING_NODES)
        .map(|index| Node::start(&endpoint, &database, &format!("r{index}"), "rolling", &[]))
        .collect();
    let alive = Arc::new(Mutex::new(
        nodes.iter().map(|node| node.http.clone()).collect::<Vec<_>>(),
    ));
    let stop = Arc::new(AtomicBool::new(false));
    let logs: Vec<Arc<Mutex<RollingLog>>> = (0..ROLLING_CONVERSATIONS).map(|_| Arc::default()).collect();
    let clients: Vec<_> = logs
        .iter()
        .enumerate()
        .map(|(index, log)| {
            let (alive, stop, log) = (Arc::clone(&alive), Arc::clone(&stop), Arc::clone(log));
            std::thread::spawn(move || rolling_client(&format!("c{index}"), index, &alive, &stop, &log, deadline))
        })
        .collect();
    let acks = |log: &Mutex<RollingLog>| log.lock().unwrap().acks.len();
    let wait_for_more_acks = |what: &str| {
        let counts: Vec<usize> = logs.iter().map(|log| acks(log)).collect();
        while logs
            .iter()
            .zip(&counts)
            .any(|(log, before)| acks(log) < before + ROLLING_ACKS_PER_STEP)
        {
            assert!(
                Instant::now() < deadline,
                "{what}: too few acknowledgements by the deadline"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    for (index, node) in nodes.iter_mut().enumerate() {
        let name = format!("r{index}");
        wait_for_more_acks(&format!("before {name}'s restart"));
        // The conversations this node owns now (their last acknowledgement's owner).
        let owned: Vec<usize> = (0..ROLLING_CONVERSATIONS)
            .filter(|&conversation| {
                logs[conversation]
                    .lock()
                    .unwrap()
                    .acks
                    .last()
                    .is_some_and(|ack| ack.owner == name)
            })
            .collect();
        alive.lock().unwrap().retain(|http| *http != node.http);
        std::thread::sleep(Duration::from_millis(ROLLING_DRAIN_MS));
        let signalled = Instant::now();
        let signal = match stop_how {
            Stop::Graceful => "-TERM",
            Stop::Crash => "-KILL",
        };
        let sent = Command::new("kill")
            .args([signal, &node.child.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success(), "kill {signal} {name}");
        let status = exited_within(&mut node.child, NODE_STOP_MS_MAX);
        let exited_at = Instant::now();
        let exited = exited_at.duration_since(signalled);
        let stderr = node.stderr.take().expect("the reader").join().unwrap();
        let Some(status) = status else {
            panic!("{name} still runs {NODE_STOP_MS_MAX} ms after kill {signal}: {stderr}");
        };
        assert!(!stderr.contains("panicked"), "{name}: {stderr}");
        let (moved_within_ms, restarted_early) = match stop_how {
            Stop::Graceful => {
                assert_eq!(status.code(), Some(0), "{name}: {stderr}");
                (LEASE_TTL_MS, None)
            }
            Stop::Crash => {
                let restarted = Node::start(&endpoint, &database, &name, "rolling", &[]);
                alive.lock().unwrap().push(restarted.http.clone());
                (LEASE_TTL_MS + CRASH_RECOVERY_SLACK_MS, Some(restarted))
            }
        };
        // Its conversations answered again (gracefully: by another node): how long after
        // the signal.
        let moved = |ack: &Acked| ack.at > exited_at && (stop_how == Stop::Crash || ack.owner != name);
        for &conversation in &owned {
            while !logs[conversation].lock().unwrap().acks.iter().any(moved) {
                assert!(
                    Instant::now() < deadline,
                    "c{conversation} never answered after {name} stopped"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            let log = logs[conversation].lock().unwrap();
            let first = log.acks.iter().find(|ack| moved(ack)).expect("an ack");
            let took = first.at.duration_since(signalled);
            let failures: Vec<&(Instant, String, String)> = log
                .failures
                .iter()
                .filter(|(at, _, _)| *at > signalled && *at <= first.at)
                .collect();
            println!(
                "{name} (exited {} ms after kill {signal}): c{conversation} acknowledged by {} {} ms after the \
                 signal, {} failed appends meanwhile",
                exited.as_millis(),
                first.owner,
                took.as_millis(),
                failures.len()
            );
            assert!(
                took < Duration::from_millis(moved_within_ms),
                "c{conversation}: first acknowledgement {} ms after {name}'s kill {signal}, not within \
                 {moved_within_ms} ms; failures: {failures:?}",
                took.as_millis()
            );
        }
        if let Some(restarted) = restarted_early {
            *node = restarted;
            continue;
        }
        let restarted = Node::start(&endpoint, &database, &name, "rolling", &[]);
        // Nothing was answered as run by the node while it was gone.
        for (conversation, log) in logs.iter().enumerate() {
            let log = log.lock().unwrap();
            let ghost = log.acks.iter().find(|ack| ack.owner == name && ack.at > exited_at);
            assert!(
                ghost.is_none(),
                "c{conversation}: acknowledged as run by {name} after it exited: {ghost:?}"
            );
        }
        alive.lock().unwrap().push(restarted.http.clone());
        *node = restarted;
    }
    wait_for_more_acks("after the rolling restart");
    stop.store(true, Ordering::SeqCst);
    for client in clients {
        client.join().expect("a client thread");
    }

    let reader = nodes[0].http.clone();
    let mut failures_by_answer: BTreeMap<String, usize> = BTreeMap::new();
    for (conversation, log) in logs.iter().enumerate() {
        let log = log.lock().unwrap();
        let (status, _, reply) = support::http_with_head(
            &reader,
            "GET",
            &format!("/v1/conversations/c{conversation}/messages"),
            "",
            HTTP_READ_TIMEOUT_MS,
        );
        assert_eq!(status, 200, "{reply}");
        let reply: Value = serde_json::from_str(&reply).expect("JSON");
        let texts: Vec<&str> = reply["messages"]
            .as_array()
            .expect("messages")
            .iter()
            .map(|message| message["text"].as_str().expect("text"))
            .collect();
        let mut previous = 0;
        for ack in &log.acks {
            assert!(
                ack.seq > previous,
                "c{conversation}: acknowledged seqs out of order: {ack:?}"
            );
            previous = ack.seq;
            let stored = usize::try_from(ack.seq - 1)
                .ok()
                .and_then(|index| texts.get(index))
                .copied();
            assert_eq!(
                stored,
                Some(ack.text.as_str()),
                "c{conversation}: acknowledged {ack:?} not stored there"
            );
        }
        for (_, via, answer) in &log.failures {
            let status = answer.split(' ').next().unwrap_or_default();
            assert!(
                ["503", "504"].contains(&status),
                "c{conversation}: an append through {via} failed with neither 503 nor 504: {answer}"
            );
            let body: Value = serde_json::from_str(answer[4..].trim()).expect("a JSON error body");
            assert!(body["error"].is_string(), "{answer}");
            *failures_by_answer
                .entry(format!("{status} {}", body["error"].as_str().unwrap_or_default()))
                .or_default() += 1;
        }
        println!(
            "c{conversation}: {} acknowledged, {} stored, {} failed",
            log.acks.len(),
            texts.len(),
            log.failures.len()
        );
    }
    println!("failed appends by answer: {failures_by_answer:#?}");
    let (rows, violations) = fence_log_violations(&database).await;
    assert!(violations.is_empty(), "two owners at once: {violations:#?}");
    println!("fence log: {rows} rows, one owner at a time");
}

/// The organisation of the delegation probe: `a` and `b` on the scripted model of `troupe
/// serve --config` (a text holding `route:` and no `route: ` is answered `hello from
/// AGENT`), no policy: every contact is allowed.
const DELEGATION_CONFIG: &str = r#"
[[agents]]
id = "a"
role = "delegates"
system_prompt = "You delegate."
max_steps = 4

[[agents]]
id = "b"
role = "works"
system_prompt = "You work."
max_steps = 4
"#;
/// Tasks `a` delegates to `b` just before `b`'s node is killed.
const DELEGATED_TASKS: usize = 8;
/// Notifications sent to `b` just before its node is killed, one after each task.
const NOTIFICATIONS: usize = 8;
/// Longest one agent request may take while nothing fails, in milliseconds.
const AGENT_REQUEST_MS_MAX: u64 = 10_000;
/// Slack over a lease and a resume sweep for every task to end, in milliseconds (a
/// shared 2-core machine; the restarted node's start is in it).
const TASKS_END_SLACK_MS: u64 = 15_000;

/// One request with a JSON body through `addr`: the status and the JSON answer
/// (`Value::Null` for an empty body). Panics on an I/O error.
fn agent_request(addr: &str, method: &str, path: &str, body: &Value) -> (u16, Value) {
    let body = if body.is_null() {
        String::new()
    } else {
        body.to_string()
    };
    let (status, _, reply) = support::http_with_head(addr, method, path, &body, AGENT_REQUEST_MS_MAX);
    (status, serde_json::from_str(&reply).unwrap_or(Value::Null))
}

/// The user messages of `agent`'s log (read through `addr`) that contain `text`.
fn user_messages_containing(addr: &str, agent: &str, text: &str) -> usize {
    let (status, reply) = agent_request(
        addr,
        "GET",
        &format!("/v1/agents/{agent}/history?limit=1000"),
        &Value::Null,
    );
    assert_eq!(status, 200, "{reply}");
    reply["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter(|message| message["role"] == "user")
        .filter(|message| {
            message["content"]
                .as_str()
                .is_some_and(|content| content.contains(text))
        })
        .count()
}

/// The holder of the newest claim of actor `kind`/`key` in PostgreSQL's fence log.
async fn newest_claim_holder(database: &str, kind: &str, key: &str) -> Option<String> {
    let (client, connection) = tokio_postgres::connect(database, tokio_postgres::NoTls)
        .await
        .expect("connect to read the fence log");
    let connection = tokio::spawn(connection);
    let row = client
        .query_opt(
            "SELECT holder FROM troupe_fence_log WHERE event = 'claim' AND kind = $1 AND key = $2 \
             ORDER BY id DESC LIMIT 1",
            &[&kind, &key],
        )
        .await
        .expect("read the fence log");
    drop(client);
    let _ = connection.await;
    row.and_then(|row| row.get(0))
}

/// Goal: tasks delegated across nodes and notifications, all acknowledged (202), while
/// the node that runs their target is killed (SIGKILL) and started again at once under
/// its name (as a supervisor does), each end exactly once: every task completes with
/// its answer at the delegator, the target's log holds every task and every
/// notification once, and PostgreSQL's fence log shows one owner at a time.
/// Method: etcd and PostgreSQL from the Debian packages, two `troupe node --config`
/// processes with the scripted model; `b` placed on d0 and `a` on d1 by a first ask
/// through each; through d1, `DELEGATED_TASKS` delegations a → b, each followed by a
/// notification to b; then kill d0 and start it again at once; the tasks polled through
/// d1 until every one ended, within a lease, a resume sweep and slack.
#[tokio::test(flavor = "multi_thread")]
async fn delegated_tasks_and_notifications_end_once_when_the_targets_node_is_killed_and_restarted() {
    let etcd = TestEtcd::start("review-delegation").await;
    let postgres = TestServer::start("review-delegation");
    let database = postgres.create_database("delegation").await;
    let dir = tempfile::tempdir().expect("a temporary directory");
    let config = dir.path().join("org.toml");
    std::fs::write(&config, DELEGATION_CONFIG).expect("write the config");
    let extra = ["--config", config.to_str().expect("utf-8 path"), "--scripted"];
    let endpoint = etcd.endpoint();
    let mut d0 = Node::start(&endpoint, &database, "d0", "delegation", &extra);
    let d1 = Node::start(&endpoint, &database, "d1", "delegation", &extra);
    for (node, agent) in [(&d0, "b"), (&d1, "a")] {
        let path = format!("/v1/agents/{agent}/messages");
        let (status, reply) = agent_request(&node.http, "POST", &path, &serde_json::json!({"text": "route:"}));
        assert_eq!(status, 200, "{reply}");
        assert_eq!(reply["text"], format!("hello from {agent}"), "{reply}");
    }
    assert_eq!(
        newest_claim_holder(&database, "agent", "b").await.as_deref(),
        Some("d0")
    );
    assert_eq!(
        newest_claim_holder(&database, "agent", "a").await.as_deref(),
        Some("d1")
    );

    let mut tasks = Vec::new();
    for index in 0..DELEGATED_TASKS.max(NOTIFICATIONS) {
        if index < DELEGATED_TASKS {
            let body = serde_json::json!({"to": "b", "text": format!("route:task-{index}")});
            let (status, reply) = agent_request(&d1.http, "POST", "/v1/agents/a/tasks", &body);
            assert_eq!(status, 202, "{reply}");
            tasks.push(reply["task_id"].as_str().expect("a task id").to_string());
        }
        if index < NOTIFICATIONS {
            let body = serde_json::json!({"text": format!("route:note-{index}")});
            let (status, reply) = agent_request(&d1.http, "POST", "/v1/agents/b/notify", &body);
            assert_eq!(status, 202, "{reply}");
        }
    }
    d0.child.kill().expect("SIGKILL d0");
    d0.child.wait().expect("reap d0");
    let killed = Instant::now();
    let d0 = Node::start(&endpoint, &database, "d0", "delegation", &extra);
    println!("d0 killed and serving again {} ms later", killed.elapsed().as_millis());

    let bound =
        Duration::from_millis(LEASE_TTL_MS + troupe_agent::limits::AGENT_RESUME_SWEEP_MS_DEFAULT + TASKS_END_SLACK_MS);
    let mut answers: BTreeMap<String, usize> = BTreeMap::new();
    let mut ended: BTreeMap<String, Value> = BTreeMap::new();
    while ended.len() < tasks.len() {
        for task in &tasks {
            if ended.contains_key(task) {
                continue;
            }
            let (status, reply) = agent_request(&d1.http, "GET", &format!("/v1/agents/a/tasks/{task}"), &Value::Null);
            *answers
                .entry(format!("{status} {}", reply.get("state").unwrap_or(&reply)))
                .or_default() += 1;
            if status == 200 && !["submitted", "working"].contains(&reply["state"].as_str().unwrap_or_default()) {
                println!(
                    "{task} ended {} ms after the kill: {reply}",
                    killed.elapsed().as_millis()
                );
                ended.insert(task.clone(), reply);
            }
        }
        assert!(
            killed.elapsed() < bound,
            "{} of {} tasks ended {} ms after the kill; answers while polling: {answers:#?}",
            ended.len(),
            tasks.len(),
            killed.elapsed().as_millis()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("answers while polling the tasks: {answers:#?}");
    for (task, reply) in &ended {
        assert_eq!(reply["state"], "completed", "{task}: {reply}");
        assert_eq!(reply["result"], "hello from b", "{task}: {reply}");
    }
    for node in [&d0, &d1] {
        for index in 0..DELEGATED_TASKS {
            let text = format!("route:task-{index}");
            assert_eq!(
                user_messages_containing(&node.http, "b", &text),
                1,
                "{text} in b's log (via {})",
                node.http
            );
        }
        for index in 0..NOTIFICATIONS {
            let text = format!("route:note-{index}");
            assert_eq!(
                user_messages_containing(&node.http, "b", &text),
                1,
                "{text} in b's log (via {})",
                node.http
            );
        }
    }
    let (rows, violations) = fence_log_violations(&database).await;
    assert!(violations.is_empty(), "two owners at once: {violations:#?}");
    println!("fence log: {rows} rows, one owner at a time");
}
