//! A shared record: JSON state that every process sharing the store writes straight
//! through it (the organisation, `org_store.rs`; the agents defined over the API,
//! `directory_store.rs`). Its kind is declared with `RuntimeBuilder::shared_record_kind`,
//! so a cluster node does not place it: the store's fences order the writers.
//!
//! ```text
//! change(f): claim(record) → fence, newest state ─► f(state) ─► commit(fence, state)
//!            Fenced (another process claimed it meanwhile) → pause
//!            ORG_WRITE_RETRY_PAUSE_MS × attempts, claim again; at most
//!            ORG_WRITE_ATTEMPTS_MAX attempts
//! ```

use std::time::Duration;

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;
use troupe_core::{ActorId, StoreError};
use troupe_runtime::{StateChange, StateStore, TurnCommit};

use crate::{ORG_WRITE_ATTEMPTS_MAX, ORG_WRITE_RETRY_PAUSE_MS};

/// The record's state from its stored bytes: the default when there are none,
/// `decode_error(the decoder's message)` when they are not its JSON.
pub(crate) fn decode<S: DeserializeOwned + Default, E>(
    bytes: Option<&Bytes>,
    decode_error: impl Fn(String) -> E,
) -> Result<S, E> {
    match bytes {
        None => Ok(S::default()),
        Some(bytes) => serde_json::from_slice(bytes).map_err(|error| decode_error(error.to_string())),
    }
}

/// Calls `unsettled` when dropped armed: a commit that failed, or whose future was
/// dropped, may or may not have landed.
struct Unsettled<'a, F: Fn()> {
    unsettled: &'a F,
    armed: bool,
}

impl<F: Fn()> Drop for Unsettled<'_, F> {
    fn drop(&mut self) {
        if self.armed {
            (self.unsettled)();
        }
    }
}

/// Applies `change` to the newest state of record `id` and commits it under the claim
/// it was read with, claiming again after a fenced commit (see the module doc); returns
/// the committed state and `change`'s output. `change` may run more than once, always
/// on the newest state; its error changes nothing. `unsettled` is called after each
/// commit that failed and when the future is dropped during a commit.
///
/// # Errors
/// `change`'s error; the store's; `decode_error` for a state that is not its JSON.
pub(crate) async fn change<S, T, E>(
    store: &dyn StateStore,
    id: &ActorId,
    decode_error: impl Fn(String) -> E,
    unsettled: impl Fn(),
    mut change: impl FnMut(&mut S) -> Result<T, E>,
) -> Result<(S, T), E>
where
    S: Serialize + DeserializeOwned + Default,
    E: From<StoreError>,
{
    let mut attempt = 0;
    loop {
        attempt += 1;
        let claimed = store.claim(id).await?;
        let mut state: S = decode(claimed.state.as_ref(), &decode_error)?;
        let output = change(&mut state)?;
        let bytes = serde_json::to_vec(&state).map_err(|error| decode_error(error.to_string()))?;
        let commit = TurnCommit {
            state: StateChange::Set(Bytes::from(bytes)),
            writes: Vec::new(),
        };
        let mut guard = Unsettled {
            unsettled: &unsettled,
            armed: true,
        };
        match store.commit(id, claimed.fence, commit).await {
            Ok(()) => {
                guard.armed = false;
                return Ok((state, output));
            }
            Err(StoreError::Fenced { .. }) if attempt < ORG_WRITE_ATTEMPTS_MAX => {
                drop(guard);
                tokio::time::sleep(Duration::from_millis(ORG_WRITE_RETRY_PAUSE_MS * u64::from(attempt))).await;
            }
            Err(error) => return Err(error.into()),
        }
    }
}
