//! Edge probes of the HTTP API from outside, as a demanding client: what an agent
//! defined over REST keeps across a restart of the server (its A2A tasks, its place in
//! every listing), path segments that are no UTF-8, ids that look like paths, and the
//! JSON-RPC envelope's answers. Each test names what failed before its fix, if any.
//!
//! Normal build only: HTTP is not simulated (the crate is empty under madsim).
#![cfg(not(madsim))]

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use troupe_agent::{ScriptRule, ScriptedLlm};
use troupe_runtime::KindConfig;
use troupe_server::ServerConfig;

mod support;
use support::{turn_started, Gated, Harness, POLL_MS, TEST_WAIT_MS_MAX};

const TOKEN: &str = "edge-probe-token-0123456789";

/// A server with its own `AgentSystem` (built with agent `echo` only; every agent's
/// model answers "heard: {input}", after `latency`) on the SQLite file at `path`.
async fn server_on_file(path: &Path, latency: Duration) -> Harness {
    let store = Arc::new(troupe_runtime::SqliteStore::open(path).expect("the SQLite file opens"));
    let llm = ScriptedLlm::new().rule(ScriptRule::any_agent().reply("heard: {input}").latency(latency));
    let builder = troupe_agent::AgentSystem::builder()
        .llm(Arc::new(llm) as _)
        .store(store as _)
        .agent(troupe_agent::AgentSpec::new("echo"));
    Harness::start(builder, ServerConfig::default().token(TOKEN)).await
}

impl Harness {
    /// A JSON-RPC request `method` with `params` to agent `agent`'s A2A endpoint, with id
    /// 1: the HTTP status and the answer.
    async fn rpc(&self, agent: &str, method: &str, params: Value) -> (u16, Value) {
        let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
        self.post(&format!("/a2a/{agent}"), body).await
    }

    /// Polls `GetTask` of `task` at `agent` until it has ended (completed, failed,
    /// canceled, rejected); panics naming the last answer if it has not within
    /// [`TEST_WAIT_MS_MAX`].
    async fn task_ended(&self, agent: &str, task: &str) -> Value {
        let mut last = Value::Null;
        let waited = tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
            loop {
                let (status, answer) = self.rpc(agent, "GetTask", json!({"id": task})).await;
                assert_eq!(status, 200, "{answer}");
                let state = answer["result"]["status"]["state"].as_str().map(str::to_string);
                last = answer;
                if matches!(
                    state.as_deref(),
                    Some("TASK_STATE_COMPLETED" | "TASK_STATE_FAILED" | "TASK_STATE_CANCELED" | "TASK_STATE_REJECTED")
                ) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
            }
        })
        .await;
        assert!(waited.is_ok(), "task {task} of {agent} did not end: last {last}");
        last
    }
}

fn send_params(message_id: &str, text: &str, return_immediately: bool) -> Value {
    json!({
        "message": {"messageId": message_id, "role": "ROLE_USER", "parts": [{"text": text}]},
        "configuration": {"returnImmediately": return_immediately},
    })
}

