//! The guard that makes a DST test fail loudly when the simulator is not active.

/// The message of the panic raised by [`require_simulator`] outside madsim.
pub const SIMULATOR_REQUIRED: &str = "troupe-sim: this test must run under the madsim simulator \
     (build with RUSTFLAGS=\"--cfg madsim\" and CARGO_TARGET_DIR=target/madsim, or use scripts/dst); \
     refusing to pass on real tokio with wall-clock time";

/// Panics unless this build runs under madsim (`--cfg madsim`) and a simulated runtime
/// is current.
///
/// # Panics
/// Always outside `--cfg madsim`, with [`SIMULATOR_REQUIRED`]; under madsim when called
/// outside a simulated runtime.
pub fn require_simulator() {
    #[cfg(not(madsim))]
    panic!("{SIMULATOR_REQUIRED}");
    #[cfg(madsim)]
    assert!(
        madsim::runtime::Handle::try_current().is_ok(),
        "troupe-sim: no simulated runtime is current; run the scenario inside #[madsim::test]"
    );
}
