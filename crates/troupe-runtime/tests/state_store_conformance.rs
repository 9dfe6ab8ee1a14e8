//! The conformance suite for this crate's [`StateStore`] backends.
//!
//! Each check is written once against `&dyn StateStore` in `troupe_runtime::conformance`
//! (the `conformance` feature, which this crate's dev-dependency on itself turns on, so
//! that other crates' backends run the same checks) and run here for every backend by
//! [`conformance_suite!`], one test per check: adding a backend is one line at the bottom
//! of the backend list. The checks are claims about the trait's contract: loads of
//! unknown actors, atomic commits, refused commits leaving nothing behind, the three
//! kinds of state change (unchanged, set, deleted), fencing (each claim fences off the
//! commits of every older one), ordered prefix scans with paging, and isolation between
//! actors. A deterministic reference model (a `BTreeMap`) checks random sequences of
//! commits and scans. `every_case_of_the_suite_runs_here` checks that no case of
//! `conformance::CASES` is left out of the list below.
//!
//! After the shared checks come tests that only make sense for one backend: reopening a
//! SQLite file, two stores opened on one SQLite file fencing each other, and the fault
//! injection of [`MemoryStore`].
//!
//! Run with `cargo nextest run -p troupe-runtime`, and under simulation with
//! `RUSTFLAGS="--cfg madsim" cargo nextest run -p troupe-runtime`.

use std::path::PathBuf;

use troupe_runtime::conformance::{
    actor, bytes, claim, commit, delete, fenced, put, scan_keys, state_commit, strings, CASES,
};
use troupe_runtime::{Fence, MemoryStore, SqliteStore, StateStore, StoreError, StoreOperation};

// ---------------------------------------------------------------------------------------
// Backends
// ---------------------------------------------------------------------------------------

/// A directory of its own for one test (`tempfile`), removed when dropped; named after
/// the test and the process, so that a leftover one tells whose it was.
struct TestDirectory(tempfile::TempDir);

impl TestDirectory {
    fn new(test_name: &str) -> Self {
        let directory = tempfile::Builder::new()
            .prefix(&format!("troupe-conformance-{test_name}-{}-", std::process::id()))
            .tempdir()
            .expect("create the test directory");
        Self(directory)
    }

    fn file(&self) -> PathBuf {
        self.0.path().join("state.sqlite")
    }
}

/// A store under test, with whatever it needs kept alive (its directory).
struct Backend {
    store: Box<dyn StateStore>,
    _directory: Option<TestDirectory>,
}

fn memory_backend(_test_name: &str) -> Backend {
    Backend {
        store: Box::new(MemoryStore::new()),
        _directory: None,
    }
}

fn sqlite_in_memory_backend(_test_name: &str) -> Backend {
    let store = SqliteStore::open_in_memory().expect("open an in-memory sqlite store");
    Backend {
        store: Box::new(store),
        _directory: None,
    }
}

fn sqlite_file_backend(test_name: &str) -> Backend {
    let directory = TestDirectory::new(test_name);
    let store = SqliteStore::open(directory.file()).expect("open a sqlite file store");
    Backend {
        store: Box::new(store),
        _directory: Some(directory),
    }
}

