//! A turn's buffered writes (`Turn::put`, `Turn::delete`), kept in a map made on the
//! first write: reads see them, the cap of `TURN_WRITES_MAX` distinct keys holds (an
//! overwrite at the cap is allowed), they are committed with the turn, and a failed
//! turn's writes are dropped.
//!
//! Runs in both builds.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use troupe_core::{ActorId, ActorKind, InvokeError};
use troupe_runtime::{
    Actor, ActorBox, ActorError, KindConfig, MemoryStore, Runtime, StoreError, Turn, TURN_WRITES_MAX,
};

struct Writer;

fn key(index: usize) -> String {
    format!("k{index:05}")
}

fn value(index: usize) -> Bytes {
    Bytes::from(index.to_string())
}

impl Actor for Writer {
    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        let failed = |what: &str| ActorError::failed(what.to_string());
        match &payload[..] {
            b"fill" => {
                for index in 0..TURN_WRITES_MAX {
                    turn.put(key(index), value(index))?;
                }
                if turn.get(&key(7)).await? != Some(value(7)) {
                    return Err(failed("a buffered write is not read back"));
                }
                // At the cap: a key already buffered may be written again, a new one not.
                turn.put(key(0), value(1))?;
                match turn.put(key(TURN_WRITES_MAX), value(0)) {
                    Err(StoreError::TooManyWrites { count, limit })
                        if count == TURN_WRITES_MAX + 1 && limit == TURN_WRITES_MAX => {}
                    other => return Err(failed(&format!("a write past the cap gave {other:?}"))),
                }
                Ok(Bytes::new())
            }
            b"delete" => {
                turn.delete(key(0))?;
                if turn.get(&key(0)).await?.is_some() {
                    return Err(failed("a buffered deletion is not read back"));
                }
                let page = turn.scan("k", None, 10).await?;
                let first: Vec<String> = page.into_iter().map(|(key, _)| key).collect();
                if first != (1..=10).map(key).collect::<Vec<_>>() {
                    return Err(failed(&format!("the scan merged the deletion wrong: {first:?}")));
                }
                Ok(Bytes::new())
            }
            b"fail" => {
                turn.put(key(1), Bytes::from_static(b"never"))?;
                Err(failed("this turn fails after writing"))
            }
            _ => {
                if turn.get(&key(2)).await? != Some(value(2)) {
                    return Err(failed("a committed write is not read"));
                }
                Ok(Bytes::new())
            }
        }
    }
}

async fn writes_are_buffered_capped_and_committed() {
    let store = Arc::new(MemoryStore::new());
    let runtime = Runtime::builder()
        .store(store.clone())
        .register(
            ActorKind::new("writer").unwrap(),
            |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> { Ok(ActorBox::new(Writer)) },
            KindConfig::default().with_idle_timeout(Duration::from_secs(3_600)),
        )
        .unwrap()
        .start();
    let target = ActorId::new("writer", "0").unwrap();
    let timeout = Duration::from_secs(5);
    let send = |command: &'static str| runtime.invoke_within(&target, Bytes::from_static(command.as_bytes()), timeout);
    let stored = |index: usize| {
        let store = store.clone();
        let target = target.clone();
        async move {
            troupe_runtime::StateStore::get(&*store, &target, &key(index))
                .await
                .unwrap()
        }
    };

    send("fill").await.unwrap();
    assert_eq!(stored(0).await, Some(value(1)), "the overwrite at the cap is committed");
    assert_eq!(stored(TURN_WRITES_MAX - 1).await, Some(value(TURN_WRITES_MAX - 1)));
    assert_eq!(stored(TURN_WRITES_MAX).await, None, "the write past the cap is not");

    send("read").await.unwrap();
    match send("fail").await {
        Err(InvokeError::ActorFailed { .. }) => {}
        other => panic!("expected ActorFailed, got {other:?}"),
    }
    assert_eq!(stored(1).await, Some(value(1)), "a failed turn's write is dropped");

    send("delete").await.unwrap();
    assert_eq!(stored(0).await, None, "the deletion is committed");
    assert_eq!(stored(1).await, Some(value(1)));
    runtime.shutdown().await;
}

#[tokio::test]
async fn writes_are_buffered_capped_and_committed_current_thread() {
    writes_are_buffered_capped_and_committed().await;
}

#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_are_buffered_capped_and_committed_multi_thread() {
    writes_are_buffered_capped_and_committed().await;
}
