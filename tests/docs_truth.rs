//! The docs' truth guard: every test and file the docs name as evidence exists.
//!
//! docs/status.md is the table of what is done: each row's claim is shown by the tests its
//! tests column names. Tests get renamed and files move; a row naming a test that no
//! longer exists is a claim no test shows. This test reads the docs' TEXT (as
//! `determinism_guard.rs` reads the source) and reports every miss at once, one line each,
//! with the doc, the line number, the name and what to do.
//!
//! # What is checked in docs/status.md
//!
//! Only table rows (lines starting with `|`, not the header row before a `|---` line nor
//! the separator), and in them only the TESTS columns: every cell after the first (the
//! claim) and before the last (the builds); a row with more than three cells has its
//! tests split over several cells. The claim column names API items, fields, metrics and
//! error codes (`define_agent`, `told_lost`, `route_not_found`), which are not tests, so
//! it is not read for names. In those cells each backticked span is:
//!
//! - a **test name** when it is snake_case (`a-z`, `0-9`, `_`, starting with a letter)
//!   with at least two underscores (three words: `keyed_retries`, `ask_as` are fields and
//!   API names, not tests). It is found when `fn NAME` (the word `fn`, then the name, then
//!   a character that cannot continue an identifier) occurs in some `.rs` file under
//!   `crates/`, `tests/`, `benches/`, `examples/` or `src/`: a `#[test]`,
//!   `#[tokio::test]` or `#[madsim::test]` function, or a helper or proptest body a test
//!   runs; comments are not told apart from code. Shorthands the table uses:
//!   - `{a,b}` names one test per alternative (`..._in_{memory,sqlite}_store`), each
//!     checked;
//!   - a trailing `*`, `...` or `…` names the tests starting with what precedes it: at
//!     least one must exist;
//!   - a leading `...`, `…` or `_` names a variant of the row's previous name `P`
//!     (`..._on_the_multi_thread_runtime`): some `fn` must end with the rest, the part
//!     of its name before that being a non-empty prefix of `P`.
//! - a Rust path `a::b::name` (`conversation::tests::a_test`, `Turn::a_method`) is read
//!   as its last segment `name`, checked as above when it is a test name;
//! - a **path** when it ends in `.rs`, `.md`, `.py`, `.tla`, `.cfg` or `.sh` and either
//!   contains `/` or is a bare file name, or starts with `scripts/`. It is found as in
//!   "Paths" below.
//!
//! Anything else (types, constants, commands, one-word or two-word names) is not checked.
//!
//! # Paths, in docs/status.md's tests columns and anywhere in README.md and docs/*.md
//!
//! In README.md and docs/*.md (status.md included: its prose too), a backticked span
//! outside fenced code blocks whose first word starts with `crates/`, `tests/`, `docs/`,
//! `scripts/`, `examples/`, `benches/` or `.ci/` is a repository path. Before the lookup
//! a `#anchor`, a `::item` and a `:LINE` are cut off; a span with `<`, `>` or `...` (a
//! placeholder such as `tests/<file>.rs`) is skipped; `{a,b}` expands to one path per
//! alternative; `*` matches any characters but `/` and must match at least one file.
//! A path starting with `crates/`, `docs/`, `scripts/`, `examples/`, `benches/` or `.ci/`
//! must exist from the repository root. Any other path (`tests/reply_wait.rs` under a
//! crate's section, `src/sqlite_store.rs`, a bare `clock.rs`) is also found when some
//! repository file's path ends with `/` and it: the docs name a crate's test files
//! relative to the crate their section is about. The repository's files are those on
//! disk under its root, `target/` and `.git/` (at any depth) left out.
//!
//! # What is not checked
//!
//! That a named test sits in the file named beside it, that it is a test rather than a
//! helper, that it is not `#[ignore]`d, and the builds column: these need a Rust parser
//! and the test list of both builds, which this text check does not have. Test names
//! outside status.md's tables (its prose, README.md, the other docs) are not checked:
//! there they sit beside metric and option names of the same shape
//! (`troupe_runtime_told_lost_total`); a one-off scan of every backticked snake_case span
//! with four or more underscores there (2026-12-07) found no stale test name.
//!
//! The whole check walks about 550 files and takes about 0.2 s.

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;

