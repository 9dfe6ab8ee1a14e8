//! The organisation routes end to end: a real `troupe_server::serve` on 127.0.0.1:0,
//! the real `AgentSystem` on the scripted model, real HTTP (reqwest). Links,
//! permission rules, memberships and the policy round trip over REST and change what
//! admission decides; every error status of these routes; approvals: a call that needs
//! approval waits, is listed by `GET /v1/approvals`, and proceeds once approved over
//! HTTP or is refused once denied; approve and deny racing over HTTP have exactly one
//! winner.
//!
//! Normal build only: HTTP is not simulated (the crate is empty under madsim).
#![cfg(not(madsim))]

use std::time::Duration;

use reqwest::Method;
use serde_json::{json, Value};
use troupe_agent::{ScriptRule, ScriptedLlm};
use troupe_runtime::KindConfig;
use troupe_server::limits::SERVER_REQUEST_BODY_SIZE_MAX_BYTES;
use troupe_server::ServerConfig;

mod support;
use support::{Harness, POLL_MS, TEST_WAIT_MS_MAX};

const TOKEN: &str = "org-routes-token-0123456789";

/// `a` asks `b` (call_agent) whatever it is told and reports the tool result; `b`
/// answers "42"; `c` answers "c here".
fn script() -> ScriptedLlm {
    ScriptedLlm::new()
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("")
                .call("call_agent", json!({"agent_id": "b", "message": "what is 6 x 7?"})),
        )
        .rule(ScriptRule::agent("a").on_tool_result().reply("result: {tool_result}"))
        .rule(ScriptRule::agent("b").reply("42"))
        .rule(ScriptRule::agent("c").reply("c here"))
}

async fn start() -> Harness {
    let config = ServerConfig {
        token: Some(TOKEN.to_string()),
        ..ServerConfig::default()
    };
    Harness::start(
        support::agents(script(), &["a", "b", "c"], KindConfig::default()),
        config,
    )
    .await
}

impl Harness {
    async fn put(&self, path: &str, body: Value) -> (u16, Value) {
        self.send(Method::PUT, path, Some(body)).await
    }

    async fn delete(&self, path: &str) -> (u16, Value) {
        self.send(Method::DELETE, path, None).await
    }

    /// Polls `GET /v1/approvals` until one is pending; returns the pending list.
    async fn pending_approvals(&self) -> Vec<Value> {
        let waited = tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
            loop {
                let (status, body) = self.get("/v1/approvals").await;
                assert_eq!(status, 200, "{body}");
                let pending = body["approvals"].as_array().unwrap().clone();
                if !pending.is_empty() {
                    return pending;
                }
                tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
            }
        })
        .await;
        waited.unwrap_or_else(|_| panic!("no approval pending within {TEST_WAIT_MS_MAX} ms"))
    }

    /// `a` supervised: every contact it starts needs approval.
    async fn supervise_a(&self) {
        let (status, body) = self.put("/v1/agents/a/membership", json!({"mode": "supervised"})).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["membership"], json!({"manager": null, "mode": "supervised"}));
    }
}

/// The error code of an error body.
fn code(body: &Value) -> &str {
    body["error"]["code"]
        .as_str()
        .unwrap_or_else(|| panic!("not an error: {body}"))
}

