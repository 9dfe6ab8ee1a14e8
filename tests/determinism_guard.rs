//! The determinism guard: library code must not read the wall clock, spawn OS threads,
//! draw unseeded randomness, use an unbiased `select!`, a tokio `watch` channel or a
//! randomly keyed std hash map,
//! because each of these breaks seed replay under madsim. `clippy.toml` forbids the methods for clippy; this test
//! scans the source so the rule holds even where clippy is not run.

use std::fs;
use std::path::{Path, PathBuf};

/// OS threads: forbidden in library code, allowed in its unit tests (`#[cfg(test)] mod
/// tests`), which may race a primitive on real threads (`reply_cell.rs`, also under
/// Miri). Such a test runs outside the simulator, so seed replay is not at stake.
const THREADS: &[(&str, &str)] = &[
    ("std::thread", "OS threads are not simulated; use tokio::spawn"),
    ("thread::spawn", "OS threads are not simulated; use tokio::spawn"),
];

const FORBIDDEN: &[(&str, &str)] = &[
    ("SystemTime::now", "the wall clock breaks seed replay"),
    ("thread_rng", "unseeded randomness breaks seed replay"),
    ("OsRng", "unseeded randomness breaks seed replay"),
    ("Uuid::new_v4", "unseeded randomness breaks seed replay"),
    ("Utc::now", "the wall clock breaks seed replay"),
];

/// The one file allowed to read the wall clock, and how often: the runtime's `Clock`
/// reads it once when it is made, to anchor its monotonic readings (stored deadlines then
/// mean the same in every process). Under madsim that read is the simulator's seeded wall
/// clock (it replaces `clock_gettime`), so seed replay holds; the determinism sweep runs
/// every simulated test twice per seed and compares.
const WALL_CLOCK_READER: (&str, usize) = ("crates/troupe-runtime/src/clock.rs", 1);

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Library sources: `src/` of every crate and of the facade. Binaries, tests and
/// benches may use threads and wall clocks.
fn library_sources() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    for entry in fs::read_dir(root.join("crates")).unwrap().flatten() {
        if entry.file_name() == "troupe-cli" {
            continue;
        }
        rust_files(&entry.path().join("src"), &mut files);
    }
    assert!(
        files.len() >= 10,
        "found only {} library files; is the layout right?",
        files.len()
    );
    files
}

fn code_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines().enumerate().filter(|(_, line)| {
        let trimmed = line.trim_start();
        !(trimmed.starts_with("//") || trimmed.starts_with("///") || trimmed.starts_with("//!"))
    })
}

/// The (0-based) numbers of the lines of `text` inside a unit test module: from a
/// `#[cfg(test)]` line followed by `mod tests {` to the brace that closes it.
fn unit_test_lines(text: &str) -> std::ops::Range<usize> {
    let lines: Vec<&str> = text.lines().collect();
    for (number, pair) in lines.windows(2).enumerate() {
        if pair[0].trim() == "#[cfg(test)]" && pair[1].trim() == "mod tests {" {
            let mut depth = 0_i64;
            for (offset, line) in lines[number + 1..].iter().enumerate() {
                if line.trim_start().starts_with("//") {
                    continue;
                }
                depth += line.matches('{').count() as i64 - line.matches('}').count() as i64;
                if depth == 0 {
                    return number..number + 1 + offset + 1;
                }
            }
            return number..lines.len();
        }
    }
    0..0
}

/// Goal: the unit test module's exemption covers that module's lines and no others.
#[test]
fn only_a_unit_test_module_is_exempt_from_the_thread_rule() {
    let text = "fn a() {}\n#[cfg(test)]\nmod tests {\n    fn t() {\n        x();\n    }\n}\nfn after() {}\n";
    assert_eq!(unit_test_lines(text), 1..7);
    assert_eq!(unit_test_lines("#[cfg(test)]\nfn not_a_module() {}\n"), 0..0);
}

#[test]
fn library_code_has_no_wall_clock_threads_or_unseeded_randomness() {
    let mut violations = Vec::new();
    let mut wall_clock_reads = 0;
    for file in library_sources() {
        let text = fs::read_to_string(&file).unwrap();
        let unit_tests = unit_test_lines(&text);
        let wall_clock_reader = file.ends_with(WALL_CLOCK_READER.0);
        for (number, line) in code_lines(&text) {
            let threads: &[(&str, &str)] = if unit_tests.contains(&number) { &[] } else { THREADS };
            for (pattern, reason) in FORBIDDEN.iter().chain(threads) {
                if wall_clock_reader && *pattern == "SystemTime::now" && line.contains(pattern) {
                    wall_clock_reads += 1;
                    continue;
                }
                if line.contains(pattern) {
                    violations.push(format!("{}:{}: {pattern}: {reason}", file.display(), number + 1));
                }
            }
            // `tokio::time::Instant::now` is virtual under madsim; `std`'s is not.
            if line.contains("Instant::now") && !line.contains("tokio::time::Instant::now") {
                violations.push(format!(
                    "{}:{}: Instant::now outside tokio::time",
                    file.display(),
                    number + 1
                ));
            }
        }
    }
    assert!(
        violations.is_empty(),
        "nondeterminism in library code:\n{}",
        violations.join("\n")
    );
    assert_eq!(
        wall_clock_reads, WALL_CLOCK_READER.1,
        "{} reads the wall clock exactly once (the clock's anchor)",
        WALL_CLOCK_READER.0
    );
}