/// Extensions that make a backticked span in status.md's tests columns a path.
const PATH_EXTENSIONS: &[&str] = &[".rs", ".md", ".py", ".tla", ".cfg", ".sh"];

/// Top-level directories whose paths the docs give from the repository root.
const ROOT_ANCHORED_PREFIXES: &[&str] = &["crates/", "docs/", "scripts/", "examples/", "benches/", ".ci/"];

/// First words of a backticked span that make it a repository path in README.md and
/// docs/*.md.
const DOC_PATH_PREFIXES: &[&str] = &[
    "crates/",
    "tests/",
    "docs/",
    "scripts/",
    "examples/",
    "benches/",
    ".ci/",
];

/// Directories whose `.rs` files are searched for `fn NAME`.
const SOURCE_DIRS: &[&str] = &["crates", "tests", "benches", "examples", "src"];

/// Directories never walked, at any depth: build output and git's own store.
const SKIPPED_DIRS: &[&str] = &["target", ".git"];

/// Fewest underscores a snake_case span needs to be taken for a test name.
const TEST_NAME_UNDERSCORES_MIN: usize = 2;

/// Fewest test names status.md's tables must yield: fewer means the parser broke.
const STATUS_TEST_NAMES_MIN: usize = 200;

/// Fewest repository paths README.md and docs/*.md must yield: fewer means the parser
/// broke.
const DOC_PATHS_MIN: usize = 300;

/// The repository: its files (paths relative to the root, `/`-separated) and the names
/// of every `fn` in its Rust sources.
struct Repository {
    files: BTreeSet<String>,
    functions: BTreeSet<String>,
}

impl Repository {
    fn read(root: &Path) -> Repository {
        let mut files = BTreeSet::new();
        walk(root, "", &mut files);
        let mut functions = BTreeSet::new();
        for file in &files {
            let in_sources = SOURCE_DIRS.iter().any(|dir| file.starts_with(&format!("{dir}/")));
            if in_sources && file.ends_with(".rs") {
                let text = fs::read_to_string(root.join(file)).unwrap_or_default();
                functions.extend(function_names(&text));
            }
        }
        Repository { files, functions }
    }

    /// Whether a test-name span (see the module doc) names existing functions; `previous`
    /// is the row's previous name, for a leading `...`/`…`/`_`.
    fn names_functions(&self, span: &str, previous: Option<&str>) -> bool {
        if let Some(suffix) = leading_variant(span) {
            let Some(previous) = previous else { return false };
            return self.functions.iter().any(|function| {
                function
                    .strip_suffix(suffix)
                    .is_some_and(|head| !head.is_empty() && previous.starts_with(head))
            });
        }
        let (core, prefix_only) = match trailing_wildcard(span) {
            Some(core) => (core, true),
            None => (span, false),
        };
        expand_braces(core).iter().all(|name| {
            if prefix_only {
                self.functions
                    .range(name.clone()..)
                    .next()
                    .is_some_and(|f| f.starts_with(name.as_str()))
            } else {
                self.functions.contains(name)
            }
        })
    }

    /// Whether a path (see the module doc) names at least one repository file or
    /// directory.
    fn has_path(&self, root: &Path, path: &str) -> bool {
        let path = strip_reference_tail(path);
        expand_braces(path).iter().all(|path| {
            let anchored = ROOT_ANCHORED_PREFIXES.iter().any(|prefix| path.starts_with(prefix));
            let pattern = path.trim_end_matches('/');
            if !pattern.contains('*') && root.join(pattern).exists() {
                return true;
            }
            // Every file, and every directory holding one.
            self.files.iter().any(|file| {
                std::iter::once(file.as_str()).chain(ancestors(file)).any(|candidate| {
                    if anchored {
                        wildcard_match(pattern, candidate)
                    } else {
                        suffixes(candidate).any(|tail| wildcard_match(pattern, tail))
                    }
                })
            })
        })
    }
}