/// Goal: links round trip over REST (create, list, update, delete) with the TOML
/// config's fields and defaults, and a link added over REST shows in
/// `GET /v1/topology` as configured, with its fields. Every error status: 409 for an
/// existing pair, 404 for an unknown agent or link, 422 for a self-link, a missing or
/// unknown field, a bad enum value or a body contradicting the path, 401 without the
/// token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_round_trip_over_rest_and_show_in_the_topology() {
    let harness = start().await;
    let (status, body) = harness.get("/v1/links").await;
    assert_eq!((status, body), (200, json!({"links": []})));

    let (status, body) = harness.post("/v1/links", json!({"from": "a", "to": "b"})).await;
    assert_eq!(status, 201, "{body}");
    let default_link = json!({"from": "a", "to": "b", "direction": "two_way", "relationship": "peer", "enabled": true});
    assert_eq!(body, default_link);
    let (status, body) = harness.get("/v1/links").await;
    assert_eq!((status, body), (200, json!({ "links": [default_link] })));

    let (status, body) = harness.post("/v1/links", json!({"from": "a", "to": "b"})).await;
    assert_eq!((status, code(&body)), (409, "link_exists"), "{body}");

    let update = json!({"direction": "one_way", "relationship": "superior", "enabled": false});
    let (status, body) = harness.put("/v1/links/a/b", update).await;
    assert_eq!(status, 200, "{body}");
    let updated = json!({"from": "a", "to": "b", "direction": "one_way", "relationship": "superior", "enabled": false});
    assert_eq!(body, updated);
    let (_, body) = harness.get("/v1/links").await;
    assert_eq!(body, json!({ "links": [updated] }));

    // The topology reads the organisation's links when asked.
    let (status, topology) = harness.get("/v1/topology").await;
    assert_eq!(status, 200, "{topology}");
    let links = topology["links"].as_array().unwrap();
    let link = links
        .iter()
        .find(|link| link["from"] == "a" && link["to"] == "b")
        .unwrap_or_else(|| panic!("no a→b link in {topology}"));
    assert_eq!(link["source"], "configured", "{link}");
    assert_eq!(
        link["configured"],
        json!({"direction": "one_way", "relationship": "superior", "enabled": false})
    );

    // Errors, each with the one JSON shape.
    let cases: Vec<(Method, &str, Option<Value>, u16, &str)> = vec![
        (
            Method::POST,
            "/v1/links",
            Some(json!({"from": "a", "to": "ghost"})),
            404,
            "agent_not_found",
        ),
        (
            Method::POST,
            "/v1/links",
            Some(json!({"from": "ghost", "to": "a"})),
            404,
            "agent_not_found",
        ),
        (
            Method::POST,
            "/v1/links",
            Some(json!({"from": "a", "to": "a"})),
            422,
            "invalid_link",
        ),
        (
            Method::POST,
            "/v1/links",
            Some(json!({"from": "a"})),
            422,
            "invalid_link",
        ),
        (
            Method::POST,
            "/v1/links",
            Some(json!({"from": "a", "to": "c", "colour": "red"})),
            422,
            "invalid_body",
        ),
        (
            Method::POST,
            "/v1/links",
            Some(json!({"from": "a", "to": "c", "direction": "sideways"})),
            422,
            "invalid_body",
        ),
        (Method::PUT, "/v1/links/a/c", Some(json!({})), 404, "link_not_found"),
        (
            Method::PUT,
            "/v1/links/a/b",
            Some(json!({"from": "c"})),
            422,
            "invalid_link",
        ),
        (Method::DELETE, "/v1/links/c/a", None, 404, "link_not_found"),
    ];
    for (method, path, body, expected, expected_code) in cases {
        let (status, answer) = harness.send(method.clone(), path, body.clone()).await;
        assert_eq!(
            (status, code(&answer)),
            (expected, expected_code),
            "{method} {path} {body:?}: {answer}"
        );
    }
    let (_, body) = harness.get("/v1/links").await;
    assert_eq!(
        body["links"].as_array().unwrap().len(),
        1,
        "no error changed anything: {body}"
    );

    let unauthenticated = harness.request(Method::GET, "/v1/links").send().await.unwrap();
    assert_eq!(unauthenticated.status().as_u16(), 401);
    let oversized = json!({"from": "a".repeat(SERVER_REQUEST_BODY_SIZE_MAX_BYTES), "to": "b"});
    let (status, body) = harness.post("/v1/links", oversized).await;
    assert_eq!((status, code(&body)), (413, "body_too_large"));

    let (status, body) = harness.delete("/v1/links/a/b").await;
    assert_eq!((status, body), (204, Value::Null));
    let (status, body) = harness.delete("/v1/links/a/b").await;
    assert_eq!((status, code(&body)), (404, "link_not_found"));
    let (_, body) = harness.get("/v1/links").await;
    assert_eq!(body, json!({"links": []}));
    harness.stop().await;
}

