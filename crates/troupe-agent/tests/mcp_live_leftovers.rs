//! Two edges of an attached MCP server's changing list (`AgentSystemBuilder::mcp_server`):
//! an agent defined while the system runs, and a server whose process exited.
//!
//! Goal: `AgentClient::define_agent` accepts a tool an attached server lists now, though
//! the system did not have it at start, and refuses a name no one lists with
//! `AgentSpecError::UnknownTool` naming the tool and the attached servers; when the
//! server drops the tool, the agent stays defined, is not offered it, and a call of it
//! reads `McpError::ToolGone`'s text; when the server lists it again, the agent is
//! offered it again. A stdio server that exited is started again by the next model step
//! that finds it dead (at most once per `MCP_DEAD_SERVER_RESTART_INTERVAL_MS`, once for
//! steps that find it dead at once), so its new list is offered without a call of one of
//! its tools.
//!
//! Method: a real rmcp server in-process over streamable HTTP on `127.0.0.1`
//! (`support/mcp_setup.rs`'s `ChangingServer`: `set_extra {names}` replaces its extra
//! tools and says its list changed); this crate's `troupe-mcp-echo` binary behind
//! shell scripts that count its starts. Scripted models. Both on the current-thread and
//! the multi-threaded runtime where it matters. Every wait is bounded.
//!
//! Run: `cargo nextest run -p troupe-agent --test mcp_live_leftovers`.

#![cfg(all(not(madsim), target_os = "linux"))]
// Real servers (a child process, loopback HTTP) are the point here; never simulated.
#![allow(clippy::disallowed_methods)]

#[path = "support/mcp_setup.rs"]
mod mcp_setup;

use std::sync::Arc;
use std::time::{Duration, Instant};

use mcp_setup::{
    attached_system, calling_agents, changing_server, counting_script, growing_agents, starts, upgrading_server,
    wait_for, wait_until_disconnected, CONNECT_TIMEOUT, ECHO_SERVER,
};
use troupe_agent::{
    AgentSpec, AgentSpecError, AgentSystem, DirectoryError, LlmRequest, McpError, McpServer, ScriptRule,
    MCP_DEAD_SERVER_RESTART_INTERVAL_MS,
};
use troupe_runtime::{MemoryStore, StateStore};

/// The tool names of request `request`.
fn offered(request: &LlmRequest) -> Vec<String> {
    request.tools.iter().map(|tool| tool.name.clone()).collect()
}

/// The scenario of the two tests below: `fresh` appears in the server's list; an agent
/// defined then names it, is offered it and calls it; a name no one lists is refused,
/// naming the server; `fresh` leaves the list: the agent stays, is offered nothing, and
/// its call reads `ToolGone`; a new definition naming `fresh` is refused; `fresh` comes
/// back: the agent is offered it and calls it again.
async fn an_agent_defined_later_may_name_a_tool_a_server_lists_now() {
    let (server, _shutdown) = changing_server().await;
    let llm = Arc::new(growing_agents());
    let system = attached_system(llm.clone(), &["boss"], &server);
    assert_eq!(system.ask("boss", "grow").await.unwrap().text, "result: set");
    wait_for("fresh listed", || server.tool_names().contains(&"fresh".to_owned())).await;

    system
        .define_agent(AgentSpec::new("user").tools(["fresh"]))
        .await
        .expect("a tool the server lists now may be named");
    assert_eq!(
        system.ask("user", "use fresh").await.unwrap().text,
        "result: called fresh"
    );
    assert_eq!(offered(&llm.requests_of("user")[0]), ["fresh"]);

    let error = system
        .define_agent(AgentSpec::new("typo").tools(["fersh"]))
        .await
        .expect_err("a name no one lists is refused");
    let DirectoryError::Invalid(AgentSpecError::UnknownTool {
        id,
        tool,
        known,
        servers,
    }) = &error
    else {
        panic!("not UnknownTool: {error:?}");
    };
    assert_eq!((id.as_str(), tool.as_str()), ("typo", "fersh"));
    assert!(known.contains(&"fresh".to_owned()), "{known:?}");
    assert_eq!(servers, &["MCP server \"live\"".to_owned()]);
    assert!(
        error
            .to_string()
            .contains("no attached server lists it now (MCP server \"live\")"),
        "{error}"
    );
    assert!(!system.directory().contains("typo"));
    assert!(system.directory().contains("user"));

    // The server drops `fresh`: the agent stays, is offered nothing, reads ToolGone.
    assert_eq!(system.ask("boss", "shrink").await.unwrap().text, "result: set");
    wait_for("fresh gone", || !server.tool_names().contains(&"fresh".to_owned())).await;
    let gone = McpError::ToolGone {
        server: "live".into(),
        tool: "fresh".into(),
        offered: vec!["echo".into(), "set_extra".into()],
    };
    assert_eq!(
        system.ask("user", "use fresh").await.unwrap().text,
        format!("result: error: fresh failed: {gone}")
    );
    assert!(offered(llm.requests_of("user").last().unwrap()).is_empty());
    let error = system
        .define_agent(AgentSpec::new("late").tools(["fresh"]))
        .await
        .expect_err("a tool no one lists any more is refused");
    assert!(
        matches!(&error, DirectoryError::Invalid(AgentSpecError::UnknownTool { tool, .. }) if tool == "fresh"),
        "{error:?}"
    );

    // Listed again: offered again.
    assert_eq!(system.ask("boss", "grow").await.unwrap().text, "result: set");
    wait_for("fresh listed again", || {
        server.tool_names().contains(&"fresh".to_owned())
    })
    .await;
    assert_eq!(
        system.ask("user", "use fresh").await.unwrap().text,
        "result: called fresh"
    );
    assert_eq!(offered(llm.requests_of("user").last().unwrap()), ["fresh"]);
    system.shutdown().await;
}

