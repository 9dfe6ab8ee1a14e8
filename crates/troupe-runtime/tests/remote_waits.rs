//! The hooks a cluster layer uses: remote wait-for edges (`begin_remote_wait`), the
//! edges' query (`waits_of`), the router for calls made by turns (`TurnCallRouter`) and
//! its notice when a local edge's path reaches a remote edge, and the router for root
//! requests (`RootCallRouter`).
//!
//! Runs in both builds; the edge-leak test also on tokio's multi-thread runtime.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use troupe_core::{ActorId, ActorKind, InvokeError};
use troupe_runtime::{
    Actor, ActorBox, ActorError, KindConfig, Runtime, TellRoute, Turn, TurnCall, TurnCallRouter, WaitEdge,
};

fn actor(key: &str) -> ActorId {
    ActorId::new("relay", key).expect("an actor id")
}

/// Calls the actor named by its payload's first key with the rest; a leaf answers "leaf".
/// `tell:<key>:<rest>` tells `<key>` the payload `<rest>` instead and answers "told".
struct Relay;

impl Actor for Relay {
    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        let text = String::from_utf8(payload.to_vec()).expect("text");
        if let Some((key, rest)) = text.strip_prefix("tell:").and_then(|told| told.split_once(':')) {
            turn.caller()
                .tell(&actor(key), Bytes::from(rest.to_string()), Duration::from_secs(5))
                .await
                .map_err(ActorError::Invoke)?;
            return Ok(Bytes::from_static(b"told"));
        }
        match text.split_once(',') {
            None if text.is_empty() => Ok(Bytes::from_static(b"leaf")),
            split => {
                let (first, rest) = split.unwrap_or((text.as_str(), ""));
                turn.invoke(&actor(first), Bytes::from(rest.to_string()), Duration::from_secs(5))
                    .await
                    .map_err(ActorError::Invoke)
            }
        }
    }
}

fn runtime() -> Runtime {
    Runtime::builder()
        .register(
            ActorKind::new("relay").expect("a kind"),
            |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> { Ok(ActorBox::new(Relay)) },
            KindConfig::default(),
        )
        .expect("register")
        .start()
}

/// A remote edge is in the graph while its guard lives; an edge closing a cycle with
/// remote edges is refused with `DeadlockDetected` naming it; dropping the guard
/// releases the edge.
#[tokio::test]
async fn remote_edges_join_the_graph_and_close_cycles() {
    let runtime = runtime();
    let handle = runtime.handle();
    let (a, b) = (actor("a"), actor("b"));
    let wait = handle.begin_remote_wait(&a, &b).await.expect("a → b");
    let edges = handle.waits_of(&a).await.expect("edges");
    assert_eq!(
        edges,
        vec![WaitEdge {
            waiter: a.clone(),
            call: wait.call_id(),
            target: b.clone(),
            remote: true
        }]
    );
    match handle.begin_remote_wait(&b, &a).await {
        Err(InvokeError::DeadlockDetected { cycle }) => assert_eq!(cycle, vec![b.clone(), a.clone(), b.clone()]),
        other => panic!("expected DeadlockDetected, got {other:?}"),
    }
    drop(wait);
    assert!(handle.waits_of(&a).await.expect("edges").is_empty(), "released on drop");
    let again = handle.begin_remote_wait(&b, &a).await.expect("no cycle any more");
    drop(again);
    assert_eq!(handle.stats().await.expect("stats").wait_for_edges, 0);
    runtime.shutdown().await;
}

/// Guards dropped at every point of `begin_remote_wait` (before the dispatcher recorded
/// the edge, while, after) never leave an edge behind.
async fn no_edge_leaks_when_waits_are_abandoned() {
    let runtime = runtime();
    let handle = runtime.handle();
    let mut tasks = Vec::new();
    for index in 0..200_u32 {
        let handle = handle.clone();
        tasks.push(tokio::spawn(async move {
            let waiter = actor(&format!("w{index}"));
            let target = actor(&format!("t{index}"));
            let begin = handle.begin_remote_wait(&waiter, &target);
            tokio::pin!(begin);
            // Abandon after 0, 1, 2 or 3 polls; the rest complete and are dropped.
            for _ in 0..index % 4 {
                if futures_poll_once(begin.as_mut()).await.is_some() {
                    return;
                }
            }
        }));
    }
    for task in tasks {
        task.await.expect("a task");
    }
    // Releases are notices the dispatcher applies before its next command.
    assert_eq!(handle.stats().await.expect("stats").wait_for_edges, 0, "an edge leaked");
    runtime.shutdown().await;
}

