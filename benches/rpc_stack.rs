//! Node-to-node RPC stacks compared for agent-sized messages: Troupe's hand-made TCP
//! transport (`TransportClient` → `TransportServer`) against tonic gRPC (HTTP/2, the
//! stack etcd-client uses), both on loopback, both ending in the same runtime's echo
//! actor, measured in the same run (docs/cluster.md, "Which RPC stack").
//!
//! What each request carries is the same: the payload, the target actor, the call
//! context (depth, chain, the remaining time). The transport encodes them in its frame
//! and translates the deadline with its handshake bound; the gRPC request carries them in
//! a protobuf message and the deadline as `grpc-timeout`. Both servers invoke the actor
//! with `RuntimeHandle::invoke_in` under the context that arrived, so the runtime's share
//! is the same and the difference is the stack.
//!
//! - `round trip, N bytes`: one request at a time (latency), 1 KiB, 64 KiB, 1 MiB.
//! - `32 in flight, N bytes`: 32 concurrent callers on one client (one connection for
//!   gRPC, whatever the transport opens), reported per request (throughput).
//!
//! The tonic service is written out by hand (what `tonic-build` would generate for one
//! unary method) so the bench needs no build script or `protoc`.
//!
//! Run: `cargo bench -p troupe-bench --bench rpc_stack` (shorter runs when `CI` is set).

// criterion_group! generates an undocumented function; a bench measures wall time.
#![allow(missing_docs, clippy::disallowed_methods)]

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use troupe::core::{ActorId, CallContext};
use troupe::runtime::{Runtime, RuntimeHandle, TransportClient, TransportServer};

#[path = "support/echo.rs"]
mod echo;

use echo::echo_runtime;

/// Payload sizes compared, in bytes: a short agent message, a long one with context, a
/// large tool result.
const PAYLOAD_SIZES_BYTES: [usize; 3] = [1024, 64 * 1024, 1024 * 1024];
/// Concurrent callers in the throughput case.
const IN_FLIGHT: usize = 32;
/// The largest message either side accepts here, in bytes (above the 1 MiB payload).
const MESSAGE_SIZE_MAX_BYTES: usize = 4 * 1024 * 1024;
/// Each request's time budget.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The gRPC request: what a node-to-node call carries.
#[derive(Clone, PartialEq, prost::Message)]
struct Invoke {
    #[prost(string, tag = "1")]
    target_kind: String,
    #[prost(string, tag = "2")]
    target_key: String,
    #[prost(uint32, tag = "3")]
    depth: u32,
    /// The chain as `kind/key` strings.
    #[prost(string, repeated, tag = "4")]
    chain: Vec<String>,
    #[prost(bytes = "bytes", tag = "5")]
    payload: Bytes,
}

/// The gRPC reply.
#[derive(Clone, PartialEq, prost::Message)]
struct Reply {
    #[prost(bytes = "bytes", tag = "1")]
    payload: Bytes,
}

const INVOKE_PATH: &str = "/troupe.bench.Node/Invoke";

/// The unary method: decode the context, invoke the actor under it, answer.
struct InvokeMethod(RuntimeHandle);

impl tonic::server::UnaryService<Invoke> for InvokeMethod {
    type Response = Reply;
    type Future = Pin<Box<dyn Future<Output = Result<tonic::Response<Reply>, tonic::Status>> + Send>>;