/// Goal: `PATCH /v1/links/{from}/{to}` changes only the fields it is given and returns
/// the link as changed; two patches of different fields sent at once both land (each
/// reads and writes the link in one change of the organisation), 20 rounds on 2 worker
/// threads; its refusals have their status and code and change nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_patch_changes_only_its_fields_and_concurrent_patches_both_land() {
    let harness = start().await;
    let (status, body) = harness.post("/v1/links", json!({"from": "a", "to": "b"})).await;
    assert_eq!(status, 201, "{body}");
    let (status, body) = harness
        .send(Method::PATCH, "/v1/links/a/b", Some(json!({"enabled": false})))
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body,
        json!({"from": "a", "to": "b", "direction": "two_way", "relationship": "peer", "enabled": false})
    );
    let (status, body) = harness
        .send(
            Method::PATCH,
            "/v1/links/a/b",
            Some(json!({"from": "a", "relationship": "subordinate"})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body,
        json!({"from": "a", "to": "b", "direction": "two_way", "relationship": "subordinate", "enabled": false})
    );
    let (status, body) = harness.send(Method::PATCH, "/v1/links/a/b", Some(json!({}))).await;
    assert_eq!((status, &body["relationship"]), (200, &json!("subordinate")), "{body}");

    for round in 0..20 {
        // Reset, then two patches of different fields at once.
        let reset = json!({"direction": "two_way", "relationship": "peer", "enabled": true});
        let (status, body) = harness.put("/v1/links/a/b", reset).await;
        assert_eq!(status, 200, "{body}");
        let (direction, enabled) = tokio::join!(
            harness.send(Method::PATCH, "/v1/links/a/b", Some(json!({"direction": "one_way"}))),
            harness.send(Method::PATCH, "/v1/links/a/b", Some(json!({"enabled": false}))),
        );
        assert_eq!(
            (direction.0, enabled.0),
            (200, 200),
            "round {round}: {direction:?} {enabled:?}"
        );
        let (_, body) = harness.get("/v1/links").await;
        assert_eq!(
            body["links"],
            json!([{"from": "a", "to": "b", "direction": "one_way", "relationship": "peer", "enabled": false}]),
            "round {round}: both patches landed"
        );
    }

    let cases: Vec<(&str, Value, u16, &str)> = vec![
        ("/v1/links/a/c", json!({"enabled": true}), 404, "link_not_found"),
        ("/v1/links/a/b", json!({"to": "c"}), 422, "invalid_link"),
        ("/v1/links/a/b", json!({"colour": "red"}), 422, "invalid_body"),
        ("/v1/links/a/b", json!({"direction": "sideways"}), 422, "invalid_body"),
        ("/v1/links/a/b", json!({"enabled": "yes"}), 422, "invalid_body"),
    ];
    for (path, body, expected, expected_code) in cases {
        let (status, answer) = harness.send(Method::PATCH, path, Some(body.clone())).await;
        assert_eq!(
            (status, code(&answer)),
            (expected, expected_code),
            "{path} {body}: {answer}"
        );
    }
    let (_, body) = harness.get("/v1/links").await;
    assert_eq!(
        body["links"],
        json!([{"from": "a", "to": "b", "direction": "one_way", "relationship": "peer", "enabled": false}]),
        "no refused patch changed anything"
    );
    harness.stop().await;
}

/// Goal: the policy, links and permission rules set over REST are what admission
/// decides on. Method: enforced policy, no link: `a`'s call to `b` is refused (its
/// model reads "no link"); a link added over REST lets it through; a deny rule added
/// over REST refuses it again; the rule removed, it passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policy_links_and_rules_set_over_rest_decide_admission() {
    let harness = start().await;
    let ask_a = || harness.post("/v1/agents/a/messages", json!({"text": "go"}));
    let (status, body) = harness.get("/v1/org/policy").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["policy"], "open");
    let (status, body) = harness.put("/v1/org/policy", json!({"policy": "enforced"})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["policy"], "enforced");
    let (status, body) = harness.put("/v1/org/policy", json!({"policy": "closed"})).await;
    assert_eq!((status, code(&body)), (422, "invalid_body"));

    let (status, reply) = ask_a().await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(
        reply["text"],
        "result: error: call_agent failed: call not permitted: a may not ask b: \
         no link joins them and the organisation requires one"
    );

    let (status, body) = harness.post("/v1/links", json!({"from": "a", "to": "b"})).await;
    assert_eq!(status, 201, "{body}");
    let (_, reply) = ask_a().await;
    assert_eq!(reply["text"], "result: 42");

    let (status, body) = harness
        .put("/v1/agents/a/permissions/b", json!({"effect": "deny"}))
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body,
        json!({"agent": "a", "rule": {"target": "b", "effect": "deny", "requires_approval": false}})
    );
    let (_, reply) = ask_a().await;
    assert_eq!(
        reply["text"],
        "result: error: call_agent failed: call not permitted: a may not ask b: \
         a permission rule denies it (explicit deny)"
    );

    let (status, body) = harness.delete("/v1/agents/a/permissions/b").await;
    assert_eq!((status, body), (204, Value::Null));
    let (_, reply) = ask_a().await;
    assert_eq!(reply["text"], "result: 42");
    harness.stop().await;
}

