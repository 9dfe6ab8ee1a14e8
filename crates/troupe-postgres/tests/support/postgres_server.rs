//! A throwaway PostgreSQL server for one test: Debian's `postgresql` server binaries
//! (`initdb`, `pg_ctl`) on a free loopback port with a temporary data directory, stopped
//! when dropped. Without the binaries the test fails and says what to install; nothing is
//! skipped. Shared by the tests of troupe-postgres and troupe-cli (`#[path]`-included).
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use troupe_postgres::{tokio_postgres, PostgresStore};

/// How many times a test tries to start its server, each time on a newly chosen free
/// port (another process may take the port between choosing and binding it).
pub(crate) const SERVER_START_ATTEMPTS: usize = 5;
/// How long `pg_ctl` waits for the server to accept connections, in seconds.
pub(crate) const SERVER_START_TIMEOUT_S: u32 = 60;
/// The database superuser that `initdb` creates; trusted on loopback, no password.
pub(crate) const SUPERUSER: &str = "troupe";

// ---------------------------------------------------------------------------------------
// The throwaway server
// ---------------------------------------------------------------------------------------

/// A PostgreSQL server of one test, in a temporary directory; stopped and removed when
/// dropped.
pub(crate) struct TestServer {
    directory: tempfile::TempDir,
    bindir: PathBuf,
    run_as: Option<&'static str>,
    port: u16,
}