    fn call(&mut self, request: tonic::Request<Invoke>) -> Self::Future {
        let handle = self.0.clone();
        Box::pin(async move {
            // tonic turns `grpc-timeout` into a server-side timeout, not into a value the
            // handler reads; the header itself is still there to translate.
            let remaining = request
                .metadata()
                .get("grpc-timeout")
                .and_then(|value| value.to_str().ok())
                .and_then(parse_grpc_timeout)
                .unwrap_or(REQUEST_TIMEOUT);
            let invoke = request.into_inner();
            let target = ActorId::new(&invoke.target_kind, &invoke.target_key)
                .map_err(|error| tonic::Status::invalid_argument(error.to_string()))?;
            let chain = invoke
                .chain
                .iter()
                .map(|id| {
                    let (kind, key) = id.split_once('/').unwrap_or((id.as_str(), ""));
                    ActorId::new(kind, key)
                })
                .collect::<Result<Vec<_>, _>>()
                .map_err(|error| tonic::Status::invalid_argument(error.to_string()))?;
            let context = CallContext::continued(invoke.depth, chain, handle.deadline_in(remaining));
            handle
                .invoke_in(&target, invoke.payload, context)
                .await
                .map(|payload| tonic::Response::new(Reply { payload }))
                .map_err(|error| tonic::Status::internal(error.to_string()))
        })
    }
}

/// `grpc-timeout` values: an integer and a unit (`H`, `M`, `S`, `m`, `u`, `n`).
fn parse_grpc_timeout(value: &str) -> Option<Duration> {
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    let amount: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(amount * 3_600),
        "M" => Duration::from_secs(amount * 60),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    })
}

/// The service: routes the one method, as generated code would.
#[derive(Clone)]
struct NodeService(RuntimeHandle);

impl tonic::server::NamedService for NodeService {
    const NAME: &'static str = "troupe.bench.Node";
}

impl tower::Service<http::Request<tonic::body::Body>> for NodeService {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let handle = self.0.clone();
        Box::pin(async move {
            if request.uri().path() != INVOKE_PATH {
                return Ok(tonic::Status::unimplemented(request.uri().path().to_string()).into_http());
            }
            let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::<Reply, Invoke>::default())
                .max_decoding_message_size(MESSAGE_SIZE_MAX_BYTES)
                .max_encoding_message_size(MESSAGE_SIZE_MAX_BYTES);
            Ok(grpc.unary(InvokeMethod(handle), request).await)
        })
    }
}

/// One side of the comparison: a client that calls the echo actor on the server node.
#[derive(Clone)]
enum Stack {
    Transport {
        client: Arc<TransportClient>,
        clock: RuntimeHandle,
    },
    Grpc(tonic::client::Grpc<tonic::transport::Channel>),
}

impl Stack {
    async fn call(&mut self, payload: Bytes) -> Bytes {
        let target = ActorId::new("echo", "0").unwrap();
        let caller = ActorId::new("caller", "0").unwrap();
        match self {
            Self::Transport { client, clock } => {
                let context = CallContext::continued(1, vec![caller.clone()], clock.deadline_in(REQUEST_TIMEOUT));
                client.invoke(&target, payload, context, Some(&caller)).await.unwrap()
            }
            Self::Grpc(grpc) => {
                let mut request = tonic::Request::new(Invoke {
                    target_kind: "echo".to_string(),
                    target_key: "0".to_string(),
                    depth: 1,
                    chain: vec![caller.to_string()],
                    payload,
                });
                request.set_timeout(REQUEST_TIMEOUT);
                grpc.ready().await.unwrap();
                let codec = tonic_prost::ProstCodec::<Invoke, Reply>::default();
                let path = http::uri::PathAndQuery::from_static(INVOKE_PATH);
                grpc.unary(request, path, codec).await.unwrap().into_inner().payload
            }
        }
    }
}

/// The server node (one runtime, both servers) and a client node for each stack.
struct Nodes {
    _server_runtime: Runtime,
    _transport_server: TransportServer,
    _client_runtime: Runtime,
    transport: Stack,
    grpc: Stack,
}