/// Goal: permission rules and memberships round trip over REST with the TOML fields,
/// and each error status: 404 for an unknown agent, target or rule, 422 for a deny
/// that requires approval or a body contradicting the path, 409 for a manager cycle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permissions_and_memberships_round_trip_over_rest() {
    let harness = start().await;
    let (status, body) = harness.get("/v1/agents/a/permissions").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body,
        json!({"agent": "a", "rules": [], "membership": {"manager": null, "mode": "autonomous"}})
    );

    let (status, body) = harness
        .put("/v1/agents/a/permissions/*", json!({"effect": "deny"}))
        .await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = harness
        .put(
            "/v1/agents/a/permissions/c",
            json!({"agent": "a", "target": "c", "effect": "allow", "requires_approval": true}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let (_, body) = harness.get("/v1/agents/a/permissions").await;
    assert_eq!(
        body["rules"],
        json!([
            {"target": "*", "effect": "deny", "requires_approval": false},
            {"target": "c", "effect": "allow", "requires_approval": true},
        ])
    );
    // Replacing the rule for the same target keeps one rule per target.
    let (status, _) = harness
        .put("/v1/agents/a/permissions/c", json!({"effect": "allow"}))
        .await;
    assert_eq!(status, 200);
    let (_, body) = harness.get("/v1/agents/a/permissions").await;
    assert_eq!(
        body["rules"][1],
        json!({"target": "c", "effect": "allow", "requires_approval": false})
    );

    let (status, body) = harness
        .put("/v1/agents/b/membership", json!({"manager": "a", "mode": "strict"}))
        .await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = harness.get("/v1/agents/b/membership").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body,
        json!({"agent": "b", "membership": {"manager": "a", "mode": "strict"}})
    );

    let cases: Vec<(Method, &str, Option<Value>, u16, &str)> = vec![
        (
            Method::GET,
            "/v1/agents/ghost/permissions",
            None,
            404,
            "agent_not_found",
        ),
        (
            Method::PUT,
            "/v1/agents/ghost/permissions/a",
            Some(json!({"effect": "allow"})),
            404,
            "agent_not_found",
        ),
        (
            Method::PUT,
            "/v1/agents/a/permissions/ghost",
            Some(json!({"effect": "allow"})),
            404,
            "agent_not_found",
        ),
        (
            Method::PUT,
            "/v1/agents/a/permissions/b",
            Some(json!({"effect": "deny", "requires_approval": true})),
            422,
            "invalid_permission",
        ),
        (
            Method::PUT,
            "/v1/agents/a/permissions/b",
            Some(json!({"target": "c", "effect": "deny"})),
            422,
            "invalid_permission",
        ),
        (
            Method::PUT,
            "/v1/agents/a/permissions/b",
            Some(json!({})),
            422,
            "invalid_body",
        ),
        (
            Method::DELETE,
            "/v1/agents/a/permissions/b",
            None,
            404,
            "permission_not_found",
        ),
        (Method::GET, "/v1/agents/ghost/membership", None, 404, "agent_not_found"),
        (
            Method::PUT,
            "/v1/agents/a/membership",
            Some(json!({"manager": "ghost"})),
            404,
            "agent_not_found",
        ),
        (
            Method::PUT,
            "/v1/agents/a/membership",
            Some(json!({"manager": "b"})),
            409,
            "manager_cycle",
        ),
        (
            Method::PUT,
            "/v1/agents/a/membership",
            Some(json!({"mode": "lazy"})),
            422,
            "invalid_body",
        ),
    ];
    for (method, path, body, expected, expected_code) in cases {
        let (status, answer) = harness.send(method.clone(), path, body.clone()).await;
        assert_eq!(
            (status, code(&answer)),
            (expected, expected_code),
            "{method} {path} {body:?}: {answer}"
        );
    }
    let (_, body) = harness.get("/v1/agents/a/permissions").await;
    assert_eq!(
        body["rules"].as_array().unwrap().len(),
        2,
        "no error changed a rule: {body}"
    );
    assert_eq!(body["membership"], json!({"manager": null, "mode": "autonomous"}));

    let (status, _) = harness.delete("/v1/agents/a/permissions/*").await;
    assert_eq!(status, 204);
    let (_, body) = harness.get("/v1/agents/a/permissions").await;
    assert_eq!(
        body["rules"],
        json!([{"target": "c", "effect": "allow", "requires_approval": false}])
    );
    harness.stop().await;
}

