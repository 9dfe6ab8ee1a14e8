//! A2A on a cluster node's server (`ServerConfig::node`):
//! - a node that takes an agent's A2A records over reads them all back: the tasks other
//!   nodes numbered and stored (their records are in the shared store) are served by
//!   `GetTask` and `ListTasks`, and one that had not ended is resumed and runs to its
//!   end;
//! - a node asked for an agent's tasks that another node holds forwards the request to
//!   that node's server (`ServerConfig::peers`), once, or refuses it as retryable,
//!   naming that node;
//! - a streamed answer a node forwards is one of its own open streams
//!   (`ServerConfig::streams_open_max`) for as long as it is open.
//!
//! Real `troupe_server::serve`s and real `AgentSystem`s on the scripted model. Here the
//! store stands in for etcd's placement: a store that refuses the claim of the A2A
//! records as placed on another node, as a cluster node's store does. With etcd and
//! `troupe node` processes: `crates/troupe-cli/tests/cluster_processes.rs`.
//!
//! Normal build only: HTTP is not simulated (the crate is empty under madsim).
#![cfg(not(madsim))]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use serde_json::{json, Value};
use troupe_agent::{ScriptRule, ScriptedLlm};
use troupe_core::{ActorId, StoreError};
use troupe_runtime::{Claimed, Fence, KindConfig, MemoryStore, StateStore, TurnCommit};
use troupe_server::{PeerAddresses, ServerConfig};

#[path = "support/a2a_records.rs"]
mod a2a_records;
mod support;
use support::{parse_sse, Gated, Harness, POLL_MS, TEST_WAIT_MS_MAX};

/// A task record as node `node` stores it (key `task/{node}/{seq}`), without a status
/// time (as the versions before 2026-12-06 stored it).
fn record(node: &str, seq: u64, state: &str, text: &str, reply: Option<&str>) -> (String, Value) {
    a2a_records::stored_task("echo", Some(node), seq, state, text, reply)
}

async fn rpc(server: &Harness, method: &str, params: Value) -> Value {
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
    let (status, answer) = server.post("/a2a/echo", body).await;
    assert_eq!(status, 200, "{method}: {answer}");
    assert!(answer.get("error").is_none(), "{method}: {answer}");
    answer["result"].clone()
}