fn walk(root: &Path, relative: &str, out: &mut BTreeSet<String>) {
    let Ok(entries) = fs::read_dir(root.join(relative)) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = if relative.is_empty() {
            name.clone()
        } else {
            format!("{relative}/{name}")
        };
        let Ok(kind) = entry.file_type() else { continue };
        if kind.is_dir() {
            if !SKIPPED_DIRS.contains(&name.as_str()) {
                walk(root, &path, out);
            }
        } else {
            out.insert(path);
        }
    }
}

fn is_identifier_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The names after every `fn` word in `text`.
fn function_names(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = text;
    let mut before: Option<char> = None;
    while let Some(at) = rest.find("fn ") {
        let preceding = rest[..at].chars().next_back().or(before);
        let after = &rest[at + 3..];
        if !preceding.is_some_and(is_identifier_char) {
            let name: String = after
                .trim_start()
                .chars()
                .take_while(|&c| is_identifier_char(c))
                .collect();
            if !name.is_empty() {
                names.push(name);
            }
        }
        before = Some(' ');
        rest = after;
    }
    names
}

/// `tail` when `span` is `...tail`, `…tail` or `_tail` (a variant of the previous name).
fn leading_variant(span: &str) -> Option<&str> {
    if let Some(tail) = span.strip_prefix("...").or_else(|| span.strip_prefix('…')) {
        return Some(tail);
    }
    span.starts_with('_').then_some(span)
}

/// The part before a trailing `*`, `...` or `…`.
fn trailing_wildcard(span: &str) -> Option<&str> {
    span.strip_suffix('*')
        .or_else(|| span.strip_suffix("..."))
        .or_else(|| span.strip_suffix('…'))
}

/// `name` of a Rust path `a::b::name` (`conversation::tests::a_test`); any other span as
/// it is.
fn last_path_segment(span: &str) -> &str {
    let segments: Vec<&str> = span.split("::").collect();
    let is_rust_path = segments.len() > 1
        && segments
            .iter()
            .all(|segment| !segment.is_empty() && segment.chars().all(is_identifier_char));
    if is_rust_path {
        segments[segments.len() - 1]
    } else {
        span
    }
}

/// Whether a backticked span in a tests column is taken for a test name.
fn is_test_name(span: &str) -> bool {
    let core = leading_variant(span).unwrap_or(span);
    let core = trailing_wildcard(core).unwrap_or(core);
    let starts_well = leading_variant(span).is_some() || core.starts_with(|c: char| c.is_ascii_lowercase());
    starts_well
        && !core.is_empty()
        && core
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "_{},".contains(c))
        && span.matches('_').count() >= TEST_NAME_UNDERSCORES_MIN
}

/// Whether a backticked span in a tests column is taken for a path.
fn is_status_path(span: &str) -> bool {
    let path = strip_reference_tail(span);
    if path.contains(char::is_whitespace) {
        return false;
    }
    let has_extension = PATH_EXTENSIONS.iter().any(|extension| path.ends_with(extension));
    (has_extension && (path.contains('/') || path.chars().all(|c| is_identifier_char(c) || ".-".contains(c))))
        || path.starts_with("scripts/")
}

/// A path with a `#anchor`, `::item` or `:LINE` cut off.
fn strip_reference_tail(path: &str) -> &str {
    let path = path.split('#').next().unwrap_or(path);
    let path = path.split("::").next().unwrap_or(path);
    match path.rsplit_once(':') {
        Some((head, line)) if !line.is_empty() && line.chars().all(|c| c.is_ascii_digit()) => head,
        _ => path,
    }
}