/// Before, the catalog of tools was made at start: `define_agent` of an agent naming
/// `fresh` failed with `UnknownTool` ("registered tools: [call_agent, …, set_extra]").
#[tokio::test]
async fn define_agent_accepts_a_tool_an_attached_server_lists_now() {
    an_agent_defined_later_may_name_a_tool_a_server_lists_now().await;
}

/// As above, on worker threads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn define_agent_accepts_a_tool_an_attached_server_lists_now_on_worker_threads() {
    an_agent_defined_later_may_name_a_tool_a_server_lists_now().await;
}

/// `define_agent` stores a definition naming `fresh` while the server lists it; the
/// server then drops `fresh`, and a second system on the same store (the next start of
/// the process) reads the definition back: the agent exists there, is offered nothing,
/// and is offered `fresh` and calls it once the server lists it again. Before, the
/// stored definition was skipped ("a stored agent definition cannot run in this
/// process"): asking "user" was refused with `AgentNotFound`.
#[tokio::test]
async fn a_stored_definition_naming_a_tool_no_longer_listed_is_kept_at_the_next_start() {
    let store: Arc<dyn StateStore> = Arc::new(MemoryStore::new());
    let (server, _shutdown) = changing_server().await;
    let llm = Arc::new(growing_agents());
    let first = AgentSystem::builder()
        .store(Arc::clone(&store))
        .llm(llm.clone())
        .agent(AgentSpec::new("boss"))
        .mcp_server(server.clone())
        .start()
        .expect("the first system starts");
    assert_eq!(first.ask("boss", "grow").await.unwrap().text, "result: set");
    wait_for("fresh listed", || server.tool_names().contains(&"fresh".to_owned())).await;
    first
        .define_agent(AgentSpec::new("user").tools(["fresh"]))
        .await
        .expect("a tool the server lists now may be named");
    assert_eq!(first.ask("boss", "shrink").await.unwrap().text, "result: set");
    wait_for("fresh gone", || !server.tool_names().contains(&"fresh".to_owned())).await;
    first.shutdown().await;

    let second = AgentSystem::builder()
        .store(Arc::clone(&store))
        .llm(llm.clone())
        .agent(AgentSpec::new("boss"))
        .mcp_server(server.clone())
        .start()
        .expect("the second system starts");
    assert_eq!(second.ask("user", "hello").await.unwrap().text, "hello");
    assert!(offered(llm.requests_of("user").last().unwrap()).is_empty());
    assert_eq!(second.ask("boss", "grow").await.unwrap().text, "result: set");
    wait_for("fresh listed again", || {
        server.tool_names().contains(&"fresh".to_owned())
    })
    .await;
    assert_eq!(
        second.ask("user", "use fresh").await.unwrap().text,
        "result: called fresh"
    );
    assert_eq!(offered(llm.requests_of("user").last().unwrap()), ["fresh"]);
    second.shutdown().await;
}

