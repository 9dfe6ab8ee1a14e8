//! The `troupe` command. `troupe demo` runs a small organisation of agents on the
//! embedded SQLite store and prints the call tree; see `troupe --help`.
//!
//! Run it with `cargo run --release -p troupe-cli -- demo`.

use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use troupe_agent::LlmClient;
use troupe_cli::{demo_script, run_demo, run_org_demo, Cli, Command, DemoArgs, DEMO_HANDOFF, DEMO_QUESTION};
#[cfg(not(madsim))]
use troupe_cli::{serve_organisation, signals::StopSignal, ServeArgs};
use troupe_runtime::{SqliteStore, StateStore};

/// A real model client and a description of it.
type RealModel = (Arc<dyn LlmClient>, String);

/// The real model, when `OPENAI_API_KEY` is set and the client is built in.
#[cfg(not(madsim))]
fn real_model() -> Result<Option<RealModel>, String> {
    if std::env::var("OPENAI_API_KEY").map_or(true, |key| key.trim().is_empty()) {
        return Ok(None);
    }
    // The client's refusal says what is wrong, not where it came from (until 2026-12-06:
    // "base_url must start with http:// or https://, got ..." alone). It may come from
    // reading the environment or from building the client (a key that cannot be sent).
    let refused = |error: &dyn std::fmt::Display| {
        format!(
            "OPENAI_API_KEY is set, so the agents think with a real model, but its configuration is refused: \
             {error}; check OPENAI_API_KEY, OPENAI_BASE_URL and OPENAI_MODEL, or give --scripted"
        )
    };
    let config = troupe_agent::OpenAiConfig::from_env().map_err(|error| refused(&error))?;
    let description = format!("{} at {}", config.model, config.base_url);
    // The client reads deadlines on a clock whose epoch is now, a moment before the
    // runtime's: its time budgets come out a few microseconds short, never long.
    let client =
        troupe_agent::OpenAiClient::new(config, troupe_runtime::Clock::new()).map_err(|error| refused(&error))?;
    Ok(Some((Arc::new(client), description)))
}

#[cfg(madsim)]
fn real_model() -> Result<Option<RealModel>, String> {
    Ok(None)
}

/// A store opened by [`open_store`]: the store, its file, and the temporary directory
/// (if any) that holds it, removed when dropped.
type OpenedStore = (Arc<dyn StateStore>, std::path::PathBuf, Option<tempfile::TempDir>);

/// The SQLite store in DIR/troupe.db, or in a new temporary directory (named with
/// `prefix`) that is removed when the returned guard drops. `flag` names the option that
/// gave DIR, for the refusal of a DIR that is a file. Called once everything that can
/// refuse the run before it starts has been checked: a refused run creates no DIR.
fn open_store(dir: Option<&std::path::Path>, flag: &str, prefix: &str) -> Result<OpenedStore, String> {
    let (directory, temporary) = match dir {
        // Until 2026-12-06 this read "cannot create FILE: File exists".
        Some(dir) if dir.exists() && !dir.is_dir() => {
            return Err(format!(
                "{flag} {}: not a directory; {flag} takes a directory, the state goes in DIR/troupe.db",
                dir.display()
            ))
        }
        Some(dir) => (dir.to_path_buf(), None),
        None => {
            let temporary = tempfile::Builder::new()
                .prefix(prefix)
                .tempdir()
                .map_err(|error| format!("cannot create a temporary directory: {error}"))?;
            (temporary.path().to_path_buf(), Some(temporary))
        }
    };
    // The refusals name the flag and say what to do (until 2026-12-07: "cannot create
    // DIR: ..." and "cannot open DIR/troupe.db: ...", without the flag).
    let given = if temporary.is_some() {
        "the temporary directory".to_string()
    } else {
        format!("{flag} {}", directory.display())
    };
    std::fs::create_dir_all(&directory).map_err(|error| {
        format!("{given}: cannot create the directory ({error}); give {flag} a directory you can write")
    })?;
    let path = directory.join("troupe.db");
    let store: Arc<dyn StateStore> = Arc::new(SqliteStore::open(&path).map_err(|error| {
        format!(
            "{given}: cannot use {} as the store ({error}); give {flag} another directory (a new one is made), \
             or move that file away if it is not a Troupe store",
            path.display()
        )
    })?);
    Ok((store, path, temporary))
}

