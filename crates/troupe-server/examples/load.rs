//! A bounded load measurement of `POST /v1/agents/{id}/messages` on loopback: a real
//! server and agent system on the scripted model (no latency), `LOAD_CLIENTS`
//! concurrent clients (default 32) sending `LOAD_REQUESTS` messages in all (default
//! 20,000) spread over `LOAD_AGENTS` agents (default 64). Prints throughput, p50, p99
//! and max latency, and every status that was not 200. Not run in CI.
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
    // reqwest is built with rustls and no provider of its own (as in troupe-agent).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::new();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = tokio::time::Instant::now();
    let mut workers = Vec::new();
    for _ in 0..clients {
        let http = http.clone();
        let base = base.clone();
        let next = Arc::clone(&next);
        workers.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut statuses: BTreeMap<u16, usize> = BTreeMap::new();
            loop {
                let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if n >= requests {
                    return (latencies, statuses);
                }
                let sent = tokio::time::Instant::now();
                let response = http
                    .post(format!("{base}/v1/agents/a{}/messages", n % agents))
                    .header("content-type", "application/json")
                    .body(format!("{{\"text\": \"message {n}\"}}"))
                    .send()
                    .await
                    .expect("the server answers");
                let status = response.status().as_u16();
                let _ = response.bytes().await;
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
    let at = |q: f64| latencies[((latencies.len() as f64 - 1.0) * q).round() as usize];
    println!(
        "{requests} messages, {clients} clients, {agents} agents: {:.0} requests/s, p50 {:?}, p99 {:?}, max {:?}; statuses {statuses:?}",
        requests as f64 / elapsed.as_secs_f64(),
        at(0.50),
        at(0.99),
        at(1.0),
    );
    let _ = stop.send(());
    server.await.unwrap().unwrap();
    system.shutdown().await;
}
