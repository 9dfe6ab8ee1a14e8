//! The `troupe` program probed from outside, as a new user and an operator run it: bad
//! flags and config files, a taken port, signals during load, restarts on the same data.
//! Each probe runs the built binary as a child process on loopback, waits a bounded
//! time, and kills what it started when it is dropped. Normal build only (the server is
//! not built under madsim).
#![cfg(not(madsim))]
// Real processes and real time only: blocking HTTP clients on OS threads, polled waits.
#![allow(clippy::disallowed_methods)]

mod support;

use std::io::{BufReader, Read};
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Output, Stdio};
use std::time::Duration;

/// The longest the binary may take to start, answer or stop, in milliseconds.
const PROBE_WAIT_MS_MAX: u64 = 20_000;
/// How often a stopping child is checked, in milliseconds.
const PROBE_POLL_MS: u64 = 20;

/// A `troupe` child killed when dropped (a failed assertion leaves no process behind).
/// Its stderr is read all along by a thread: a server logging a line per span would
/// otherwise fill the pipe and block.
struct Running {
    child: Child,
    stderr: Option<std::thread::JoinHandle<String>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl Running {
    /// Starts `command` with stdout and stderr piped.
    fn spawn(command: &mut Command) -> Self {
        let mut child = command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        let mut pipe = child.stderr.take().unwrap();
        let stderr = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        });
        Self {
            child,
            stderr: Some(stderr),
        }
    }

    /// Sends `signal` (`TERM`, `INT`) to the child, as a service manager or ctrl-c does.
    fn signal(&self, signal: &str) {
        let sent = Command::new("kill")
            .args([format!("-{signal}"), self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success(), "kill -{signal} {} failed", self.child.id());
    }

    /// Its exit status once it stops, within `PROBE_WAIT_MS_MAX`; else panics (the drop
    /// kills it).
    fn wait(&mut self) -> std::process::ExitStatus {
        for _ in 0..PROBE_WAIT_MS_MAX / PROBE_POLL_MS {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            std::thread::sleep(Duration::from_millis(PROBE_POLL_MS));
        }
        panic!(
            "troupe did not stop within {PROBE_WAIT_MS_MAX} ms; where it is:\n{}",
            where_it_is(self.child.id())
        );
    }

    /// Its stderr (once it has stopped: this waits for the pipe's end).
    fn stderr(&mut self) -> String {
        self.stderr
            .take()
            .map(|reader| reader.join().unwrap_or_default())
            .unwrap_or_default()
    }
}

/// Where process `pid` is, for a probe's failure: its signal masks (`SigCgt` says
/// whether SIGTERM's handler is installed, `ShdPnd`/`SigPnd` whether one waits
/// undelivered) and each thread's name, state and kernel wait channel. A process that
/// does not stop under load is then told apart from one that lost its signal.
fn where_it_is(pid: u32) -> String {
    let read = |path: String| std::fs::read_to_string(path).unwrap_or_default();
    let mut text: String = read(format!("/proc/{pid}/status"))
        .lines()
        .filter(|line| line.starts_with("Sig") || line.starts_with("ShdPnd") || line.starts_with("State"))
        .map(|line| format!("{line}\n"))
        .collect();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let task = task.path();
        let stat = read(format!("{}/stat", task.display()));
        let wchan = read(format!("{}/wchan", task.display()));
        text.push_str(&format!(
            "{} wchan={wchan}\n",
            stat.split(") ").next().unwrap_or_default()
        ));
        text.push_str(&format!(
            "  state {}\n",
            stat.split(") ")
                .nth(1)
                .unwrap_or_default()
                .split(' ')
                .next()
                .unwrap_or_default()
        ));
    }
    text
}

fn troupe() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_troupe"));
    command
        .env_remove("TROUPE_TOKEN")
        .env_remove("OPENAI_API_KEY")
        .env_remove("RUST_LOG");
    command
}

/// Runs `troupe ARGS` to its end (it must stop by itself within the wait).
fn run(args: &[&str]) -> Output {
    let mut running = Running::spawn(troupe().args(args));
    let status = running.wait();
    let mut stdout = Vec::new();
    running.child.stdout.take().unwrap().read_to_end(&mut stdout).unwrap();
    let stderr = running.stderr().into_bytes();
    Output { status, stdout, stderr }
}

/// `troupe serve --scripted --bind 127.0.0.1:0 ARGS`, up to the address it prints.
fn serve(args: &[&str]) -> (Running, BufReader<ChildStdout>, String) {
    let mut running = Running::spawn(
        troupe()
            .args(["serve", "--scripted", "--bind", "127.0.0.1:0"])
            .args(args),
    );
    let (stdout, addr) = support::read_address(&mut running.child).unwrap_or_else(|| {
        let _ = running.child.kill();
        panic!("troupe serve printed no address: {}", running.stderr())
    });
    (running, stdout, addr)
}

fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    support::http(addr, method, path, body, PROBE_WAIT_MS_MAX)
}

/// A refusal as an operator must see it: exit code 1, nothing on stdout about
/// listening, one `troupe: ` line on stderr holding every `needle`, and no panic.
fn assert_refused(output: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "stdout: {stdout}\nstderr: {stderr}");
    assert!(!stdout.contains("listening on"), "{stdout}");
    assert!(
        !stderr.contains("panicked") && !stderr.contains("RUST_BACKTRACE"),
        "{stderr}"
    );
    assert!(stderr.starts_with("troupe: "), "{stderr}");
    for needle in needles {
        assert!(stderr.contains(needle), "{needle:?} not in: {stderr}");
    }
}

