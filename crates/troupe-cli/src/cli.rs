//! The `troupe` command line, parsed by `clap` (derive): every command has `--help`, and
//! an unknown command or flag fails with clap's error (exit code 2) naming it.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand};
use troupe_server::limits::{
    A2A_TASKS_KEPT_MAX, SERVER_CONCURRENT_REQUESTS_MAX, SERVER_CONCURRENT_REQUESTS_MAX_DEFAULT, SERVER_CONNECTIONS_MAX,
    SERVER_CONNECTIONS_MAX_DEFAULT, SERVER_STREAMS_OPEN_MAX, SERVER_STREAMS_OPEN_MAX_DEFAULT,
};

/// troupe: a virtual-actor runtime for AI agents.
#[derive(Debug, Parser)]
#[command(name = "troupe", version, arg_required_else_help = true)]
pub struct Cli {
    /// What to run.
    #[command(subcommand)]
    pub command: Command,
}

/// The commands of `troupe`.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a small organisation of five agents, each a virtual actor with its own model
    /// and tools.
    ///
    /// A user asks the coordinator for a brief; the coordinator asks the researcher and
    /// the archivist at once; the researcher asks the analyst; the analyst tries to call
    /// the coordinator back up the chain and is refused (the coordinator is waiting on
    /// it: a deadlock avoided); the archivist is too slow for its 1.5 s timeout: the call
    /// times out and the archivist's turn is cancelled, committing nothing. Prints the answer and the call tree with depths,
    /// durations and outcomes. Then the user notifies the coordinator that the report is
    /// ready (fire-and-forget, persisted in its inbox): in its own turn it delegates a
    /// review to the critic and notifies the researcher, and the critic's review comes
    /// back to it as a new turn; the demo prints these inbox events.
    ///
    /// Without OPENAI_API_KEY the agents think with a scripted, deterministic model: no
    /// key or network needed. With it, they use a real model on an OpenAI-compatible
    /// chat-completions API (OPENAI_BASE_URL, default https://api.openai.com/v1;
    /// OPENAI_MODEL, default gpt-4o-mini).
    Demo(DemoArgs),
    /// Serve an organisation of agents over HTTP: REST + SSE, /health, /metrics, and the
    /// OpenAI-compatible /v1/chat/completions and /v1/models (the model is the agent id).
    /// See docs/serve.md.
    ///
    /// Serves the demo's five agents, or the organisation a --config file declares, on
    /// the scripted model, or on a real one if OPENAI_API_KEY is set (as `troupe demo`).
    /// Prints `listening on http://ADDR` once it accepts connections. On SIGTERM, ctrl-c
    /// (SIGINT) or SIGHUP (its terminal closed) it stops accepting, lets requests in
    /// flight finish (up to 10 s), then shuts the agents down and exits 0. A second
    /// signal during that grace stops it at once (exit code 1): requests in flight are
    /// cut, turns still running half a second later are cut as by a crash; what was
    /// acknowledged is kept. A signal while it starts stops it once started.
    Serve(ServeArgs),
    /// Run one node of a Troupe cluster: actors' state in PostgreSQL (fenced), their
    /// placement and the node's membership in etcd, calls between nodes over TCP. See
    /// docs/cluster.md.
    ///
    /// Serves durable conversation logs (the actor kind `conversation`) over HTTP on
    /// --http: POST /v1/conversations/ID/messages {"text": ...} appends a message and
    /// answers its sequence number; GET /v1/conversations/ID/messages reads them in
    /// order, a page at a time (?after=SEQ reads on from the reply's next_after). Any node answers for any conversation: the call is routed to the node that
    /// owns it, and when that node dies another takes it over once its lease (--lease-ttl-ms)
    /// has ended. Prints `node NAME transport ADDR` and `listening on http://ADDR` once
    /// it serves. On SIGTERM, ctrl-c (SIGINT) or SIGHUP (its terminal closed) it stops
    /// serving, lets the requests in flight finish, saves and leaves the cluster (exit
    /// code 0). A second signal during that stops it at once (exit code 1): requests in
    /// flight are cut, turns still running half a second later are cut as by a crash,
    /// and its lease ends by itself; what was acknowledged is kept.
    ///
    /// With --config FILE (the organisation file of `troupe serve --config`), the node
    /// also serves those agents with `troupe serve`'s HTTP API (/v1/agents/...), each
    /// agent run by the node that owns it; the conversation logs then move to
    /// /v1/logs/ID/messages. Start every node of the cluster with the same file.
    Node(NodeArgs),
}

