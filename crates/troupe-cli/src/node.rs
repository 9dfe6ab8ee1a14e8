//! `troupe node`: one node of a Troupe cluster, with the PostgreSQL store and etcd
//! placement, serving durable conversation logs over a small HTTP API.
//!
//! ```text
//!  HTTP client ──► any node's --http ──► ClusterClient::invoke(conversation/ID)
//!                                          │ owner = this node ──► local runtime
//!                                          │ owner = node B ─────► TCP ──► B's runtime
//!  each runtime: claim = place in etcd (fence = placement revision) + claim in PostgreSQL
//!               commit = PostgreSQL transaction checked against the newest fence
//! ```
//!
//! The conversation log is a durable actor kind that shows what the cluster guarantees
//! (every acknowledged message kept, in order, one owner at a time).
//!
//! With `--config FILE` (the organisation file of `troupe serve --config`), the node also
//! runs the agents FILE declares (the agent system prepared with
//! `AgentSystemBuilder::prepare`, started on the node's runtime and attached to it) and
//! serves `troupe serve`'s HTTP API ([`troupe_server::router`]) next to the logs, which
//! then live under the kind [`LOG_KIND_WITH_AGENTS`] at `/v1/logs/{id}/messages` (the
//! agent layer owns the kind `conversation` and the path `/v1/conversations/...`). An
//! ask made through any node runs on the agent's owner node; `call_agent` between agents
//! is routed the same way. Each node writes FILE's organisation (policy, links,
//! memberships, permissions) to the shared store once attached; the record is one for
//! the whole cluster, and a change made through any node's API reaches every node's
//! admission within `ORG_CACHE_MAX_AGE_MS`.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::json;
use troupe_agent::limits::AGENT_RESUME_SWEEP_MS_DEFAULT;
use troupe_agent::{AgentClient, AgentSystem, LlmClient, OrgConfig};
use troupe_cluster::{ClusterClient, ClusterNode};
use troupe_core::{ActorId, ActorKind, InvokeError};
use troupe_etcd::{EtcdConfig, EtcdPlacement, NodeId, ETCD_KEEP_ALIVES_PER_TTL, ETCD_LEASE_EXPIRY_SLACK_MS};
use troupe_runtime::{
    Actor, ActorBox, ActorError, KindConfig, Runtime, RuntimeBuilder, Turn, FRAME_SIZE_MAX_BYTES, STATE_SCAN_LIMIT_MAX,
};
use troupe_server::limits::SERVER_REQUEST_BODY_DRAIN_MS;

use crate::NodeArgs;

/// The actor kind of a conversation log (without `--config`).
pub const CONVERSATION_KIND: &str = "conversation";
/// The actor kind of a conversation log on a node that also serves agents (`--config`):
/// the agent layer registers [`troupe_agent::CONVERSATION_KIND`] itself.
pub const LOG_KIND_WITH_AGENTS: &str = "conversation-log";
/// Longest message a conversation accepts, in bytes.
pub const CONVERSATION_TEXT_BYTES_MAX: usize = 16 * 1024;
/// Most messages one read returns, in messages (in order, from the read's `after`); a
/// read that stops at it names where the next one starts (`next_after`).
pub const CONVERSATION_READ_MESSAGES_MAX: usize = STATE_SCAN_LIMIT_MAX;
/// Most bytes of messages (as JSON) one read returns, in bytes: half a transport frame
/// ([`FRAME_SIZE_MAX_BYTES`]), so the reply crosses between nodes whatever the messages
/// hold. A read stops before the message that would pass it and names where the next
/// one starts (`next_after`).
pub const CONVERSATION_READ_REPLY_BYTES_MAX: usize = FRAME_SIZE_MAX_BYTES / 2;
/// How long one HTTP request may wait for its conversation, in milliseconds; it covers
/// finding a new owner after one died (one lease) and the call itself.
pub const NODE_CALL_TIMEOUT_MS: u64 = 30_000;
/// The etcd request timeout `troupe node` uses at most, in milliseconds (less when the
/// lease is short: see [`EtcdConfig::validate`]).
pub const NODE_ETCD_REQUEST_TIMEOUT_MS_MAX: u64 = 1_000;
/// Shortest lease `troupe node` accepts, in milliseconds (etcd's minimum TTL here).
pub const NODE_LEASE_TTL_MS_MIN: u64 = troupe_etcd::ETCD_LEASE_TTL_S_MIN * 1_000;
/// Longest lease `troupe node` accepts, in milliseconds.
pub const NODE_LEASE_TTL_MS_MAX: u64 = troupe_etcd::ETCD_LEASE_TTL_S_MAX * 1_000;
/// Most HTTP request body bytes a node reads, in bytes.
pub const NODE_HTTP_BODY_BYTES_MAX: usize = CONVERSATION_TEXT_BYTES_MAX + 1_024;
/// Longest append key (the `id` of an append), in bytes: a UUID (36) fits.
pub const APPEND_ID_BYTES_MAX: usize = 64;
/// The `Retry-After` a node sends with 429 (the conversation's mailbox is full) and 503
/// (its dispatcher is overloaded, or it is stopping), in seconds.
pub const NODE_RETRY_AFTER_S: u64 = 1;
/// How long a node stopped by a signal while it joins the cluster lets the join go on,
/// in milliseconds (two etcd requests' timeouts): a join that ends within it is left at
/// once (its lease revoked, its membership record gone); one still running then is cut,
/// and a lease it may hold already ends by itself within `--lease-ttl-ms`. A second
/// signal cuts it at once. A signal while the node connects to PostgreSQL stops it at
/// once: nothing is registered yet.
pub const NODE_JOIN_STOP_WAIT_MS: u64 = 2 * NODE_ETCD_REQUEST_TIMEOUT_MS_MAX;
/// How many append keys a conversation remembers, in keys: the keys of its last this
/// many keyed appends; the oldest is forgotten first, and a resend of a forgotten key is
/// stored again as a new message.
pub const APPEND_IDS_REMEMBERED: usize = 256;

// The largest message, as JSON (every byte escaped as `\u00XX`: 6 bytes), fits in one
// read, and the reply's envelope in the rest of the frame.
/// How often a node with `--rejoin-after-lost-lease` whose lease was lost looks whether
/// it holds a new one (to log the line saying it rejoined), in milliseconds.
pub const NODE_REJOIN_WATCH_MS: u64 = 200;

const _: () = assert!(6 * CONVERSATION_TEXT_BYTES_MAX + 1_024 < CONVERSATION_READ_REPLY_BYTES_MAX);
const _: () = assert!(CONVERSATION_READ_REPLY_BYTES_MAX + 64 * 1_024 < FRAME_SIZE_MAX_BYTES);

/// An append key (`id`) that cannot be used, naming the field and what to send.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AppendIdError {
    /// The key is empty.
    #[error("id is empty: give 1 to {APPEND_ID_BYTES_MAX} bytes of A-Z a-z 0-9 - _ . :, or leave id out")]
    Empty,
    /// The key is longer than [`APPEND_ID_BYTES_MAX`].
    #[error("id is {bytes} bytes long; at most {APPEND_ID_BYTES_MAX} bytes are accepted (a UUID fits)")]
    TooLong {
        /// Its length, in bytes.
        bytes: usize,
    },
    /// The key holds a character outside A-Z a-z 0-9 - _ . :
    #[error("id holds {character:?}; only A-Z a-z 0-9 - _ . : are allowed")]
    Character {
        /// The first character refused.
        character: char,
    },
}

/// Checks an append key: 1 to [`APPEND_ID_BYTES_MAX`] bytes of `A-Z a-z 0-9 - _ . :`.
///
/// # Errors
/// [`AppendIdError`] saying what is wrong.
pub fn check_append_id(id: &str) -> Result<(), AppendIdError> {
    if id.is_empty() {
        return Err(AppendIdError::Empty);
    }
    if id.len() > APPEND_ID_BYTES_MAX {
        return Err(AppendIdError::TooLong { bytes: id.len() });
    }
    match id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':')))
    {
        Some(character) => Err(AppendIdError::Character { character }),
        None => Ok(()),
    }
}

/// An append body that cannot be used, with the status it is answered with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AppendBodyError {
    /// The body is larger than [`NODE_HTTP_BODY_BYTES_MAX`]: 413.
    #[error(
        "the body is larger than the limit of {NODE_HTTP_BODY_BYTES_MAX} bytes; a message's text holds at most \
         {CONVERSATION_TEXT_BYTES_MAX} bytes"
    )]
    TooLarge,
    /// The text is longer than [`CONVERSATION_TEXT_BYTES_MAX`]: 422.
    #[error("text is {bytes} bytes; at most {CONVERSATION_TEXT_BYTES_MAX} bytes are accepted: send a shorter message")]
    TextTooLong {
        /// Its length, in bytes.
        bytes: usize,
    },
    /// The body is not `application/json`: 415.
    #[error("the body must be JSON with Content-Type: application/json: {cause}")]
    NotJson {
        /// What the extractor said.
        cause: String,
    },
    /// The body is JSON but not `{"text": ..., "id": ...}`: 422.
    #[error("the body must be JSON {{\"text\": \"...\", \"id\": \"optional key\"}}: {cause}")]
    Fields {
        /// What the extractor said.
        cause: String,
    },
    /// The body is not JSON, or could not be read: 400.
    #[error("the body must be JSON {{\"text\": \"...\", \"id\": \"optional key\"}}: {cause}")]
    Unreadable {
        /// What the extractor said.
        cause: String,
    },
}

impl AppendBodyError {
    /// The HTTP status it is answered with.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::TextTooLong { .. } | Self::Fields { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            Self::NotJson { .. } => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::Unreadable { .. } => StatusCode::BAD_REQUEST,
        }
    }

    fn of_rejection(rejection: &axum::extract::rejection::JsonRejection) -> Self {
        let cause = rejection.body_text();
        match rejection.status() {
            StatusCode::PAYLOAD_TOO_LARGE => Self::TooLarge,
            StatusCode::UNSUPPORTED_MEDIA_TYPE => Self::NotJson { cause },
            StatusCode::UNPROCESSABLE_ENTITY => Self::Fields { cause },
            _ => Self::Unreadable { cause },
        }
    }
}