/// Goal: a call that needs approval waits for it, is listed by `GET /v1/approvals`,
/// proceeds once approved over HTTP; a second one is refused once denied over HTTP;
/// resolving either again is 409, an unknown id 404, a non-number 400. Method: `a`
/// supervised over REST; `POST /v1/agents/a/messages` runs while the test resolves the
/// approval over HTTP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_needing_approval_waits_until_approved_or_denied_over_http() {
    let harness = start().await;
    harness.supervise_a().await;

    let asked = harness.post("/v1/agents/a/messages", json!({"text": "go"}));
    let resolved = async {
        let pending = harness.pending_approvals().await;
        assert_eq!(pending.len(), 1, "{pending:?}");
        let approval = &pending[0];
        assert_eq!(
            (
                &approval["from"],
                &approval["to"],
                &approval["kind"],
                &approval["message"],
                &approval["state"]
            ),
            (
                &json!("a"),
                &json!("b"),
                &json!("ask"),
                &json!("what is 6 x 7?"),
                &json!("pending")
            )
        );
        let id = approval["id"].as_u64().unwrap();
        let (status, body) = harness.get(&format!("/v1/approvals/{id}")).await;
        assert_eq!((status, &body["state"]), (200, &json!("pending")), "{body}");
        let (status, body) = harness.post(&format!("/v1/approvals/{id}/approve"), json!({})).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["state"], "approved");
        id
    };
    let ((status, reply), approved) = tokio::join!(asked, resolved);
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["text"], "result: 42");
    let (status, body) = harness.post(&format!("/v1/approvals/{approved}/deny"), json!({})).await;
    assert_eq!((status, code(&body)), (409, "approval_not_pending"), "{body}");
    let (_, body) = harness.get("/v1/approvals").await;
    assert_eq!(body, json!({"approvals": []}));

    let asked = harness.post("/v1/agents/a/messages", json!({"text": "go"}));
    let resolved = async {
        let id = harness.pending_approvals().await[0]["id"].as_u64().unwrap();
        let (status, body) = harness.post(&format!("/v1/approvals/{id}/deny"), json!({})).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["state"], "denied");
        id
    };
    let ((status, reply), denied) = tokio::join!(asked, resolved);
    assert_eq!(status, 200, "{reply}");
    assert_eq!(
        reply["text"],
        format!("result: error: call_agent failed: call not permitted: a may not ask b: approval {denied} was denied")
    );
    let (status, body) = harness
        .post(&format!("/v1/approvals/{denied}/approve"), json!({}))
        .await;
    assert_eq!((status, code(&body)), (409, "approval_not_pending"), "{body}");
    let (status, body) = harness.get(&format!("/v1/approvals/{denied}")).await;
    assert_eq!((status, &body["state"]), (200, &json!("denied")), "{body}");

    let (status, body) = harness.post("/v1/approvals/999/approve", json!({})).await;
    assert_eq!((status, code(&body)), (404, "approval_not_found"), "{body}");
    let (status, body) = harness.get("/v1/approvals/999").await;
    assert_eq!((status, code(&body)), (404, "approval_not_found"), "{body}");
    let (status, body) = harness.post("/v1/approvals/first/deny", json!({})).await;
    assert_eq!((status, code(&body)), (400, "invalid_approval_id"), "{body}");
    harness.stop().await;
}