/// Whether each task `ListTasks` answered carries a status time, in order.
fn listed_times(listed: &Value) -> Vec<bool> {
    listed["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|task| task["status"].get("timestamp").is_some())
        .collect()
}

fn reply_text(task: &Value) -> &str {
    task["status"]["message"]["parts"][0]["text"]
        .as_str()
        .unwrap_or_default()
}

/// Goal: node h1, taking over agent `echo`'s A2A records, serves the tasks h0 and h2
/// numbered (one ended, read back as it was), resumes h0's task that was working when
/// h0 died (it completes with the agent's reply), numbers its own new task after all of
/// them, and lists them a page at a time in the `a2a-sdk`'s order: the task whose state
/// changed last first, the records stored without a status time last, by id (so two
/// tasks two nodes gave the same number are told apart); a page token of the versions
/// before 2026-12-06 (a task number, `2.h1`) is invalid params naming it. Before, tasks
/// were listed by number (`h1-2, h2-1, h0-1, h0-0`: h0's resumed task, completed
/// after h2's was stored, listed after it), and `2.h1` was a token. Method: write the
/// records (without status times, as an older version stored them) to the shared store
/// first, then start the server with `ServerConfig::node("h1")` and ask it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_taking_an_agents_a2a_records_over_serves_and_resumes_the_tasks_other_nodes_stored() {
    let store = MemoryStore::new();
    a2a_records::write_records(
        &store,
        "echo",
        &[
            record("h0", 0, "Completed", "first", Some("echo: first")),
            record("h0", 1, "Working", "resume me", None),
            record("h2", 1, "Completed", "from h2", Some("echo: from h2")),
        ],
    )
    .await;
    let builder = support::agents(
        ScriptedLlm::new().rule(ScriptRule::agent("echo").reply("echo: {input}")),
        &["echo"],
        KindConfig::default(),
    )
    .store(Arc::new(store));
    let server = Harness::start(builder, ServerConfig::default().node("h1".to_string())).await;

    let first = rpc(&server, "GetTask", json!({"id": "echo-task-h0-0"})).await;
    assert_eq!(first["status"]["state"], "TASK_STATE_COMPLETED", "{first}");
    assert_eq!(reply_text(&first), "echo: first", "{first}");

    // h0's working task is handed to the agent again and runs to its end here.
    let mut states = Vec::new();
    let mut polls = 0;
    let resumed = loop {
        let task = rpc(&server, "GetTask", json!({"id": "echo-task-h0-1"})).await;
        let state = task["status"]["state"].as_str().unwrap().to_string();
        if states.last() != Some(&state) {
            states.push(state.clone());
        }
        if state == "TASK_STATE_COMPLETED" {
            break task;
        }
        assert!(
            matches!(state.as_str(), "TASK_STATE_SUBMITTED" | "TASK_STATE_WORKING"),
            "{states:?}"
        );
        polls += 1;
        assert!(polls * POLL_MS < TEST_WAIT_MS_MAX, "never completed: {states:?}");
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    };
    assert_eq!(reply_text(&resumed), "echo: resume me", "{resumed}");

    // A new task is h1's, numbered after every task read back.
    let sent = rpc(
        &server,
        "SendMessage",
        json!({"message": {"messageId": "h1-new", "role": "ROLE_USER", "parts": [{"text": "new"}]}}),
    )
    .await;
    assert_eq!(sent["task"]["id"], "echo-task-h1-2", "{sent}");
    assert_eq!(reply_text(&sent["task"]), "echo: new", "{sent}");

    let all = rpc(&server, "ListTasks", json!({})).await;
    assert_eq!(all["totalSize"], 4, "{all}");
    let mut seen = Vec::new();
    let mut tokens = Vec::new();
    let mut token = String::new();
    loop {
        let page = rpc(&server, "ListTasks", json!({"pageSize": 1, "pageToken": token})).await;
        assert_eq!(page["tasks"].as_array().map(Vec::len), Some(1), "{page}");
        seen.push(page["tasks"][0]["id"].as_str().unwrap().to_string());
        token = page["nextPageToken"].as_str().unwrap().to_string();
        if token.is_empty() {
            break;
        }
        tokens.push(token.clone());
        assert!(seen.len() < 5, "{seen:?}");
    }
    assert_eq!(
        seen,
        ["echo-task-h1-2", "echo-task-h0-1", "echo-task-h2-1", "echo-task-h0-0"],
        "the a2a-sdk's order: the task whose state changed last first (h1's new one, then \
         h0's resumed one, which completed here before it was made), then those stored \
         without a status time, by id (greatest first)"
    );
    let times: Vec<bool> = listed_times(&all);
    assert_eq!(times, [true, true, false, false], "{all}");
    assert!(
        tokens
            .iter()
            .all(|token| !token.starts_with(|c: char| c.is_ascii_digit())),
        "no token is a task number: {tokens:?}"
    );
    for (token, message) in [
        ("2.h1", "a Troupe server before 2026-12-06"),
        ("x.h0", "is not one this server gave"),
    ] {
        let (status, answer) = server
            .post(
                "/a2a/echo",
                json!({"jsonrpc": "2.0", "id": 2, "method": "ListTasks", "params": {"pageToken": token}}),
            )
            .await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["error"]["code"], -32602, "{token}: {answer}");
        let text = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(
            text.contains(&format!("{token:?}")) && text.contains(message),
            "{token}: {answer}"
        );
    }
    server.stop().await;
}

/// A node's store on which another node, `holder`, holds every agent's A2A records
/// while `elsewhere` is set: their claim is refused [`StoreError::NotOwner`], as a
/// cluster node's store refuses an actor placed elsewhere, and a commit under an older
/// claim is refused [`StoreError::Fenced`], as the store refuses it once the other node
/// claimed. Everything else goes to the memory store.
struct HeldElsewhere {
    store: MemoryStore,
    holder: &'static str,
    elsewhere: AtomicBool,
}