/// Runs every check against the backend that `$open` builds, in a module named `$backend`.
///
/// A backend with a known bug in scans that start after a key sorting before the prefix
/// passes `pending [ignore = "why"]`: those checks are then generated with that attribute
/// (and stay visible with `--run-ignored all`). Every other backend passes no such list.
macro_rules! conformance_suite {
    ($backend:ident => $open:ident) => {
        conformance_suite!($backend => $open, pending [cfg(all())]);
    };
    ($backend:ident => $open:ident, pending $pending:tt) => {
        conformance_suite!(@suite $backend, $open, $pending, [
                load_of_an_unknown_actor_is_none,
                committed_state_and_writes_are_all_visible_after_commit,
                unchanged_state_keeps_the_previous_state,
                deleted_state_loads_and_claims_as_none_and_keeps_the_entries,
                deleting_a_state_that_was_never_set_leaves_none,
                state_set_after_a_delete_is_visible_again,
                claim_of_an_unknown_actor_issues_the_first_fence_and_no_state,
                claim_returns_the_last_committed_state,
                each_claim_issues_a_newer_fence_than_the_last,
                commit_under_an_older_fence_is_refused_and_writes_nothing,
                commit_of_an_actor_never_claimed_is_refused,
                commit_under_another_actors_fence_is_refused,
                empty_commit_under_an_older_fence_is_refused,
                fences_of_two_actors_are_independent,
                a_fence_check_answers_as_a_commit_would,
                delete_write_removes_the_key,
                writes_in_one_commit_apply_in_order,
                empty_value_is_stored_and_differs_from_an_absent_key,
                empty_commit_changes_nothing,
                oversized_value_is_refused_and_nothing_of_that_commit_is_visible,
                oversized_state_is_refused_and_nothing_of_that_commit_is_visible,
                oversized_key_is_refused_and_nothing_of_that_commit_is_visible,
                too_many_writes_are_refused_and_nothing_of_that_commit_is_visible,
                most_writes_allowed_in_one_commit_are_accepted,
                get_and_scan_refuse_an_oversized_key,
                scan_returns_only_keys_with_the_prefix_in_key_order,
                scan_with_an_empty_prefix_returns_every_key_of_the_actor,
                scan_starts_strictly_after_the_given_key,
                scan_returns_at_most_limit_entries,
                scan_pages_through_every_entry_with_after_and_limit,
                scan_returns_at_most_the_scan_limit_maximum,
                scan_does_not_leak_keys_of_an_actor_whose_id_extends_this_one,
                scan_treats_percent_and_underscore_in_the_prefix_literally,
                scan_orders_non_ascii_keys_by_their_bytes,
                keys_and_states_of_two_actors_never_mix,
            ], [
                scan_after_a_key_before_the_prefix_returns_the_prefix_from_its_start,
                random_commits_and_scans_match_a_btreemap_model,
            ]);
    };
    (@suite $backend:ident, $open:ident, $pending:tt, [$($check:ident),* $(,)?], [$($pending_check:ident),* $(,)?]) => {
        mod $backend {
            /// Every check this module runs, by name.
            #[allow(dead_code)]
            pub(super) const CHECKS: &[&str] = &[$(stringify!($check),)* $(stringify!($pending_check),)*];
            conformance_suite!(@tests $backend, $open, [cfg(all())]; $($check),*);
            conformance_suite!(@tests $backend, $open, $pending; $($pending_check),*);
        }
    };
    (@tests $backend:ident, $open:ident, $attribute:tt; $($check:ident),* $(,)?) => {
        $(
            #$attribute
            #[tokio::test]
            async fn $check() {
                let backend = super::$open(concat!(stringify!($backend), "-", stringify!($check)));
                troupe_runtime::conformance::$check(backend.store.as_ref()).await;
            }
        )*
    };
}

conformance_suite!(memory => memory_backend);
conformance_suite!(sqlite_in_memory => sqlite_in_memory_backend);
conformance_suite!(sqlite_file => sqlite_file_backend);

/// Goal: the list above leaves out no case of the shared suite (a case added to
/// `conformance::CASES` but not here would silently not run for these backends).
#[test]
fn every_case_of_the_suite_runs_here() {
    let mut listed: Vec<&str> = memory::CHECKS.to_vec();
    let mut suite: Vec<&str> = CASES.iter().map(|case| case.name).collect();
    listed.sort_unstable();
    suite.sort_unstable();
    assert_eq!(listed, suite);
}

// ---------------------------------------------------------------------------------------
// The SQLite file backend only
// ---------------------------------------------------------------------------------------

/// Goal: what a file store committed is there after every handle is dropped and the file
/// is opened again, and what was deleted stays deleted. Method: commit, drop, reopen.
#[tokio::test]
async fn sqlite_file_state_survives_reopening() {
    let directory = TestDirectory::new("sqlite_file_state_survives_reopening");
    let first = actor("agent", "a");
    let second = actor("agent", "ab");
    {
        let store = SqliteStore::open(directory.file()).expect("open a new file");
        let clone = store.clone();
        commit(&store, &first, state_commit("A", vec![put("k1", "1"), put("k2", "2")])).await;
        commit(&clone, &first, state_commit("A2", vec![delete("k1")])).await;
        commit(&clone, &second, state_commit("B", vec![put("k1", "other")])).await;
    }
    let store = SqliteStore::open(directory.file()).expect("reopen the file");
    assert_eq!(store.load(&first).await.expect("load"), Some(bytes("A2")));
    assert_eq!(store.load(&second).await.expect("load"), Some(bytes("B")));
    assert_eq!(scan_keys(&store, &first, "").await, strings(&["k2"]));
    assert_eq!(store.get(&second, "k1").await.expect("get"), Some(bytes("other")));
}