/// The options of `troupe node`.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct NodeArgs {
    /// etcd client endpoints, `host:port` or `http://host:port`, separated by commas.
    #[arg(long, value_name = "URL[,URL]", value_delimiter = ',', required = true)]
    pub etcd: Vec<String>,
    /// The PostgreSQL database every node shares: a URL
    /// (`postgresql://user@host:port/db`) or `key=value` pairs.
    #[arg(long, value_name = "URL")]
    pub postgres: String,
    /// The address other nodes call this node on (port 0: any free port; the bound
    /// address is published in etcd).
    #[arg(long, value_name = "ADDR", value_parser = socket_address)]
    pub listen: SocketAddr,
    /// This node's name in the cluster (ASCII letters, digits, '-', '_', '.').
    /// Default: `node-PID`.
    #[arg(long, value_name = "ID")]
    pub node_id: Option<String>,
    /// The cluster's name: every node of one cluster gives the same.
    #[arg(long, value_name = "NAME", default_value = NODE_CLUSTER_DEFAULT)]
    pub cluster: String,
    /// The node's etcd lease, in milliseconds (whole seconds, 3000 to 300000): when the
    /// node dies, its actors move to other nodes this long after its last renewal.
    #[arg(long, value_name = "N", default_value_t = NODE_LEASE_TTL_MS_DEFAULT)]
    pub lease_ttl_ms: u64,
    /// Serve the conversation HTTP API on ADDR (port 0: any free port). A non-loopback
    /// address needs a token. Without it the node serves only other nodes.
    #[arg(long, value_name = "ADDR", value_parser = socket_address)]
    pub http: Option<SocketAddr>,
    /// The bearer token every HTTP request but GET /health (and, with --config, the A2A
    /// Agent Cards and the topology page's files) must carry (at least 16 bytes).
    #[arg(long, value_name = "T", env = "TROUPE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Also record every accepted commit (not only every claim) in PostgreSQL's
    /// `troupe_fence_log` table, with its fence, node and time: an audit trail that
    /// shows no commit was accepted under an old fence. One more row per turn.
    #[arg(long)]
    pub fence_log_commits: bool,
    /// Also serve the agents declared in FILE (the TOML of `troupe serve --config`; see
    /// examples/org.toml) with `troupe serve`'s HTTP API. Every node of the cluster must
    /// be started with the same file. Each node writes the file's organisation (policy,
    /// links, permission rules, managers, modes) to the shared store when it starts: one
    /// record for the whole cluster, which the API of any node changes.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// With --config: use the scripted model even if OPENAI_API_KEY is set.
    #[arg(long)]
    pub scripted: bool,
    /// HTTP requests handled at once (1 to 65536), as `troupe serve`'s flag; one more is
    /// answered 503 with Retry-After. With --config, the agents' API has a limit of its
    /// own of the same size.
    #[arg(
        long,
        value_name = "N",
        default_value_t = SERVER_CONCURRENT_REQUESTS_MAX_DEFAULT as u64,
        value_parser = clap::value_parser!(u64).range(1..=SERVER_CONCURRENT_REQUESTS_MAX as u64)
    )]
    pub concurrent_requests_max: u64,
    /// HTTP connections served at once (1 to 65536), as `troupe serve`'s flag: past it
    /// no new connection is accepted until one closes.
    #[arg(
        long,
        visible_alias = "connections-max",
        value_name = "N",
        default_value_t = SERVER_CONNECTIONS_MAX_DEFAULT as u64,
        value_parser = clap::value_parser!(u64).range(1..=SERVER_CONNECTIONS_MAX as u64)
    )]
    pub max_connections: u64,
    /// After etcd did not answer for longer than the lease (an etcd outage or restart),
    /// take a new lease and serve again once every actor of this node has stopped,
    /// instead of exiting: retried for about 5 minutes while etcd does not answer; the
    /// node exits 1 when it gives up, or when a live node took its name meanwhile. Off by default: the node then exits 1 on a lost lease
    /// and a supervisor starts it again.
    #[arg(long)]
    pub rejoin_after_lost_lease: bool,
}

