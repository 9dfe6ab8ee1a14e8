//! The conversation routes end to end: a real `troupe_server::serve` on 127.0.0.1:0,
//! the real `AgentSystem` on the scripted model, real HTTP (reqwest). Creating direct
//! and group conversations of agents and humans, posting (a retry is a no-op), @mentions
//! that trigger the agents' turns whose replies are appended, cursor paging, the error
//! statuses and codes, and concurrent posts getting gap-free seqs.
//!
//! Normal build only: HTTP is not simulated (the crate is empty under madsim).
#![cfg(not(madsim))]

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use troupe_agent::{ScriptRule, ScriptedLlm, CONVERSATIONS_LISTED_MAX};
use troupe_runtime::KindConfig;
use troupe_server::limits::SERVER_CONVERSATION_PAGE_MAX;
use troupe_server::ServerConfig;

mod support;
use support::{Harness, POLL_MS, TEST_WAIT_MS_MAX};

const TOKEN: &str = "conversation-token-0123456789";

fn script() -> ScriptedLlm {
    ScriptedLlm::new()
        .rule(ScriptRule::agent("alice").reply("alice here; @carol please check"))
        .rule(ScriptRule::agent("carol").reply("carol checked"))
}

async fn start() -> Harness {
    let builder = support::agents(script(), &["alice", "carol", "idle"], KindConfig::default());
    Harness::start(builder, ServerConfig::default().token(TOKEN)).await
}

fn party(kind: &str, name: &str) -> Value {
    json!({"kind": kind, "name": name})
}

async fn create_group(server: &Harness, id: &str, participants: Value) {
    let (status, body) = server
        .post(
            "/v1/conversations",
            json!({"id": id, "kind": "group", "participants": participants}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
}

async fn post(server: &Harness, id: &str, human: &str, msg_id: &str, text: &str) -> (u16, Value) {
    server
        .post(
            &format!("/v1/conversations/{id}/messages"),
            json!({"sender": party("human", human), "msg_id": msg_id, "text": text}),
        )
        .await
}

/// Every message of conversation `id`, read page by page (`limit` each): the messages
/// and the number of pages.
async fn read_all(server: &Harness, id: &str, limit: usize) -> (Vec<Value>, usize) {
    let mut messages = Vec::new();
    let mut after: Option<u64> = None;
    let mut pages = 0;
    loop {
        let path = match after {
            Some(seq) => format!("/v1/conversations/{id}/messages?after={seq}&limit={limit}"),
            None => format!("/v1/conversations/{id}/messages?limit={limit}"),
        };
        let (status, body) = server.get(&path).await;
        assert_eq!(status, 200, "{body}");
        pages += 1;
        let page = body["messages"].as_array().unwrap();
        assert!(page.len() <= limit, "{body}");
        messages.extend(page.iter().cloned());
        match body["next_after"].as_u64() {
            Some(next) => {
                assert_eq!(Some(next), page.last().and_then(|message| message["seq"].as_u64()));
                after = Some(next);
            }
            None => return (messages, pages),
        }
    }
}

fn seqs(messages: &[Value]) -> Vec<u64> {
    messages
        .iter()
        .map(|message| message["seq"].as_u64().unwrap())
        .collect()
}

/// Goal: a human's post mentioning an agent triggers that agent's turn, and the reply,
/// which mentions a second agent, triggers its turn too: both replies are appended with
/// `reply_to` and the chain, as through the Rust API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mention_posted_over_http_triggers_the_agents_turns_and_their_replies_are_appended() {
    let server = start().await;
    create_group(
        &server,
        "plan",
        json!([party("human", "hugo"), party("agent", "alice"), party("agent", "carol")]),
    )
    .await;
    let (status, body) = server.get("/v1/agents/alice/conversations").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["conversations"], json!(["plan"]));
    assert_eq!(body["truncated"], false);

    let (status, posted) = post(&server, "plan", "hugo", "m1", "@alice ship it?").await;
    assert_eq!(status, 200, "{posted}");
    assert_eq!((posted["seq"].as_u64(), &posted["duplicate"]), (Some(0), &json!(false)));

    let waited = tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
        loop {
            let (messages, _) = read_all(&server, "plan", SERVER_CONVERSATION_PAGE_MAX).await;
            if messages.len() >= 3 {
                return messages;
            }
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
    })
    .await;
    let messages = waited.expect("alice and carol answered in time");
    assert_eq!(seqs(&messages), [0, 1, 2], "{messages:#?}");
    assert_eq!(messages[0]["sender"], party("human", "hugo"));
    assert_eq!(messages[0]["mentions"], json!(["alice"]));
    assert_eq!(messages[1]["sender"], party("agent", "alice"));
    assert_eq!(messages[1]["text"], "alice here; @carol please check");
    assert_eq!(messages[1]["reply_to"], 0);
    assert_eq!(messages[1]["chain"], json!(["alice"]));
    assert_eq!(messages[2]["sender"], party("agent", "carol"));
    assert_eq!(messages[2]["text"], "carol checked");
    assert_eq!(messages[2]["reply_to"], 1);
    assert_eq!(messages[2]["chain"], json!(["alice", "carol"]));
    assert_eq!(messages[2]["note"], Value::Null);
    server.stop().await;
}

