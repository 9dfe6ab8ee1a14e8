//! Per-agent model providers and tool sets, end to end through the real runtime; only
//! the models are scripted.
//!
//! Goal: show that an agent's turns use the provider its spec names (and the rest the
//! default), that an agent limited to some tools is offered only those and that a call
//! of any other is refused without running it, that a config file applies `provider`
//! and `tools`, and that unknown names are typed errors naming what is wrong.
//!
//! Runs in both builds: `cargo nextest run -p troupe-agent --test per_agent` and
//! `CARGO_TARGET_DIR=target/madsim RUSTFLAGS="--cfg madsim" cargo nextest run -p
//! troupe-agent --test per_agent`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use serde_json::json;
use troupe_agent::{
    AgentSpec, AgentSpecError, AgentSystem, AgentSystemBuilder, AgentSystemError, ConfigError, Link, OrgConfig,
    OrgError, OrgPolicy, Role, ScriptRule, ScriptedLlm, Tool,
};

fn keys(llm: &ScriptedLlm) -> Vec<String> {
    llm.requests()
        .iter()
        .map(|request| request.agent.key().to_string())
        .collect()
}

/// A tool named `name` that answers `name ran` and counts its runs.
fn counted_tool(name: &str, runs: &Arc<AtomicUsize>) -> Tool {
    let runs = Arc::clone(runs);
    let answer = format!("{name} ran");
    Tool::from_fn(
        name,
        format!("the {name} tool"),
        json!({"type": "object", "properties": {}}),
        move |_context, _arguments| {
            let runs = Arc::clone(&runs);
            let answer = answer.clone();
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok(answer)
            }
        },
    )
}

fn offered(llm: &ScriptedLlm, agent: &str) -> Vec<String> {
    llm.requests_of(agent)[0]
        .tools
        .iter()
        .map(|tool| tool.name.clone())
        .collect()
}

/// Goal: each agent's model calls go to its own provider. Method: three scripted
/// clients, each answering with its own text; `a` names provider `cheap`, `b` names
/// `smart`, `c` names none. Each answer and each client's recorded requests show who
/// served whom.
#[tokio::test(start_paused = true)]
async fn each_agent_answers_from_its_own_provider() {
    let default = ScriptedLlm::new().rule(ScriptRule::any_agent().reply("from default"));
    let cheap = ScriptedLlm::new().rule(ScriptRule::any_agent().reply("from cheap"));
    let smart = ScriptedLlm::new().rule(ScriptRule::any_agent().reply("from smart"));
    let system = AgentSystem::builder()
        .llm(Arc::new(default.clone()))
        .provider("cheap", Arc::new(cheap.clone()))
        .provider("smart", Arc::new(smart.clone()))
        .agent(AgentSpec::new("a").provider("cheap"))
        .agent(AgentSpec::new("b").provider("smart"))
        .agent(AgentSpec::new("c"))
        .start()
        .unwrap();

    assert_eq!(system.ask("a", "hi").await.unwrap().text, "from cheap");
    assert_eq!(system.ask("b", "hi").await.unwrap().text, "from smart");
    assert_eq!(system.ask("c", "hi").await.unwrap().text, "from default");
    assert_eq!(system.ask("a", "again").await.unwrap().text, "from cheap");

    assert_eq!(keys(&cheap), vec!["a", "a"]);
    assert_eq!(keys(&smart), vec!["b"]);
    assert_eq!(keys(&default), vec!["c"]);
    system.shutdown().await;
}

/// Goal: a tool set is enforced, not left to the model. Method: tools `search` and
/// `secret` are registered; agent `a` may use only `search`. Its model is offered only
/// `search`; when it calls `secret` anyway, it reads a refusal and `secret` never runs;
/// its call of `search` runs. Agent `b`, with no list, is offered every tool.
#[tokio::test(start_paused = true)]
async fn an_agent_limited_to_one_tool_sees_only_it_and_other_calls_are_refused() {
    let search_runs = Arc::new(AtomicUsize::new(0));
    let secret_runs = Arc::new(AtomicUsize::new(0));
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("sneak")
                .call("secret", json!({})),
        )
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("look")
                .call("search", json!({})),
        )
        .rule(ScriptRule::agent("a").on_tool_result().reply("got: {tool_result}"))
        .rule(ScriptRule::agent("b").reply("hello"));
    let system = AgentSystem::builder()
        .llm(Arc::new(llm.clone()))
        .tool(counted_tool("search", &search_runs))
        .tool(counted_tool("secret", &secret_runs))
        .agent(AgentSpec::new("a").tools(["search"]))
        .agent(AgentSpec::new("b"))
        .start()
        .unwrap();

    let refused = system.ask("a", "sneak").await.unwrap();
    assert_eq!(
        refused.text,
        "got: error: tool `secret` is not available to agent a; its tools are: search"
    );
    assert_eq!(secret_runs.load(Ordering::SeqCst), 0, "the refused tool never ran");

    let allowed = system.ask("a", "look").await.unwrap();
    assert_eq!(allowed.text, "got: search ran");
    assert_eq!(search_runs.load(Ordering::SeqCst), 1);

    assert_eq!(offered(&llm, "a"), vec!["search"]);
    // Without a contact tool, `a`'s prompt does not invite it to contact anyone.
    let system_prompt = &llm.requests_of("a")[0].messages[0];
    assert_eq!(system_prompt.role, Role::System);
    assert!(
        !system_prompt.content.contains("may contact"),
        "{}",
        system_prompt.content
    );

    system.ask("b", "hi").await.unwrap();
    assert_eq!(
        offered(&llm, "b"),
        vec!["call_agent", "delegate_to_agent", "notify_agent", "search", "secret"]
    );
    let b_prompt = &llm.requests_of("b")[0].messages[0].content;
    assert!(b_prompt.contains("Agents you may contact with call_agent, delegate_to_agent and notify_agent:"));
    system.shutdown().await;
}