async fn demo(args: DemoArgs) -> Result<bool, String> {
    let real = if args.scripted { None } else { real_model()? };
    // Read before the store is opened: a file that cannot be used creates no --data-dir.
    let org = match &args.config {
        Some(path) => Some(troupe_agent::OrgConfig::from_file(path).map_err(|error| error.to_string())?),
        None => None,
    };
    // Without --data-dir, a new temporary directory, removed when `temporary` drops.
    let (store, path, temporary) = open_store(args.data_dir.as_deref(), "--data-dir", "troupe-demo-")?;
    if let (Some(config), Some(config_path)) = (&org, &args.config) {
        let ok = org_demo(store, config, config_path).await;
        drop(temporary);
        return ok;
    }
    let scripted = real.is_none();
    let (llm, model, description): (Arc<dyn LlmClient>, String, String) = match real {
        Some((client, description)) => (client, String::new(), format!("real model: {description}")),
        None => (
            Arc::new(demo_script()),
            "scripted".to_string(),
            "scripted model (no API key needed)".to_string(),
        ),
    };
    troupe_cli::outln!("Troupe demo: five agents as virtual actors, {description}");
    troupe_cli::outln!(
        "state: {} (SQLite){}",
        path.display(),
        if temporary.is_some() { ", removed at exit" } else { "" }
    );
    troupe_cli::outln!();
    troupe_cli::outln!("user -> coordinator: {DEMO_QUESTION}");
    let report = run_demo(store, llm, &model).await.map_err(|error| error.to_string())?;
    match &report.answer {
        Ok(reply) => troupe_cli::outln!("coordinator: {}", reply.text),
        Err(error) => {
            troupe_cli::outln!("coordinator failed: {error}");
            if !scripted {
                // What a new user can do about a real model that fails.
                troupe_cli::outln!(
                    "(the agents think with the real model of OPENAI_API_KEY: check it, OPENAI_BASE_URL and \
                     OPENAI_MODEL, or run `troupe demo --scripted`)"
                );
            }
        }
    }
    troupe_cli::outln!();
    troupe_cli::outln!("Call tree (caller -> callee, depth, duration, outcome):");
    troupe_cli::out!("{}", report.tree);
    troupe_cli::outln!();
    troupe_cli::outln!(
        "calls: {} ok, {} refused, {} timed out, {} failed; turns run: {}, rolled back: {} failed, {} cancelled \
         (their caller stopped waiting)",
        report.count("ok"),
        report.count("refused"),
        report.count("timeout"),
        report.count("failed"),
        report.counters.turns_run,
        report.counters.turns_failed,
        // The archivist's, cut when its caller's 1.5 s ran out: until 2026-12-07 the line
        // said "turns rolled back: 0" under a tree that shows it cancelled.
        report.counters.turns_abandoned,
    );
    let logs: Vec<String> = report
        .log_lengths
        .iter()
        .map(|(agent, n)| format!("{agent} {n}"))
        .collect();
    troupe_cli::outln!();
    troupe_cli::outln!("user -> coordinator (notification): {DEMO_HANDOFF}");
    for line in &report.handoff {
        troupe_cli::outln!("  {line}");
    }
    troupe_cli::outln!("messages in each agent's durable log: {}", logs.join(", "));
    drop(temporary);
    if scripted && !report.scripted_story_happened() {
        return Err("the scripted demo did not play out as expected (see the call tree above)".to_string());
    }
    Ok(report.answer.is_ok())
}

