//! The `troupe` program as a first user meets it, following README.md: the mistakes a
//! newcomer makes on the command line (an address written as a host name or a port
//! alone, a state directory that cannot be used) are refused with the flag, the value
//! and what to give instead, and the demo's summary agrees with the tree it prints.
//! Each test runs the built binary to its end; normal build only (`troupe serve` is not
//! built under madsim).
#![cfg(not(madsim))]

use std::process::{Command, Output};

mod support;

/// Runs `troupe ARGS` to its end, without the variables that would change what it does
/// (a real model, a token, a log filter from the caller's environment).
fn troupe(args: &[&str]) -> Output {
    troupe_command(args).output().expect("run the troupe binary")
}

/// `troupe ARGS`, not started, as [`troupe`] runs it.
fn troupe_command(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_troupe"));
    command
        .args(args)
        .env_remove("OPENAI_API_KEY")
        .env_remove("TROUPE_TOKEN")
        .env_remove("RUST_LOG");
    command
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The arguments `troupe node` needs besides the one under test (nothing is contacted:
/// the command line is refused first).
const NODE: [&str; 6] = [
    "node",
    "--etcd",
    "127.0.0.1:2379",
    "--postgres",
    "postgresql://troupe@127.0.0.1/troupe",
    "--listen",
];

/// Goal: an address flag (`--bind`, `--listen`, `--http`) given a host name, a port
/// alone, an address without a port or something else is refused (exit code 2) with
/// the flag, the value and what to give instead. Before 2026-12-07 each read only
/// "invalid value 'localhost:8080' for '--bind <ADDR>': invalid socket address syntax".
/// Method: run each command line and read its stderr.
#[test]
fn an_address_that_is_not_an_ip_and_a_port_is_refused_saying_what_to_give() {
    let cases: [(Vec<&str>, &str, &str); 7] = [
        (
            vec!["serve", "--bind", "localhost:8080"],
            "'localhost:8080' for '--bind <ADDR>'",
            "host names are not looked up; give an IP address and a port, such as 127.0.0.1:8080 or [::1]:8080",
        ),
        (
            vec!["serve", "--bind", "8080"],
            "'8080' for '--bind <ADDR>'",
            "a port alone is not an address; give an IP address and the port, such as 127.0.0.1:8080",
        ),
        (
            vec!["serve", "--bind", ":9090"],
            "':9090' for '--bind <ADDR>'",
            "a port alone is not an address; give an IP address and the port, such as 127.0.0.1:9090",
        ),
        (
            vec!["serve", "--bind", "127.0.0.1"],
            "'127.0.0.1' for '--bind <ADDR>'",
            "no port; give the address and a port, such as 127.0.0.1:8080",
        ),
        (
            [&NODE[..], &["::1"]].concat(),
            "'::1' for '--listen <ADDR>'",
            "read as the IPv6 address ::1, with no port; an IPv6 address and its port are written [ADDRESS]:PORT, \
             such as [::1]:8080",
        ),
        (
            [&NODE[..], &["127.0.0.1:0", "--http", "my-host:80"]].concat(),
            "'my-host:80' for '--http <ADDR>'",
            "host names are not looked up",
        ),
        (
            vec!["serve", "--bind", "127.0.0.1:99999"],
            "'127.0.0.1:99999' for '--bind <ADDR>'",
            "not an IP address and a port; give one such as 127.0.0.1:8080 or [::1]:8080 (port 0 picks a free one)",
        ),
    ];
    for (args, named, hint) in cases {
        let output = troupe(&args);
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(output.stdout.is_empty(), "{args:?}: {output:?}");
        assert!(stderr.contains(&format!("invalid value {named}")), "{args:?}: {stderr}");
        assert!(stderr.contains(hint), "{args:?}: {hint:?} not in {stderr}");
        assert!(!stderr.contains("invalid socket address syntax"), "{args:?}: {stderr}");
    }
}

/// Goal: a state directory that cannot be made, or whose `troupe.db` is not a store,
/// is refused (exit code 1) naming the flag (`--data-dir`, `--db`) and the file, and
/// saying what to do; the file found there is left as it was. Before 2026-12-07:
/// "troupe: cannot create DIR: Not a directory (os error 20)" and "troupe: cannot open
/// DIR/troupe.db: open failed: switching to WAL journal mode: file is not a database",
/// neither naming the flag nor what to do. Method: a directory under a file, and a
/// directory holding a `troupe.db` of plain text, given to `troupe demo` and `troupe
/// serve`.
#[test]
fn a_state_directory_that_cannot_be_used_is_refused_naming_the_flag_and_what_to_do() {
    let directory = tempfile::tempdir().unwrap();
    let file = directory.path().join("notes.txt");
    std::fs::write(&file, "notes").unwrap();
    let under_a_file = file.join("state");
    let under_a_file = under_a_file.to_str().unwrap();
    let holding_text = directory.path().join("state");
    std::fs::create_dir(&holding_text).unwrap();
    std::fs::write(holding_text.join("troupe.db"), "not a database").unwrap();
    let holding_text = holding_text.to_str().unwrap();

    for (command, flag) in [
        (&["demo", "--scripted"][..], "--data-dir"),
        (&["serve", "--scripted", "--bind", "127.0.0.1:0"][..], "--db"),
    ] {
        let output = troupe(&[command, &[flag, under_a_file]].concat());
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{command:?}: {stderr}");
        assert!(
            stderr.starts_with(&format!("troupe: {flag} {under_a_file}: cannot create the directory (")),
            "{stderr}"
        );
        assert!(
            stderr.contains(&format!("give {flag} a directory you can write")),
            "{stderr}"
        );

        let output = troupe(&[command, &[flag, holding_text]].concat());
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{command:?}: {stderr}");
        assert!(
            stderr.starts_with(&format!(
                "troupe: {flag} {holding_text}: cannot use {holding_text}/troupe.db as the store ("
            )),
            "{stderr}"
        );
        assert!(stderr.contains("file is not a database"), "{stderr}");
        assert!(
            stderr.contains(&format!(
                "give {flag} another directory (a new one is made), or move that file away if it is not a Troupe store"
            )),
            "{stderr}"
        );
        assert!(!text(&output.stdout).contains("listening on"), "{output:?}");
        assert_eq!(
            std::fs::read_to_string(format!("{holding_text}/troupe.db")).unwrap(),
            "not a database",
            "the file found is left as it was"
        );
    }
}

/// Goal: `troupe demo`'s summary line counts the archivist's turn that the tree above
/// it shows cut at its caller's 1.5 s timeout, as a turn rolled back. Before
/// 2026-12-07 the line read "turns rolled back: 0" under that tree (it counted only
/// failed turns). Method: run the demo as README.md's first command does (scripted) and
/// read the tree and the summary.
#[test]
fn the_demos_summary_counts_the_turn_cancelled_at_its_callers_timeout() {
    let output = troupe(&["demo", "--scripted"]);
    let stdout = text(&output.stdout);
    assert!(output.status.success(), "{output:?}");
    assert!(
        stdout.contains("  coordinator -> archivist  [depth 1]")
            && stdout.contains("timeout: invocation of agent/archivist"),
        "{stdout}"
    );
    assert!(
        stdout.contains("calls: 3 ok, 1 refused, 1 timed out, 0 failed; turns run: "),
        "{stdout}"
    );
    assert!(
        stdout.contains(", rolled back: 0 failed, 1 cancelled (their caller stopped waiting)\n"),
        "{stdout}"
    );
}

/// Goal: every flag `troupe serve --help` lists has a row in docs/serve.md's flag table,
/// where a user looks a flag up (`operator_probes.rs` checks the other way: each row is
/// a flag of `--help`). Before 2026-12-07 `--max-connections` had none. Method: read the
/// flags off `--help` (its lines `      --FLAG`) and look each up in the table.
#[test]
fn every_flag_of_serve_help_has_a_row_in_the_docs_flag_table() {
    let output = troupe(&["serve", "--help"]);
    assert!(output.status.success(), "{output:?}");
    let help = text(&output.stdout);
    let docs = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/serve.md")).unwrap();
    let table: Vec<&str> = docs
        .lines()
        .skip_while(|line| !line.starts_with("| flag | meaning |"))
        .skip(2)
        .take_while(|line| line.starts_with("| `--"))
        .collect();
    let flags: Vec<&str> = help
        .lines()
        .filter_map(|line| line.strip_prefix("      --"))
        .map(|rest| rest.split([' ', ',']).next().unwrap())
        .collect();
    assert!(flags.len() >= 10, "the flags of --help: {flags:?}\n{help}");
    for flag in flags {
        assert!(
            table
                .iter()
                .any(|row| row.starts_with(&format!("| `--{flag} ")) || row.starts_with(&format!("| `--{flag}`"))),
            "--{flag} of `troupe serve --help` has no row in docs/serve.md's flag table"
        );
    }
}

/// The longest a message to `troupe serve` may take here, in milliseconds.
const SERVE_ANSWER_WAIT_MS_MAX: u64 = 20_000;

/// Goal: what docs/serve.md says a first user gets from `troupe serve --config
/// examples/org.toml` on the scripted model: a message is read as the id of the agent to
/// call (`ana` to `lead`: lead calls ana, which answers `hello from ana`), the call under
/// the organisation's rules (`pia` to `ben`: refused by the deny rule, as the model's
/// tool result), and a text that names no agent (`hello`) answered with the refusal
/// naming it. Before 2026-12-07 the docs did not say, and "hello" (the message
/// `serve.rs` sends) got "call refused: agent agent/hello not found" unexplained. Method:
/// serve the example file on 127.0.0.1:0 and send the three messages.
#[test]
fn serve_with_a_config_on_the_scripted_model_reads_a_message_as_the_agent_to_call() {
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/org.toml");
    let mut command = troupe_command(&["serve", "--scripted", "--bind", "127.0.0.1:0", "--config", config]);
    let (mut child, stderr, _stdout, addr) = support::spawn_serving(&mut command, "troupe serve");
    let ask = |agent: &str, text: &str| {
        let body = serde_json::json!({ "text": text }).to_string();
        let path = format!("/v1/agents/{agent}/messages");
        let (status, answer) = support::http(&addr, "POST", &path, &body, SERVE_ANSWER_WAIT_MS_MAX);
        let reply: serde_json::Value = serde_json::from_str(&answer).unwrap_or_default();
        (status, reply["text"].as_str().unwrap_or(&answer).to_string())
    };
    let answers = [ask("lead", "ana"), ask("ben", "pia"), ask("lead", "hello")];
    let _ = child.kill();
    let _ = child.wait();
    let stderr = stderr.join().unwrap_or_default();
    assert_eq!(answers[0], (200, "hello from ana".to_string()), "{stderr}");
    assert_eq!(
        answers[1],
        (
            200,
            "error: call_agent failed: call not permitted: ben may not ask pia: a permission rule denies it \
             (explicit deny)"
                .to_string()
        ),
        "{stderr}"
    );
    assert_eq!(
        answers[2],
        (
            200,
            "error: call_agent failed: call refused: agent agent/hello not found".to_string()
        ),
        "{stderr}"
    );
}