/// Goal: a `troupe serve --db DIR` that refuses to start (its config file missing, a
/// directory, not TOML, or naming an agent twice) says which file and what is wrong,
/// and leaves nothing behind: DIR is not created, no `troupe.db` is made for a run that
/// never started. Method: each bad file with a `--db` that does not exist yet.
#[test]
fn serve_refusing_its_config_names_the_file_and_leaves_no_state_behind() {
    let directory = tempfile::tempdir().unwrap();
    let root = directory.path();
    let write = |name: &str, text: &str| {
        let path = root.join(name);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_string()
    };
    let missing = root.join("missing.toml").to_str().unwrap().to_string();
    let a_directory = root.to_str().unwrap().to_string();
    let syntax = write("syntax.toml", "[[agents]\nid = \"a\"\n");
    let twice = write("twice.toml", "[[agents]]\nid = \"a\"\n\n[[agents]]\nid = \"a\"\n");
    let unknown = write("unknown.toml", "[[agents]]\nid = \"a\"\nsystem_promt = \"x\"\n");
    let link = write(
        "link.toml",
        "[[agents]]\nid = \"a\"\n\n[[links]]\nfrom = \"a\"\nto = \"zed\"\n",
    );
    for (n, (file, needles)) in [
        (&missing, vec!["missing.toml", "No such file"]),
        (&a_directory, vec!["Is a directory"]),
        (&syntax, vec!["syntax.toml:1:"]),
        (&twice, vec!["twice.toml:5:", "declared twice"]),
        (&unknown, vec!["unknown.toml:3:", "system_promt"]),
        (&link, vec!["link.toml:6:", "zed"]),
    ]
    .into_iter()
    .enumerate()
    {
        let db = root.join(format!("state-{n}"));
        let output = run(&[
            "serve",
            "--scripted",
            "--bind",
            "127.0.0.1:0",
            "--db",
            db.to_str().unwrap(),
            "--config",
            file,
        ]);
        assert_refused(&output, &needles);
        assert!(
            !db.exists(),
            "{file}: the refused run left {} behind: {:?}",
            db.display(),
            std::fs::read_dir(&db).map(|entries| entries.count())
        );
    }
}

/// Goal: as `troupe serve`, `troupe demo --data-dir DIR --config FILE` with a FILE it
/// cannot read creates no DIR.
#[test]
fn demo_refusing_its_config_leaves_no_data_dir_behind() {
    let directory = tempfile::tempdir().unwrap();
    let data = directory.path().join("data");
    let missing = directory.path().join("missing.toml");
    let output = run(&[
        "demo",
        "--scripted",
        "--data-dir",
        data.to_str().unwrap(),
        "--config",
        missing.to_str().unwrap(),
    ]);
    assert_refused(&output, &["missing.toml"]);
    assert!(!data.exists(), "the refused demo left {} behind", data.display());
}

/// Goal: a port another process holds stops `troupe serve` before it writes anything,
/// with a message naming the address, `--bind`, and what to do. Method: hold a loopback
/// port, serve on it with a `--db` and a config file.
#[test]
fn serve_on_a_taken_port_says_what_to_do_and_writes_nothing() {
    let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = holder.local_addr().unwrap().to_string();
    let directory = tempfile::tempdir().unwrap();
    let db = directory.path().join("state");
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/org.toml");
    let output = run(&[
        "serve",
        "--scripted",
        "--bind",
        &taken,
        "--db",
        db.to_str().unwrap(),
        "--config",
        config,
    ]);
    assert_refused(&output, &[&taken, "in use", "--bind", "port 0"]);
    assert!(!db.exists(), "the refused run left {} behind", db.display());
    drop(holder);
}

/// Goal: `--db` naming a file (not a directory) is refused saying that `--db` takes a
/// directory, not "cannot create FILE: File exists". The same for `demo --data-dir`.
#[test]
fn a_state_directory_that_is_a_file_is_refused_saying_a_directory_is_needed() {
    let directory = tempfile::tempdir().unwrap();
    let file = directory.path().join("troupe.db");
    std::fs::write(&file, b"not a directory").unwrap();
    let file = file.to_str().unwrap();
    let output = run(&["serve", "--scripted", "--bind", "127.0.0.1:0", "--db", file]);
    assert_refused(&output, &["--db", file, "not a directory"]);
    let output = run(&["demo", "--scripted", "--data-dir", file]);
    assert_refused(&output, &["--data-dir", file, "not a directory"]);
    assert_eq!(
        std::fs::read(file).unwrap(),
        b"not a directory",
        "the file is untouched"
    );
}

/// Goal: a token too short is refused naming the flag and the environment variable it
/// may come from, and the minimum; so is an empty `--token ""` (an unset shell variable,
/// `--token "$T"`), which until 2026-12-06 was taken as no token: the server started
/// on loopback serving every request without one, though the operator asked for one.
/// The same for `troupe node --http`.
#[test]
fn a_short_or_empty_token_is_refused_naming_where_it_came_from() {
    for token in ["abc", ""] {
        let output = run(&["serve", "--scripted", "--bind", "127.0.0.1:0", "--token", token]);
        assert_refused(&output, &["--token", "TROUPE_TOKEN", "16"]);
        let output = run(&[
            "node",
            "--etcd",
            "127.0.0.1:1",
            "--postgres",
            "postgresql://troupe@127.0.0.1:1/troupe",
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
            "--token",
            token,
        ]);
        assert_refused(&output, &["--token", "TROUPE_TOKEN", "16"]);
    }
}

/// Goal: a bad RUST_LOG stops `troupe serve` naming it; `--bind` that is no address is
/// clap's usage error (exit 2) naming the flag and the value.
#[test]
fn a_bad_log_filter_or_bind_address_is_refused_naming_it() {
    let output = troupe()
        .args(["serve", "--scripted", "--bind", "127.0.0.1:0"])
        .env("RUST_LOG", "troupe=[")
        .output()
        .unwrap();
    assert_refused(&output, &["RUST_LOG"]);
    let output = run(&["serve", "--bind", "localhost:8080"]);
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--bind") && stderr.contains("localhost:8080"),
        "{stderr}"
    );
}

/// Asks the demo's coordinator for a brief (a turn that calls three agents, about 2 s)
/// on a thread of its own: the status and body it is answered with.
fn ask_for_a_brief_in_the_background(addr: &str) -> std::thread::JoinHandle<(u16, String)> {
    let addr = addr.to_string();
    std::thread::spawn(move || {
        http(
            &addr,
            "POST",
            "/v1/agents/coordinator/messages",
            r#"{"text": "Prepare a brief"}"#,
        )
    })
}

