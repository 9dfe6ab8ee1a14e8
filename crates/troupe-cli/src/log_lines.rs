//! The log lines of `troupe serve` and `troupe node`: written to stderr by a thread of
//! their own through a bounded queue (`tracing-appender`'s non-blocking writer, lossy),
//! so that a stderr read slowly or not at all never stalls a request. A line that finds
//! the queue full ([`SERVE_LOG_LINES_BUFFERED_MAX`] lines) is dropped and counted; the
//! count is reported while it grows (every [`SERVE_LOG_DROPPED_REPORT_MS`]) and at exit,
//! once the queue is flushed ([`LogLines::finish`]).
//!
//! Until 2026-12-06 the lines were written to stderr from the thread that logged them:
//! with `RUST_LOG=info`, a server whose stderr nobody read filled the 64 KiB pipe after
//! about 64 requests and stopped answering.
//!
//! The lines of `crate::outln!` (the address, `stopped`) go to stdout the same way while
//! a server runs ([`LogLines::stdout`]): until 2026-12-07 they were written from the
//! thread that printed them, and a `troupe serve` whose stdout was a full pipe (shared
//! with its stderr, or a reader that stopped) blocked on its first line, before it
//! served, and never exited at SIGTERM.

use std::io::Write;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tracing_appender::non_blocking::{ErrorCounter, NonBlocking, NonBlockingBuilder, WorkerGuard};

use crate::{SERVE_LOG_DROPPED_REPORT_MS, SERVE_LOG_FLUSH_WAIT_MS, SERVE_LOG_LINES_BUFFERED_MAX};

/// Writes of [`crate::outln!`] that wait for stdout at most, in writes (`troupe serve`
/// and `troupe node` print a few lines); one more is dropped and counted.
pub const SERVE_STDOUT_LINES_BUFFERED_MAX: usize = 64;

/// How long [`LogLines::finish`] waits between two tries of its report line when the
/// queue is full, in milliseconds.
const LOG_REPORT_RETRY_MS: u64 = 10;

/// The queue of the [`LogLines`] of stderr running now, if any: the lines of
/// [`crate::errln!`] go through it ([`stderr_line`]).
static STDERR_QUEUE: Mutex<Option<NonBlocking>> = Mutex::new(None);

/// The queue of the [`LogLines`] of stdout running now, if any: the text of
/// [`crate::outln!`] goes through it ([`stdout_text`]).
static STDOUT_QUEUE: Mutex<Option<NonBlocking>> = Mutex::new(None);

/// Writes `text` to stdout: through the queue of the [`LogLines::stdout`] running now
/// (queued, or dropped and counted if it is full: never waited for), else directly
/// (waiting for a slow reader, as `troupe demo` should). What [`crate::outln!`] writes
/// with.
pub fn stdout_text(text: std::fmt::Arguments<'_>) {
    let queue = STDOUT_QUEUE.lock().unwrap_or_else(PoisonError::into_inner).clone();
    match queue {
        Some(mut queue) => {
            let _ = queue.write_all(text.to_string().as_bytes());
        }
        None => {
            let _ = std::io::stdout().write_fmt(text);
        }
    }
}

/// The count of lines dropped by the last [`LogLines::stderr`] started, kept after its
/// end: what [`stderr_lines_dropped`] reads.
static STDERR_DROPPED: Mutex<Option<ErrorCounter>> = Mutex::new(None);

/// How many log lines the queue of [`LogLines::stderr`] has dropped so far (0 before one
/// starts): what `/metrics` shows as `troupe_log_lines_dropped_total`
/// (`troupe_server::ServerConfig::log_lines_dropped`). Until 2026-12-07 the count was
/// only written to stderr, which is just what nobody reads when lines are dropped.
pub fn stderr_lines_dropped() -> u64 {
    let dropped = STDERR_DROPPED.lock().unwrap_or_else(PoisonError::into_inner);
    dropped
        .as_ref()
        .map_or(0, |counter| u64::try_from(counter.dropped_lines()).unwrap_or(u64::MAX))
}

/// Writes `line` and a newline to stderr: through the queue of the [`LogLines::stderr`]
/// running now (queued, or dropped and counted if it is full: never waited for), else
/// directly. What [`crate::errln!`] writes with. Until 2026-12-07 every such line was
/// written directly: a second signal's line or the final `troupe: ...` refusal blocked
/// forever on a full stderr pipe nobody read, and the process never exited.
pub fn stderr_line(line: std::fmt::Arguments<'_>) {
    let text = format!("{line}\n");
    let queue = STDERR_QUEUE.lock().unwrap_or_else(PoisonError::into_inner).clone();
    match queue {
        Some(mut queue) => {
            let _ = queue.write_all(text.as_bytes());
        }
        None => {
            let _ = std::io::stderr().write_all(text.as_bytes());
        }
    }
}