/// Parses an `ADDR` flag (`--bind`, `--listen`, `--http`): an IP address and a port.
/// Its refusal (clap prints it after "invalid value 'TEXT' for '--flag <ADDR>'") says
/// what to give instead: until 2026-12-07 it was std's "invalid socket address syntax",
/// also for `localhost:8080` and for a port alone.
fn socket_address(text: &str) -> Result<SocketAddr, String> {
    use std::net::IpAddr;
    const EXAMPLES: &str = "such as 127.0.0.1:8080 or [::1]:8080 (port 0 picks a free one)";
    text.parse().map_err(|_| {
        let port_alone = text.strip_prefix(':').unwrap_or(text);
        let name_and_port = text
            .rsplit_once(':')
            .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
        match text.parse::<IpAddr>() {
            _ if port_alone.parse::<u16>().is_ok() => {
                format!(
                    "a port alone is not an address; give an IP address and the port, such as 127.0.0.1:{port_alone}"
                )
            }
            Ok(IpAddr::V4(_)) => format!("no port; give the address and a port, such as {text}:8080"),
            // `::1:8080` is an IPv6 address too: the example does not guess the port.
            Ok(IpAddr::V6(_)) => format!(
                "read as the IPv6 address {text}, with no port; an IPv6 address and its port are written \
                 [ADDRESS]:PORT, such as [::1]:8080"
            ),
            Err(_) if name_and_port => {
                format!("host names are not looked up; give an IP address and a port, {EXAMPLES}")
            }
            Err(_) => format!("not an IP address and a port; give one {EXAMPLES}"),
        }
    })
}

/// The default cluster name of `troupe node`.
pub const NODE_CLUSTER_DEFAULT: &str = "troupe";
/// The default lease of `troupe node`, in milliseconds.
pub const NODE_LEASE_TTL_MS_DEFAULT: u64 = 5_000;

/// The default address of `troupe serve`.
pub const SERVE_BIND_DEFAULT: &str = "127.0.0.1:8080";

/// How long `troupe serve` and `troupe node` wait for their agents to stop after a
/// second SIGTERM, ctrl-c or SIGHUP (during the grace the first one started), in milliseconds: turns still running then
/// are cut as by a crash (a turn commits whole or not at all).
pub const SERVE_SECOND_SIGNAL_SHUTDOWN_WAIT_MS: u64 = 500;

/// Most log lines of `troupe serve` and `troupe node` waiting to be written to stderr,
/// in lines (a span's close line is about 250 bytes: about 1 MiB). The lines go through
/// a queue of this many, written by a thread of their own; a line that finds it full
/// is dropped and counted, never waited for, so a stderr read slowly or not at all
/// never stalls a request. The count is reported at exit (and, while lines are being
/// dropped, every [`SERVE_LOG_DROPPED_REPORT_MS`]).
pub const SERVE_LOG_LINES_BUFFERED_MAX: usize = 4_096;