/// Goal: a call waiting for approval whose HTTP client leaves (it gives up on
/// `POST /v1/agents/a/messages` and closes the connection) takes its approval off the
/// list: the server drops the request, the call's turn is cancelled, and the approval
/// reads `expired`, is no longer listed, and approving it is 409 `approval_not_pending`
/// (nothing proceeds: `b`'s history stays empty). Before 2026-12-02 it stayed listed,
/// and approvable, until the call's 30 s deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_whose_http_client_left_takes_its_approval_off_the_list() {
    /// How long the leaving client waits for its answer, in milliseconds.
    const CLIENT_GIVES_UP_MS: u64 = 500;
    let harness = start().await;
    harness.supervise_a().await;
    let leaving = reqwest::Client::builder()
        .timeout(Duration::from_millis(CLIENT_GIVES_UP_MS))
        .build()
        .unwrap();
    let asked = leaving
        .post(format!("{}/v1/agents/a/messages", harness.base))
        .bearer_auth(TOKEN)
        .json(&json!({"text": "go"}))
        .send();
    let seen = async { harness.pending_approvals().await[0]["id"].as_u64().unwrap() };
    let (asked, id) = tokio::join!(asked, seen);
    assert!(asked.unwrap_err().is_timeout(), "the client gave up");

    let off_the_list = tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
        loop {
            let (_, body) = harness.get("/v1/approvals").await;
            if body == json!({"approvals": []}) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
    })
    .await;
    assert!(off_the_list.is_ok(), "the approval is still listed");
    let (status, body) = harness.get(&format!("/v1/approvals/{id}")).await;
    assert_eq!((status, &body["state"]), (200, &json!("expired")), "{body}");
    let (status, body) = harness.post(&format!("/v1/approvals/{id}/approve"), json!({})).await;
    assert_eq!((status, code(&body)), (409, "approval_not_pending"), "{body}");
    let (status, body) = harness.get("/v1/agents/b/history").await;
    assert_eq!((status, &body["total"]), (200, &json!(0)), "nothing reached b: {body}");
    harness.stop().await;
}

/// Goal: an approval whose call stopped waiting (the message's 400 ms timeout passed
/// before anyone approved) is expired: it reads `expired`, is no longer listed as
/// pending, approving it is 409 `approval_expired` (nothing proceeds: `b`'s history
/// stays empty), and resolving it again is 409 `approval_not_pending`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_that_outlives_its_call_expires_and_approving_it_is_refused() {
    let harness = start().await;
    harness.supervise_a().await;
    let asked = harness.post("/v1/agents/a/messages", json!({"text": "go", "timeout_ms": 400}));
    let seen = async {
        let pending = harness.pending_approvals().await;
        assert_eq!(pending.len(), 1, "{pending:?}");
        assert!(pending[0]["deadline"]["at_us"].is_u64(), "{pending:?}");
        pending[0]["id"].as_u64().unwrap()
    };
    let ((status, reply), id) = tokio::join!(asked, seen);
    assert_ne!(status, 200, "the message timed out waiting for the approval: {reply}");

    let (status, body) = harness.get(&format!("/v1/approvals/{id}")).await;
    assert_eq!((status, &body["state"]), (200, &json!("expired")), "{body}");
    let (_, body) = harness.get("/v1/approvals").await;
    assert_eq!(body, json!({"approvals": []}));
    let (status, body) = harness.post(&format!("/v1/approvals/{id}/approve"), json!({})).await;
    assert_eq!((status, code(&body)), (409, "approval_expired"), "{body}");
    assert!(
        body["error"]["message"].as_str().unwrap().contains("deadline"),
        "{body}"
    );
    let (status, body) = harness.post(&format!("/v1/approvals/{id}/deny"), json!({})).await;
    assert_eq!((status, code(&body)), (409, "approval_not_pending"), "{body}");
    let (status, body) = harness.get(&format!("/v1/approvals/{id}")).await;
    assert_eq!((status, &body["state"]), (200, &json!("expired")), "{body}");
    let (status, body) = harness.get("/v1/agents/b/history").await;
    assert_eq!((status, &body["total"]), (200, &json!(0)), "nothing reached b: {body}");
    harness.stop().await;
}

