//! The topology routes end to end: a real `troupe_server::serve` on 127.0.0.1:0, the
//! real `AgentSystem` on the scripted model, real HTTP (reqwest). `GET /v1/topology`
//! before and after traffic (counts and observed links move; a configured link shows as
//! configured), the call tree of the last request, and the page's files: content types,
//! the Content-Security-Policy, served without the token while the API needs it.
//!
//! Normal build only: HTTP is not simulated (the crate is empty under madsim).
#![cfg(not(madsim))]

use std::time::Duration;

use serde_json::{json, Value};
use troupe_agent::{Link, ScriptRule, ScriptedLlm};
use troupe_runtime::KindConfig;
use troupe_server::ServerConfig;

mod support;
use support::{Harness, POLL_MS, TEST_WAIT_MS_MAX};

const TOKEN: &str = "topology-token-0123456789";
/// The CSP the page's files must carry.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
                   img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

fn script() -> ScriptedLlm {
    ScriptedLlm::new()
        .rule(ScriptRule::agent("echo").reply("echo: {input}"))
        .rule(ScriptRule::agent("caller").on_user_containing("").call(
            "call_agent",
            json!({"agent_id": "echo", "message": "from caller: {input}"}),
        ))
        .rule(
            ScriptRule::agent("caller")
                .on_tool_result()
                .reply("caller heard: {tool_result}"),
        )
        .rule(ScriptRule::agent("boss").reply("noted"))
        .rule(
            ScriptRule::agent("ghoster")
                .on_user_containing("")
                .call("call_agent", json!({"agent_id": "{input}", "message": "anyone there?"})),
        )
        .rule(
            ScriptRule::agent("ghoster")
                .on_tool_result()
                .reply("ghoster heard: {tool_result}"),
        )
}

async fn start() -> Harness {
    let config = ServerConfig {
        token: Some(TOKEN.to_string()),
        ..ServerConfig::default()
    };
    Harness::start(
        support::agents(script(), &["boss", "caller", "echo", "ghoster"], KindConfig::default()),
        config,
    )
    .await
}

impl Harness {
    async fn topology(&self) -> Value {
        let (status, body) = self.send(reqwest::Method::GET, "/v1/topology", None).await;
        assert_eq!(status, 200, "{body}");
        body
    }

    /// Polls `GET /v1/topology` until `done` holds (the topology reads the event stream
    /// on its own task, so it may trail a reply by a moment).
    async fn topology_when(&self, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        let waited = tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
            loop {
                let topology = self.topology().await;
                if done(&topology) {
                    return topology;
                }
                tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
            }
        })
        .await;
        match waited {
            Ok(topology) => topology,
            Err(_) => panic!(
                "{what}: not within {TEST_WAIT_MS_MAX} ms; last: {}",
                self.topology().await
            ),
        }
    }

    /// Polls `GET /v1/topology/agents/{agent}/call-tree` until `done` holds (as
    /// `topology_when`).
    async fn call_tree_when(&self, agent: &str, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        self.get_when(&format!("/v1/topology/agents/{agent}/call-tree"), what, done)
            .await
    }
}

fn agent<'a>(topology: &'a Value, id: &str) -> &'a Value {
    topology["agents"]
        .as_array()
        .unwrap()
        .iter()
        .find(|agent| agent["id"] == id)
        .unwrap_or_else(|| panic!("no agent {id} in {topology}"))
}