impl HeldElsewhere {
    fn new(holder: &'static str, elsewhere: bool) -> Self {
        Self {
            store: MemoryStore::new(),
            holder,
            elsewhere: AtomicBool::new(elsewhere),
        }
    }

    fn refuses(&self, actor: &ActorId) -> bool {
        actor.kind().as_str() == "troupe-a2a" && self.elsewhere.load(Ordering::SeqCst)
    }
}

#[async_trait::async_trait]
impl StateStore for HeldElsewhere {
    async fn claim(&self, actor: &ActorId) -> Result<Claimed, StoreError> {
        if self.refuses(actor) {
            return Err(StoreError::NotOwner {
                actor: actor.clone(),
                owner: Some(self.holder.to_string()),
            });
        }
        self.store.claim(actor).await
    }

    async fn load(&self, actor: &ActorId) -> Result<Option<Bytes>, StoreError> {
        self.store.load(actor).await
    }

    async fn commit(&self, actor: &ActorId, fence: Fence, commit: TurnCommit) -> Result<(), StoreError> {
        if self.refuses(actor) {
            return Err(StoreError::Fenced {
                actor: actor.clone(),
                held: fence,
                current: None,
            });
        }
        self.store.commit(actor, fence, commit).await
    }

    async fn get(&self, actor: &ActorId, key: &str) -> Result<Option<Bytes>, StoreError> {
        self.store.get(actor, key).await
    }

    async fn scan(
        &self,
        actor: &ActorId,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Bytes)>, StoreError> {
        self.store.scan(actor, prefix, after, limit).await
    }
}