/// `a{b,c}d` → `abd`, `acd` (one brace group, the only form the docs use; nested or
/// several groups expand left to right).
fn expand_braces(text: &str) -> Vec<String> {
    let (Some(open), Some(close)) = (text.find('{'), text.find('}')) else {
        return vec![text.to_owned()];
    };
    if close < open {
        return vec![text.to_owned()];
    }
    let (head, tail) = (&text[..open], &text[close + 1..]);
    text[open + 1..close]
        .split(',')
        .flat_map(|choice| expand_braces(&format!("{head}{choice}{tail}")))
        .collect()
}

/// `pattern` against `text`, where `*` matches any run of characters but `/`.
fn wildcard_match(pattern: &str, text: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == text,
        Some((head, tail)) => {
            let Some(rest) = text.strip_prefix(head) else {
                return false;
            };
            let run_end = rest.find('/').unwrap_or(rest.len());
            (0..=run_end).any(|taken| wildcard_match(tail, &rest[taken..]))
        }
    }
}

/// `file` and each of its ends that starts after a `/`.
fn suffixes(file: &str) -> impl Iterator<Item = &str> {
    std::iter::once(file).chain(file.match_indices('/').map(move |(at, _)| &file[at + 1..]))
}

/// The directories holding `file`: `a/b/c.rs` → `a/b`, `a`.
fn ancestors(file: &str) -> impl Iterator<Item = &str> {
    file.rmatch_indices('/').map(move |(at, _)| &file[..at])
}

/// The backticked spans of `text` with the 1-based line each starts on, fenced code
/// blocks left out; a span may wrap onto the next line.
fn code_spans(text: &str) -> Vec<(usize, String)> {
    let mut spans = Vec::new();
    let mut open: Option<(usize, String)> = None;
    let mut fenced = false;
    for (index, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            open = None;
            continue;
        }
        if fenced {
            continue;
        }
        for (part_index, part) in line.split('`').enumerate() {
            if part_index > 0 {
                match open.take() {
                    Some(span) => spans.push(span),
                    None => open = Some((index + 1, String::new())),
                }
            }
            if let Some((_, span)) = open.as_mut() {
                if part_index == 0 && !span.is_empty() {
                    span.push(' ');
                }
                span.push_str(part);
            }
        }
        if line.is_empty() {
            open = None;
        }
    }
    spans
}

/// The cells of a table row, split at `|` not written `\|`.
fn row_cells(line: &str) -> Vec<&str> {
    let line = line.trim();
    let mut cells = Vec::new();
    let mut start = 0;
    let mut escaped = false;
    for (at, c) in line.char_indices() {
        if c == '|' && !escaped {
            cells.push(&line[start..at]);
            start = at + 1;
        }
        escaped = c == '\\' && !escaped;
    }
    cells.push(&line[start..]);
    // The text before the first `|` and after the last one are not cells.
    cells[1..cells.len() - 1].to_vec()
}

/// One reference the docs make that the repository does not hold.
struct Miss {
    doc: String,
    line: usize,
    what: String,
    advice: &'static str,
}

impl std::fmt::Display for Miss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}: {}: {}", self.doc, self.line, self.what, self.advice)
    }
}

const TEST_ADVICE: &str = "no `fn` has this name: rename the reference or restore the test";
const PATH_ADVICE: &str = "no such file: fix the path or restore the file";