/// The queue of log lines and the thread that writes them. Keep it until the program
/// stops, then call [`LogLines::finish`]: lines still queued are written then (up to
/// [`SERVE_LOG_FLUSH_WAIT_MS`]).
pub struct LogLines {
    program: &'static str,
    /// What the sink is called in the reports (`stderr`, `stdout`).
    stream: &'static str,
    writer: NonBlocking,
    dropped: ErrorCounter,
    buffered_max: usize,
    guard: Option<WorkerGuard>,
    reporter: Option<tokio::task::JoinHandle<()>>,
    /// The process-wide queue it is ([`LogLines::stderr`], [`LogLines::stdout`]), if
    /// any: it stops being so at [`LogLines::finish`] or when dropped.
    queue_of: Option<&'static Mutex<Option<NonBlocking>>>,
}

impl Drop for LogLines {
    fn drop(&mut self) {
        if let Some(queue) = self.queue_of.take() {
            *queue.lock().unwrap_or_else(PoisonError::into_inner) = None;
        }
    }
}

impl std::fmt::Debug for LogLines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogLines")
            .field("program", &self.program)
            .field("dropped", &self.dropped())
            .field("buffered_max", &self.buffered_max)
            .finish_non_exhaustive()
    }
}

impl LogLines {
    /// Lines of `program` (`troupe serve`, which starts its reports) to stderr, at most
    /// [`SERVE_LOG_LINES_BUFFERED_MAX`] queued.
    /// From now until [`LogLines::finish`], the lines of [`crate::errln!`] go through it
    /// too.
    pub fn stderr(program: &'static str) -> Self {
        let mut lines = Self::new(program, std::io::stderr(), SERVE_LOG_LINES_BUFFERED_MAX);
        *STDERR_QUEUE.lock().unwrap_or_else(PoisonError::into_inner) = Some(lines.writer());
        *STDERR_DROPPED.lock().unwrap_or_else(PoisonError::into_inner) = Some(lines.dropped.clone());
        lines.queue_of = Some(&STDERR_QUEUE);
        lines
    }

    /// The text of [`crate::outln!`] to stdout, written by a thread of its own: at most
    /// [`SERVE_STDOUT_LINES_BUFFERED_MAX`] writes queued, and from now until
    /// [`LogLines::finish`] an `outln!` never waits for stdout's reader. Finish it after
    /// the program's last `outln!` (a later one writes directly, and may block).
    pub fn stdout(program: &'static str) -> Self {
        let mut lines = Self::new(program, std::io::stdout(), SERVE_STDOUT_LINES_BUFFERED_MAX);
        lines.stream = "stdout";
        *STDOUT_QUEUE.lock().unwrap_or_else(PoisonError::into_inner) = Some(lines.writer());
        lines.queue_of = Some(&STDOUT_QUEUE);
        lines
    }

    /// Lines of `program` to `sink`, at most `buffered_max` queued (at least one).
    pub fn new(program: &'static str, sink: impl Write + Send + 'static, buffered_max: usize) -> Self {
        let buffered_max = buffered_max.max(1);
        let (writer, guard) = NonBlockingBuilder::default()
            .lossy(true)
            .buffered_lines_limit(buffered_max)
            .thread_name("troupe-log-lines")
            .finish(sink);
        let dropped = writer.error_counter();
        Self {
            program,
            stream: "stderr",
            writer,
            dropped,
            buffered_max,
            guard: Some(guard),
            reporter: None,
            queue_of: None,
        }
    }

    /// The writer for `tracing_subscriber::fmt::layer().with_writer(..)`: one log line
    /// (one event, formatted whole) per write, queued or dropped, never waited for.
    pub fn writer(&self) -> NonBlocking {
        self.writer.clone()
    }

    /// How many lines were dropped so far because the queue was full.
    pub fn dropped(&self) -> usize {
        self.dropped.dropped_lines()
    }