/// Goal: the A2A tasks of an agent defined over REST survive a restart of the server on
/// the same store, as those of a built-in agent do (docs/serve.md: "every A2A task the
/// client was answered about, with its state"): one that had completed reads back
/// completed, one the client was answered `submitted` about runs and completes after the
/// restart, and `ListTasks` holds both. Method: agent `made` created over REST on a
/// server on a SQLite file (model latency 300 ms); a blocking send completes, a
/// `returnImmediately` send is answered and the server stopped at once; a second server
/// (a new `AgentSystem` built with `echo` only) on the same file. Before the fix the
/// second server read the stored tasks back at its start for the agents it was built
/// with only (the directory in memory, before the stored one was read), so `made`'s
/// were never read: `GetTask` of the completed task answered -32001 `agent "made" has
/// no task "made-task-0"`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_a2a_tasks_of_an_agent_defined_over_rest_survive_a_restart() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("troupe.db");
    let latency = Duration::from_millis(300);

    let first = server_on_file(&path, latency).await;
    let (status, body) = first.post("/v1/agents", json!({"id": "made"})).await;
    assert_eq!(status, 201, "create: {body}");
    let (status, done) = first
        .rpc("made", "SendMessage", send_params("m-done", "one", false))
        .await;
    assert_eq!(status, 200, "{done}");
    assert_eq!(
        done["result"]["task"]["status"]["state"], "TASK_STATE_COMPLETED",
        "{done}"
    );
    let done_id = done["result"]["task"]["id"].as_str().unwrap().to_string();
    let (status, waiting) = first
        .rpc("made", "SendMessage", send_params("m-wait", "two", true))
        .await;
    assert_eq!(status, 200, "{waiting}");
    assert_eq!(
        waiting["result"]["task"]["status"]["state"], "TASK_STATE_SUBMITTED",
        "{waiting}"
    );
    let waiting_id = waiting["result"]["task"]["id"].as_str().unwrap().to_string();
    first.stop().await;

    let second = server_on_file(&path, latency).await;
    let (status, read) = second.rpc("made", "GetTask", json!({"id": done_id})).await;
    assert_eq!(status, 200, "{read}");
    assert!(read.get("error").is_none(), "the completed task is lost: {read}");
    assert_eq!(read["result"]["status"]["state"], "TASK_STATE_COMPLETED", "{read}");
    assert_eq!(
        read["result"]["artifacts"][0]["parts"][0]["text"], "heard: one",
        "{read}"
    );
    let resumed = second.task_ended("made", &waiting_id).await;
    assert_eq!(
        resumed["result"]["status"]["state"], "TASK_STATE_COMPLETED",
        "{resumed}"
    );
    assert_eq!(
        resumed["result"]["artifacts"][0]["parts"][0]["text"], "heard: two",
        "{resumed}"
    );
    let (status, listed) = second.rpc("made", "ListTasks", json!({})).await;
    assert_eq!(status, 200, "{listed}");
    let mut ids: Vec<&str> = listed["result"]["tasks"]
        .as_array()
        .unwrap_or_else(|| panic!("{listed}"))
        .iter()
        .map(|task| task["id"].as_str().unwrap())
        .collect();
    ids.sort_unstable();
    let mut expected = vec![done_id.as_str(), waiting_id.as_str()];
    expected.sort_unstable();
    assert_eq!(ids, expected, "{listed}");
    second.stop().await;
}

/// Goal: a graceful stop of the server (`serve`'s shutdown, then the agent system's)
/// leaves every A2A task the client was answered `submitted` about to the next start,
/// which runs it: none is stored `failed` for the stop. Method: 13 `returnImmediately`
/// sends to `echo` (model latency 200 ms, one task at a time in its lane), the server
/// stopped once the first is `working`, a second server on the same file: each task
/// completes with its own reply. Before the fix the tasks whose turn in the lane came
/// while the agent system stopped were handed to it anyway, and the hand-over's failure
/// was stored as theirs: `TASK_STATE_FAILED`, "agent_failed: agent/echo failed: could
/// not schedule inbox work: the runtime has shut down".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_leaves_the_waiting_a2a_tasks_to_the_next_start() {
    /// Tasks sent: one running when the server stops, the rest waiting in the lane.
    const TASKS: usize = 13;
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("troupe.db");
    let latency = Duration::from_millis(200);

    let first = server_on_file(&path, latency).await;
    let mut tasks = Vec::new();
    for n in 0..TASKS {
        let (status, sent) = first
            .rpc(
                "echo",
                "SendMessage",
                send_params(&format!("m-{n}"), &format!("text {n}"), true),
            )
            .await;
        assert_eq!(status, 200, "{sent}");
        assert_eq!(
            sent["result"]["task"]["status"]["state"], "TASK_STATE_SUBMITTED",
            "{sent}"
        );
        tasks.push(sent["result"]["task"]["id"].as_str().unwrap().to_string());
    }
    let first_task = tasks[0].clone();
    let mut last = Value::Null;
    let working = tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
        loop {
            let (_, read) = first.rpc("echo", "GetTask", json!({"id": first_task})).await;
            let state = read["result"]["status"]["state"].clone();
            last = read;
            if state == "TASK_STATE_WORKING" {
                return;
            }
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
    })
    .await;
    assert!(working.is_ok(), "the first task does not start: {last}");
    first.stop().await;

    let second = server_on_file(&path, latency).await;
    for (n, task) in tasks.iter().enumerate() {
        let ended = second.task_ended("echo", task).await;
        assert_eq!(
            ended["result"]["status"]["state"], "TASK_STATE_COMPLETED",
            "task {n}: {ended}"
        );
        assert_eq!(
            ended["result"]["artifacts"][0]["parts"][0]["text"],
            format!("heard: text {n}"),
            "task {n}: {ended}"
        );
    }
    second.stop().await;
}

