//! `Caller::invoke_as_root`, the one explicit root invocation a turn can make: outside
//! the turn's chain, but bounded by the turn's deadline and cancelled with the turn.
//! Both builds.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use troupe::core::{ActorId, ActorKind, Deadline, InvokeError};
use troupe::runtime::{Actor, ActorBox, ActorError, KindConfig, Runtime, RuntimeHandle, Turn};

const KIND: &str = "node";

fn node(key: &str) -> ActorId {
    ActorId::new(KIND, key).unwrap()
}

type Results = Arc<Mutex<Vec<(Result<Bytes, InvokeError>, Duration)>>>;
/// Each turn's actor key and deadline, in the order the turns started.
type Deadlines = Arc<Mutex<Vec<(String, Deadline)>>>;

/// `sleep:MS` sleeps; `root:TARGET:MS` invokes TARGET (`sleep:MS`) as root and waits;
/// `spawn:TARGET:MS` does that from a spawned task and returns at once.
struct Node {
    key: String,
    results: Results,
    deadlines: Deadlines,
    /// The runtime's own handle, captured as an actor or tool might.
    captured: Arc<OnceLock<RuntimeHandle>>,
}

impl Actor for Node {
    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        self.deadlines.lock().unwrap().push((self.key.clone(), turn.deadline()));
        let text = String::from_utf8(payload.to_vec()).map_err(|e| ActorError::failed(e.to_string()))?;
        let parts: Vec<&str> = text.split(':').collect();
        match parts.as_slice() {
            ["sleep", ms] => {
                tokio::time::sleep(Duration::from_millis(ms.parse().unwrap())).await;
            }
            ["captured", target] => {
                let handle = self.captured.get().expect("set when the runtime started");
                let started = tokio::time::Instant::now();
                let deadline = handle.deadline_in(Duration::from_secs(1));
                let result = handle.invoke(&node(target), Bytes::from("sleep:0"), deadline).await;
                self.results.lock().unwrap().push((result, started.elapsed()));
            }
            [mode @ ("root" | "spawn"), target, ms] => {
                let caller = turn.caller().clone();
                let results = Arc::clone(&self.results);
                let (target, payload) = (node(target), Bytes::from(format!("sleep:{ms}")));
                let call = async move {
                    let started = tokio::time::Instant::now();
                    let result = caller.invoke_as_root(&target, payload, Duration::from_secs(60)).await;
                    results.lock().unwrap().push((result, started.elapsed()));
                };
                if *mode == "root" {
                    call.await;
                } else {
                    tokio::spawn(call);
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            _ => return Err(ActorError::rejected(format!("unknown request {text:?}"))),
        }
        Ok(Bytes::new())
    }
}

fn start(results: &Results, deadlines: &Deadlines) -> Runtime {
    let (results, deadlines) = (Arc::clone(results), Arc::clone(deadlines));
    let captured = Arc::new(OnceLock::new());
    let handle_slot = Arc::clone(&captured);
    let factory = move |id: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> {
        Ok(ActorBox::new(Node {
            key: id.key().to_string(),
            results: Arc::clone(&results),
            deadlines: Arc::clone(&deadlines),
            captured: Arc::clone(&handle_slot),
        }))
    };
    let runtime = Runtime::builder()
        .register(ActorKind::new(KIND).unwrap(), factory, KindConfig::default())
        .unwrap()
        .start();
    captured.set(runtime.handle()).expect("set once");
    runtime
}

/// Goal: a root invocation from a turn never outlives the turn's deadline, whatever
/// timeout it asks for. Method: A's turn has 100 ms; it invokes B (1 s of work) as root
/// asking for 60 s. B's turn runs under A's deadline, not 60 s; the request ends with
/// `Timeout` at 100 ms and B's turn ends with it.
#[tokio::test(start_paused = true)]
async fn a_root_invoke_from_a_turn_is_bounded_by_the_turns_deadline() {
    let (results, deadlines) = (Results::default(), Deadlines::default());
    let rt = start(&results, &deadlines);
    let started = tokio::time::Instant::now();
    let outcome = rt
        .invoke(
            &node("a"),
            Bytes::from("root:b:1000"),
            rt.deadline_in(Duration::from_millis(100)),
        )
        .await;
    assert!(matches!(outcome, Err(InvokeError::Timeout { .. })), "{outcome:?}");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(100) && took < Duration::from_millis(101),
        "{took:?}"
    );
    let deadlines = deadlines.lock().unwrap().clone();
    let keys: Vec<&str> = deadlines.iter().map(|(key, _)| key.as_str()).collect();
    assert_eq!(keys, vec!["a", "b"]);
    assert_eq!(
        deadlines[1].1, deadlines[0].1,
        "B runs under A's deadline, not the 60 s asked for"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let counters = rt.counters();
    assert_eq!(
        counters.turns_failed + counters.turns_abandoned,
        2,
        "both turns ended unsuccessfully: {counters:?}"
    );
    rt.shutdown().await;
}

/// Goal: a root invocation made from a task the turn spawned is cancelled when the turn
/// ends, and its callee's turn with it. Method: A spawns a root invoke of B (2 s of
/// work) and returns after 10 ms.
#[tokio::test(start_paused = true)]
async fn a_root_invoke_from_a_spawned_task_is_cancelled_when_the_turn_ends() {
    let (results, deadlines) = (Results::default(), Deadlines::default());
    let rt = start(&results, &deadlines);
    rt.invoke(
        &node("a"),
        Bytes::from("spawn:b:2000"),
        rt.deadline_in(Duration::from_secs(10)),
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let results = results.lock().unwrap().clone();
    assert_eq!(results.len(), 1, "{results:?}");
    assert_eq!(results[0].0, Err(InvokeError::Cancelled { target: node("b") }));
    assert!(
        results[0].1 <= Duration::from_millis(11),
        "ended with the turn: {:?}",
        results[0].1
    );
    assert_eq!(rt.counters().turns_abandoned, 1, "B's turn was cancelled");
    rt.shutdown().await;
}

/// Goal: on the multi-thread runtime too, a root invocation through a handle captured
/// inside a turn is refused at once (the turn marker follows the task's polls across
/// worker threads), while the same handle works from outside any turn. Method: 200 turns
/// on 4 worker threads each invoke another actor through the captured handle.
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_root_invoke_through_a_captured_handle_is_refused_inside_turns_on_worker_threads() {
    let (results, deadlines) = (Results::default(), Deadlines::default());
    let rt = start(&results, &deadlines);
    let mut requests = Vec::new();
    for index in 0..200 {
        let handle = rt.handle();
        requests.push(tokio::spawn(async move {
            let deadline = handle.deadline_in(Duration::from_secs(5));
            handle
                .invoke(&node(&format!("a{index}")), Bytes::from("captured:b"), deadline)
                .await
        }));
    }
    for request in requests {
        request.await.unwrap().unwrap();
    }
    let results = results.lock().unwrap().clone();
    assert_eq!(results.len(), 200);
    for (result, took) in &results {
        assert_eq!(
            result,
            &Err(InvokeError::Refused(troupe::core::CallRefused::RootInvokeInsideTurn))
        );
        assert!(*took < Duration::from_millis(100), "refused at once: {took:?}");
    }
    let outside = rt
        .invoke(
            &node("b"),
            Bytes::from("sleep:0"),
            rt.deadline_in(Duration::from_secs(1)),
        )
        .await;
    assert_eq!(outside, Ok(Bytes::new()), "outside a turn the handle works");
    rt.shutdown().await;
}
