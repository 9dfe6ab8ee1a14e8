//! A stopping server says which requests it never read (protocol version 7's
//! `GoingAway`), so their callers know those never ran ([`Delivery::NeverSent`]) and
//! may send them to the actor's new owner.
//!
//! Goal: when a server stops (its node leaving) while requests are written on a
//! connection, the requests it had not read end `Unreachable` as never sent, and a
//! request it read (whether its turn started or still waited) is never reported never
//! sent. Before, every request queued on the connection ended `Unreachable` as maybe
//! sent: the client could not tell those the server had read from those it had not,
//! and a cluster ended them `Unreachable` (the last lost call of the rolling-restart
//! probe, 'connection reset by peer').
//!
//! Method: a `hold` actor records its key when a turn starts, then sleeps far past the
//! server's stop. Requests of [`PAYLOAD_BYTES`] each, one per actor, fill the server's
//! byte budget for the connection (a request read holds its bytes until its turn ends),
//! so the server stops reading after a few: the rest stay written and unread. Then the
//! server is dropped. Each request's turn started if and only if the server read it,
//! which the test checks against the delivery each request ends with. A second test
//! sends small requests to one actor: one runs, the others were read and wait behind
//! it; all must end maybe sent. The first section runs on loopback, the second in the
//! simulator.
//!
//! Run with `cargo nextest run -p troupe-runtime --test transport_going_away`, and under
//! simulation with `CARGO_TARGET_DIR=target/madsim RUSTFLAGS="--cfg madsim" cargo
//! nextest run -p troupe-runtime --test transport_going_away`.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use troupe_core::{ActorId, ActorKind, CallContext, InvokeError};
use troupe_runtime::{
    Actor, ActorBox, ActorError, Clock, Delivery, KindConfig, RequestFailure, RequestKind, Runtime, TransportClient,
    Turn, CONNECTION_BYTES_IN_FLIGHT_MAX_BYTES,
};

/// How long a `hold` turn sleeps, in milliseconds: far past the server's stop.
const HOLD_TURN_MS: u64 = 20_000;
/// The deadline of each request, in milliseconds: past the server's stop, so a request
/// fails because its server went away, not at its deadline.
const REQUEST_DEADLINE_MS: u64 = 30_000;
/// Each large request's payload, in bytes: a quarter of a connection's byte budget, so
/// the server reads three of them (a fourth does not fit beside them) and no more.
const PAYLOAD_BYTES: usize = CONNECTION_BYTES_IN_FLIGHT_MAX_BYTES / 4;
/// Large requests sent: twice what the server reads before its budget is full.
const LARGE_REQUESTS: usize = 6;
/// Small requests sent to one actor in the second test.
const SMALL_REQUESTS: usize = 4;
/// Longest a request may take to fail once its server stopped, in milliseconds.
const FAILS_WITHIN_MS: u64 = 2_000;

/// The keys of the `hold` actors whose turns started, in the order they started.
type Started = Arc<Mutex<Vec<String>>>;

/// Records its key in `started` when a turn starts, then sleeps [`HOLD_TURN_MS`].
struct Hold {
    key: String,
    started: Started,
}

impl Actor for Hold {
    async fn handle(&mut self, _turn: &mut Turn, _payload: Bytes) -> Result<Bytes, ActorError> {
        self.started.lock().unwrap().push(self.key.clone());
        tokio::time::sleep(Duration::from_millis(HOLD_TURN_MS)).await;
        Ok(Bytes::from_static(b"held"))
    }
}

fn hold_runtime(started: &Started) -> Runtime {
    let started = Arc::clone(started);
    Runtime::builder()
        .register(
            ActorKind::new("hold").unwrap(),
            move |id: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> {
                Ok(ActorBox::new(Hold {
                    key: id.key().to_string(),
                    started: Arc::clone(&started),
                }))
            },
            KindConfig::default(),
        )
        .unwrap()
        .start()
}

fn hold(key: &str) -> ActorId {
    ActorId::new("hold", key).unwrap()
}

