//! Probes of `McpServer` against MCP servers that misbehave, as an embedder meets them:
//! a server that exits at start, never answers, crashes mid-call, lists a tool whose
//! schema does not compile, answers with a huge result, is slow to list its tools; and
//! one server shared by several agents at once.
//!
//! Goal: each misbehaviour ends in a typed error within its bound (the connect timeout,
//! or the turn's deadline), the model reads a tool failure as a tool result, nothing
//! hangs, and no child process is left behind (alive or a zombie).
//!
//! Method: the server is this crate's `troupe-mcp-echo` binary, with `--mode MODE`
//! for the misbehaviours (`src/bin/troupe-mcp-echo/misbehave.rs`), or a shell command.
//! The model is scripted. Every wait is bounded.
//!
//! Run: `cargo nextest run -p troupe-agent --test mcp_probes`.

#![cfg(all(not(madsim), target_os = "linux"))]
// Wall-clock timing of real child processes is the point here; never simulated.
#![allow(clippy::disallowed_methods)]

#[path = "../src/bin/troupe-mcp-echo/echo.rs"]
mod echo;
#[path = "support/mcp_setup.rs"]
mod mcp_setup;

use std::sync::Arc;
use std::time::{Duration, Instant};

use mcp_setup::{calling_agent, serve_http, CONNECT_TIMEOUT, ECHO_SERVER, EXIT_WAIT_MS, POLL_MS};
use serde_json::json;
use troupe_agent::{AgentSpec, AgentSystem, McpError, McpServer, ScriptRule, ScriptedLlm};

/// How much later than its bound a wait may end (ms).
const SLACK_MS_MAX: u64 = 1_500;

/// The pids and states of this process's children whose command line holds `marker`
/// (zombies included: a child killed but never waited for is one).
fn children_with(marker: &str) -> Vec<(u32, String)> {
    let me = std::process::id();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc is readable").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some(close) = stat.rfind(')') else { continue };
        let mut rest = stat[close + 1..].split_whitespace();
        let (Some(state), Some(ppid)) = (rest.next(), rest.next()) else {
            continue;
        };
        if ppid.parse::<u32>() != Ok(me) {
            continue;
        }
        // A zombie's command line is empty: it is known by the marker in its name then.
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        let comm = &stat[stat.find('(').map_or(0, |open| open + 1)..close];
        if cmdline.contains(marker) || (state == "Z" && marker.contains(comm)) {
            found.push((pid, state.to_owned()));
        }
    }
    found
}

