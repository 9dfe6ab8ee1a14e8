//! A bounded load measurement of `POST /v1/agents/{id}/messages` on loopback.
//!
//! Two modes:
//! - in process (default): a real server and agent system on the scripted model (no
//!   latency), `LOAD_AGENTS` agents `a0..` (default 64);
//! - against a running server, `LOAD_URL=http://127.0.0.1:PORT` (used by
//!   `scripts/load-serve` against `troupe serve --config`): the agents `load-0..` of
//!   that server (`LOAD_AGENTS` of them), sent `[message from load] N`, which the
//!   organisation script answers at once without a model delay.
//!
//! `LOAD_CLIENTS` concurrent clients (default 32) send `LOAD_REQUESTS` messages in all
//! (default 20,000), stopping early after `LOAD_SECONDS` (default: no time bound) and at
//! most `LOAD_RATE` requests per second in all (default: no cap). Prints throughput,
//! p50, p99 and max latency, and the status histogram; a request that got no HTTP answer
//! (connection refused or reset, or a body cut off) counts as status `0`. Not run in CI.
//!
//! `LOAD_ROUTE` picks what a request is:
//! - `messages` (default): `POST /v1/agents/{id}/messages` with `{"text": ...}`;
//! - `chat-stream`: a streamed OpenAI chat completion, `POST /v1/chat/completions` with
//!   `{"model": id, "stream": true, "messages": [{"role": "user", "content": ...}]}`,
//!   its SSE body read to its end. A stream is complete only if it is a 200 whose body
//!   holds a content chunk (a non-empty `delta.content`) and ends with `data: [DONE]`;
//!   a 200 that is not complete is counted apart (`incomplete`). Of the complete streams
//!   the latency to the first `data:` line is measured apart from the latency to the
//!   body's end (the overall figures are of every answer, to its end). A 503 or 429 is
//!   answered before any body, as JSON: the refusals are also counted by error code, a
//!   503 for want of a stream slot (`streams_open_max`) apart from the concurrency
//!   limit's.
//!
//! `cargo run --release -p troupe-server --example load`

#[cfg(madsim)]
fn main() {
    eprintln!("the load example needs the normal build (HTTP is not simulated)");
}

#[cfg(not(madsim))]
#[tokio::main]
async fn main() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use troupe_agent::{AgentSpec, AgentSystem, ScriptRule, ScriptedLlm};
    use troupe_server::ServerConfig;

    fn setting(name: &str, default: usize) -> usize {
        std::env::var(name)
            .ok()
            .and_then(|value| value.parse().ok())
            .unwrap_or(default)
    }
    let clients = setting("LOAD_CLIENTS", 32).max(1);
    let requests = setting("LOAD_REQUESTS", 20_000).max(1);
    let agents = setting("LOAD_AGENTS", 64).max(1);
    let seconds = setting("LOAD_SECONDS", 0);
    let rate = setting("LOAD_RATE", 0);
    let external = std::env::var("LOAD_URL").ok().filter(|url| !url.is_empty());
    let route = std::env::var("LOAD_ROUTE").unwrap_or_default();
    let streamed = match route.as_str() {
        "" | "messages" => false,
        "chat-stream" => true,
        other => {
            eprintln!("LOAD_ROUTE is {other:?}: give messages (the default) or chat-stream");
            std::process::exit(2);
        }
    };

    // In process: our own server; against LOAD_URL: nothing to start.
    let mut own = None;
    let (base, agent_prefix, text_prefix) = match &external {
        Some(url) => (url.trim_end_matches('/').to_string(), "load-", "[message from load] "),
        None => {
            let llm = ScriptedLlm::new()
                .rule(ScriptRule::any_agent().reply("ok: {input}"))
                .without_recording();
            let mut builder = AgentSystem::builder().llm(Arc::new(llm));
            for n in 0..agents {
                builder = builder.agent(AgentSpec::new(format!("a{n}")));
            }
            let system = builder.start().expect("the agent system starts");
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let base = format!("http://{}", listener.local_addr().unwrap());
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let server = tokio::spawn(troupe_server::serve(
                listener,
                system.client(),
                ServerConfig::default(),
                async move {
                    let _ = stopped.await;
                },
            ));
            own = Some((system, stop, server));
            (base, "a", "message ")
        }
    };
    // reqwest is built with rustls and no provider of its own (as in troupe-agent).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::new();
    let next = Arc::new(AtomicUsize::new(0));
    let started = tokio::time::Instant::now();
    let end = (seconds > 0).then(|| started + Duration::from_secs(seconds as u64));
    let mut workers = Vec::new();
    for _ in 0..clients {
        let http = http.clone();
        let base = base.clone();
        let next = Arc::clone(&next);
        workers.push(tokio::spawn(async move {
            let mut tally = Tally::default();
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= requests || end.is_some_and(|end| tokio::time::Instant::now() >= end) {
                    return tally;
                }
                if rate > 0 {
                    // Request n is due n/rate seconds after the start.
                    let due = started + Duration::from_secs_f64(n as f64 / rate as f64);
                    tokio::time::sleep_until(due).await;
                }
                let agent = format!("{agent_prefix}{}", n % agents);
                let text = format!("{text_prefix}{n}");
                let sent = tokio::time::Instant::now();
                let request = if streamed {
                    let body = serde_json::json!({
                        "model": agent,
                        "stream": true,
                        "messages": [{"role": "user", "content": text}],
                    });
                    http.post(format!("{base}/v1/chat/completions")).body(body.to_string())
                } else {
                    http.post(format!("{base}/v1/agents/{agent}/messages"))
                        .body(serde_json::json!({ "text": text }).to_string())
                };
                let answer = request.header("content-type", "application/json").send().await;
                let status = match answer {
                    Ok(response) if streamed && response.status().as_u16() == 200 => {
                        match read_stream(response, sent).await {
                            Ok(Some(first)) => {
                                tally.first_chunk.push(first);
                                tally.stream_end.push(sent.elapsed());
                                200
                            }
                            Ok(None) => {
                                tally.incomplete += 1;
                                200
                            }
                            Err(()) => 0,
                        }
                    }
                    Ok(response) => {
                        let status = response.status().as_u16();
                        match response.bytes().await {
                            Ok(body) => {
                                if streamed && status != 200 {
                                    *tally.refusals.entry(refusal(status, &body)).or_insert(0) += 1;
                                }
                                status
                            }
                            Err(_) => 0,
                        }
                    }
                    Err(_) => 0,
                };
                tally.latencies.push(sent.elapsed());
                *tally.statuses.entry(status).or_insert(0) += 1;
            }
        }));
    }
    let mut all = Tally::default();
    for worker in workers {
        let mine = worker.await.unwrap();
        all.latencies.extend(mine.latencies);
        all.first_chunk.extend(mine.first_chunk);
        all.stream_end.extend(mine.stream_end);
        for (refusal, count) in mine.refusals {
            *all.refusals.entry(refusal).or_insert(0) += count;
        }
        all.incomplete += mine.incomplete;
        for (status, count) in mine.statuses {
            *all.statuses.entry(status).or_insert(0) += count;
        }
    }
    let elapsed = started.elapsed();
    let Tally {
        mut latencies,
        mut first_chunk,
        mut stream_end,
        incomplete,
        refusals,
        statuses,
    } = all;
    println!(
        "{} {} in {:.1} s, {clients} clients, {agents} agents: {:.0} requests/s, {}; statuses {statuses:?}",
        latencies.len(),
        if streamed {
            "streamed chat completions"
        } else {
            "messages"
        },
        elapsed.as_secs_f64(),
        latencies.len() as f64 / elapsed.as_secs_f64(),
        quantiles(&mut latencies),
    );
    if streamed {
        println!(
            "complete streams (200, content, [DONE]): {}; 200 but incomplete: {incomplete}; to the first chunk: {}; to the end: {}; refusals {refusals:?}",
            first_chunk.len(),
            quantiles(&mut first_chunk),
            quantiles(&mut stream_end),
        );
    }
    if let Some((system, stop, server)) = own {
        let _ = stop.send(());
        server.await.unwrap().unwrap();
        system.shutdown().await;
    }
}