/// A `troupe node` argument that cannot be used, naming the flag and what to do.
#[derive(Debug, thiserror::Error)]
pub enum NodeArgError {
    /// No etcd endpoint.
    #[error("--etcd: no endpoint given; give host:port (or http://host:port), several separated by commas")]
    NoEtcdEndpoint,
    /// An etcd endpoint is not `host:port`.
    #[error("--etcd {endpoint:?}: {reason}; give host:port or http://host:port, several separated by commas")]
    EtcdEndpoint {
        /// The endpoint given.
        endpoint: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The lease is not whole seconds in the allowed range.
    #[error(
        "--lease-ttl-ms {value_ms}: the lease must be whole seconds from {NODE_LEASE_TTL_MS_MIN} to \
         {NODE_LEASE_TTL_MS_MAX} ms (etcd counts leases in seconds); give e.g. 5000"
    )]
    LeaseTtl {
        /// The value given, in milliseconds.
        value_ms: u64,
    },
    /// A name breaks the naming rules.
    #[error("{flag} {name:?}: {reason}")]
    Name {
        /// `--node-id` or `--cluster`.
        flag: &'static str,
        /// The name given.
        name: String,
        /// Which rule it breaks and what to use.
        reason: String,
    },
    /// The PostgreSQL connection string is empty.
    #[error("--postgres is empty: give a URL such as postgresql://user@host:5432/db")]
    NoPostgres,
    /// The HTTP address or token was refused (same rule as `troupe serve`).
    #[error("--http: {0}")]
    Http(#[from] troupe_server::ServeError),
    /// Another check of the etcd configuration failed.
    #[error("etcd configuration refused: {0}")]
    Etcd(troupe_etcd::ConfigError),
    /// The --config file cannot be read or is not a valid organisation (the error names
    /// the file, line, column and field).
    #[error("--config {0}")]
    Config(Box<troupe_agent::ConfigError>),
    /// The --config file declares no agent.
    #[error("--config {path}: the file declares no [[agents]]; declare at least one, or leave out --config")]
    ConfigNoAgents {
        /// The file.
        path: PathBuf,
    },
    /// The agents of the --config file cannot be built.
    #[error("--config {path}: the agents cannot be built: {cause}")]
    ConfigAgents {
        /// The file.
        path: PathBuf,
        /// Why.
        cause: Box<troupe_agent::AgentSystemError>,
    },
}

/// What `troupe node` runs, from checked arguments.
#[derive(Debug, Clone)]
pub struct NodePlan {
    /// The etcd configuration (endpoints, cluster, node, lease, request timeout).
    pub etcd: EtcdConfig,
    /// The transport's listen address.
    pub listen: SocketAddr,
    /// The PostgreSQL connection string.
    pub postgres: String,
    /// The HTTP address, if any.
    pub http: Option<SocketAddr>,
    /// The HTTP bearer token, if any.
    pub token: Option<String>,
    /// Whether commits are written to the fence log.
    pub fence_log_commits: bool,
    /// The organisation of --config (its agents are served), with its file.
    pub org: Option<(PathBuf, OrgConfig)>,
    /// HTTP requests handled at once (--concurrent-requests-max).
    pub concurrent_requests_max: usize,
    /// HTTP connections served at once (--max-connections).
    pub connections_max: usize,
    /// Whether the node takes a new lease after it lost its lease
    /// (--rejoin-after-lost-lease).
    pub rejoin_after_lost_lease: bool,
}

/// Checks `args` and builds the plan; nothing is started or connected.
///
/// # Errors
/// [`NodeArgError`] naming the flag and what to do.
pub fn plan(args: &NodeArgs) -> Result<NodePlan, NodeArgError> {
    let mut endpoints = Vec::new();
    for endpoint in &args.etcd {
        let trimmed = endpoint.trim();
        if trimmed.is_empty() {
            continue;
        }
        if trimmed.starts_with("https://") {
            return Err(NodeArgError::EtcdEndpoint {
                endpoint: endpoint.clone(),
                reason: "TLS to etcd is not supported",
            });
        }
        let address = trimmed.strip_prefix("http://").unwrap_or(trimmed).trim_end_matches('/');
        let port_ok = address
            .rsplit_once(':')
            .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
        if !port_ok || address.contains('/') {
            return Err(NodeArgError::EtcdEndpoint {
                endpoint: endpoint.clone(),
                reason: "not host:port",
            });
        }
        endpoints.push(address.to_string());
    }
    if endpoints.is_empty() {
        return Err(NodeArgError::NoEtcdEndpoint);
    }
    let ttl_ms = args.lease_ttl_ms;
    if !ttl_ms.is_multiple_of(1_000) || !(NODE_LEASE_TTL_MS_MIN..=NODE_LEASE_TTL_MS_MAX).contains(&ttl_ms) {
        return Err(NodeArgError::LeaseTtl { value_ms: ttl_ms });
    }
    let name = match &args.node_id {
        Some(name) => name.clone(),
        None => format!("node-{}", std::process::id()),
    };
    let node = NodeId::new(&name).map_err(|error| name_error("--node-id", &name, error))?;
    if args.postgres.trim().is_empty() {
        return Err(NodeArgError::NoPostgres);
    }
    let mut server = troupe_server::ServerConfig::default();
    // An empty token is refused as too short by `check_bind`, as `troupe serve`'s (until
    // 2026-12-06 it was taken as no token).
    let token = args.token.clone();
    if let Some(token) = &token {
        server = server.token(token.clone());
    }
    if let Some(http) = args.http {
        server.check_bind(http)?;
    }
    // The longest request the lease leaves room for (EtcdConfig::validate's rule).
    let request_max_ms = ttl_ms - ETCD_LEASE_EXPIRY_SLACK_MS - ttl_ms / u64::from(ETCD_KEEP_ALIVES_PER_TTL) - 1;
    let etcd = EtcdConfig::new(endpoints, args.cluster.clone(), node, String::new())
        .with_lease_ttl_s(ttl_ms / 1_000)
        .with_request_timeout_ms(NODE_ETCD_REQUEST_TIMEOUT_MS_MAX.min(request_max_ms));
    let org = match &args.config {
        Some(path) => {
            let config = OrgConfig::from_file(path).map_err(|error| NodeArgError::Config(Box::new(error)))?;
            check_agents(path, &config)?;
            Some((path.clone(), config))
        }
        None => None,
    };
    etcd.validate().map_err(|error| match error {
        troupe_etcd::ConfigError::BadName { ref name, .. } if *name == args.cluster => {
            name_error("--cluster", &args.cluster, error)
        }
        other => NodeArgError::Etcd(other),
    })?;
    Ok(NodePlan {
        etcd,
        listen: args.listen,
        postgres: args.postgres.clone(),
        http: args.http,
        token,
        fence_log_commits: args.fence_log_commits,
        org,
        // Within 1..=SERVER_CONCURRENT_REQUESTS_MAX: clap checked it.
        concurrent_requests_max: usize::try_from(args.concurrent_requests_max).unwrap_or(usize::MAX),
        // Within 1..=SERVER_CONNECTIONS_MAX: clap checked it.
        connections_max: usize::try_from(args.max_connections).unwrap_or(usize::MAX),
        rejoin_after_lost_lease: args.rejoin_after_lost_lease,
    })
}

/// Refuses a config that declares no agent: a node with `--config` serves agents.
fn check_agents(path: &std::path::Path, config: &OrgConfig) -> Result<(), NodeArgError> {
    if config.agents.is_empty() {
        return Err(NodeArgError::ConfigNoAgents {
            path: path.to_path_buf(),
        });
    }
    Ok(())
}

fn name_error(flag: &'static str, name: &str, error: troupe_etcd::ConfigError) -> NodeArgError {
    let reason = match error {
        troupe_etcd::ConfigError::BadName { reason, .. } => reason,
        other => other.to_string(),
    };
    NodeArgError::Name {
        flag,
        name: name.to_string(),
        reason,
    }
}

/// A request to a conversation actor (JSON).
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ConversationRequest {
    /// Append a message; the reply is `{"seq": N, "duplicate": false, "owner": NODE}`.
    /// With `id`, a resend of a remembered key with the same text is answered
    /// `{"seq": ORIGINAL, "duplicate": true, ...}` and stores nothing; with another text
    /// the reply is `{"conflict": {"id": ID, "seq": ORIGINAL}, "owner": NODE}`.
    Append {
        /// The message.
        text: String,
        /// The client's key of this message (see [`check_append_id`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<String>,
    },
    /// Read the messages after seq `after` (from the first if absent), at most
    /// [`CONVERSATION_READ_MESSAGES_MAX`] of them and [`CONVERSATION_READ_REPLY_BYTES_MAX`]
    /// bytes; the reply is `{"messages": [{"seq", "text"}], "next_after": SEQ | null,
    /// "owner": NODE}`, `next_after` the `after` of the next read when more may follow.
    Read {
        /// The seq the read starts after.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        after: Option<u64>,
    },
}

/// A conversation log: numbered messages, each an entry `msg/<seq>` written in the turn
/// that appends it; the snapshot is the last sequence number and the keys of the last
/// [`APPEND_IDS_REMEMBERED`] keyed appends with their sequence numbers.
struct Conversation {
    node: String,
    last_seq: u64,
    /// (key, seq), oldest first.
    ids: VecDeque<(String, u64)>,
}

/// The snapshot of a conversation with remembered keys (JSON). A conversation that
/// remembers no key saves only its last sequence number, in decimal, as logs stored
/// before append keys existed do.
#[derive(Serialize, Deserialize)]
struct ConversationSnapshot {
    last_seq: u64,
    #[serde(default)]
    ids: Vec<(String, u64)>,
}