fn started_now(started: &Started) -> Vec<String> {
    started.lock().unwrap().clone()
}

/// One request to `hold/key` through `client`: its failure (it must fail).
async fn attempt(client: &TransportClient, clock: Clock, key: String, payload: Bytes) -> (String, RequestFailure) {
    let context = CallContext::root(clock.deadline_in(Duration::from_millis(REQUEST_DEADLINE_MS)));
    let result = client
        .attempt(&hold(&key), payload, context, None, RequestKind::Invoke)
        .await;
    (key, result.expect_err("the request fails: its server stops"))
}

/// Sends `keys.len()` requests at once, each to its own key (or the same), with
/// `payload`; returns their tasks.
fn send_all(
    client: &Arc<TransportClient>,
    clock: Clock,
    keys: Vec<String>,
    payload: &Bytes,
) -> Vec<tokio::task::JoinHandle<(String, RequestFailure)>> {
    keys.into_iter()
        .map(|key| {
            let client = Arc::clone(client);
            let payload = payload.clone();
            tokio::spawn(async move { attempt(&client, clock, key, payload).await })
        })
        .collect()
}

/// Waits for every request's failure, each within [`FAILS_WITHIN_MS`] of `stopped_at`.
async fn failures(
    requests: Vec<tokio::task::JoinHandle<(String, RequestFailure)>>,
    clock: Clock,
    stopped_at: troupe_core::Deadline,
) -> Vec<(String, RequestFailure)> {
    let mut failed = Vec::new();
    for request in requests {
        let (key, failure) = request.await.unwrap();
        let took = Duration::from_micros(clock.now().as_micros() - stopped_at.as_micros());
        assert!(
            took < Duration::from_millis(FAILS_WITHIN_MS),
            "request {key} failed {took:?} after its server stopped, not at once: {failure:?}"
        );
        assert!(
            matches!(failure.error, InvokeError::Unreachable { .. }),
            "request {key}: {failure:?}"
        );
        failed.push((key, failure));
    }
    failed
}

/// The large requests' check: a request whose turn started (the server read it) ended
/// maybe sent; one whose turn never started (the server never read it: every request
/// read starts at once, each on its own actor) ended never sent. Some of each.
fn check_read_or_not(failed: &[(String, RequestFailure)], started: &[String]) {
    let started: BTreeSet<&str> = started.iter().map(String::as_str).collect();
    for (key, failure) in failed {
        if started.contains(key.as_str()) {
            assert_eq!(
                failure.delivery,
                Delivery::MaybeSent,
                "request {key}, which the server read and ran, must never be reported never sent: {failure:?}"
            );
        } else {
            assert_eq!(
                failure.delivery,
                Delivery::NeverSent,
                "request {key}, which the server never read (its turn never started), ended {:?}, not NeverSent: {failure:?}",
                failure.delivery
            );
        }
    }
    let never_sent = failed.iter().filter(|(_, failure)| failure.was_never_sent()).count();
    assert!(
        !started.is_empty() && never_sent > 0,
        "some requests were read, some not: started {started:?}"
    );
}

/// The small requests' check: every request was read (one ran when the server stopped,
/// the others waited behind it for the same actor: `started`, taken at the stop), so
/// none may be reported never sent. (As the server abandons them one by one, the
/// runtime may start a waiting turn before its call is dropped: turns may start after
/// the stop.)
fn check_all_read(failed: &[(String, RequestFailure)], started: &[String]) {
    assert_eq!(
        started.len(),
        1,
        "one turn ran at the stop, the others waited: {started:?}"
    );
    for (key, failure) in failed {
        assert_eq!(
            failure.delivery,
            Delivery::MaybeSent,
            "request {key} was read (its turn waited behind another): it must not be reported never sent: {failure:?}"
        );
    }
}

fn large_keys() -> Vec<String> {
    (0..LARGE_REQUESTS).map(|i| format!("h{i}")).collect()
}

