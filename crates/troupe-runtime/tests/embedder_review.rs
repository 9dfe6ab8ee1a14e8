//! A demanding embedder's review of the runtime, from outside (helper-80, 2026-12-07):
//! only the public API, on tokio's worker threads, every wait bounded. Each probe is a
//! property that fails if its guarantee breaks; what `embedder_probes.rs` already covers
//! (shutdown storms, abandoned asks, two runtimes on one SQLite file, deadlines at their
//! edges) is not repeated here.

#![cfg(not(madsim))]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use troupe_core::{ActorId, ActorKind, InvokeError};
use troupe_runtime::{Actor, ActorBox, ActorError, KindConfig, MemoryStore, Runtime, Turn};

/// How long any single await may take before the probe calls it a hang.
const HANG: Duration = Duration::from_secs(5);

/// How often a probe looks again at the dispatcher's tables while it waits for a state.
const POLL_PAUSE_MS: u64 = 1;

async fn within<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(HANG, future)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within {HANG:?}"))
}

/// What the recorder's instances share with the test: the told records in the order
/// they ran, and the gate a `gate` turn waits at.
#[derive(Default)]
struct Shared {
    records: Mutex<Vec<String>>,
    gate: tokio::sync::Notify,
}

/// An actor that runs told commands (ASCII): `gate` (waits until the test opens the
/// gate), `panic` (its task ends: a crash), `rec:<x>` (appends `x` to the records).
struct Recorder {
    shared: Arc<Shared>,
}

impl Actor for Recorder {
    async fn handle(&mut self, _turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        let text = std::str::from_utf8(&payload).map_err(|e| ActorError::failed(e.to_string()))?;
        match text.split_once(':') {
            None if text == "gate" => self.shared.gate.notified().await,
            None if text == "panic" => panic!("the recorder was told to panic"),
            Some(("rec", record)) => self.shared.records.lock().unwrap().push(record.to_string()),
            _ => return Err(ActorError::rejected(format!("unknown command {text}"))),
        }
        Ok(Bytes::new())
    }
}

fn start_recorder(shared: &Arc<Shared>, config: KindConfig) -> Runtime {
    let shared = Arc::clone(shared);
    Runtime::builder()
        .store(Arc::new(MemoryStore::new()))
        .register(
            ActorKind::new("recorder").unwrap(),
            move |_id: &ActorId, _saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
                Ok(ActorBox::new(Recorder {
                    shared: Arc::clone(&shared),
                }))
            },
            config,
        )
        .unwrap()
        .start()
}

/// Goal: a told message, once accepted (`tell` answered `Ok`), runs: here, when the
/// activation crashes while it deactivates, with a full mailbox behind the crash and
/// more messages held for the next activation. The crashed mailbox's unrun messages and
/// the held ones together are up to twice the mailbox's capacity; every one of them was
/// accepted, so the next activation must run them all, in the order they were accepted.
/// Method: capacity 4; a `gate` turn holds the actor while `panic` and three records
/// fill the mailbox; `deactivate` closes it; four more records are held (each tell `Ok`);
/// the gate opens, the `panic` turn crashes the activation, and the next activation
/// must record all seven.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn told_messages_accepted_behind_a_crash_while_deactivating_all_run() {
    const CAPACITY: usize = 4;
    let shared = Arc::new(Shared::default());
    let runtime = start_recorder(&shared, KindConfig::default().with_mailbox_capacity(CAPACITY));
    let id = ActorId::new("recorder", "r").unwrap();
    let tell = |text: String| {
        let handle = runtime.handle();
        let id = id.clone();
        async move { handle.tell(&id, Bytes::from(text), handle.deadline_in(HANG)).await }
    };
    within("the gate's tell", tell("gate".into())).await.unwrap();
    // The gate turn has taken its message once the mailbox has room for CAPACITY more.
    let mut in_mailbox = vec!["panic".to_string()];
    in_mailbox.extend((0..CAPACITY - 1).map(|i| format!("rec:m{i}")));
    for text in &in_mailbox {
        loop {
            match within("a tell into the mailbox", tell(text.clone())).await {
                Ok(()) => break,
                // The gate's message not taken yet: the mailbox holds one too many.
                Err(InvokeError::Busy { .. }) => {
                    tokio::time::sleep(Duration::from_millis(POLL_PAUSE_MS)).await;
                }
                Err(other) => panic!("{text}: {other:?}"),
            }
        }
    }
    let full = within("a tell into the full mailbox", tell("rec:refused".into())).await;
    assert!(
        matches!(full, Err(InvokeError::Busy { .. })),
        "the mailbox is full: {full:?}"
    );
    // Close the mailbox while the gate turn runs: the activation deactivates once its
    // queued messages are done; new messages are held for the next one.
    let deactivation = tokio::spawn({
        let handle = runtime.handle();
        let id = id.clone();
        async move { handle.deactivate(&id).await }
    });
    within("the mailbox closed", async {
        while runtime.stats().await.unwrap().deactivating == 0 {
            tokio::time::sleep(Duration::from_millis(POLL_PAUSE_MS)).await;
        }
    })
    .await;
    let held: Vec<String> = (0..CAPACITY).map(|i| format!("h{i}")).collect();
    for record in &held {
        within("a held tell", tell(format!("rec:{record}")))
            .await
            .unwrap_or_else(|error| panic!("{record}: held for the next activation, not {error:?}"));
    }
    assert_eq!(runtime.stats().await.unwrap().held_messages, CAPACITY, "all held");
    shared.gate.notify_one();
    let deactivated = within("the deactivation", deactivation).await.unwrap();
    println!("deactivate answered {deactivated:?}");
    // Every accepted record, in the order accepted.
    let expected: Vec<String> = in_mailbox
        .iter()
        .filter_map(|text| text.strip_prefix("rec:").map(str::to_string))
        .chain(held.iter().cloned())
        .collect();
    // An ask sent after them is answered after every message queued before it ran.
    within("the ask behind them", async {
        loop {
            let handle = runtime.handle();
            match handle
                .invoke(&id, Bytes::from_static(b"rec:last"), handle.deadline_in(HANG))
                .await
            {
                Ok(_) => return,
                Err(InvokeError::Busy { .. }) => tokio::time::sleep(Duration::from_millis(POLL_PAUSE_MS)).await,
                Err(other) => panic!("the ask behind them: {other:?}"),
            }
        }
    })
    .await;
    let mut ran = shared.records.lock().unwrap().clone();
    assert_eq!(ran.pop().as_deref(), Some("last"), "the ask ran last");
    assert_eq!(ran, expected, "every accepted told message runs once, in order");
    within("shutdown", runtime.shutdown()).await;
}