impl Conversation {
    fn load(node: String, saved: Option<&[u8]>) -> Result<Self, ActorError> {
        let Some(bytes) = saved else {
            return Ok(Self {
                node,
                last_seq: 0,
                ids: VecDeque::new(),
            });
        };
        if let Some(last_seq) = std::str::from_utf8(bytes).ok().and_then(|text| text.parse().ok()) {
            return Ok(Self {
                node,
                last_seq,
                ids: VecDeque::new(),
            });
        }
        let snapshot: ConversationSnapshot = serde_json::from_slice(bytes).map_err(|error| {
            ActorError::failed(format!(
                "the saved conversation is neither a sequence number nor a snapshot: {error}"
            ))
        })?;
        Ok(Self {
            node,
            last_seq: snapshot.last_seq,
            ids: snapshot.ids.into(),
        })
    }
}

fn message_key(seq: u64) -> String {
    format!("msg/{seq:020}")
}

impl Actor for Conversation {
    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        let request: ConversationRequest = serde_json::from_slice(&payload)
            .map_err(|error| ActorError::rejected(format!("not a conversation request: {error}")))?;
        let reply = match request {
            ConversationRequest::Append { text, id } => {
                if text.len() > CONVERSATION_TEXT_BYTES_MAX {
                    return Err(ActorError::rejected(format!(
                        "the message is {} bytes; at most {CONVERSATION_TEXT_BYTES_MAX} are accepted",
                        text.len()
                    )));
                }
                if let Some(id) = &id {
                    check_append_id(id).map_err(|error| ActorError::rejected(error.to_string()))?;
                    if let Some(&(_, seq)) = self.ids.iter().find(|(known, _)| known == id) {
                        let stored = turn
                            .get(&message_key(seq))
                            .await
                            .map_err(|error| ActorError::failed(error.to_string()))?
                            .ok_or_else(|| {
                                ActorError::failed(format!("key {id:?} names message {seq}, which is not stored"))
                            })?;
                        let reply = if stored == text.as_bytes() {
                            json!({"seq": seq, "duplicate": true, "owner": self.node})
                        } else {
                            json!({"conflict": {"id": id, "seq": seq}, "owner": self.node})
                        };
                        return Ok(Bytes::from(reply.to_string()));
                    }
                }
                let seq = self.last_seq + 1;
                turn.put(message_key(seq), Bytes::from(text))
                    .map_err(|error| ActorError::failed(error.to_string()))?;
                self.last_seq = seq;
                if let Some(id) = id {
                    self.ids.push_back((id, seq));
                    while self.ids.len() > APPEND_IDS_REMEMBERED {
                        self.ids.pop_front();
                    }
                }
                json!({"seq": seq, "duplicate": false, "owner": self.node})
            }
            ConversationRequest::Read { after } => {
                let after_key = after.map(message_key);
                let entries = turn
                    .scan("msg/", after_key.as_deref(), CONVERSATION_READ_MESSAGES_MAX)
                    .await
                    .map_err(|error| ActorError::failed(error.to_string()))?;
                let full_page = entries.len() == CONVERSATION_READ_MESSAGES_MAX;
                let mut messages = Vec::with_capacity(entries.len());
                let (mut bytes, mut last, mut cut) = (0_usize, None, false);
                for (key, value) in entries {
                    let seq: u64 = key.trim_start_matches("msg/").parse().map_err(|_| {
                        ActorError::failed(format!("the conversation holds a key {key:?} that is not msg/<seq>"))
                    })?;
                    let message = json!({"seq": seq, "text": String::from_utf8_lossy(&value)});
                    let size = message.to_string().len();
                    if bytes + size > CONVERSATION_READ_REPLY_BYTES_MAX {
                        cut = true;
                        break;
                    }
                    bytes += size;
                    last = Some(seq);
                    messages.push(message);
                }
                // More may follow: the page stopped at its byte or message limit.
                let next_after = if cut || full_page { last } else { None };
                json!({"messages": messages, "next_after": next_after, "owner": self.node})
            }
        };
        Ok(Bytes::from(reply.to_string()))
    }

    fn snapshot(&self) -> Result<Option<Bytes>, ActorError> {
        if self.ids.is_empty() {
            return Ok(Some(Bytes::from(self.last_seq.to_string())));
        }
        let snapshot = ConversationSnapshot {
            last_seq: self.last_seq,
            ids: self.ids.iter().cloned().collect(),
        };
        let bytes = serde_json::to_vec(&snapshot).map_err(|error| ActorError::failed(error.to_string()))?;
        Ok(Some(Bytes::from(bytes)))
    }
}

/// A runtime builder with the conversation kind, whose replies name `node`.
///
/// # Errors
/// [`NodeError::Kind`] if the kind cannot be named or registered.
pub fn conversation_runtime(node: &str) -> Result<RuntimeBuilder, NodeError> {
    register_log_kind(Runtime::builder(), CONVERSATION_KIND, node)
}

/// `builder` with the conversation-log actor registered as `kind`, its replies naming
/// `node`.
///
/// # Errors
/// [`NodeError::Kind`] if the kind cannot be named or registered.
pub fn register_log_kind(builder: RuntimeBuilder, kind: &str, node: &str) -> Result<RuntimeBuilder, NodeError> {
    let node = node.to_string();
    let kind = ActorKind::new(kind).map_err(|error| NodeError::Kind(error.to_string()))?;
    let builder = builder.register(
        kind,
        move |_id: &ActorId, saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
            Ok(ActorBox::new(Conversation::load(node.clone(), saved.as_deref())?))
        },
        KindConfig::default(),
    );
    builder.map_err(|error| NodeError::Kind(error.to_string()))
}

#[derive(Clone)]
struct HttpState {
    client: ClusterClient,
    node: String,
    /// The conversation log's actor kind.
    kind: &'static str,
}

/// The places of the node's own HTTP requests: one per request handled at once.
#[derive(Clone)]
struct RequestPlaces {
    places: Arc<tokio::sync::Semaphore>,
    max: usize,
}

impl RequestPlaces {
    /// `max` places.
    ///
    /// # Panics
    /// If `max` is 0.
    fn new(max: usize) -> Self {
        assert!(max >= 1, "a node admits at least one request at once");
        Self {
            // No node reaches tokio's bound of permits (2^61) in requests at once.
            places: Arc::new(tokio::sync::Semaphore::new(
                max.min(tokio::sync::Semaphore::MAX_PERMITS),
            )),
            max,
        }
    }
}

/// Admits at most [`NodePlan::concurrent_requests_max`] requests at once, as `troupe
/// serve` does: one more is answered 503 with `Retry-After` at once, its body unread.
/// Runs before the body is read ([`troupe_server::read_body`]), so a request whose body
/// is slow holds its place at most `SERVER_REQUEST_BODY_READ_MS`, and after the token
/// check ([`authenticate`]), so a request without the token takes no place.
async fn limit_requests(
    State(places): State<RequestPlaces>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Ok(_place) = Arc::clone(&places.places).try_acquire_owned() else {
        return retry_response(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "the node is handling {} requests, its limit (--concurrent-requests-max); retry later",
                places.max
            ),
        );
    };
    next.run(request).await
}

/// Refuses a request without `Authorization: Bearer TOKEN` (the node's `--token`; the
/// scheme in any case), by `troupe serve`'s rule ([`troupe_server::bearer_credential`],
/// [`troupe_server::same_secret`]): 401 `{"error": ...}` at once, before the request
/// takes a place ([`limit_requests`]) and before its body is read, so a client without
/// the token makes the node neither read nor parse a body, nor wait for one. The refused
/// body is read and discarded afterwards, apart from the answer ([`authenticate_drain`]).
async fn authenticate(
    State(token): State<Arc<str>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let given = request
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(troupe_server::bearer_credential);
    if given.is_some_and(|given| troupe_server::same_secret(given.as_bytes(), token.as_bytes())) {
        return next.run(request).await;
    }
    tokio::spawn(authenticate_drain(request.into_body()));
    error_response(
        StatusCode::UNAUTHORIZED,
        "missing or wrong bearer token: send Authorization: Bearer TOKEN",
    )
}

/// Reads and discards a refused request's body, as `troupe serve` drains a refused body,
/// so that its client, still writing a body the node would take, gets the 401 rather
/// than a connection reset: at most [`NODE_HTTP_BODY_BYTES_MAX`] bytes (a body declared
/// longer is not read at all; one found longer is read no further) and for at most
/// `SERVER_REQUEST_BODY_DRAIN_MS`. It runs apart from the answer, which is sent at once,
/// and holds no place; once it stops, the connection closes if the body is not read
/// whole.
async fn authenticate_drain(body: axum::body::Body) {
    let declared = axum::body::HttpBody::size_hint(&body).lower();
    if declared > NODE_HTTP_BODY_BYTES_MAX as u64 {
        return;
    }
    let reading = axum::body::to_bytes(body, NODE_HTTP_BODY_BYTES_MAX);
    // A body over the limit, broken off or slower than the limit is only left unread.
    let _ = tokio::time::timeout(Duration::from_millis(SERVER_REQUEST_BODY_DRAIN_MS), reading).await;
}

/// The node's limits on its own routes, the same as `troupe serve`'s: at most
/// `places.max` requests at once ([`limit_requests`]), then the body read under
/// [`troupe_server::read_body`]'s rule (whole within `SERVER_REQUEST_BODY_READ_MS`, else
/// 408 `body_timeout`), then the node's own body limit ([`NODE_HTTP_BODY_BYTES_MAX`],
/// 413). With `token`, [`authenticate`] runs first, before all of them. Routers made
/// with one `places` share its places.
fn with_request_limits(
    routes: Router<HttpState>,
    places: &RequestPlaces,
    token: Option<&Arc<str>>,
) -> Router<HttpState> {
    // Layers run outside in: the last added runs first.
    let limited = routes
        .layer(axum::extract::DefaultBodyLimit::max(NODE_HTTP_BODY_BYTES_MAX))
        .layer(axum::middleware::from_fn(troupe_server::read_body))
        .layer(axum::middleware::from_fn_with_state(places.clone(), limit_requests));
    match token {
        Some(token) => limited.layer(axum::middleware::from_fn_with_state(Arc::clone(token), authenticate)),
        None => limited,
    }
}