/// Goal: pages follow the `next_after` cursor through every message once, in seq order,
/// without gaps, and the last page has no cursor; a retried post (same `msg_id`) appends
/// nothing and returns the first seq; an agent's list shows its conversations in id
/// order, a direct one included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_page_by_seq_through_the_cursor_and_a_retried_post_appends_nothing() {
    let server = start().await;
    create_group(
        &server,
        "room",
        json!([party("human", "ann"), party("human", "bob"), party("agent", "idle")]),
    )
    .await;
    let (status, direct) = server
        .post(
            "/v1/conversations",
            json!({"id": "a-direct", "kind": "direct", "participants": [party("human", "ann"), party("agent", "idle")]}),
        )
        .await;
    assert_eq!(status, 200, "{direct}");
    assert_eq!(direct["kind"], "direct");
    for index in 0..7_u64 {
        let human = if index % 2 == 0 { "ann" } else { "bob" };
        let (status, posted) = post(&server, "room", human, &format!("m{index}"), &format!("note {index}")).await;
        assert_eq!(status, 200, "{posted}");
        assert_eq!(posted["seq"], index);
    }
    let (status, again) = post(&server, "room", "bob", "m3", "note 3").await;
    assert_eq!(status, 200, "{again}");
    assert_eq!((again["seq"].as_u64(), &again["duplicate"]), (Some(3), &json!(true)));

    let (messages, pages) = read_all(&server, "room", 3).await;
    assert_eq!(seqs(&messages), (0..7).collect::<Vec<_>>());
    assert_eq!(pages, 3, "pages of 3, 3 and 1");
    assert_eq!(messages[4]["text"], "note 4");
    assert_eq!(messages[5]["sender"], party("human", "bob"));
    // Exactly full last page: one more request finds it empty.
    let (messages, pages) = read_all(&server, "room", 7).await;
    assert_eq!((messages.len(), pages), (7, 2));
    let (status, body) = server.get("/v1/conversations/room/messages?after=6").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["messages"], json!([]));
    assert_eq!(body["next_after"], Value::Null);

    let (status, body) = server.get("/v1/agents/idle/conversations").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["conversations"], json!(["a-direct", "room"]));
    server.stop().await;
}

