//! A fast, deterministic hasher for the runtime's own tables.
//!
//! The activation table and the route map are looked up on every invocation, and
//! SipHash over an id's two strings was a tenth of a hot invoke's instructions. This is
//! rustc's hash (FxHash, from the `rustc-hash` crate): not keyed, so it behaves
//! identically in every run (seed replay under madsim needs that), at the price of no
//! defence against ids crafted to collide. Ids come from the embedding application; a
//! server that accepts ids from untrusted clients should bound them (they are bounded in
//! length by `ACTOR_KEY_LENGTH_MAX`) or rate-limit creation.

use std::collections::{HashMap, HashSet};

/// A `HashMap` with rustc's unkeyed FxHash.
pub(crate) type FastMap<K, V> = HashMap<K, V, rustc_hash::FxBuildHasher>;

/// A `HashSet` with rustc's unkeyed FxHash.
pub(crate) type FastSet<K> = HashSet<K, rustc_hash::FxBuildHasher>;

#[cfg(test)]
mod tests {
    use std::hash::{BuildHasher, Hash};

    use troupe_core::ActorId;

    fn hash_of(value: &impl Hash) -> u64 {
        rustc_hash::FxBuildHasher.hash_one(value)
    }

    #[test]
    #[cfg(target_pointer_width = "64")]
    fn equal_ids_hash_equal_and_the_hash_is_stable_across_runs() {
        let a = ActorId::new("agent", "a").unwrap();
        assert_eq!(hash_of(&a), hash_of(&ActorId::new("agent", "a").unwrap()));
        assert_ne!(hash_of(&a), hash_of(&ActorId::new("agent", "b").unwrap()));
        // Fixed, unkeyed: the same value in every process (seed replay relies on it).
        assert_eq!(hash_of(&a), HASH_OF_AGENT_A, "the hash is a fixed function of the id");
    }

    /// The hash of `agent/a` on 64-bit targets (rustc-hash 2), recorded once: a keyed
    /// (random) hasher would fail this in every process.
    #[cfg(target_pointer_width = "64")]
    const HASH_OF_AGENT_A: u64 = 15_474_942_833_171_339_887;

    #[test]
    fn keys_that_differ_only_in_their_tail_hash_apart() {
        let keys: Vec<u64> = (0..1_000).map(|i| hash_of(&format!("agent-{i:05}"))).collect();
        let mut unique = keys.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), keys.len());
    }
}
