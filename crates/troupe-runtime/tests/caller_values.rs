//! `Caller::invoke_value` and `Caller::invoke_value_as_root`: a turn's calls that pass
//! their message and reply as values within the process (what an agent's `call_agent`
//! and its recorded exchange use), under the same admission, chain and deadline rules
//! as the calls that carry bytes; refused where calls are routed (a cluster node). And
//! `RuntimeHandle::invoke_value_in`, the same from outside any turn (what
//! `AgentClient::ask` uses).
//!
//! Runs in both builds.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use troupe_core::limits::AGENT_CALL_DEPTH_MAX;
use troupe_core::{ActorId, ActorKind, CallContext, CallRefused, Deadline, InvokeError};
use troupe_runtime::{
    Actor, ActorBox, ActorError, AnyValue, KindConfig, RootCallRouter, Runtime, RuntimeHandle, Turn, TurnCall,
    TurnCallRouter, WaitEdge,
};

const KIND: &str = "hop";
const BYTES_ONLY_KIND: &str = "bytes";
const CALL_TIMEOUT_MS: u64 = 5_000;

fn hop(key: &str) -> ActorId {
    ActorId::new(KIND, key).unwrap()
}

/// What a value call carries.
enum Message {
    /// Reply with the same `Arc`.
    Echo(Arc<String>),
    /// Call `0` back with a value (the caller is up the chain: refused).
    CallBack(ActorId),
}

/// (actor, depth, chain keys) of every value turn, in start order.
type Seen = Arc<Mutex<Vec<(String, u32, Vec<String>)>>>;

struct Hop {
    key: String,
    seen: Seen,
    /// The runtime's handle, captured (set once the runtime has started).
    outside: Arc<OnceLock<RuntimeHandle>>,
}

/// The outcome of a value call, as text.
fn outcome(reply: Result<AnyValue, InvokeError>, sent: &Arc<String>) -> String {
    match reply {
        Ok(value) => match value.downcast::<Arc<String>>() {
            Ok(back) if Arc::ptr_eq(&back, sent) => "same".to_string(),
            Ok(back) => format!("copied {back}"),
            Err(value) => match value.downcast::<String>() {
                Ok(text) => text,
                Err(_) => "another type".to_string(),
            },
        },
        Err(InvokeError::Refused(CallRefused::CycleDetected { chain })) => {
            let keys: Vec<&str> = chain.iter().map(ActorId::key).collect();
            format!("cycle {}", keys.join(">"))
        }
        Err(InvokeError::Refused(refused)) => format!("refused: {refused:?}"),
        Err(InvokeError::Rejected { reason, .. }) => format!("rejected: {reason}"),
        Err(other) => format!("other {other}"),
    }
}