/// How often `troupe serve` and `troupe node` say how many log lines they dropped since
/// the last report, in milliseconds (only when some were: see
/// [`SERVE_LOG_LINES_BUFFERED_MAX`]).
pub const SERVE_LOG_DROPPED_REPORT_MS: u64 = 10_000;

/// How long `troupe serve` and `troupe node` wait at exit for their queued log lines to
/// reach stderr, in milliseconds; lines still queued then (nobody reads stderr) are
/// lost, and the exit goes on.
pub const SERVE_LOG_FLUSH_WAIT_MS: u64 = 2_000;

/// The options of `troupe serve`.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct ServeArgs {
    /// The address to listen on (port 0: any free port). A non-loopback address needs a
    /// token.
    #[arg(long, value_name = "ADDR", default_value = SERVE_BIND_DEFAULT, value_parser = socket_address)]
    pub bind: SocketAddr,
    /// Keep the agents' state in DIR/troupe.db (SQLite). Default: a new temporary
    /// directory, removed at exit.
    #[arg(long, value_name = "DIR")]
    pub db: Option<PathBuf>,
    /// The bearer token every request must carry (at least 16 bytes), but GET /health,
    /// the A2A Agent Cards and the topology page's files.
    #[arg(long, value_name = "TOKEN", env = "TROUPE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Use the scripted model even if OPENAI_API_KEY is set.
    #[arg(long)]
    pub scripted: bool,
    /// Serve the organisation declared in FILE (TOML: agents, links, permissions,
    /// policy; see examples/org.toml) instead of the built-in demo organisation. It is
    /// synced into the store at start: declared items win, items created at runtime are
    /// kept.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The format of the log lines on stderr: `text` (one readable line per event) or
    /// `json` (one JSON object per line). What is logged is chosen by RUST_LOG (default:
    /// `info` for the troupe crates, `warn` for the others, and no line per request; with
    /// RUST_LOG set, e.g. `RUST_LOG=info`, each span of a request, from `http_request`
    /// down to `model_call`, also logs a line when it closes).
    #[arg(long, value_name = "FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Export the spans (each request's `http_request`, `invoke`, `turn` with its call
    /// chain, `model_call`, `tool_call`) to the OpenTelemetry collector at URL, over
    /// OTLP/HTTP (protobuf), e.g. http://127.0.0.1:4318 (`/v1/traces` is appended). Only
    /// in a troupe built with `--features otel`; otherwise the flag is refused.
    #[arg(long, value_name = "URL")]
    pub otlp_endpoint: Option<String>,
    /// Requests handled at once (1 to 65536); one more is answered 503 `overloaded`
    /// with Retry-After.
    #[arg(
        long,
        value_name = "N",
        default_value_t = SERVER_CONCURRENT_REQUESTS_MAX_DEFAULT as u64,
        value_parser = clap::value_parser!(u64).range(1..=SERVER_CONCURRENT_REQUESTS_MAX as u64)
    )]
    pub concurrent_requests_max: u64,
    /// HTTP connections served at once (1 to 65536): past it no new connection is
    /// accepted until one closes (they wait, unanswered; an idle connection closes after
    /// 10 s), so that a flood of connections cannot use up the process's file
    /// descriptors. Keep it under the descriptor limit (`ulimit -n`) less what the store
    /// and the model clients need.
    #[arg(
        long,
        visible_alias = "connections-max",
        value_name = "N",
        default_value_t = SERVER_CONNECTIONS_MAX_DEFAULT as u64,
        value_parser = clap::value_parser!(u64).range(1..=SERVER_CONNECTIONS_MAX as u64)
    )]
    pub max_connections: u64,
    /// Streamed answers open at once (1 to 65536): streamed messages, A2A
    /// SendStreamingMessage and SubscribeToTask, each counted until it ends or its client
    /// goes away; one more is answered 503 with Retry-After (`ServerConfig::streams_open_max`).
    #[arg(
        long,
        value_name = "N",
        default_value_t = SERVER_STREAMS_OPEN_MAX_DEFAULT as u64,
        value_parser = clap::value_parser!(u64).range(1..=SERVER_STREAMS_OPEN_MAX as u64)
    )]
    pub streams_open_max: u64,
    /// A2A tasks kept, in memory and in the store (1 to 10000): past it, a new task
    /// lets the oldest ended one go, and its agent forgets it too (its id then answers
    /// -32001, and its message id, sent again, starts a new task).
    #[arg(
        long,
        value_name = "N",
        default_value_t = A2A_TASKS_KEPT_MAX as u64,
        value_parser = clap::value_parser!(u64).range(1..=A2A_TASKS_KEPT_MAX as u64)
    )]
    pub a2a_tasks_kept: u64,
}

