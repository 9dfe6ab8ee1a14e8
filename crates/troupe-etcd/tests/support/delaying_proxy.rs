//! A TCP proxy on 127.0.0.1 in front of one test's etcd, so a test can hold back etcd's
//! answers (pause the etcd → client bytes, then release them in order) or cut every
//! connection at once, as a slow or failing network would. It forwards bytes only; it
//! does not read gRPC or HTTP/2. It accepts at most [`PROXY_CONNECTIONS_MAX`]
//! connections and stops, with all of them, when dropped.
//!
//! Test code only: waits go through `tokio::sync::Notify` (clippy.toml forbids watch
//! channels) and every `select!` is biased (tests/determinism_guard.rs).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

/// Most connections one proxy accepts over its life; later ones are closed at once.
pub(crate) const PROXY_CONNECTIONS_MAX: u64 = 64;
/// Bytes one direction of a connection reads (and, held back, keeps) at a time.
const PROXY_BUFFER_BYTES: usize = 16 * 1_024;

/// What the proxy and its connection tasks share.
#[derive(Debug, Default)]
struct Shared {
    /// Whether etcd → client bytes are held back.
    paused: AtomicBool,
    /// Woken when `paused` is cleared.
    released: Notify,
    /// Woken to cut every open connection.
    cuts: Notify,
    /// Connections accepted so far.
    accepted: AtomicU64,
    /// Client → etcd bytes forwarded so far.
    upstream_bytes: AtomicU64,
    /// Woken whenever client → etcd bytes were forwarded.
    upstream_sent: Notify,
}

/// The proxy of one test; see the module documentation.
pub(crate) struct DelayingProxy {
    address: SocketAddr,
    shared: Arc<Shared>,
    accept_task: JoinHandle<()>,
}

impl DelayingProxy {
    /// Listens on a free 127.0.0.1 port and forwards every connection to `upstream`
    /// (`127.0.0.1:PORT`).
    pub(crate) async fn start(upstream: &str) -> Self {
        let upstream: SocketAddr = upstream.parse().expect("etcd's endpoint is ip:port");
        assert!(upstream.ip().is_loopback(), "the proxy forwards to loopback only");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the proxy");
        let address = listener.local_addr().expect("the proxy's address");
        let shared = Arc::new(Shared::default());
        let accept_task = tokio::spawn(accept(listener, upstream, Arc::clone(&shared)));
        Self {
            address,
            shared,
            accept_task,
        }
    }

    /// The endpoint clients connect to, `127.0.0.1:PORT`.
    pub(crate) fn endpoint(&self) -> String {
        self.address.to_string()
    }

    /// Holds back every etcd → client byte from now on (on open and new connections)
    /// until [`DelayingProxy::release_answers`]; client → etcd bytes still flow.
    pub(crate) fn pause_answers(&self) {
        self.shared.paused.store(true, Ordering::SeqCst);
    }

    /// Lets the held-back etcd → client bytes through, in order, and those after them.
    pub(crate) fn release_answers(&self) {
        self.shared.paused.store(false, Ordering::SeqCst);
        self.shared.released.notify_waiters();
    }

    /// Closes every open connection at once (both sockets; held-back bytes are lost).
    /// Connections made afterwards are served as before.
    pub(crate) fn cut_connections(&self) {
        self.shared.cuts.notify_waiters();
    }

    /// Connections accepted so far.
    pub(crate) fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Waits until client → etcd bytes are forwarded after this call (a request sent),
    /// at most until `deadline`; returns when they were, or `None` at the deadline.
    pub(crate) async fn next_request(&self, deadline: Instant) -> Option<Instant> {
        let before = self.shared.upstream_bytes.load(Ordering::SeqCst);
        loop {
            let sent = self.shared.upstream_sent.notified();
            if self.shared.upstream_bytes.load(Ordering::SeqCst) > before {
                return Some(tokio::time::Instant::now());
            }
            tokio::select! {
                biased;
                () = sent => {}
                () = tokio::time::sleep_until(deadline) => return None,
            }
        }
    }
}

impl Drop for DelayingProxy {
    fn drop(&mut self) {
        // The accept task owns the connection tasks (a JoinSet): aborting it ends them.
        self.accept_task.abort();
    }
}

async fn accept(listener: TcpListener, upstream: SocketAddr, shared: Arc<Shared>) {
    let mut connections = JoinSet::new();
    loop {
        let (client, _peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                eprintln!("the proxy's accept failed: {error}");
                continue;
            }
        };
        if shared.accepted.fetch_add(1, Ordering::SeqCst) >= PROXY_CONNECTIONS_MAX {
            eprintln!("the proxy refuses a connection beyond {PROXY_CONNECTIONS_MAX}");
            continue;
        }
        connections.spawn(forward(client, upstream, Arc::clone(&shared)));
        // Reap finished connection tasks so the set stays small.
        while connections.try_join_next().is_some() {}
    }
}

/// Forwards one connection both ways until either side closes or the proxy cuts it.
async fn forward(client: TcpStream, upstream: SocketAddr, shared: Arc<Shared>) {
    // Registered before anything else, so a cut from now on ends this connection.
    let cut = shared.cuts.notified();
    let server = match TcpStream::connect(upstream).await {
        Ok(server) => server,
        Err(error) => {
            eprintln!("the proxy could not reach etcd at {upstream}: {error}");
            return;
        }
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let (upstream_shared, answers_shared) = (Arc::clone(&shared), Arc::clone(&shared));
    let requests = async move {
        let mut buffer = vec![0_u8; PROXY_BUFFER_BYTES];
        loop {
            let read = match client_read.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(read) => read,
            };
            if server_write.write_all(&buffer[..read]).await.is_err() {
                return;
            }
            let read = u64::try_from(read).expect("a buffer's length fits u64");
            upstream_shared.upstream_bytes.fetch_add(read, Ordering::SeqCst);
            upstream_shared.upstream_sent.notify_waiters();
        }
    };
    let answers = async move {
        let mut buffer = vec![0_u8; PROXY_BUFFER_BYTES];
        loop {
            let read = match server_read.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(read) => read,
            };
            loop {
                let released = answers_shared.released.notified();
                if !answers_shared.paused.load(Ordering::SeqCst) {
                    break;
                }
                released.await;
            }
            if client_write.write_all(&buffer[..read]).await.is_err() {
                return;
            }
        }
    };
    // Either direction ending ends the connection: the sockets are dropped (closed).
    tokio::select! {
        biased;
        () = cut => {}
        () = requests => {}
        () = answers => {}
    }
}
