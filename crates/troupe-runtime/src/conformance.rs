//! The [`StateStore`] conformance suite, for every backend, in this crate or another.
//!
//! Compiled with the `conformance` feature. Each case is a `pub async fn` written once
//! against `&dyn StateStore`, and [`CASES`] lists them all by name; a backend passes
//! when every case passes on a fresh, empty store. The cases are claims about the
//! trait's contract: loads of unknown actors, atomic commits, refused commits leaving
//! nothing behind, the three kinds of state change (unchanged, set, deleted), fencing
//! (each claim fences off the commits of every older one), ordered prefix scans with
//! paging, and isolation between actors. A deterministic reference model (a
//! `BTreeMap`) checks random sequences of commits and scans.
//!
//! Two ways to run it: one test per case (this crate's
//! `tests/state_store_conformance.rs` generates them for the memory and SQLite backends,
//! so a failure names its case), or [`run_all`], which runs every case in turn on a
//! fresh store from a factory and names the case that fails (what
//! `troupe-postgres` does: one database per case on one server).
//!
//! The helpers ([`actor`], [`commit`], [`fenced`], …) are public too, for a backend's
//! own tests beside the suite. Every case panics on a failure, as tests do.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;

use bytes::Bytes;
use troupe_core::ActorId;

use crate::state_store::{
    Fence, FencedClaim, StateChange, StateStore, StoreError, StoreItem, TurnCommit, STATE_KEY_LENGTH_MAX,
    STATE_SCAN_LIMIT_MAX, STATE_VALUE_SIZE_MAX, TURN_WRITES_MAX,
};

/// The future one case returns.
pub type CaseFuture<'store> = Pin<Box<dyn Future<Output = ()> + Send + 'store>>;

/// One conformance case: its name (the name of its function) and how to run it.
#[derive(Clone, Copy)]
pub struct Case {
    /// The case's function name, e.g. `"commit_of_an_actor_never_claimed_is_refused"`.
    pub name: &'static str,
    /// Runs the case on `store`, which must be fresh and empty; panics on a failure.
    pub run: for<'store> fn(&'store dyn StateStore) -> CaseFuture<'store>,
}

impl std::fmt::Debug for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

macro_rules! cases {
    ($($case:ident),* $(,)?) => {
        /// Every case of the suite, in the order [`run_all`] runs them.
        pub const CASES: &[Case] = &[$(Case { name: stringify!($case), run: boxed::$case }),*];

        /// The cases as boxed futures, so that they fit in one [`Case`] type.
        mod boxed {
            use super::{CaseFuture, StateStore};
            $(
                pub(super) fn $case(store: &dyn StateStore) -> CaseFuture<'_> {
                    Box::pin(super::$case(store))
                }
            )*
        }
    };
}

cases!(
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
    scan_after_a_key_before_the_prefix_returns_the_prefix_from_its_start,
    scan_returns_at_most_limit_entries,
    scan_pages_through_every_entry_with_after_and_limit,
    scan_returns_at_most_the_scan_limit_maximum,
    scan_does_not_leak_keys_of_an_actor_whose_id_extends_this_one,
    scan_treats_percent_and_underscore_in_the_prefix_literally,
    scan_orders_non_ascii_keys_by_their_bytes,
    keys_and_states_of_two_actors_never_mix,
    random_commits_and_scans_match_a_btreemap_model,
);