impl Actor for Hop {
    /// From outside: `value:KEY` (or `root-value:KEY`) calls `KEY` with an echo value
    /// from this turn (or as a root request of it); `back:KEY` asks `KEY` to call this
    /// actor back. Replies with the outcome's text.
    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        let text = String::from_utf8(payload.to_vec()).unwrap();
        let (verb, target) = text.split_once(':').unwrap();
        let target = if verb == "bytes-only" {
            ActorId::new(BYTES_ONLY_KIND, target).unwrap()
        } else {
            hop(target)
        };
        let sent = Arc::new(format!("from {}", self.key));
        let caller = turn.caller().clone();
        let message = match verb {
            "back" => Message::CallBack(hop(&self.key)),
            _ => Message::Echo(Arc::clone(&sent)),
        };
        let reply = match verb {
            // A request from outside made from inside a turn (through a captured handle).
            "outside-value" => {
                let handle = self.outside.get().expect("set at start");
                let context = CallContext::root(turn.context().deadline());
                handle.invoke_value_in(&target, AnyValue::new(message), context).await
            }
            "root-value" => {
                caller
                    .invoke_value_as_root(&target, AnyValue::new(message), Duration::from_millis(CALL_TIMEOUT_MS))
                    .await
            }
            _ => match caller.admit(&target, true, Some(CALL_TIMEOUT_MS)) {
                Ok(admitted) => caller.invoke_value(admitted, AnyValue::new(message)).await,
                Err(refused) => Err(refused.into()),
            },
        };
        Ok(Bytes::from(outcome(reply, &sent)))
    }

    async fn handle_value(&mut self, turn: &mut Turn, message: AnyValue) -> Result<AnyValue, ActorError> {
        let chain = turn.context().chain().iter().map(|id| id.key().to_string()).collect();
        self.seen
            .lock()
            .unwrap()
            .push((self.key.clone(), turn.context().depth(), chain));
        match message.downcast::<Message>() {
            Ok(Message::Echo(value)) => Ok(AnyValue::new(value)),
            Ok(Message::CallBack(target)) => {
                let caller = turn.caller().clone();
                let sent = Arc::new("back".to_string());
                let reply = match caller.admit(&target, true, Some(CALL_TIMEOUT_MS)) {
                    Ok(admitted) => {
                        caller
                            .invoke_value(admitted, AnyValue::new(Message::Echo(Arc::clone(&sent))))
                            .await
                    }
                    Err(refused) => Err(refused.into()),
                };
                Ok(AnyValue::new(outcome(reply, &sent)))
            }
            Err(_) => Err(ActorError::rejected("not a Message")),
        }
    }
}

/// Takes bytes only (the default `handle_value`).
struct BytesOnly;

impl Actor for BytesOnly {
    async fn handle(&mut self, _turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        Ok(payload)
    }
}

fn start(seen: &Seen) -> Runtime {
    let seen = Arc::clone(seen);
    let outside = Arc::new(OnceLock::new());
    let handle = Arc::clone(&outside);
    let factory = move |id: &ActorId, _saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
        Ok(ActorBox::new(Hop {
            key: id.key().to_string(),
            seen: Arc::clone(&seen),
            outside: Arc::clone(&handle),
        }))
    };
    let bytes_only =
        |_id: &ActorId, _saved: Option<Bytes>| -> Result<ActorBox, ActorError> { Ok(ActorBox::new(BytesOnly)) };
    let runtime = Runtime::builder()
        .register(ActorKind::new(KIND).unwrap(), factory, KindConfig::default())
        .unwrap()
        .register(
            ActorKind::new(BYTES_ONLY_KIND).unwrap(),
            bytes_only,
            KindConfig::default(),
        )
        .unwrap()
        .start();
    assert!(outside.set(runtime.handle()).is_ok());
    runtime
}

async fn ask(runtime: &Runtime, key: &str, text: &str) -> String {
    let reply = runtime
        .invoke(
            &hop(key),
            Bytes::from(text.to_string()),
            runtime.deadline_in(Duration::from_secs(10)),
        )
        .await
        .unwrap();
    String::from_utf8(reply.to_vec()).unwrap()
}

/// Goal: a value passed by a turn's call reaches the callee as itself and its reply
/// comes back as itself (the same `Arc`, no copy), with the call's context (depth 1,
/// the caller in the chain); as a root request of the turn it runs at depth 0 with an
/// empty chain; a call back up the chain is refused as a cycle, with the chain, before
/// anything is sent; an actor that takes bytes only rejects a value.
#[tokio::test(start_paused = true)]
async fn values_cross_a_turns_calls_as_themselves_under_the_call_rules() {
    let seen = Seen::default();
    let runtime = start(&seen);

    assert_eq!(ask(&runtime, "a", "value:b").await, "same");
    assert_eq!(ask(&runtime, "a", "root-value:b").await, "same");
    assert_eq!(ask(&runtime, "a", "back:b").await, "cycle a>b>a");
    let bytes_only = ask(&runtime, "a", "bytes-only:x").await;
    assert!(bytes_only.starts_with("rejected: "), "{bytes_only}");
    assert!(bytes_only.contains("takes bytes only"), "{bytes_only}");

    // The call back was refused at admission: b ran, a did not run again.
    assert_eq!(
        *seen.lock().unwrap(),
        vec![
            ("b".to_string(), 1, vec!["a".to_string()]),
            ("b".to_string(), 0, vec![]),
            ("b".to_string(), 1, vec!["a".to_string()]),
        ]
    );
    runtime.shutdown().await;
}