/// Waits (at most `EXIT_WAIT_MS`) until no child with `marker` is left, alive or zombie.
async fn assert_no_child_within_wait(marker: &str, when: &str) {
    let deadline = Instant::now() + Duration::from_millis(EXIT_WAIT_MS);
    loop {
        let left = children_with(marker);
        if left.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{EXIT_WAIT_MS} ms after {when}, children are left (pid, state): {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
}

async fn misbehaving(mode: &str) -> McpServer {
    McpServer::connect_stdio(mode, ECHO_SERVER, ["--mode", mode], CONNECT_TIMEOUT)
        .await
        .expect("the echo server starts")
}

fn system_with(llm: Arc<ScriptedLlm>, server: &McpServer, agents: &[&str]) -> AgentSystem {
    let mut builder = AgentSystem::builder().llm(llm);
    for agent in agents {
        builder = builder.agent(AgentSpec::new(*agent));
    }
    for tool in server.tools().expect("the tools compile") {
        builder = builder.tool(tool);
    }
    builder.start().expect("the system starts")
}

/// A program that exits at once (before `initialize`) is a `Connect` error naming the
/// server, at once: not a `Timeout` after the whole connect timeout.
#[tokio::test]
async fn a_server_that_exits_at_start_is_a_connect_error_at_once() {
    let started = Instant::now();
    let error = McpServer::connect_stdio("quitter", "sh", ["-c", "exit 3"], CONNECT_TIMEOUT)
        .await
        .unwrap_err();
    assert!(
        matches!(&error, McpError::Connect { server, .. } if server == "quitter"),
        "{error:?}"
    );
    assert!(
        started.elapsed() < Duration::from_millis(SLACK_MS_MAX),
        "{:?}",
        started.elapsed()
    );
}

/// A program that never answers `initialize` times out at the connect timeout, and its
/// process is killed and reaped (no zombie) once the connect gave up.
#[tokio::test]
async fn a_server_that_never_answers_times_out_and_leaves_no_process() {
    let marker = "sleep 37.5";
    let started = Instant::now();
    let error = McpServer::connect_stdio(
        "mute",
        "sh",
        ["-c", &format!("exec {marker}")],
        Duration::from_millis(400),
    )
    .await
    .unwrap_err();
    assert_eq!(
        error,
        McpError::Timeout {
            server: "mute".to_owned(),
            timeout_ms: 400
        }
    );
    assert!(started.elapsed() < Duration::from_millis(400 + SLACK_MS_MAX));
    assert_no_child_within_wait(marker, "the connect timed out").await;
}

/// A server slow to list its tools (30 s) is bounded by the connect timeout, and its
/// process is gone afterwards.
#[tokio::test]
async fn a_server_slow_to_list_its_tools_times_out() {
    let started = Instant::now();
    let error = McpServer::connect_stdio("slow", ECHO_SERVER, ["--mode", "slow-list"], Duration::from_millis(500))
        .await
        .unwrap_err();
    assert!(matches!(error, McpError::Timeout { timeout_ms: 500, .. }), "{error:?}");
    assert!(started.elapsed() < Duration::from_millis(500 + SLACK_MS_MAX));
    assert_no_child_within_wait("slow-list", "the connect timed out").await;
}

/// A listed tool whose schema does not compile: it is skipped (no panic), reported as a
/// typed `InvalidToolSchema` naming it by `skipped_tools()`, and the server's other
/// tools are offered (see `mcp_leftovers.rs`); the names are still listed.
#[tokio::test]
async fn a_tool_with_a_schema_that_does_not_compile_is_a_typed_error() {
    let server = misbehaving("bad-schema").await;
    assert!(server.tool_names().contains(&"broken".to_owned()));
    let skipped = server.skipped_tools();
    assert!(
        matches!(skipped.as_slice(), [McpError::InvalidToolSchema { tool, .. }] if tool == "broken"),
        "{skipped:?}"
    );
}

/// A server that exits in the middle of a call: the model reads a tool failure at once
/// (not a wait until the turn's deadline), the turn answers, and the next call to the
/// dead server fails at once too.
#[tokio::test]
async fn a_server_that_crashes_mid_call_is_a_tool_failure_at_once() {
    let server = misbehaving("crash").await;
    let llm = Arc::new(calling_agent("crash", json!({})));
    let system = system_with(llm.clone(), &server, &["calc"]);
    let timeout = Duration::from_secs(10);

    for attempt in 0..2 {
        let started = Instant::now();
        let reply = system.ask_with_timeout("calc", "go", timeout).await;
        let elapsed = started.elapsed();
        let reply = reply.unwrap_or_else(|error| panic!("attempt {attempt}: {error:?} after {elapsed:?}"));
        assert!(
            reply.text.starts_with("result: error: crash failed: "),
            "attempt {attempt}: {}",
            reply.text
        );
        // What failed and what to do: the server (by name) is gone, until connected
        // again. Before: "crash failed: the MCP call failed: Transport closed".
        for part in ["MCP server \"crash\" is gone", "connect"] {
            assert!(
                reply.text.contains(part),
                "attempt {attempt}: {part:?} in {}",
                reply.text
            );
        }
        assert!(
            elapsed < Duration::from_millis(SLACK_MS_MAX),
            "attempt {attempt} waited {elapsed:?}: {}",
            reply.text
        );
    }
    system.shutdown().await;
    drop(server);
    assert_no_child_within_wait("crash", "the server crashed and was dropped").await;
}

/// A result of 4 MiB reaches the model cut to `MCP_TOOL_RESULT_BYTES_MAX` or less
/// (the agent's own limit on a tool result may be lower).
#[tokio::test]
async fn a_huge_result_is_cut() {
    let server = misbehaving("huge").await;
    let llm = Arc::new(calling_agent("huge", json!({"bytes": 4 * 1024 * 1024})));
    let system = system_with(llm.clone(), &server, &["calc"]);

    let reply = system.ask("calc", "go").await.unwrap();

    let seen = llm.tool_results_seen_by("calc");
    assert_eq!(seen.len(), 1);
    assert!(
        seen[0].len() <= troupe_agent::MCP_TOOL_RESULT_BYTES_MAX,
        "{}",
        seen[0].len()
    );
    assert!(seen[0].starts_with("xxxx"));
    assert!(reply.text.starts_with("result: xxxx"));
    system.shutdown().await;
}

/// Eight agents share one stdio server and call it at once, each with its own numbers,
/// on a multi-threaded runtime: every answer is its own sum.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_sharing_one_server_get_their_own_answers() {
    let server = McpServer::connect_stdio("echo", ECHO_SERVER, std::iter::empty::<&str>(), CONNECT_TIMEOUT)
        .await
        .expect("the echo server starts");
    let agents: Vec<String> = (0..8).map(|index| format!("calc{index}")).collect();
    let mut llm = ScriptedLlm::new();
    for (index, agent) in agents.iter().enumerate() {
        llm = llm
            .rule(
                ScriptRule::agent(agent)
                    .on_user_containing("go")
                    .call("add", json!({"a": index * 1000, "b": 7})),
            )
            .rule(ScriptRule::agent(agent).on_tool_result().reply("{tool_result}"));
    }
    let names: Vec<&str> = agents.iter().map(String::as_str).collect();
    let system = system_with(Arc::new(llm), &server, &names);

    let asks = agents.iter().map(|agent| {
        let client = system.client();
        let agent = agent.clone();
        tokio::spawn(async move { client.ask(&agent, "go").await })
    });
    let replies = tokio::time::timeout(Duration::from_secs(20), futures::future::join_all(asks))
        .await
        .expect("every ask ends");
    for (index, reply) in replies.into_iter().enumerate() {
        let reply = reply.unwrap().unwrap();
        assert_eq!(reply.text, (index * 1000 + 7).to_string());
    }
    system.shutdown().await;
}

/// Whether `name` is a tool name OpenAI-compatible providers accept
/// (`^[a-zA-Z0-9_-]{1,64}$`).
fn provider_accepts(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|byte| byte.is_ascii_alphanumeric() || byte == b'_' || byte == b'-')
}