/// Runs every case of [`CASES`] in turn, each on a fresh store from `make_store`, which
/// is given the case's name (for a file or database of its own). The store is dropped
/// after its case. Before each case its name is printed to standard output, so a
/// failing run shows which case failed, besides the panic's own message and location.
pub async fn run_all<S, F, Fut>(mut make_store: F)
where
    S: StateStore,
    F: FnMut(&'static str) -> Fut,
    Fut: Future<Output = S>,
{
    for case in CASES {
        println!("conformance case {}", case.name);
        let store = make_store(case.name).await;
        (case.run)(&store).await;
    }
}

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

/// An actor id from a kind and a key that are known to be valid.
pub fn actor(kind: &str, key: &str) -> ActorId {
    ActorId::new(kind, key).expect("a valid actor id")
}

/// The bytes of `text`.
pub fn bytes(text: &str) -> Bytes {
    Bytes::copy_from_slice(text.as_bytes())
}

/// A write that sets `key` to `value`.
pub fn put(key: &str, value: &str) -> (String, Option<Bytes>) {
    (key.to_string(), Some(bytes(value)))
}

/// A write that deletes `key`.
pub fn delete(key: &str) -> (String, Option<Bytes>) {
    (key.to_string(), None)
}

/// A commit that sets the state to `state` and applies `writes`.
pub fn state_commit(state: &str, writes: Vec<(String, Option<Bytes>)>) -> TurnCommit {
    TurnCommit {
        state: StateChange::Set(bytes(state)),
        writes,
    }
}

/// A commit that leaves the state unchanged and applies `writes`.
pub fn writes_commit(writes: Vec<(String, Option<Bytes>)>) -> TurnCommit {
    TurnCommit {
        state: StateChange::Unchanged,
        writes,
    }
}

/// A commit that deletes the state and writes nothing.
pub fn delete_state_commit() -> TurnCommit {
    TurnCommit {
        state: StateChange::Deleted,
        writes: Vec::new(),
    }
}

/// A new fence for `owner`, as an activation gets one.
pub async fn claim(store: &dyn StateStore, owner: &ActorId) -> Fence {
    store.claim(owner).await.expect("claim").fence
}

/// Claims `owner` and commits under the new fence, as one activation with one turn.
pub async fn commit(store: &dyn StateStore, owner: &ActorId, commit: TurnCommit) {
    let fence = claim(store, owner).await;
    store
        .commit(owner, fence, commit)
        .await
        .expect("a valid commit succeeds");
}

/// The refusal a commit of `owner` under `held` must get when `current` is the newest.
pub fn fenced(owner: &ActorId, held: Fence, current: Option<Fence>) -> StoreError {
    StoreError::Fenced {
        actor: owner.clone(),
        held,
        current,
    }
}

/// Every key of `owner` under `prefix`, in one scan.
pub async fn scan_keys(store: &dyn StateStore, owner: &ActorId, prefix: &str) -> Vec<String> {
    scan_page(store, owner, prefix, None, STATE_SCAN_LIMIT_MAX).await
}

/// The keys of one page of a scan of `owner`.
pub async fn scan_page(
    store: &dyn StateStore,
    owner: &ActorId,
    prefix: &str,
    after: Option<&str>,
    limit: usize,
) -> Vec<String> {
    store
        .scan(owner, prefix, after, limit)
        .await
        .expect("scan")
        .into_iter()
        .map(|(key, _)| key)
        .collect()
}

/// Owned copies of `keys`.
pub fn strings(keys: &[&str]) -> Vec<String> {
    keys.iter().map(|key| (*key).to_string()).collect()
}

/// Commits state `"A"` with keys `a1`, `a2`, then checks a refused commit left them alone.
async fn refused_commit_leaves_nothing(store: &dyn StateStore, refused: TurnCommit) {
    let owner = actor("agent", "a");
    commit(
        store,
        &owner,
        state_commit("A", vec![put("a1", "one"), put("a2", "two")]),
    )
    .await;

    let fence = claim(store, &owner).await;
    let error = store
        .commit(&owner, fence, refused)
        .await
        .expect_err("the commit is refused");
    assert!(
        matches!(error, StoreError::TooLarge { .. } | StoreError::TooManyWrites { .. }),
        "unexpected error: {error:?}"
    );

    assert_eq!(store.load(&owner).await.expect("load"), Some(bytes("A")));
    assert_eq!(scan_keys(store, &owner, "").await, strings(&["a1", "a2"]));
    assert_eq!(store.get(&owner, "a1").await.expect("get"), Some(bytes("one")));
}

// ---------------------------------------------------------------------------------------
// Checks, shared by every backend
// ---------------------------------------------------------------------------------------

/// Conformance case `load_of_an_unknown_actor_is_none`.
pub async fn load_of_an_unknown_actor_is_none(store: &dyn StateStore) {
    let owner = actor("agent", "never-committed");
    assert_eq!(store.load(&owner).await.expect("load"), None);
    assert_eq!(store.get(&owner, "anything").await.expect("get"), None);
    assert!(scan_keys(store, &owner, "").await.is_empty());
}

/// Conformance case `committed_state_and_writes_are_all_visible_after_commit`.
pub async fn committed_state_and_writes_are_all_visible_after_commit(store: &dyn StateStore) {
    let owner = actor("agent", "a");
    let writes = vec![put("b", "two"), put("a", "one"), put("c", "three")];
    commit(store, &owner, state_commit("state", writes)).await;

    assert_eq!(store.load(&owner).await.expect("load"), Some(bytes("state")));
    for (key, value) in [("a", "one"), ("b", "two"), ("c", "three")] {
        assert_eq!(
            store.get(&owner, key).await.expect("get"),
            Some(bytes(value)),
            "key {key}"
        );
    }
    let entries = store.scan(&owner, "", None, 10).await.expect("scan");
    assert_eq!(
        entries,
        vec![
            ("a".to_string(), bytes("one")),
            ("b".to_string(), bytes("two")),
            ("c".to_string(), bytes("three"))
        ]
    );
}

/// Conformance case `unchanged_state_keeps_the_previous_state`.
pub async fn unchanged_state_keeps_the_previous_state(store: &dyn StateStore) {
    let owner = actor("agent", "a");
    commit(store, &owner, state_commit("first", vec![])).await;
    commit(store, &owner, writes_commit(vec![put("k", "v")])).await;
    assert_eq!(store.load(&owner).await.expect("load"), Some(bytes("first")));
    commit(store, &owner, state_commit("second", vec![])).await;
    assert_eq!(store.load(&owner).await.expect("load"), Some(bytes("second")));
    assert_eq!(store.get(&owner, "k").await.expect("get"), Some(bytes("v")));
}

/// Conformance case `deleted_state_loads_and_claims_as_none_and_keeps_the_entries`.
pub async fn deleted_state_loads_and_claims_as_none_and_keeps_the_entries(store: &dyn StateStore) {
    let owner = actor("agent", "a");
    commit(store, &owner, state_commit("A", vec![put("k", "v")])).await;
    commit(store, &owner, delete_state_commit()).await;
    assert_eq!(store.load(&owner).await.expect("load"), None);
    assert_eq!(store.claim(&owner).await.expect("claim").state, None);
    assert_eq!(store.get(&owner, "k").await.expect("get"), Some(bytes("v")));
    // An unchanged state after the delete stays deleted.
    commit(store, &owner, writes_commit(vec![put("k2", "v2")])).await;
    assert_eq!(store.load(&owner).await.expect("load"), None);
}

/// Conformance case `deleting_a_state_that_was_never_set_leaves_none`.
pub async fn deleting_a_state_that_was_never_set_leaves_none(store: &dyn StateStore) {
    let owner = actor("agent", "a");
    commit(
        store,
        &owner,
        TurnCommit {
            state: StateChange::Deleted,
            writes: vec![put("k", "v")],
        },
    )
    .await;
    assert_eq!(store.load(&owner).await.expect("load"), None);
    assert_eq!(store.get(&owner, "k").await.expect("get"), Some(bytes("v")));
}

/// Conformance case `state_set_after_a_delete_is_visible_again`.
pub async fn state_set_after_a_delete_is_visible_again(store: &dyn StateStore) {
    let owner = actor("agent", "a");
    commit(store, &owner, state_commit("A", vec![])).await;
    commit(store, &owner, delete_state_commit()).await;
    commit(store, &owner, state_commit("B", vec![])).await;
    assert_eq!(store.load(&owner).await.expect("load"), Some(bytes("B")));
}

/// Conformance case `claim_of_an_unknown_actor_issues_the_first_fence_and_no_state`.
pub async fn claim_of_an_unknown_actor_issues_the_first_fence_and_no_state(store: &dyn StateStore) {
    let owner = actor("agent", "never-claimed");
    let claimed = store.claim(&owner).await.expect("claim");
    assert_eq!(claimed.fence, Fence::FIRST);
    assert_eq!(claimed.state, None);
}

/// Conformance case `claim_returns_the_last_committed_state`.
pub async fn claim_returns_the_last_committed_state(store: &dyn StateStore) {
    let owner = actor("agent", "a");
    commit(store, &owner, state_commit("A", vec![])).await;
    commit(store, &owner, state_commit("B", vec![])).await;
    assert_eq!(store.claim(&owner).await.expect("claim").state, Some(bytes("B")));
}

/// Conformance case `each_claim_issues_a_newer_fence_than_the_last`.
pub async fn each_claim_issues_a_newer_fence_than_the_last(store: &dyn StateStore) {
    let owner = actor("agent", "a");
    let mut expected = Fence::FIRST;
    for _ in 0..5 {
        assert_eq!(claim(store, &owner).await, expected);
        expected = expected.next();
    }
}

/// Conformance case `commit_under_an_older_fence_is_refused_and_writes_nothing`.
pub async fn commit_under_an_older_fence_is_refused_and_writes_nothing(store: &dyn StateStore) {
    let owner = actor("agent", "a");
    let older = claim(store, &owner).await;
    store
        .commit(&owner, older, state_commit("A", vec![put("k", "old")]))
        .await
        .expect("the only claim commits");
    let newer = claim(store, &owner).await;
    assert_eq!(newer, older.next());

    let refused = store
        .commit(
            &owner,
            older,
            state_commit("stale", vec![put("k", "stale"), put("new", "stale"), delete("k")]),
        )
        .await;
    assert_eq!(refused, Err(fenced(&owner, older, Some(newer))));
    assert_eq!(store.load(&owner).await.expect("load"), Some(bytes("A")));
    assert_eq!(store.get(&owner, "k").await.expect("get"), Some(bytes("old")));
    assert_eq!(store.get(&owner, "new").await.expect("get"), None);

    store
        .commit(&owner, newer, state_commit("B", vec![put("k", "new")]))
        .await
        .expect("the newest claim commits");
    assert_eq!(store.load(&owner).await.expect("load"), Some(bytes("B")));
    // Refused again: a newer fence never makes an older one current again.
    let refused = store.commit(&owner, older, state_commit("stale", vec![])).await;
    assert_eq!(refused, Err(fenced(&owner, older, Some(newer))));
}

/// Conformance case `commit_of_an_actor_never_claimed_is_refused`.
pub async fn commit_of_an_actor_never_claimed_is_refused(store: &dyn StateStore) {
    let owner = actor("agent", "never-claimed");
    let refused = store
        .commit(&owner, Fence::FIRST, state_commit("A", vec![put("k", "v")]))
        .await;
    assert_eq!(refused, Err(fenced(&owner, Fence::FIRST, None)));
    assert_eq!(store.load(&owner).await.expect("load"), None);
    assert_eq!(store.get(&owner, "k").await.expect("get"), None);
}

/// Conformance case `commit_under_another_actors_fence_is_refused`.
pub async fn commit_under_another_actors_fence_is_refused(store: &dyn StateStore) {
    let owner = actor("agent", "a");
    let other = actor("agent", "b");
    let owner_fence = claim(store, &owner).await;
    for _ in 0..3 {
        claim(store, &other).await;
    }
    let other_fence = claim(store, &other).await;
    assert_ne!(owner_fence, other_fence);
    let refused = store.commit(&owner, other_fence, state_commit("A", vec![])).await;
    assert_eq!(refused, Err(fenced(&owner, other_fence, Some(owner_fence))));
    assert_eq!(store.load(&owner).await.expect("load"), None);
}

/// Conformance case `empty_commit_under_an_older_fence_is_refused`.
pub async fn empty_commit_under_an_older_fence_is_refused(store: &dyn StateStore) {
    let owner = actor("agent", "a");
    let older = claim(store, &owner).await;
    let newer = claim(store, &owner).await;
    let refused = store.commit(&owner, older, TurnCommit::default()).await;
    assert_eq!(refused, Err(fenced(&owner, older, Some(newer))));
    store
        .commit(&owner, newer, TurnCommit::default())
        .await
        .expect("an empty commit under the newest fence");
}

/// Conformance case `fences_of_two_actors_are_independent`.
pub async fn fences_of_two_actors_are_independent(store: &dyn StateStore) {
    let first = actor("agent", "a");
    let second = actor("agent", "ab");
    let first_fence = claim(store, &first).await;
    let second_fence = claim(store, &second).await;
    claim(store, &actor("agent", "b")).await;
    store
        .commit(&first, first_fence, state_commit("first", vec![]))
        .await
        .expect("claims of other actors do not fence this one");
    store
        .commit(&second, second_fence, state_commit("second", vec![]))
        .await
        .expect("claims of other actors do not fence this one");
    assert_eq!(store.load(&first).await.expect("load"), Some(bytes("first")));
    assert_eq!(store.load(&second).await.expect("load"), Some(bytes("second")));
}

/// Conformance case `a_fence_check_answers_as_a_commit_would`: `check_fence` refuses
/// exactly the fences a commit would refuse, with the same error, and writes nothing. A
/// store that does not check (the trait's default) answers `Ok` to every fence; that is
/// allowed, and found out here by its answer for an actor never claimed, which a store
/// that checks refuses.
pub async fn a_fence_check_answers_as_a_commit_would(store: &dyn StateStore) {
    let never = actor("agent", "never-claimed");
    let checks = match store.check_fence(&never, Fence::FIRST).await {
        Ok(()) => false,
        Err(error) => {
            assert_eq!(error, fenced(&never, Fence::FIRST, None));
            true
        }
    };
    let owner = actor("agent", "a");
    let other = actor("agent", "b");
    let older = claim(store, &owner).await;
    store
        .check_fence(&owner, older)
        .await
        .expect("the only claim is current");
    claim(store, &other).await;
    store
        .check_fence(&owner, older)
        .await
        .expect("claims of other actors do not fence this one");
    let newer = claim(store, &owner).await;
    let checked = store.check_fence(&owner, older).await;
    let committed = store.commit(&owner, older, TurnCommit::default()).await;
    assert_eq!(committed, Err(fenced(&owner, older, Some(newer))));
    if checks {
        assert_eq!(checked, committed, "the check refuses what the commit refuses");
    } else {
        assert_eq!(checked, Ok(()), "a store that does not check answers Ok");
    }
    store
        .check_fence(&owner, newer)
        .await
        .expect("the newest claim is current");
    store
        .commit(&owner, newer, state_commit("A", vec![put("k", "v")]))
        .await
        .expect("the newest claim commits after its checks");
    assert_eq!(store.load(&owner).await.expect("load"), Some(bytes("A")));
    // A check writes nothing: the fences issued after it go on from the newest.
    assert_eq!(claim(store, &owner).await, newer.next());
}

/// Conformance case `delete_write_removes_the_key`.
pub async fn delete_write_removes_the_key(store: &dyn StateStore) {
    let owner = actor("agent", "a");
    commit(store, &owner, writes_commit(vec![put("keep", "1"), put("drop", "2")])).await;
    commit(
        store,
        &owner,
        writes_commit(vec![delete("drop"), delete("never-existed")]),
    )
    .await;
    assert_eq!(store.get(&owner, "drop").await.expect("get"), None);
    assert_eq!(store.get(&owner, "keep").await.expect("get"), Some(bytes("1")));
    assert_eq!(scan_keys(store, &owner, "").await, strings(&["keep"]));
}

/// Conformance case `writes_in_one_commit_apply_in_order`.
pub async fn writes_in_one_commit_apply_in_order(store: &dyn StateStore) {
    let owner = actor("agent", "a");
    let writes = vec![
        put("put-then-delete", "x"),
        delete("put-then-delete"),
        delete("delete-then-put"),
        put("delete-then-put", "y"),
        put("overwritten", "old"),
        put("overwritten", "new"),
    ];
    commit(store, &owner, writes_commit(writes)).await;
    assert_eq!(store.get(&owner, "put-then-delete").await.expect("get"), None);
    assert_eq!(
        store.get(&owner, "delete-then-put").await.expect("get"),
        Some(bytes("y"))
    );
    assert_eq!(store.get(&owner, "overwritten").await.expect("get"), Some(bytes("new")));
}

/// Conformance case `empty_value_is_stored_and_differs_from_an_absent_key`.
pub async fn empty_value_is_stored_and_differs_from_an_absent_key(store: &dyn StateStore) {
    let owner = actor("agent", "a");
    commit(
        store,
        &owner,
        TurnCommit {
            state: StateChange::Set(Bytes::new()),
            writes: vec![put("empty", "")],
        },
    )
    .await;
    assert_eq!(store.load(&owner).await.expect("load"), Some(Bytes::new()));
    assert_eq!(store.get(&owner, "empty").await.expect("get"), Some(Bytes::new()));
    assert_eq!(scan_keys(store, &owner, "").await, strings(&["empty"]));
}

/// Conformance case `empty_commit_changes_nothing`.
pub async fn empty_commit_changes_nothing(store: &dyn StateStore) {
    let owner = actor("agent", "a");
    commit(store, &owner, TurnCommit::default()).await;
    assert_eq!(store.load(&owner).await.expect("load"), None);
    commit(store, &owner, state_commit("A", vec![put("k", "v")])).await;
    commit(store, &owner, TurnCommit::default()).await;
    assert_eq!(store.load(&owner).await.expect("load"), Some(bytes("A")));
    assert_eq!(store.get(&owner, "k").await.expect("get"), Some(bytes("v")));
}

/// Conformance case `oversized_value_is_refused_and_nothing_of_that_commit_is_visible`.
pub async fn oversized_value_is_refused_and_nothing_of_that_commit_is_visible(store: &dyn StateStore) {
    let oversized = Bytes::from(vec![0_u8; STATE_VALUE_SIZE_MAX + 1]);
    let refused = TurnCommit {
        state: StateChange::Set(bytes("B")),
        writes: vec![put("new", "fresh"), delete("a1"), ("huge".to_string(), Some(oversized))],
    };
    refused_commit_leaves_nothing(store, refused).await;
}

/// Conformance case `oversized_state_is_refused_and_nothing_of_that_commit_is_visible`.
pub async fn oversized_state_is_refused_and_nothing_of_that_commit_is_visible(store: &dyn StateStore) {
    let refused = TurnCommit {
        state: StateChange::Set(Bytes::from(vec![0_u8; STATE_VALUE_SIZE_MAX + 1])),
        writes: vec![put("new", "fresh"), delete("a1")],
    };
    refused_commit_leaves_nothing(store, refused).await;
}

/// Conformance case `oversized_key_is_refused_and_nothing_of_that_commit_is_visible`.
pub async fn oversized_key_is_refused_and_nothing_of_that_commit_is_visible(store: &dyn StateStore) {
    let oversized_key = "k".repeat(STATE_KEY_LENGTH_MAX + 1);
    let refused = state_commit("B", vec![put("new", "fresh"), delete("a1"), put(&oversized_key, "v")]);
    refused_commit_leaves_nothing(store, refused).await;
}

/// Conformance case `too_many_writes_are_refused_and_nothing_of_that_commit_is_visible`.
pub async fn too_many_writes_are_refused_and_nothing_of_that_commit_is_visible(store: &dyn StateStore) {
    let mut writes: Vec<_> = (0..TURN_WRITES_MAX)
        .map(|index| put(&format!("new{index:05}"), "v"))
        .collect();
    writes.push(delete("a1"));
    refused_commit_leaves_nothing(store, state_commit("B", writes)).await;
}

/// Conformance case `most_writes_allowed_in_one_commit_are_accepted`.
pub async fn most_writes_allowed_in_one_commit_are_accepted(store: &dyn StateStore) {
    let owner = actor("agent", "a");
    let writes: Vec<_> = (0..TURN_WRITES_MAX)
        .map(|index| put(&format!("key{index:05}"), "v"))
        .collect();
    let longest_key = "k".repeat(STATE_KEY_LENGTH_MAX);
    commit(store, &owner, writes_commit(writes)).await;
    commit(store, &owner, writes_commit(vec![put(&longest_key, "v")])).await;
    assert_eq!(scan_keys(store, &owner, "key").await.len(), TURN_WRITES_MAX);
    assert_eq!(store.get(&owner, &longest_key).await.expect("get"), Some(bytes("v")));
}

/// Conformance case `get_and_scan_refuse_an_oversized_key`.
pub async fn get_and_scan_refuse_an_oversized_key(store: &dyn StateStore) {
    let owner = actor("agent", "a");
    let oversized_key = "k".repeat(STATE_KEY_LENGTH_MAX + 1);
    assert!(matches!(
        store.get(&owner, &oversized_key).await,
        Err(StoreError::TooLarge {
            what: StoreItem::Key,
            ..
        })
    ));
    assert!(matches!(
        store.scan(&owner, &oversized_key, None, 10).await,
        Err(StoreError::TooLarge {
            what: StoreItem::Key,
            ..
        })
    ));
}

/// Conformance case `scan_returns_only_keys_with_the_prefix_in_key_order`.
pub async fn scan_returns_only_keys_with_the_prefix_in_key_order(store: &dyn StateStore) {
    let owner = actor("agent", "a");
    let writes = vec![
        put("note/3", "c"),
        put("note", "bare prefix"),
        put("note/1", "a"),
        put("notes", "sibling"),
        put("nota", "before"),
        put("note/2", "b"),
        put("zzz", "after"),
        put("not", "shorter"),
    ];
    commit(store, &owner, writes_commit(writes)).await;

    assert_eq!(
        scan_keys(store, &owner, "note/").await,
        strings(&["note/1", "note/2", "note/3"])
    );
    assert_eq!(
        scan_keys(store, &owner, "note").await,
        strings(&["note", "note/1", "note/2", "note/3", "notes"])
    );
    let entries = store.scan(&owner, "note/", None, 10).await.expect("scan");
    assert_eq!(entries[0], ("note/1".to_string(), bytes("a")));
    assert!(scan_keys(store, &owner, "nothing").await.is_empty());
    assert!(scan_keys(store, &owner, "zzzz").await.is_empty());
}

/// Conformance case `scan_with_an_empty_prefix_returns_every_key_of_the_actor`.
pub async fn scan_with_an_empty_prefix_returns_every_key_of_the_actor(store: &dyn StateStore) {
    let owner = actor("agent", "a");
    commit(
        store,
        &owner,
        writes_commit(vec![put("b", "2"), put("a", "1"), put("", "empty key")]),
    )
    .await;
    assert_eq!(scan_keys(store, &owner, "").await, strings(&["", "a", "b"]));
}

/// Conformance case `scan_starts_strictly_after_the_given_key`.
pub async fn scan_starts_strictly_after_the_given_key(store: &dyn StateStore) {
    let owner = actor("agent", "a");
    let writes = vec![put("p/1", "1"), put("p/2", "2"), put("p/3", "3"), put("q", "4")];
    commit(store, &owner, writes_commit(writes)).await;

    assert_eq!(
        scan_page(store, &owner, "p/", Some("p/1"), 10).await,
        strings(&["p/2", "p/3"])
    );
    // `after` need not be a stored key.
    assert_eq!(
        scan_page(store, &owner, "p/", Some("p/15"), 10).await,
        strings(&["p/2", "p/3"])
    );
    // `after` before the prefix: the whole prefix.
    assert_eq!(
        scan_page(store, &owner, "p/", Some("a"), 10).await,
        strings(&["p/1", "p/2", "p/3"])
    );
    // `after` at or past the last key: nothing.
    assert!(scan_page(store, &owner, "p/", Some("p/3"), 10).await.is_empty());
    assert!(scan_page(store, &owner, "p/", Some("z"), 10).await.is_empty());
    // `after` equal to the prefix, which is itself not a key.
    assert_eq!(
        scan_page(store, &owner, "p/", Some("p/"), 10).await,
        strings(&["p/1", "p/2", "p/3"])
    );
}

/// Conformance case `scan_after_a_key_before_the_prefix_returns_the_prefix_from_its_start`.
pub async fn scan_after_a_key_before_the_prefix_returns_the_prefix_from_its_start(store: &dyn StateStore) {
    let owner = actor("agent", "a");
    let writes = vec![put("a", "between after and prefix"), put("m/1", "1"), put("m/2", "2")];
    commit(store, &owner, writes_commit(writes)).await;
    // Key `a` sorts after `after` but before the prefix; it must not end the scan.
    assert_eq!(
        scan_page(store, &owner, "m/", Some("0"), 10).await,
        strings(&["m/1", "m/2"])
    );
    assert_eq!(scan_page(store, &owner, "m/", Some("0"), 1).await, strings(&["m/1"]));
}

/// Conformance case `scan_returns_at_most_limit_entries`.
pub async fn scan_returns_at_most_limit_entries(store: &dyn StateStore) {
    let owner = actor("agent", "a");
    let writes = (0..10).map(|index| put(&format!("k{index}"), "v")).collect();
    commit(store, &owner, writes_commit(writes)).await;

    assert_eq!(
        scan_page(store, &owner, "k", None, 3).await,
        strings(&["k0", "k1", "k2"])
    );
    assert_eq!(
        scan_page(store, &owner, "k", Some("k7"), 5).await,
        strings(&["k8", "k9"])
    );
    assert_eq!(scan_page(store, &owner, "k", None, 1).await, strings(&["k0"]));
    assert!(scan_page(store, &owner, "k", None, 0).await.is_empty());
}

/// Conformance case `scan_pages_through_every_entry_with_after_and_limit`.
pub async fn scan_pages_through_every_entry_with_after_and_limit(store: &dyn StateStore) {
    let owner = actor("agent", "a");
    let expected: Vec<String> = (0..25).map(|index| format!("page/{index:03}")).collect();
    let writes = expected.iter().rev().map(|key| put(key, "v")).collect();
    commit(store, &owner, writes_commit(writes)).await;
    commit(
        store,
        &owner,
        writes_commit(vec![put("pagf", "outside"), put("pag", "outside")]),
    )
    .await;

    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let page = scan_page(store, &owner, "page/", after.as_deref(), 7).await;
        assert!(page.len() <= 7, "a page of {} entries", page.len());
        let Some(last) = page.last().cloned() else {
            break;
        };
        seen.extend(page);
        after = Some(last);
    }
    assert_eq!(seen, expected);
}

