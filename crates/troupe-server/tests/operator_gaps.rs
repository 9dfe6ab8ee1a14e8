//! Gaps an operator of `troupe serve` met next, closed on 2026-12-07, each probed as a
//! client sees it: the log lines dropped by the process's log queue in `/metrics`.
//!
//! Normal build only: HTTP is not simulated (the crate is empty under madsim).
#![cfg(not(madsim))]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use troupe_agent::{ScriptRule, ScriptedLlm};
use troupe_runtime::KindConfig;
use troupe_server::ServerConfig;

mod support;
use support::{agents, gauge, Harness};

async fn serve_echo(config: ServerConfig) -> Harness {
    let llm = ScriptedLlm::new().rule(ScriptRule::any_agent().reply("heard: {input}"));
    Harness::start(agents(llm, &["echo"], KindConfig::default()), config).await
}

/// Goal: a server given a count of dropped log lines (`troupe serve`'s log queue) shows
/// it in `/metrics` as the counter `troupe_log_lines_dropped_total`, read at every
/// scrape; a server given none leaves it out. Before: no such counter (the count was
/// only written to stderr, which is what nobody reads when lines are dropped).
#[tokio::test]
async fn metrics_show_the_log_lines_dropped_read_at_every_scrape() {
    let dropped = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&dropped);
    let server =
        serve_echo(ServerConfig::default().log_lines_dropped(Arc::new(move || counted.load(Ordering::Relaxed)))).await;
    let metrics = server.metrics().await;
    assert_eq!(gauge(&metrics, "troupe_log_lines_dropped_total"), 0, "{metrics}");
    assert!(
        metrics.contains("# TYPE troupe_log_lines_dropped_total counter\n"),
        "{metrics}"
    );
    dropped.store(1_234, Ordering::Relaxed);
    let metrics = server.metrics().await;
    assert_eq!(gauge(&metrics, "troupe_log_lines_dropped_total"), 1_234, "{metrics}");
    server.stop().await;

    let server = serve_echo(ServerConfig::default()).await;
    let metrics = server.metrics().await;
    assert!(!metrics.contains("troupe_log_lines_dropped_total"), "{metrics}");
    server.stop().await;
}