/// `troupe serve`: the organisation of [`serve_organisation`] over HTTP until SIGTERM,
/// SIGINT (ctrl-c) or SIGHUP: `first`, which lets the requests in flight finish; `second`
/// (the next signal) stops at once. Whether it stopped without an error; a refusal is
/// written on stderr (`troupe: ...`) through the log queue, so a stderr nobody reads
/// never blocks the exit (until 2026-12-07 it was written after the queue's end,
/// directly, and blocked forever on a full pipe).
#[cfg(not(madsim))]
async fn serve(args: ServeArgs, first: StopSignal, second: StopSignal) -> bool {
    // Its stdout lines (the address, `stopped`) go through a queue of their own too: a
    // full stdout pipe no longer blocks the start (until 2026-12-07 it never served).
    let out = troupe_cli::log_lines::LogLines::stdout("troupe serve");
    let (otel, mut lines) = match init_logging("troupe serve", args.log_format, args.otlp_endpoint.as_deref()) {
        Ok(logging) => logging,
        Err(message) => {
            troupe_cli::errln!("troupe: {message}");
            return false;
        }
    };
    lines.report_dropped_lines();
    let served = serve_logged(args, first, second, otel).await;
    if let Err(message) = &served {
        troupe_cli::errln!("troupe: {message}");
    }
    // The lines still queued reach stderr and stdout (bounded), the count of dropped
    // ones last.
    tokio::join!(lines.finish(), out.finish());
    served.is_ok()
}

/// [`serve`] once its log is set up.
#[cfg(not(madsim))]
async fn serve_logged(args: ServeArgs, first: StopSignal, second: StopSignal, otel: OtelGuard) -> Result<(), String> {
    use troupe_agent::AgentSystem;
    use troupe_server::ServerConfig;

    // All within their ranges (checked by clap, and by `check_bind` below).
    let as_count = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
    let mut config = ServerConfig::default()
        .concurrent_requests_max(as_count(args.concurrent_requests_max))
        .streams_open_max(as_count(args.streams_open_max))
        .a2a_tasks_kept(as_count(args.a2a_tasks_kept))
        .connections_max(as_count(args.max_connections))
        .log_lines_dropped(Arc::new(troupe_cli::log_lines::stderr_lines_dropped));
    // An empty token (`--token "$UNSET"`) is refused as too short by `check_bind`: until
    // 2026-12-06 it was taken as no token, and the server served without one.
    if let Some(token) = args.token.clone() {
        config = config.token(token);
    }
    // Refuse a bad address, token or limit before anything starts.
    config.check_bind(args.bind).map_err(|error| error.to_string())?;
    let real = if args.scripted { None } else { real_model()? };
    // A config file replaces the built-in organisation (read before anything starts, so
    // a broken file stops here naming its line and field).
    let org = match &args.config {
        Some(file) => Some(troupe_agent::OrgConfig::from_file(file).map_err(|error| error.to_string())?),
        None => None,
    };
    // Served, not refused: agents may be created through the API, and an earlier run's
    // are kept in --db. Until 2026-12-06 such a file served 0 agents without a word.
    if let (Some(org), Some(file)) = (&org, &args.config) {
        if org.agents.is_empty() {
            troupe_cli::errln!(
                "troupe serve: warning: --config {} declares no [[agents]]: the server has only the agents \
                 created through POST /v1/agents (and those an earlier run kept in --db); a minimal agent entry \
                 is the two lines `[[agents]]` and `id = \"assistant\"` (see examples/org.toml)",
                file.display()
            );
        }
    }
    // The port before the store: a run that cannot listen writes nothing (until
    // 2026-12-06 it had created `--db` and synced the config into it first).
    let listener = tokio::net::TcpListener::bind(args.bind)
        .await
        .map_err(|error| troupe_cli::listen_refusal("--bind", args.bind, &error))?;
    let (store, path, temporary) = open_store(args.db.as_deref(), "--db", "troupe-serve-")?;
    let (agents, script) = match &org {
        Some(_) => (Vec::new(), troupe_cli::org_demo_script()),
        None => serve_organisation(if real.is_some() { "" } else { "scripted" }),
    };
    let (llm, description): (Arc<dyn LlmClient>, String) = match real {
        Some((client, description)) => (client, format!("real model: {description}")),
        // A server runs for long: the scripted model must not keep every request it
        // answered (up to 100,000 prompts, tens of KiB each; found by the soak of
        // scripts/load-serve, docs/serve.md).
        None => (Arc::new(script.without_recording()), "scripted model".to_string()),
    };
    let mut builder = AgentSystem::builder().store(store).llm(llm);
    let mut count = agents.len();
    for spec in agents {
        builder = builder.agent(spec);
    }
    let system = builder.start().map_err(|error| error.to_string())?;
    if let (Some(org), Some(file)) = (&org, &args.config) {
        system
            .apply_config(org)
            .await
            .map_err(|error| format!("{}: the config could not be applied: {error}", file.display()))?;
        count = org.agent_specs().len();
    }
    let local = listener
        .local_addr()
        .map_err(|error| format!("cannot read the listening address: {error}"))?;
    troupe_cli::outln!(
        "troupe serve: {count} agents, {description}, state in {}{}",
        path.display(),
        if temporary.is_some() { " (removed at exit)" } else { "" }
    );
    // A line (stdout is line-buffered): written as soon as stdout is read.
    troupe_cli::outln!("listening on http://{local}");
    // The first SIGTERM, ctrl-c or SIGHUP stops accepting and lets requests in flight
    // finish (up to the grace); a second one during it stops at once. Until 2026-12-06 a
    // second signal was ignored, and the process waited for the requests in flight
    // anyway. One that came while it started (the signals are watched from `main`'s
    // command starts) stops it as soon as it serves, removing its temporary state.
    let served = tokio::select! {
        biased;
        served = troupe_server::serve(listener, system.client(), config, first) => Some(served),
        () = second => None,
    };
    if served.is_none() {
        troupe_cli::errln!("troupe serve: a second signal: stopping now, without waiting for the requests in flight");
        // The runtime's stop waits for the turns running: past this bound they are cut
        // as by a crash (a turn commits whole or not at all).
        let wait = std::time::Duration::from_millis(troupe_cli::SERVE_SECOND_SIGNAL_SHUTDOWN_WAIT_MS);
        if tokio::time::timeout(wait, system.shutdown()).await.is_err() {
            troupe_cli::errln!(
                "troupe serve: turns still running after {} ms were cut (a turn commits whole or not at all)",
                troupe_cli::SERVE_SECOND_SIGNAL_SHUTDOWN_WAIT_MS
            );
        }
    } else {
        system.shutdown().await;
    }
    drop(temporary);
    #[cfg(feature = "otel")]
    if let Some(guard) = otel {
        if let Err(error) = guard.shutdown().await {
            troupe_cli::errln!("troupe serve: {error}");
        }
    }
    #[cfg(not(feature = "otel"))]
    let _: OtelGuard = otel;
    let Some(served) = served else {
        return Err(
            "stopped by a second signal: the requests in flight were cut (a turn commits whole or not at \
             all); what was acknowledged before is kept"
                .to_string(),
        );
    };
    served.map_err(|error| error.to_string())?;
    troupe_cli::outln!("troupe serve: stopped");
    Ok(())
}