/// Conformance case `scan_returns_at_most_the_scan_limit_maximum`.
pub async fn scan_returns_at_most_the_scan_limit_maximum(store: &dyn StateStore) {
    let owner = actor("agent", "a");
    let total = STATE_SCAN_LIMIT_MAX + 5;
    let keys: Vec<String> = (0..total).map(|index| format!("k{index:06}")).collect();
    for chunk in keys.chunks(TURN_WRITES_MAX) {
        commit(
            store,
            &owner,
            writes_commit(chunk.iter().map(|key| put(key, "")).collect()),
        )
        .await;
    }
    let page = scan_page(store, &owner, "k", None, usize::MAX).await;
    assert_eq!(page.len(), STATE_SCAN_LIMIT_MAX);
    assert_eq!(page, keys[..STATE_SCAN_LIMIT_MAX]);
}

/// Conformance case `scan_does_not_leak_keys_of_an_actor_whose_id_extends_this_one`.
pub async fn scan_does_not_leak_keys_of_an_actor_whose_id_extends_this_one(store: &dyn StateStore) {
    let short = actor("agent", "a");
    let long = actor("agent", "ab");
    let slashed = actor("agent", "a/b");
    let other_kind = actor("tool", "a");
    commit(
        store,
        &short,
        writes_commit(vec![put("b/1", "short"), put("x", "short")]),
    )
    .await;
    commit(
        store,
        &long,
        writes_commit(vec![put("b/1", "long"), put("b/2", "long"), put("a", "long")]),
    )
    .await;
    commit(store, &slashed, writes_commit(vec![put("b/3", "slashed")])).await;
    commit(store, &other_kind, writes_commit(vec![put("b/4", "tool")])).await;

    assert_eq!(scan_keys(store, &short, "").await, strings(&["b/1", "x"]));
    assert_eq!(scan_keys(store, &short, "b").await, strings(&["b/1"]));
    assert_eq!(
        scan_page(store, &short, "b", Some("b/1"), 10).await,
        Vec::<String>::new()
    );
    assert_eq!(scan_keys(store, &long, "b").await, strings(&["b/1", "b/2"]));
    assert_eq!(scan_keys(store, &slashed, "").await, strings(&["b/3"]));
    assert_eq!(scan_keys(store, &other_kind, "").await, strings(&["b/4"]));
    let entries = store.scan(&short, "b/", None, 10).await.expect("scan");
    assert_eq!(entries, vec![("b/1".to_string(), bytes("short"))]);
}