/// One peer's address.
struct Peer(&'static str, String);

impl PeerAddresses for Peer {
    fn http_address<'a>(&'a self, node: &'a str) -> futures::future::BoxFuture<'a, Option<String>> {
        Box::pin(async move { (node == self.0).then(|| self.1.clone()) })
    }
}

/// `echo`, and `echo #2?`, whose id needs escaping in a URL path.
fn echo_agents() -> troupe_agent::AgentSystemBuilder {
    support::agents(
        ScriptedLlm::new()
            .rule(ScriptRule::agent("echo").reply("echo: {input}"))
            .rule(ScriptRule::agent(ODD_ID).reply("odd: {input}")),
        &["echo", ODD_ID],
        KindConfig::default(),
    )
}

/// An agent id with characters a URL path must escape.
const ODD_ID: &str = "echo #2?";

/// POSTs a JSON-RPC request to `/a2a/echo` of `base` with `headers`: the status, the
/// `x-troupe-forwarded-to` header and the answer (SSE bodies as text).
async fn post_rpc(base: &str, method: &str, params: Value, headers: &[(&str, &str)]) -> (u16, Option<String>, Value) {
    post_rpc_to(base, "echo", method, params, headers).await
}

/// [`post_rpc`] to agent `agent` (its id escaped as a path segment).
async fn post_rpc_to(
    base: &str,
    agent: &str,
    method: &str,
    params: Value,
    headers: &[(&str, &str)],
) -> (u16, Option<String>, Value) {
    let body = json!({"jsonrpc": "2.0", "id": 7, "method": method, "params": params});
    let mut url = reqwest::Url::parse(base).unwrap();
    url.path_segments_mut().unwrap().extend(["a2a", agent]);
    let mut request = reqwest::Client::new()
        .post(url)
        .timeout(Duration::from_millis(TEST_WAIT_MS_MAX))
        .header("content-type", "application/json")
        .body(body.to_string());
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.expect("the server answers");
    let status = response.status().as_u16();
    let forwarded_to = response
        .headers()
        .get("x-troupe-forwarded-to")
        .map(|value| value.to_str().unwrap().to_string());
    let streamed = response
        .headers()
        .get("content-type")
        .is_some_and(|value| value.to_str().unwrap().starts_with("text/event-stream"));
    let text = response.text().await.unwrap();
    let value = if streamed {
        Value::String(text)
    } else {
        serde_json::from_str(&text).unwrap_or_else(|error| panic!("not JSON ({error}): {text}"))
    };
    (status, forwarded_to, value)
}

fn held_by_h0(status: u16, answer: &Value) {
    assert_eq!(status, 503, "{answer}");
    assert_eq!(answer["error"]["code"], -32000, "{answer}");
    let message = answer["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("A2A tasks are held by node h0"), "{answer}");
}

/// Goal: node h1, asked for agent `echo`'s A2A tasks, which node h0 holds, forwards the
/// request to h0's server: a blocking send runs on h0 (numbered in h0's space), its
/// answer comes back as h0 gave it; `GetTask` and a streamed send go through too. A
/// request that was already forwarded once is not forwarded again (refused 503, naming
/// h0), and a node that knows no address for h0 refuses the request the same way;
/// nothing runs on h1. Method: three servers in one process (h0 on its own store; h1
/// and h2 on stores where h0 holds the A2A records, h1 with h0's address, h2 without).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_forwards_a2a_requests_to_the_node_holding_the_agents_tasks_once() {
    let h0 = Harness::start(echo_agents(), ServerConfig::default().node("h0".to_string())).await;
    let h0_address: SocketAddr = h0.base.trim_start_matches("http://").parse().unwrap();
    let elsewhere = || Arc::new(HeldElsewhere::new("h0", true));
    let h1 = Harness::start(
        echo_agents().store(elsewhere()),
        ServerConfig::default()
            .node("h1".to_string())
            .peers(Arc::new(Peer("h0", h0_address.to_string()))),
    )
    .await;
    let h2 = Harness::start(
        echo_agents().store(elsewhere()),
        ServerConfig::default().node("h2".to_string()),
    )
    .await;

    let send =
        |text: &str, id: &str| json!({"message": {"messageId": id, "role": "ROLE_USER", "parts": [{"text": text}]}});
    let (status, forwarded_to, answer) = post_rpc(&h1.base, "SendMessage", send("via h1", "m1"), &[]).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(forwarded_to.as_deref(), Some("h0"));
    let task = &answer["result"]["task"];
    assert_eq!(task["id"], "echo-task-h0-0", "h0 numbered it: {answer}");
    assert_eq!(reply_text(task), "echo: via h1", "{answer}");
    assert_eq!(answer["id"], 7, "the client's JSON-RPC id: {answer}");

    let (status, _, answer) = post_rpc(&h1.base, "GetTask", json!({"id": "echo-task-h0-0"}), &[]).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["result"]["status"]["state"], "TASK_STATE_COMPLETED", "{answer}");
    let on_h0 = rpc(&h0, "GetTask", json!({"id": "echo-task-h0-0"})).await;
    assert_eq!(reply_text(&on_h0), "echo: via h1", "the task is h0's: {on_h0}");

    // An id a URL path must escape is forwarded as one path segment.
    let (status, forwarded_to, answer) = post_rpc_to(&h1.base, ODD_ID, "SendMessage", send("odd", "o1"), &[]).await;
    assert_eq!((status, forwarded_to.as_deref()), (200, Some("h0")), "{answer}");
    assert_eq!(reply_text(&answer["result"]["task"]), "odd: odd", "{answer}");

    let (status, forwarded_to, answer) = post_rpc(&h1.base, "SendStreamingMessage", send("streamed", "m2"), &[]).await;
    assert_eq!((status, forwarded_to.as_deref()), (200, Some("h0")), "{answer}");
    let events = answer.as_str().unwrap();
    assert!(
        // Each agent's tasks are numbered on their own: echo's second task.
        events.contains("echo-task-h0-1") && events.contains("echo: streamed"),
        "{events}"
    );

    // Forwarded once only; without an address for h0, refused.
    let (status, forwarded_to, answer) = post_rpc(
        &h1.base,
        "SendMessage",
        send("again", "m3"),
        &[("x-troupe-forwarded-by", "h2")],
    )
    .await;
    held_by_h0(status, &answer);
    assert_eq!(forwarded_to, None);
    let (status, forwarded_to, answer) = post_rpc(&h2.base, "SendMessage", send("no address", "m4"), &[]).await;
    held_by_h0(status, &answer);
    assert_eq!(forwarded_to, None);
    let listed = rpc(&h0, "ListTasks", json!({})).await;
    assert_eq!(listed["totalSize"], 2, "only the two forwarded tasks ran: {listed}");
    for agents in [h1.system(), h2.system()] {
        let history = agents.client().history_window("echo").await.expect("the log reads");
        assert!(history.is_empty(), "nothing ran on h1 or h2: {history:?}");
    }
    h2.stop().await;
    h1.stop().await;
    h0.stop().await;
}

