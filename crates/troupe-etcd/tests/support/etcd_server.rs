//! A throwaway etcd server for one test: Debian's `etcd-server` (`/usr/bin/etcd`) on two
//! free loopback ports with a temporary data directory, killed when dropped. Without the
//! binary the test fails and says what to install; nothing is skipped. Shared by the
//! real-etcd tests of troupe-etcd and troupe-cluster (`#[path]`-included).

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::time::Instant;
use troupe_etcd::{EtcdConfig, NodeId};

/// Where Debian's `etcd-server` puts the server.
pub(crate) const ETCD_BINARY: &str = "/usr/bin/etcd";
/// How many times a test tries to start its server, each on newly chosen free ports.
pub(crate) const SERVER_START_ATTEMPTS: usize = 5;
/// How long a started server may take to answer, in milliseconds.
pub(crate) const SERVER_START_TIMEOUT_MS: u64 = 20_000;
/// The lease TTL of the tests' nodes, in seconds: the shortest allowed, so expiry
/// tests are quick.
pub(crate) const TEST_LEASE_TTL_S: u64 = 3;
/// The request timeout of the tests' nodes, in milliseconds.
pub(crate) const TEST_REQUEST_TIMEOUT_MS: u64 = 500;

/// A throwaway etcd server of one test.
pub(crate) struct TestEtcd {
    child: Option<Child>,
    _directory: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
}

impl TestEtcd {
    /// Starts a server and waits until it answers a read.
    pub(crate) async fn start(test_name: &str) -> Self {
        let binary = PathBuf::from(ETCD_BINARY);
        assert!(
            binary.exists(),
            "{ETCD_BINARY} is missing: install the Debian package `etcd-server` \
             (`apt-get install etcd-server`; .ci/run does it)"
        );
        for attempt in 1..=SERVER_START_ATTEMPTS {
            let directory = tempfile::Builder::new()
                .prefix(&format!("troupe-etcd-{test_name}-"))
                .tempdir()
                .expect("create the server's directory");
            let (client_port, peer_port) = (free_port(), free_port());
            let child = spawn(&directory, client_port, peer_port);
            let mut server = Self {
                child: Some(child),
                _directory: directory,
                client_port,
                peer_port,
            };
            if server.answers().await {
                return server;
            }
            eprintln!("etcd attempt {attempt} on port {client_port} did not answer; retrying on other ports");
            server.kill();
        }
        panic!("etcd did not start in {SERVER_START_ATTEMPTS} attempts");
    }

    /// Stops the server at once (SIGKILL), keeping its data and ports for
    /// [`TestEtcd::restart`].
    #[allow(dead_code)] // only the tests that restart etcd use it
    pub(crate) fn stop(&mut self) {
        self.kill();
    }

    /// Starts the server again on its data and ports, after [`TestEtcd::stop`], and
    /// waits until it answers a read.
    #[allow(dead_code)] // only the tests that restart etcd use it
    pub(crate) async fn restart(&mut self) {
        self.kill();
        self.child = Some(spawn(&self._directory, self.client_port, self.peer_port));
        assert!(self.answers().await, "etcd did not answer after its restart");
    }

    /// Waits until the server answers a read.
    async fn answers(&mut self) -> bool {
        let deadline = Instant::now() + Duration::from_millis(SERVER_START_TIMEOUT_MS);
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut() {
                if child.try_wait().expect("poll etcd").is_some() {
                    return false;
                }
            }
            let endpoint = self.endpoint();
            let read = async {
                let mut client = etcd_client::Client::connect([endpoint], None).await?;
                client.get("/", None).await
            };
            if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(1_000), read).await {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    }

    /// The client endpoint, `127.0.0.1:PORT`.
    pub(crate) fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }

    /// A node's configuration on this server: the tests' TTL and request timeout.
    pub(crate) fn config(&self, node: &str, address: &str) -> EtcdConfig {
        EtcdConfig::new(
            vec![self.endpoint()],
            "test",
            NodeId::new(node).expect("a valid node name"),
            address,
        )
        .with_lease_ttl_s(TEST_LEASE_TTL_S)
        .with_request_timeout_ms(TEST_REQUEST_TIMEOUT_MS)
    }

    /// Kills the server (a crash, as far as its clients can tell).
    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for TestEtcd {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Starts etcd on `directory`'s data and the given loopback ports, its log appended to
/// `etcd.log` there.
fn spawn(directory: &tempfile::TempDir, client_port: u16, peer_port: u16) -> Child {
    let client_url = format!("http://127.0.0.1:{client_port}");
    let peer_url = format!("http://127.0.0.1:{peer_port}");
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(directory.path().join("etcd.log"))
        .expect("open the server's log");
    Command::new(ETCD_BINARY)
        .arg("--data-dir")
        .arg(directory.path().join("data"))
        .args([
            "--listen-client-urls",
            &client_url,
            "--advertise-client-urls",
            &client_url,
        ])
        .args([
            "--listen-peer-urls",
            &peer_url,
            "--initial-advertise-peer-urls",
            &peer_url,
        ])
        .args(["--initial-cluster", &format!("default={peer_url}")])
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        .spawn()
        .expect("start etcd")
}

/// A free loopback port (free when asked; the caller binds it soon after).
pub(crate) fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("bind a free loopback port")
        .port()
}