/// Conformance case `scan_treats_percent_and_underscore_in_the_prefix_literally`.
pub async fn scan_treats_percent_and_underscore_in_the_prefix_literally(store: &dyn StateStore) {
    let owner = actor("agent", "a");
    let writes = vec![
        put("100%", "percent"),
        put("100%/x", "percent child"),
        put("1000", "digit"),
        put("100x", "letter"),
        put("a_b", "underscore"),
        put("a_bc", "underscore longer"),
        put("axb", "letter"),
        put("a\\b", "backslash"),
        put("a\\_b", "escaped underscore"),
    ];
    commit(store, &owner, writes_commit(writes)).await;

    assert_eq!(scan_keys(store, &owner, "100%").await, strings(&["100%", "100%/x"]));
    assert_eq!(scan_keys(store, &owner, "a_").await, strings(&["a_b", "a_bc"]));
    assert_eq!(scan_keys(store, &owner, "%").await, Vec::<String>::new());
    assert_eq!(scan_keys(store, &owner, "_").await, Vec::<String>::new());
    assert_eq!(scan_keys(store, &owner, "a\\").await, strings(&["a\\_b", "a\\b"]));
}

/// Conformance case `scan_orders_non_ascii_keys_by_their_bytes`.
pub async fn scan_orders_non_ascii_keys_by_their_bytes(store: &dyn StateStore) {
    let owner = actor("agent", "a");
    let mut keys = vec!["é", "e", "z", "日本", "日", "😀", "\u{7f}", "ÿ", "Z", "e\u{301}"];
    let writes = keys.iter().map(|key| put(key, "v")).collect();
    commit(store, &owner, writes_commit(writes)).await;
    keys.sort_unstable();
    assert_eq!(scan_keys(store, &owner, "").await, strings(&keys));
    assert_eq!(scan_keys(store, &owner, "日").await, strings(&["日", "日本"]));
    assert_eq!(scan_keys(store, &owner, "e").await, strings(&["e", "e\u{301}"]));
}