fn large_payload() -> Bytes {
    Bytes::from(vec![b'p'; PAYLOAD_BYTES])
}

#[cfg(not(madsim))]
mod loopback {
    use std::net::SocketAddr;

    use troupe_runtime::TransportServer;

    use super::*;

    /// How often the test looks at what the server read, in milliseconds.
    const POLL_MS: u64 = 50;
    /// How long what the server read must stay the same before it is taken as all it
    /// will read, in milliseconds.
    const SETTLED_MS: u64 = 500;
    /// Longest the test waits for the server to settle, in milliseconds.
    const SETTLE_WITHIN_MS: u64 = 10_000;

    /// Waits until the server runs as many requests as turns started, and neither has
    /// changed for [`SETTLED_MS`].
    async fn settle(server: &TransportServer, started: &Started) -> Vec<String> {
        let mut last = (usize::MAX, Vec::new());
        let mut same_for_ms = 0;
        let mut waited_ms = 0;
        loop {
            let now = (server.stats().requests_running, started_now(started));
            if now == last && now.0 == now.1.len() && !now.1.is_empty() {
                same_for_ms += POLL_MS;
                if same_for_ms >= SETTLED_MS {
                    return now.1;
                }
            } else {
                same_for_ms = 0;
            }
            last = now;
            assert!(waited_ms < SETTLE_WITHIN_MS, "the server did not settle: {last:?}");
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
            waited_ms += POLL_MS;
        }
    }

    async fn start() -> (Started, Runtime, TransportServer, Arc<TransportClient>, Clock) {
        let started = Started::default();
        let runtime = hold_runtime(&started);
        let address: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let server = TransportServer::bind(address, runtime.handle()).await.unwrap();
        let clock = Clock::new();
        let client = Arc::new(TransportClient::new(server.local_address(), clock));
        (started, runtime, server, client, clock)
    }

    async fn requests_the_server_never_read_were_never_sent() {
        let (started, runtime, server, client, clock) = start().await;
        let requests = send_all(&client, clock, large_keys(), &large_payload());
        let read = settle(&server, &started).await;
        assert!(
            read.len() < LARGE_REQUESTS,
            "the budget stopped the server reading: {read:?}"
        );
        let stopped_at = clock.now();
        drop(server);
        let failed = failures(requests, clock, stopped_at).await;
        assert_eq!(started_now(&started), read, "no turn started after the stop");
        check_read_or_not(&failed, &read);
        let stats = client.stats();
        assert_eq!(stats.connections_server_went_away, 1, "{stats:?}");
        assert_eq!(
            stats.requests_not_read,
            u64::try_from(LARGE_REQUESTS - read.len()).unwrap(),
            "{stats:?}"
        );
        drop(runtime);
    }

    /// Goal and method: see the file's documentation (the large requests).
    #[tokio::test]
    async fn requests_a_stopping_server_never_read_end_never_sent_and_those_it_read_maybe_sent() {
        requests_the_server_never_read_were_never_sent().await;
    }

    /// As above, the client's callers and the server's tasks on two threads.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn requests_a_stopping_server_never_read_end_never_sent_on_two_threads() {
        requests_the_server_never_read_were_never_sent().await;
    }

    /// Goal: a request the server read is never reported never sent, though its turn
    /// had not started (it waited behind another turn of its actor). Method: small
    /// requests to one `hold` actor; the server stopped once all were read.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn requests_a_stopping_server_read_end_maybe_sent_though_they_had_not_started() {
        let (started, runtime, server, client, clock) = start().await;
        let keys = vec!["one".to_string(); SMALL_REQUESTS];
        let requests = send_all(&client, clock, keys, &Bytes::from_static(b"small"));
        // Every request is read: the server runs all of them (one turn, the others
        // waiting for the actor).
        let mut waited_ms = 0;
        while server.stats().requests_running < SMALL_REQUESTS || started_now(&started).is_empty() {
            assert!(waited_ms < SETTLE_WITHIN_MS, "not all read: {:?}", server.stats());
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
            waited_ms += POLL_MS;
        }
        let read = started_now(&started);
        let stopped_at = clock.now();
        drop(server);
        let failed = failures(requests, clock, stopped_at).await;
        check_all_read(&failed, &read);
        let stats = client.stats();
        assert_eq!(stats.connections_server_went_away, 1, "{stats:?}");
        assert_eq!(stats.requests_not_read, 0, "{stats:?}");
        drop(runtime);
    }
}