/// A server whose tool names MCP allows but model providers refuse (`files.read`, a
/// space, 100 characters): the tools are offered under names the provider accepts
/// (distinct), and a call under such a name reaches the server's tool of the original
/// name. Before, the names were offered as they were, and a provider refused every
/// request of every agent that had them (OpenAI: 400, "does not match pattern").
#[tokio::test]
async fn tool_names_a_provider_refuses_are_offered_under_names_it_accepts() {
    let server = misbehaving("odd-names").await;
    let tools = server.tools().unwrap();
    let names: Vec<String> = tools.iter().map(|tool| tool.spec().name.clone()).collect();
    for name in &names {
        assert!(provider_accepts(name), "{name:?} is offered; all: {names:?}");
    }
    let mut distinct = names.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), names.len(), "{names:?}");
    for (original, expected) in [
        ("echo", "echo"),
        ("files.read", "files_read"),
        ("read file", "read_file"),
    ] {
        assert!(
            names.iter().any(|name| name == expected),
            "{original:?} is not offered as {expected:?}: {names:?}"
        );
    }
    let prefixed = server.tools_with_prefix("fs.").unwrap();
    assert!(prefixed.iter().all(|tool| provider_accepts(&tool.spec().name)));

    let long = names
        .iter()
        .find(|name| name.starts_with("nnnn"))
        .expect("the long name is offered")
        .clone();
    let llm = Arc::new(
        ScriptedLlm::new()
            .rule(
                ScriptRule::agent("calc")
                    .on_user_containing("dot")
                    .call("files_read", json!({})),
            )
            .rule(
                ScriptRule::agent("calc")
                    .on_user_containing("long")
                    .call(&long, json!({})),
            )
            .rule(ScriptRule::agent("calc").on_tool_result().reply("{tool_result}")),
    );
    let system = system_with(llm, &server, &["calc"]);
    assert_eq!(system.ask("calc", "dot").await.unwrap().text, "called files.read");
    assert_eq!(
        system.ask("calc", "long").await.unwrap().text,
        format!("called {}", "n".repeat(100))
    );
    system.shutdown().await;
}