/// Goal: a told message accepted before `shutdown()` runs within the grace period also
/// when it was held for the next activation (its actor was deactivating when it came),
/// as one put into an open mailbox does (`Runtime::shutdown`, step 2; `tell` is accepted
/// once "in the mailbox or held for the next activation"). Method: a `gate` turn holds
/// the actor; `deactivate` closes its mailbox; one record is told and held (`Ok`);
/// `shutdown()` begins (grace `GRACE`); the gate opens well within the grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_told_message_held_when_shutdown_begins_runs_within_the_grace() {
    const GRACE: Duration = Duration::from_secs(2);
    let shared = Arc::new(Shared::default());
    let shared_for_factory = Arc::clone(&shared);
    let runtime = Runtime::builder()
        .store(Arc::new(MemoryStore::new()))
        .shutdown_grace(GRACE)
        .unwrap()
        .register(
            ActorKind::new("recorder").unwrap(),
            move |_id: &ActorId, _saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
                Ok(ActorBox::new(Recorder {
                    shared: Arc::clone(&shared_for_factory),
                }))
            },
            KindConfig::default(),
        )
        .unwrap()
        .start();
    let handle = runtime.handle();
    let id = ActorId::new("recorder", "r").unwrap();
    let tell = |text: &'static str| {
        let handle = handle.clone();
        let id = id.clone();
        async move { handle.tell(&id, Bytes::from(text), handle.deadline_in(HANG)).await }
    };
    within("the gate's tell", tell("gate")).await.unwrap();
    let deactivation = tokio::spawn({
        let (handle, id) = (handle.clone(), id.clone());
        async move { handle.deactivate(&id).await }
    });
    within("the mailbox closed", async {
        while handle.stats().await.unwrap().deactivating == 0 {
            tokio::time::sleep(Duration::from_millis(POLL_PAUSE_MS)).await;
        }
    })
    .await;
    within("the held tell", tell("rec:held"))
        .await
        .expect("held, so accepted");
    assert_eq!(handle.stats().await.unwrap().held_messages, 1, "held");
    let started = tokio::time::Instant::now();
    let shutdown = tokio::spawn(runtime.shutdown());
    // Shutdown has begun once a new request is refused with it (a request to a kind no
    // one registered: refused `ActorNotFound` before, and it runs nothing).
    let nobody = ActorId::new("nobody", "n").unwrap();
    within("shutdown begun", async {
        loop {
            match handle.tell(&nobody, Bytes::new(), handle.deadline_in(HANG)).await {
                Err(InvokeError::Shutdown) => return,
                Err(InvokeError::ActorNotFound { .. }) => {
                    tokio::time::sleep(Duration::from_millis(POLL_PAUSE_MS)).await;
                }
                other => panic!("a tell to an unregistered kind: {other:?}"),
            }
        }
    })
    .await;
    shared.gate.notify_one();
    within("shutdown", shutdown).await.unwrap();
    let took = started.elapsed();
    let _ = within("the deactivation", deactivation).await.unwrap();
    assert!(took < GRACE, "shutdown took {took:?}, the whole grace {GRACE:?}");
    let ran = shared.records.lock().unwrap().clone();
    assert_eq!(
        ran,
        vec!["held".to_string()],
        "the told message accepted before the shutdown ran within the grace (shutdown took {took:?})"
    );
}
