//! [`TransportClient::attempt`]: a failed request says whether it may have reached the
//! server ([`Delivery`]).
//!
//! Goal: a router may send a request again to the actor's current owner only if it
//! never left this node, so the transport must tell "never sent" (no connection could
//! be had: refused; the connection had closed before the request was queued) from
//! "sent, then lost" (queued on an open connection that broke before the reply: it may
//! have run). Method: a `hold` actor counts every turn it starts, then sleeps; the
//! server is stopped while a request's turn sleeps (the request reached it: `MaybeSent`,
//! one turn started), and a request is made while nothing listens (`NeverSent`, no
//! turn). The first section runs on loopback, the second in the simulator (the server
//! node killed and restarted).
//!
//! Run with `cargo nextest run -p troupe-runtime --test transport_delivery`, and under
//! simulation with `CARGO_TARGET_DIR=target/madsim RUSTFLAGS="--cfg madsim" cargo
//! nextest run -p troupe-runtime --test transport_delivery`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use troupe_core::{ActorId, ActorKind, CallContext, InvokeError};
use troupe_runtime::{
    Actor, ActorBox, ActorError, Clock, Delivery, KindConfig, RequestFailure, RequestKind, Runtime, TransportClient,
    Turn,
};

/// How long a `hold` turn sleeps, in milliseconds: far past the moment the server stops.
const HOLD_TURN_MS: u64 = 20_000;
/// The deadline of each request, in milliseconds: past the server's stop, so a request
/// lost then fails because the connection broke, not at its deadline.
const REQUEST_DEADLINE_MS: u64 = 30_000;
/// When the server stops after the request was sent, in milliseconds.
const STOP_AFTER_MS: u64 = 500;
/// Longest a lost request may take to fail once its server stopped, in milliseconds:
/// the connection's break, not the deadline.
const FAILS_WITHIN_MS: u64 = 2_000;

/// Counts every turn it starts in `started`, then sleeps [`HOLD_TURN_MS`].
struct Hold {
    started: Arc<AtomicU64>,
}

impl Actor for Hold {
    async fn handle(&mut self, _turn: &mut Turn, _payload: Bytes) -> Result<Bytes, ActorError> {
        self.started.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(HOLD_TURN_MS)).await;
        Ok(Bytes::from_static(b"held"))
    }
}

fn hold_runtime(started: &Arc<AtomicU64>) -> Runtime {
    let started = Arc::clone(started);
    Runtime::builder()
        .register(
            ActorKind::new("hold").unwrap(),
            move |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> {
                Ok(ActorBox::new(Hold {
                    started: Arc::clone(&started),
                }))
            },
            KindConfig::default(),
        )
        .unwrap()
        .start()
}

fn hold() -> ActorId {
    ActorId::new("hold", "h").unwrap()
}

/// One `hold` request through `client`, unkeyed: its failure (it must fail) and how long
/// it took on `clock`.
async fn attempt(client: &TransportClient, clock: &Clock) -> (RequestFailure, Duration) {
    let started = clock.now();
    let context = CallContext::root(clock.deadline_in(Duration::from_millis(REQUEST_DEADLINE_MS)));
    let result = client
        .attempt(&hold(), Bytes::from_static(b"hold"), context, None, RequestKind::Invoke)
        .await;
    let took = Duration::from_micros(clock.now().as_micros() - started.as_micros());
    (result.expect_err("the request fails"), took)
}

/// Asserts a failure is `Unreachable` with `delivery`, within [`FAILS_WITHIN_MS`].
fn assert_unreachable(what: &str, (failure, took): &(RequestFailure, Duration), delivery: Delivery) {
    assert!(
        matches!(failure.error, InvokeError::Unreachable { .. }),
        "{what}: {failure:?}"
    );
    assert_eq!(failure.delivery, delivery, "{what}: {failure:?}");
    assert_eq!(failure.was_never_sent(), delivery == Delivery::NeverSent, "{what}");
    assert!(
        *took < Duration::from_millis(FAILS_WITHIN_MS),
        "{what}: failed after {took:?}, not at once"
    );
}

#[cfg(not(madsim))]
mod loopback {
    use troupe_runtime::TransportServer;

    use super::*;