/// A server that prints a banner line on stdout before speaking MCP (many do): what
/// the embedder gets is either a working server or a typed error, within the connect
/// timeout.
#[tokio::test]
async fn a_server_that_prints_a_banner_first_works_or_is_a_typed_error() {
    let script = format!("echo 'Starting the server on stdio...'; exec {ECHO_SERVER}");
    let started = Instant::now();
    let connected = McpServer::connect_stdio("chatty", "sh", ["-c", &script], Duration::from_secs(5)).await;
    let elapsed = started.elapsed();
    let server = connected.unwrap_or_else(|error| panic!("{error:?} after {elapsed:?}"));
    let llm = Arc::new(calling_agent("add", json!({"a": 1, "b": 2})));
    let system = system_with(llm, &server, &["calc"]);
    assert_eq!(system.ask("calc", "go").await.unwrap().text, "result: 3");
    system.shutdown().await;
}

/// A streamable-HTTP server that goes away after connecting: a call is a tool failure
/// the model reads, long before the turn's deadline.
#[tokio::test]
async fn an_http_server_gone_after_connecting_is_a_tool_failure_at_once() {
    let (url, shutdown) = serve_http(echo::EchoServer).await;
    let server = McpServer::connect_http("gone-later", &url, CONNECT_TIMEOUT)
        .await
        .unwrap();
    shutdown.stop().await;

    let llm = Arc::new(calling_agent("add", json!({"a": 1, "b": 2})));
    let system = system_with(llm, &server, &["calc"]);
    let started = Instant::now();
    let reply = system.ask_with_timeout("calc", "go", Duration::from_secs(10)).await;
    let elapsed = started.elapsed();
    let reply = reply.unwrap_or_else(|error| panic!("{error:?} after {elapsed:?}"));
    assert!(reply.text.starts_with("result: error: add failed: "), "{}", reply.text);
    assert!(
        reply.text.contains("\"gone-later\""),
        "the server is named: {}",
        reply.text
    );
    assert!(
        elapsed < Duration::from_millis(SLACK_MS_MAX),
        "{elapsed:?}: {}",
        reply.text
    );
    system.shutdown().await;
}

/// On one shared server, a call cut by its turn's deadline does not disturb the calls
/// of other agents running at the same time, nor the server: four agents' `sleep`s of
/// 400..700 ms answer each its own while a fifth's `sleep` of 5 s is cancelled at its
/// 300 ms deadline (multi-threaded runtime).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_call_on_a_shared_server_leaves_the_other_calls_alone() {
    let server = McpServer::connect_stdio("echo", ECHO_SERVER, std::iter::empty::<&str>(), CONNECT_TIMEOUT)
        .await
        .expect("the echo server starts");
    let mut llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("sleeper")
                .on_user_containing("go")
                .call("sleep", json!({"ms": 5_000})),
        )
        .rule(ScriptRule::agent("sleeper").on_tool_result().reply("{tool_result}"));
    let adders: Vec<String> = (0..4).map(|index| format!("adder{index}")).collect();
    for (index, agent) in adders.iter().enumerate() {
        llm = llm
            .rule(
                ScriptRule::agent(agent)
                    .on_user_containing("go")
                    .call("sleep", json!({"ms": 400 + 100 * index})),
            )
            .rule(
                ScriptRule::agent(agent)
                    .on_tool_result()
                    .reply(format!("{agent}: {{tool_result}}")),
            );
    }
    let mut names: Vec<&str> = adders.iter().map(String::as_str).collect();
    names.push("sleeper");
    let system = system_with(Arc::new(llm), &server, &names);

    let sleeper = {
        let client = system.client();
        tokio::spawn(async move {
            client
                .ask_with_timeout("sleeper", "go", Duration::from_millis(300))
                .await
        })
    };
    let asks: Vec<_> = adders
        .iter()
        .map(|agent| {
            let client = system.client();
            let agent = agent.clone();
            tokio::spawn(async move { client.ask(&agent, "go").await })
        })
        .collect();
    let started = Instant::now();
    let slept = tokio::time::timeout(Duration::from_secs(10), sleeper)
        .await
        .expect("the sleeper's ask ends")
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_millis(300 + SLACK_MS_MAX),
        "{:?}",
        started.elapsed()
    );
    match slept {
        Err(troupe_agent::AgentCallError::Invoke(troupe_core::InvokeError::Timeout { .. })) => {}
        Ok(reply) => assert_eq!(reply.text, "error: sleep did not finish before the turn's deadline"),
        Err(other) => panic!("{other:?}"),
    }
    let replies = tokio::time::timeout(Duration::from_secs(10), futures::future::join_all(asks))
        .await
        .expect("every ask ends");
    for (index, reply) in replies.into_iter().enumerate() {
        let reply = reply.unwrap().unwrap();
        assert_eq!(reply.text, format!("adder{index}: slept {} ms", 400 + 100 * index));
    }
    system.shutdown().await;
}