/// Logs to stderr in `format`, filtered by RUST_LOG (or [`SERVE_LOG_FILTER_DEFAULT`]).
/// With RUST_LOG set, every span it enables also logs one line when it closes, with its
/// fields and its busy and idle times (without it, a request logs no line): a request's `http_request` line carries its status and latency, and its
/// `invoke`, `turn` and `model_call` lines list it among their ancestors. With
/// `otlp_endpoint` (feature `otel`), the same spans are also exported over OTLP/HTTP;
/// the guard returned flushes them. The lines go through a bounded queue
/// ([`troupe_cli::log_lines::LogLines`], of `program`): a stderr read slowly or not at all
/// never stalls the program, and lines dropped are counted; finish it at exit.
#[cfg(not(madsim))]
fn init_logging(
    program: &'static str,
    format: troupe_cli::LogFormat,
    otlp_endpoint: Option<&str>,
) -> Result<(OtelGuard, troupe_cli::log_lines::LogLines), String> {
    use std::io::IsTerminal as _;
    use tracing_subscriber::fmt::format::FmtSpan;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    use tracing_subscriber::{EnvFilter, Layer as _};

    // The spans' close lines are the per-request detail (a coordinator request wrote 32
    // of them, about 14 KiB): written only when RUST_LOG asks for a filter. Until
    // 2026-12-06 the default wrote them too, and a server whose stderr nobody read (a full
    // 64 KiB pipe) stalled on its next line after a few requests.
    let (filter, span_lines) = match std::env::var("RUST_LOG") {
        Ok(directives) if !directives.trim().is_empty() => (
            EnvFilter::try_new(&directives).map_err(|error| format!("RUST_LOG={directives}: {error}"))?,
            FmtSpan::CLOSE,
        ),
        _ => (EnvFilter::new(troupe_cli::SERVE_LOG_FILTER_DEFAULT), FmtSpan::NONE),
    };
    // Until 2026-12-06 written from the thread that logged (`with_writer(std::io::stderr)`):
    // with RUST_LOG set, a stderr nobody read stalled the server after about 64 requests.
    let queue = troupe_cli::log_lines::LogLines::stderr(program);
    let lines = tracing_subscriber::fmt::layer()
        .with_span_events(span_lines)
        .with_writer(queue.writer());
    let lines = match format {
        troupe_cli::LogFormat::Text => lines.with_ansi(std::io::stderr().is_terminal()).boxed(),
        troupe_cli::LogFormat::Json => lines.json().with_current_span(true).with_span_list(true).boxed(),
    };
    #[cfg(feature = "otel")]
    let (export, guard) = match otlp_endpoint {
        Some(endpoint) => {
            let (layer, guard) = troupe_server::otel::layer(endpoint, "troupe").map_err(|error| error.to_string())?;
            (Some(layer), Some(guard))
        }
        None => (None, None),
    };
    #[cfg(not(feature = "otel"))]
    let (export, guard) = match otlp_endpoint {
        Some(endpoint) => {
            return Err(format!(
                "--otlp-endpoint {endpoint}: this troupe was built without OpenTelemetry; \
                 build it with `cargo build -p troupe-cli --features otel`"
            ))
        }
        None => (None::<tracing_subscriber::layer::Identity>, None),
    };
    tracing_subscriber::registry()
        .with(lines)
        .with(export)
        .with(filter)
        .try_init()
        .map_err(|error| format!("cannot install the logger: {error}"))?;
    Ok((guard, queue))
}

