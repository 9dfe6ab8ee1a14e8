//! Messages that arrive while an actor's activation is deactivating are held by the
//! dispatcher for the next activation, at most the kind's mailbox capacity of them: past
//! it, a message is refused `Busy` at once, as a full mailbox refuses it, and nothing is
//! queued unbounded. The held ones run in the next activation, in the order sent.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Notify;
use troupe_core::{ActorId, ActorKind, InvokeError};
use troupe_runtime::{Actor, ActorBox, ActorError, KindConfig, MemoryStore, Runtime, RuntimeHandle, Turn};

/// How long a test waits for anything before it fails, in milliseconds.
const WAIT_MS_MAX: u64 = 10_000;
/// The kind's mailbox capacity, in messages: also how many are held while deactivating.
const CAPACITY: usize = 3;

#[derive(Default)]
struct Probe {
    /// Signalled when an `on_deactivate` has begun.
    deactivating: Notify,
    /// Lets the first `on_deactivate` return.
    release: Notify,
}

/// Appends each payload's byte to its state (saved), and answers with the whole state.
struct Recorder {
    probe: Arc<Probe>,
    seen: Vec<u8>,
    first: bool,
}

impl Actor for Recorder {
    async fn on_deactivate(&mut self, _id: &ActorId) -> Result<(), ActorError> {
        if self.first {
            self.probe.deactivating.notify_one();
            self.probe.release.notified().await;
        }
        Ok(())
    }

    async fn handle(&mut self, _turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        self.seen.extend_from_slice(&payload);
        Ok(Bytes::copy_from_slice(&self.seen))
    }

    fn snapshot(&self) -> Result<Option<Bytes>, ActorError> {
        Ok(Some(Bytes::copy_from_slice(&self.seen)))
    }
}

fn runtime(probe: &Arc<Probe>) -> Runtime {
    let probe = Arc::clone(probe);
    Runtime::builder()
        .store(Arc::new(MemoryStore::new()))
        .register(
            ActorKind::new("recorder").unwrap(),
            move |_: &ActorId, saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
                Ok(ActorBox::new(Recorder {
                    probe: Arc::clone(&probe),
                    first: saved.is_none(),
                    seen: saved.map(|bytes| bytes.to_vec()).unwrap_or_default(),
                }))
            },
            KindConfig::default().with_mailbox_capacity(CAPACITY),
        )
        .unwrap()
        .start()
}

async fn within<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_millis(WAIT_MS_MAX), future)
        .await
        .unwrap_or_else(|_| panic!("{what} did not happen within {WAIT_MS_MAX} ms"))
}

async fn held_up_to_the_capacity() {
    let probe = Arc::new(Probe::default());
    let runtime = runtime(&probe);
    let handle: RuntimeHandle = runtime.handle();
    let id = ActorId::new("recorder", "a").unwrap();
    let timeout = Duration::from_millis(WAIT_MS_MAX);

    let first = within(
        "the first reply",
        handle.invoke_within(&id, Bytes::from_static(b"0"), timeout),
    )
    .await;
    assert_eq!(&first.unwrap()[..], b"0");
    let deactivated = tokio::spawn({
        let (handle, id) = (handle.clone(), id.clone());
        async move { handle.deactivate(&id).await }
    });
    within("the first on_deactivate", probe.deactivating.notified()).await;

    // Sent while it deactivates: the first CAPACITY are held, in order.
    let mut held = Vec::new();
    for (index, byte) in (b'1'..).take(CAPACITY).enumerate() {
        held.push(tokio::spawn({
            let (handle, id) = (handle.clone(), id.clone());
            async move { handle.invoke_within(&id, Bytes::from(vec![byte]), timeout).await }
        }));
        within("the message held", async {
            while handle.stats().await.unwrap().held_messages != index + 1 {
                tokio::task::yield_now().await;
            }
        })
        .await;
    }
    // One more is refused at once, naming the bound; nothing else is held.
    let refused = within(
        "the refusal",
        handle.invoke_within(&id, Bytes::from_static(b"x"), timeout),
    )
    .await;
    match refused {
        Err(InvokeError::Busy { target, capacity }) => {
            assert_eq!((target, capacity), (id.clone(), CAPACITY));
        }
        other => panic!("expected Busy with capacity {CAPACITY}, got {other:?}"),
    }
    assert_eq!(handle.stats().await.unwrap().held_messages, CAPACITY);

    probe.release.notify_one();
    assert!(within("the deactivation", deactivated).await.unwrap().unwrap());
    // The held ones ran in the next activation, from the saved state, in the order sent.
    let mut expected = b"0".to_vec();
    for (reply, byte) in held.into_iter().zip(b'1'..) {
        expected.push(byte);
        let reply = within("a held message's reply", reply).await.unwrap().unwrap();
        assert_eq!(&reply[..], &expected[..]);
    }
    assert_eq!(handle.stats().await.unwrap().held_messages, 0);
    runtime.shutdown().await;
}

#[tokio::test]
async fn messages_past_the_capacity_are_refused_busy_while_deactivating_current_thread() {
    held_up_to_the_capacity().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_past_the_capacity_are_refused_busy_while_deactivating_multi_thread() {
    held_up_to_the_capacity().await;
}