/// Conformance case `keys_and_states_of_two_actors_never_mix`.
pub async fn keys_and_states_of_two_actors_never_mix(store: &dyn StateStore) {
    let first = actor("agent", "a");
    let second = actor("agent", "ab");
    commit(
        store,
        &first,
        state_commit("first", vec![put("shared", "1"), put("only-first", "1")]),
    )
    .await;
    commit(store, &second, state_commit("second", vec![put("shared", "2")])).await;
    commit(store, &second, writes_commit(vec![delete("only-first")])).await;
    commit(store, &first, writes_commit(vec![delete("shared")])).await;

    assert_eq!(store.load(&first).await.expect("load"), Some(bytes("first")));
    assert_eq!(store.load(&second).await.expect("load"), Some(bytes("second")));
    assert_eq!(store.get(&first, "shared").await.expect("get"), None);
    assert_eq!(store.get(&second, "shared").await.expect("get"), Some(bytes("2")));
    assert_eq!(store.get(&first, "only-first").await.expect("get"), Some(bytes("1")));
    assert_eq!(store.get(&second, "only-first").await.expect("get"), None);
    assert_eq!(store.load(&actor("agent", "b")).await.expect("load"), None);
}

/// A small deterministic generator, so the model check runs the same in every build.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut mixed = self.0;
        mixed = (mixed ^ (mixed >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        mixed = (mixed ^ (mixed >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        mixed ^ (mixed >> 31)
    }

    fn below(&mut self, bound: usize) -> usize {
        usize::try_from(self.next() % bound as u64).expect("below a usize bound")
    }

    /// One to three fragments glued together.
    fn key(&mut self, fragments: &[&str]) -> String {
        let length = 1 + self.below(3);
        (0..length).map(|_| fragments[self.below(fragments.len())]).collect()
    }
}

/// Conformance case `random_commits_and_scans_match_a_btreemap_model`.
pub async fn random_commits_and_scans_match_a_btreemap_model(store: &dyn StateStore) {
    const FRAGMENTS: [&str; 8] = ["a", "b", "%", "_", "/", "é", "ab", "\\"];
    let owners = [actor("agent", "a"), actor("agent", "ab"), actor("tool", "a")];
    let mut states: BTreeMap<usize, Bytes> = BTreeMap::new();
    let mut entries: BTreeMap<(usize, String), Bytes> = BTreeMap::new();
    let mut random = SplitMix64(0x7470_6f75_7065);

    for step in 0..300 {
        let owner = random.below(owners.len());
        if step % 3 != 2 {
            let write_count = random.below(5);
            let writes: Vec<_> = (0..write_count)
                .map(|_| {
                    let entry_key = random.key(&FRAGMENTS);
                    if random.below(4) == 0 {
                        delete(&entry_key)
                    } else {
                        put(&entry_key, &format!("{step}"))
                    }
                })
                .collect();
            let state = match random.below(3) {
                0 => StateChange::Unchanged,
                1 => StateChange::Set(bytes(&format!("state {step}"))),
                _ => StateChange::Deleted,
            };
            match &state {
                StateChange::Unchanged => {}
                StateChange::Set(value) => {
                    states.insert(owner, value.clone());
                }
                StateChange::Deleted => {
                    states.remove(&owner);
                }
            }
            for (entry_key, value) in &writes {
                match value {
                    Some(value) => entries.insert((owner, entry_key.clone()), value.clone()),
                    None => entries.remove(&(owner, entry_key.clone())),
                };
            }
            commit(store, &owners[owner], TurnCommit { state, writes }).await;
        } else {
            let prefix = if random.below(4) == 0 {
                String::new()
            } else {
                random.key(&FRAGMENTS)
            };
            let after = (random.below(2) == 0).then(|| random.key(&FRAGMENTS));
            let limit = random.below(6);
            let expected: Vec<(String, Bytes)> = entries
                .iter()
                .filter(|((entry_owner, entry_key), _)| {
                    *entry_owner == owner
                        && entry_key.starts_with(&prefix)
                        && after.as_ref().is_none_or(|after| entry_key > after)
                })
                .take(limit)
                .map(|((_, entry_key), value)| (entry_key.clone(), value.clone()))
                .collect();
            let actual = store
                .scan(&owners[owner], &prefix, after.as_deref(), limit)
                .await
                .expect("scan");
            assert_eq!(
                actual, expected,
                "step {step}: prefix {prefix:?}, after {after:?}, limit {limit}"
            );
        }
    }
    for (index, owner) in owners.iter().enumerate() {
        assert_eq!(store.load(owner).await.expect("load"), states.get(&index).cloned());
    }
}

/// The [`FencedClaim`] case, for backends that take external fences (not in [`CASES`]:
/// not every backend does). `node_a` and `node_b` are two handles on one fresh store,
/// standing for two nodes.
///
/// A claims with fence 7 and commits; B claims with 12 and sees A's state; A's commit
/// under 7, A's claim with 7 and a second claim with 12 are refused naming 12; B
/// commits; a plain `claim` afterwards issues 13 (the store's own fences continue above
/// the external one).
pub async fn claim_with_fence_takes_newer_fences_and_refuses_older<S: FencedClaim>(node_a: &S, node_b: &S) {
    let fence = |token: u64| Fence::from_token(token).expect("a nonzero token");
    let owner = actor("counter", "fenced");
    let claimed = node_a
        .claim_with_fence(&owner, fence(7))
        .await
        .expect("A claims with 7");
    assert_eq!((claimed.fence, claimed.state), (fence(7), None));
    node_a
        .commit(&owner, fence(7), state_commit("A", Vec::new()))
        .await
        .expect("A commits under 7");

    let claimed = node_b
        .claim_with_fence(&owner, fence(12))
        .await
        .expect("B claims with 12");
    assert_eq!(claimed.fence, fence(12));
    assert_eq!(claimed.state, Some(bytes("A")), "B starts from A's commit");

    let refused = |result: Result<(), StoreError>, what: &str| match result {
        Err(StoreError::Fenced { current, .. }) => assert_eq!(current, Some(fence(12)), "{what}"),
        other => panic!("{what} must be fenced, got {other:?}"),
    };
    refused(
        node_a
            .commit(&owner, fence(7), state_commit("zombie", Vec::new()))
            .await,
        "A's commit under 7",
    );
    refused(
        node_a.claim_with_fence(&owner, fence(7)).await.map(drop),
        "A's claim with 7",
    );
    refused(
        node_b.claim_with_fence(&owner, fence(12)).await.map(drop),
        "a second claim with 12",
    );

    node_b
        .commit(&owner, fence(12), state_commit("B", Vec::new()))
        .await
        .expect("B commits under 12");
    assert_eq!(
        node_a.load(&owner).await.expect("load"),
        Some(bytes("B")),
        "the zombie wrote nothing"
    );
    let claimed = node_a.claim(&owner).await.expect("a plain claim");
    assert_eq!(
        claimed.fence,
        fence(13),
        "the store's own claim continues above the external fence"
    );
}