/// The format of `troupe serve`'s log lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// JSON lines: `timestamp`, `level`, `fields`, `target`, `span` (the innermost span)
    /// and `spans` (its ancestry, outermost first).
    Json,
}

/// `troupe serve`'s log filter when RUST_LOG is not set: `info` for the troupe crates,
/// `warn` for every other (axum, hyper, ...). The spans' close lines (a request's
/// detail) are then not written: RUST_LOG set writes them.
pub const SERVE_LOG_FILTER_DEFAULT: &str =
    "warn,troupe=info,troupe_cli=info,troupe_server=info,troupe_runtime=info,troupe_agent=info,troupe_core=info";

/// The options of `troupe demo`.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct DemoArgs {
    /// Keep the agents' state in DIR/troupe.db (SQLite; open it with sqlite3); agents
    /// then remember earlier runs. Default: a new temporary directory, removed at the
    /// end.
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Use the scripted model even if OPENAI_API_KEY is set.
    #[arg(long)]
    pub scripted: bool,
    /// Run the organisation declared in FILE (TOML: agents, links, permissions,
    /// policy; see examples/org.toml) instead of the built-in demo, on the scripted
    /// model: every agent tries to contact every other agent, and the demo prints who
    /// talked to whom and which contacts the organisation refused.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
}

#[cfg(test)]
mod tests {
    use clap::error::ErrorKind;
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn the_command_line_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn demo_flags_parse() {
        let cli = Cli::try_parse_from(["troupe", "demo", "--data-dir", "/tmp/x", "--scripted"]).unwrap();
        let Command::Demo(args) = cli.command else {
            panic!("not demo")
        };
        assert_eq!(
            args,
            DemoArgs {
                data_dir: Some(PathBuf::from("/tmp/x")),
                scripted: true,
                config: None,
            }
        );
        let cli = Cli::try_parse_from(["troupe", "demo", "--config", "org.toml"]).unwrap();
        let Command::Demo(args) = cli.command else {
            panic!("not demo")
        };
        assert_eq!(args.config, Some(PathBuf::from("org.toml")));
    }

