//! A counter whose effects are counted in its committed state: `add` adds one to the
//! key `count` and replies `count=<n>`. For the idempotency-key tests, which count how
//! many times an effect landed by reading `count` from the store.

use bytes::Bytes;
use troupe_runtime::{Actor, ActorError, Turn};

/// `add` adds one to `count` and replies with the new count.
pub(crate) struct Counter;

impl Actor for Counter {
    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        assert_eq!(&payload[..], b"add");
        let count = read_count(turn.get("count").await?);
        turn.put("count", Bytes::from((count + 1).to_string()))?;
        Ok(Bytes::from(format!("count={}", count + 1)))
    }
}

/// The count a stored `count` value holds (0 when absent).
pub(crate) fn read_count(value: Option<Bytes>) -> u64 {
    value.map_or(0, |bytes| std::str::from_utf8(&bytes).unwrap().parse().unwrap())
}

/// The count of a counter's reply, `count=<n>`.
#[allow(dead_code)] // not every test that shares this file reads replies
pub(crate) fn count_of_reply(reply: &[u8]) -> u64 {
    std::str::from_utf8(reply)
        .unwrap()
        .strip_prefix("count=")
        .unwrap()
        .parse()
        .unwrap()
}