/// Goal: a blocking `SendMessage` in flight when the server stops gracefully is
/// answered at once with its task as it is (not ended), and the server stops without
/// waiting out its shutdown grace; the next start completes the task. Method: `echo`'s
/// model takes 3 s; a blocking send is in flight and its task `working`; the server is
/// stopped: the send's answer and `serve`'s return each come within 5 s (the grace is
/// `SERVER_SHUTDOWN_GRACE_MS`, 10 s); a second server on the file completes the task.
/// Before the fix the send waited for an end its lane no longer followed, until the
/// grace cut its connection (`the blocking send is answered at the stop: Elapsed`; by
/// hand, SIGTERM to `troupe serve`: curl got no answer after 11 s, the process exited
/// after 12 s, while a REST message in flight got its reply).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocking_send_in_flight_at_a_stop_is_answered_with_its_task_as_it_is() {
    /// How long the answer and the stop may take, in milliseconds: far less than the
    /// shutdown grace.
    const STOP_WAIT_MS: u64 = 5_000;
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("troupe.db");
    let latency = Duration::from_millis(3_000);

    let first = server_on_file(&path, latency).await;
    let send = tokio::spawn(
        first
            .request(reqwest::Method::POST, "/a2a/echo")
            .bearer_auth(TOKEN)
            .json(&json!({"jsonrpc": "2.0", "id": 1, "method": "SendMessage",
                          "params": send_params("m-block", "blocking", false)}))
            .send(),
    );
    let mut last = Value::Null;
    let working = tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
        loop {
            let (_, listed) = first.rpc("echo", "ListTasks", json!({})).await;
            let state = listed["result"]["tasks"][0]["status"]["state"].clone();
            last = listed;
            if state == "TASK_STATE_WORKING" {
                return;
            }
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
    })
    .await;
    assert!(working.is_ok(), "the task does not start: {last}");
    // The server's stop (`serve` returning), apart from the agent system's, which waits
    // for the running turn.
    let mut first = first;
    let _ = first.stop.take().unwrap().send(());
    let served = first.served.take().unwrap();
    let response = tokio::time::timeout(Duration::from_millis(STOP_WAIT_MS), send)
        .await
        .expect("the blocking send is answered at the stop")
        .unwrap()
        .expect("the blocking send gets an answer, not a cut connection");
    let status = response.status().as_u16();
    let answer: Value = response.json().await.unwrap();
    assert_eq!(status, 200, "{answer}");
    let task = answer["result"]["task"]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("{answer}"))
        .to_string();
    assert_eq!(
        answer["result"]["task"]["status"]["state"], "TASK_STATE_WORKING",
        "{answer}"
    );
    tokio::time::timeout(Duration::from_millis(STOP_WAIT_MS), served)
        .await
        .expect("the stop waited out the shutdown grace")
        .unwrap()
        .expect("serve ends cleanly");
    first.system.take().unwrap().shutdown().await;

    let second = server_on_file(&path, Duration::ZERO).await;
    let ended = second.task_ended("echo", &task).await;
    assert_eq!(ended["result"]["status"]["state"], "TASK_STATE_COMPLETED", "{ended}");
    assert_eq!(
        ended["result"]["artifacts"][0]["parts"][0]["text"], "heard: blocking",
        "{ended}"
    );
    second.stop().await;
}