/// Test sources: `tests/` of the facade and of every crate. Simulated tests live there
/// too, and an unbiased `select!` draws its first branch from tokio's thread-local
/// generator, which outlives a run in a process.
fn test_sources() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("tests"), &mut files);
    for entry in fs::read_dir(root.join("crates")).unwrap().flatten() {
        rust_files(&entry.path().join("tests"), &mut files);
    }
    files
}

#[test]
fn every_select_in_library_and_test_code_is_biased() {
    let mut violations = Vec::new();
    let this_file = Path::new(file!()).file_name().expect("a file name");
    for file in library_sources().into_iter().chain(test_sources()) {
        // This guard names `select!` in its own checks.
        if file.file_name() == Some(this_file) {
            continue;
        }
        let text = fs::read_to_string(&file).unwrap();
        let lines: Vec<(usize, &str)> = code_lines(&text).collect();
        for (index, (number, line)) in lines.iter().enumerate() {
            if line.contains("select!") {
                let next = lines.get(index + 1).map(|(_, l)| l.trim()).unwrap_or("");
                if next != "biased;" {
                    violations.push(format!("{}:{}", file.display(), number + 1));
                }
            }
        }
    }
    assert!(
        violations.is_empty(),
        "select! without `biased;` as its first line:\n{}",
        violations.join("\n")
    );
}

/// The code lines of simulated library code (all but `troupe-server`, which is empty
/// under the simulator, and the files ending in one of `skipped`) that `forbidden`
/// matches, as `file:line: code`.
fn simulated_library_lines(skipped: &[PathBuf], forbidden: impl Fn(&str) -> bool) -> Vec<String> {
    let server = Path::new("crates").join("troupe-server").join("src");
    let mut violations = Vec::new();
    for file in library_sources() {
        if file.starts_with(Path::new(env!("CARGO_MANIFEST_DIR")).join(&server))
            || skipped.iter().any(|skip| file.ends_with(skip))
        {
            continue;
        }
        let text = fs::read_to_string(&file).unwrap();
        for (number, line) in code_lines(&text) {
            if forbidden(line) {
                violations.push(format!("{}:{}: {}", file.display(), number + 1, line.trim()));
            }
        }
    }
    violations
}

/// A tokio `watch` receiver waits on one of eight `Notify`s picked by tokio's
/// thread-local random generator, which madsim does not reset between two runs of a
/// seed in one process: several waiters are woken in another order (the organisation's
/// approvals diverged so until 2026-11-28). `troupe-server` is empty under the simulator
/// (its `lib.rs`), so it may use them.
#[test]
fn no_watch_channel_in_simulated_library_code() {
    let violations = simulated_library_lines(&[], |line| line.contains("watch::"));
    assert!(
        violations.is_empty(),
        "tokio watch channels in simulated library code (use tokio::sync::Notify or troupe_runtime::Latch):\n{}",
        violations.join("\n")
    );
}

/// A std `HashMap` or `HashSet` hashes with keys drawn once per thread and stepped for
/// every new map, so two runs of a seed in one process (madsim's determinism check) see
/// other keys and, where a map is iterated, another order (a cluster node's fenced-off
/// deactivations were spawned so until 2026-11-28). Simulated library code uses
/// unkeyed FxHash maps (`fast_hash.rs`, `rustc_hash`) or ordered ones; `troupe-server`
/// is empty under the simulator.
#[test]
fn no_randomly_keyed_hash_map_in_simulated_library_code() {
    // `fast_hash.rs` builds the unkeyed maps on std's.
    let fast_hash = Path::new("troupe-runtime").join("src").join("fast_hash.rs");
    // `use std::collections::{HashMap, ..}` or a qualified path: the import or the use
    // names the std module (a map through `FastMap` or `FxHashMap` does not).
    let violations = simulated_library_lines(&[fast_hash], |line| {
        line.contains("collections::") && (line.contains("HashMap") || line.contains("HashSet"))
    });
    assert!(
        violations.is_empty(),
        "std hash maps (randomly keyed) in simulated library code (use FastMap/FastSet, rustc_hash::FxHashMap or a BTreeMap):\n{}",
        violations.join("\n")
    );
}

#[test]
fn the_guard_recognises_a_violation() {
    let sample = "fn f() {\n    let t = std::time::Instant::now();\n}\n";
    let hits = code_lines(sample)
        .filter(|(_, l)| l.contains("Instant::now") && !l.contains("tokio::time::Instant::now"))
        .count();
    assert_eq!(hits, 1);
    let comment = "// std::thread::spawn in a comment is fine\n";
    assert_eq!(code_lines(comment).count(), 0);
}
