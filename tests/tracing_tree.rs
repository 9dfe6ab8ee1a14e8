//! `tracing` spans: one request is one tree, across agents and tasks. An outside ask
//! opens an `invoke` span; the callee's `turn` is its child; the turn's `model_call` and
//! `tool_call` spans are the turn's children; a `call_agent` tool call opens the next
//! `invoke`, whose `turn` runs in the callee's task. Normal build (a thread-local
//! subscriber on a current-thread runtime).
#![cfg(not(madsim))]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use serde_json::json;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id};
use tracing::Subscriber;
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use troupe::agent::{AgentSpec, AgentSystem, ScriptRule, ScriptedLlm};

/// One span as it was opened: name, fields, parent.
#[derive(Debug, Clone)]
struct Opened {
    name: String,
    fields: String,
    parent: Option<u64>,
}

#[derive(Clone, Default)]
struct Spans(Arc<Mutex<BTreeMap<u64, Opened>>>);

struct Fields<'a>(&'a mut String);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, "{}={:?} ", field.name(), value);
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Spans {
    fn on_new_span(&self, attributes: &Attributes<'_>, id: &Id, context: Context<'_, S>) {
        let span = context.span(id).expect("a new span is registered");
        let mut fields = String::new();
        attributes.record(&mut Fields(&mut fields));
        let opened = Opened {
            name: span.name().to_string(),
            fields,
            parent: span.parent().map(|parent| parent.id().into_u64()),
        };
        self.0.lock().unwrap().insert(id.into_u64(), opened);
    }
}

/// Goal: the worker's model call, three agents' hops down, walks up to the outside ask
/// through exactly the spans of the request, in order.
#[test]
fn one_request_is_one_tree_of_spans_across_agents() {
    let spans = Spans::default();
    let subscriber = tracing_subscriber::registry().with(spans.clone());
    tracing::subscriber::with_default(subscriber, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let llm = ScriptedLlm::new()
                .rule(ScriptRule::agent("boss").on_user_containing("").call(
                    "call_agent",
                    json!({"agent_id": "worker", "message": "count the stars"}),
                ))
                .rule(
                    ScriptRule::agent("boss")
                        .on_tool_result()
                        .reply("the worker says {tool_result}"),
                )
                .rule(ScriptRule::agent("worker").reply("many"));
            let system = AgentSystem::builder()
                .llm(Arc::new(llm))
                .agent(AgentSpec::new("boss"))
                .agent(AgentSpec::new("worker"))
                .start()
                .unwrap();
            system.ask("boss", "how many stars").await.unwrap();
            system.shutdown().await;
        });
    });
    let spans = spans.0.lock().unwrap().clone();
    let worker_model_call = spans
        .iter()
        .find(|(_, span)| span.name == "model_call" && span.fields.contains("agent=agent/worker"))
        .map(|(id, _)| *id)
        .expect("the worker's model call has a span");
    let mut path = Vec::new();
    let mut at = Some(worker_model_call);
    while let Some(id) = at {
        let span = &spans[&id];
        let who = ["agent=", "actor=", "target=", "tool="]
            .iter()
            .find_map(|key| {
                span.fields
                    .split(' ')
                    .find(|field| field.starts_with(key))
                    .map(str::to_string)
            })
            .unwrap_or_default();
        path.push(format!("{} {who}", span.name));
        at = span.parent;
    }
    assert_eq!(
        path,
        vec![
            "model_call agent=agent/worker",
            "turn actor=agent/worker",
            "invoke target=agent/worker",
            "tool_call agent=agent/boss",
            "turn actor=agent/boss",
            "invoke target=agent/boss",
        ]
    );
    // The boss's two model calls are children of its one turn.
    let boss_turn = spans
        .iter()
        .find(|(_, span)| span.name == "turn" && span.fields.contains("actor=agent/boss"))
        .map(|(id, _)| *id)
        .unwrap();
    let boss_model_calls = spans
        .values()
        .filter(|span| span.name == "model_call" && span.parent == Some(boss_turn))
        .count();
    assert_eq!(boss_model_calls, 2);
}