/// What flushes the OpenTelemetry export at exit (nothing without the `otel` feature).
#[cfg(all(not(madsim), feature = "otel"))]
type OtelGuard = Option<troupe_server::otel::OtelGuard>;
#[cfg(all(not(madsim), not(feature = "otel")))]
type OtelGuard = Option<std::convert::Infallible>;

/// `troupe demo --config FILE`: the organisation of FILE on the scripted model.
async fn org_demo(
    store: Arc<dyn StateStore>,
    config: &troupe_agent::OrgConfig,
    path: &std::path::Path,
) -> Result<bool, String> {
    troupe_cli::outln!(
        "Troupe organisation demo: {} agents, {} links, {} permission rules, policy {:?}, from {} (scripted model)",
        config.agents.len(),
        config.links.len(),
        config.permissions.len(),
        config.policy,
        path.display()
    );
    troupe_cli::outln!("Every agent tries to contact every other agent (call_agent).");
    troupe_cli::outln!();
    let report = run_org_demo(store, config).await?;
    troupe_cli::outln!("Who talked to whom:");
    for contact in &report.contacts {
        let detail = if contact.detail.is_empty() {
            String::new()
        } else {
            format!(": {}", contact.detail)
        };
        troupe_cli::outln!("  {} -> {}  {}{detail}", contact.from, contact.to, contact.label);
    }
    troupe_cli::outln!();
    troupe_cli::outln!(
        "contacts: {} ok, {} not permitted, {} other",
        report.with_label("ok").len(),
        report.with_label("not permitted").len(),
        report.contacts.len() - report.with_label("ok").len() - report.with_label("not permitted").len(),
    );
    Ok(true)
}

/// The exit code of a demo stopped by ctrl-c or SIGTERM: 128 + SIGINT, as a shell reports
/// a command ctrl-c stopped.
const DEMO_INTERRUPTED_EXIT_CODE: u8 = 130;

