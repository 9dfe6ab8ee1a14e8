//! The `troupe` binary's command line, run as a user runs it: every command answers
//! `--help`, and an unknown flag fails with exit code 2 and an error that names it.

use std::process::{Command, Output};

fn troupe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_troupe"))
        .args(args)
        .output()
        .expect("run the troupe binary")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Goal: `--help` works for the program and for every command. Method: run each and
/// check the exit code and that the usage and the command's options are printed.
#[test]
fn help_is_printed_for_the_program_and_every_command() {
    let program = troupe(&["--help"]);
    assert!(program.status.success(), "{program:?}");
    let stdout = text(&program.stdout);
    assert!(
        stdout.starts_with("troupe: a virtual-actor runtime for AI agents"),
        "{stdout}"
    );
    assert!(stdout.contains("Usage: troupe"), "{stdout}");
    assert!(stdout.contains("demo"), "{stdout}");

    let demo = troupe(&["demo", "--help"]);
    assert!(demo.status.success(), "{demo:?}");
    let stdout = text(&demo.stdout);
    assert!(stdout.contains("--data-dir <DIR>"), "{stdout}");
    assert!(stdout.contains("--scripted"), "{stdout}");
}

/// Goal: a typo in a flag is refused clearly, not ignored. Method: pass `--bogus` and
/// check exit code 2 and an error naming the flag.
#[test]
fn an_unknown_flag_fails_with_an_error_naming_it() {
    let output = troupe(&["demo", "--bogus"]);
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    let stderr = text(&output.stderr);
    assert!(stderr.contains("error: unexpected argument '--bogus'"), "{stderr}");
    assert!(output.stdout.is_empty(), "{output:?}");
}

/// Goal: the version flag reports the package version.
#[test]
fn version_is_the_package_version() {
    let output = troupe(&["--version"]);
    assert!(output.status.success(), "{output:?}");
    assert_eq!(
        text(&output.stdout).trim(),
        format!("troupe {}", env!("CARGO_PKG_VERSION"))
    );
}

fn example_config() -> String {
    format!("{}/../../examples/org.toml", env!("CARGO_MANIFEST_DIR"))
}

/// Goal: `troupe demo --config examples/org.toml` runs the example organisation and
/// prints who talked to whom, the forbidden pair refused. Method: run the binary as a
/// user does and read its output.
#[test]
fn demo_with_the_example_config_prints_who_talked_to_whom_and_the_refused_pair() {
    let output = troupe(&["demo", "--scripted", "--config", &example_config()]);
    assert!(output.status.success(), "{output:?}");
    let stdout = text(&output.stdout);
    assert!(
        stdout.contains("4 agents, 4 links, 1 permission rules, policy Enforced"),
        "{stdout}"
    );
    assert!(stdout.contains("  lead -> ana  ok\n"), "{stdout}");
    assert!(stdout.contains("  ana -> lead  ok\n"), "{stdout}");
    assert!(
        stdout.contains("  ben -> pia  not permitted: a permission rule denies it (explicit deny)\n"),
        "{stdout}"
    );
    assert!(stdout.contains("contacts: 11 ok, 1 not permitted, 0 other"), "{stdout}");
}

/// Goal: a broken config file is refused with the file, line, column and field, and
/// exit code 1. Method: a link to an undeclared agent.
#[test]
fn a_broken_config_is_refused_naming_the_file_line_and_field() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("org.toml");
    std::fs::write(
        &path,
        "[[agents]]\nid = \"a\"\n\n[[links]]\nfrom = \"a\"\nto = \"zed\"\n",
    )
    .unwrap();
    let output = troupe(&["demo", "--scripted", "--config", path.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    let stderr = text(&output.stderr);
    assert!(
        stderr.contains(&format!(
            "{}:6:6: field `links[0].to`: \"zed\" is not a declared agent",
            path.display()
        )),
        "{stderr}"
    );
}