/// Polls `future` once: its output if it was ready.
async fn futures_poll_once<F: std::future::Future + Unpin>(mut future: F) -> Option<F::Output> {
    std::future::poll_fn(|cx| match std::pin::Pin::new(&mut future).poll(cx) {
        std::task::Poll::Ready(output) => std::task::Poll::Ready(Some(output)),
        std::task::Poll::Pending => std::task::Poll::Ready(None),
    })
    .await
}

#[tokio::test]
async fn abandoned_remote_waits_leave_no_edge() {
    no_edge_leaks_when_waits_are_abandoned().await;
}

#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_remote_waits_leave_no_edge_on_the_multi_thread_runtime() {
    no_edge_leaks_when_waits_are_abandoned().await;
}

/// A router that runs every call locally and records what it saw.
struct LocalRouter {
    handle: troupe_runtime::RuntimeHandle,
    calls: Mutex<Vec<(String, String, u32)>>,
    leaving: Mutex<Vec<Vec<WaitEdge>>>,
}

#[async_trait]
impl TurnCallRouter for LocalRouter {
    async fn call(&self, call: TurnCall) -> Result<Bytes, InvokeError> {
        self.calls.lock().expect("calls").push((
            call.caller.key().to_string(),
            call.target.key().to_string(),
            call.context.depth(),
        ));
        self.handle
            .invoke_for_turn(&call.caller, &call.target, call.payload, call.context)
            .await
    }

    fn path_leaves_node(&self, remote_edges: Vec<WaitEdge>) {
        self.leaving.lock().expect("leaving").push(remote_edges);
    }
}

/// With a router installed, a turn's calls go through it with the callee's context;
/// a local call whose target waits on a remote edge is reported as leaving the node.
#[tokio::test]
async fn a_router_receives_turn_calls_and_hears_of_paths_that_leave_the_node() {
    let runtime = runtime();
    let handle = runtime.handle();
    let router = Arc::new(LocalRouter {
        handle: handle.clone(),
        calls: Mutex::default(),
        leaving: Mutex::default(),
    });
    assert!(handle.set_turn_call_router(router.clone()).is_ok());
    assert!(handle.set_turn_call_router(router.clone()).is_err(), "one router only");
    let deadline = handle.deadline_in(Duration::from_secs(5));
    let reply = handle
        .invoke(&actor("a"), Bytes::from_static(b"b,c"), deadline)
        .await
        .expect("a → b → c");
    assert_eq!(reply.as_ref(), b"leaf");
    assert_eq!(
        *router.calls.lock().expect("calls"),
        vec![
            ("a".to_string(), "b".to_string(), 1),
            ("b".to_string(), "c".to_string(), 2)
        ]
    );
    assert!(router.leaving.lock().expect("leaving").is_empty(), "no remote edge yet");
    // c waits on a remote actor; a call from x to c now leads off the node.
    let remote = handle
        .begin_remote_wait(&actor("c"), &actor("far"))
        .await
        .expect("c → far");
    let deadline = handle.deadline_in(Duration::from_millis(300));
    let _ = handle.invoke(&actor("x"), Bytes::from_static(b"c"), deadline).await;
    let leaving = router.leaving.lock().expect("leaving").clone();
    assert!(
        leaving
            .iter()
            .any(|edges| edges.iter().any(|edge| edge.call == remote.call_id()
                && edge.waiter == actor("c")
                && edge.target == actor("far")
                && edge.remote)),
        "the path x → c → far was reported: {leaving:?}"
    );
    drop(remote);
    runtime.shutdown().await;
}

/// A root router that runs every request locally and records the targets it saw.
struct LocalRootRouter {
    handle: troupe_runtime::RuntimeHandle,
    targets: Mutex<Vec<String>>,
}

#[async_trait]
impl troupe_runtime::RootCallRouter for LocalRootRouter {
    async fn invoke_root(
        &self,
        target: &ActorId,
        payload: Bytes,
        deadline: troupe_core::Deadline,
    ) -> Result<Bytes, InvokeError> {
        self.targets.lock().expect("targets").push(target.key().to_string());
        self.handle.invoke_root_for_router(target, payload, deadline).await
    }
}

/// Sends its payload to `relay:<payload>` as an independent root request from its turn.
struct Detacher;

impl Actor for Detacher {
    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        let key = String::from_utf8(payload.to_vec()).expect("text");
        turn.caller()
            .invoke_as_root(&actor(&key), Bytes::new(), Duration::from_secs(5))
            .await
            .map_err(ActorError::Invoke)
    }
}

