//! `GET /metrics`: the server's request counts and the runtime's counters, in the
//! Prometheus text format (version 0.0.4).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;

use troupe_agent::AgentClient;

/// Requests answered, by (method, route template, status). Routes are the matched
/// templates (`/v1/agents/{id}`), so the number of series is bounded by the routes;
/// an unmatched path counts as `unmatched`.
#[derive(Debug, Default)]
pub(crate) struct Metrics {
    requests: Mutex<BTreeMap<(String, String, u16), u64>>,
}

impl Metrics {
    pub(crate) fn record(&self, method: &str, route: &str, status: u16) {
        let mut requests = self.requests.lock().expect("the metrics lock is never poisoned");
        *requests
            .entry((method.to_string(), route.to_string(), status))
            .or_insert(0) += 1;
    }

    /// The text of `/metrics`; `agents` the agents in the directory; `streams_open` the
    /// open `/v1/events` streams and the open streamed answers; `a2a` the A2A tasks held
    /// and the agents the A2A layer keeps anything of; `process[0]` the log lines the
    /// process dropped so far, if it has a log queue that drops them; `process[1]` the
    /// connections open, if `serve` counts them.
    pub(crate) fn render(
        &self,
        client: &AgentClient,
        agents: usize,
        streams_open: [usize; 2],
        a2a: (usize, usize),
        process: [Option<u64>; 2],
    ) -> String {
        let mut out = String::new();
        out.push_str("# HELP troupe_http_requests_total HTTP requests answered, by method, route and status.\n");
        out.push_str("# TYPE troupe_http_requests_total counter\n");
        for ((method, route, status), count) in self.requests.lock().expect("the metrics lock is never poisoned").iter()
        {
            let _ = writeln!(
                out,
                "troupe_http_requests_total{{method=\"{method}\",route=\"{route}\",status=\"{status}\"}} {count}"
            );
        }
        // Taken apart field by field, with no `..`: a counter added to the runtime
        // fails this build until it is shown here (`store_retries` was missing from
        // /metrics until 2026-12-07).
        let troupe_runtime::RuntimeCounters {
            activations_started,
            deactivations_finished,
            turns_run,
            turns_failed,
            expired_dropped,
            busy_refused,
            deadlocks_refused,
            deactivation_saves_failed,
            turns_abandoned,
            activations_aborted,
            dispatcher_busy_refused,
            store_retries,
            told_lost,
        } = client.runtime().counters();
        let runtime = [
            ("activations_started", "Activations spawned.", activations_started),
            (
                "deactivations_finished",
                "Activations that finished deactivating.",
                deactivations_finished,
            ),
            (
                "turns_run",
                "Turns that ran to completion, successfully or not.",
                turns_run,
            ),
            (
                "turns_failed",
                "Turns that failed, timed out or whose commit failed.",
                turns_failed,
            ),
            (
                "expired_dropped",
                "Requests dropped unrun: deadline passed, or caller gone, before they started.",
                expired_dropped,
            ),
            (
                "busy_refused",
                "Requests refused because a mailbox was full.",
                busy_refused,
            ),
            (
                "deadlocks_refused",
                "Calls refused with DeadlockDetected.",
                deadlocks_refused,
            ),
            (
                "deactivation_saves_failed",
                "Deactivation saves that failed.",
                deactivation_saves_failed,
            ),
            (
                "turns_abandoned",
                "Turns cancelled because their caller stopped waiting.",
                turns_abandoned,
            ),
            (
                "activations_aborted",
                "Activations stopped at the end of the shutdown grace.",
                activations_aborted,
            ),
            (
                "dispatcher_busy_refused",
                "Requests refused because the dispatcher queue was full.",
                dispatcher_busy_refused,
            ),
            (
                "store_retries",
                "Claims and commits tried again after the store failed for a moment (connection refused or closed, \
                 server restarting, file locked), one per try after the first.",
                store_retries,
            ),
            (
                "told_lost",
                "Fire-and-forget messages accepted and then not run for a reason other than their deadline \
                 (queued behind a commit another runtime on the same store fenced off, or left when the shutdown \
                 grace ended).",
                told_lost,
            ),
        ];
        for (name, help, value) in runtime {
            let _ = writeln!(out, "# HELP troupe_runtime_{name}_total {help}");
            let _ = writeln!(out, "# TYPE troupe_runtime_{name}_total counter");
            let _ = writeln!(out, "troupe_runtime_{name}_total {value}");
        }
        let [log_lines_dropped, connections_open] = process;
        if let Some(dropped) = log_lines_dropped {
            out.push_str(
                "# HELP troupe_log_lines_dropped_total Log lines dropped because the log queue was full (stderr not \
                 read as fast as they came).\n",
            );
            out.push_str("# TYPE troupe_log_lines_dropped_total counter\n");
            let _ = writeln!(out, "troupe_log_lines_dropped_total {dropped}");
        }
        let gauges = [
            (
                "troupe_agents",
                "Agents in the directory.",
                agents,
            ),
            (
                "troupe_event_streams_open",
                "Open SSE streams of /v1/events.",
                streams_open[0],
            ),
            (
                "troupe_streams_open",
                "Open streamed answers (streamed messages, streamed chat completions, A2A streams), at most streams_open_max.",
                streams_open[1],
            ),
            ("troupe_a2a_tasks_kept", "A2A tasks the server holds in memory.", a2a.0),
            (
                "troupe_a2a_agents_tracked",
                "Agents the A2A layer keeps anything of in memory (tasks, a lane, a hold, a store fence).",
                a2a.1,
            ),
        ];
        for (name, help, value) in gauges {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} gauge");
            let _ = writeln!(out, "{name} {value}");
        }
        if let Some(open) = connections_open {
            out.push_str(
                "# HELP troupe_http_connections_open HTTP connections open, at most connections_max (past it new \
                 ones wait).\n",
            );
            out.push_str("# TYPE troupe_http_connections_open gauge\n");
            let _ = writeln!(out, "troupe_http_connections_open {open}");
        }
        out
    }
}
