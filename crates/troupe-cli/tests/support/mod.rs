//! What the tests that run `troupe serve` as a process share: reading the address it
//! prints, and one HTTP/1.1 request over a fresh connection.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, ChildStdout};
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
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_millis(read_timeout_ms)))
        .unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let status = response[9..12].parse().unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    (status, head.to_string(), body.to_string())
}