/// A router that runs every call here, counting them.
struct CountingRouter {
    handle: troupe_runtime::RuntimeHandle,
    calls: Mutex<u32>,
}

#[async_trait]
impl TurnCallRouter for CountingRouter {
    async fn call(&self, call: TurnCall) -> Result<Bytes, InvokeError> {
        *self.calls.lock().unwrap() += 1;
        self.handle
            .invoke_for_turn(&call.caller, &call.target, call.payload, call.context)
            .await
    }

    fn path_leaves_node(&self, _remote_edges: Vec<WaitEdge>) {}
}

/// Goal: where a router takes a turn's calls (a cluster node, whose calls may cross
/// to another process), a value is refused `Rejected` with nothing sent: the router
/// sees no call and the target never runs.
#[tokio::test(start_paused = true)]
async fn a_runtime_that_routes_calls_refuses_values_with_nothing_sent() {
    let seen = Seen::default();
    let runtime = start(&seen);
    let router = Arc::new(CountingRouter {
        handle: runtime.handle(),
        calls: Mutex::new(0),
    });
    assert!(runtime.handle().set_turn_call_router(router.clone()).is_ok());

    for text in ["value:b", "root-value:b"] {
        let refused = ask(&runtime, "a", text).await;
        assert!(refused.starts_with("rejected: "), "{text}: {refused}");
        assert!(refused.contains("routes its turns' calls"), "{text}: {refused}");
    }
    assert_eq!(*router.calls.lock().unwrap(), 0);
    assert!(seen.lock().unwrap().is_empty());
    runtime.shutdown().await;
}

/// Tasks on worker threads in the multi-thread tests, and attempts per task.
#[cfg(not(madsim))]
const TASKS: usize = 8;
#[cfg(not(madsim))]
const ATTEMPTS_PER_TASK: usize = 50;

/// Runs `attempt(runtime, task, n)` [`ATTEMPTS_PER_TASK`] times in each of [`TASKS`]
/// spawned tasks and returns how many answered "same"; checks that every attempt ran
/// one value turn.
#[cfg(not(madsim))]
async fn same_answers_on_worker_threads<F, Fut>(attempt: F) -> usize
where
    F: Fn(Arc<Runtime>, usize, usize) -> Fut + Send + Sync + Copy + 'static,
    Fut: std::future::Future<Output = String> + Send,
{
    let seen = Seen::default();
    let runtime = Arc::new(start(&seen));
    let mut tasks = Vec::new();
    for task in 0..TASKS {
        let runtime = Arc::clone(&runtime);
        tasks.push(tokio::spawn(async move {
            let mut same = 0;
            for n in 0..ATTEMPTS_PER_TASK {
                if attempt(Arc::clone(&runtime), task, n).await == "same" {
                    same += 1;
                }
            }
            same
        }));
    }
    let mut same = 0;
    for task in tasks {
        same += task.await.unwrap();
    }
    assert_eq!(seen.lock().unwrap().len(), TASKS * ATTEMPTS_PER_TASK);
    same
}

/// Goal: on worker threads, concurrent turns' value calls each get their own value
/// back (8 tasks × 50 calls through 8 callers to 2 callees).
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_value_calls_each_get_their_own_value_on_the_multi_thread_runtime() {
    let same = same_answers_on_worker_threads(|runtime, task, call| async move {
        let callee = if call % 2 == 0 { "even" } else { "odd" };
        ask(&runtime, &format!("caller-{task}"), &format!("value:{callee}")).await
    })
    .await;
    assert_eq!(same, TASKS * ATTEMPTS_PER_TASK);
}