fn link<'a>(topology: &'a Value, from: &str, to: &str) -> Option<&'a Value> {
    topology["links"]
        .as_array()
        .unwrap()
        .iter()
        .find(|link| link["from"] == from && link["to"] == to)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topology_counts_and_links_move_with_traffic() {
    let harness = start().await;

    let before = harness.topology().await;
    let ids: Vec<&str> = before["agents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|agent| agent["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["boss", "caller", "echo", "ghoster"], "{before}");
    assert_eq!(agent(&before, "caller")["description"], "the caller agent");
    for id in ids {
        let seen = agent(&before, id);
        assert_eq!(seen["calls_made"], 0, "{seen}");
        assert_eq!(seen["calls_received"], 0, "{seen}");
        assert_eq!(seen["active"], false, "{seen}");
        assert_eq!(seen["turns_running"], 0, "{seen}");
        assert_eq!(seen["inbox"], 0, "{seen}");
    }
    assert_eq!(before["links"], json!([]), "no traffic, no configured link: no link");

    // caller -> echo, from outside.
    let (status, reply) = harness
        .send(
            reqwest::Method::POST,
            "/v1/agents/caller/messages",
            Some(json!({"text": "hi"})),
        )
        .await;
    assert_eq!(status, 200, "{reply}");
    let after = harness
        .topology_when("the call caller -> echo counted", |topology| {
            agent(topology, "echo")["calls_received"] == 1 && agent(topology, "caller")["turns_running"] == 0
        })
        .await;
    let caller = agent(&after, "caller");
    assert_eq!(caller["calls_made"], 1, "{caller}");
    assert_eq!(caller["calls_received"], 1, "{caller}");
    assert_eq!(caller["calls_from_outside"], 1, "{caller}");
    assert_eq!(caller["active"], true, "{caller}");
    let echo = agent(&after, "echo");
    assert_eq!(echo["calls_made"], 0, "{echo}");
    assert_eq!(echo["calls_from_outside"], 0, "{echo}");
    assert_eq!(echo["turns_running"], 0, "{echo}");
    let observed = link(&after, "caller", "echo").unwrap_or_else(|| panic!("no link caller -> echo: {after}"));
    assert_eq!(observed["source"], "observed", "{observed}");
    assert_eq!(observed["calls"], 1, "{observed}");
    assert_eq!(observed["calls_refused"], 0, "{observed}");
    assert_eq!(observed["configured"], Value::Null, "{observed}");
    assert!(link(&after, "echo", "caller").is_none(), "links are directed: {after}");
    assert_eq!(agent(&after, "boss")["calls_received"], 0);

    // The call tree of the last request that touched echo: outside -> caller -> echo.
    // The topology reads the events after they happen: the root call's end may be read
    // after the HTTP reply came back (under load, 1 run in 17 read it still running).
    let tree = harness
        .call_tree_when("echo", "the root call ended", |tree| !tree["root"]["outcome"].is_null())
        .await;
    let root = &tree["root"];
    assert_eq!(root["caller"], Value::Null, "{tree}");
    assert_eq!(root["target"], "caller", "{tree}");
    assert_eq!(root["depth"], 0, "{tree}");
    assert_eq!(root["outcome"], "ok", "{tree}");
    let children = root["children"].as_array().unwrap();
    assert_eq!(children.len(), 1, "{tree}");
    assert_eq!(children[0]["caller"], "caller", "{tree}");
    assert_eq!(children[0]["target"], "echo", "{tree}");
    assert_eq!(children[0]["depth"], 1, "{tree}");
    assert_eq!(children[0]["parent"], root["call"], "{tree}");
    let (status, none) = harness
        .send(reqwest::Method::GET, "/v1/topology/agents/boss/call-tree", None)
        .await;
    assert_eq!((status, &none["root"]), (200, &Value::Null), "{none}");
    let (status, missing) = harness
        .send(reqwest::Method::GET, "/v1/topology/agents/nobody/call-tree", None)
        .await;
    assert_eq!(status, 404, "{missing}");
    assert_eq!(missing["error"]["code"], "agent_not_found");

    // A message: boss delegates to echo (a task message boss -> echo).
    let (status, task) = harness
        .send(
            reqwest::Method::POST,
            "/v1/agents/boss/tasks",
            Some(json!({"to": "echo", "text": "do it"})),
        )
        .await;
    assert_eq!(status, 202, "{task}");
    let delegated = harness
        .topology_when("the task message boss -> echo counted", |topology| {
            link(topology, "boss", "echo").is_some_and(|link| link["messages"].as_u64() >= Some(1))
        })
        .await;
    assert!(
        agent(&delegated, "boss")["messages_sent"].as_u64() >= Some(1),
        "{delegated}"
    );
    assert_eq!(link(&delegated, "boss", "echo").unwrap()["calls"], 0, "{delegated}");

    // A configured link shows as configured; with no traffic on it, with zero counts.
    harness
        .system()
        .client()
        .add_link(Link::new("caller", "boss"))
        .await
        .expect("the link is added");
    let configured = harness.topology().await;
    let added = link(&configured, "caller", "boss").unwrap_or_else(|| panic!("no configured link: {configured}"));
    assert_eq!(added["source"], "configured", "{added}");
    assert_eq!(added["configured"]["enabled"], true, "{added}");
    assert_eq!(added["configured"]["direction"], "two_way", "{added}");
    assert_eq!(added["calls"], 0, "{added}");
    assert_eq!(link(&configured, "caller", "echo").unwrap()["source"], "observed");

    harness.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_files_have_their_types_and_csp_and_need_no_token() {
    let harness = start().await;
    let anonymous = reqwest::Client::new();
    let mut html = String::new();
    for (path, content_type) in [
        ("/", "text/html; charset=utf-8"),
        ("/ui", "text/html; charset=utf-8"),
        ("/ui/topology.js", "text/javascript; charset=utf-8"),
        ("/ui/topology.css", "text/css; charset=utf-8"),
    ] {
        let response = anonymous.get(format!("{}{path}", harness.base)).send().await.unwrap();
        assert_eq!(response.status().as_u16(), 200, "{path} without the token");
        let headers = response.headers().clone();
        assert_eq!(headers["content-type"], content_type, "{path}");
        assert_eq!(headers["content-security-policy"], CSP, "{path}");
        assert_eq!(headers["x-content-type-options"], "nosniff", "{path}");
        assert_eq!(headers["x-frame-options"], "DENY", "{path}");
        let body = response.text().await.unwrap();
        assert!(!body.is_empty(), "{path}");
        if path == "/" {
            html = body;
        }
    }
    // The HTML loads only this origin's files and has no inline script or style, which
    // the CSP would block.
    assert!(
        html.contains(r#"<script src="/ui/topology.js" defer></script>"#),
        "{html}"
    );
    assert!(
        html.contains(r#"<link rel="stylesheet" href="/ui/topology.css">"#),
        "{html}"
    );
    assert_eq!(html.matches("<script").count(), 1, "one script, by src");
    assert!(!html.contains("<style"), "no inline style element");
    assert!(!html.contains(" style="), "no inline style attribute");
    assert!(
        !html.contains("http://") && !html.contains("https://"),
        "nothing from elsewhere"
    );

    // The data behind the page needs the token.
    for path in ["/v1/topology", "/v1/topology/agents/echo/call-tree", "/v1/events"] {
        let response = anonymous.get(format!("{}{path}", harness.base)).send().await.unwrap();
        assert_eq!(response.status().as_u16(), 401, "{path} without the token");
    }
    // Only GET is open: a POST to the page's path is refused before routing.
    let response = anonymous.post(format!("{}/", harness.base)).send().await.unwrap();
    assert_eq!(response.status().as_u16(), 401);

    harness.stop().await;
}

/// Goal: ids that name no agent do not become agents or links of the topology. A
/// model's `call_agent` announces its call before the target is looked up (the observer
/// sees every call, refused ones too); the topology takes back what such a call's start
/// counted when it ends refused `AgentNotFound`, so a model (or a client) naming
/// invented ids cannot fill the agents and links the page shows (up to their bounds).
/// Method: an agent whose model calls `call_agent` with the id it is given, sent 8
/// invented ids; the agents listed stay the defined ones, no link leaves the caller,
/// the caller's calls made count the 8, and the last request's tree still shows the
/// refused call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_to_ids_that_name_no_agent_add_no_agent_and_no_link() {
    let harness = start().await;
    let ghosts = 8;
    for n in 0..ghosts {
        let (status, reply) = harness
            .send(
                reqwest::Method::POST,
                "/v1/agents/ghoster/messages",
                Some(json!({"text": format!("ghost-{n}")})),
            )
            .await;
        assert_eq!(status, 200, "{reply}");
        assert!(reply.to_string().contains("not found"), "{reply}");
    }
    let after = harness
        .topology_when("the ghoster's calls counted", |topology| {
            agent(topology, "ghoster")["calls_made"] == ghosts && agent(topology, "ghoster")["turns_running"] == 0
        })
        .await;
    let ids: Vec<&str> = after["agents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|agent| agent["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["boss", "caller", "echo", "ghoster"], "{after}");
    assert_eq!(
        after["links"],
        json!([]),
        "no link to an id that names no agent: {after}"
    );
    let tree = harness
        .call_tree_when("ghoster", "the last request ended", |tree| {
            !tree["root"]["outcome"].is_null()
        })
        .await;
    let refused = &tree["root"]["children"][0];
    assert_eq!(
        (&refused["target"], &refused["outcome"]),
        (&json!("ghost-7"), &json!("refused")),
        "the refused call stays in its tree: {tree}"
    );
    harness.stop().await;
}