/// The pids of every process (not only this one's children: an orphan is adopted by
/// init) whose command line holds `marker` and that is not a zombie.
fn processes_with(marker: &str) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc is readable").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some(close) = stat.rfind(')') else { continue };
        if stat[close + 1..].split_whitespace().next() == Some("Z") {
            continue;
        }
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).replace('\0', " ").contains(marker) {
            found.push(pid);
        }
    }
    found
}

/// A server that started a helper process of its own (a browser, a language server)
/// which does not read stdin: once the server is dropped, the helper is gone too, not
/// left running as an orphan (it goes when the server's process group is killed, after
/// `MCP_CLOSE_GRACE_MS`).
#[tokio::test]
async fn a_servers_own_helper_processes_end_with_it() {
    let marker = "sleep 41.25";
    let script = format!("{marker} & exec {ECHO_SERVER}");
    let server = McpServer::connect_stdio("parent", "sh", ["-c", &script], CONNECT_TIMEOUT)
        .await
        .expect("the server starts");
    assert_eq!(processes_with(marker).len(), 1, "the helper runs");
    drop(server);
    let dropped = Instant::now();
    let wait_ms = troupe_agent::MCP_CLOSE_GRACE_MS + EXIT_WAIT_MS;
    let deadline = dropped + Duration::from_millis(wait_ms);
    loop {
        let left = processes_with(marker);
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{wait_ms} ms after the server was dropped, its helper is still running: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
}

/// The same when the runtime ends before the grace is over (an embedder's `main`
/// returning): the helper is killed as the runtime ends, not left behind.
#[test]
fn a_servers_helpers_end_with_the_runtime_that_ran_it() {
    let marker = "sleep 43.75";
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let script = format!("{marker} & exec {ECHO_SERVER}");
        let server = McpServer::connect_stdio("parent", "sh", ["-c", &script], CONNECT_TIMEOUT)
            .await
            .expect("the server starts");
        assert_eq!(processes_with(marker).len(), 1, "the helper runs");
        drop(server);
    });
    let ended = Instant::now();
    drop(runtime);
    loop {
        let left = processes_with(marker);
        if left.is_empty() {
            break;
        }
        // Well before the grace: the kill came with the runtime's end.
        assert!(
            ended.elapsed() < Duration::from_millis(SLACK_MS_MAX),
            "{:?} after the runtime ended, the helper is still running: {left:?}",
            ended.elapsed()
        );
        std::thread::sleep(Duration::from_millis(POLL_MS));
    }
}

/// An HTTP endpoint that is not an MCP server (404 at the path given): a typed
/// `Connect` error naming the server and the status, at once, not a `Timeout`.
#[tokio::test]
async fn an_http_url_that_is_not_an_mcp_server_is_a_connect_error_at_once() {
    let router = axum::Router::new().route("/", axum::routing::get(|| async { "hello" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    let started = Instant::now();
    let error = McpServer::connect_http("wrong-path", &format!("http://{address}/mcp"), CONNECT_TIMEOUT)
        .await
        .unwrap_err();
    let elapsed = started.elapsed();
    task.abort();
    assert!(
        matches!(&error, McpError::Connect { server, cause } if server == "wrong-path" && cause.contains("404")),
        "{error:?} after {elapsed:?}"
    );
    assert!(elapsed < Duration::from_millis(SLACK_MS_MAX), "{elapsed:?}");
}