/// Polls `GET /v1/agents/{agent}/tasks/{task}` until its state is `state`.
async fn task_when(harness: &Harness, agent: &str, task: &str, state: &str) -> Value {
    let path = format!("/v1/agents/{agent}/tasks/{task}");
    let waited = tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
        loop {
            let (status, body) = harness.get(&path).await;
            assert_eq!(status, 200, "{body}");
            if body["state"] == state {
                return body;
            }
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
    })
    .await;
    match waited {
        Ok(body) => body,
        Err(_) => panic!(
            "task {task} not {state} within {TEST_WAIT_MS_MAX} ms: {:?}",
            harness.get(&path).await
        ),
    }
}

/// Goal: a delegation that needs approval waits in the sender's outbox (the request
/// returns 202 at once); approved over HTTP, the task is sent and completes with the
/// delegatee's answer; denied over HTTP, the task ends `rejected` with the denial.
/// Method: `c` supervised over REST delegates to `b` with `POST /v1/agents/c/tasks`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delegation_needing_approval_completes_once_approved_and_is_rejected_once_denied() {
    let harness = start().await;
    let (status, body) = harness
        .put("/v1/agents/c/membership", json!({"mode": "supervised"}))
        .await;
    assert_eq!(status, 200, "{body}");

    let (status, body) = harness
        .post("/v1/agents/c/tasks", json!({"to": "b", "text": "do it"}))
        .await;
    assert_eq!(status, 202, "{body}");
    let task = body["task_id"].as_str().unwrap().to_string();
    let pending = harness.pending_approvals().await;
    assert_eq!(
        (
            &pending[0]["from"],
            &pending[0]["to"],
            &pending[0]["kind"],
            &pending[0]["message"]
        ),
        (&json!("c"), &json!("b"), &json!("delegate"), &json!("do it"))
    );
    let id = pending[0]["id"].as_u64().unwrap();
    let (status, body) = harness.post(&format!("/v1/approvals/{id}/approve"), json!({})).await;
    assert_eq!(status, 200, "{body}");
    let done = task_when(&harness, "c", &task, "completed").await;
    assert_eq!(done["result"], "42", "{done}");

    let (status, body) = harness
        .post("/v1/agents/c/tasks", json!({"to": "b", "text": "do it"}))
        .await;
    assert_eq!(status, 202, "{body}");
    let task = body["task_id"].as_str().unwrap().to_string();
    let id = harness.pending_approvals().await[0]["id"].as_u64().unwrap();
    let (status, body) = harness.post(&format!("/v1/approvals/{id}/deny"), json!({})).await;
    assert_eq!(status, 200, "{body}");
    let rejected = task_when(&harness, "c", &task, "rejected").await;
    assert_eq!(
        rejected["result"],
        format!("not permitted: c may not delegate to b: approval {id} was denied")
    );
    harness.stop().await;
}

/// Goal: an approval resolved by two racing HTTP requests (approve and deny at once)
/// has exactly one winner, the other is 409 `approval_not_pending`, and the waiting
/// call follows the winner. Method: five rounds; each starts a call needing approval,
/// then sends approve and deny concurrently from two tasks on the multi-thread runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_approve_and_deny_over_http_have_exactly_one_winner() {
    const ROUNDS: usize = 5;
    let harness = start().await;
    harness.supervise_a().await;
    let mut winners = Vec::new();
    for round in 0..ROUNDS {
        let asked = harness.post("/v1/agents/a/messages", json!({"text": "go"}));
        let raced = async {
            let id = harness.pending_approvals().await[0]["id"].as_u64().unwrap();
            let post = |verb: &'static str| {
                let request = harness
                    .request(Method::POST, &format!("/v1/approvals/{id}/{verb}"))
                    .bearer_auth(TOKEN)
                    .send();
                tokio::spawn(async move {
                    let response = request.await.expect("the server answers");
                    let status = response.status().as_u16();
                    (status, response.json::<Value>().await.unwrap())
                })
            };
            let (approve, deny) = (post("approve"), post("deny"));
            let ((approve_status, approve_body), (deny_status, deny_body)) =
                (approve.await.unwrap(), deny.await.unwrap());
            (id, approve_status, approve_body, deny_status, deny_body)
        };
        let ((status, reply), (id, approve_status, approve_body, deny_status, deny_body)) = tokio::join!(asked, raced);
        assert_eq!(status, 200, "{reply}");
        let approved = match (approve_status, deny_status) {
            (200, 409) => {
                assert_eq!(approve_body["state"], "approved");
                assert_eq!(code(&deny_body), "approval_not_pending");
                true
            }
            (409, 200) => {
                assert_eq!(deny_body["state"], "denied");
                assert_eq!(code(&approve_body), "approval_not_pending");
                false
            }
            other => panic!("round {round}: expected one 200 and one 409, got {other:?}: {approve_body} {deny_body}"),
        };
        let expected = if approved {
            "result: 42".to_string()
        } else {
            format!("result: error: call_agent failed: call not permitted: a may not ask b: approval {id} was denied")
        };
        assert_eq!(reply["text"], expected, "round {round}");
        let (_, record) = harness.get(&format!("/v1/approvals/{id}")).await;
        assert_eq!(record["state"], if approved { "approved" } else { "denied" });
        winners.push(approved);
    }
    assert_eq!(winners.len(), ROUNDS);
    harness.stop().await;
}