/// Goal: SIGTERM while a turn runs lets it finish (within the 10 s grace): its request
/// is answered 200, the process exits 0 saying it stopped, and what it acknowledged is
/// there after a restart on the same `--db`. Method: ask the coordinator (its scripted
/// turn calls three agents, about 2 s), SIGTERM 300 ms in; restart, read its history.
#[test]
fn sigterm_during_a_turn_lets_it_finish_and_keeps_it_across_a_restart() {
    let directory = tempfile::tempdir().unwrap();
    let db = directory.path().to_str().unwrap();
    let (mut running, mut stdout, addr) = serve(&["--db", db]);
    let asking = ask_for_a_brief_in_the_background(&addr);
    std::thread::sleep(Duration::from_millis(300));
    running.signal("TERM");
    let (status, body) = asking.join().unwrap();
    assert_eq!(status, 200, "the turn in flight finishes: {body}");
    assert!(body.contains("Brief."), "{body}");
    assert!(running.wait().success(), "{}", running.stderr());
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    assert!(rest.contains("troupe serve: stopped"), "{rest}");

    let (mut again, _stdout, addr) = serve(&["--db", db]);
    let (status, history) = http(&addr, "GET", "/v1/agents/coordinator/history", "");
    assert_eq!(status, 200, "{history}");
    assert!(
        history.contains("Prepare a brief") && history.contains("Brief."),
        "the acknowledged turn is kept: {history}"
    );
    again.signal("INT");
    assert!(again.wait().success(), "ctrl-c stops it with 0 too");
}

/// Goal: the flags docs/serve.md's table names are the flags `troupe serve --help`
/// lists, with the defaults it documents; `--version` is the package version.
#[test]
fn serve_help_lists_the_documented_flags() {
    let output = run(&["serve", "--help"]);
    assert!(output.status.success(), "{output:?}");
    let help = String::from_utf8_lossy(&output.stdout);
    let docs = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/serve.md")).unwrap();
    let table: Vec<&str> = docs
        .lines()
        .skip_while(|line| !line.starts_with("| flag | meaning |"))
        .skip(2)
        .take_while(|line| line.starts_with("| `--"))
        .collect();
    assert!(table.len() >= 10, "the flag table of docs/serve.md: {table:?}");
    for row in &table {
        let flag = row[3..].split([' ', '`']).next().unwrap();
        assert!(
            help.contains(&format!("{flag} ")) || help.contains(&format!("{flag}\n")),
            "{flag} of docs/serve.md is not in --help:\n{help}"
        );
    }
    for default in [
        "[default: 127.0.0.1:8080]",
        "[default: 256]",
        "[default: 10000]",
        "[default: text]",
    ] {
        assert!(help.contains(default), "{default} not in --help:\n{help}");
    }
    let output = run(&["--version"]);
    assert_eq!(
        String::from_utf8_lossy(&output.stdout).trim(),
        format!("troupe {}", env!("CARGO_PKG_VERSION"))
    );
}

/// Goal: a second SIGTERM or ctrl-c during the shutdown grace stops `troupe serve` at
/// once, as an operator pressing ctrl-c twice expects, rather than after the requests in
/// flight (up to the 10 s grace): exit code 1, a line saying requests were cut; what was
/// acknowledged before is kept. Method: a message to the critic (acknowledged), then one
/// to the archivist (its scripted turn takes 4 s), SIGTERM 300 ms in, SIGINT 300 ms
/// later: the process must be gone within `SECOND_SIGNAL_STOP_MS_MAX` of the second
/// signal; restarted on the same `--db`, the critic's exchange is there.
#[test]
fn a_second_signal_during_the_grace_stops_at_once_keeping_what_was_acknowledged() {
    /// How long after the second signal the process may take to be gone, in ms: far
    /// less than the archivist's 4 s turn.
    const SECOND_SIGNAL_STOP_MS_MAX: u64 = 1_500;
    let directory = tempfile::tempdir().unwrap();
    let db = directory.path().to_str().unwrap();
    let (mut running, _stdout, addr) = serve(&["--db", db]);
    let (status, body) = http(&addr, "POST", "/v1/agents/critic/messages", r#"{"text": "a brief"}"#);
    assert_eq!(status, 200, "{body}");
    let _asking = std::thread::spawn({
        let addr = addr.clone();
        move || {
            let mut stream = std::net::TcpStream::connect(&addr).unwrap();
            let body = r#"{"text": "Any reports on batteries?"}"#;
            let _ = std::io::Write::write_all(
                &mut stream,
                format!(
                    "POST /v1/agents/archivist/messages HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
                     Content-Length: {}\r\n\r\n{body}",
                    body.len()
                )
                .as_bytes(),
            );
            let mut answer = String::new();
            let _ = stream.read_to_string(&mut answer);
        }
    });
    std::thread::sleep(Duration::from_millis(300));
    running.signal("TERM");
    std::thread::sleep(Duration::from_millis(300));
    running.signal("INT");
    let signalled = std::time::Instant::now();
    let status = running.wait();
    let took = signalled.elapsed();
    let stderr = running.stderr();
    assert!(
        took < Duration::from_millis(SECOND_SIGNAL_STOP_MS_MAX),
        "still running {took:?} after the second signal: {stderr}"
    );
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("second signal"), "{stderr}");

    let (_again, _stdout, addr) = serve(&["--db", db]);
    let (status, history) = http(&addr, "GET", "/v1/agents/critic/history", "");
    assert_eq!(status, 200, "{history}");
    assert!(
        history.contains("Looks fine."),
        "the acknowledged turn is kept: {history}"
    );
}

/// Goal: `troupe demo | head -1` does not panic when `head` goes away: a stdout whose
/// reader closed is no error (the demo runs to its end and exits 0, nothing on stderr
/// about it). Method: read the demo's first line from its piped stdout, close the pipe,
/// wait for the exit.
#[test]
fn demo_whose_stdout_reader_goes_away_does_not_panic() {
    use std::io::BufRead as _;
    let mut running = Running::spawn(troupe().args(["demo", "--scripted"]));
    let mut stdout = BufReader::new(running.child.stdout.take().unwrap());
    let mut first = String::new();
    stdout.read_line(&mut first).unwrap();
    assert!(first.starts_with("Troupe demo:"), "{first}");
    drop(stdout);
    let status = running.wait();
    let stderr = running.stderr();
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(status.code(), Some(0), "{stderr}");
}

