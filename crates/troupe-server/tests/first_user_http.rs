//! Two refusals a first user of `troupe serve` meets, each answered as the route's typed
//! JSON error: a body sent without `Content-Type: application/json` (415
//! `unsupported_media_type`, as axum's own refusal of it, but naming what to send and
//! what was sent), and a method a route does not serve (405 `method_not_allowed` with
//! the `Allow` header RFC 9110 15.5.6 requires). Method: a real server (tests/support)
//! on the scripted model, driven with reqwest on a multi-thread runtime.
//!
//! Before 2026-12-07 the 415's message was axum's text "Expected request with
//! `Content-Type: application/json`", naming neither the content type sent nor where
//! to set it. The 405's message names no allowed method (only `Allow` does): axum adds
//! `Allow` after the server's middleware has shaped the body, so the body cannot read it.
//!
//! Normal build only: HTTP is not simulated (the crate is empty under madsim).
#![cfg(not(madsim))]

mod support;

use reqwest::header::{ALLOW, CONTENT_TYPE};
use reqwest::Method;
use serde_json::{json, Value};
use support::{agents, Harness};
use troupe_agent::{ScriptRule, ScriptedLlm};
use troupe_runtime::KindConfig;
use troupe_server::ServerConfig;

async fn serve() -> Harness {
    Harness::start(
        agents(
            ScriptedLlm::new().rule(ScriptRule::agent("echo").reply("echo: {input}")),
            &["echo"],
            KindConfig::default(),
        ),
        ServerConfig::default(),
    )
    .await
}

/// The status, `Allow` header and JSON body of `response`.
async fn answer(response: reqwest::Response) -> (u16, Option<String>, Value) {
    let status = response.status().as_u16();
    let allow = response
        .headers()
        .get(ALLOW)
        .map(|value| value.to_str().unwrap().to_string());
    let text = response.text().await.unwrap();
    let body = serde_json::from_str(&text).unwrap_or_else(|error| panic!("not JSON ({error}): {text}"));
    (status, allow, body)
}

/// Goal: a POST whose body is JSON but whose `Content-Type` is missing or not JSON is
/// 415 `unsupported_media_type` in the route's shape (REST: `{"error": {code,
/// message}}`; OpenAI-compatible: with `type` and `param`), its message naming
/// `Content-Type: application/json` and the content type sent.
#[tokio::test(flavor = "multi_thread")]
async fn a_body_sent_without_json_content_type_is_415_saying_to_send_application_json() {
    let server = serve().await;
    let body = json!({"text": "hi"}).to_string();
    let chat = json!({"model": "echo", "messages": [{"role": "user", "content": "hi"}]}).to_string();
    for (path, body, openai) in [
        ("/v1/agents/echo/messages", &body, false),
        ("/v1/conversations", &body, false),
        ("/v1/chat/completions", &chat, true),
    ] {
        for sent in [Some("text/plain"), None] {
            let mut request = server.request(Method::POST, path).body(body.clone());
            if let Some(sent) = sent {
                request = request.header(CONTENT_TYPE, sent);
            }
            let (status, _, answered) = answer(request.send().await.unwrap()).await;
            assert_eq!(status, 415, "{path} {sent:?}: {answered}");
            let error = &answered["error"];
            assert_eq!(error["code"], "unsupported_media_type", "{path}: {answered}");
            let message = error["message"].as_str().unwrap();
            assert!(
                message.contains("`Content-Type: application/json`"),
                "{path}: {message}"
            );
            match sent {
                Some(sent) => assert!(
                    message.contains(&format!("`Content-Type: {sent}`")),
                    "{path}: {message}"
                ),
                None => assert!(message.contains("no Content-Type was sent"), "{path}: {message}"),
            }
            if openai {
                assert_eq!(error["type"], "invalid_request_error", "{path}: {answered}");
                assert_eq!(error["param"], Value::Null, "{path}: {answered}");
            } else {
                assert!(error.get("type").is_none(), "{path}: {answered}");
            }
        }
    }
    // The same body with the content type is served: the refusal was about it alone.
    let (status, body) = server.post("/v1/agents/echo/messages", json!({"text": "hi"})).await;
    assert_eq!(status, 200, "{body}");
    server.stop().await;
}

/// Goal: a method a route does not serve is 405 `method_not_allowed` in the route's
/// shape with `Allow` naming the methods it serves.
#[tokio::test(flavor = "multi_thread")]
async fn a_method_a_route_does_not_serve_is_405_typed_with_allow_naming_the_allowed_methods() {
    let server = serve().await;
    for (method, path, route, allowed, openai) in [
        (
            Method::GET,
            "/v1/agents/echo/messages",
            "/v1/agents/{id}/messages",
            "POST",
            false,
        ),
        (
            Method::DELETE,
            "/v1/agents/echo/messages",
            "/v1/agents/{id}/messages",
            "POST",
            false,
        ),
        (
            Method::GET,
            "/v1/chat/completions",
            "/v1/chat/completions",
            "POST",
            true,
        ),
        (
            Method::DELETE,
            "/v1/org/policy",
            "/v1/org/policy",
            "GET,HEAD,PUT",
            false,
        ),
    ] {
        let (status, allow, answered) = answer(server.request(method.clone(), path).send().await.unwrap()).await;
        assert_eq!(status, 405, "{method} {path}: {answered}");
        let allow = allow.unwrap_or_else(|| panic!("{method} {path}: no Allow header"));
        assert_eq!(allow, allowed, "{method} {path}");
        let error = &answered["error"];
        assert_eq!(error["code"], "method_not_allowed", "{method} {path}: {answered}");
        assert_eq!(
            error["message"],
            format!("{method} is not allowed on {route}"),
            "{method} {path}"
        );
        assert_eq!(error.get("type").is_some(), openai, "{method} {path}: {answered}");
    }
    server.stop().await;
}