    /// From now on, every [`SERVE_LOG_DROPPED_REPORT_MS`] in which lines were dropped
    /// ends with a line saying how many (queued as any other line: dropped too if the
    /// queue is still full, and counted in the next report). Needs a tokio runtime.
    pub fn report_dropped_lines(&mut self) {
        let (program, stream, mut writer, dropped, buffered_max) = (
            self.program,
            self.stream,
            self.writer.clone(),
            self.dropped.clone(),
            self.buffered_max,
        );
        let period = Duration::from_millis(SERVE_LOG_DROPPED_REPORT_MS);
        self.reporter = Some(tokio::spawn(async move {
            let mut reported = 0;
            loop {
                tokio::time::sleep(period).await;
                let now = dropped.dropped_lines();
                if now > reported {
                    let line = format!(
                        "{program}: {} more log lines dropped in the last {} s ({now} in all): {stream} is not read \
                         as fast as they come; up to {buffered_max} lines wait to be written\n",
                        now - reported,
                        period.as_secs(),
                    );
                    let _ = writer.write_all(line.as_bytes());
                    reported = now;
                }
            }
        }));
    }

    /// Ends the log: if lines were dropped, queues a last line saying how many (`PROGRAM:
    /// N log lines were dropped in all: ...`, tried again while the queue is full), then
    /// waits up to [`SERVE_LOG_FLUSH_WAIT_MS`] for the queued lines to be written. Lines
    /// still queued then (nobody reads stderr) are lost; the caller goes on to exit.
    ///
    /// From then on [`crate::errln!`] writes to stderr directly (which may block on a
    /// full pipe): write the last lines before.
    pub async fn finish(mut self) {
        if let Some(queue) = self.queue_of.take() {
            *queue.lock().unwrap_or_else(PoisonError::into_inner) = None;
        }
        if let Some(reporter) = self.reporter.take() {
            reporter.abort();
        }
        let flush_wait = Duration::from_millis(SERVE_LOG_FLUSH_WAIT_MS);
        let started = tokio::time::Instant::now();
        let dropped = self.dropped();
        if dropped > 0 {
            let line = format!(
                "{}: {dropped} log lines were dropped in all: {} was not read as fast as they came (up to {} \
                 lines wait to be written; see SERVE_LOG_LINES_BUFFERED_MAX)\n",
                self.program, self.stream, self.buffered_max
            );
            loop {
                let before = self.dropped();
                let _ = self.writer.write_all(line.as_bytes());
                if self.dropped() == before || started.elapsed() >= flush_wait {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(LOG_REPORT_RETRY_MS)).await;
            }
        }
        // The guard's drop queues a stop behind the lines and waits for the thread to
        // reach it (tracing-appender gives up after about 1.1 s): a blocking wait, so on a
        // blocking thread, and bounded here too. Dropped only once the queue has room
        // for the stop: with a full queue it would print its failure on stdout (and panic
        // if stdout is closed); a queue that stays full past the wait (nobody reads
        // stderr) is left to the exit, as is its thread.
        let Some(guard) = self.guard.take() else { return };
        loop {
            if self.has_room() {
                let flushed = tokio::task::spawn_blocking(move || drop(guard));
                let left = flush_wait.saturating_sub(started.elapsed());
                let _ = tokio::time::timeout(left, flushed).await;
                return;
            }
            if started.elapsed() >= flush_wait {
                std::mem::forget(guard);
                return;
            }
            tokio::time::sleep(Duration::from_millis(LOG_REPORT_RETRY_MS)).await;
        }
    }