/// Goal: `troupe serve` whose stdout reader goes away (a log pipe that died) goes on
/// serving and stops on SIGTERM with 0, without a panic at its last line. Method: read
/// the address, close stdout, ask the critic, SIGTERM.
#[test]
fn serve_whose_stdout_reader_goes_away_serves_on_and_stops_cleanly() {
    let (mut running, stdout, addr) = serve(&[]);
    drop(stdout);
    let (status, body) = http(&addr, "POST", "/v1/agents/critic/messages", r#"{"text": "a brief"}"#);
    assert_eq!(status, 200, "{body}");
    running.signal("TERM");
    let status = running.wait();
    let stderr = running.stderr();
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(status.code(), Some(0), "{stderr}");
}

/// Goal: ctrl-c (SIGINT) under a load of notifications exits 0 within the grace, and
/// every notification answered 202 is kept: after a restart on the same `--db` the
/// critic's history holds each acknowledged text (processed before the stop, or
/// resumed from its inbox after the restart). Method: `NOTIFY_CLIENTS` clients each
/// sending up to `NOTIFY_PER_CLIENT` notifications with their own `msg_id`, SIGINT
/// 300 ms in; the clients stop at their first failed request.
#[test]
fn sigint_under_notify_load_exits_0_and_keeps_every_acknowledged_notification() {
    const NOTIFY_CLIENTS: usize = 4;
    const NOTIFY_PER_CLIENT: usize = 40;
    let directory = tempfile::tempdir().unwrap();
    let db = directory.path().to_str().unwrap();
    let (mut running, _stdout, addr) = serve(&["--db", db]);
    let clients: Vec<_> = (0..NOTIFY_CLIENTS)
        .map(|client| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let mut acknowledged = Vec::new();
                for n in 0..NOTIFY_PER_CLIENT {
                    let text = format!("note-{client}-{n}");
                    let body = format!(r#"{{"text": "{text}", "msg_id": "m-{client}-{n}"}}"#);
                    let answered = std::panic::catch_unwind(|| http(&addr, "POST", "/v1/agents/critic/notify", &body));
                    match answered {
                        Ok((202, _)) => acknowledged.push(text),
                        _ => break,
                    }
                }
                acknowledged
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    running.signal("INT");
    let acknowledged: Vec<String> = clients.into_iter().flat_map(|client| client.join().unwrap()).collect();
    let status = running.wait();
    assert!(status.success(), "{}", running.stderr());
    assert!(
        !acknowledged.is_empty(),
        "no notification was acknowledged before the stop"
    );

    let (_again, _stdout, addr) = serve(&["--db", db]);
    let waited = std::time::Instant::now();
    loop {
        let (status, history) = http(&addr, "GET", "/v1/agents/critic/history?limit=1000", "");
        assert_eq!(status, 200, "{history}");
        let missing: Vec<&String> = acknowledged
            .iter()
            // As the agent reads it: "[notification m-0-1 from outside] note-0-1".
            .filter(|text| !history.contains(&format!("] {text}\"")))
            .collect();
        if missing.is_empty() {
            break;
        }
        assert!(
            waited.elapsed() < Duration::from_millis(PROBE_WAIT_MS_MAX),
            "{} of {} acknowledged notifications are not in the history after the restart: {missing:?}",
            missing.len(),
            acknowledged.len()
        );
        std::thread::sleep(Duration::from_millis(PROBE_POLL_MS));
    }
}

/// Goal: `troupe demo` with a model it cannot reach (OPENAI_API_KEY set, OPENAI_BASE_URL
/// a closed port: a new user's typo) fails within seconds, exit code 1, saying the
/// model provider is unreachable, rather than waiting out the hand-off's 60 s for a
/// review no turn can write. Method: a loopback port bound and closed again.
#[test]
fn demo_with_an_unreachable_model_fails_quickly_saying_so() {
    /// How long the demo may take, in milliseconds: its ask fails in well under a
    /// second (three retries from 250 ms), the hand-off's turn as fast.
    const DEMO_UNREACHABLE_MS_MAX: u64 = 10_000;
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let started = std::time::Instant::now();
    let mut running = Running::spawn(
        troupe()
            .args(["demo"])
            .env("OPENAI_API_KEY", "sk-probe")
            .env("OPENAI_BASE_URL", format!("http://{closed}/v1")),
    );
    let status = running.wait();
    let took = started.elapsed();
    let mut stdout = String::new();
    running
        .child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .unwrap();
    let stderr = running.stderr();
    assert_eq!(status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("unreachable") && stdout.contains("OPENAI_BASE_URL") && stdout.contains("--scripted"),
        "{stdout}"
    );
    assert!(
        took < Duration::from_millis(DEMO_UNREACHABLE_MS_MAX),
        "the demo took {took:?}: {stdout}"
    );
}

/// Goal: what an operator sees running two `troupe serve` on one `--db` (one SQLite
/// file) and sending one agent's messages through both in turn: the runtime's fencing
/// keeps one committer, so each answer is 200, or 503 `fenced` with `Retry-After: 1`
/// (the other process took the agent over; nothing of the turn was committed), and
/// that request sent again is 200; the agent's history holds every message once, in
/// the order answered. Held before any change; it measures how often the operator pays
/// a fenced turn (counted in the message on failure: with alternating traffic, every
/// request after the first pair).
#[test]
fn two_servers_on_one_file_answer_fenced_turns_503_and_their_retries_200() {
    const ROUNDS: usize = 4;
    let directory = tempfile::tempdir().unwrap();
    let db = directory.path().to_str().unwrap();
    let (_first, _first_out, first) = serve(&["--db", db]);
    let (_second, _second_out, second) = serve(&["--db", db]);
    let mut sent = Vec::new();
    let mut fenced = 0;
    for round in 0..ROUNDS {
        for (name, addr) in [("a", &first), ("b", &second)] {
            let text = format!("m{round}{name}");
            let body = format!(r#"{{"text": "{text}"}}"#);
            let (status, head, answer) =
                support::http_with_head(addr, "POST", "/v1/agents/critic/messages", &body, PROBE_WAIT_MS_MAX);
            if status == 503 {
                assert!(answer.contains("\"code\":\"fenced\""), "{answer}");
                assert!(head.to_ascii_lowercase().contains("retry-after: 1"), "{head}");
                fenced += 1;
                let (status, answer) = http(addr, "POST", "/v1/agents/critic/messages", &body);
                assert_eq!(status, 200, "the retry of a fenced request: {answer}");
            } else {
                assert_eq!(status, 200, "{answer}");
            }
            sent.push(text);
        }
    }
    eprintln!("{fenced} of {} requests were fenced and sent again", 2 * ROUNDS);
    let (status, history) = http(&first, "GET", "/v1/agents/critic/history?limit=1000", "");
    assert_eq!(status, 200, "{history}");
    let history: serde_json::Value = serde_json::from_str(&history).unwrap();
    let asked: Vec<&str> = history["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|message| message["role"] == "user")
        .filter_map(|message| message["content"].as_str())
        .collect();
    assert_eq!(asked, sent, "each message once, in order ({fenced} fenced turns)");
}

/// Goal: with OPENAI_API_KEY set, a model configuration the client refuses (an
/// OPENAI_BASE_URL that is no URL; a key that cannot be sent in a header) stops `troupe
/// serve` and `troupe demo` naming the environment variables to check and
/// `--scripted`, before anything starts.
#[test]
fn a_refused_model_configuration_names_the_variables_and_scripted() {
    let refusals = [
        ("sk-probe", "api.example.com/v1", "api.example.com/v1"),
        ("sk-pro\nbe", "http://127.0.0.1:1/v1", "OPENAI_API_KEY"),
    ];
    for ((key, url, named), args) in refusals.into_iter().flat_map(|refusal| {
        [
            (refusal, &["serve", "--bind", "127.0.0.1:0"][..]),
            (refusal, &["demo"][..]),
        ]
    }) {
        let mut running = Running::spawn(
            troupe()
                .args(args)
                .env("OPENAI_API_KEY", key)
                .env("OPENAI_BASE_URL", url),
        );
        let status = running.wait();
        let mut stdout = Vec::new();
        running.child.stdout.take().unwrap().read_to_end(&mut stdout).unwrap();
        let output = Output {
            status,
            stdout,
            stderr: running.stderr().into_bytes(),
        };
        assert_refused(&output, &[named, "OPENAI_BASE_URL", "--scripted"]);
    }
}

/// Goal: ctrl-c (or SIGTERM) during `troupe demo` without `--data-dir` stops it and
/// removes the temporary directory it made for its state (exit code 130, saying it was
/// interrupted), rather than dying by the signal and leaving `troupe-demo-*` behind in
/// the temporary directory at every interrupted run. Method: TMPDIR a directory of the
/// test's own; interrupt the demo once it has printed its state line, then list TMPDIR.
#[test]
fn an_interrupted_demo_removes_its_temporary_state() {
    use std::io::BufRead as _;
    for signal in ["INT", "TERM"] {
        let temporary = tempfile::tempdir().unwrap();
        let mut running = Running::spawn(troupe().args(["demo", "--scripted"]).env("TMPDIR", temporary.path()));
        let mut stdout = BufReader::new(running.child.stdout.take().unwrap());
        let mut line = String::new();
        while !line.starts_with("state: ") {
            line.clear();
            assert!(stdout.read_line(&mut line).unwrap() > 0, "no state line");
        }
        assert!(line.contains(temporary.path().to_str().unwrap()), "{line}");
        running.signal(signal);
        let status = running.wait();
        let stderr = running.stderr();
        let left: Vec<_> = std::fs::read_dir(temporary.path())
            .unwrap()
            .map(|entry| entry.unwrap().file_name())
            .collect();
        assert!(
            left.is_empty(),
            "SIG{signal}: left behind: {left:?} ({status:?}, {stderr})"
        );
        assert_eq!(status.code(), Some(130), "SIG{signal}: {stderr}");
        assert!(stderr.contains("interrupted"), "{stderr}");
    }
}

/// The entries of `directory` (an emptied TMPDIR lists nothing).
fn entries(directory: &Path) -> Vec<std::ffi::OsString> {
    std::fs::read_dir(directory)
        .unwrap()
        .map(|entry| entry.unwrap().file_name())
        .collect()
}

/// Goal: SIGHUP (the terminal `troupe serve` runs in is closed, or an ssh session ends)
/// stops it as SIGTERM does: requests in flight finish, it exits 0 saying it stopped and
/// removes its temporary state; `--help` says so. Until 2026-12-06 SIGHUP's default
/// action killed it at once, leaving `troupe-serve-*` behind. Method: TMPDIR of the
/// test's own, a coordinator turn (about 2 s) in flight, SIGHUP 300 ms in.
#[test]
fn sighup_stops_serve_gracefully_as_sigterm_does() {
    let temporary = tempfile::tempdir().unwrap();
    let mut running = Running::spawn(
        troupe()
            .args(["serve", "--scripted", "--bind", "127.0.0.1:0"])
            .env("TMPDIR", temporary.path()),
    );
    let (mut stdout, addr) = support::read_address(&mut running.child).expect("an address");
    assert_eq!(entries(temporary.path()).len(), 1, "its temporary state");
    let asking = ask_for_a_brief_in_the_background(&addr);
    std::thread::sleep(Duration::from_millis(300));
    running.signal("HUP");
    let (status, body) = asking.join().unwrap();
    assert_eq!(status, 200, "the turn in flight finishes: {body}");
    let exit = running.wait();
    let stderr = running.stderr();
    assert_eq!(exit.code(), Some(0), "{exit:?}: {stderr}");
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    assert!(rest.contains("troupe serve: stopped"), "{rest}");
    assert!(
        entries(temporary.path()).is_empty(),
        "left behind: {:?}",
        entries(temporary.path())
    );
    let output = run(&["serve", "--help"]);
    let help = String::from_utf8_lossy(&output.stdout);
    assert!(help.contains("SIGHUP"), "--help does not say what SIGHUP does:\n{help}");
}

/// Goal: a SIGTERM that comes while `troupe serve` is starting (before it listens)
/// stops it without leaving its temporary state behind: it exits 0 (the signal was
/// taken: it stops as soon as it has started) or, if the signal came before the program
/// watched signals at all, dies by it before it has created anything. Until 2026-12-06
/// the handlers were installed only once it listened: a signal while it opened its store
/// killed it and left `troupe-serve-*` in TMPDIR. Method: `EARLY_SIGNAL_RUNS` starts,
/// each with a TMPDIR of its own, SIGTERM sent 0, 1, 2, ... ms after the spawn (the
/// first right after it), then TMPDIR listed.
#[test]
fn an_early_sigterm_leaves_no_temporary_state_behind() {
    use std::os::unix::process::ExitStatusExt as _;
    /// How many starts are signalled.
    const EARLY_SIGNAL_RUNS: u64 = 40;
    /// How much later each start is signalled than the one before, in microseconds.
    const EARLY_SIGNAL_STEP_US: u64 = 2_500;
    let mut outcomes = std::collections::BTreeMap::<String, u32>::new();
    for run in 0..EARLY_SIGNAL_RUNS {
        let temporary = tempfile::tempdir().unwrap();
        let mut running = Running::spawn(
            troupe()
                .args(["serve", "--scripted", "--bind", "127.0.0.1:0"])
                .env("TMPDIR", temporary.path()),
        );
        std::thread::sleep(Duration::from_micros(run * EARLY_SIGNAL_STEP_US));
        running.signal("TERM");
        let status = running.wait();
        let stderr = running.stderr();
        let left = entries(temporary.path());
        assert!(
            left.is_empty(),
            "SIGTERM {} us after the spawn: left behind {left:?} ({status:?}, {stderr})",
            run * EARLY_SIGNAL_STEP_US
        );
        assert!(
            status.code() == Some(0) || (status.code().is_none() && status.signal() == Some(15)),
            "SIGTERM {} us after the spawn: {status:?}: {stderr}",
            run * EARLY_SIGNAL_STEP_US
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
        *outcomes.entry(format!("{status:?}")).or_default() += 1;
    }
    eprintln!("early SIGTERM outcomes: {outcomes:?}");
}
/// Goal: a `troupe serve` whose stderr nobody reads (a pipe to a process that went
/// away, a service manager's pipe that is full) keeps answering at the default log
/// level: a request writes no line at `info` (its detail is at `debug`), so the 64 KiB
/// pipe never fills. Until 2026-12-06 a coordinator request wrote 32 lines (about 14
/// KiB) at `info`: a few requests filled the pipe and the server stalled on its next
/// log line. Method: stderr piped and never read, `UNREAD_STDERR_REQUESTS` coordinator
/// requests one after the other, each answered within `UNREAD_STDERR_ANSWER_MS_MAX`.
#[test]
fn a_server_whose_stderr_is_never_read_keeps_answering() {
    /// How many requests are sent.
    const UNREAD_STDERR_REQUESTS: usize = 300;
    /// The longest one answer may take, in milliseconds (a coordinator turn is about 2 s
    /// of scripted delays; the first ones are asked of the critic, which answers at once).
    const UNREAD_STDERR_ANSWER_MS_MAX: u64 = 10_000;
    let mut child = troupe()
        .args(["serve", "--scripted", "--bind", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Held, never read.
    let _stderr = child.stderr.take().unwrap();
    let mut running = Running { child, stderr: None };
    let (_stdout, addr) = support::read_address(&mut running.child).expect("an address");
    for request in 0..UNREAD_STDERR_REQUESTS {
        // One coordinator request (32 lines before), then the critic (4 lines each).
        let (path, body) = if request == 0 {
            ("/v1/agents/coordinator/messages", r#"{"text": "Prepare a brief"}"#)
        } else {
            ("/v1/agents/critic/messages", r#"{"text": "a brief"}"#)
        };
        let started = std::time::Instant::now();
        let (status, answer) = support::http(&addr, "POST", path, body, UNREAD_STDERR_ANSWER_MS_MAX);
        assert_eq!(status, 200, "request {request}: {answer}");
        assert!(
            started.elapsed() < Duration::from_millis(UNREAD_STDERR_ANSWER_MS_MAX),
            "request {request} took {:?}",
            started.elapsed()
        );
    }
}

/// Goal: `troupe serve --config FILE` whose FILE declares no agent (empty, or only a
/// policy) says so on stderr, naming the file, that it declares no `[[agents]]`, and
/// what a minimal entry looks like; it still serves (agents may be created through
/// `POST /v1/agents`, and those of an earlier run are kept in `--db`). Until 2026-12-06
/// it served 0 agents without a word. Method: an empty file and a policy-only file.
#[test]
fn a_config_without_agents_is_served_with_a_warning_saying_what_an_agent_entry_is() {
    let directory = tempfile::tempdir().unwrap();
    for (name, text) in [("empty.toml", ""), ("policy.toml", "policy = \"enforced\"\n")] {
        let file = directory.path().join(name);
        std::fs::write(&file, text).unwrap();
        let file = file.to_str().unwrap();
        let (mut running, _stdout, addr) = serve(&["--config", file]);
        let (status, body) = http(&addr, "GET", "/v1/agents", "");
        assert_eq!(status, 200, "{name}: {body}");
        running.signal("TERM");
        assert!(running.wait().success(), "{name}");
        let stderr = running.stderr();
        let warning = stderr
            .lines()
            .find(|line| line.contains("warning"))
            .unwrap_or_else(|| panic!("{name}: no warning: {stderr:?}"));
        for needle in [
            file,
            "no [[agents]]",
            "POST /v1/agents",
            "`[[agents]]` and `id = \"assistant\"`",
        ] {
            assert!(warning.contains(needle), "{name}: {needle:?} not in: {warning}");
        }
    }
}

/// `troupe serve --scripted` on a free loopback port with `RUST_LOG=info`, up to the
/// address it prints: the running server, its stderr pipe (taken, for the caller to hold
/// unread), the rest of its stdout and the address.
fn serving_with_stderr_unread() -> (
    Running,
    std::process::ChildStderr,
    std::io::BufReader<std::process::ChildStdout>,
    String,
) {
    let mut child = troupe()
        .args(["serve", "--scripted", "--bind", "127.0.0.1:0"])
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pipe = child.stderr.take().unwrap();
    let mut running = Running { child, stderr: None };
    let (stdout, addr) = support::read_address(&mut running.child).expect("an address");
    (running, pipe, stdout, addr)
}

/// Goal: a `troupe serve` that logs a line per span (RUST_LOG set) keeps answering when
/// nobody reads its stderr: log lines go through a bounded queue written by a thread of
/// their own, and lines that find the queue full are dropped and counted, never waited
/// for; at a graceful exit the queue is flushed and its last line says how many were
/// dropped. Until 2026-12-06 only the default level was safe (a4b7626): with
/// `RUST_LOG=info` the 64 KiB pipe filled after about 64 critic requests (4 lines each)
/// and the server stalled on its next line. Method: stderr piped and held unread,
/// `UNREAD_LOG_REQUESTS` critic requests (more lines than the pipe and
/// `SERVE_LOG_LINES_BUFFERED_MAX` hold), each answered within `UNREAD_LOG_ANSWER_MS_MAX`;
/// then stderr is read, SIGTERM: exit 0 and the last line reports the dropped lines.
/// `/metrics` shows them too (`troupe_log_lines_dropped_total`: 0 at the start, some
/// once the requests are answered, at most the count reported at the end); until
/// 2026-12-07 it had no such counter, and an operator scraping it could not see them.
#[test]
fn a_server_logging_every_span_keeps_answering_when_its_stderr_is_never_read() {
    /// How many requests are sent: 4 lines each at `info`, so about 8,000 lines (2
    /// MiB), more than the pipe (64 KiB) and the queue (`SERVE_LOG_LINES_BUFFERED_MAX`).
    const UNREAD_LOG_REQUESTS: usize = 2_000;
    /// The longest one answer may take, in milliseconds (the critic answers at once).
    const UNREAD_LOG_ANSWER_MS_MAX: u64 = 10_000;
    // The pipe is held, not read until the requests are answered.
    let (mut running, mut pipe, _stdout, addr) = serving_with_stderr_unread();
    assert_eq!(log_lines_dropped(&addr), 0);
    let started = std::time::Instant::now();
    for request in 0..UNREAD_LOG_REQUESTS {
        let asked = std::time::Instant::now();
        let (status, answer) = support::http(
            &addr,
            "POST",
            "/v1/agents/critic/messages",
            r#"{"text": "a brief"}"#,
            UNREAD_LOG_ANSWER_MS_MAX,
        );
        assert_eq!(status, 200, "request {request}: {answer}");
        assert!(
            asked.elapsed() < Duration::from_millis(UNREAD_LOG_ANSWER_MS_MAX),
            "request {request} took {:?}",
            asked.elapsed()
        );
    }
    eprintln!(
        "{UNREAD_LOG_REQUESTS} requests with stderr unread: {:?}",
        started.elapsed()
    );
    let scraped = log_lines_dropped(&addr);
    running.stderr = Some(std::thread::spawn(move || {
        let mut text = String::new();
        let _ = pipe.read_to_string(&mut text);
        text
    }));
    running.signal("TERM");
    let status = running.wait();
    let stderr = running.stderr();
    assert!(status.success(), "{status:?}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    let dropped: usize = last
        .strip_prefix("troupe serve: ")
        .and_then(|rest| rest.split_once(" log lines were dropped"))
        .and_then(|(count, _)| count.parse().ok())
        .unwrap_or_else(|| panic!("the last line reports no dropped lines: {last:?}"));
    let written = stderr.lines().filter(|line| line.contains("http_request")).count();
    eprintln!(
        "dropped {dropped} lines ({scraped} in /metrics after the requests), {written} request lines written; last \
         line: {last}"
    );
    assert!(dropped > 0 && written > 0, "{last}");
    assert!(
        scraped > 0 && scraped <= dropped as u64,
        "/metrics showed {scraped} log lines dropped; {dropped} were at the end"
    );
}

/// The counter `troupe_log_lines_dropped_total` of the `/metrics` of the server at `addr`.
fn log_lines_dropped(addr: &str) -> u64 {
    let (status, metrics) = http(addr, "GET", "/metrics", "");
    assert_eq!(status, 200, "{metrics}");
    metrics
        .lines()
        .find_map(|line| line.strip_prefix("troupe_log_lines_dropped_total "))
        .unwrap_or_else(|| panic!("no troupe_log_lines_dropped_total in /metrics:\n{metrics}"))
        .parse()
        .unwrap()
}

/// Goal: a server whose stderr nobody reads (a full pipe) still stops within a bound
/// after a second signal: its direct stderr lines (the second signal's, the final
/// `troupe: ...` refusal) go through the bounded log queue, as its log lines do, and are
/// dropped when it is full. Until 2026-12-07 they were written to stderr directly and
/// blocked forever on the full pipe: the process never exited. Method: `RUST_LOG=info`,
/// stderr held and never read, `UNREAD_FILL_REQUESTS` requests (about 1 KiB of lines
/// each, far more than the 64 KiB pipe); a request whose body never comes (the graceful
/// stop waits for it), SIGTERM, then SIGINT: gone within `UNREAD_SECOND_SIGNAL_STOP_MS_MAX`,
/// exit 1.
#[test]
fn a_server_whose_stderr_is_never_read_stops_at_a_second_signal() {
    /// How many requests fill the pipe.
    const UNREAD_FILL_REQUESTS: usize = 400;
    /// How long after the second signal the process may take to be gone, in ms: the
    /// turns' cut (`SERVE_SECOND_SIGNAL_SHUTDOWN_WAIT_MS`, 500 ms) and the log's flush
    /// (`SERVE_LOG_FLUSH_WAIT_MS`, 2 s) with room to spare.
    const UNREAD_SECOND_SIGNAL_STOP_MS_MAX: u64 = 5_000;
    // The pipe is held, never read while the process runs.
    let (mut running, mut pipe, _stdout, addr) = serving_with_stderr_unread();
    for request in 0..UNREAD_FILL_REQUESTS {
        let (status, answer) = http(&addr, "POST", "/v1/agents/critic/messages", r#"{"text": "a brief"}"#);
        assert_eq!(status, 200, "request {request}: {answer}");
    }
    // A request whose body never comes: the graceful stop waits for it.
    let mut hanging = std::net::TcpStream::connect(&addr).unwrap();
    std::io::Write::write_all(
        &mut hanging,
        format!(
            "POST /v1/agents/critic/messages HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Content-Length: 100\r\n\r\n{{\"text\""
        )
        .as_bytes(),
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    running.signal("TERM");
    std::thread::sleep(Duration::from_millis(300));
    running.signal("INT");
    let signalled = std::time::Instant::now();
    let mut status = None;
    while signalled.elapsed() < Duration::from_millis(UNREAD_SECOND_SIGNAL_STOP_MS_MAX) {
        status = running.child.try_wait().unwrap();
        if status.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(PROBE_POLL_MS));
    }
    let took = signalled.elapsed();
    // Read now (the drop kills a process still running): what the pipe held.
    if status.is_none() {
        let _ = running.child.kill();
        let _ = running.child.wait();
    }
    let mut stderr = String::new();
    let _ = pipe.read_to_string(&mut stderr);
    let Some(status) = status else {
        panic!(
            "still running {took:?} after the second signal with its stderr unread ({} bytes in the pipe)",
            stderr.len()
        );
    };
    eprintln!(
        "gone {took:?} after the second signal; {} bytes in the pipe",
        stderr.len()
    );
    assert_eq!(status.code(), Some(1), "{status:?}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    drop(hanging);
}

/// Goal: `troupe serve --max-connections N` serves at most N connections at once: a
/// flood of idle connections past it is not accepted (they wait in the kernel's
/// backlog), so the process's descriptors grow by N at most and the store and model
/// clients keep theirs; a request on one more connection waits, unanswered, and is
/// answered at once when the idle connections go. Until 2026-12-07 there was no such
/// flag and every connection was accepted: by hand, 2,000 idle connections took 1,628
/// descriptors of the process (idle ones close only after `SERVER_HEADER_READ_MS`, 10 s),
/// and under `prlimit --nofile=256` a message waited 7.1 s for a descriptor. Method:
/// `--max-connections CAP`, `IDLE` idle connections, the child's `/proc/PID/fd` counted.
#[test]
fn idle_connections_past_max_connections_wait_and_the_descriptors_stay_bounded() {
    /// The cap given, in connections.
    const CAP: usize = 4;
    /// Idle connections opened, far more than the cap and fewer than the listen backlog
    /// holds (about 128 here): past the backlog the kernel drops new connection attempts
    /// and the client's TCP retries them (1 s, 3 s, 7 s later), which a probe need not
    /// wait for.
    const IDLE: usize = 64;
    /// Descriptors the server may open meanwhile besides the cap's (a log line, a store
    /// file).
    const SLACK: usize = 16;
    /// How long the request on one more connection is given while the idle ones are
    /// held, in milliseconds: it must not be answered.
    const HELD_MS: u64 = 1_000;
    /// How soon it must be answered once they are gone, in milliseconds.
    const ANSWERED_MS: u64 = 3_000;
    let (mut running, _stdout, addr) = serve(&["--max-connections", &CAP.to_string()]);
    let pid = running.child.id();
    let descriptors = || std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count();
    let before = descriptors();
    let idle: Vec<std::net::TcpStream> = (0..IDLE)
        .map(|_| std::net::TcpStream::connect(&addr).unwrap())
        .collect();
    // The server accepts what it will.
    std::thread::sleep(Duration::from_millis(300));
    let grown = descriptors().saturating_sub(before);
    eprintln!("{IDLE} idle connections, --max-connections {CAP}: the server's descriptors grew by {grown}");
    assert!(
        grown <= CAP + SLACK,
        "{grown} descriptors more for {IDLE} idle connections with --max-connections {CAP}"
    );

    // One more connection waits behind them, unanswered.
    let took = support::held_past_the_cap_then_answered(
        &addr,
        Duration::from_millis(HELD_MS),
        Duration::from_millis(ANSWERED_MS),
        || drop(idle),
    );
    assert!(
        took < Duration::from_millis(ANSWERED_MS),
        "answered {took:?} after the idle connections went"
    );
    running.signal("TERM");
    assert!(running.wait().success());
}

/// Goal: a `troupe serve` whose stdout is a full pipe nobody reads (a reader that
/// stopped, a pipe shared with another writer) still serves and stops at SIGTERM: its
/// stdout lines (the address, `stopped`) go through a bounded queue written by a thread
/// of its own, as its log lines do, and are never waited for. Until 2026-12-07 they were
/// written from the thread that printed them: the process blocked on its first line,
/// before it served, and a SIGTERM did not stop it (probed by hand: `/health` not
/// answered in 5 s, still running 5 s after SIGTERM). Method: stdout a pipe filled by a
/// thread of this test before the start and never read; `--bind` a port picked here;
/// `/health` within `FULL_STDOUT_SERVES_MS`, then SIGTERM: exit 0 within
/// `PROBE_WAIT_MS_MAX`.
#[test]
fn a_server_whose_stdout_is_a_full_pipe_serves_and_stops() {
    /// How long the server may take to answer `/health`, in milliseconds.
    const FULL_STDOUT_SERVES_MS: u64 = 10_000;
    let (reader, writer) = std::io::pipe().unwrap();
    // Fills the pipe, then blocks until the reader is dropped (its write then fails).
    let mut filler = writer.try_clone().unwrap();
    let filling = std::thread::spawn(move || {
        let chunk = [b'x'; 4096];
        while std::io::Write::write_all(&mut filler, &chunk).is_ok() {}
    });
    // Its head start: 64 KiB fill in far less.
    std::thread::sleep(Duration::from_millis(200));
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let addr = format!("127.0.0.1:{port}");
    let child = troupe()
        .args(["serve", "--scripted", "--bind", &addr])
        .stdout(writer)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut running = Running { child, stderr: None };
    let started = std::time::Instant::now();
    let mut served = false;
    while started.elapsed() < Duration::from_millis(FULL_STDOUT_SERVES_MS) {
        if std::net::TcpStream::connect(&addr).is_ok() {
            let (status, body) = support::http(&addr, "GET", "/health", "", FULL_STDOUT_SERVES_MS);
            assert_eq!(status, 200, "{body}");
            served = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(PROBE_POLL_MS));
    }
    let took = started.elapsed();
    assert!(served, "not serving {took:?} after the start with its stdout full");
    eprintln!("serving {took:?} after the start with its stdout full");
    running.signal("TERM");
    let status = running.wait();
    assert!(status.success(), "{status:?}");
    drop(reader);
    filling.join().unwrap();
}
