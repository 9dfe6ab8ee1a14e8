//! Replay: the one command that reproduces a failing seed, printed on every failure.

use std::cell::RefCell;
use std::sync::Once;

/// Where a scenario lives: its test target (a file `tests/<test>.rs` of the `troupe`
/// package) and its test function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scenario {
    /// The test target, e.g. `dst_crash`.
    pub test: &'static str,
    /// The test function, e.g. `crash_during_call_loses_nothing_acknowledged`.
    pub name: &'static str,
}

/// The command that replays `scenario` with `seed`.
pub fn replay_command(scenario: Scenario, seed: u64) -> String {
    format!(
        "MADSIM_TEST_SEED={seed} bash scripts/dst --replay {}::{}",
        scenario.test, scenario.name
    )
}

/// The raw cargo command the script runs for a replay.
pub fn replay_cargo_command(scenario: Scenario, seed: u64) -> String {
    format!(
        "MADSIM_TEST_SEED={seed} CARGO_TARGET_DIR=target/madsim RUSTFLAGS=\"--cfg madsim\" \
         cargo test -p troupe --test {} -- --exact {} --nocapture",
        scenario.test, scenario.name
    )
}

/// What the panic hook prints about the run on this thread.
#[cfg_attr(not(madsim), allow(dead_code))]
pub(crate) struct Running {
    pub(crate) scenario: Scenario,
    pub(crate) seed: u64,
    pub(crate) describe: Box<dyn Fn() -> String>,
}

thread_local! {
    static RUNNING: RefCell<Option<Running>> = const { RefCell::new(None) };
}

#[cfg_attr(not(madsim), allow(dead_code))]
static HOOK: Once = Once::new();

/// Installs (once per process) a panic hook that prints the replay command of the
/// scenario running on the panicking thread, then registers this run. madsim runs
/// every seed on its own thread, and every task of a seed on that thread.
#[cfg_attr(not(madsim), allow(dead_code))]
pub(crate) fn register(running: Running) {
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            previous(info);
            RUNNING.with(|slot| {
                if let Ok(slot) = slot.try_borrow() {
                    if let Some(running) = slot.as_ref() {
                        eprintln!(
                            "\n=== troupe DST failure: scenario {}::{} seed {} ===\n{}\nreplay: {}\n   (raw: {})\n",
                            running.scenario.test,
                            running.scenario.name,
                            running.seed,
                            (running.describe)(),
                            replay_command(running.scenario, running.seed),
                            replay_cargo_command(running.scenario, running.seed),
                        );
                    }
                }
            });
        }));
    });
    RUNNING.with(|slot| *slot.borrow_mut() = Some(running));
}

/// Forgets the run on this thread (it finished).
#[cfg_attr(not(madsim), allow(dead_code))]
pub(crate) fn unregister() {
    RUNNING.with(|slot| *slot.borrow_mut() = None);
}
