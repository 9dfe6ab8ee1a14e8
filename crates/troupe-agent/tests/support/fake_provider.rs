//! A scripted OpenAI-compatible server on loopback for the provider tests
//! (`provider_probes.rs`, `provider_leftovers.rs`, `openai_resilience.rs`): each request
//! is read whole (HTTP/1.1, `Content-Length`) and answered as the test's script says for
//! its number and body; the server reports each request read, and each held (`Hang`)
//! connection the client closed. Real sockets: the normal build only.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// How long a `Hang` answer waits for the client to hang up, at most.
const HANG_MS_MAX: u64 = 10_000;

/// The pause after each piece of an `Sse` answer, in milliseconds (so the client reads
/// them as separate chunks, as a provider sends them).
const SSE_PIECE_PAUSE_MS: u64 = 5;

/// What the server does with one request.
#[derive(Clone)]
pub(crate) enum Behaviour {
    /// A complete response: status, extra headers, body.
    Respond {
        status: u16,
        headers: Vec<(&'static str, String)>,
        body: String,
    },
    /// Headers promising `length` bytes, then `sent` of the body, then the connection
    /// is closed.
    CutBody { length: usize, sent: String },
    /// An SSE response: these raw pieces, one by one, then the connection closes.
    Sse(Vec<String>),
    /// Reads the request and answers nothing (until the client hangs up, which `closed`
    /// reports).
    Hang,
}

/// A scripted OpenAI-compatible server on loopback.
pub(crate) struct FakeServer {
    pub(crate) base_url: String,
    requests: Arc<AtomicUsize>,
    /// Every request's body, in the order they were read.
    pub(crate) bodies: Arc<Mutex<Vec<Value>>>,
    /// One message per request read.
    #[allow(dead_code)] // read by openai_resilience.rs only
    pub(crate) received: mpsc::UnboundedReceiver<()>,
    /// One message per `Hang` connection the client closed.
    #[allow(dead_code)] // read by openai_resilience.rs only
    pub(crate) closed: mpsc::UnboundedReceiver<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeServer {
    /// Serves on `127.0.0.1:0`; `script` gets each request's number (from 0) and body.
    pub(crate) async fn start(script: impl Fn(usize, &Value) -> Behaviour + Send + Sync + 'static) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind loopback");
        let address = listener.local_addr().expect("local address");
        let requests = Arc::new(AtomicUsize::new(0));
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let (received_sender, received) = mpsc::unbounded_channel();
        let (closed_sender, closed) = mpsc::unbounded_channel();
        let script = Arc::new(script);
        let task = {
            let requests = requests.clone();
            let bodies = bodies.clone();
            tokio::spawn(async move {
                loop {
                    let Ok((stream, _)) = listener.accept().await else {
                        return;
                    };
                    let script = script.clone();
                    let requests = requests.clone();
                    let bodies = bodies.clone();
                    let received_sender = received_sender.clone();
                    let closed_sender = closed_sender.clone();
                    tokio::spawn(async move {
                        let Some((body, mut stream)) = read_request(stream).await else {
                            return;
                        };
                        let index = requests.fetch_add(1, Ordering::SeqCst);
                        let behaviour = script(index, &body);
                        bodies.lock().unwrap().push(body);
                        let _ = received_sender.send(());
                        answer(&mut stream, behaviour, &closed_sender).await;
                    });
                }
            })
        };
        Self {
            base_url: format!("http://{address}/v1"),
            requests,
            bodies,
            received,
            closed,
            task,
        }
    }

    /// How many requests were read.
    pub(crate) fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
}

/// Reads one HTTP/1.1 request with a `Content-Length` body; `None` if the client hung up.
pub(crate) async fn read_request(mut stream: TcpStream) -> Option<(Value, TcpStream)> {
    let mut bytes = Vec::new();
    let mut buffer = [0_u8; 4096];
    let header_end = loop {
        let read = stream.read(&mut buffer).await.ok()?;
        if read == 0 {
            return None;
        }
        bytes.extend_from_slice(&buffer[..read]);
        if let Some(position) = bytes.windows(4).position(|window| window == b"\r\n\r\n") {
            break position + 4;
        }
    };
    let head = String::from_utf8_lossy(&bytes[..header_end]).to_lowercase();
    let length: usize = head
        .lines()
        .find_map(|line| line.strip_prefix("content-length:"))
        .map(|value| value.trim().parse().expect("numeric content-length"))
        .expect("the client sends Content-Length");
    while bytes.len() < header_end + length {
        let read = stream.read(&mut buffer).await.ok()?;
        if read == 0 {
            return None;
        }
        bytes.extend_from_slice(&buffer[..read]);
    }
    let body = serde_json::from_slice(&bytes[header_end..header_end + length]).expect("the request body is JSON");
    Some((body, stream))
}

async fn answer(stream: &mut TcpStream, behaviour: Behaviour, closed: &mpsc::UnboundedSender<()>) {
    match behaviour {
        Behaviour::Respond { status, headers, body } => {
            let mut head = format!(
                "HTTP/1.1 {status} Scripted\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
                 Connection: close\r\n",
                body.len()
            );
            for (name, value) in headers {
                head.push_str(&format!("{name}: {value}\r\n"));
            }
            head.push_str("\r\n");
            let _ = stream.write_all(head.as_bytes()).await;
            let _ = stream.write_all(body.as_bytes()).await;
            let _ = stream.shutdown().await;
        }
        Behaviour::CutBody { length, sent } => {
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\
                 Connection: close\r\n\r\n"
            );
            let _ = stream.write_all(head.as_bytes()).await;
            let _ = stream.write_all(sent.as_bytes()).await;
            let _ = stream.flush().await;
            let _ = stream.shutdown().await;
        }
        Behaviour::Sse(pieces) => {
            let head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n";
            let _ = stream.write_all(head.as_bytes()).await;
            for piece in pieces {
                let _ = stream.write_all(piece.as_bytes()).await;
                let _ = stream.flush().await;
                tokio::time::sleep(Duration::from_millis(SSE_PIECE_PAUSE_MS)).await;
            }
            let _ = stream.shutdown().await;
        }
        Behaviour::Hang => {
            let mut buffer = [0_u8; 256];
            let hung_up = tokio::time::timeout(Duration::from_millis(HANG_MS_MAX), async {
                while matches!(stream.read(&mut buffer).await, Ok(read) if read > 0) {}
            })
            .await;
            if hung_up.is_ok() {
                let _ = closed.send(());
            }
        }
    }
}

/// A complete answer with `status` and JSON `body`.
pub(crate) fn respond(status: u16, body: &str) -> Behaviour {
    Behaviour::Respond {
        status,
        headers: Vec::new(),
        body: body.to_owned(),
    }
}
