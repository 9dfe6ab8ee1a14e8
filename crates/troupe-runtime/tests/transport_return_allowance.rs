//! A remote request's answer gets time to travel back: the client measures its
//! connection's round trips and tells the host to answer earlier by their spread (plus
//! `RETURN_ALLOWANCE_MS_MIN`), so a way back that became slower than the handshake's
//! still brings the host's answer before the caller gives up.
//!
//! Goal: a call to a host whose store is down ends with the host's answer
//! (`StorageFailed { source: Unavailable }`, which the host gives 5 to 10 ms before its
//! deadline) although the way back is 60 ms slower than when the connection's handshake
//! measured it, once a clock refresh has measured the slower way; and a call with less
//! time left than the connection's return allowance is still sent, the allowance cut to
//! half its time (`RETURN_ALLOWANCE_SHARE_OF_LEFT_MAX_PERCENT`).
//! Before the return allowance the host's deadline was earlier than the caller's only by
//! the handshake's return leg (tens of microseconds on loopback), so that answer came
//! about 50 ms after the caller's deadline and the call ended `Timeout`.
//!
//! Method: a relay on loopback between the client and the host's transport, whose way
//! back can be slowed (each chunk of the host's bytes held `RETURN_DELAY_MS`). The
//! handshake runs fast; then the way back is slowed: a first call while the store is down
//! ends `Timeout` (the slowdown is not measured yet: what the allowance cannot know; the
//! answer is late by design of this test). A call made over a second later sends a clock
//! refresh with it, whose round trip measures the slower way; the next call while the
//! store is down ends with the host's `Unavailable`. Runs on two threads.
//!
//! Run with `cargo nextest run -p troupe-runtime --test transport_return_allowance`.
#![cfg(not(madsim))]

#[path = "support/turn_counter.rs"]
mod turn_counter;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use troupe_core::{ActorId, CallContext, InvokeError};
use troupe_runtime::{
    Clock, MemoryStore, RequestKind, StoreError, StoreOperation, TransportClient, TransportServer,
    RETURN_ALLOWANCE_MS_MIN,
};
use turn_counter::{turn_counter_runtime, TURN_COUNTER_KIND};

/// How long the relay holds each chunk of the host's bytes once the way back is slowed,
/// in milliseconds: more than the 5 to 10 ms the host's store retries leave before its
/// deadline plus `RETURN_ALLOWANCE_MS_MIN`, so an answer the allowance does not cover
/// is late.
const RETURN_DELAY_MS: u64 = 60;
/// The deadline of a call made while the host's store is down, in milliseconds.
const OUTAGE_CALL_MS: u64 = 1_000;
/// The deadline of a call made while the store is up, in milliseconds.
const CALL_MS: u64 = 10_000;
/// A deadline shorter than the return allowance once the slower way is measured (at
/// least `RETURN_ALLOWANCE_MS_MIN` + about `RETURN_DELAY_MS`), and than the way back, in
/// milliseconds.
const TOO_SHORT_MS: u64 = 30;
/// The clock refresh interval the transport uses (`CLOCK_RESYNC_INTERVAL_MS`, 1 s) and a
/// little more, in milliseconds: a call made this long after the handshake sends a
/// refresh.
const AFTER_RESYNC_INTERVAL_MS: u64 = 1_100;
/// Longest the test waits for the refresh's answer, in milliseconds.
const REFRESH_WAIT_MS_MAX: u64 = 5_000;
/// How much larger than the floor the allowance must have grown once the slower way is
/// measured, in microseconds: half the delay (the handshake's own round trip, on a loaded
/// machine, may take a few milliseconds off the spread).
const MEASURED_SLOWDOWN_US_MIN: u64 = RETURN_DELAY_MS * 1_000 / 2;

const _: () = assert!(TOO_SHORT_MS < RETURN_ALLOWANCE_MS_MIN + MEASURED_SLOWDOWN_US_MIN / 1_000);
const _: () = assert!(TOO_SHORT_MS < RETURN_DELAY_MS);
const _: () = assert!(RETURN_DELAY_MS > 10 + RETURN_ALLOWANCE_MS_MIN + 5);

/// A loopback relay to `upstream` whose way back (upstream to client) holds each chunk
/// `return_delay_ms` milliseconds.
struct Relay {
    address: SocketAddr,
    return_delay_ms: Arc<AtomicU64>,
}

impl Relay {
    async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let return_delay_ms = Arc::new(AtomicU64::new(0));
        let delay = Arc::clone(&return_delay_ms);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let host = TcpStream::connect(upstream).await.unwrap();
                client.set_nodelay(true).unwrap();
                host.set_nodelay(true).unwrap();
                let (mut client_reader, mut client_writer) = client.into_split();
                let (mut host_reader, mut host_writer) = host.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut client_reader, &mut host_writer).await;
                    let _ = host_writer.shutdown().await;
                });
                let delay = Arc::clone(&delay);
                tokio::spawn(async move {
                    let mut chunk = vec![0_u8; 64 * 1024];
                    loop {
                        let read = match host_reader.read(&mut chunk).await {
                            Ok(0) | Err(_) => break,
                            Ok(read) => read,
                        };
                        let hold_ms = delay.load(Ordering::SeqCst);
                        if hold_ms > 0 {
                            tokio::time::sleep(Duration::from_millis(hold_ms)).await;
                        }
                        if client_writer.write_all(&chunk[..read]).await.is_err() {
                            break;
                        }
                    }
                    let _ = client_writer.shutdown().await;
                });
            }
        });
        Self {
            address,
            return_delay_ms,
        }
    }

    fn slow_the_way_back(&self, delay_ms: u64) {
        self.return_delay_ms.store(delay_ms, Ordering::SeqCst);
    }
}