/// One client's (then all clients') counts.
#[cfg(not(madsim))]
#[derive(Default)]
struct Tally {
    /// Of every request, to the end of its answer's body.
    latencies: Vec<std::time::Duration>,
    /// Of every complete stream, to its first `data:` line.
    first_chunk: Vec<std::time::Duration>,
    /// Of every complete stream, to its body's end.
    stream_end: Vec<std::time::Duration>,
    /// Streams answered 200 but without a content chunk or `data: [DONE]` at the end.
    incomplete: usize,
    statuses: std::collections::BTreeMap<u16, usize>,
    /// Answers other than 200 by status and error code (streamed completions only); a 503
    /// for want of a stream slot is told from the concurrency limit's by its message.
    refusals: std::collections::BTreeMap<String, usize>,
}

/// `503 overloaded`, `429 busy`, ...: an error answer's status and `error.code`, marked
/// `(streams_open_max)` when its message names the stream slots' limit.
#[cfg(not(madsim))]
fn refusal(status: u16, body: &[u8]) -> String {
    let error = serde_json::from_slice::<serde_json::Value>(body).unwrap_or_default();
    let code = error["error"]["code"].as_str().unwrap_or("?");
    let slots = error["error"]["message"]
        .as_str()
        .is_some_and(|message| message.contains("streams_open_max"));
    format!("{status} {code}{}", if slots { " (streams_open_max)" } else { "" })
}

/// p50, p99 and max of `latencies` (sorted here), as printed.
#[cfg(not(madsim))]
fn quantiles(latencies: &mut [std::time::Duration]) -> String {
    latencies.sort_unstable();
    let count = latencies.len();
    let at = |q: f64| {
        latencies
            .get(((count.max(1) as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or_default()
    };
    format!("p50 {:?}, p99 {:?}, max {:?}", at(0.50), at(0.99), at(1.0))
}

/// Reads a streamed chat completion's SSE body (a 200) to its end: `Ok(Some(latency to
/// the first data: line, from sent))` if the stream is complete (a non-empty
/// `delta.content` and `data: [DONE]` last), `Ok(None)` if it is not, `Err` if the body
/// could not be read to its end.
#[cfg(not(madsim))]
async fn read_stream(
    mut response: reqwest::Response,
    sent: tokio::time::Instant,
) -> Result<Option<std::time::Duration>, ()> {
    let mut body = Vec::new();
    let mut first = None;
    while let Some(chunk) = response.chunk().await.map_err(|_| ())? {
        // Only what this chunk can complete is searched: from 5 bytes before it.
        let from = body.len().saturating_sub(5);
        body.extend_from_slice(&chunk);
        if first.is_none() && (body.starts_with(b"data:") || body[from..].windows(6).any(|line| line == b"\ndata:")) {
            first = Some(sent.elapsed());
        }
    }
    let body = String::from_utf8_lossy(&body);
    let data: Vec<&str> = body
        .lines()
        .filter_map(|line| line.strip_prefix("data:"))
        .map(str::trim)
        .collect();
    let content = data.iter().any(|data| {
        serde_json::from_str::<serde_json::Value>(data).is_ok_and(|chunk| {
            chunk["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|content| !content.is_empty())
        })
    });
    let done = data.last() == Some(&"[DONE]");
    Ok((content && done).then_some(first).flatten())
}