/// Goal: a built-in contact tool can be left out like any other. Method: `a` may use
/// only `notify_agent`; its `call_agent` is refused and `b` is never asked.
#[tokio::test(start_paused = true)]
async fn a_contact_tool_outside_the_set_is_refused_and_reaches_no_one() {
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("ask")
                .call("call_agent", json!({"agent_id": "b", "message": "hi"})),
        )
        .rule(ScriptRule::agent("a").on_tool_result().reply("{tool_result}"))
        .rule(ScriptRule::agent("b").reply("b answered"));
    let system = AgentSystem::builder()
        .llm(Arc::new(llm.clone()))
        .agent(AgentSpec::new("a").tools(["notify_agent"]))
        .agent(AgentSpec::new("b"))
        .start()
        .unwrap();

    let reply = system.ask("a", "ask b").await.unwrap();

    assert_eq!(
        reply.text,
        "error: tool `call_agent` is not available to agent a; its tools are: notify_agent"
    );
    assert!(llm.requests_of("b").is_empty(), "b was never asked");
    assert_eq!(offered(&llm, "a"), vec!["notify_agent"]);
    assert!(llm.requests_of("a")[0].messages[0]
        .content
        .contains("Agents you may contact with notify_agent:"));
    system.shutdown().await;
}

fn builder(default: &ScriptedLlm, cheap: &ScriptedLlm) -> AgentSystemBuilder {
    AgentSystem::builder()
        .llm(Arc::new(default.clone()))
        .provider("cheap", Arc::new(cheap.clone()))
        .tool(counted_tool("search", &Arc::new(AtomicUsize::new(0))))
}

/// Goal: unknown names are typed errors naming the agent, the name and the known
/// names, at start and at runtime upsert. Method: one bad spec per case.
#[tokio::test(start_paused = true)]
async fn unknown_providers_and_tools_are_refused_with_the_known_names() {
    let (default, cheap) = (ScriptedLlm::new(), ScriptedLlm::new());

    let error = builder(&default, &cheap)
        .agent(AgentSpec::new("a").provider("expensive"))
        .start()
        .unwrap_err();
    assert_eq!(
        error,
        AgentSystemError::Spec(AgentSpecError::UnknownProvider {
            id: "a".into(),
            provider: "expensive".into(),
            known: vec!["cheap".into()],
        })
    );
    assert!(error.to_string().contains("known providers: [cheap]"), "{error}");

    let error = builder(&default, &cheap)
        .agent(AgentSpec::new("a").tools(["search", "serach"]))
        .start()
        .unwrap_err();
    assert_eq!(
        error,
        AgentSystemError::Spec(AgentSpecError::UnknownTool {
            id: "a".into(),
            tool: "serach".into(),
            known: ["call_agent", "delegate_to_agent", "notify_agent", "search"]
                .map(String::from)
                .to_vec(),
            servers: Vec::new(),
        })
    );

    let system = builder(&default, &cheap).start().unwrap();
    let upsert = system.directory().upsert(AgentSpec::new("late").provider("nope"));
    assert!(
        matches!(&upsert, Err(AgentSpecError::UnknownProvider { id, provider, .. }) if id == "late" && provider == "nope"),
        "{upsert:?}"
    );
    assert!(!system.directory().contains("late"), "nothing was added");
    system
        .directory()
        .upsert(AgentSpec::new("late").provider("cheap").tools(["search"]))
        .unwrap();
    system.shutdown().await;
}

const CONFIG: &str = r#"
[[agents]]
id = "planner"
provider = "cheap"
tools = ["search"]

[[agents]]
id = "writer"
"#;

