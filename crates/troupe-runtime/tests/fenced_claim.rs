//! `FencedClaim::claim_with_fence`, the claim under a fence issued outside the store (a
//! cluster placement's token), against `MemoryStore` (two clones) and `SqliteStore` (two
//! handles on one file): the same cases for both, each with two handles standing for two
//! nodes.

use bytes::Bytes;
use troupe_core::ActorId;
use troupe_runtime::{Fence, FencedClaim, MemoryStore, StateChange, StoreError, TurnCommit};

fn fence(token: u64) -> Fence {
    Fence::from_token(token).expect("a nonzero token")
}

fn set(text: &str) -> TurnCommit {
    TurnCommit {
        state: StateChange::Set(Bytes::copy_from_slice(text.as_bytes())),
        writes: Vec::new(),
    }
}

/// Goal: a newer external fence takes the actor over from an older one, and the older
/// one can neither commit nor claim again; an equal fence is refused too (two owners
/// can never hold one token); the store's own `claim` continues above the external
/// fence. Method: node A claims with 7 and commits, node B claims with 12 and sees A's
/// state; A's commit under 7, A's claim with 7 and B's repeated claim with 12 are
/// refused naming 12; B commits; a plain `claim` afterwards issues 13.
async fn newer_fence_takes_over_and_older_is_refused<S: FencedClaim>(node_a: S, node_b: S) {
    let actor = ActorId::new("counter", "fenced").expect("an actor id");
    let claimed = node_a
        .claim_with_fence(&actor, fence(7))
        .await
        .expect("A claims with 7");
    assert_eq!((claimed.fence, claimed.state), (fence(7), None));
    node_a
        .commit(&actor, fence(7), set("A"))
        .await
        .expect("A commits under 7");

    let claimed = node_b
        .claim_with_fence(&actor, fence(12))
        .await
        .expect("B claims with 12");
    assert_eq!(claimed.fence, fence(12));
    assert_eq!(claimed.state.as_deref(), Some(&b"A"[..]), "B starts from A's commit");

    let refused = |result: Result<_, StoreError>, what: &str| match result {
        Err(StoreError::Fenced { current, .. }) => assert_eq!(current, Some(fence(12)), "{what}"),
        other => panic!("{what} must be fenced, got {other:?}"),
    };
    refused(
        node_a.commit(&actor, fence(7), set("zombie")).await,
        "A's commit under 7",
    );
    refused(
        node_a.claim_with_fence(&actor, fence(7)).await.map(drop),
        "A's claim with 7",
    );
    refused(
        node_b.claim_with_fence(&actor, fence(12)).await.map(drop),
        "a second claim with 12",
    );

    node_b
        .commit(&actor, fence(12), set("B"))
        .await
        .expect("B commits under 12");
    assert_eq!(node_a.load(&actor).await.expect("load").as_deref(), Some(&b"B"[..]));
    let claimed = node_a.claim(&actor).await.expect("a plain claim");
    assert_eq!(
        claimed.fence,
        fence(13),
        "the store's own claim continues above the external fence"
    );
}

#[tokio::test]
async fn memory_store_takes_newer_external_fences_and_refuses_older() {
    let store = MemoryStore::new();
    newer_fence_takes_over_and_older_is_refused(store.clone(), store).await;
}

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn sqlite_store_takes_newer_external_fences_and_refuses_older() {
    let directory = tempfile::tempdir().expect("a directory");
    let path = directory.path().join("state.db");
    let node_a = troupe_runtime::SqliteStore::open(&path).expect("open A");
    let node_b = troupe_runtime::SqliteStore::open(&path).expect("open B");
    newer_fence_takes_over_and_older_is_refused(node_a, node_b).await;
}