/// Goal: a node that held an agent's A2A records and finds another node holding them
/// (its write refused: the store fenced its claim off, and claiming again names the
/// other node) stops serving them: the send whose record could not be stored is a
/// retryable 503 and does not run, and the next request checks again and is refused
/// naming the holder, not answered from the node's memory. Method: one server on a
/// store that lets it claim the records, then takes them away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_loses_an_agents_a2a_records_stops_serving_them() {
    let store = Arc::new(HeldElsewhere::new("h0", false));
    let h1 = Harness::start(
        echo_agents().store(Arc::clone(&store) as Arc<dyn StateStore>),
        ServerConfig::default().node("h1".to_string()),
    )
    .await;
    let send =
        |text: &str, id: &str| json!({"message": {"messageId": id, "role": "ROLE_USER", "parts": [{"text": text}]}});
    let held = rpc(&h1, "SendMessage", send("while held", "m1")).await;
    assert_eq!(held["task"]["id"], "echo-task-h1-0", "{held}");
    assert_eq!(reply_text(&held["task"]), "echo: while held", "{held}");

    store.elsewhere.store(true, Ordering::SeqCst);
    let (status, _, answer) = post_rpc(&h1.base, "SendMessage", send("after", "m2"), &[]).await;
    assert_eq!(status, 503, "{answer}");
    let message = answer["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("could not be stored") && message.contains("placed on node h0"),
        "{answer}"
    );
    let (status, _, answer) = post_rpc(&h1.base, "GetTask", json!({"id": "echo-task-h1-0"}), &[]).await;
    held_by_h0(status, &answer);
    let history = h1
        .system()
        .client()
        .history_window("echo")
        .await
        .expect("the log reads");
    let asked = |text: &str| history.iter().filter(|message| message.content == text).count();
    assert_eq!(asked("while held"), 1, "{history:?}");
    assert_eq!(asked("after"), 0, "the refused send did not run: {history:?}");
    h1.stop().await;
}