fn counter(key: &str) -> ActorId {
    ActorId::new(TURN_COUNTER_KIND, key).unwrap()
}

/// One `inc` of `target` through `client`, within `within_ms`.
async fn inc(client: &TransportClient, clock: Clock, target: &ActorId, within_ms: u64) -> Result<Bytes, InvokeError> {
    let context = CallContext::root(clock.deadline_in(Duration::from_millis(within_ms)));
    client.invoke(target, Bytes::from_static(b"inc"), context, None).await
}

/// Goal and method: see the file's documentation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_over_a_way_back_slower_than_the_handshakes_arrives_once_the_slowdown_is_measured() {
    let store = MemoryStore::new();
    let turns = Arc::new(AtomicU64::new(0));
    let runtime = turn_counter_runtime(Arc::new(store.clone()), &turns);
    let server = TransportServer::bind("127.0.0.1:0".parse().unwrap(), runtime.handle())
        .await
        .unwrap();
    let relay = Relay::start(server.local_address()).await;
    let clock = Clock::new();
    let client = TransportClient::new(relay.address, clock);
    let target = counter("a");
    let handshake_at = clock.now();
    assert_eq!(inc(&client, clock, &target, CALL_MS).await.unwrap(), "1");
    assert_eq!(client.stats().clock_syncs, 1, "the handshake, fast");

    // The way back slows down; the connection has measured only its fast handshake.
    relay.slow_the_way_back(RETURN_DELAY_MS);
    store.faults().set_unavailable(true);
    let unmeasured = inc(&client, clock, &target, OUTAGE_CALL_MS).await;
    assert!(
        matches!(unmeasured, Err(InvokeError::Timeout { .. })),
        "a slowdown the connection has not measured yet: the host's answer comes late: {unmeasured:?}"
    );
    store.faults().set_unavailable(false);

    // A call over a second after the handshake sends a clock refresh with it.
    let since_handshake = Duration::from_micros(clock.now().as_micros() - handshake_at.as_micros());
    if let Some(left) = Duration::from_millis(AFTER_RESYNC_INTERVAL_MS).checked_sub(since_handshake) {
        tokio::time::sleep(left).await;
    }
    assert_eq!(inc(&client, clock, &target, CALL_MS).await.unwrap(), "2");
    let waited_since = clock.now();
    while client.stats().clock_syncs < 2 {
        assert!(
            clock.now().as_micros() - waited_since.as_micros() < REFRESH_WAIT_MS_MAX * 1_000,
            "no clock refresh answered: {:?}",
            client.stats()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    // Measured: the host answers early enough for its answer to come back.
    store.faults().set_unavailable(true);
    let (failed_before, turns_before) = (store.faults().injected_count(), turns.load(Ordering::SeqCst));
    let measured = inc(&client, clock, &target, OUTAGE_CALL_MS).await;
    match &measured {
        Err(InvokeError::StorageFailed {
            target: failed,
            source: StoreError::Unavailable { operation, .. },
        }) if *failed == target && *operation == StoreOperation::Commit => {}
        other => panic!(
            "the host's answer over the measured slower way: StorageFailed {{ source: Unavailable }} at the \
             commit, not {other:?} ({:?})",
            client.stats()
        ),
    }
    assert_eq!(
        turns.load(Ordering::SeqCst) - turns_before,
        1,
        "one turn, its commit tried again"
    );
    assert!(
        store.faults().injected_count() - failed_before >= 2,
        "the host tried its store again"
    );
    store.faults().set_unavailable(false);

    // A call with less time left than the allowance: sent, its allowance cut to half
    // the time it has (`RETURN_ALLOWANCE_SHARE_OF_LEFT_MAX_PERCENT`), so its host gets
    // the other half and runs it (the store is up); its answer, `RETURN_DELAY_MS` on the way back,
    // comes after the caller's `TOO_SHORT_MS`: `Timeout`, but not unsent.
    let turns_before = turns.load(Ordering::SeqCst);
    let context = CallContext::root(clock.deadline_in(Duration::from_millis(TOO_SHORT_MS)));
    let short = client
        .attempt(&target, Bytes::from_static(b"inc"), context, None, RequestKind::Invoke)
        .await
        .expect_err("an answer slower than the call's deadline");
    assert!(
        matches!(short.error, InvokeError::Timeout { .. }) && !short.was_never_sent(),
        "{short:?}"
    );

    let stats = client.stats();
    let allowance_us = stats.return_allowance_us.expect("an open connection");
    assert!(
        allowance_us >= RETURN_ALLOWANCE_MS_MIN * 1_000 + MEASURED_SLOWDOWN_US_MIN,
        "the slower way was measured: {stats:?}"
    );
    assert_eq!(stats.requests_allowance_capped, 1, "{stats:?}");
    assert_eq!(stats.connections_opened, 1, "{stats:?}");
    // Whatever was in flight has come back by now: the short call ran on its host.
    tokio::time::sleep(Duration::from_millis(4 * RETURN_DELAY_MS)).await;
    assert_eq!(
        turns.load(Ordering::SeqCst),
        turns_before + 1,
        "the short call was sent and ran"
    );
    assert_eq!(
        inc(&client, clock, &target, CALL_MS).await.unwrap(),
        "4",
        "the counter counts on from its committed state (the short call's turn committed; the failed turns nothing)"
    );
    drop(server);
    runtime.shutdown().await;
}