/// Goal: an agent's conversations page by id through the `next_after` cursor, each
/// once and in id order, the last page without a cursor (a page exactly full is
/// followed by an empty one); and a conversation's definition reads back as it was
/// created, participants in their sorted order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_conversations_page_by_id_and_a_definition_reads_back() {
    let server = start().await;
    let ids = ["c-04", "c-00", "c-03", "c-01", "c-02"];
    for id in ids {
        create_group(&server, id, json!([party("human", "hugo"), party("agent", "alice")])).await;
    }
    // Another agent's conversation is not in alice's list.
    create_group(
        &server,
        "c-05",
        json!([party("human", "hugo"), party("agent", "carol")]),
    )
    .await;
    for limit in [1, 2, 5, 6] {
        let mut listed = Vec::new();
        let mut pages = 0;
        let mut after: Option<String> = None;
        loop {
            let path = match &after {
                Some(id) => format!("/v1/agents/alice/conversations?after={id}&limit={limit}"),
                None => format!("/v1/agents/alice/conversations?limit={limit}"),
            };
            let (status, body) = server.get(&path).await;
            assert_eq!(status, 200, "{body}");
            pages += 1;
            assert!(pages <= 10, "the cursor does not move: {body}");
            let page: Vec<String> = body["conversations"]
                .as_array()
                .unwrap()
                .iter()
                .map(|id| id.as_str().unwrap().to_string())
                .collect();
            assert!(page.len() <= limit, "{body}");
            assert_eq!(body["truncated"], body["next_after"].is_string(), "{body}");
            listed.extend(page.iter().cloned());
            match body["next_after"].as_str() {
                Some(next) => {
                    assert_eq!(Some(next), page.last().map(String::as_str), "{body}");
                    after = Some(next.to_string());
                }
                None => break,
            }
        }
        assert_eq!(listed, ["c-00", "c-01", "c-02", "c-03", "c-04"], "limit {limit}");
        // Five ids: pages of `limit`, and an empty last one when the pages fill exactly.
        assert_eq!(pages, 5 / limit + 1, "limit {limit}");
    }
    // Without a limit: all of them in one page, as before paging.
    let (status, body) = server.get("/v1/agents/alice/conversations").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["conversations"], json!(["c-00", "c-01", "c-02", "c-03", "c-04"]));
    assert_eq!((&body["truncated"], &body["next_after"]), (&json!(false), &Value::Null));

    let (status, created) = server
        .post(
            "/v1/conversations",
            json!({"id": "pair", "kind": "direct", "participants": [party("human", "hugo"), party("agent", "carol")]}),
        )
        .await;
    assert_eq!(status, 200, "{created}");
    let (status, read) = server.get("/v1/conversations/pair").await;
    assert_eq!(status, 200, "{read}");
    assert_eq!(read, created);
    assert_eq!(read["kind"], "direct");
    let (status, group) = server.get("/v1/conversations/c-03").await;
    assert_eq!(status, 200, "{group}");
    assert_eq!(
        group,
        json!({"id": "c-03", "kind": "group", "participants": [party("agent", "alice"), party("human", "hugo")]})
    );
    server.stop().await;
}

/// One refused request: what it shows, method, path, body, status, error code.
type Refusal = (&'static str, reqwest::Method, String, Option<Value>, u16, &'static str);

