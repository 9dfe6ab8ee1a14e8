//! The `troupe` command. `troupe demo` runs a small organisation of agents on the
//! embedded SQLite store and prints the call tree; see `troupe --help`.
//!
//! Run it with `cargo run --release -p troupe-cli -- demo`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use troupe_agent::LlmClient;
use troupe_cli::{demo_script, run_demo, DEMO_QUESTION};
use troupe_runtime::{SqliteStore, StateStore};

const HELP: &str = "\
troupe: a virtual-actor runtime for AI agents

USAGE:
    troupe demo [--data-dir DIR] [--scripted]
    troupe help | --help | -h
    troupe --version

COMMANDS:
    demo    Run a small organisation of five agents, each a virtual actor with its own
            model and tools. A user asks the coordinator for a brief; the coordinator asks
            the researcher and the archivist at once; the researcher asks the analyst; the
            analyst tries to call the coordinator back up the chain and is refused (the
            coordinator is waiting on it: a deadlock avoided); the archivist is too slow
            for its 1.5 s timeout and its late answer is discarded. Prints the answer and
            the call tree with depths, durations and outcomes.

            Without OPENAI_API_KEY the agents think with a scripted, deterministic model:
            no key or network needed. With it, they use a real model.

OPTIONS (demo):
    --data-dir DIR   Keep the agents' state in DIR/troupe.db (SQLite; open it with
                     sqlite3). Agents then remember earlier runs. Default: a new
                     temporary directory, removed at the end.
    --scripted       Use the scripted model even if OPENAI_API_KEY is set.

ENVIRONMENT:
    OPENAI_API_KEY   Run the demo on an OpenAI-compatible chat-completions API.
    OPENAI_BASE_URL  The API root (default https://api.openai.com/v1).
    OPENAI_MODEL     The model (default gpt-4o-mini).
";

struct DemoArgs {
    data_dir: Option<PathBuf>,
    scripted: bool,
}

fn parse_demo(args: &[String]) -> Result<DemoArgs, String> {
    let mut parsed = DemoArgs {
        data_dir: None,
        scripted: false,
    };
    let mut rest = args.iter();
    while let Some(arg) = rest.next() {
        match arg.as_str() {
            "--data-dir" => {
                let dir = rest.next().ok_or("--data-dir needs a directory")?;
                parsed.data_dir = Some(PathBuf::from(dir));
            }
            "--scripted" => parsed.scripted = true,
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown option {other:?} for demo")),
        }
    }
    Ok(parsed)
}

/// A real model client and a description of it.
type RealModel = (Arc<dyn LlmClient>, String);

/// The real model, when `OPENAI_API_KEY` is set and the client is built in.
#[cfg(not(madsim))]
fn real_model() -> Result<Option<RealModel>, String> {
    if std::env::var("OPENAI_API_KEY").map_or(true, |key| key.trim().is_empty()) {
        return Ok(None);
    }
    let config = troupe_agent::OpenAiConfig::from_env().map_err(|error| error.to_string())?;
    let description = format!("{} at {}", config.model, config.base_url);
    // The client reads deadlines on a clock whose epoch is now, a moment before the
    // runtime's: its time budgets come out a few microseconds short, never long.
    let client =
        troupe_agent::OpenAiClient::new(config, troupe_runtime::Clock::new()).map_err(|error| error.to_string())?;
    Ok(Some((Arc::new(client), description)))
}

#[cfg(madsim)]
fn real_model() -> Result<Option<RealModel>, String> {
    Ok(None)
}

async fn demo(args: DemoArgs) -> Result<bool, String> {
    let real = if args.scripted { None } else { real_model()? };
    let (directory, temporary) = match &args.data_dir {
        Some(dir) => (dir.clone(), false),
        None => (
            std::env::temp_dir().join(format!("troupe-demo-{}", std::process::id())),
            true,
        ),
    };
    std::fs::create_dir_all(&directory).map_err(|error| format!("cannot create {}: {error}", directory.display()))?;
    let path = directory.join("troupe.db");
    let store: Arc<dyn StateStore> =
        Arc::new(SqliteStore::open(&path).map_err(|error| format!("cannot open {}: {error}", path.display()))?);
    let scripted = real.is_none();
    let (llm, model, description): (Arc<dyn LlmClient>, String, String) = match real {
        Some((client, description)) => (client, String::new(), format!("real model: {description}")),
        None => (
            Arc::new(demo_script()),
            "scripted".to_string(),
            "scripted model (no API key needed)".to_string(),
        ),
    };
    println!("Troupe demo: five agents as virtual actors, {description}");
    println!(
        "state: {} (SQLite){}",
        path.display(),
        if temporary { ", removed at exit" } else { "" }
    );
    println!();
    println!("user -> coordinator: {DEMO_QUESTION}");
    let report = run_demo(store, llm, &model).await.map_err(|error| error.to_string())?;
    match &report.answer {
        Ok(reply) => println!("coordinator: {}", reply.text),
        Err(error) => println!("coordinator failed: {error}"),
    }
    println!();
    println!("Call tree (caller -> callee, depth, duration, outcome):");
    print!("{}", report.tree);
    println!();
    println!(
        "calls: {} ok, {} refused, {} timed out, {} failed; turns run: {}, turns rolled back: {}",
        report.count("ok"),
        report.count("refused"),
        report.count("timeout"),
        report.count("failed"),
        report.counters.turns_run,
        report.counters.turns_failed,
    );
    let logs: Vec<String> = report
        .log_lengths
        .iter()
        .map(|(agent, n)| format!("{agent} {n}"))
        .collect();
    println!("messages in each agent's durable log: {}", logs.join(", "));
    if temporary {
        let _ = std::fs::remove_dir_all(&directory);
    }
    if scripted && !report.scripted_story_happened() {
        return Err("the scripted demo did not play out as expected (see the call tree above)".to_string());
    }
    Ok(report.answer.is_ok())
}

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        None | Some("help" | "-h" | "--help") => {
            print!("{HELP}");
            ExitCode::SUCCESS
        }
        Some("--version" | "-V") => {
            println!("troupe {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        Some("demo") => match parse_demo(&args[1..]) {
            Err(message) if message.is_empty() => {
                print!("{HELP}");
                ExitCode::SUCCESS
            }
            Err(message) => {
                eprintln!("troupe: {message}\n\n{HELP}");
                ExitCode::from(2)
            }
            Ok(demo_args) => match demo(demo_args).await {
                Ok(true) => ExitCode::SUCCESS,
                Ok(false) => ExitCode::FAILURE,
                Err(message) => {
                    eprintln!("troupe: {message}");
                    ExitCode::FAILURE
                }
            },
        },
        Some(other) => {
            eprintln!("troupe: unknown command {other:?}\n\n{HELP}");
            ExitCode::from(2)
        }
    }
}