/// Goal: an agent defined over REST by another server on the same store is, within the
/// directory's refresh period, in every listing and every route that checks an agent
/// exists: `GET /v1/models`, `GET /v1/topology`, and `POST /v1/links` and `PUT
/// .../permissions/...` naming it; so is one defined by an earlier run, after a restart.
/// Method: two servers on one SQLite file, both started before `made` is created on
/// the first; the second is asked only through these routes (polling `/v1/models` until
/// it lists `made`, at most `TEST_WAIT_MS_MAX`); then a third server on the file after
/// both stopped. Before the fix these routes read the directory in memory, which only
/// the agent routes read again from the store: the second server's `/v1/models` never
/// listed `made` (`/v1/models lists the agent defined elsewhere: not within 15000 ms`),
/// and after a restart, before the server's start read the stored directory too, `POST
/// /v1/links` from it was 404 `agent_not_found` (seen by hand with `troupe serve --db`).
/// (`/health` and `/metrics` count the agents this process has read, without a store
/// read of their own.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_defined_over_rest_elsewhere_or_before_a_restart_is_in_every_listing() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("troupe.db");
    let here = server_on_file(&path, Duration::ZERO).await;
    let elsewhere = server_on_file(&path, Duration::ZERO).await;
    let (status, body) = here.post("/v1/agents", json!({"id": "made"})).await;
    assert_eq!(status, 201, "create: {body}");
    let ids = |list: &Value, field: &str| -> Vec<String> {
        list[field]
            .as_array()
            .unwrap_or_else(|| panic!("{list}"))
            .iter()
            .map(|item| item["id"].as_str().unwrap().to_string())
            .collect()
    };

    let models = elsewhere
        .get_when("/v1/models", "/v1/models lists the agent defined elsewhere", |models| {
            ids(models, "data").contains(&"made".to_string())
        })
        .await;
    assert_eq!(ids(&models, "data"), ["echo", "made"], "{models}");
    let (status, topology) = elsewhere.get("/v1/topology").await;
    assert_eq!(status, 200, "{topology}");
    assert_eq!(ids(&topology, "agents"), ["echo", "made"], "/v1/topology: {topology}");
    let (status, link) = elsewhere.post("/v1/links", json!({"from": "made", "to": "echo"})).await;
    assert_eq!(status, 201, "a link from the agent defined elsewhere: {link}");
    here.stop().await;
    elsewhere.stop().await;

    let restarted = server_on_file(&path, Duration::ZERO).await;
    let (status, models) = restarted.get("/v1/models").await;
    assert_eq!(status, 200, "{models}");
    assert_eq!(ids(&models, "data"), ["echo", "made"], "after a restart: {models}");
    let (status, rule) = restarted
        .send(
            reqwest::Method::PUT,
            "/v1/agents/echo/permissions/made",
            Some(json!({"effect": "deny"})),
        )
        .await;
    assert_eq!(status, 200, "a rule naming it after a restart: {rule}");
    restarted.stop().await;
}