/// Goal: fencing holds between two stores opened on one file, as between two runtimes
/// or two processes: the second's claim fences off the first, whose commit is refused
/// and writes nothing, and no acknowledged update is lost. Method: two stores on one
/// file act as two activations of one counter, each adding one to the count it last
/// saw and committing under its fence, in an interleaving that loses an update without
/// fencing; the first then claims again and wins back. A third store reads the result.
#[tokio::test]
async fn sqlite_second_store_on_one_file_fences_the_first_and_no_update_is_lost() {
    let directory = TestDirectory::new("sqlite_second_store_on_one_file_fences_the_first_and_no_update_is_lost");
    let owner = actor("counter", "c");
    let first = SqliteStore::open(directory.file()).expect("open the file");
    let second = SqliteStore::open(directory.file()).expect("open the file a second time");

    let first_claim = first.claim(&owner).await.expect("claim");
    assert_eq!((first_claim.fence, first_claim.state), (Fence::FIRST, None));
    first
        .commit(&owner, first_claim.fence, state_commit("1", vec![put("by", "first")]))
        .await
        .expect("the only claim commits");

    let second_claim = second.claim(&owner).await.expect("claim");
    assert_eq!(second_claim.fence, Fence::FIRST.next());
    assert_eq!(second_claim.state, Some(bytes("1")));
    second
        .commit(&owner, second_claim.fence, state_commit("2", vec![put("by", "second")]))
        .await
        .expect("the newest claim commits");

    // The first still believes the count is 1: without the fence this would write 2
    // over 2 and lose the second's increment.
    let refused = first
        .commit(&owner, first_claim.fence, state_commit("2", vec![put("by", "first")]))
        .await;
    assert_eq!(
        refused,
        Err(fenced(&owner, first_claim.fence, Some(second_claim.fence)))
    );
    assert_eq!(second.load(&owner).await.expect("load"), Some(bytes("2")));
    assert_eq!(second.get(&owner, "by").await.expect("get"), Some(bytes("second")));

    second
        .commit(&owner, second_claim.fence, state_commit("3", vec![]))
        .await
        .expect("the newest claim commits again");
    let reclaim = first.claim(&owner).await.expect("claim again");
    assert_eq!(reclaim.fence, Fence::FIRST.next().next());
    assert_eq!(reclaim.state, Some(bytes("3")));
    first
        .commit(&owner, reclaim.fence, state_commit("4", vec![]))
        .await
        .expect("the new claim commits");
    let refused = second
        .commit(&owner, second_claim.fence, state_commit("4", vec![]))
        .await;
    assert_eq!(refused, Err(fenced(&owner, second_claim.fence, Some(reclaim.fence))));

    drop((first, second));
    let reader = SqliteStore::open(directory.file()).expect("reopen the file");
    // Four commits were acknowledged, each adding one: the count is 4.
    assert_eq!(reader.load(&owner).await.expect("load"), Some(bytes("4")));
}

// ---------------------------------------------------------------------------------------
// MemoryStore fault injection only
// ---------------------------------------------------------------------------------------

/// Goal: an injected commit failure is reported and leaves nothing behind, and only as
/// many commits fail as were asked for. Method: fail one commit, then commit again.
#[tokio::test]
async fn memory_injected_commit_failure_makes_nothing_visible_and_the_next_commit_succeeds() {
    let store = MemoryStore::new();
    let owner = actor("agent", "a");
    commit(&store, &owner, state_commit("A", vec![put("k", "1")])).await;

    let fence = claim(&store, &owner).await;
    store.faults().fail_next_commits(1);
    let error = store
        .commit(&owner, fence, state_commit("B", vec![put("k", "2"), put("new", "x")]))
        .await
        .expect_err("the injected fault fails the commit");
    assert_eq!(
        error,
        StoreError::Injected {
            operation: StoreOperation::Commit
        }
    );
    assert_eq!(store.faults().injected_count(), 1);
    assert_eq!(store.load(&owner).await.expect("load"), Some(bytes("A")));
    assert_eq!(store.get(&owner, "k").await.expect("get"), Some(bytes("1")));
    assert_eq!(store.get(&owner, "new").await.expect("get"), None);

    commit(&store, &owner, state_commit("C", vec![put("new", "y")])).await;
    assert_eq!(store.load(&owner).await.expect("load"), Some(bytes("C")));
    assert_eq!(store.get(&owner, "new").await.expect("get"), Some(bytes("y")));
    assert_eq!(store.faults().injected_count(), 1);
}

/// Goal: write-back mode models a disk cache. Method: commit and flush, commit more
/// without flushing, crash: only the flushed commits remain.
#[tokio::test]
async fn memory_crash_in_write_back_mode_loses_unflushed_commits_and_keeps_flushed_ones() {
    let store = MemoryStore::new();
    let owner = actor("agent", "a");
    let unflushed_only = actor("agent", "ab");
    store.faults().set_write_back(true);

    commit(
        &store,
        &owner,
        state_commit("flushed", vec![put("kept", "1"), put("later-deleted", "2")]),
    )
    .await;
    store.flush();
    commit(
        &store,
        &owner,
        state_commit("unflushed", vec![put("lost", "3"), delete("later-deleted")]),
    )
    .await;
    commit(&store, &unflushed_only, state_commit("lost", vec![])).await;
    assert_eq!(store.load(&owner).await.expect("load"), Some(bytes("unflushed")));

    store.crash();
    assert_eq!(store.load(&owner).await.expect("load"), Some(bytes("flushed")));
    assert_eq!(store.load(&unflushed_only).await.expect("load"), None);
    assert_eq!(scan_keys(&store, &owner, "").await, strings(&["kept", "later-deleted"]));

    store.faults().set_write_back(false);
    commit(&store, &owner, state_commit("durable", vec![])).await;
    store.crash();
    assert_eq!(store.load(&owner).await.expect("load"), Some(bytes("durable")));
}