/// Goal: without a delete too, a node never gives one of an agent's A2A task ids twice:
/// after a restart, a node numbers an agent's new task after every task it numbered for
/// that agent, even when the agent's last record was let go to make room (the records
/// it reads back when it takes the agent's over are not its last). Before, the node
/// numbered from the records read back, none of `echo`'s: its next task was given
/// `echo-task-h1-0` again (a client holding the old id would read the new task; had
/// the agent not forgotten the old one, it would have answered with its outcome).
/// Method: node h1 keeps 2 tasks; `echo` gets a task (completed), `slow` two (the first
/// still running when the second is made, so `echo`'s is the oldest ended and goes);
/// then h1 restarts on the same store and `echo` gets a new task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_restarted_after_an_agents_last_record_was_let_go_numbers_its_next_task_after_it() {
    let store = Arc::new(MemoryStore::new());
    let start = || {
        let agents = support::agents(
            ScriptedLlm::new()
                .rule(ScriptRule::agent("echo").reply("echo: {input}"))
                .rule(
                    ScriptRule::agent("slow")
                        .reply("slow done")
                        .latency(Duration::from_millis(2_000)),
                ),
            &["echo", "slow"],
            KindConfig::default(),
        );
        Harness::start(
            agents.store(Arc::clone(&store) as Arc<dyn StateStore>),
            ServerConfig::default().node("h1".to_string()).a2a_tasks_kept(2),
        )
    };
    let send = |text: &str, id: &str, immediately: bool| {
        json!({
            "message": {"messageId": id, "role": "ROLE_USER", "parts": [{"text": text}]},
            "configuration": {"returnImmediately": immediately},
        })
    };
    let first = start().await;
    let old = rpc(&first, "SendMessage", send("one", "m1", false)).await;
    assert_eq!(old["task"]["id"], "echo-task-h1-0", "{old}");
    assert_eq!(reply_text(&old["task"]), "echo: one", "{old}");
    for (text, id) in [("long", "m2"), ("longer", "m3")] {
        let (status, _, answer) = post_rpc_to(&first.base, "slow", "SendMessage", send(text, id, true), &[]).await;
        assert_eq!(status, 200, "{answer}");
        assert!(answer.get("error").is_none(), "{answer}");
    }
    let (status, _, gone) = post_rpc(&first.base, "GetTask", json!({"id": "echo-task-h1-0"}), &[]).await;
    assert_eq!(status, 200, "{gone}");
    assert_eq!(gone["error"]["code"], -32001, "echo's task was let go: {gone}");
    first.stop().await;

    let second = start().await;
    let new = rpc(&second, "SendMessage", send("two", "m4", false)).await;
    assert_ne!(new["task"]["id"], "echo-task-h1-0", "a task id given again: {new}");
    assert_eq!(reply_text(&new["task"]), "echo: two", "{new}");
    second.stop().await;
}

/// Sends the JSON-RPC request `method` with `params` to `/a2a/echo` of `base`: the
/// response, its headers received and its body not read.
async fn open_rpc(base: &str, method: &str, params: Value) -> reqwest::Response {
    let body = json!({"jsonrpc": "2.0", "id": 7, "method": method, "params": params});
    reqwest::Client::new()
        .post(format!("{base}/a2a/echo"))
        .timeout(Duration::from_millis(TEST_WAIT_MS_MAX))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("the server answers")
}

/// Reads an open SSE response until its first event: the event's data as JSON.
async fn first_event(response: &mut reqwest::Response) -> Value {
    let mut text = String::new();
    tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
        loop {
            let chunk = response.chunk().await.unwrap().expect("the stream stays open");
            text.push_str(std::str::from_utf8(&chunk).unwrap());
            if let Some((_, data)) = parse_sse(&text).into_iter().next() {
                return serde_json::from_str(&data).unwrap();
            }
        }
    })
    .await
    .expect("the stream's first event arrives")
}