/// Goal: a delete that waits for its agent's running turn holds up no change to another
/// agent: while `held`'s turn runs (its model behind a gate) and `DELETE
/// /v1/agents/held` waits for it, creating, replacing and deleting other agents are
/// answered at once; the delete answers 204 once the turn ends. Before the fix one lock
/// for every definition change was held across the delete's wait: the create of
/// `other` waited for `held`'s turn and failed this test's bound (`creating another
/// agent waited for the delete`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_delete_waiting_for_its_agents_turn_holds_up_no_change_to_another_agent() {
    /// How long a change to another agent may take here, in milliseconds: it is answered
    /// at once; the turn it must not wait for is held until the test opens the gate.
    const CHANGE_WAIT_MS: u64 = 5_000;
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let llm = Gated {
        script: ScriptedLlm::new().rule(ScriptRule::any_agent().reply("heard: {input}")),
        gate: Arc::clone(&gate),
    };
    let builder = troupe_agent::AgentSystem::builder()
        .llm(Arc::new(llm))
        .agent(troupe_agent::AgentSpec::new("held"))
        .agent(troupe_agent::AgentSpec::new("kept"));
    let server = Arc::new(Harness::start(builder, ServerConfig::default().token(TOKEN)).await);
    let mut events = server.system().client().subscribe();

    let message = tokio::spawn({
        let server = Arc::clone(&server);
        async move { server.post("/v1/agents/held/messages", json!({"text": "hold"})).await }
    });
    turn_started(&mut events, "held").await;
    let delete = tokio::spawn({
        let server = Arc::clone(&server);
        async move { server.send(reqwest::Method::DELETE, "/v1/agents/held", None).await }
    });
    // The delete has taken `held` out of the directory and waits for its turn.
    server
        .get_when("/v1/agents", "held leaves the directory", |body| {
            !body["agents"]
                .as_array()
                .unwrap()
                .iter()
                .any(|agent| agent["id"] == "held")
        })
        .await;
    assert!(!delete.is_finished(), "the delete waits for the running turn");

    let change = |what: &'static str, method: reqwest::Method, path: &'static str, body: Option<Value>| {
        let server = Arc::clone(&server);
        async move {
            tokio::time::timeout(Duration::from_millis(CHANGE_WAIT_MS), server.send(method, path, body))
                .await
                .unwrap_or_else(|_| panic!("{what} waited for the delete"))
        }
    };
    let (status, body) = change(
        "creating another agent",
        reqwest::Method::POST,
        "/v1/agents",
        Some(json!({"id": "other"})),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    let (status, body) = change(
        "replacing another agent",
        reqwest::Method::PUT,
        "/v1/agents/kept",
        Some(json!({"role": "replaced"})),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = change(
        "deleting another agent",
        reqwest::Method::DELETE,
        "/v1/agents/other",
        None,
    )
    .await;
    assert_eq!(status, 204, "{body}");
    assert!(!delete.is_finished(), "the turn is still held");

    gate.add_permits(1);
    let (status, body) = message.await.unwrap();
    assert_eq!((status, &body["text"]), (200, &json!("heard: hold")), "{body}");
    let (status, body) = delete.await.unwrap();
    assert_eq!(status, 204, "{body}");
    let (status, body) = server.get("/v1/agents/held").await;
    assert_eq!(status, 404, "{body}");
    Arc::into_inner(server)
        .expect("no request holds the server")
        .stop()
        .await;
}

/// Goal: a path segment that is no UTF-8 once percent-decoded (`%FF`) is 400
/// `bad_request` with a message saying what could not be read, on every kind of route
/// (agents, conversations, links, approvals, A2A, topology), in the one error shape.
/// Before the fix the server replaced the path extractor's text by "the request failed
/// with status 400 Bad Request" under the code `http_error`, which named nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_segment_that_is_no_utf8_is_400_bad_request_saying_so() {
    let server = Harness::start(
        support::agents(ScriptedLlm::new(), &["echo"], KindConfig::default()),
        ServerConfig::default().token(TOKEN),
    )
    .await;
    let probes = [
        (reqwest::Method::GET, "/v1/agents/%FF"),
        (reqwest::Method::POST, "/v1/agents/%FF/messages"),
        (reqwest::Method::GET, "/v1/agents/echo/tasks/%C3%28"),
        (reqwest::Method::GET, "/v1/conversations/%FF/messages"),
        (reqwest::Method::PATCH, "/v1/links/echo/%FF"),
        (reqwest::Method::POST, "/v1/approvals/%FF/approve"),
        (reqwest::Method::POST, "/a2a/%FF"),
        (reqwest::Method::GET, "/v1/topology/agents/%FF/call-tree"),
    ];
    for (method, path) in probes {
        let body = (method != reqwest::Method::GET).then(|| json!({}));
        let (status, answer) = server.send(method.clone(), path, body).await;
        assert_eq!(status, 400, "{method} {path}: {answer}");
        assert_eq!(answer["error"]["code"], "bad_request", "{method} {path}: {answer}");
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("UTF-8"),
            "{method} {path}: the message names the cause: {message}"
        );
    }
    // Well-formed percent-encoding is decoded: not refused.
    let (status, answer) = server.get("/v1/agents/%65cho").await;
    assert_eq!((status, &answer["id"]), (200, &json!("echo")), "{answer}");
    server.stop().await;
}

