//! The simulator guard: a DST scenario can never pass on real tokio.
//!
//! In the normal build the DST files compile to nothing (`#![cfg(madsim)]`), so this
//! file proves the guard itself: outside madsim, `require_simulator` panics with a
//! message that says how to run the suite. Under madsim, the guard lets a simulated
//! test through and `cfg!(madsim)` holds.

#[cfg(not(madsim))]
#[test]
#[should_panic(expected = "must run under the madsim simulator")]
fn a_dst_scenario_outside_the_simulator_fails_loudly() {
    troupe_sim::require_simulator();
}

#[cfg(madsim)]
#[madsim::test]
async fn the_simulator_is_active_in_the_dst_build() {
    const _: () = assert!(cfg!(madsim), "the DST build must set --cfg madsim");
    troupe_sim::require_simulator();
    // madsim's handle exists only inside the simulator; its clock is virtual, so an
    // minute of sleep costs no wall time (the whole test takes milliseconds).
    assert!(madsim::runtime::Handle::try_current().is_ok());
    let before = tokio::time::Instant::now();
    tokio::time::sleep(std::time::Duration::from_secs(60)).await;
    assert!(before.elapsed() >= std::time::Duration::from_secs(60));
}