/// Goal: every refusal has the one JSON error shape with its status and code: unknown
/// conversation or agent 404, a sender outside the conversation 403, bad participants,
/// names, text and mentions 422, a conflicting definition 409, a bad page query 400, a
/// body without its fields 422.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversation_refusals_have_their_status_and_code() {
    let server = start().await;
    create_group(&server, "room", json!([party("human", "ann"), party("agent", "alice")])).await;
    let over = SERVER_CONVERSATION_PAGE_MAX + 1;
    let cases: Vec<Refusal> = vec![
        (
            "unknown conversation, read",
            reqwest::Method::GET,
            "/v1/conversations/nowhere/messages".into(),
            None,
            404,
            "conversation_not_found",
        ),
        (
            "unknown conversation, post",
            reqwest::Method::POST,
            "/v1/conversations/nowhere/messages".into(),
            Some(json!({"sender": party("human", "ann"), "msg_id": "x", "text": "hi"})),
            404,
            "conversation_not_found",
        ),
        (
            "unknown agent's list",
            reqwest::Method::GET,
            "/v1/agents/nobody/conversations".into(),
            None,
            404,
            "agent_not_found",
        ),
        (
            "unknown agent as participant",
            reqwest::Method::POST,
            "/v1/conversations".into(),
            Some(
                json!({"id": "x", "kind": "group", "participants": [party("human", "ann"), party("agent", "nobody")]}),
            ),
            404,
            "agent_not_found",
        ),
        (
            "sender not a participant",
            reqwest::Method::POST,
            "/v1/conversations/room/messages".into(),
            Some(json!({"sender": party("human", "eve"), "msg_id": "x", "text": "hi"})),
            403,
            "not_participant",
        ),
        (
            "direct of three",
            reqwest::Method::POST,
            "/v1/conversations".into(),
            Some(
                json!({"id": "d", "kind": "direct", "participants": [party("human", "a"), party("human", "b"), party("human", "c")]}),
            ),
            422,
            "invalid_participants",
        ),
        (
            "reserved id",
            reqwest::Method::POST,
            "/v1/conversations".into(),
            Some(json!({"id": "_mine", "kind": "group", "participants": [party("human", "a"), party("human", "b")]})),
            422,
            "invalid_name",
        ),
        (
            "conflicting definition",
            reqwest::Method::POST,
            "/v1/conversations".into(),
            Some(
                json!({"id": "room", "kind": "group", "participants": [party("human", "bob"), party("agent", "alice")]}),
            ),
            409,
            "conversation_conflict",
        ),
        (
            "empty text",
            reqwest::Method::POST,
            "/v1/conversations/room/messages".into(),
            Some(json!({"sender": party("human", "ann"), "msg_id": "x", "text": ""})),
            422,
            "invalid_text",
        ),
        (
            "mention of a stranger",
            reqwest::Method::POST,
            "/v1/conversations/room/messages".into(),
            Some(json!({"sender": party("human", "ann"), "msg_id": "x", "text": "@carol hi"})),
            422,
            "unknown_mention",
        ),
        (
            "no msg_id",
            reqwest::Method::POST,
            "/v1/conversations/room/messages".into(),
            Some(json!({"sender": party("human", "ann"), "text": "hi"})),
            422,
            "invalid_body",
        ),
        (
            "unknown sender kind",
            reqwest::Method::POST,
            "/v1/conversations/room/messages".into(),
            Some(json!({"sender": party("robot", "ann"), "msg_id": "x", "text": "hi"})),
            422,
            "invalid_body",
        ),
        (
            "limit 0",
            reqwest::Method::GET,
            "/v1/conversations/room/messages?limit=0".into(),
            None,
            400,
            "invalid_query",
        ),
        (
            "limit over the max",
            reqwest::Method::GET,
            format!("/v1/conversations/room/messages?limit={over}"),
            None,
            400,
            "invalid_query",
        ),
        (
            "cursor not a number",
            reqwest::Method::GET,
            "/v1/conversations/room/messages?after=first".into(),
            None,
            400,
            "invalid_query",
        ),
        (
            "unknown conversation, definition",
            reqwest::Method::GET,
            "/v1/conversations/nowhere".into(),
            None,
            404,
            "conversation_not_found",
        ),
        (
            "reserved id, definition",
            reqwest::Method::GET,
            "/v1/conversations/_index".into(),
            None,
            404,
            "conversation_not_found",
        ),
        (
            "an agent's list, limit 0",
            reqwest::Method::GET,
            "/v1/agents/alice/conversations?limit=0".into(),
            None,
            400,
            "invalid_query",
        ),
        (
            "an agent's list, limit over the max",
            reqwest::Method::GET,
            format!("/v1/agents/alice/conversations?limit={}", CONVERSATIONS_LISTED_MAX + 1),
            None,
            400,
            "invalid_query",
        ),
        (
            "an agent's list, an unknown query field",
            reqwest::Method::GET,
            "/v1/agents/alice/conversations?from=room".into(),
            None,
            400,
            "invalid_query",
        ),
    ];
    for (what, method, path, body, status, code) in cases {
        let (got, answer) = server.send(method, &path, body).await;
        assert_eq!(got, status, "{what}: {answer}");
        assert_eq!(answer["error"]["code"], code, "{what}: {answer}");
        assert!(
            !answer["error"]["message"].as_str().unwrap().is_empty(),
            "{what}: {answer}"
        );
    }
    // Nothing refused was appended.
    let (status, body) = server.get("/v1/conversations/room/messages").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["messages"], json!([]));
    server.stop().await;
}

/// Goal: posts sent at once by many clients to one conversation each get their own
/// seq, and the log holds them all, gap-free.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_posts_get_distinct_gap_free_seqs() {
    const POSTS: u64 = 24;
    let server = Arc::new(start().await);
    create_group(&server, "busy", json!([party("human", "ann"), party("human", "bob")])).await;
    let mut tasks = Vec::new();
    for index in 0..POSTS {
        let server = Arc::clone(&server);
        tasks.push(tokio::spawn(async move {
            let human = if index % 2 == 0 { "ann" } else { "bob" };
            let (status, posted) = post(&server, "busy", human, &format!("p{index}"), &format!("post {index}")).await;
            assert_eq!(status, 200, "{posted}");
            (index, posted["seq"].as_u64().unwrap())
        }));
    }
    let mut assigned = Vec::new();
    for task in tasks {
        assigned.push(task.await.unwrap());
    }
    let mut got: Vec<u64> = assigned.iter().map(|(_, seq)| *seq).collect();
    got.sort_unstable();
    assert_eq!(got, (0..POSTS).collect::<Vec<_>>());
    let (messages, _) = read_all(&server, "busy", 5).await;
    assert_eq!(seqs(&messages), (0..POSTS).collect::<Vec<_>>());
    for (index, seq) in assigned {
        let position = usize::try_from(seq).unwrap();
        assert_eq!(messages[position]["text"], format!("post {index}"));
    }
    Arc::into_inner(server).unwrap().stop().await;
}