/// Goal: agent ids that look like paths or hold any Unicode (`../etc`, `a/b`, `x%41`,
/// `é€😀`, `two words`) are ids like any other: created, read back at their
/// percent-encoded path, messaged, listed and deleted, never another agent's and never a
/// route. Held before any fix (a probe kept as a test: not covered elsewhere for REST).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_that_look_like_paths_are_ids_like_any_other() {
    let llm = ScriptedLlm::new().rule(ScriptRule::any_agent().reply("{agent} heard: {input}"));
    let server = Harness::start(
        support::agents(llm, &["echo", "etc"], KindConfig::default()),
        ServerConfig::default().token(TOKEN),
    )
    .await;
    let ids = ["../etc", "a/b", "x%41", "é€😀", "two words"];
    for id in ids {
        let (status, body) = server.post("/v1/agents", json!({"id": id})).await;
        assert_eq!(status, 201, "create {id:?}: {body}");
    }
    for id in ids {
        let path = format!("/v1/agents/{}", percent_encode(id));
        let (status, body) = server.get(&path).await;
        assert_eq!((status, &body["id"]), (200, &json!(id)), "{path}: {body}");
        let (status, reply) = server.post(&format!("{path}/messages"), json!({"text": "hello"})).await;
        assert_eq!(status, 200, "{path}/messages: {reply}");
        assert_eq!(reply["agent"], id, "{reply}");
        assert_eq!(reply["text"], format!("{id} heard: hello"), "{reply}");
    }
    let (_, etc) = server.get("/v1/agents/etc/history").await;
    assert_eq!(etc["total"], 0, "`../etc` is not `etc`: {etc}");
    for id in ids {
        let path = format!("/v1/agents/{}", percent_encode(id));
        let (status, body) = server.send(reqwest::Method::DELETE, &path, None).await;
        assert_eq!(status, 204, "delete {path}: {body}");
    }
    let (_, listed) = server.get("/v1/agents").await;
    let left: Vec<&str> = listed["agents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|agent| agent["id"].as_str().unwrap())
        .collect();
    assert_eq!(left, ["echo", "etc"], "{listed}");
    server.stop().await;
}

/// Every byte of `text` but RFC 3986's unreserved ones, percent-encoded.
fn percent_encode(text: &str) -> String {
    text.bytes()
        .map(|byte| {
            if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
                (byte as char).to_string()
            } else {
                format!("%{byte:02X}")
            }
        })
        .collect()
}

/// Goal: the JSON-RPC envelope's errors follow JSON-RPC 2.0: an error of a request
/// whose id was read is answered under that id (here `params` that are not an object,
/// -32602, for ids 7, "s" and 1.5), an Invalid Request (-32600) and a Parse error
/// (-32700) under `null`; a notification (no id) is not answered (202, no body). Before the
/// fix `params` that were not an object were answered with the id `null`, which a client
/// cannot match to its request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_rpc_envelope_errors_carry_the_requests_id_when_it_was_read() {
    let server = Harness::start(
        support::agents(ScriptedLlm::new(), &["echo"], KindConfig::default()),
        ServerConfig::default().token(TOKEN),
    )
    .await;
    let raw = |body: String| {
        let request = server
            .request(reqwest::Method::POST, "/a2a/echo")
            .bearer_auth(TOKEN)
            .header("content-type", "application/json")
            .body(body)
            .send();
        async move {
            let response = request.await.expect("the server answers");
            let status = response.status().as_u16();
            (status, response.json::<Value>().await.unwrap())
        }
    };
    for id in [json!(7), json!("s"), json!(1.5)] {
        for params in [json!([1]), json!("x"), json!(3)] {
            let body = json!({"jsonrpc": "2.0", "id": id, "method": "GetTask", "params": params});
            let (status, answer) = raw(body.to_string()).await;
            assert_eq!(status, 200, "{answer}");
            assert_eq!(answer["error"]["code"], -32602, "{body}: {answer}");
            assert_eq!(answer["id"], id, "{body}: {answer}");
            assert_eq!(answer["jsonrpc"], "2.0", "{answer}");
        }
    }
    let invalid = [
        json!({"jsonrpc": "1.0", "id": 7, "method": "GetTask"}),
        json!({"id": 7, "method": "GetTask"}),
        json!({"jsonrpc": "2.0", "id": {"a": 1}, "method": "GetTask"}),
        json!({"jsonrpc": "2.0", "id": true, "method": "GetTask"}),
        json!({"jsonrpc": "2.0", "id": 7, "method": 5}),
        json!([{"jsonrpc": "2.0", "id": 7, "method": "GetTask", "params": {"id": "x"}}]),
        json!([]),
    ];
    for body in invalid {
        let (status, answer) = raw(body.to_string()).await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["error"]["code"], -32600, "{body}: {answer}");
        assert_eq!(answer["id"], Value::Null, "{body}: {answer}");
    }
    for body in ["", "{", "\u{feff}{}", "{\"jsonrpc\": \"2.0\",}"] {
        let (status, answer) = raw(body.to_string()).await;
        assert_eq!(
            (status, &answer["error"]["code"]),
            (200, &json!(-32700)),
            "{body:?}: {answer}"
        );
        assert_eq!(answer["id"], Value::Null, "{answer}");
    }
    // A notification is not answered at all since 2026-12-07 (JSON-RPC 2.0, 4.1; see
    // tests/operator_gaps.rs): 202, no body. Before, its error came under `null`.
    let notified = server
        .request(reqwest::Method::POST, "/a2a/echo")
        .bearer_auth(TOKEN)
        .header("content-type", "application/json")
        .body(json!({"jsonrpc": "2.0", "method": "GetTask", "params": {"id": "none"}}).to_string())
        .send()
        .await
        .expect("the server answers");
    assert_eq!(notified.status().as_u16(), 202);
    assert_eq!(notified.text().await.unwrap(), "");
    server.stop().await;
}