/// The server exits after a call; started again, it is a newer version (no `add`, a
/// new `multiply`). No tool of it is called after it exited: the next model step
/// (of an agent asked "hello", which calls no tool) starts it again and is offered its
/// new list. Before, a dead server was started again only by a call of one of its
/// tools: the step was offered `add` and no `multiply`, and the server stayed dead.
#[tokio::test]
async fn a_dead_servers_new_list_is_offered_at_the_next_step_without_a_call() {
    let directory = tempfile::tempdir().unwrap();
    let server = upgrading_server("tools", directory.path()).await;
    let llm = Arc::new(calling_agents().rule(ScriptRule::any_agent().reply("hello")));
    let system = attached_system(llm.clone(), &["calc"], &server);
    assert_eq!(system.ask("calc", "add").await.unwrap().text, "result: 5");
    wait_until_disconnected(&server).await;
    tokio::time::sleep(Duration::from_millis(MCP_DEAD_SERVER_RESTART_INTERVAL_MS)).await;

    assert_eq!(system.ask("calc", "hello").await.unwrap().text, "hello");
    let step = offered(llm.requests_of("calc").last().unwrap());
    assert!(step.contains(&"multiply".to_owned()), "{step:?}");
    assert!(!step.contains(&"add".to_owned()), "{step:?}");
    assert!(server.is_connected());
    assert_eq!(starts(directory.path()), 2);
    assert_eq!(system.ask("calc", "multiply").await.unwrap().text, "result: 6");
    system.shutdown().await;
}

/// The server exits after a call; started again, it lists `multiply`. `define_agent`
/// of an agent naming `multiply` (which no list read so far holds) starts the dead
/// server, reads its new list and accepts the definition; the agent calls `multiply`.
/// Without the second look (tried), it was refused with `UnknownTool` (known: add,
/// call_agent, …, sleep; servers: MCP server "tools").
#[tokio::test]
async fn define_agent_starts_a_dead_server_again_to_look_for_a_tool() {
    let directory = tempfile::tempdir().unwrap();
    let server = upgrading_server("tools", directory.path()).await;
    let llm = Arc::new(calling_agents());
    let system = attached_system(llm.clone(), &["calc"], &server);
    assert_eq!(system.ask("calc", "add").await.unwrap().text, "result: 5");
    wait_until_disconnected(&server).await;
    tokio::time::sleep(Duration::from_millis(MCP_DEAD_SERVER_RESTART_INTERVAL_MS)).await;

    system
        .define_agent(AgentSpec::new("times").tools(["multiply"]))
        .await
        .expect("the server, started again, lists multiply");
    assert_eq!(starts(directory.path()), 2);
    assert_eq!(system.ask("times", "multiply").await.unwrap().text, "result: 6");
    system.shutdown().await;
}

/// The server exits after a call and cannot be started again (its script exits at
/// once). Steps of four agents that find it dead at once start it once; the steps after,
/// within `MCP_DEAD_SERVER_RESTART_INTERVAL_MS`, do not start it; one step after the
/// interval starts it once more; each agent still answers (with the last list offered).
/// On worker threads. Before (no start by a step), the steps started it 0 times; with
/// the interval not kept (tried), the eight steps started it 8 times in 27 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steps_that_find_a_server_dead_start_it_once_per_interval() {
    let directory = tempfile::tempdir().unwrap();
    let script = counting_script(
        directory.path(),
        &format!("exec '{ECHO_SERVER}' --mode exit-after-call"),
        "exit 1",
    );
    let server = McpServer::connect_stdio("dying", "sh", ["-c", &script], CONNECT_TIMEOUT)
        .await
        .expect("the first start works");
    let agents = ["a", "b", "c", "d"];
    let llm = Arc::new(calling_agents().rule(ScriptRule::any_agent().reply("hello")));
    let system = attached_system(llm, &agents, &server);
    assert_eq!(system.ask("a", "add").await.unwrap().text, "result: 5");
    wait_until_disconnected(&server).await;
    tokio::time::sleep(Duration::from_millis(MCP_DEAD_SERVER_RESTART_INTERVAL_MS)).await;

    let interval = Duration::from_millis(MCP_DEAD_SERVER_RESTART_INTERVAL_MS);
    let started = Instant::now();
    let before = starts(directory.path());
    let asks = agents.map(|agent| {
        let client = system.client();
        tokio::spawn(async move { client.ask(agent, "hello").await })
    });
    for ask in asks {
        assert_eq!(ask.await.unwrap().unwrap().text, "hello");
    }
    for agent in agents {
        assert_eq!(system.ask(agent, "hello").await.unwrap().text, "hello");
    }
    let elapsed = started.elapsed();
    // One start by the steps, and at most one more per interval the asks took.
    let bound = 1 + usize::try_from(elapsed.as_millis() / interval.as_millis()).unwrap();
    let counted = starts(directory.path()) - before;
    assert!(counted >= 1, "the steps did not start the dead server");
    assert!(counted <= bound, "{counted} starts in {elapsed:?}, more than {bound}");
    if elapsed < interval {
        assert_eq!(counted, 1, "steps within the interval started it again");
    }

    tokio::time::sleep(interval).await;
    let before = starts(directory.path());
    assert_eq!(system.ask("a", "hello").await.unwrap().text, "hello");
    assert_eq!(
        starts(directory.path()),
        before + 1,
        "a step after the interval starts it"
    );
    assert!(!server.is_connected());
    system.shutdown().await;
}
