//! The server's configuration, and why a server refuses to start.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;

use crate::limits::{
    A2A_TASKS_KEPT_MAX, SERVER_CONCURRENT_REQUESTS_MAX, SERVER_CONCURRENT_REQUESTS_MAX_DEFAULT, SERVER_CONNECTIONS_MAX,
    SERVER_CONNECTIONS_MAX_DEFAULT, SERVER_REQUEST_TIMEOUT_MS_DEFAULT, SERVER_REQUEST_TIMEOUT_MS_MAX,
    SERVER_REQUEST_TIMEOUT_MS_MIN, SERVER_STREAMS_OPEN_MAX, SERVER_STREAMS_OPEN_MAX_DEFAULT,
    SERVER_TOKEN_LENGTH_MIN_BYTES,
};

/// How a server behaves: its bearer token and its limits.
#[derive(Clone)]
pub struct ServerConfig {
    /// The bearer token every request but `GET /health` must carry
    /// (`Authorization: Bearer TOKEN`); `None`: no authentication (loopback only, see
    /// [`ServerConfig::check_bind`]).
    pub token: Option<String>,
    /// Requests handled at once, from 1 to [`SERVER_CONCURRENT_REQUESTS_MAX`]; one more
    /// gets 503 `overloaded`.
    pub concurrent_requests_max: usize,
    /// Streamed answers open at once (a streamed message, A2A `SendStreamingMessage`
    /// and `SubscribeToTask`), from 1 to [`SERVER_STREAMS_OPEN_MAX`]; one more gets 503
    /// with `Retry-After` before it starts anything. A stream holds its slot until it
    /// ends or its client goes away.
    pub streams_open_max: usize,
    /// How long a request may take until its response headers, from
    /// [`SERVER_REQUEST_TIMEOUT_MS_MIN`] to [`SERVER_REQUEST_TIMEOUT_MS_MAX`] ms.
    pub request_timeout: Duration,
    /// A2A tasks kept (in memory and in the store), at most, from 1 to
    /// [`A2A_TASKS_KEPT_MAX`] (the default): past it the oldest ended task is forgotten,
    /// and so is its agent's record of it.
    pub a2a_tasks_kept: usize,
    /// The cluster node this server runs on (`None`: a single server). A2A task ids
    /// (`{agent}-task-{node}-{n}`) and their stored records carry it, so that two nodes
    /// never number the same task: a node that takes over an agent's A2A records after
    /// another node's death then neither overwrites its tasks nor reuses their ids.
    pub node: Option<String>,
    /// Where the cluster's other nodes serve HTTP (`None`: nowhere known). A cluster
    /// node's server asked for an agent's A2A tasks that another node holds forwards
    /// the request to that node's server, once; without an address it refuses it as
    /// retryable (503), naming the node.
    pub peers: Option<Arc<dyn PeerAddresses>>,
    /// How many log lines the process has dropped so far, read at every scrape of
    /// `/metrics` (as `troupe_log_lines_dropped_total`): `troupe serve` and `troupe node`
    /// write their log lines through a bounded queue that drops a line when it is full
    /// (stderr not read as fast as they come). `None`: the process has no such queue,
    /// and `/metrics` leaves the counter out.
    pub log_lines_dropped: Option<LogLinesDropped>,
    /// Connections served at once, from 1 to [`SERVER_CONNECTIONS_MAX`]: past it
    /// [`crate::serve`] accepts no new connection until one closes (the connections
    /// asking wait in the kernel's listen backlog, unanswered), so that connections (idle
    /// ones above all) cannot use up the process's file descriptors, which its store,
    /// etcd and model clients need too.
    pub connections_max: usize,
}

/// Reads a count of log lines dropped (see [`ServerConfig::log_lines_dropped`]).
pub type LogLinesDropped = Arc<dyn Fn() -> u64 + Send + Sync>;

/// Where the other nodes of a cluster serve HTTP (`troupe node` reads the addresses the
/// nodes publish in etcd).
pub trait PeerAddresses: Send + Sync {
    /// The `host:port` node `node` serves HTTP on, if it is known and serves HTTP.
    fn http_address<'a>(&'a self, node: &'a str) -> BoxFuture<'a, Option<String>>;
}

impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("ServerConfig")
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .field("concurrent_requests_max", &self.concurrent_requests_max)
            .field("streams_open_max", &self.streams_open_max)
            .field("request_timeout", &self.request_timeout)
            .field("a2a_tasks_kept", &self.a2a_tasks_kept)
            .field("node", &self.node)
            .field("peers", &self.peers.as_ref().map(|_| "<set>"))
            .field("log_lines_dropped", &self.log_lines_dropped.as_ref().map(|_| "<set>"))
            .field("connections_max", &self.connections_max)
            .finish()
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            token: None,
            concurrent_requests_max: SERVER_CONCURRENT_REQUESTS_MAX_DEFAULT,
            streams_open_max: SERVER_STREAMS_OPEN_MAX_DEFAULT,
            request_timeout: Duration::from_millis(SERVER_REQUEST_TIMEOUT_MS_DEFAULT),
            a2a_tasks_kept: A2A_TASKS_KEPT_MAX,
            node: None,
            peers: None,
            log_lines_dropped: None,
            connections_max: SERVER_CONNECTIONS_MAX_DEFAULT,
        }
    }
}

impl ServerConfig {
    /// Requires `token` on every request but `GET /health`.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// Handles at most `max` requests at once.
    pub fn concurrent_requests_max(mut self, max: usize) -> Self {
        self.concurrent_requests_max = max;
        self
    }

    /// Keeps at most `max` streamed answers open at once (see
    /// [`ServerConfig::streams_open_max`]).
    pub fn streams_open_max(mut self, max: usize) -> Self {
        self.streams_open_max = max;
        self
    }

    /// Answers 504 to a request that takes longer than `timeout` to its headers.
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// Keeps at most `kept` A2A tasks (see [`ServerConfig::a2a_tasks_kept`]).
    pub fn a2a_tasks_kept(mut self, kept: usize) -> Self {
        self.a2a_tasks_kept = kept;
        self
    }

    /// Runs as cluster node `node` (see [`ServerConfig::node`]).
    pub fn node(mut self, node: impl Into<String>) -> Self {
        self.node = Some(node.into());
        self
    }

    /// Forwards A2A requests for tasks another cluster node holds to the address `peers`
    /// gives for it (see [`ServerConfig::peers`]).
    pub fn peers(mut self, peers: Arc<dyn PeerAddresses>) -> Self {
        self.peers = Some(peers);
        self
    }

    /// Shows `dropped()`, the log lines dropped so far, in `/metrics` (see
    /// [`ServerConfig::log_lines_dropped`]).
    pub fn log_lines_dropped(mut self, dropped: LogLinesDropped) -> Self {
        self.log_lines_dropped = Some(dropped);
        self
    }

    /// Serves at most `max` connections at once (see [`ServerConfig::connections_max`]).
    pub fn connections_max(mut self, max: usize) -> Self {
        self.connections_max = max;
        self
    }