/// Goal: the OpenAI-compatible route answers the requests a client of OpenAI may send as
/// docs/serve.md says: fields it does not use are ignored (the client's `tools` and
/// `tool_choice` are not the agent's tools; `n: 1` is served, another `n` refused since
/// 2026-12-06, below and in `tests/serve_gaps.rs`), only the last `user`
/// message goes to the agent (messages of other roles, unknown ones included, are
/// ignored, also after it), text parts are joined as they are; and each malformed request
/// is a typed 4xx naming what was wrong, the same streamed or not, before the agent is
/// asked. Held before any fix (a probe kept as a test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_requests_with_unused_fields_or_malformed_parts_are_answered_as_documented() {
    let llm = ScriptedLlm::new().rule(ScriptRule::agent("echo").reply("echo: {input}"));
    let server = Harness::start(
        support::agents(llm.clone(), &["echo"], KindConfig::default()),
        ServerConfig::default().token(TOKEN),
    )
    .await;
    let user = |text: &str| json!({"role": "user", "content": text});
    let (status, body) = server
        .post(
            "/v1/chat/completions",
            json!({"model": "echo", "n": 1, "tool_choice": "required",
                   "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                   "messages": [user("first"), {"role": "robot", "content": "?"}, user("second"),
                                {"role": "assistant", "content": "after"}, {"role": "tool", "content": "t"}]}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"].as_array().map(Vec::len), Some(1), "{body}");
    assert_eq!(body["choices"][0]["message"]["content"], "echo: second", "{body}");
    assert!(body["choices"][0]["message"].get("tool_calls").is_none(), "{body}");
    let (status, body) = server
        .post(
            "/v1/chat/completions",
            json!({"model": "echo", "messages": [{"role": "user", "content": [
                {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}),
        )
        .await;
    assert_eq!(
        (status, &body["choices"][0]["message"]["content"]),
        (200, &json!("echo: ab")),
        "{body}"
    );
    let asked = llm.requests_of("echo").len();

    let long = "x".repeat(troupe_server::limits::SERVER_MESSAGE_SIZE_MAX_BYTES + 1);
    let refusals = [
        (json!({"model": "echo", "messages": []}), 400, "no_user_message", "user"),
        (
            json!({"model": "echo", "n": 3, "messages": [user("x")]}),
            400,
            "invalid_request_error",
            "n is 3",
        ),
        (
            json!({"model": "echo", "messages": [{"role": "robot", "content": "x"}]}),
            400,
            "no_user_message",
            "user",
        ),
        (json!({"model": "echo"}), 400, "invalid_body", "messages"),
        (json!({"messages": [user("x")]}), 400, "invalid_body", "model"),
        (
            json!({"model": "echo", "messages": [{"content": "x"}]}),
            400,
            "invalid_body",
            "role",
        ),
        (
            json!({"model": "echo", "messages": [user("x")], "stream": "true"}),
            400,
            "invalid_body",
            "stream",
        ),
        (
            json!({"model": "echo", "messages": [user("")]}),
            400,
            "empty_message",
            "empty",
        ),
        (
            json!({"model": "echo", "messages": [{"role": "user", "content": null}]}),
            400,
            "unsupported_content",
            "content",
        ),
        (
            json!({"model": "echo", "messages": [{"role": "user", "content": 7}]}),
            400,
            "unsupported_content",
            "content",
        ),
        (
            json!({"model": "echo", "messages": [user(&long)]}),
            400,
            "message_too_long",
            "limit",
        ),
        (
            json!({"model": "", "messages": [user("x")]}),
            404,
            "model_not_found",
            "model",
        ),
        (
            json!({"model": "../echo", "messages": [user("x")]}),
            404,
            "model_not_found",
            "model",
        ),
    ];
    for (body, status_expected, code, named) in refusals {
        for stream in [false, true] {
            let mut request = body.clone();
            if stream && request.get("stream").is_none() {
                request["stream"] = json!(true);
            }
            let (status, answer) = server.post("/v1/chat/completions", request.clone()).await;
            assert_eq!(
                (status, error_code(&answer)),
                (status_expected, code),
                "{request}: {answer}"
            );
            let message = answer["error"]["message"].as_str().unwrap();
            assert!(
                message.contains(named),
                "{request}: the message names {named:?}: {message}"
            );
        }
    }
    assert_eq!(
        llm.requests_of("echo").len(),
        asked,
        "no refused request reached the agent"
    );
    server.stop().await;
}

fn error_code(body: &Value) -> &str {
    body["error"]["code"]
        .as_str()
        .unwrap_or_else(|| panic!("no error code: {body}"))
}

/// Goal: `GET /v1/events` keeps at most `SERVER_EVENT_STREAMS_MAX` (64) streams open:
/// one more is 503 `overloaded` with `Retry-After: 1`, a stream whose client leaves gives
/// its place back (`troupe_event_streams_open` counts them, back to 0 when all left).
/// Held before any fix (a probe kept as a test: the limit had no test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_streams_past_their_limit_are_refused_503_until_one_leaves() {
    use troupe_server::limits::SERVER_EVENT_STREAMS_MAX;
    const OPEN: &str = "troupe_event_streams_open";
    let server = Harness::start(
        support::agents(ScriptedLlm::new(), &["echo"], KindConfig::default()),
        ServerConfig::default().token(TOKEN),
    )
    .await;
    let open = || {
        server
            .request(reqwest::Method::GET, "/v1/events")
            .bearer_auth(TOKEN)
            .send()
    };
    let mut streams = Vec::new();
    for n in 0..SERVER_EVENT_STREAMS_MAX {
        let response = open().await.expect("the server answers");
        assert_eq!(response.status().as_u16(), 200, "stream {n}");
        streams.push(response);
    }
    server
        .gauge_when(OPEN, SERVER_EVENT_STREAMS_MAX as u64, "all open")
        .await;
    let refused = open().await.expect("the server answers");
    assert_eq!(refused.status().as_u16(), 503);
    assert_eq!(refused.headers()["retry-after"], "1");
    let body: Value = refused.json().await.unwrap();
    assert_eq!(error_code(&body), "overloaded", "{body}");

    drop(streams.pop());
    server
        .gauge_when(OPEN, SERVER_EVENT_STREAMS_MAX as u64 - 1, "a stream whose client left")
        .await;
    let again = open().await.expect("the server answers");
    assert_eq!(again.status().as_u16(), 200, "the place given back is taken");
    streams.push(again);
    drop(streams);
    server.gauge_when(OPEN, 0, "every client left").await;
    server.stop().await;
}