/// Sends `Echo(sent)` from outside with `RuntimeHandle::invoke_value_in` under `context`.
async fn value_from_outside(runtime: &Runtime, target: &ActorId, context: CallContext) -> String {
    let sent = Arc::new("from outside".to_string());
    let message = AnyValue::new(Message::Echo(Arc::clone(&sent)));
    outcome(runtime.handle().invoke_value_in(target, message, context).await, &sent)
}

/// Goal: from outside any turn, `invoke_value_in` passes the value to the target as
/// itself and brings its reply back as itself, under the context given: a root context
/// runs at depth 0 with an empty chain, a continued one at its depth with its chain
/// (as a request from another process's call tree); a deadline already passed is
/// refused `Timeout` before anything runs; an actor that takes bytes only rejects a
/// value; from inside a turn it is refused like every root request.
#[tokio::test(start_paused = true)]
async fn values_from_outside_cross_as_themselves_under_the_context_given() {
    let seen = Seen::default();
    let runtime = start(&seen);
    let in_ten_seconds = runtime.deadline_in(Duration::from_secs(10));

    let root = value_from_outside(&runtime, &hop("b"), CallContext::root(in_ten_seconds)).await;
    assert_eq!(root, "same");
    let continued = CallContext::continued(2, vec![hop("x"), hop("y")], in_ten_seconds);
    assert_eq!(value_from_outside(&runtime, &hop("c"), continued).await, "same");
    // A call made under the continued context sees its chain: back to x is a cycle.
    let back = CallContext::continued(1, vec![hop("b")], in_ten_seconds);
    let sent = Arc::new("unused".to_string());
    let reply = runtime
        .handle()
        .invoke_value_in(&hop("c"), AnyValue::new(Message::CallBack(hop("b"))), back)
        .await;
    assert_eq!(outcome(reply, &sent), "cycle b>c>b");

    let passed = Deadline::from_micros(0);
    let late = runtime
        .handle()
        .invoke_value_in(&hop("d"), AnyValue::new(Message::Echo(sent)), CallContext::root(passed))
        .await;
    assert!(matches!(late, Err(InvokeError::Timeout { .. })), "{late:?}");

    let bytes_only = ActorId::new(BYTES_ONLY_KIND, "x").unwrap();
    let rejected = value_from_outside(&runtime, &bytes_only, CallContext::root(in_ten_seconds)).await;
    assert!(rejected.contains("takes bytes only"), "{rejected}");

    assert_eq!(
        ask(&runtime, "a", "outside-value:b").await,
        "refused: RootInvokeInsideTurn"
    );

    assert_eq!(
        *seen.lock().unwrap(),
        vec![
            ("b".to_string(), 0, vec![]),
            ("c".to_string(), 2, vec!["x".to_string(), "y".to_string()]),
            ("c".to_string(), 1, vec!["b".to_string()]),
        ]
    );
    runtime.shutdown().await;
}