    /// Checks the configuration for serving on `addr`.
    ///
    /// # Errors
    /// [`ServeError::TokenTooShort`] for a token under [`SERVER_TOKEN_LENGTH_MIN_BYTES`];
    /// [`ServeError::TokenRequired`] for a non-loopback address without a token;
    /// [`ServeError::ConcurrentRequests`] for a `concurrent_requests_max` of 0 or over
    /// [`SERVER_CONCURRENT_REQUESTS_MAX`];
    /// [`ServeError::StreamsOpen`] for a `streams_open_max` of 0 or over
    /// [`SERVER_STREAMS_OPEN_MAX`];
    /// [`ServeError::RequestTimeout`] for a `request_timeout` under
    /// [`SERVER_REQUEST_TIMEOUT_MS_MIN`] or over [`SERVER_REQUEST_TIMEOUT_MS_MAX`] ms;
    /// [`ServeError::A2aTasksKept`] for an `a2a_tasks_kept` of 0 or over
    /// [`A2A_TASKS_KEPT_MAX`];
    /// [`ServeError::Connections`] for a `connections_max` of 0 or over
    /// [`SERVER_CONNECTIONS_MAX`].
    pub fn check_bind(&self, addr: SocketAddr) -> Result<(), ServeError> {
        if let Some(token) = &self.token {
            if token.len() < SERVER_TOKEN_LENGTH_MIN_BYTES {
                return Err(ServeError::TokenTooShort {
                    length: token.len(),
                    min: SERVER_TOKEN_LENGTH_MIN_BYTES,
                });
            }
        } else if !addr.ip().is_loopback() {
            return Err(ServeError::TokenRequired { addr });
        }
        if !(1..=SERVER_CONCURRENT_REQUESTS_MAX).contains(&self.concurrent_requests_max) {
            return Err(ServeError::ConcurrentRequests {
                given: self.concurrent_requests_max,
                max: SERVER_CONCURRENT_REQUESTS_MAX,
            });
        }
        if !(1..=SERVER_STREAMS_OPEN_MAX).contains(&self.streams_open_max) {
            return Err(ServeError::StreamsOpen {
                given: self.streams_open_max,
                max: SERVER_STREAMS_OPEN_MAX,
            });
        }
        let timeouts =
            Duration::from_millis(SERVER_REQUEST_TIMEOUT_MS_MIN)..=Duration::from_millis(SERVER_REQUEST_TIMEOUT_MS_MAX);
        if !timeouts.contains(&self.request_timeout) {
            return Err(ServeError::RequestTimeout {
                given_ms: self.request_timeout.as_millis(),
                min_ms: SERVER_REQUEST_TIMEOUT_MS_MIN,
                max_ms: SERVER_REQUEST_TIMEOUT_MS_MAX,
            });
        }
        if !(1..=A2A_TASKS_KEPT_MAX).contains(&self.a2a_tasks_kept) {
            return Err(ServeError::A2aTasksKept {
                kept: self.a2a_tasks_kept,
                max: A2A_TASKS_KEPT_MAX,
            });
        }
        if !(1..=SERVER_CONNECTIONS_MAX).contains(&self.connections_max) {
            return Err(ServeError::Connections {
                given: self.connections_max,
                max: SERVER_CONNECTIONS_MAX,
            });
        }
        Ok(())
    }
}

/// Why a server did not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A non-loopback address without a token would serve the agents to anyone.
    #[error(
        "refusing to serve on {addr} without a bearer token: give --token TOKEN (or set TROUPE_TOKEN), \
         or bind a loopback address such as 127.0.0.1"
    )]
    TokenRequired {
        /// The address asked for.
        addr: SocketAddr,
    },
    /// The token is too short to be a secret.
    #[error(
        "the bearer token (--token or TROUPE_TOKEN) is {length} bytes, shorter than the minimum of {min}: \
         use a longer random token, e.g. `openssl rand -hex 16`"
    )]
    TokenTooShort {
        /// Its length, in bytes.
        length: usize,
        /// [`SERVER_TOKEN_LENGTH_MIN_BYTES`].
        min: usize,
    },
    /// `concurrent_requests_max` is out of its range (0 would serve no request).
    #[error("concurrent_requests_max is {given}: give from 1 to {max} requests to handle at once")]
    ConcurrentRequests {
        /// The number given.
        given: usize,
        /// [`SERVER_CONCURRENT_REQUESTS_MAX`].
        max: usize,
    },
    /// `streams_open_max` is out of its range (0 would serve no stream).
    #[error("streams_open_max is {given}: give from 1 to {max} streamed answers to keep open at once")]
    StreamsOpen {
        /// The number given.
        given: usize,
        /// [`SERVER_STREAMS_OPEN_MAX`].
        max: usize,
    },
    /// `request_timeout` is out of its range (zero would answer every request 504).
    #[error("request_timeout is {given_ms} ms: give from {min_ms} to {max_ms} ms")]
    RequestTimeout {
        /// The timeout given, in milliseconds.
        given_ms: u128,
        /// [`SERVER_REQUEST_TIMEOUT_MS_MIN`].
        min_ms: u64,
        /// [`SERVER_REQUEST_TIMEOUT_MS_MAX`].
        max_ms: u64,
    },
    /// `a2a_tasks_kept` is out of its range.
    #[error("a2a_tasks_kept is {kept}: give from 1 to {max} A2A tasks to keep")]
    A2aTasksKept {
        /// The number given.
        kept: usize,
        /// [`A2A_TASKS_KEPT_MAX`].
        max: usize,
    },
    /// `connections_max` is out of its range (0 would serve no connection).
    #[error("connections_max is {given}: give from 1 to {max} connections to serve at once")]
    Connections {
        /// The number given.
        given: usize,
        /// [`SERVER_CONNECTIONS_MAX`].
        max: usize,
    },
    /// Reading the listener's address or serving failed.
    #[error("serving failed: {0}")]
    Io(#[from] std::io::Error),
}
