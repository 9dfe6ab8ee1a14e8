//! A2A tasks survive a crash of `troupe serve`: the process is killed (SIGKILL) while
//! an A2A task of the slow scripted archivist runs, and a new process on the same
//! SQLite file finishes it. Normal build only (the server is not built under madsim).
#![cfg(not(madsim))]

mod support;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

/// The longest the binary may take to start, answer or finish the task, in
/// milliseconds (the archivist's scripted turn takes 4 s).
const SERVE_WAIT_MS_MAX: u64 = 30_000;
/// How often a task is read while waiting, in milliseconds.
const POLL_MS: u64 = 50;

type Stdout = std::io::BufReader<std::process::ChildStdout>;

/// A `troupe serve` process on `db`: the child, its stdout (held open: the server
/// prints little after its address) and the address.
fn serve(db: &std::path::Path) -> (Child, Stdout, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_troupe"))
        .args(["serve", "--bind", "127.0.0.1:0", "--scripted", "--db"])
        .arg(db)
        .env_remove("TROUPE_TOKEN")
        .env_remove("OPENAI_API_KEY")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (stdout, addr) = support::read_address(&mut child).expect("troupe serve printed no address");
    (child, stdout, addr)
}

fn rpc(addr: &str, method: &str, params: Value) -> Value {
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).to_string();
    let (status, text) = support::http(addr, "POST", "/a2a/archivist", &body, SERVE_WAIT_MS_MAX);
    assert_eq!(status, 200, "{text}");
    serde_json::from_str(&text).unwrap()
}

fn state_of(addr: &str, id: &str) -> String {
    let answer = rpc(addr, "GetTask", json!({"id": id}));
    assert!(answer.get("error").is_none(), "the task is lost: {answer}");
    answer["result"]["status"]["state"].as_str().unwrap().to_string()
}

/// Goal: an A2A task sent with `returnImmediately` is never lost when the server is
/// killed mid-task: after a restart on the same data file, GetTask finds it (submitted
/// or working) and then completed, with the agent's reply, and the agent's turn ran to
/// a committed end once; the message sent again to the second process is that task.
/// Method: send to the slow archivist (4 s turn), wait until it works, SIGKILL, start a
/// second process on the same `--db`, poll GetTask, send the message again.
#[tokio::test]
async fn an_a2a_task_survives_a_sigkill_of_the_server() {
    let db = std::env::temp_dir().join(format!("troupe-a2a-restart-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&db);
    std::fs::create_dir_all(&db).unwrap();
    let (mut first, _stdout, addr) = serve(&db);
    let message =
        json!({"messageId": "restart-1", "role": "ROLE_USER", "parts": [{"text": "Any reports on batteries?"}]});
    let sent = rpc(
        &addr,
        "SendMessage",
        json!({"message": message.clone(), "configuration": {"returnImmediately": true}}),
    );
    let task = &sent["result"]["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_SUBMITTED", "{sent}");
    let id = task["id"].as_str().unwrap().to_string();
    let mut polls = 0;
    while state_of(&addr, &id) != "TASK_STATE_WORKING" {
        polls += 1;
        assert!(polls * POLL_MS < SERVE_WAIT_MS_MAX, "the task never started");
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
    // Well inside the archivist's 4 s turn: handed over and running, not committed.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert_eq!(state_of(&addr, &id), "TASK_STATE_WORKING");
    first.kill().unwrap(); // SIGKILL
    first.wait().unwrap();

    let (mut second, _stdout2, addr) = serve(&db);
    let mut seen = Vec::new();
    let mut polls = 0;
    loop {
        let state = state_of(&addr, &id);
        if seen.last() != Some(&state) {
            seen.push(state.clone());
        }
        if state == "TASK_STATE_COMPLETED" {
            break;
        }
        assert!(
            matches!(state.as_str(), "TASK_STATE_SUBMITTED" | "TASK_STATE_WORKING"),
            "{seen:?}"
        );
        polls += 1;
        assert!(
            polls * POLL_MS < SERVE_WAIT_MS_MAX,
            "the task never completed: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
    let done = rpc(&addr, "GetTask", json!({"id": id}))["result"].clone();
    assert_eq!(
        done["artifacts"][0]["parts"][0]["text"], "Reports: none found.",
        "{done}"
    );
    // The message sent again to the restarted server is the task it started.
    let again = rpc(&addr, "SendMessage", json!({"message": message}))["result"]["task"].clone();
    assert_eq!(again["id"], id.as_str(), "{again}");
    assert_eq!(again["status"]["state"], "TASK_STATE_COMPLETED", "{again}");
    let listed = rpc(&addr, "ListTasks", json!({}))["result"].clone();
    assert_eq!(listed["totalSize"], 1, "{listed}");
    // The agent's log holds the task's question once (one committed turn).
    let (status, history) = support::http(&addr, "GET", "/v1/agents/archivist/history", "", SERVE_WAIT_MS_MAX);
    assert_eq!(status, 200, "{history}");
    assert_eq!(history.matches("Any reports on batteries?").count(), 1, "{history}");
    second.kill().unwrap();
    second.wait().unwrap();
    let _ = std::fs::remove_dir_all(&db);
}
