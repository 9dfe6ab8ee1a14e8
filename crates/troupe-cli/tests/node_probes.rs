//! `troupe node` probed from outside as an operator runs it, on a throwaway etcd and
//! PostgreSQL (the servers of crates/troupe-etcd's and crates/troupe-postgres's tests):
//! what it says when a port it needs is taken. Normal build only (the node command is
//! not built under madsim).
//!
//! Without `/usr/bin/etcd` (Debian `etcd-server`) or the PostgreSQL server binaries
//! (Debian `postgresql`) the test fails and names the package; nothing is skipped.
#![cfg(not(madsim))]
// Real processes and real time only: the child is polled with the wall clock.
#![allow(clippy::disallowed_methods)]

#[allow(dead_code)] // the helpers the etcd tests use and this one does not
#[path = "../../troupe-etcd/tests/support/etcd_server.rs"]
mod etcd_server;
#[path = "../../troupe-postgres/tests/support/postgres_server.rs"]
mod postgres_server;

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use etcd_server::TestEtcd;
use postgres_server::TestServer;

/// The longest a refused node may take to exit, in milliseconds.
const NODE_EXIT_MS_MAX: u64 = 20_000;

/// Runs `troupe node ARGS` until it exits (killed past `NODE_EXIT_MS_MAX`): its exit
/// code, stdout and stderr.
fn node(args: &[&str]) -> (Option<i32>, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_troupe"))
        .arg("node")
        .args(args)
        .env_remove("TROUPE_TOKEN")
        .env_remove("OPENAI_API_KEY")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > Duration::from_millis(NODE_EXIT_MS_MAX) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("troupe node {args:?} did not exit within {NODE_EXIT_MS_MAX} ms");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stdout = String::new();
    child.stdout.take().unwrap().read_to_string(&mut stdout).unwrap();
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    (status.code(), stdout, stderr)
}

/// Goal: a `troupe node` whose `--listen` or `--http` port another process holds exits
/// 1 with one line naming the flag, the address, and what to do (as `troupe serve
/// --bind` does), before it serves anything. Method: hold a loopback port, start a node
/// on real etcd and PostgreSQL with it as `--listen`, then as `--http`.
#[tokio::test]
async fn a_node_whose_port_is_taken_names_the_flag_and_what_to_do() {
    let etcd = TestEtcd::start("node-probes").await;
    let postgres = TestServer::start("node-probes");
    let database = postgres.create_database("probes").await;
    let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = holder.local_addr().unwrap().to_string();
    let endpoint = etcd.endpoint();
    let common = [
        "--etcd",
        endpoint.as_str(),
        "--postgres",
        database.as_str(),
        "--node-id",
        "probe",
        "--lease-ttl-ms",
        "3000",
    ];
    for (flag, ports) in [
        ("--listen", ["--listen", taken.as_str(), "--http", "127.0.0.1:0"]),
        ("--http", ["--listen", "127.0.0.1:0", "--http", taken.as_str()]),
    ] {
        let args: Vec<&str> = common.iter().chain(ports.iter()).copied().collect();
        let (code, stdout, stderr) = node(&args);
        assert_eq!(code, Some(1), "{flag}: stdout {stdout}\nstderr {stderr}");
        assert!(!stdout.contains("listening on"), "{flag}: {stdout}");
        assert!(!stderr.contains("panicked"), "{flag}: {stderr}");
        let line = stderr
            .lines()
            .find(|line| line.starts_with("troupe: "))
            .unwrap_or_else(|| panic!("{flag}: no `troupe: ` line: {stderr}"));
        for needle in [flag, taken.as_str(), "in use", "port 0"] {
            assert!(line.contains(needle), "{flag}: {needle:?} not in: {line}");
        }
    }
    drop(holder);
}