    /// Whether the queue has room for one more line, tried with an empty line (which
    /// writes nothing; if it does not fit, it counts as dropped).
    fn has_room(&self) -> bool {
        let before = self.dropped();
        let _ = self.writer.clone().write_all(b"");
        self.dropped() == before
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// A sink that keeps what it is given, and blocks every write while `stuck` is held.
    #[derive(Clone, Default)]
    struct Sink {
        written: Arc<Mutex<Vec<u8>>>,
        stuck: Arc<Mutex<()>>,
    }

    impl Write for Sink {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let _wait = self.stuck.lock().unwrap();
            self.written.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Sink {
        fn text(&self) -> String {
            String::from_utf8(self.written.lock().unwrap().clone()).unwrap()
        }
    }

    /// Goal: with the sink stuck (a stderr nobody reads), writing many more lines than
    /// the queue holds returns at once; the lines past it are counted; once the sink
    /// moves, `finish` writes what was queued and ends with the count.
    #[tokio::test(flavor = "multi_thread")]
    async fn lines_past_a_full_queue_are_dropped_counted_and_reported_at_the_end() {
        const QUEUED: usize = 8;
        const WRITTEN: usize = 1_000;
        let sink = Sink::default();
        let stuck = Arc::clone(&sink.stuck);
        let held = stuck.lock().unwrap();
        let lines = LogLines::new("troupe test", sink.clone(), QUEUED);
        let mut writer = lines.writer();
        for n in 0..WRITTEN {
            writer.write_all(format!("line {n}\n").as_bytes()).unwrap();
        }
        // The thread holds one line (blocked in the sink), the queue `QUEUED` more.
        let dropped = lines.dropped();
        assert!(
            (WRITTEN - QUEUED - 1..=WRITTEN - QUEUED).contains(&dropped),
            "{dropped} dropped"
        );
        drop(held);
        lines.finish().await;
        let text = sink.text();
        let last = text.lines().last().unwrap();
        assert_eq!(
            last,
            format!(
                "troupe test: {dropped} log lines were dropped in all: stderr was not read as fast as they came (up \
                 to {QUEUED} lines wait to be written; see SERVE_LOG_LINES_BUFFERED_MAX)"
            )
        );
        assert!(text.starts_with("line 0\nline 1\n"), "{text}");
        assert_eq!(text.lines().count(), WRITTEN - dropped + 1, "{text}");
    }

    /// Goal: while lines are being dropped, a line every `SERVE_LOG_DROPPED_REPORT_MS`
    /// says how many since the last one and in all; a period without drops says nothing.
    #[tokio::test]
    async fn dropped_lines_are_reported_every_period_in_which_some_were() {
        const QUEUED: usize = 4;
        let sink = Sink::default();
        let stuck = Arc::clone(&sink.stuck);
        let held = stuck.lock().unwrap();
        let mut lines = LogLines::new("troupe test", sink.clone(), QUEUED);
        let mut writer = lines.writer();
        for n in 0..100 {
            writer.write_all(format!("line {n}\n").as_bytes()).unwrap();
        }
        let dropped = lines.dropped();
        drop(held);
        // The writer's thread writes what was queued (real time), then the report's
        // periods pass in paused time.
        let written = |text: String| text.lines().count();
        let waited = tokio::time::Instant::now();
        while written(sink.text()) < 100 - dropped && waited.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::pause();
        lines.report_dropped_lines();
        let period = Duration::from_millis(SERVE_LOG_DROPPED_REPORT_MS);
        // The first period has drops to report, the second none.
        tokio::time::sleep(period + Duration::from_millis(1)).await;
        tokio::time::sleep(period).await;
        tokio::time::resume();
        let reports = |text: String| -> Vec<String> {
            text.lines()
                .filter(|line| line.contains("more log lines dropped"))
                .map(str::to_string)
                .collect()
        };
        let waited = tokio::time::Instant::now();
        while reports(sink.text()).is_empty() && waited.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            reports(sink.text()),
            vec![format!(
                "troupe test: {dropped} more log lines dropped in the last {} s ({dropped} in all): stderr is not \
                 read as fast as they come; up to {QUEUED} lines wait to be written",
                period.as_secs()
            )]
        );
        lines.finish().await;
    }

    /// Goal: nothing dropped, nothing reported; every line reaches the sink by `finish`.
    #[tokio::test(flavor = "multi_thread")]
    async fn finish_writes_every_queued_line_and_no_report_when_none_was_dropped() {
        let sink = Sink::default();
        let lines = LogLines::new("troupe test", sink.clone(), 64);
        let mut writer = lines.writer();
        for n in 0..50 {
            writer.write_all(format!("line {n}\n").as_bytes()).unwrap();
        }
        lines.finish().await;
        let expected: String = (0..50).map(|n| format!("line {n}\n")).collect();
        assert_eq!(sink.text(), expected);
    }

    /// Goal: a sink stuck for good (nobody ever reads stderr) does not hold the exit:
    /// `finish` returns within `SERVE_LOG_FLUSH_WAIT_MS` and a little.
    #[tokio::test(flavor = "multi_thread")]
    // The lock is held across the wait on purpose: it is what keeps the sink stuck.
    #[allow(clippy::await_holding_lock)]
    async fn finish_returns_in_bounded_time_when_the_sink_never_moves() {
        /// Allowance over the flush wait for scheduling, in milliseconds.
        const SLACK_MS: u64 = 1_000;
        let sink = Sink::default();
        let stuck = Arc::clone(&sink.stuck);
        let _held = stuck.lock().unwrap();
        let lines = LogLines::new("troupe test", sink, 4);
        let mut writer = lines.writer();
        for n in 0..100 {
            writer.write_all(format!("line {n}\n").as_bytes()).unwrap();
        }
        let started = tokio::time::Instant::now();
        lines.finish().await;
        assert!(
            started.elapsed() < Duration::from_millis(SERVE_LOG_FLUSH_WAIT_MS + SLACK_MS),
            "{:?}",
            started.elapsed()
        );
    }
}
