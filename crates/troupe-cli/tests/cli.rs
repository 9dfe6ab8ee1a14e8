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