impl TestServer {
    pub(crate) fn start(test_name: &str) -> Self {
        let bindir = server_bindir();
        stop_servers_of_dead_tests(&bindir);
        let directory = tempfile::Builder::new()
            .prefix(&format!("troupe-pg-{test_name}-{}-", std::process::id()))
            .tempdir()
            .expect("create the server's directory");
        let run_as = server_user();
        if let Some(user) = run_as {
            run(Command::new("chown").arg("-R").arg(user).arg(directory.path()));
        }
        let mut server = Self {
            directory,
            bindir,
            run_as,
            port: 0,
        };
        let data = server.data().to_string_lossy().into_owned();
        server.run_tool(
            "initdb",
            &[
                "-D",
                &data,
                "-U",
                SUPERUSER,
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C",
                "--no-sync",
            ],
        );
        let log = server
            .directory
            .path()
            .join("server.log")
            .to_string_lossy()
            .into_owned();
        let socket_directory = server.directory.path().to_string_lossy().into_owned();
        for attempt in 1..=SERVER_START_ATTEMPTS {
            let port = free_port();
            let options = format!("-p {port} -h 127.0.0.1 -k {socket_directory}");
            let timeout = SERVER_START_TIMEOUT_S.to_string();
            let output = server.tool_output(
                "pg_ctl",
                &["-D", &data, "-l", &log, "-o", &options, "-w", "-t", &timeout, "start"],
            );
            if output.status.success() {
                server.port = port;
                return server;
            }
            let log_text = std::fs::read_to_string(&log).unwrap_or_default();
            assert!(
                attempt < SERVER_START_ATTEMPTS,
                "pg_ctl start failed {SERVER_START_ATTEMPTS} times; last: {}\n{}\nserver log:\n{log_text}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        unreachable!("the loop returns or panics")
    }

    /// Restarts the server (`pg_ctl restart -m fast`: open connections are closed, the
    /// data is kept) on the same port, and waits until it accepts connections again.
    pub(crate) fn restart(&self) {
        let data = self.data().to_string_lossy().into_owned();
        let log = self.directory.path().join("server.log").to_string_lossy().into_owned();
        let timeout = SERVER_START_TIMEOUT_S.to_string();
        self.run_tool(
            "pg_ctl",
            &["-D", &data, "-l", &log, "-m", "fast", "-w", "-t", &timeout, "restart"],
        );
    }

    /// Stops the server (`pg_ctl stop -m fast`: open connections are closed, the data is
    /// kept); [`TestServer::start_again`] starts it on the same port.
    pub(crate) fn stop(&self) {
        let data = self.data().to_string_lossy().into_owned();
        let timeout = SERVER_START_TIMEOUT_S.to_string();
        self.run_tool("pg_ctl", &["-D", &data, "-m", "fast", "-w", "-t", &timeout, "stop"]);
    }

    /// Flushes the server's dirty pages (`CHECKPOINT`), so that a stop right after has
    /// little to write and takes the server down for less time.
    pub(crate) async fn checkpoint(&self) {
        let (client, connection) = tokio_postgres::connect(&self.config("postgres"), tokio_postgres::NoTls)
            .await
            .expect("connect to the server's postgres database");
        let connection = tokio::spawn(connection);
        client.batch_execute("CHECKPOINT").await.expect("a checkpoint");
        drop(client);
        connection.await.expect("the connection task").expect("the connection");
    }

    /// Starts the server stopped by [`TestServer::stop`] again, on the same port, and
    /// waits until it accepts connections.
    pub(crate) fn start_again(&self) {
        let data = self.data().to_string_lossy().into_owned();
        let log = self.directory.path().join("server.log").to_string_lossy().into_owned();
        let socket_directory = self.directory.path().to_string_lossy().into_owned();
        let options = format!("-p {} -h 127.0.0.1 -k {socket_directory}", self.port);
        let timeout = SERVER_START_TIMEOUT_S.to_string();
        self.run_tool(
            "pg_ctl",
            &["-D", &data, "-l", &log, "-o", &options, "-w", "-t", &timeout, "start"],
        );
    }

    /// The port the server listens on (loopback).
    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    pub(crate) fn data(&self) -> PathBuf {
        self.directory.path().join("data")
    }

    /// Connection parameters for `database` on this server.
    pub(crate) fn config(&self, database: &str) -> String {
        format!("host=127.0.0.1 port={} user={SUPERUSER} dbname={database}", self.port)
    }

    /// Creates an empty database and returns its connection parameters.
    pub(crate) async fn create_database(&self, database: &str) -> String {
        let (client, connection) = tokio_postgres::connect(&self.config("postgres"), tokio_postgres::NoTls)
            .await
            .expect("connect to the server's postgres database");
        let connection = tokio::spawn(connection);
        client
            .batch_execute(&format!("CREATE DATABASE {database}"))
            .await
            .expect("create a database");
        drop(client);
        connection.await.expect("the connection task").expect("the connection");
        self.config(database)
    }

    /// A store connected with `config`.
    pub(crate) async fn store_on(&self, config: &str) -> PostgresStore {
        PostgresStore::connect(config).await.expect("connect a store")
    }

    /// A store on a new database of its own.
    pub(crate) async fn store(&self, database: &str) -> PostgresStore {
        let config = self.create_database(database).await;
        PostgresStore::connect(&config).await.expect("connect a store")
    }

    pub(crate) fn tool_output(&self, tool: &str, arguments: &[&str]) -> Output {
        let program = self.bindir.join(tool);
        let mut command = match self.run_as {
            Some(user) => {
                let mut command = Command::new("runuser");
                command.arg("-u").arg(user).arg("--").arg(&program);
                command
            }
            None => Command::new(&program),
        };
        command
            .args(arguments)
            .current_dir(self.directory.path())
            .output()
            .unwrap_or_else(|error| panic!("run {}: {error}", program.display()))
    }

    pub(crate) fn run_tool(&self, tool: &str, arguments: &[&str]) {
        let output = self.tool_output(tool, arguments);
        assert!(
            output.status.success(),
            "{tool} failed: {}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if self.port != 0 {
            let data = self.data().to_string_lossy().into_owned();
            // Immediate: the data is thrown away anyway.
            let _ = self.tool_output("pg_ctl", &["-D", &data, "-m", "immediate", "-w", "stop"]);
        }
    }
}

/// Stops and removes the servers of test processes that died without dropping their
/// [`TestServer`] (killed, say, by a timeout): their directories are named
/// `troupe-pg-{test}-{pid}-{random}` in the temporary directory.
pub(crate) fn stop_servers_of_dead_tests(bindir: &Path) {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with("troupe-pg-") {
            continue;
        }
        let mut parts = name.rsplit('-');
        let (Some(_random), Some(pid)) = (parts.next(), parts.next()) else {
            continue;
        };
        if pid.parse::<u32>().is_err() || Path::new("/proc").join(pid).exists() {
            continue;
        }
        let data = entry.path().join("data");
        if data.join("postmaster.pid").exists() {
            let data = data.to_string_lossy().into_owned();
            let stop_arguments = ["-D", data.as_str(), "-m", "immediate", "-w", "stop"];
            let program = bindir.join("pg_ctl");
            let _ = match server_user() {
                Some(user) => Command::new("runuser")
                    .arg("-u")
                    .arg(user)
                    .arg("--")
                    .arg(&program)
                    .args(stop_arguments)
                    .output(),
                None => Command::new(&program).args(stop_arguments).output(),
            };
        }
        let _ = std::fs::remove_dir_all(entry.path());
    }
}

/// Where `initdb` and `pg_ctl` are; panics, saying what to install, if nowhere.
pub(crate) fn server_bindir() -> PathBuf {
    let has_tools = |directory: &Path| directory.join("initdb").is_file() && directory.join("pg_ctl").is_file();
    if let Ok(output) = Command::new("pg_config").arg("--bindir").output() {
        let directory = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
        if output.status.success() && has_tools(&directory) {
            return directory;
        }
    }
    let mut candidates: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path().join("bin"))
        .filter(|directory| has_tools(directory))
        .collect();
    // The newest major version last.
    candidates.sort_by_key(|directory| {
        directory
            .parent()
            .and_then(Path::file_name)
            .and_then(|name| name.to_str())
            .and_then(|name| name.parse::<u32>().ok())
            .unwrap_or(0)
    });
    candidates.pop().unwrap_or_else(|| {
        panic!(
            "the PostgreSQL server binaries (initdb, pg_ctl) were found neither through \
             `pg_config --bindir` nor in /usr/lib/postgresql/*/bin: install the Debian package \
             `postgresql` (apt-get install postgresql) to run these tests"
        )
    })
}

/// The user to run the server as: none (ourselves) unless we are root, which
/// PostgreSQL refuses.
pub(crate) fn server_user() -> Option<&'static str> {
    let output = Command::new("id").arg("-u").output().expect("run id -u");
    if String::from_utf8_lossy(&output.stdout).trim() != "0" {
        return None;
    }
    let postgres_exists = Command::new("id")
        .arg("postgres")
        .output()
        .is_ok_and(|output| output.status.success());
    Some(if postgres_exists { "postgres" } else { "nobody" })
}

pub(crate) fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a free loopback port");
    listener.local_addr().expect("the listener's address").port()
}

pub(crate) fn run(command: &mut Command) {
    let output = command.output().expect("run a command");
    assert!(
        output.status.success(),
        "{command:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}