#[derive(Deserialize)]
struct AppendBody {
    text: String,
    /// The client's key of the message (see [`check_append_id`]).
    #[serde(default)]
    id: Option<String>,
}

fn error_response(status: StatusCode, message: impl std::fmt::Display) -> Response {
    (status, Json(json!({"error": message.to_string()}))).into_response()
}

/// [`error_response`] with `Retry-After:` [`NODE_RETRY_AFTER_S`]: the client may send
/// it again.
fn retry_response(status: StatusCode, message: impl std::fmt::Display) -> Response {
    let mut response = error_response(status, message);
    response.headers_mut().insert(
        axum::http::header::RETRY_AFTER,
        axum::http::HeaderValue::from(NODE_RETRY_AFTER_S),
    );
    response
}

async fn call(state: &HttpState, id: &str, request: &ConversationRequest) -> Response {
    let actor = match ActorId::new(state.kind, id) {
        Ok(actor) => actor,
        Err(error) => return error_response(StatusCode::BAD_REQUEST, format!("conversation id {id:?}: {error}")),
    };
    let payload = match serde_json::to_vec(request) {
        Ok(payload) => Bytes::from(payload),
        Err(error) => return error_response(StatusCode::INTERNAL_SERVER_ERROR, error),
    };
    let deadline = state.client.deadline_in(Duration::from_millis(NODE_CALL_TIMEOUT_MS));
    match state.client.invoke(&actor, payload, deadline).await {
        Ok(reply) => match serde_json::from_slice::<serde_json::Value>(&reply) {
            Ok(value) if value.get("conflict").is_some() => {
                let conflict = &value["conflict"];
                let message = format!(
                    "id {} was already used for message {} with another text; a new message needs a new id",
                    conflict["id"], conflict["seq"]
                );
                let body = json!({
                    "error": message,
                    "id": conflict["id"],
                    "seq": conflict["seq"],
                    "owner": value["owner"],
                    "via": state.node,
                });
                (StatusCode::CONFLICT, Json(body)).into_response()
            }
            Ok(mut value) => {
                value["via"] = json!(state.node);
                (StatusCode::OK, Json(value)).into_response()
            }
            Err(error) => error_response(StatusCode::INTERNAL_SERVER_ERROR, error),
        },
        Err(error) => invoke_error_response(error),
    }
}

/// The answer to a conversation call that failed with `error`: what went wrong, and
/// whether (and when: `Retry-After`) the client may send it again.
fn invoke_error_response(error: InvokeError) -> Response {
    match error {
        error @ InvokeError::Rejected { .. } => error_response(StatusCode::BAD_REQUEST, error),
        error @ InvokeError::Timeout { .. } => error_response(StatusCode::GATEWAY_TIMEOUT, error),
        // The owner died mid-call: the message may or may not be stored; the client
        // decides whether to send it again.
        error @ InvokeError::Unreachable { .. } => error_response(StatusCode::SERVICE_UNAVAILABLE, error),
        // The store failed: answered as `troupe serve` answers it (its error shape,
        // `{"error": {"code", "message"}}`): a store down for a moment 503
        // `storage_unavailable` with `Retry-After` (nothing was committed: send it
        // again), any other store failure 500 `storage_failed`. Until 2026-12-07 both
        // were 503 `{"error": "..."}` without `Retry-After`.
        ref error @ InvokeError::StorageFailed { .. } => troupe_server::ApiError::from(error).into_response(),
        // The conversation's mailbox is full: nothing was stored; send it again later.
        error @ InvokeError::Busy { .. } => retry_response(StatusCode::TOO_MANY_REQUESTS, error),
        // The runtime is overloaded or stopping, or the owner's transport connection
        // from this node is at its most requests: the client may send it again (with
        // an id, an append is stored once).
        error @ (InvokeError::DispatcherBusy { .. } | InvokeError::ConnectionBusy { .. } | InvokeError::Shutdown) => {
            retry_response(StatusCode::SERVICE_UNAVAILABLE, error)
        }
        error => error_response(StatusCode::INTERNAL_SERVER_ERROR, error),
    }
}

async fn append(
    State(state): State<HttpState>,
    Path(id): Path<String>,
    body: Result<Json<AppendBody>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let Json(body) = match body {
        Ok(body) => body,
        Err(rejection) => {
            let error = AppendBodyError::of_rejection(&rejection);
            return error_response(error.status(), error);
        }
    };
    if body.text.len() > CONVERSATION_TEXT_BYTES_MAX {
        let error = AppendBodyError::TextTooLong { bytes: body.text.len() };
        return error_response(error.status(), error);
    }
    if let Some(key) = &body.id {
        if let Err(error) = check_append_id(key) {
            let body = json!({"error": error.to_string(), "field": "id"});
            return (StatusCode::UNPROCESSABLE_ENTITY, Json(body)).into_response();
        }
    }
    let request = ConversationRequest::Append {
        text: body.text,
        id: body.id,
    };
    call(&state, &id, &request).await
}

/// The query of a read: `?after=SEQ`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReadQuery {
    after: Option<u64>,
}

async fn read(
    State(state): State<HttpState>,
    Path(id): Path<String>,
    query: Result<Query<ReadQuery>, QueryRejection>,
) -> Response {
    let Query(query) = match query {
        Ok(query) => query,
        Err(rejection) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                format!("the query may hold after=SEQ (a message's seq, from next_after) only: {rejection}"),
            )
        }
    };
    call(&state, &id, &ConversationRequest::Read { after: query.after }).await
}

async fn health(State(state): State<HttpState>) -> Response {
    (StatusCode::OK, Json(json!({"status": "ok", "node": state.node}))).into_response()
}

/// The node's HTTP API: `GET /health`, `POST` and `GET /v1/conversations/{id}/messages`
/// (a read is one page: `?after=SEQ` reads on from the reply's `next_after`), at most
/// `concurrent_requests_max` requests at once, each body read under `troupe serve`'s
/// rule (see [`with_request_limits`]). With `token`, the conversations answer only
/// requests that carry it, checked first ([`authenticate`]); `GET /health` never needs
/// it.
///
/// # Panics
/// If `concurrent_requests_max` is 0.
pub fn router(client: ClusterClient, token: Option<String>, concurrent_requests_max: usize) -> Router {
    let state = HttpState {
        node: client.node().to_string(),
        client,
        kind: CONVERSATION_KIND,
    };
    let token: Option<Arc<str>> = token.map(Arc::from);
    let places = RequestPlaces::new(concurrent_requests_max);
    let conversations = Router::new().route("/v1/conversations/{id}/messages", get(read).post(append));
    let health = Router::new().route("/health", get(health));
    with_request_limits(conversations, &places, token.as_ref())
        .merge(with_request_limits(health, &places, None))
        .with_state(state)
}

/// The HTTP API of a node that serves agents (`--config`): `troupe serve`'s API over
/// `agents` ([`troupe_server::router`], with `token` if given; its `GET /health`), and
/// the conversation logs (kind [`LOG_KIND_WITH_AGENTS`]) at `POST` and
/// `GET /v1/logs/{id}/messages`.
/// With `placement`, an A2A request for an agent whose A2A tasks another node holds is
/// forwarded to the HTTP address that node published in etcd
/// ([`troupe_etcd::EtcdPlacement::publish_http`]). The logs' routes admit at most
/// `concurrent_requests_max` requests at once, and so do the agents' (each its own
/// limit); every body is read under `troupe serve`'s rule.
///
/// # Panics
/// If `concurrent_requests_max` is 0.
pub fn agents_router(
    client: ClusterClient,
    agents: AgentClient,
    token: Option<String>,
    placement: Option<EtcdPlacement>,
    concurrent_requests_max: usize,
) -> Router {
    // A2A tasks are numbered in this node's own space (`ServerConfig::node`).
    let mut config = troupe_server::ServerConfig::default()
        .node(client.node().to_string())
        .concurrent_requests_max(concurrent_requests_max)
        // The log queue of `troupe node` (none in a test that builds this router: 0).
        .log_lines_dropped(Arc::new(crate::log_lines::stderr_lines_dropped));
    if let Some(placement) = placement {
        config = config.peers(Arc::new(EtcdPeers(placement)));
    }
    if let Some(token) = &token {
        config = config.token(token.clone());
    }
    let state = HttpState {
        node: client.node().to_string(),
        client,
        kind: LOG_KIND_WITH_AGENTS,
    };
    let token: Option<Arc<str>> = token.map(Arc::from);
    let places = RequestPlaces::new(concurrent_requests_max);
    let logs = Router::new().route("/v1/logs/{id}/messages", get(read).post(append));
    let logs = with_request_limits(logs, &places, token.as_ref()).with_state(state);
    logs.merge(troupe_server::router(agents, config))
}

/// The HTTP addresses the cluster's nodes published in etcd.
struct EtcdPeers(EtcdPlacement);

impl troupe_server::PeerAddresses for EtcdPeers {
    fn http_address<'a>(
        &'a self,
        node: &'a str,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Option<String>> + Send + 'a>> {
        Box::pin(async move {
            let node = NodeId::new(node).ok()?;
            match self.0.http_address(&node).await {
                Ok(address) => address,
                Err(error) => {
                    tracing::warn!(%node, %error, "reading a node's HTTP address from etcd failed");
                    None
                }
            }
        })
    }
}

