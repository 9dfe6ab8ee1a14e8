//! What the tests that run `troupe serve` as a process share: reading the address it
//! prints (after starting it with its stderr read by a thread), one HTTP/1.1 request
//! over a fresh connection, and the check that a connection past the server's cap waits.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

/// Reads the child's stdout up to the `listening on http://ADDR` line; the rest of
/// stdout (for later reads) and the address, or `None` if stdout ended first.
pub(crate) fn read_address(child: &mut Child) -> Option<(BufReader<ChildStdout>, String)> {
    let mut stdout = BufReader::new(child.stdout.take().expect("the child's stdout is piped"));
    let mut line = String::new();
    while stdout.read_line(&mut line).unwrap() > 0 {
        if let Some(rest) = line.trim().strip_prefix("listening on http://") {
            return Some((stdout, rest.to_string()));
        }
        line.clear();
    }
    None
}

/// One HTTP/1.1 request with a JSON `body` over a fresh connection, waiting at most
/// `read_timeout_ms` for the answer; the status and the body.
pub(crate) fn http(addr: &str, method: &str, path: &str, body: &str, read_timeout_ms: u64) -> (u16, String) {
    let (status, _, body) = http_with_head(addr, method, path, body, read_timeout_ms);
    (status, body)
}

/// As [`http`], with the response's head too (status line and headers, as sent).
#[allow(dead_code)]
pub(crate) fn http_with_head(
    addr: &str,
    method: &str,
    path: &str,
    body: &str,
    read_timeout_ms: u64,
) -> (u16, String, String) {
    try_http_with_head(addr, method, path, body, read_timeout_ms).unwrap()
}

/// As [`http_with_head`], returning the I/O error (a stopped or killed server refuses
/// or resets the connection; an answer that is not HTTP is `InvalidData`) instead of
/// panicking.
#[allow(dead_code)]
pub(crate) fn try_http_with_head(
    addr: &str,
    method: &str,
    path: &str,
    body: &str,
    read_timeout_ms: u64,
) -> std::io::Result<(u16, String, String)> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_millis(read_timeout_ms)))?;
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let bad = || {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("not an HTTP answer: {response:?}"),
        )
    };
    let status = response.get(9..12).and_then(|code| code.parse().ok()).ok_or_else(bad)?;
    let (head, body) = response.split_once("\r\n\r\n").ok_or_else(bad)?;
    Ok((status, head.to_string(), body.to_string()))
}

/// Sends `GET /health` on a new connection to `addr`, a server whose connection cap is
/// taken, and checks that no byte of an answer comes within `held` (the connection
/// waits unaccepted); then runs `release` (which closes the connections holding the
/// cap) and checks the request is answered 200 within `answered`. Returns how long
/// after `release` the answer came.
#[allow(dead_code)] // the connection-cap tests use it
#[allow(clippy::disallowed_methods)] // a real process's answer, timed on the wall clock
pub(crate) fn held_past_the_cap_then_answered(
    addr: &str,
    held: Duration,
    answered: Duration,
    release: impl FnOnce(),
) -> Duration {
    let mut waiting = TcpStream::connect(addr).unwrap();
    waiting
        .write_all(format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes())
        .unwrap();
    waiting.set_read_timeout(Some(held)).unwrap();
    let mut first = [0_u8; 1];
    match waiting.read(&mut first) {
        Err(error)
            if matches!(
                error.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) => {}
        other => panic!("a request past the cap was answered: {other:?}"),
    }
    let released = std::time::Instant::now();
    release();
    waiting.set_read_timeout(Some(answered)).unwrap();
    let mut answer = String::new();
    waiting
        .read_to_string(&mut answer)
        .expect("answered once the idle connections are gone");
    let took = released.elapsed();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    took
}

/// Starts `command` (a `troupe serve` or `troupe node`; `what` names it in a failure)
/// with its stdout and stderr piped, its stderr read to the end by a thread so that its
/// logs never fill the pipe, and waits for the address it prints: the child, the
/// stderr's reader, the rest of stdout and the address. Panics with the stderr if it
/// printed no address.
#[allow(dead_code)] // the tests that start nodes use it
#[allow(clippy::disallowed_methods)] // a thread in a test, reading a child's pipe
pub(crate) fn spawn_serving(
    command: &mut Command,
    what: &str,
) -> (Child, std::thread::JoinHandle<String>, BufReader<ChildStdout>, String) {
    let mut child = command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let mut pipe = child.stderr.take().unwrap();
    let stderr = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = pipe.read_to_string(&mut text);
        text
    });
    let Some((stdout, addr)) = read_address(&mut child) else {
        let _ = child.kill();
        panic!("{what} printed no address: {}", stderr.join().unwrap());
    };
    (child, stderr, stdout, addr)
}
