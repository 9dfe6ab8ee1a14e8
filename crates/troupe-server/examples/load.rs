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
//! (connection refused or reset) counts as status `0`. Not run in CI.
//!
//! `cargo run --release -p troupe-server --example load`

#[cfg(madsim)]
fn main() {
    eprintln!("the load example needs the normal build (HTTP is not simulated)");
}

#[cfg(not(madsim))]
#[tokio::main]
async fn main() {
    use std::collections::BTreeMap;
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
            let mut latencies = Vec::new();
            let mut statuses: BTreeMap<u16, usize> = BTreeMap::new();
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= requests || end.is_some_and(|end| tokio::time::Instant::now() >= end) {
                    return (latencies, statuses);
                }
                if rate > 0 {
                    // Request n is due n/rate seconds after the start.
                    let due = started + Duration::from_secs_f64(n as f64 / rate as f64);
                    tokio::time::sleep_until(due).await;
                }
                let sent = tokio::time::Instant::now();
                let answer = http
                    .post(format!("{base}/v1/agents/{agent_prefix}{}/messages", n % agents))
                    .header("content-type", "application/json")
                    .body(format!("{{\"text\": \"{text_prefix}{n}\"}}"))
                    .send()
                    .await;
                let status = match answer {
                    Ok(response) => {
                        let status = response.status().as_u16();
                        match response.bytes().await {
                            Ok(_) => status,
                            Err(_) => 0,
                        }
                    }
                    Err(_) => 0,
                };
                latencies.push(sent.elapsed());
                *statuses.entry(status).or_insert(0) += 1;
            }
        }));
    }
    let mut latencies: Vec<Duration> = Vec::new();
    let mut statuses: BTreeMap<u16, usize> = BTreeMap::new();
    for worker in workers {
        let (mine, counts) = worker.await.unwrap();
        latencies.extend(mine);
        for (status, count) in counts {
            *statuses.entry(status).or_insert(0) += count;
        }
    }
    let elapsed = started.elapsed();
    latencies.sort_unstable();
    let sent = latencies.len().max(1);
    let at = |q: f64| {
        latencies
            .get(((sent as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or_default()
    };
    println!(
        "{} messages in {:.1} s, {clients} clients, {agents} agents: {:.0} requests/s, p50 {:?}, p99 {:?}, max {:?}; statuses {statuses:?}",
        latencies.len(),
        elapsed.as_secs_f64(),
        latencies.len() as f64 / elapsed.as_secs_f64(),
        at(0.50),
        at(0.99),
        at(1.0),
    );
    if let Some((system, stop, server)) = own {
        let _ = stop.send(());
        server.await.unwrap().unwrap();
        system.shutdown().await;
    }
}