/// `work`'s output, or `None` if SIGTERM, ctrl-c or SIGHUP came first: `work` is then
/// dropped, and with it what it holds (the demo's temporary directory). Until 2026-12-06
/// the demo died by the signal and left its `troupe-demo-*` directory behind.
#[cfg(not(madsim))]
async fn interruptible<T>(work: impl std::future::Future<Output = T>) -> Option<T> {
    // Watched before `work` first runs: before it creates anything.
    let (stop, _) = troupe_cli::signals::stop_signals("troupe demo");
    tokio::select! {
        biased;
        () = stop => None,
        output = work => Some(output),
    }
}

/// Under the simulator there are no signals.
#[cfg(madsim)]
async fn interruptible<T>(work: impl std::future::Future<Output = T>) -> Option<T> {
    Some(work.await)
}

#[tokio::main]
async fn main() -> ExitCode {
    // `--help`, `--version` and parse errors print and exit here (errors with code 2).
    let cli = Cli::parse();
    match cli.command {
        Command::Demo(demo_args) => match interruptible(demo(demo_args)).await {
            None => {
                // Its temporary directory (without --data-dir) went with the dropped demo.
                troupe_cli::errln!("troupe: interrupted");
                ExitCode::from(DEMO_INTERRUPTED_EXIT_CODE)
            }
            Some(Ok(true)) => ExitCode::SUCCESS,
            Some(Ok(false)) => ExitCode::FAILURE,
            Some(Err(message)) => {
                troupe_cli::errln!("troupe: {message}");
                ExitCode::FAILURE
            }
        },
        #[cfg(not(madsim))]
        Command::Serve(serve_args) => {
            // Watched before anything is created: a signal while the server starts no
            // longer kills it with its temporary state left behind.
            let (first, second) = troupe_cli::signals::stop_signals("troupe serve");
            // Its refusal is written by `serve`, through the log queue.
            if serve(serve_args, first, second).await {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        #[cfg(not(madsim))]
        Command::Node(node_args) => {
            // As `troupe serve`: watched first; a second signal stops at once.
            let (first, second) = troupe_cli::signals::stop_signals("troupe node");
            // As `troupe serve`'s: a full stdout pipe never blocks it.
            let out = troupe_cli::log_lines::LogLines::stdout("troupe node");
            // Kept alive until the node stops (it flushes an OTLP export, if any, on drop).
            let (_otel, mut lines) = match init_logging("troupe node", troupe_cli::LogFormat::Text, None) {
                Ok(logging) => logging,
                Err(message) => {
                    troupe_cli::errln!("troupe: {message}");
                    return ExitCode::FAILURE;
                }
            };
            lines.report_dropped_lines();
            // With --config, the agents use a real model when OPENAI_API_KEY is set (as
            // `troupe serve`), else the scripted one.
            let model = if node_args.config.is_some() && !node_args.scripted {
                match real_model() {
                    Ok(model) => model.map(|(client, _)| client),
                    Err(message) => {
                        troupe_cli::errln!("troupe: {message}");
                        return ExitCode::FAILURE;
                    }
                }
            } else {
                None
            };
            let ran = troupe_cli::node::run_node(&node_args, model, first, second).await;
            // Queued before the queues' end: until 2026-12-07 written after it, directly,
            // and a full stderr (or stdout) pipe nobody read blocked the exit forever.
            match &ran {
                Ok(()) => troupe_cli::outln!("troupe node: stopped"),
                Err(error) => troupe_cli::errln!("troupe: {error}"),
            }
            // The lines still queued reach stderr and stdout (bounded), the count of
            // dropped ones last.
            tokio::join!(lines.finish(), out.finish());
            match ran {
                Ok(()) => ExitCode::SUCCESS,
                Err(_) => ExitCode::FAILURE,
            }
        }
        #[cfg(madsim)]
        Command::Node(_) => {
            troupe_cli::errln!("troupe: node is not built under the simulator (--cfg madsim)");
            ExitCode::FAILURE
        }
        #[cfg(madsim)]
        Command::Serve(_) => {
            troupe_cli::errln!("troupe: serve is not built under the simulator (--cfg madsim)");
            ExitCode::FAILURE
        }
    }
}