/// Goal: a config file's `provider` and `tools` are applied. Method: apply a config
/// declaring `planner` on provider `cheap` with only `search`, and `writer` with
/// neither; ask both and read which client served each and what it was offered.
#[tokio::test(start_paused = true)]
async fn a_config_file_applies_provider_and_tools() {
    let default = ScriptedLlm::new().rule(ScriptRule::any_agent().reply("from default"));
    let cheap = ScriptedLlm::new().rule(ScriptRule::any_agent().reply("from cheap"));
    let system = builder(&default, &cheap).start().unwrap();
    let config = OrgConfig::from_toml(CONFIG, "org.toml").unwrap();

    system.apply_config(&config).await.unwrap();

    let planner = system.directory().get("planner").unwrap();
    assert_eq!(planner.provider.as_deref(), Some("cheap"));
    assert_eq!(planner.tools, Some(vec!["search".to_string()]));
    assert_eq!(system.ask("planner", "plan").await.unwrap().text, "from cheap");
    assert_eq!(system.ask("writer", "write").await.unwrap().text, "from default");
    assert_eq!(keys(&cheap), vec!["planner"]);
    assert_eq!(keys(&default), vec!["writer"]);
    assert_eq!(offered(&cheap, "planner"), vec!["search"]);
    assert_eq!(offered(&default, "writer").len(), 4);
    system.shutdown().await;
}

/// Goal: an unknown provider or tool in a config file names the file, line, column
/// and field, and nothing is applied. Method: two broken variants of the file.
#[tokio::test(start_paused = true)]
async fn unknown_names_in_a_config_file_name_the_file_line_and_column() {
    let (default, cheap) = (ScriptedLlm::new(), ScriptedLlm::new());
    let system = builder(&default, &cheap).start().unwrap();
    let table = [
        (
            CONFIG.replace("\"cheap\"", "\"pricey\""),
            "org.toml:4:12: field `agents[0].provider`: agent \"planner\" names model provider \"pricey\", which \
             this system does not have; known providers: [cheap]",
        ),
        (
            CONFIG.replace("[\"search\"]", "[\"search\", \"browse\"]"),
            "org.toml:5:20: field `agents[0].tools[1]`: agent \"planner\" names tool \"browse\", which this system \
             does not have; registered tools: [call_agent, delegate_to_agent, notify_agent, search]",
        ),
    ];
    for (text, expected) in table {
        let config = OrgConfig::from_toml(&text, "org.toml").unwrap();
        let error = system.apply_config(&config).await.unwrap_err();
        assert!(
            matches!(error, OrgError::Config(ConfigError::Agent { .. })),
            "{error:?}"
        );
        assert!(error.to_string().starts_with(expected), "{error}");
        assert!(system.directory().list().is_empty(), "nothing was applied");
    }
    system.shutdown().await;
}

/// Goal: the system message an agent's model sees follows every change it is derived
/// from, though it is built once and kept between turns: a peer's new role (directory),
/// the organisation's policy and links, and the agent's own definition.
/// Method: four asks of `a` with a change before each, reading the system message the
/// scripted model received each time.
#[tokio::test]
async fn the_system_message_follows_the_directory_the_organisation_and_the_agents_definition() {
    let llm = ScriptedLlm::new().rule(ScriptRule::agent("a").reply("ok"));
    let system = AgentSystem::builder()
        .llm(Arc::new(llm.clone()))
        .agent(AgentSpec::new("a").role("first"))
        .agent(AgentSpec::new("b").role("helps"))
        .start()
        .unwrap();
    let last_system_message = |llm: &ScriptedLlm| {
        let requests = llm.requests_of("a");
        let message = &requests.last().expect("a was asked").messages[0];
        assert_eq!(message.role, Role::System);
        message.content.clone()
    };

    system.ask("a", "one").await.unwrap();
    let first = last_system_message(&llm);
    assert!(first.contains("(agent id \"a\"), first."), "{first}");
    assert!(first.contains("- b: helps"), "{first}");
    system.ask("a", "one again").await.unwrap();
    assert_eq!(last_system_message(&llm), first, "nothing changed");

    system.directory().upsert(AgentSpec::new("b").role("changed")).unwrap();
    system.ask("a", "two").await.unwrap();
    let second = last_system_message(&llm);
    assert!(second.contains("- b: changed") && !second.contains("helps"), "{second}");

    system.set_org_policy(OrgPolicy::Enforced).await.unwrap();
    system.ask("a", "three").await.unwrap();
    let third = last_system_message(&llm);
    assert!(!third.contains("- b:"), "no link, b is not listed: {third}");
    system.add_link(Link::new("a", "b")).await.unwrap();
    system.ask("a", "four").await.unwrap();
    let fourth = last_system_message(&llm);
    assert!(fourth.contains("- b: changed"), "{fourth}");

    system.directory().upsert(AgentSpec::new("a").role("second")).unwrap();
    system.ask("a", "five").await.unwrap();
    let fifth = last_system_message(&llm);
    assert!(fifth.contains("(agent id \"a\"), second."), "{fifth}");
    system.shutdown().await;
}