/// Why `troupe node` stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// A flag was refused.
    #[error(transparent)]
    Args(#[from] NodeArgError),
    /// The PostgreSQL store could not be opened. Until 2026-12-07 the message ended
    /// with the server's error and said nothing of what to do.
    #[error(
        "cannot open the PostgreSQL store given by --postgres: {0}; check that PostgreSQL runs at the \
         address --postgres gives and that its role and database exist (troupe creates its tables, not the \
         database), then start the node again"
    )]
    Postgres(troupe_core::StoreError),
    /// The actor kinds could not be registered.
    #[error("cannot register the conversation kind: {0}")]
    Kind(String),
    /// The agents could not be attached to the node's runtime.
    #[error("cannot attach the agents to the node: {0}")]
    Attach(troupe_agent::AgentSystemError),
    /// The organisation of --config could not be written to the store.
    #[error("--config {}: the organisation could not be written to the store: {cause}", path.display())]
    Org {
        /// The file.
        path: PathBuf,
        /// Why (boxed: `OrgError` is large, and every `NodeError` would carry its size).
        cause: Box<troupe_agent::OrgError>,
    },
    /// The node could not start or join.
    #[error("cannot start the node (--listen, --etcd): {0}")]
    Cluster(#[from] troupe_cluster::ClusterError),
    /// No etcd answered while the node joined the cluster: nothing listens at --etcd,
    /// what listens there is not etcd, or it did not answer within the request timeout.
    /// Until 2026-12-07 this was [`NodeError::Cluster`], whose message named the
    /// endpoint and the transport error but not what to do.
    #[error(
        "--etcd {endpoints}: no etcd answered as the node joined the cluster ({cause}); check that etcd runs \
         there and that --etcd gives its client address (host:port; etcd serves clients on port 2379 by \
         default), then start the node again"
    )]
    EtcdUnreachable {
        /// The endpoints given, comma-separated.
        endpoints: String,
        /// The join's error.
        cause: troupe_etcd::PlacementError,
    },
    /// `flag`'s address (`--listen`, `--http`) could not be listened on; the message
    /// says what to do. Until 2026-12-06 a taken port read "--http ADDR: Address already
    /// in use (os error 98)", or for --listen "cannot start the node (--listen, --etcd):
    /// cannot listen on ADDR: ...".
    #[error("{}", crate::listen_refusal(flag, *address, cause))]
    Bind {
        /// The flag that gave the address.
        flag: &'static str,
        /// The address.
        address: SocketAddr,
        /// The operating system's error.
        cause: std::io::Error,
    },
    /// The HTTP address could not be served.
    #[error("--http {address}: {cause}")]
    Http {
        /// The address.
        address: SocketAddr,
        /// What failed.
        cause: std::io::Error,
    },
    /// A second stop signal came while the node stopped gracefully: it stopped at once.
    #[error(
        "stopped by a second signal: the requests in flight were cut (a turn commits whole or not at all); \
         what was acknowledged before is kept"
    )]
    SecondSignal,
    /// The node's etcd lease ended: it owns nothing any more.
    #[error(
        "the node's etcd lease was lost ({0:?}): it owns nothing now; start the node again (with \
         --rejoin-after-lost-lease it takes a new lease by itself)"
    )]
    LeaseLost(troupe_etcd::LeaseLostReason),
    /// The node's etcd lease ended and, with --rejoin-after-lost-lease, it could not take
    /// a new one: it owns nothing any more.
    #[error(
        "the node's etcd lease was lost ({0:?}) and it took no new one (a live node took its name, or etcd did not \
         answer for {attempts} attempts {pause_ms} ms apart): it owns nothing now; start the node again",
        attempts = troupe_cluster::REJOIN_ATTEMPTS_MAX,
        pause_ms = troupe_cluster::REJOIN_RETRY_PAUSE_MS
    )]
    RejoinGaveUp(troupe_etcd::LeaseLostReason),
}

/// Logs a warning line each time the node's lease is lost and a line once it holds a new
/// one (a node with `--rejoin-after-lost-lease`), until aborted.
async fn log_lease_losses(placement: EtcdPlacement) {
    loop {
        let reason = placement.lease_lost().await;
        tracing::warn!(
            ?reason,
            "troupe node: the etcd lease was lost: every actor of this node stops, then it takes a new lease \
             (--rejoin-after-lost-lease)"
        );
        while !placement.holds_lease() {
            tokio::time::sleep(Duration::from_millis(NODE_REJOIN_WATCH_MS)).await;
        }
        tracing::warn!("troupe node: rejoined the cluster with a new etcd lease: serving again");
    }
}

/// Aborts its task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Runs a node from `args` until `shutdown` completes (then it lets the HTTP requests in
/// flight finish and leaves the cluster) or its lease is lost (an error). If `stop_now`
/// completes while it stops so (a second SIGTERM or ctrl-c), it cuts the requests in
/// flight, gives its turns [`crate::SERVE_SECOND_SIGNAL_SHUTDOWN_WAIT_MS`] to end and
/// returns [`NodeError::SecondSignal`], as `troupe serve` does. If `shutdown` completes
/// before the node serves, it stops where it is: at once while it connects to
/// PostgreSQL, within [`NODE_JOIN_STOP_WAIT_MS`] while it joins the cluster (leaving it
/// if the join ends meanwhile), and returns `Ok` saying so on stderr; until 2026-12-06 a
/// signal then was acted on only once the node served (after PostgreSQL's 10 s connect
/// timeout, or etcd's request timeout, it exited 1). Prints `node NAME transport ADDR` and, with --http,
/// `listening on http://ADDR` once it serves. With --config, the agents think with
/// `model`, or with the scripted model of `troupe serve --config`
/// ([`crate::org_demo_script`]) if it is `None`.
///
/// # Errors
/// [`NodeError`] naming what failed.
pub async fn run_node(
    args: &NodeArgs,
    model: Option<Arc<dyn LlmClient>>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    stop_now: impl std::future::Future<Output = ()> + Send,
) -> Result<(), NodeError> {
    use futures::FutureExt as _;

    let mut stop_now = std::pin::pin!(stop_now);
    // Watched from the start (while the node connects) and then by the HTTP server.
    let shutdown: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> = Box::pin(shutdown);
    let shutdown = shutdown.shared();

    let plan = plan(args)?;
    let node_name = plan.etcd.node.to_string();
    let connect = async {
        let store = troupe_postgres::PostgresStore::connect(&plan.postgres)
            .await
            .map_err(NodeError::Postgres)?
            .with_holder(node_name.clone())
            .map_err(|error| NodeError::Postgres(error.into()))?
            .with_commit_log(plan.fence_log_commits);
        // The cluster name is bound to this database on etcd: a node of another
        // deployment (another database) under the same cluster name is refused
        // `StoreMismatch`.
        let identity = store.identity().await.map_err(NodeError::Postgres)?;
        Ok::<_, NodeError>((store, identity))
    };
    // Nothing is registered anywhere yet: a signal stops the node at once.
    let (store, identity) = tokio::select! {
        biased;
        () = shutdown.clone() => {
            crate::errln!(
                "troupe node: a signal before it joined the cluster (while it connected to PostgreSQL): stopped"
            );
            return Ok(());
        }
        connected = connect => connected?,
    };
    let etcd = plan.etcd.clone().with_store_identity(identity);
    let (runtime, pending) = match &plan.org {
        None => (conversation_runtime(&node_name)?, None),
        Some((path, org)) => {
            let logs = register_log_kind(Runtime::builder(), LOG_KIND_WITH_AGENTS, &node_name)?;
            // A node runs for long: the scripted model keeps no requests (as `troupe serve`).
            let model = model.unwrap_or_else(|| Arc::new(crate::org_demo_script().without_recording()));
            let mut builder = AgentSystem::builder().runtime(logs).llm(model);
            for spec in org.agent_specs() {
                builder = builder.agent(spec);
            }
            for remote in org.remote_agent_list() {
                builder = builder.remote_agent(remote);
            }
            let (runtime, pending) = builder.prepare().map_err(|cause| NodeArgError::ConfigAgents {
                path: path.clone(),
                cause: Box::new(cause),
            })?;
            (runtime, Some(pending))
        }
    };
    let http = match plan.http {
        Some(address) => Some(
            tokio::net::TcpListener::bind(address)
                .await
                .map_err(|cause| NodeError::Bind {
                    flag: "--http",
                    address,
                    cause,
                })?,
        ),
        None => None,
    };
    let start = ClusterNode::start(etcd, plan.listen, runtime, store);
    let mut start = std::pin::pin!(start);
    let started = tokio::select! {
        biased;
        () = shutdown.clone() => None,
        started = &mut start => Some(started),
    };
    let Some(started) = started else {
        return stop_while_joining(start, stop_now).await;
    };
    let node = started.map_err(|error| match error {
        troupe_cluster::ClusterError::Listen { address, cause } => NodeError::Bind {
            flag: "--listen",
            address,
            cause,
        },
        troupe_cluster::ClusterError::Join(cause @ troupe_etcd::PlacementError::EtcdUnavailable { .. }) => {
            NodeError::EtcdUnreachable {
                endpoints: plan.etcd.endpoints.join(","),
                cause,
            }
        }
        error => NodeError::Cluster(error),
    })?;
    // Off by default: a lost lease then ends the node (`fenced_off` below).
    node.rejoin_after_a_lost_lease(plan.rejoin_after_lost_lease);
    let _rejoin_lines = plan
        .rejoin_after_lost_lease
        .then(|| AbortOnDrop(tokio::spawn(log_lease_losses(node.placement().clone()))));
    let agents = match pending {
        Some(pending) => {
            let applied = match pending.attach(node.handle().clone()) {
                Ok(agents) => match &plan.org {
                    // Every node writes the file's organisation: the same file gives the
                    // same record, whichever node writes last.
                    Some((path, org)) => match agents.store_config(org).await {
                        Ok(()) => Ok(agents),
                        Err(cause) => Err(NodeError::Org {
                            path: path.clone(),
                            cause: Box::new(cause),
                        }),
                    },
                    None => Ok(agents),
                },
                Err(error) => Err(NodeError::Attach(error)),
            };
            match applied {
                Ok(agents) => Some(agents),
                Err(error) => {
                    if let Err(error) = node.leave().await {
                        tracing::warn!(%error, "leaving the cluster failed; the lease ends by itself");
                    }
                    return Err(error);
                }
            }
        }
        None => None,
    };
    // Pending entries of an agent whose node died, which no request reaches, are taken
    // over once that node's lease has ended (stopped when the node stops).
    let _resume_sweep = agents.as_ref().map(|agents| {
        agents
            .start_resume_sweep(Duration::from_millis(AGENT_RESUME_SWEEP_MS_DEFAULT))
            .expect("AGENT_RESUME_SWEEP_MS_DEFAULT is in range")
    });
    crate::outln!(
        "node {node_name} transport {} cluster {} lease {} ms{}",
        node.address(),
        plan.etcd.cluster,
        args.lease_ttl_ms,
        match &plan.org {
            Some((path, org)) => format!(", {} agents from {}", org.agents.len(), path.display()),
            None => String::new(),
        }
    );
    let served = async {
        match http {
            Some(listener) => {
                let asked = plan.http.unwrap_or(plan.listen);
                let address = listener
                    .local_addr()
                    .map_err(|cause| NodeError::Http { address: asked, cause })?;
                if address.ip().is_unspecified() {
                    tracing::warn!(
                        %address,
                        "--http binds every interface: this node publishes no HTTP address, so other nodes \
                         do not forward A2A requests here (they refuse them, naming this node); bind one address"
                    );
                } else {
                    // Other nodes forward A2A requests for the agents whose tasks this
                    // node holds here.
                    node.placement()
                        .publish_http(&address.to_string())
                        .await
                        .map_err(|error| NodeError::Http {
                            address,
                            cause: std::io::Error::other(format!("publishing it in etcd failed: {error}")),
                        })?;
                }
                // A line (stdout is line-buffered): no flush, which would wait for the
                // queue's writer while it waits for a reader.
                crate::outln!("listening on http://{address}");
                let app = match &agents {
                    Some(agents) => agents_router(
                        node.client(),
                        agents.clone(),
                        plan.token.clone(),
                        Some(node.placement().clone()),
                        plan.concurrent_requests_max,
                    ),
                    None => router(node.client(), plan.token.clone(), plan.concurrent_requests_max),
                };
                // As `troupe serve`: hyper's header read timeout and the connection cap in
                // force.
                troupe_server::serve_http(listener, app, shutdown.clone(), plan.connections_max)
                    .await
                    .map_err(|cause| NodeError::Http { address, cause })
            }
            None => {
                shutdown.clone().await;
                Ok(())
            }
        }
    };
    let mut outcome = tokio::select! {
        biased;
        reason = node.fenced_off() => Err(if plan.rejoin_after_lost_lease {
            NodeError::RejoinGaveUp(reason)
        } else {
            NodeError::LeaseLost(reason)
        }),
        served = served => served,
        () = &mut stop_now => Err(NodeError::SecondSignal),
    };
    // Until 2026-12-06 a second signal was ignored: the node waited for the requests in
    // flight without bound, then for its turns.
    let stopping_now = matches!(outcome, Err(NodeError::SecondSignal));
    if stopping_now {
        crate::errln!("troupe node: a second signal: stopping now, without waiting for the requests in flight");
    }
    let wait = Duration::from_millis(crate::SERVE_SECOND_SIGNAL_SHUTDOWN_WAIT_MS);
    let cut = async {
        if !stopping_now {
            (&mut stop_now).await;
            crate::errln!("troupe node: a second signal: stopping now, without waiting for the turns running");
        }
        tokio::time::sleep(wait).await;
    };
    // Leaving saves the actors (it waits for the turns running): past the wait it is
    // dropped half-way, as a crash (a turn commits whole or not at all; the lease ends
    // by itself).
    let left = tokio::select! {
        biased;
        left = node.leave() => Some(left),
        () = cut => None,
    };
    match left {
        Some(Ok(())) => {}
        Some(Err(error)) => tracing::warn!(%error, "leaving the cluster failed; the lease ends by itself"),
        None => {
            crate::errln!(
                "troupe node: turns still running after {} ms were cut (a turn commits whole or not at all); its \
                 lease ends by itself",
                crate::SERVE_SECOND_SIGNAL_SHUTDOWN_WAIT_MS
            );
            if outcome.is_ok() {
                outcome = Err(NodeError::SecondSignal);
            }
        }
    }
    outcome
}

