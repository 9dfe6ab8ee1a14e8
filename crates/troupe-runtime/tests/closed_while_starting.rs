//! An activation whose mailbox is closed while it is still starting (its `on_activate`
//! has not returned): the dispatcher hears no notice that it started, and learns it from
//! the task's next notice. These tests pin what that must still give: the request that
//! activated it is answered, the deactivation waits for the start and then runs
//! `on_deactivate` once, a request sent meanwhile is held for the next activation (which
//! really starts, from the state the first one saved), and the table empties.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Notify;
use troupe_core::{ActorId, ActorKind};
use troupe_runtime::{Actor, ActorBox, ActorError, KindConfig, MemoryStore, Runtime, RuntimeHandle, Turn};

/// How long a test waits for anything before it fails, in milliseconds.
const WAIT_MS_MAX: u64 = 10_000;

#[derive(Default)]
struct Probe {
    activations: AtomicU64,
    deactivations: AtomicU64,
    /// Signalled when an `on_activate` has begun.
    starting: Notify,
    /// Lets the first `on_activate` return.
    release: Notify,
}

/// Counts the messages it handled, in its state (saved as 8 bytes).
struct Slow {
    probe: Arc<Probe>,
    handled: u64,
}

impl Actor for Slow {
    async fn on_activate(&mut self, _id: &ActorId) -> Result<(), ActorError> {
        let first = self.probe.activations.fetch_add(1, Ordering::SeqCst) == 0;
        self.probe.starting.notify_one();
        if first {
            self.probe.release.notified().await;
        }
        Ok(())
    }

    async fn on_deactivate(&mut self, _id: &ActorId) -> Result<(), ActorError> {
        self.probe.deactivations.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    async fn handle(&mut self, _turn: &mut Turn, _payload: Bytes) -> Result<Bytes, ActorError> {
        self.handled += 1;
        Ok(Bytes::copy_from_slice(&self.handled.to_le_bytes()))
    }

    fn snapshot(&self) -> Result<Option<Bytes>, ActorError> {
        Ok(Some(Bytes::copy_from_slice(&self.handled.to_le_bytes())))
    }
}

fn decode(bytes: &[u8]) -> u64 {
    u64::from_le_bytes(bytes.try_into().expect("8 bytes"))
}

fn runtime(probe: &Arc<Probe>) -> Runtime {
    let probe = Arc::clone(probe);
    Runtime::builder()
        .store(Arc::new(MemoryStore::new()))
        .register(
            ActorKind::new("slow").unwrap(),
            move |_: &ActorId, saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
                let handled = saved.as_deref().map_or(0, decode);
                Ok(ActorBox::new(Slow {
                    probe: Arc::clone(&probe),
                    handled,
                }))
            },
            KindConfig::default(),
        )
        .unwrap()
        .start()
}

async fn within<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_millis(WAIT_MS_MAX), future)
        .await
        .unwrap_or_else(|_| panic!("{what} did not happen within {WAIT_MS_MAX} ms"))
}

async fn closed_while_starting() {
    let probe = Arc::new(Probe::default());
    let runtime = runtime(&probe);
    let handle: RuntimeHandle = runtime.handle();
    let id = ActorId::new("slow", "a").unwrap();
    let timeout = Duration::from_millis(WAIT_MS_MAX);

    let first = tokio::spawn({
        let (handle, id) = (handle.clone(), id.clone());
        async move { handle.invoke_within(&id, Bytes::from_static(b"1"), timeout).await }
    });
    within("the first on_activate", probe.starting.notified()).await;
    // Closed while its on_activate waits.
    let deactivated = tokio::spawn({
        let (handle, id) = (handle.clone(), id.clone());
        async move { handle.deactivate(&id).await }
    });
    // Wait until the dispatcher has closed it: the table's entry reads closed.
    within("the close", async {
        while handle.stats().await.unwrap().deactivating != 1 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    // Sent while the first activation is closed and still starting: held for the next.
    let second = tokio::spawn({
        let (handle, id) = (handle.clone(), id.clone());
        async move { handle.invoke_within(&id, Bytes::from_static(b"2"), timeout).await }
    });
    within("the held message", async {
        while handle.stats().await.unwrap().held_messages != 1 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert_eq!(probe.deactivations.load(Ordering::SeqCst), 0, "not before it started");
    probe.release.notify_one();

    let first = within("the first reply", first).await.unwrap().unwrap();
    assert_eq!(decode(&first), 1, "the request that activated it runs in it");
    assert!(within("the deactivation", deactivated).await.unwrap().unwrap());
    let second = within("the second reply", second).await.unwrap().unwrap();
    assert_eq!(decode(&second), 2, "the next activation starts from the saved state");
    assert_eq!(probe.activations.load(Ordering::SeqCst), 2);
    assert_eq!(probe.deactivations.load(Ordering::SeqCst), 1);
    let stats = handle.stats().await.unwrap();
    assert_eq!((stats.activations, stats.deactivating, stats.held_messages), (1, 0, 0));

    // The second activation is fully started: it deactivates at once when asked.
    assert!(within("the second deactivation", handle.deactivate(&id)).await.unwrap());
    assert_eq!(probe.deactivations.load(Ordering::SeqCst), 2);
    assert_eq!(handle.stats().await.unwrap().activations, 0);
    runtime.shutdown().await;
}

#[tokio::test]
async fn an_activation_closed_while_it_starts_deactivates_after_its_start_current_thread() {
    closed_while_starting().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_activation_closed_while_it_starts_deactivates_after_its_start_multi_thread() {
    closed_while_starting().await;
}