    #[test]
    fn serve_flags_parse_and_a_bad_address_is_refused() {
        let cli = Cli::try_parse_from(["troupe", "serve"]).unwrap();
        let Command::Serve(args) = cli.command else {
            panic!("not serve")
        };
        assert_eq!(args.bind, SERVE_BIND_DEFAULT.parse::<SocketAddr>().unwrap());
        let cli = Cli::try_parse_from([
            "troupe",
            "serve",
            "--bind",
            "0.0.0.0:9000",
            "--db",
            "/tmp/d",
            "--token",
            "t",
            "--scripted",
        ])
        .unwrap();
        let Command::Serve(args) = cli.command else {
            panic!("not serve")
        };
        assert_eq!(args.bind, "0.0.0.0:9000".parse::<SocketAddr>().unwrap());
        assert_eq!(args.db, Some(PathBuf::from("/tmp/d")));
        assert_eq!(args.token.as_deref(), Some("t"));
        assert!(args.scripted);
        assert_eq!(
            (args.concurrent_requests_max, args.a2a_tasks_kept),
            (SERVER_CONCURRENT_REQUESTS_MAX_DEFAULT as u64, A2A_TASKS_KEPT_MAX as u64)
        );
        let cli = Cli::try_parse_from([
            "troupe",
            "serve",
            "--concurrent-requests-max",
            "8",
            "--a2a-tasks-kept",
            "3",
        ])
        .unwrap();
        let Command::Serve(args) = cli.command else {
            panic!("not serve")
        };
        assert_eq!((args.concurrent_requests_max, args.a2a_tasks_kept), (8, 3));
        let cli = Cli::try_parse_from(["troupe", "serve", "--concurrent-requests-max", "65536"]).unwrap();
        let Command::Serve(args) = cli.command else {
            panic!("not serve")
        };
        assert_eq!(args.concurrent_requests_max, SERVER_CONCURRENT_REQUESTS_MAX as u64);
        for (flag, value) in [
            ("--concurrent-requests-max", "0"),
            ("--concurrent-requests-max", "65537"),
            ("--concurrent-requests-max", "18446744073709551615"),
            ("--a2a-tasks-kept", "0"),
            ("--a2a-tasks-kept", "10001"),
        ] {
            let error = Cli::try_parse_from(["troupe", "serve", flag, value]).expect_err("out of range");
            assert_eq!(error.kind(), ErrorKind::ValueValidation, "{flag} {value}");
            assert!(
                error.to_string().contains(flag) && error.to_string().contains(value),
                "{error}"
            );
        }
        let error = Cli::try_parse_from(["troupe", "serve", "--bind", "localhost"]).expect_err("not an address");
        assert_eq!(error.kind(), ErrorKind::ValueValidation);
        assert!(error.to_string().contains("localhost"), "{error}");
    }

    /// Goal: `--max-connections` (alias `--connections-max`) of `troupe serve` and
    /// `troupe node` defaults to `SERVER_CONNECTIONS_MAX_DEFAULT`, takes 1 to
    /// `SERVER_CONNECTIONS_MAX`, and refuses 0 and more, naming the flag and the value.
    /// Before 2026-12-07 there was no such flag.
    #[test]
    fn max_connections_defaults_takes_its_range_and_refuses_the_rest() {
        let connections = |args: &[&str]| match Cli::try_parse_from(args).unwrap().command {
            Command::Serve(args) => args.max_connections,
            Command::Node(args) => args.max_connections,
            Command::Demo(_) => panic!("not serve or node"),
        };
        let node = [
            "troupe",
            "node",
            "--etcd",
            "http://127.0.0.1:2379",
            "--postgres",
            "host=x",
            "--listen",
            "127.0.0.1:0",
        ];
        assert_eq!(connections(&["troupe", "serve"]), SERVER_CONNECTIONS_MAX_DEFAULT as u64);
        assert_eq!(connections(&node), SERVER_CONNECTIONS_MAX_DEFAULT as u64);
        for flag in ["--max-connections", "--connections-max"] {
            assert_eq!(connections(&["troupe", "serve", flag, "4"]), 4);
            assert_eq!(connections(&[&node[..], &[flag, "65536"]].concat()), 65_536);
        }
        for value in ["0", "65537"] {
            for command in [&["troupe", "serve"][..], &node[..]] {
                let error =
                    Cli::try_parse_from([command, &["--max-connections", value]].concat()).expect_err("out of range");
                assert_eq!(error.kind(), ErrorKind::ValueValidation, "{value}");
                assert!(
                    error.to_string().contains("--max-connections") && error.to_string().contains(value),
                    "{error}"
                );
            }
        }
    }