/// The misses of status.md's tests columns, and how many test names were checked.
fn status_misses(root: &Path, repository: &Repository, doc: &str, text: &str) -> (Vec<Miss>, usize) {
    let lines: Vec<&str> = text.lines().collect();
    let mut misses = Vec::new();
    let mut names_checked = 0;
    for (index, line) in lines.iter().enumerate() {
        let is_row = line.starts_with('|') && !line.starts_with("|---");
        let is_header = lines.get(index + 1).is_some_and(|next| next.starts_with("|---"));
        if !is_row || is_header {
            continue;
        }
        let cells = row_cells(line);
        if cells.len() < 3 {
            continue;
        }
        let mut previous: Option<String> = None;
        for cell in &cells[1..cells.len() - 1] {
            for written in cell.split('`').skip(1).step_by(2) {
                let span = last_path_segment(written);
                let miss = |what: String, advice| Miss {
                    doc: doc.to_owned(),
                    line: index + 1,
                    what,
                    advice,
                };
                if is_test_name(span) {
                    names_checked += 1;
                    if !repository.names_functions(span, previous.as_deref()) {
                        let what = match (leading_variant(span), &previous) {
                            (Some(_), Some(previous)) => format!("test `{span}` (a variant of `{previous}`)"),
                            (Some(_), None) => format!("test `{span}` (a variant, but no name before it in the row)"),
                            (None, _) => format!("test `{span}`"),
                        };
                        misses.push(miss(what, TEST_ADVICE));
                    }
                    if leading_variant(span).is_none() {
                        previous = Some(trailing_wildcard(span).unwrap_or(span).to_owned());
                    }
                } else if is_status_path(span) && !repository.has_path(root, span) {
                    misses.push(miss(format!("path `{span}`"), PATH_ADVICE));
                }
            }
        }
    }
    (misses, names_checked)
}

/// The misses among the repository paths a doc names anywhere outside fenced code, and
/// how many paths were checked.
fn path_misses(root: &Path, repository: &Repository, doc: &str, text: &str) -> (Vec<Miss>, usize) {
    let mut misses = Vec::new();
    let mut paths_checked = 0;
    for (line, span) in code_spans(text) {
        let Some(first_word) = span.split_whitespace().next() else {
            continue;
        };
        let is_path = DOC_PATH_PREFIXES.iter().any(|prefix| first_word.starts_with(prefix));
        if !is_path || first_word.contains(['<', '>']) || first_word.contains("...") {
            continue;
        }
        paths_checked += 1;
        if !repository.has_path(root, first_word) {
            misses.push(Miss {
                doc: doc.to_owned(),
                line,
                what: format!("path `{first_word}`"),
                advice: PATH_ADVICE,
            });
        }
    }
    (misses, paths_checked)
}

fn markdown_docs(root: &Path) -> Vec<String> {
    let mut docs = vec!["README.md".to_owned()];
    let mut in_docs: Vec<String> = fs::read_dir(root.join("docs"))
        .expect("docs/ is readable")
        .flatten()
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".md"))
        .map(|name| format!("docs/{name}"))
        .collect();
    in_docs.sort();
    docs.extend(in_docs);
    docs
}

#[test]
fn every_test_and_path_the_docs_name_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let repository = Repository::read(root);
    assert!(
        repository.functions.len() > 1000,
        "found only {} functions; is the layout right?",
        repository.functions.len()
    );
    let status = fs::read_to_string(root.join("docs/status.md")).expect("docs/status.md is readable");
    let (mut misses, names_checked) = status_misses(root, &repository, "docs/status.md", &status);
    assert!(
        names_checked >= STATUS_TEST_NAMES_MIN,
        "read only {names_checked} test names in docs/status.md's tables (at least {STATUS_TEST_NAMES_MIN} expected); \
         has the table's layout changed? Update status_misses"
    );
    let mut paths_checked = 0;
    for doc in markdown_docs(root) {
        let text = fs::read_to_string(root.join(&doc)).unwrap_or_else(|error| panic!("{doc}: {error}"));
        let (doc_misses, checked) = path_misses(root, &repository, &doc, &text);
        misses.extend(doc_misses);
        paths_checked += checked;
    }
    assert!(
        paths_checked >= DOC_PATHS_MIN,
        "read only {paths_checked} repository paths in README.md and docs/*.md (at least {DOC_PATHS_MIN} expected); \
         has the docs' layout changed? Update path_misses"
    );
    let report: Vec<String> = misses.iter().map(Miss::to_string).collect();
    assert!(
        report.is_empty(),
        "{} reference(s) in the docs name no test or file of the repository:\n{}",
        report.len(),
        report.join("\n")
    );
}

