//! Runs several futures of one turn concurrently on the turn's own task.
//!
//! `tokio::task::JoinSet` does not exist under madsim, and spawned tasks would outlive a
//! cancelled turn; polling the futures in place keeps them inside the turn, so they are
//! all dropped (cancelled) with it.

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;

/// A boxed future borrowed for the duration of the join.
pub(crate) type JoinFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Polls every future until all are done; returns their outputs in input order. Each
/// future is first polled in input order, so anything a future does before its first
/// await (such as taking an in-flight slot) happens in that order.
pub(crate) async fn join_all<T>(futures: Vec<JoinFuture<'_, T>>) -> Vec<T> {
    let mut pending: Vec<Option<JoinFuture<'_, T>>> = futures.into_iter().map(Some).collect();
    let mut outputs: Vec<Option<T>> = pending.iter().map(|_| None).collect();
    std::future::poll_fn(move |context| {
        let mut all_done = true;
        for (slot, output) in pending.iter_mut().zip(outputs.iter_mut()) {
            if let Some(future) = slot {
                match future.as_mut().poll(context) {
                    Poll::Ready(value) => {
                        *output = Some(value);
                        *slot = None;
                    }
                    Poll::Pending => all_done = false,
                }
            }
        }
        if all_done {
            Poll::Ready(
                outputs
                    .iter_mut()
                    .map(|o| o.take().expect("every future finished"))
                    .collect(),
            )
        } else {
            Poll::Pending
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn outputs_keep_input_order_and_the_futures_run_concurrently() {
        let started = tokio::time::Instant::now();
        let futures: Vec<JoinFuture<'_, u64>> = [30u64, 10, 20]
            .into_iter()
            .map(|ms| -> JoinFuture<'_, u64> {
                Box::pin(async move {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    ms
                })
            })
            .collect();
        assert_eq!(join_all(futures).await, vec![30, 10, 20]);
        // madsim adds a few microseconds of scheduling jitter to virtual time.
        let elapsed = started.elapsed();
        assert!(
            elapsed >= Duration::from_millis(30) && elapsed < Duration::from_millis(31),
            "{elapsed:?}"
        );
    }
}