    /// Goal: `--streams-open-max` parses as `--concurrent-requests-max` does: its
    /// default is `SERVER_STREAMS_OPEN_MAX_DEFAULT`, a value in 1..=`SERVER_STREAMS_OPEN_MAX`
    /// is taken (the bounds too), and 0, the maximum plus one and `u64::MAX` are refused
    /// by clap naming the flag and the value.
    #[test]
    fn serve_streams_open_max_parses_within_its_range() {
        let serve = |flags: &[&str]| {
            let cli = Cli::try_parse_from(["troupe", "serve"].iter().chain(flags)).unwrap();
            let Command::Serve(args) = cli.command else {
                panic!("not serve")
            };
            args.streams_open_max
        };
        assert_eq!(serve(&[]), SERVER_STREAMS_OPEN_MAX_DEFAULT as u64);
        assert_eq!(serve(&["--streams-open-max", "1"]), 1);
        assert_eq!(serve(&["--streams-open-max", "8"]), 8);
        assert_eq!(serve(&["--streams-open-max", "65536"]), SERVER_STREAMS_OPEN_MAX as u64);
        let over = (SERVER_STREAMS_OPEN_MAX + 1).to_string();
        for value in ["0", over.as_str(), "18446744073709551615"] {
            let error =
                Cli::try_parse_from(["troupe", "serve", "--streams-open-max", value]).expect_err("out of range");
            assert_eq!(error.kind(), ErrorKind::ValueValidation, "{value}");
            assert!(
                error.to_string().contains("--streams-open-max") && error.to_string().contains(value),
                "{error}"
            );
        }
    }

    #[test]
    fn node_flags_parse_with_several_etcd_endpoints() {
        let cli = Cli::try_parse_from([
            "troupe",
            "node",
            "--etcd",
            "http://127.0.0.1:2379,10.0.0.2:2379",
            "--postgres",
            "postgresql://troupe@127.0.0.1/troupe",
            "--listen",
            "127.0.0.1:7100",
            "--node-id",
            "n1",
            "--lease-ttl-ms",
            "3000",
            "--http",
            "127.0.0.1:8080",
        ])
        .unwrap();
        let Command::Node(args) = cli.command else {
            panic!("not node")
        };
        assert_eq!(args.etcd, vec!["http://127.0.0.1:2379", "10.0.0.2:2379"]);
        assert_eq!(args.node_id.as_deref(), Some("n1"));
        assert_eq!(args.lease_ttl_ms, 3_000);
        assert_eq!(args.http, Some("127.0.0.1:8080".parse().unwrap()));
        assert_eq!(args.cluster, NODE_CLUSTER_DEFAULT);
        let error = Cli::try_parse_from(["troupe", "node", "--postgres", "x", "--listen", "127.0.0.1:1"])
            .expect_err("--etcd is required");
        assert_eq!(error.kind(), ErrorKind::MissingRequiredArgument);
        assert!(error.to_string().contains("--etcd"), "{error}");
    }

    #[test]
    fn every_command_has_help() {
        for argv in [
            &["troupe", "--help"][..],
            &["troupe", "help"],
            &["troupe", "demo", "--help"],
            &["troupe", "serve", "--help"],
            &["troupe", "node", "--help"],
        ] {
            let error = Cli::try_parse_from(argv).expect_err("help stops parsing");
            assert_eq!(error.kind(), ErrorKind::DisplayHelp, "{argv:?}");
        }
    }

    #[test]
    fn an_unknown_flag_is_refused_and_named() {
        let error = Cli::try_parse_from(["troupe", "demo", "--bogus"]).expect_err("unknown flag");
        assert_eq!(error.kind(), ErrorKind::UnknownArgument);
        assert!(error.to_string().contains("--bogus"), "{error}");
    }

    #[test]
    fn a_missing_command_or_value_is_refused() {
        let error = Cli::try_parse_from(["troupe", "demo", "--data-dir"]).expect_err("missing value");
        assert_eq!(error.kind(), ErrorKind::InvalidValue);
        let error = Cli::try_parse_from(["troupe", "launch"]).expect_err("unknown command");
        assert_eq!(error.kind(), ErrorKind::InvalidSubcommand);
    }
}