#[test]
fn the_shorthands_of_the_status_table_are_read_as_documented() {
    let repository = Repository {
        files: ["crates/a/tests/x_probe.rs", "crates/a/src/lib.rs", "tests/root.rs"]
            .map(str::to_owned)
            .into(),
        functions: [
            "a_thing_holds_in_memory_store",
            "a_thing_holds_in_sqlite_store",
            "a_thing_holds_paused",
            "a_thing_holds_on_the_multi_thread_runtime",
        ]
        .map(str::to_owned)
        .into(),
    };
    let names = |span, previous| repository.names_functions(span, previous);
    assert!(names("a_thing_holds_in_{memory,sqlite}_store", None));
    assert!(
        !names("a_thing_holds_in_{memory,postgres}_store", None),
        "every alternative must exist"
    );
    assert!(names("a_thing_holds_*", None));
    assert!(names("a_thing_holds_in_…", None));
    assert!(!names("a_thing_fails_*", None));
    assert!(names("..._on_the_multi_thread_runtime", Some("a_thing_holds_paused")));
    assert!(names("…_on_the_multi_thread_runtime", Some("a_thing_holds")));
    assert!(!names("..._on_the_multi_thread_runtime", Some("another_thing_holds")));
    assert!(!names("..._on_the_multi_thread_runtime", None));
    assert!(!names("a_thing_holds", None), "a whole name must match exactly");

    assert!(is_test_name("a_thing_holds"));
    assert!(!is_test_name("told_lost"), "one underscore is a field or an API name");
    assert!(!is_test_name("INVOKE_TIMEOUT_MS_MAX"));
    assert!(!is_test_name("Turn::check_fence"));
    assert!(is_status_path("clock.rs") && is_status_path("tests/x.rs") && is_status_path("scripts/dst"));
    assert!(!is_status_path("cargo test --test x.rs"));

    let root = Path::new("/nonexistent-docs-truth-root");
    assert!(
        repository.has_path(root, "tests/x_probe.rs"),
        "a crate's tests/ path is found by its end"
    );
    assert!(repository.has_path(root, "x_probe.rs") && repository.has_path(root, "a/src/lib.rs"));
    assert!(repository.has_path(root, "crates/a/tests/x_probe.rs::a_thing_holds_paused"));
    assert!(repository.has_path(root, "crates/*/tests/*.rs") && repository.has_path(root, "crates/a/"));
    assert!(repository.has_path(root, "crates/a/{src/lib,tests/x_probe}.rs"));
    assert!(!repository.has_path(root, "crates/a/{src/lib,tests/y}.rs"));
    assert!(
        !repository.has_path(root, "crates/tests/x_probe.rs"),
        "crates/ paths are read from the root"
    );
    assert!(!repository.has_path(root, "tests/y.rs"));
}

#[test]
fn code_spans_and_cells_are_split_as_markdown_writes_them() {
    let text = "a `one` and `two\nwraps` here\n```\n`fenced`\n```\n`three`";
    let spans: Vec<(usize, String)> = code_spans(text);
    assert_eq!(
        spans,
        vec![
            (1, "one".to_owned()),
            (1, "two wraps".to_owned()),
            (6, "three".to_owned())
        ]
    );
    assert_eq!(
        row_cells(r"| a \| b | `c` | both |"),
        vec![r" a \| b ", " `c` ", " both "]
    );
    assert_eq!(
        function_names("fn a_b() {}\nasync fn c_d<T>() {}\nlet fnx = 1; xfn e()"),
        vec!["a_b", "c_d"]
    );
    assert_eq!(strip_reference_tail("docs/serve.md#remote"), "docs/serve.md");
    assert_eq!(last_path_segment("conversation::tests::a_b_c"), "a_b_c");
    assert_eq!(last_path_segment("tests/x.rs::a_b_c"), "tests/x.rs::a_b_c");
    assert_eq!(
        last_path_segment("Fenced { held, current }"),
        "Fenced { held, current }"
    );
    assert_eq!(strip_reference_tail("tests/x.rs:12"), "tests/x.rs");
}