/// A signal came while the node joined the cluster: the join goes on for up to
/// [`NODE_JOIN_STOP_WAIT_MS`] (each etcd request is bounded by its timeout), so that a
/// join that ends is left at once, its lease revoked, rather than leave a membership
/// record behind for a whole lease; past it the join is cut. `Ok`: the node stopped as
/// asked; [`NodeError::SecondSignal`] if `stop_now` (a second signal) cut the join or
/// the leave, as a second signal does once the node serves (exit 1).
async fn stop_while_joining(
    start: std::pin::Pin<&mut impl std::future::Future<Output = Result<ClusterNode, troupe_cluster::ClusterError>>>,
    stop_now: std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
) -> Result<(), NodeError> {
    /// How a wait bounded by [`NODE_JOIN_STOP_WAIT_MS`] and a second signal ended.
    enum Waited<T> {
        Ended(T),
        TimedOut,
        SecondSignal,
    }
    let wait = Duration::from_millis(NODE_JOIN_STOP_WAIT_MS);
    let mut stop_now = stop_now;
    let joined = tokio::select! {
        biased;
        () = &mut stop_now => Waited::SecondSignal,
        joined = tokio::time::timeout(wait, start) => joined.map_or(Waited::TimedOut, Waited::Ended),
    };
    let node = match joined {
        Waited::Ended(Ok(node)) => node,
        Waited::Ended(Err(error)) => {
            crate::errln!("troupe node: a signal before it joined the cluster (the join failed: {error}): stopped");
            return Ok(());
        }
        Waited::TimedOut => {
            crate::errln!(
                "troupe node: a signal while it joined the cluster: the join was cut after {NODE_JOIN_STOP_WAIT_MS} \
                 ms; a lease it may hold ends by itself within --lease-ttl-ms: stopped"
            );
            return Ok(());
        }
        Waited::SecondSignal => {
            crate::errln!(
                "troupe node: a second signal while it joined the cluster: the join was cut; a lease it may hold \
                 ends by itself within --lease-ttl-ms"
            );
            return Err(NodeError::SecondSignal);
        }
    };
    let left = tokio::select! {
        biased;
        () = &mut stop_now => Waited::SecondSignal,
        left = tokio::time::timeout(wait, node.leave()) => left.map_or(Waited::TimedOut, Waited::Ended),
    };
    match left {
        Waited::Ended(Ok(())) => {
            crate::errln!("troupe node: a signal while it joined the cluster: it joined, then left at once: stopped");
        }
        Waited::Ended(Err(error)) => crate::errln!(
            "troupe node: a signal while it joined the cluster: leaving failed ({error}); its lease ends by itself: \
             stopped"
        ),
        Waited::TimedOut => crate::errln!(
            "troupe node: a signal while it joined the cluster: leaving was cut; its lease ends by itself: stopped"
        ),
        Waited::SecondSignal => {
            crate::errln!(
                "troupe node: a second signal while it left the cluster it had just joined: leaving was cut; its \
                 lease ends by itself"
            );
            return Err(NodeError::SecondSignal);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::{Cli, Command};

    fn args(extra: &[&str]) -> NodeArgs {
        let mut argv = vec![
            "troupe",
            "node",
            "--etcd",
            "127.0.0.1:2379",
            "--postgres",
            "host=127.0.0.1",
            "--listen",
            "127.0.0.1:0",
        ];
        argv.extend_from_slice(extra);
        match Cli::try_parse_from(argv).unwrap().command {
            Command::Node(args) => args,
            other => panic!("not node: {other:?}"),
        }
    }

    #[test]
    fn good_arguments_give_a_plan_with_a_request_timeout_the_lease_allows() {
        let mut given = args(&["--lease-ttl-ms", "3000", "--node-id", "a.1"]);
        given.etcd = vec!["http://127.0.0.1:2379/".to_string(), "h:1".to_string()];
        let short = plan(&given).unwrap();
        assert_eq!(short.etcd.endpoints, vec!["127.0.0.1:2379", "h:1"]);
        assert_eq!(short.etcd.lease_ttl_s, 3);
        assert_eq!(short.etcd.node.as_str(), "a.1");
        assert!(short.etcd.request_timeout_ms < NODE_ETCD_REQUEST_TIMEOUT_MS_MAX);
        let default = plan(&args(&[])).unwrap();
        assert_eq!(default.etcd.request_timeout_ms, NODE_ETCD_REQUEST_TIMEOUT_MS_MAX);
        assert!(default.etcd.node.as_str().starts_with("node-"));
    }

    #[test]
    fn bad_arguments_are_refused_naming_the_flag() {
        let cases: [(&[&str], &str); 5] = [
            (&["--lease-ttl-ms", "2500"], "--lease-ttl-ms 2500"),
            (&["--lease-ttl-ms", "1000"], "--lease-ttl-ms 1000"),
            (&["--node-id", "a/b"], "--node-id \"a/b\""),
            (&["--cluster", "x y"], "--cluster \"x y\""),
            (&["--http", "0.0.0.0:80"], "--token"),
        ];
        for (extra, expected) in cases {
            let error = plan(&args(extra)).expect_err("refused");
            assert!(error.to_string().contains(expected), "{extra:?}: {error}");
        }
        for (endpoint, expected) in [
            ("https://e:2379", "--etcd \"https://e:2379\": TLS"),
            ("etcd-without-port", "--etcd \"etcd-without-port\": not host:port"),
        ] {
            let mut given = args(&[]);
            given.etcd = vec![endpoint.to_string()];
            let error = plan(&given).expect_err("refused");
            assert!(error.to_string().contains(expected), "{endpoint}: {error}");
        }
        let mut no_endpoint = args(&[]);
        no_endpoint.etcd = vec![" ".to_string()];
        assert!(matches!(plan(&no_endpoint), Err(NodeArgError::NoEtcdEndpoint)));
        // A token lets the node serve every interface.
        assert!(plan(&args(&["--http", "0.0.0.0:80", "--token", "0123456789abcdef"])).is_ok());
    }

    #[test]
    fn a_config_without_agents_is_refused_and_one_with_an_organisation_passes() {
        let path = std::path::Path::new("org.toml");
        let config = |text: &str| OrgConfig::from_toml(text, path).unwrap();
        let organisation = concat!(
            "policy = \"enforced\"\n[[agents]]\nid = \"a\"\n[[agents]]\nid = \"b\"\nmanager = \"a\"\n",
            "[[links]]\nfrom = \"a\"\nto = \"b\"\n",
            "[[permissions]]\nagent = \"a\"\ntarget = \"b\"\neffect = \"deny\"\n"
        );
        assert!(check_agents(path, &config(organisation)).is_ok());
        let error = check_agents(path, &config("")).expect_err("no agents");
        assert!(error.to_string().contains("declares no [[agents]]"), "{error}");
    }

    /// A runtime with the conversation kind on `store`.
    fn log_runtime(store: &Arc<troupe_runtime::MemoryStore>) -> Runtime {
        let store: Arc<dyn troupe_runtime::StateStore> = store.clone();
        conversation_runtime("n").unwrap().store(store).start()
    }

    async fn send(runtime: &Runtime, request: &ConversationRequest) -> Result<serde_json::Value, InvokeError> {
        let handle = runtime.handle();
        let actor = ActorId::new(CONVERSATION_KIND, "c").unwrap();
        let payload = Bytes::from(serde_json::to_vec(request).unwrap());
        let reply = handle
            .invoke(&actor, payload, handle.deadline_in(Duration::from_secs(5)))
            .await?;
        Ok(serde_json::from_slice(&reply).unwrap())
    }

    fn keyed(text: &str, id: &str) -> ConversationRequest {
        ConversationRequest::Append {
            text: text.to_string(),
            id: Some(id.to_string()),
        }
    }

    async fn texts(runtime: &Runtime) -> Vec<(u64, String)> {
        let reply = send(runtime, &ConversationRequest::Read { after: None }).await.unwrap();
        reply["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| (m["seq"].as_u64().unwrap(), m["text"].as_str().unwrap().to_string()))
            .collect()
    }

    #[tokio::test]
    async fn a_resent_key_is_answered_with_its_sequence_number_and_stored_once_across_activations() {
        let store = Arc::new(troupe_runtime::MemoryStore::new());
        let runtime = log_runtime(&store);
        let first = send(&runtime, &keyed("hello", "k-1")).await.unwrap();
        assert_eq!(
            (first["seq"].as_u64(), first["duplicate"].as_bool()),
            (Some(1), Some(false))
        );
        let plain = ConversationRequest::Append {
            text: "no key".to_string(),
            id: None,
        };
        assert_eq!(send(&runtime, &plain).await.unwrap()["seq"], 2);
        let again = send(&runtime, &keyed("hello", "k-1")).await.unwrap();
        assert_eq!(
            (again["seq"].as_u64(), again["duplicate"].as_bool()),
            (Some(1), Some(true))
        );
        // Keys are committed state: a new activation (another node after a crash) knows them.
        runtime.shutdown().await;
        let runtime = log_runtime(&store);
        let later = send(&runtime, &keyed("hello", "k-1")).await.unwrap();
        assert_eq!(
            (later["seq"].as_u64(), later["duplicate"].as_bool()),
            (Some(1), Some(true))
        );
        assert_eq!(send(&runtime, &keyed("next", "k-2")).await.unwrap()["seq"], 3);
        assert_eq!(
            texts(&runtime).await,
            vec![
                (1, "hello".to_string()),
                (2, "no key".to_string()),
                (3, "next".to_string())
            ]
        );
        runtime.shutdown().await;
    }

    /// Concurrent sends of one key (a client resending while its first attempt still
    /// runs): one stores, every other answers the same seq as a duplicate.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_sends_of_one_key_store_it_once() {
        const SENDERS: usize = 16;
        let store = Arc::new(troupe_runtime::MemoryStore::new());
        let runtime = Arc::new(log_runtime(&store));
        let mut tasks = Vec::new();
        for round in 0..3 {
            for _ in 0..SENDERS {
                let runtime = Arc::clone(&runtime);
                tasks.push(tokio::spawn(async move {
                    let id = format!("k{round}");
                    send(&runtime, &keyed(&format!("m{round}"), &id)).await.unwrap()
                }));
            }
        }
        let mut replies = Vec::new();
        for task in tasks {
            replies.push(task.await.unwrap());
        }
        for round in 0..3 {
            let of_round = &replies[round * SENDERS..(round + 1) * SENDERS];
            let stored = of_round.iter().filter(|reply| reply["duplicate"] == false).count();
            assert_eq!(stored, 1, "round {round}: {of_round:?}");
            let seq = &of_round[0]["seq"];
            assert!(of_round.iter().all(|reply| reply["seq"] == *seq), "{of_round:?}");
        }
        let mut stored = texts(&runtime).await;
        stored.sort_by(|a, b| a.1.cmp(&b.1));
        assert_eq!(
            stored.iter().map(|(_, text)| text.as_str()).collect::<Vec<_>>(),
            vec!["m0", "m1", "m2"]
        );
        Arc::try_unwrap(runtime)
            .ok()
            .expect("every sender is done")
            .shutdown()
            .await;
    }

    #[tokio::test]
    async fn a_resent_key_with_another_text_is_a_conflict_naming_the_key_and_stores_nothing() {
        let store = Arc::new(troupe_runtime::MemoryStore::new());
        let runtime = log_runtime(&store);
        send(&runtime, &keyed("hello", "k-1")).await.unwrap();
        let conflict = send(&runtime, &keyed("changed", "k-1")).await.unwrap();
        assert_eq!(conflict["conflict"], json!({"id": "k-1", "seq": 1}), "{conflict}");
        assert!(conflict.get("seq").is_none(), "{conflict}");
        assert_eq!(texts(&runtime).await, vec![(1, "hello".to_string())]);
        // A bad key sent straight to the actor is refused too.
        let error = send(&runtime, &keyed("x", "a b")).await.expect_err("bad key");
        assert!(matches!(error, InvokeError::Rejected { .. }), "{error}");
        assert!(error.to_string().contains("id holds ' '"), "{error}");
        runtime.shutdown().await;
    }

    #[tokio::test]
    async fn the_oldest_key_is_forgotten_first_past_the_window() {
        let store = Arc::new(troupe_runtime::MemoryStore::new());
        let runtime = log_runtime(&store);
        for index in 0..=APPEND_IDS_REMEMBERED {
            let reply = send(&runtime, &keyed(&format!("m{index}"), &format!("k{index}")))
                .await
                .unwrap();
            assert_eq!(reply["seq"], index as u64 + 1);
        }
        // k0 fell out of the window: its resend is stored again, as a new message.
        let forgotten = send(&runtime, &keyed("m0", "k0")).await.unwrap();
        let stored_again = APPEND_IDS_REMEMBERED as u64 + 2;
        assert_eq!(
            (forgotten["seq"].as_u64(), forgotten["duplicate"].as_bool()),
            (Some(stored_again), Some(false))
        );
        // Storing k0 again pushed k1 out; k2 is now the oldest remembered key.
        let k1 = send(&runtime, &keyed("m1", "k1")).await.unwrap();
        assert_eq!(
            (k1["seq"].as_u64(), k1["duplicate"].as_bool()),
            (Some(stored_again + 1), Some(false))
        );
        let k3 = send(&runtime, &keyed("m3", "k3")).await.unwrap();
        assert_eq!((k3["seq"].as_u64(), k3["duplicate"].as_bool()), (Some(4), Some(true)));
        // The window is committed state: after a new activation it still ends at k3.
        runtime.shutdown().await;
        let runtime = log_runtime(&store);
        let k2 = send(&runtime, &keyed("m2", "k2")).await.unwrap();
        assert_eq!(k2["duplicate"], false, "{k2}");
        let k4 = send(&runtime, &keyed("m4", "k4")).await.unwrap();
        assert_eq!((k4["seq"].as_u64(), k4["duplicate"].as_bool()), (Some(5), Some(true)));
        runtime.shutdown().await;
    }

    #[tokio::test]
    async fn a_log_saved_before_append_keys_loads_and_takes_keys() {
        use troupe_runtime::StateStore as _;
        let store = Arc::new(troupe_runtime::MemoryStore::new());
        let actor = ActorId::new(CONVERSATION_KIND, "c").unwrap();
        // The old format: the snapshot is the last sequence number in decimal.
        let fence = store.claim(&actor).await.unwrap().fence;
        let old = troupe_runtime::TurnCommit {
            state: troupe_runtime::StateChange::Set(Bytes::from_static(b"2")),
            writes: vec![
                (message_key(1), Some(Bytes::from_static(b"old one"))),
                (message_key(2), Some(Bytes::from_static(b"old two"))),
            ],
        };
        store.commit(&actor, fence, old).await.unwrap();
        let runtime = log_runtime(&store);
        let reply = send(&runtime, &keyed("new", "k")).await.unwrap();
        assert_eq!(reply["seq"], 3, "{reply}");
        assert_eq!(send(&runtime, &keyed("new", "k")).await.unwrap()["duplicate"], true);
        runtime.shutdown().await;
        assert_eq!(
            store.load(&actor).await.unwrap(),
            Some(Bytes::from(r#"{"last_seq":3,"ids":[["k",3]]}"#))
        );
        let runtime = log_runtime(&store);
        assert_eq!(
            texts(&runtime).await,
            vec![
                (1, "old one".to_string()),
                (2, "old two".to_string()),
                (3, "new".to_string())
            ]
        );
        runtime.shutdown().await;
        // A log with no key keeps saving the old format.
        let plain = Conversation::load("n".to_string(), Some(b"7")).unwrap();
        assert_eq!(plain.snapshot().unwrap(), Some(Bytes::from_static(b"7")));
        assert!(Conversation::load("n".to_string(), Some(b"{bad")).is_err());
    }

    #[test]
    fn append_keys_are_checked_for_length_and_characters() {
        assert_eq!(check_append_id("0f8e6a52-6c1c-4a4e-9d7b-1b2c3d4e5f60"), Ok(()));
        assert_eq!(check_append_id("a.b_c:d-E9"), Ok(()));
        assert_eq!(check_append_id(&"x".repeat(APPEND_ID_BYTES_MAX)), Ok(()));
        assert_eq!(check_append_id(""), Err(AppendIdError::Empty));
        assert_eq!(
            check_append_id(&"x".repeat(APPEND_ID_BYTES_MAX + 1)),
            Err(AppendIdError::TooLong {
                bytes: APPEND_ID_BYTES_MAX + 1
            })
        );
        assert_eq!(check_append_id("a/b"), Err(AppendIdError::Character { character: '/' }));
        assert_eq!(check_append_id("é"), Err(AppendIdError::Character { character: 'é' }));
        assert!(AppendIdError::Empty.to_string().starts_with("id is empty"));
    }

    /// A raw request (JSON) to conversation `c`: its reply and the reply's size in bytes.
    async fn send_raw(runtime: &Runtime, request: serde_json::Value) -> (serde_json::Value, usize) {
        let handle = runtime.handle();
        let actor = ActorId::new(CONVERSATION_KIND, "c").unwrap();
        let reply = handle
            .invoke(
                &actor,
                Bytes::from(request.to_string()),
                handle.deadline_in(Duration::from_secs(5)),
            )
            .await
            .unwrap();
        (serde_json::from_slice(&reply).unwrap(), reply.len())
    }

    /// Reads conversation `c` page by page (`after` the last page's `next_after`, at
    /// most `pages_max` pages): every (seq, text length) read, and the largest reply.
    async fn read_all(runtime: &Runtime, pages_max: usize) -> (Vec<(u64, usize)>, usize) {
        let (mut read, mut largest, mut after) = (Vec::new(), 0, None::<u64>);
        for _ in 0..pages_max {
            let request = match after {
                Some(after) => json!({"op": "read", "after": after}),
                None => json!({"op": "read"}),
            };
            let (reply, size) = send_raw(runtime, request).await;
            largest = largest.max(size);
            for message in reply["messages"].as_array().unwrap() {
                read.push((
                    message["seq"].as_u64().unwrap(),
                    message["text"].as_str().unwrap().len(),
                ));
            }
            match reply["next_after"].as_u64() {
                Some(next) => after = Some(next),
                None => break,
            }
        }
        (read, largest)
    }

    /// Goal: a conversation of any length is read whole, page by page: a read answers at
    /// most `CONVERSATION_READ_MESSAGES_MAX` messages and names where the next page starts
    /// (`next_after`), and `?after=SEQ` reads on from there. Before, a read answered the
    /// first 10,000 messages and nothing said there were more: the rest could not be read.
    /// Method: 10,005 one-byte messages, read through the cursor: every seq once, in order.
    #[tokio::test]
    async fn messages_past_one_reads_limit_are_reached_through_the_cursor() {
        let runtime = log_runtime(&Arc::new(troupe_runtime::MemoryStore::new()));
        let count = CONVERSATION_READ_MESSAGES_MAX as u64 + 5;
        for _ in 0..count {
            send_raw(&runtime, json!({"op": "append", "text": "m"})).await;
        }
        let (read, _) = read_all(&runtime, 10).await;
        let seqs: Vec<u64> = read.iter().map(|(seq, _)| *seq).collect();
        assert_eq!(seqs.len() as u64, count, "messages read of {count}");
        assert!(seqs.iter().copied().eq(1..=count), "every seq once, in order");
        runtime.shutdown().await;
    }

    /// Goal: a read's reply fits in one transport frame (`FRAME_SIZE_MAX_BYTES`), so a
    /// conversation is readable through any node, not only its owner: a read stops at
    /// `CONVERSATION_READ_REPLY_BYTES_MAX` and names where the next page starts. Before,
    /// 1,100 messages of the largest size (16 KiB) made one reply of 18 MB, more than a
    /// frame holds, which a node reading through another could not receive.
    /// Method: 1,100 messages of `CONVERSATION_TEXT_BYTES_MAX` bytes, read through the
    /// cursor: every reply within the frame limit, every message read once, whole.
    #[tokio::test]
    async fn a_reads_reply_fits_in_one_transport_frame() {
        let runtime = log_runtime(&Arc::new(troupe_runtime::MemoryStore::new()));
        let count = 1_100_u64;
        let text = "x".repeat(CONVERSATION_TEXT_BYTES_MAX);
        for _ in 0..count {
            send_raw(&runtime, json!({"op": "append", "text": text})).await;
        }
        let (read, largest) = read_all(&runtime, 100).await;
        assert!(
            largest <= troupe_runtime::FRAME_SIZE_MAX_BYTES,
            "a reply of {largest} bytes, more than a frame's {}",
            troupe_runtime::FRAME_SIZE_MAX_BYTES
        );
        assert_eq!(read.len() as u64, count);
        assert!(read.iter().map(|(seq, _)| *seq).eq(1..=count));
        assert!(read.iter().all(|(_, length)| *length == CONVERSATION_TEXT_BYTES_MAX));
        runtime.shutdown().await;
    }

    /// Goal: a failed conversation call is answered with the status that says what to
    /// do, `Retry-After` exactly where sending again later helps: a full mailbox 429, an
    /// overloaded or stopping runtime 503, both with `Retry-After:` `NODE_RETRY_AFTER_S`;
    /// an unreachable owner 503 without it (the message may be stored; the client
    /// decides); a store failure as `troupe serve` answers it (`{"error": {"code",
    /// "message"}}`): down for a moment 503 `storage_unavailable` with `Retry-After`,
    /// otherwise 500 `storage_failed` (until 2026-12-07 both were 503 without it, in the
    /// node's own shape); a timeout 504, a refusal 400; the body names the error.
    /// Method: each `InvokeError` through `invoke_error_response`.
    #[tokio::test]
    async fn failed_calls_are_answered_with_their_status_and_retry_after_where_it_helps() {
        use troupe_core::{StoreError, StoreOperation};
        let target = ActorId::new(CONVERSATION_KIND, "c").unwrap();
        let retry_after = NODE_RETRY_AFTER_S.to_string();
        let cases = [
            (
                InvokeError::Busy {
                    target: target.clone(),
                    capacity: 64,
                },
                StatusCode::TOO_MANY_REQUESTS,
                Some(retry_after.as_str()),
            ),
            (
                InvokeError::DispatcherBusy { capacity: 1_024 },
                StatusCode::SERVICE_UNAVAILABLE,
                Some(retry_after.as_str()),
            ),
            (
                InvokeError::ConnectionBusy {
                    target: target.clone(),
                    capacity: 1_024,
                },
                StatusCode::SERVICE_UNAVAILABLE,
                Some(retry_after.as_str()),
            ),
            (
                InvokeError::Shutdown,
                StatusCode::SERVICE_UNAVAILABLE,
                Some(retry_after.as_str()),
            ),
            (
                InvokeError::Unreachable {
                    target: target.clone(),
                    cause: "connection reset".to_string(),
                },
                StatusCode::SERVICE_UNAVAILABLE,
                None,
            ),
            (
                InvokeError::StorageFailed {
                    target: target.clone(),
                    source: StoreError::Injected {
                        operation: StoreOperation::Commit,
                    },
                },
                StatusCode::INTERNAL_SERVER_ERROR,
                None,
            ),
            (
                InvokeError::StorageFailed {
                    target: target.clone(),
                    source: StoreError::Unavailable {
                        operation: StoreOperation::Commit,
                        cause: "connection refused".to_string(),
                    },
                },
                StatusCode::SERVICE_UNAVAILABLE,
                Some(retry_after.as_str()),
            ),
            (
                InvokeError::Timeout {
                    target: target.clone(),
                    timeout_ms: NODE_CALL_TIMEOUT_MS,
                },
                StatusCode::GATEWAY_TIMEOUT,
                None,
            ),
            (
                InvokeError::Rejected {
                    target: target.clone(),
                    reason: "no".to_string(),
                },
                StatusCode::BAD_REQUEST,
                None,
            ),
        ];
        for (error, status, expected_retry_after) in cases {
            let text = error.to_string();
            // A store failure in `troupe serve`'s shape, with its code.
            let store_code = match &error {
                InvokeError::StorageFailed { source, .. } if source.is_transient() => Some("storage_unavailable"),
                InvokeError::StorageFailed { .. } => Some("storage_failed"),
                _ => None,
            };
            let response = invoke_error_response(error);
            assert_eq!(response.status(), status, "{text}");
            let retry_after = response
                .headers()
                .get(axum::http::header::RETRY_AFTER)
                .map(|value| value.to_str().unwrap().to_string());
            assert_eq!(retry_after.as_deref(), expected_retry_after, "{text}");
            let body = axum::body::to_bytes(response.into_body(), usize::MAX).await.unwrap();
            let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
            match store_code {
                Some(code) => assert_eq!(body["error"], json!({"code": code, "message": text})),
                None => assert_eq!(body["error"], json!(text)),
            }
        }
    }
}