async fn start_nodes() -> Nodes {
    let server_runtime = echo_runtime();
    let handle = server_runtime.handle();
    let transport_server = TransportServer::bind(SocketAddr::from(([127, 0, 0, 1], 0)), handle.clone())
        .await
        .unwrap();
    // Both stacks with Nagle off on both ends (the transport sets TCP_NODELAY itself).
    let incoming = tonic::transport::server::TcpIncoming::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .unwrap()
        .with_nodelay(Some(true));
    let grpc_address = incoming.local_addr().unwrap();
    let service = NodeService(handle.clone());
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(incoming)
            .await
            .unwrap();
    });
    // The caller's node: its own runtime, for its clock (as a cluster node's client has).
    let client_runtime = echo_runtime();
    let client_handle = client_runtime.handle();
    let transport = Stack::Transport {
        client: Arc::new(TransportClient::new(
            transport_server.local_address(),
            client_handle.clock(),
        )),
        clock: client_handle,
    };
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc_address}"))
        .unwrap()
        .tcp_nodelay(true)
        .connect()
        .await
        .unwrap();
    let grpc = Stack::Grpc(
        tonic::client::Grpc::new(channel)
            .max_decoding_message_size(MESSAGE_SIZE_MAX_BYTES)
            .max_encoding_message_size(MESSAGE_SIZE_MAX_BYTES),
    );
    let mut nodes = Nodes {
        _server_runtime: server_runtime,
        _transport_server: transport_server,
        _client_runtime: client_runtime,
        transport,
        grpc,
    };
    // Connect both and activate the actor before anything is timed.
    for stack in [&mut nodes.transport, &mut nodes.grpc] {
        let echoed = stack.call(Bytes::from_static(b"warm")).await;
        assert_eq!(&echoed[..], b"warm");
    }
    nodes
}

fn multi_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// `iters` requests, `callers` at a time, all from tasks on `rt`; returns the time taken.
fn timed(rt: &tokio::runtime::Runtime, stack: &Stack, payload: &Bytes, callers: usize, iters: u64) -> Duration {
    let per_caller = iters.div_ceil(callers as u64);
    let stack = stack.clone();
    let payload = payload.clone();
    rt.block_on(async move {
        let start = Instant::now();
        let mut tasks = Vec::with_capacity(callers);
        for _ in 0..callers {
            let mut stack = stack.clone();
            let payload = payload.clone();
            tasks.push(tokio::spawn(async move {
                for _ in 0..per_caller {
                    let echoed = stack.call(payload.clone()).await;
                    assert_eq!(echoed.len(), payload.len());
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        // Scaled to `iters` requests (the callers made `per_caller * callers`).
        start
            .elapsed()
            .mul_f64(iters as f64 / (per_caller * callers as u64) as f64)
    })
}

fn rpc_stacks(c: &mut Criterion) {
    let rt = multi_thread();
    let nodes = rt.block_on(start_nodes());
    for (case, callers) in [("round trip", 1), ("32 in flight", IN_FLIGHT)] {
        let mut group = c.benchmark_group(format!("rpc stack, {case}, multi_thread (2 workers)"));
        for size in PAYLOAD_SIZES_BYTES {
            let payload = Bytes::from(vec![b'a'; size]);
            group.throughput(Throughput::Bytes(size as u64));
            for (name, stack) in [("troupe transport", &nodes.transport), ("tonic grpc", &nodes.grpc)] {
                group.bench_with_input(BenchmarkId::new(name, size), &payload, |b, payload| {
                    b.iter_custom(|iters| timed(&rt, stack, payload, callers, iters));
                });
            }
        }
        group.finish();
    }
    // Runtimes and servers stop inside the tokio runtime that runs them.
    rt.block_on(async move { drop(nodes) });
}

fn config() -> Criterion {
    let quick = std::env::var_os("CI").is_some();
    Criterion::default()
        .sample_size(if quick { 10 } else { 30 })
        .warm_up_time(Duration::from_millis(if quick { 200 } else { 1_000 }))
        .measurement_time(Duration::from_millis(if quick { 500 } else { 3_000 }))
}

criterion_group! { name = benches; config = config(); targets = rpc_stacks }
criterion_main!(benches);
