//! `FencedClaim::claim_with_fence`, the claim under a fence issued outside the store (a
//! cluster placement's token): the conformance case
//! `claim_with_fence_takes_newer_fences_and_refuses_older` against `MemoryStore` (two
//! clones) and `SqliteStore` (two handles on one file), two handles standing for two
//! nodes.
#![cfg(feature = "conformance")]

use troupe_runtime::conformance::claim_with_fence_takes_newer_fences_and_refuses_older;
use troupe_runtime::MemoryStore;

#[tokio::test]
async fn memory_store_takes_newer_external_fences_and_refuses_older() {
    let store = MemoryStore::new();
    claim_with_fence_takes_newer_fences_and_refuses_older(&store.clone(), &store).await;
}

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn sqlite_store_takes_newer_external_fences_and_refuses_older() {
    let directory = tempfile::tempdir().expect("a directory");
    let path = directory.path().join("state.db");
    let node_a = troupe_runtime::SqliteStore::open(&path).expect("open A");
    let node_b = troupe_runtime::SqliteStore::open(&path).expect("open B");
    claim_with_fence_takes_newer_fences_and_refuses_older(&node_a, &node_b).await;
}