/// With a root router installed, `invoke_routed` (and `invoke_routed_within`) and a
/// turn's `invoke_as_root` go through it, and its local path answers even from inside a
/// turn; `invoke` stays local; without a router, `invoke_routed` is `invoke`.
#[tokio::test]
async fn a_root_router_receives_routed_root_requests_and_invoke_as_root() {
    let runtime = Runtime::builder()
        .register(
            ActorKind::new("relay").expect("a kind"),
            |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> { Ok(ActorBox::new(Relay)) },
            KindConfig::default(),
        )
        .expect("register")
        .register(
            ActorKind::new("detacher").expect("a kind"),
            |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> { Ok(ActorBox::new(Detacher)) },
            KindConfig::default(),
        )
        .expect("register")
        .start();
    let handle = runtime.handle();
    let deadline = || handle.deadline_in(Duration::from_secs(5));
    assert!(!handle.has_root_call_router());
    let unrouted = handle.invoke_routed(&actor("u"), Bytes::new(), deadline()).await;
    assert_eq!(unrouted.expect("local without a router").as_ref(), b"leaf");
    let router = Arc::new(LocalRootRouter {
        handle: handle.clone(),
        targets: Mutex::default(),
    });
    assert!(handle.set_root_call_router(router.clone()).is_ok());
    assert!(
        handle.set_root_call_router(router.clone()).is_err(),
        "one root router only"
    );
    assert!(handle.has_root_call_router());
    let routed = handle.invoke_routed(&actor("r1"), Bytes::new(), deadline()).await;
    assert_eq!(routed.expect("routed").as_ref(), b"leaf");
    let routed = handle
        .invoke_routed_within(&actor("r2"), Bytes::new(), Duration::from_secs(5))
        .await;
    assert_eq!(routed.expect("routed within").as_ref(), b"leaf");
    let local = handle.invoke(&actor("l"), Bytes::new(), deadline()).await;
    assert_eq!(local.expect("local").as_ref(), b"leaf");
    let detacher = ActorId::new("detacher", "d").expect("an actor id");
    let detached = handle.invoke(&detacher, Bytes::from_static(b"r3"), deadline()).await;
    assert_eq!(detached.expect("invoke_as_root through the router").as_ref(), b"leaf");
    assert_eq!(*router.targets.lock().expect("targets"), vec!["r1", "r2", "r3"]);
    runtime.shutdown().await;
}

/// A router that records the tells and calls of turns and delivers them locally; it
/// routes tells itself, or hands them back to the runtime (the trait's default).
struct TellRouter {
    handle: troupe_runtime::RuntimeHandle,
    routes_tells: bool,
    tells: Mutex<Vec<(String, String, u32)>>,
    calls: Mutex<Vec<(String, String, u32)>>,
}

#[async_trait]
impl TurnCallRouter for TellRouter {
    async fn call(&self, call: TurnCall) -> Result<Bytes, InvokeError> {
        self.calls.lock().expect("calls").push((
            call.caller.key().to_string(),
            call.target.key().to_string(),
            call.context.depth(),
        ));
        self.handle
            .invoke_for_turn(&call.caller, &call.target, call.payload, call.context)
            .await
    }

    async fn tell(&self, call: TurnCall) -> TellRoute {
        if !self.routes_tells {
            return TellRoute::Local(call);
        }
        self.tells.lock().expect("tells").push((
            call.caller.key().to_string(),
            call.target.key().to_string(),
            call.context.depth(),
        ));
        TellRoute::Sent(
            self.handle
                .tell_for_turn(&call.target, call.payload, call.context)
                .await,
        )
    }

    fn path_leaves_node(&self, _remote_edges: Vec<WaitEdge>) {}
}

/// With a router installed, a turn's tell to another actor goes through the router
/// with the target's context (depth + 1), and the told turn runs (its own call shows
/// at depth 2); a router that hands tells back has them delivered locally all the same.
#[tokio::test]
async fn a_router_receives_turn_tells_or_hands_them_back_for_local_delivery() {
    for routes_tells in [true, false] {
        let runtime = runtime();
        let handle = runtime.handle();
        let router = Arc::new(TellRouter {
            handle: handle.clone(),
            routes_tells,
            tells: Mutex::default(),
            calls: Mutex::default(),
        });
        assert!(handle.set_turn_call_router(router.clone()).is_ok());
        let deadline = handle.deadline_in(Duration::from_secs(5));
        let reply = handle
            .invoke(&actor("a"), Bytes::from_static(b"tell:b:c"), deadline)
            .await
            .expect("a tells b");
        assert_eq!(reply.as_ref(), b"told");
        let expected_tells = if routes_tells {
            vec![("a".to_string(), "b".to_string(), 1)]
        } else {
            Vec::new()
        };
        assert_eq!(*router.tells.lock().expect("tells"), expected_tells);
        // The told turn of b runs and calls c, through the router, at depth 2.
        for _ in 0..500 {
            if !router.calls.lock().expect("calls").is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(
            *router.calls.lock().expect("calls"),
            vec![("b".to_string(), "c".to_string(), 2)],
            "routes tells: {routes_tells}"
        );
        runtime.shutdown().await;
    }
}