/// Goal: organisation changes made over REST reach `GET /v1/events`: each change as
/// `org_changed` with the organisation's version after it, a contact needing approval
/// as `approval_requested`, its resolution as `approval_resolved` with the new state.
/// Method: the stream is opened first (its headers arrived: events from then on are in
/// it); a link is added, `a` supervised, a call approved over HTTP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn organisation_changes_and_approvals_reach_the_event_stream() {
    let harness = start().await;
    let mut stream = harness
        .request(Method::GET, "/v1/events")
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status().as_u16(), 200);
    let (status, _) = harness.post("/v1/links", json!({"from": "a", "to": "b"})).await;
    assert_eq!(status, 201);
    let (_, policy) = harness.get("/v1/org/policy").await;
    let link_version = policy["version"].as_u64().unwrap();
    harness.supervise_a().await;
    let asked = harness.post("/v1/agents/a/messages", json!({"text": "go"}));
    let approved = async {
        let id = harness.pending_approvals().await[0]["id"].as_u64().unwrap();
        let (status, body) = harness.post(&format!("/v1/approvals/{id}/approve"), json!({})).await;
        assert_eq!(status, 200, "{body}");
        id
    };
    let ((status, reply), id) = tokio::join!(asked, approved);
    assert_eq!((status, &reply["text"]), (200, &json!("result: 42")));

    let mut text = String::new();
    let events = tokio::time::timeout(Duration::from_millis(TEST_WAIT_MS_MAX), async {
        loop {
            let chunk = stream.chunk().await.unwrap().expect("the stream stays open");
            text.push_str(std::str::from_utf8(&chunk).unwrap());
            let events = support::parse_sse(&text);
            if events.iter().any(|(name, _)| name == "approval_resolved") {
                return events;
            }
        }
    })
    .await
    .expect("the approval's resolution arrives on the stream");
    let data = |wanted: &str| -> Vec<Value> {
        events
            .iter()
            .filter(|(name, _)| name == wanted)
            .map(|(_, data)| serde_json::from_str(data).unwrap())
            .collect()
    };
    let changes: Vec<u64> = data("org_changed")
        .iter()
        .map(|event| event["version"].as_u64().unwrap())
        .collect();
    // The link, the membership and the resolution, in order (the pending record is
    // written by admission, reported as approval_requested).
    assert_eq!(changes.len(), 3, "{changes:?}");
    assert_eq!(changes[0], link_version);
    assert!(changes.windows(2).all(|pair| pair[0] < pair[1]), "{changes:?}");
    let requested = data("approval_requested");
    assert_eq!(requested.len(), 1, "{requested:?}");
    assert_eq!(
        (&requested[0]["id"], &requested[0]["from"], &requested[0]["to"]),
        (&json!(id), &json!("agent/a"), &json!("agent/b"))
    );
    let resolved = data("approval_resolved");
    assert_eq!(
        (
            &resolved[0]["id"],
            &resolved[0]["from"],
            &resolved[0]["to"],
            &resolved[0]["kind"],
            &resolved[0]["state"]
        ),
        (
            &json!(id),
            &json!("agent/a"),
            &json!("agent/b"),
            &json!("ask"),
            &json!("approved")
        )
    );
    harness.stop().await;
}