#[cfg(madsim)]
mod simulated {
    use std::net::{IpAddr, SocketAddr};

    use madsim::runtime::Handle;
    use troupe_runtime::TransportServer;

    use super::*;

    const SERVER_IP: &str = "10.0.0.1";
    const CLIENT_IP: &str = "10.0.0.2";
    const SERVER_PORT: u16 = 7_000;
    /// When the client starts sending, in milliseconds after the start.
    const SEND_AT_MS: u64 = 100;
    /// When the server stops, in milliseconds after the start: long after every request
    /// was written, and those that fit the budget read.
    const STOP_AT_MS: u64 = 2_000;

    fn server_address() -> SocketAddr {
        SocketAddr::new(SERVER_IP.parse().unwrap(), SERVER_PORT)
    }

    /// A server node that serves a `hold` runtime and drops its server (a graceful
    /// stop, not a kill) at [`STOP_AT_MS`].
    fn server_node(handle: &Handle, started: &Started) {
        handle
            .create_node()
            .name("server")
            .ip(SERVER_IP.parse::<IpAddr>().unwrap())
            .init({
                let started = Arc::clone(started);
                move || {
                    let started = Arc::clone(&started);
                    async move {
                        let runtime = hold_runtime(&started);
                        let server = TransportServer::bind(server_address(), runtime.handle()).await.unwrap();
                        tokio::time::sleep(Duration::from_millis(STOP_AT_MS)).await;
                        drop(server);
                        std::future::pending::<()>().await;
                    }
                }
            })
            .build();
    }

    /// Runs `keys` requests with `payload` from a client node; returns their failures,
    /// the turns started when the server stopped, and those started by the end.
    async fn run(keys: Vec<String>, payload: Bytes) -> (Vec<(String, RequestFailure)>, Vec<String>, Vec<String>) {
        let handle = Handle::current();
        let started = Started::default();
        server_node(&handle, &started);
        let client_node = handle
            .create_node()
            .name("client")
            .ip(CLIENT_IP.parse::<IpAddr>().unwrap())
            .build();
        client_node
            .spawn(async move {
                tokio::time::sleep(Duration::from_millis(SEND_AT_MS)).await;
                let clock = Clock::new();
                let client = Arc::new(TransportClient::new(server_address(), clock));
                let requests = send_all(&client, clock, keys, &payload);
                tokio::time::sleep(Duration::from_millis(STOP_AT_MS - SEND_AT_MS)).await;
                let read = started_now(&started);
                let failed = failures(requests, clock, clock.now()).await;
                (failed, read, started_now(&started))
            })
            .await
            .unwrap()
    }

    /// Goal and method: see the file's documentation (the large requests), on
    /// simulated nodes.
    #[madsim::test]
    async fn requests_a_stopping_server_never_read_end_never_sent_and_those_it_read_maybe_sent() {
        let (failed, read, by_the_end) = run(large_keys(), large_payload()).await;
        assert_eq!(by_the_end, read, "no turn started after the stop");
        assert!(
            read.len() < LARGE_REQUESTS,
            "the budget stopped the server reading: {read:?}"
        );
        check_read_or_not(&failed, &read);
    }

    /// Goal and method: as the loopback test of the same name.
    #[madsim::test]
    async fn requests_a_stopping_server_read_end_maybe_sent_though_they_had_not_started() {
        let keys = vec!["one".to_string(); SMALL_REQUESTS];
        let (failed, read, _) = run(keys, Bytes::from_static(b"small")).await;
        check_all_read(&failed, &read);
    }
}