/// Goal: a request from outside under a context that no admission could have given is
/// refused before anything runs, as the transport refuses it on arrival: a chain that
/// already holds the target (it waits up the chain: the call would wait on itself) is
/// `CycleDetected` with the chain and the target, a depth past
/// [`AGENT_CALL_DEPTH_MAX`] is `DepthExceeded` (with the caller's depth, one less),
/// through `invoke_value_in` and `invoke_in` alike. Before, both ran (the cyclic one
/// as a turn of an actor its own chain says is waiting). The deepest admitted depth
/// still runs.
#[tokio::test(start_paused = true)]
async fn contexts_no_admission_gives_are_refused_from_outside() {
    let seen = Seen::default();
    let runtime = start(&seen);
    let handle = runtime.handle();
    let in_ten_seconds = runtime.deadline_in(Duration::from_secs(10));
    let sent = Arc::new("x".to_string());
    let echo = || AnyValue::new(Message::Echo(Arc::clone(&sent)));

    let cyclic = CallContext::continued(2, vec![hop("x"), hop("c")], in_ten_seconds);
    let cycle = InvokeError::Refused(CallRefused::CycleDetected {
        chain: vec![hop("x"), hop("c"), hop("c")],
    });
    let reply = handle.invoke_value_in(&hop("c"), echo(), cyclic).await;
    assert_eq!(reply.err(), Some(cycle));
    let bytes_only = ActorId::new(BYTES_ONLY_KIND, "x").unwrap();
    let cyclic = CallContext::continued(1, vec![bytes_only.clone()], in_ten_seconds);
    let reply = handle.invoke_in(&bytes_only, Bytes::from_static(b"hi"), cyclic).await;
    assert_eq!(
        reply,
        Err(InvokeError::Refused(CallRefused::CycleDetected {
            chain: vec![bytes_only.clone(), bytes_only.clone()],
        }))
    );

    let too_deep = CallContext::continued(AGENT_CALL_DEPTH_MAX + 1, vec![hop("x")], in_ten_seconds);
    let depth = InvokeError::Refused(CallRefused::DepthExceeded {
        depth: AGENT_CALL_DEPTH_MAX,
        max: AGENT_CALL_DEPTH_MAX,
    });
    let reply = handle.invoke_value_in(&hop("d"), echo(), too_deep.clone()).await;
    assert_eq!(reply.err(), Some(depth.clone()));
    let reply = handle.invoke_in(&bytes_only, Bytes::from_static(b"hi"), too_deep).await;
    assert_eq!(reply, Err(depth));

    let deepest = CallContext::continued(AGENT_CALL_DEPTH_MAX, vec![hop("x")], in_ten_seconds);
    assert_eq!(value_from_outside(&runtime, &hop("e"), deepest).await, "same");
    assert_eq!(
        *seen.lock().unwrap(),
        vec![("e".to_string(), AGENT_CALL_DEPTH_MAX, vec!["x".to_string()])],
        "only the admissible request ran"
    );
    runtime.shutdown().await;
}

/// A root router that runs every request here, counting them.
struct CountingRootRouter {
    handle: troupe_runtime::RuntimeHandle,
    calls: Mutex<u32>,
}

#[async_trait]
impl RootCallRouter for CountingRootRouter {
    async fn invoke_root(&self, target: &ActorId, payload: Bytes, deadline: Deadline) -> Result<Bytes, InvokeError> {
        *self.calls.lock().unwrap() += 1;
        self.handle.invoke_root_for_router(target, payload, deadline).await
    }
}

/// Goal: where root requests are routed (a cluster node, where the target's owner may
/// be another process), `invoke_value_in` is refused `Rejected` with nothing sent: the
/// router sees no request and the target never runs.
#[tokio::test(start_paused = true)]
async fn a_runtime_that_routes_root_requests_refuses_values_from_outside() {
    let seen = Seen::default();
    let runtime = start(&seen);
    let router = Arc::new(CountingRootRouter {
        handle: runtime.handle(),
        calls: Mutex::new(0),
    });
    assert!(runtime.handle().set_root_call_router(router.clone()).is_ok());

    let context = CallContext::root(runtime.deadline_in(Duration::from_secs(10)));
    let refused = value_from_outside(&runtime, &hop("b"), context).await;
    assert!(refused.starts_with("rejected: "), "{refused}");
    assert!(refused.contains("routes its root requests"), "{refused}");
    assert_eq!(*router.calls.lock().unwrap(), 0);
    assert!(seen.lock().unwrap().is_empty());
    runtime.shutdown().await;
}

/// Goal: on worker threads, concurrent values from outside each come back as
/// themselves (8 tasks × 50 requests to 4 actors).
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_values_from_outside_each_get_their_own_on_the_multi_thread_runtime() {
    let same = same_answers_on_worker_threads(|runtime, task, request| async move {
        let target = hop(&format!("t{}", (task + request) % 4));
        let context = CallContext::root(runtime.deadline_in(Duration::from_secs(10)));
        value_from_outside(&runtime, &target, context).await
    })
    .await;
    assert_eq!(same, TASKS * ATTEMPTS_PER_TASK);
}