/// Goal: a streamed A2A answer node h1 forwards to h0 (the node holding the agent's
/// tasks) counts against h1's `streams_open_max` for as long as it is open, as a stream
/// h1 serves itself does: with h1's limit at 1 and one forwarded stream open, a second
/// `SendStreamingMessage` and a `SubscribeToTask` through h1 are refused 503 with
/// `Retry-After: 1` and JSON-RPC -32000 naming the limit, forwarded nowhere (h0 makes
/// no task for them, though h0 has room), while a plain `GetTask` is still forwarded;
/// once the open stream ends, a new one through h1 is forwarded and served to its reply;
/// a forwarded stream whose client goes away frees its slot too.
/// Method: two servers in one process, h0's model behind a gate the test opens, h1 on a
/// store where h0 holds the A2A records, with h0's address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_stream_counts_against_the_forwarding_nodes_stream_limit() {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let gated = Gated {
        script: ScriptedLlm::new().rule(ScriptRule::agent("echo").reply("echo: {input}")),
        gate: Arc::clone(&gate),
    };
    let h0 = Harness::start(
        troupe_agent::AgentSystem::builder()
            .llm(Arc::new(gated))
            .kind_config(KindConfig::default())
            .agent(troupe_agent::AgentSpec::new("echo")),
        ServerConfig::default().node("h0".to_string()),
    )
    .await;
    let h0_address: SocketAddr = h0.base.trim_start_matches("http://").parse().unwrap();
    let h1 = Harness::start(
        echo_agents().store(Arc::new(HeldElsewhere::new("h0", true))),
        ServerConfig::default()
            .node("h1".to_string())
            .peers(Arc::new(Peer("h0", h0_address.to_string())))
            .streams_open_max(1),
    )
    .await;
    let send =
        |text: &str, id: &str| json!({"message": {"messageId": id, "role": "ROLE_USER", "parts": [{"text": text}]}});

    let mut open = open_rpc(&h1.base, "SendStreamingMessage", send("held", "m1")).await;
    assert_eq!(open.status().as_u16(), 200);
    assert_eq!(
        open.headers()
            .get("x-troupe-forwarded-to")
            .map(|value| value.to_str().unwrap()),
        Some("h0")
    );
    let first = first_event(&mut open).await;
    assert_eq!(first["result"]["task"]["id"], "echo-task-h0-0", "{first}");

    for (method, params) in [
        ("SendStreamingMessage", send("one too many", "m2")),
        ("SubscribeToTask", json!({"id": "echo-task-h0-0"})),
    ] {
        let refused = open_rpc(&h1.base, method, params).await;
        assert_eq!(refused.status().as_u16(), 503, "a second forwarded stream ({method})");
        assert_eq!(
            refused
                .headers()
                .get("retry-after")
                .map(|value| value.to_str().unwrap()),
            Some("1"),
            "{method}"
        );
        assert!(
            refused.headers().get("x-troupe-forwarded-to").is_none(),
            "{method}: not forwarded"
        );
        let answer: Value = serde_json::from_str(&refused.text().await.unwrap()).unwrap();
        assert_eq!(answer["error"]["code"], -32000, "{method}: {answer}");
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("streams_open_max"), "{method}: {answer}");
    }
    // A plain request is forwarded, and h0 made no task for the refused stream.
    let (status, forwarded_to, listed) = post_rpc(&h1.base, "ListTasks", json!({}), &[]).await;
    assert_eq!((status, forwarded_to.as_deref()), (200, Some("h0")), "{listed}");
    assert_eq!(listed["result"]["totalSize"], 1, "{listed}");

    // The open stream ends with its reply, and its slot is free again.
    gate.add_permits(2);
    let rest = tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), open.text())
        .await
        .expect("the stream ends once its turn has")
        .unwrap();
    assert!(rest.contains("echo: held"), "{rest}");
    let mut polls = 0;
    let events = loop {
        let (status, forwarded_to, answer) = post_rpc(
            &h1.base,
            "SendStreamingMessage",
            send("after", &format!("m3-{polls}")),
            &[],
        )
        .await;
        if status == 200 {
            assert_eq!(forwarded_to.as_deref(), Some("h0"));
            break answer.as_str().unwrap().to_string();
        }
        assert_eq!(status, 503, "{answer}");
        polls += 1;
        assert!(polls * POLL_MS < TEST_WAIT_MS_MAX, "the slot was never freed: {answer}");
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    };
    assert!(events.contains("echo: after"), "{events}");

    // A held stream whose client leaves frees h1's slot (its model waits at the gate).
    let mut left = open_rpc(&h1.base, "SendStreamingMessage", send("left", "m4")).await;
    assert_eq!(left.status().as_u16(), 200);
    first_event(&mut left).await;
    drop(left);
    let mut polls = 0;
    loop {
        let mut next = open_rpc(&h1.base, "SendStreamingMessage", send("next", &format!("m5-{polls}"))).await;
        if next.status().as_u16() == 200 {
            first_event(&mut next).await;
            break;
        }
        assert_eq!(next.status().as_u16(), 503);
        polls += 1;
        assert!(
            polls * POLL_MS < TEST_WAIT_MS_MAX,
            "a left stream's slot was never freed"
        );
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
    gate.add_permits(2);
    h1.stop().await;
    h0.stop().await;
}