    /// Goal: a request to a port nothing listens on (a node that left and closed it) is
    /// `Unreachable` and says it was never sent; a request the server took, whose
    /// connection then broke as the server stopped, says it may have been sent (its turn
    /// did start). Method: a server on loopback, a `hold` request, the server dropped
    /// 500 ms later; then another request to its closed port.
    #[tokio::test]
    async fn a_request_lost_after_it_was_sent_may_have_run_and_one_to_a_closed_port_was_never_sent() {
        let started = Arc::new(AtomicU64::new(0));
        let runtime = hold_runtime(&started);
        let server = TransportServer::bind("127.0.0.1:0".parse().unwrap(), runtime.handle())
            .await
            .unwrap();
        let address: SocketAddr = server.local_address();
        let clock = Clock::new();
        let client = Arc::new(TransportClient::new(address, clock));
        let lost = tokio::spawn({
            let client = Arc::clone(&client);
            async move { attempt(&client, &clock).await }
        });
        tokio::time::sleep(Duration::from_millis(STOP_AFTER_MS)).await;
        assert_eq!(started.load(Ordering::SeqCst), 1, "the request reached the server");
        drop(server);
        let lost = lost.await.unwrap();
        assert_unreachable("the request lost after it was sent", &lost, Delivery::MaybeSent);

        let refused = attempt(&client, &clock).await;
        assert_unreachable("the request to a closed port", &refused, Delivery::NeverSent);
        let via_invoke = client
            .invoke(
                &hold(),
                Bytes::from_static(b"hold"),
                CallContext::root(clock.deadline_in(Duration::from_millis(REQUEST_DEADLINE_MS))),
                None,
            )
            .await;
        assert_eq!(via_invoke, Err(refused.0.error), "invoke ends as attempt does");
        assert_eq!(started.load(Ordering::SeqCst), 1, "no other turn started");
        drop(runtime);
    }

    /// Goal: a request whose deadline has passed before it is queued was never sent
    /// (it ends `Timeout`, `NeverSent`). Method: `attempt` with a deadline in the past.
    #[tokio::test]
    async fn a_request_whose_deadline_passed_before_it_was_queued_was_never_sent() {
        let clock = Clock::new();
        let client = TransportClient::new("127.0.0.1:9".parse().unwrap(), clock);
        let context = CallContext::root(clock.now());
        let failure = client
            .attempt(&hold(), Bytes::from_static(b"hold"), context, None, RequestKind::Invoke)
            .await
            .expect_err("past its deadline");
        assert!(matches!(failure.error, InvokeError::Timeout { .. }), "{failure:?}");
        assert_eq!(failure.delivery, Delivery::NeverSent);
    }
}

#[cfg(madsim)]
mod simulated {
    use std::net::IpAddr;

    use madsim::runtime::Handle;
    use troupe_runtime::TransportServer;

    use super::*;

    const SERVER_IP: &str = "10.0.0.1";
    const CLIENT_IP: &str = "10.0.0.2";
    const SERVER_PORT: u16 = 7_000;

    fn server_address() -> SocketAddr {
        SocketAddr::new(SERVER_IP.parse().unwrap(), SERVER_PORT)
    }

    /// Goal: as the loopback test, on simulated nodes: the server node killed while the
    /// request's turn sleeps there (`MaybeSent`; its turn started once), a request while
    /// it is down (`NeverSent`), and after a restart a request reaches it again.
    #[madsim::test]
    async fn a_request_lost_when_its_server_is_killed_may_have_run_and_one_while_it_is_down_was_never_sent() {
        let handle = Handle::current();
        let started = Arc::new(AtomicU64::new(0));
        let server = handle
            .create_node()
            .name("server")
            .ip(SERVER_IP.parse::<IpAddr>().unwrap())
            .init({
                let started = Arc::clone(&started);
                move || {
                    let started = Arc::clone(&started);
                    async move {
                        let runtime = hold_runtime(&started);
                        let _server = TransportServer::bind(server_address(), runtime.handle()).await.unwrap();
                        std::future::pending::<()>().await;
                    }
                }
            })
            .build();
        let client_node = handle
            .create_node()
            .name("client")
            .ip(CLIENT_IP.parse::<IpAddr>().unwrap())
            .build();
        let server_id = server.id();
        client_node
            .spawn(async move {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let clock = Clock::new();
                let client = Arc::new(TransportClient::new(server_address(), clock));
                let lost = tokio::spawn({
                    let client = Arc::clone(&client);
                    async move { attempt(&client, &clock).await }
                });
                tokio::time::sleep(Duration::from_millis(STOP_AFTER_MS)).await;
                assert_eq!(started.load(Ordering::SeqCst), 1, "the request reached the server");
                Handle::current().kill(server_id);
                let lost = lost.await.unwrap();
                assert_unreachable("the request lost with its server", &lost, Delivery::MaybeSent);

                let refused = attempt(&client, &clock).await;
                assert_unreachable("the request while the server is down", &refused, Delivery::NeverSent);
                assert_eq!(started.load(Ordering::SeqCst), 1, "no other turn started");

                Handle::current().restart(server_id);
                tokio::time::sleep(Duration::from_secs(1)).await;
                let again = tokio::spawn({
                    let client = Arc::clone(&client);
                    async move { attempt(&client, &clock).await }
                });
                tokio::time::sleep(Duration::from_millis(STOP_AFTER_MS)).await;
                assert_eq!(started.load(Ordering::SeqCst), 2, "the restarted server runs it");
                again.abort();
            })
            .await
            .unwrap();
    }
}
