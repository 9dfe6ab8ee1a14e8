//! A fast, deterministic hasher for the runtime's own tables.
//!
//! The activation table and the route map are looked up on every invocation, and
//! SipHash over an id's two strings was a tenth of a hot invoke's instructions. This is
//! the multiply-rotate hash used by rustc (FxHash), written out here: not keyed, so it
//! behaves identically in every run (seed replay under madsim needs that), at the price
//! of no defence against ids crafted to collide. Ids come from the embedding
//! application; a server that accepts ids from untrusted clients should bound them
//! (they are bounded in length by `ACTOR_KEY_LENGTH_MAX`) or rate-limit creation.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

/// FxHash: for each word, `hash = (hash.rotate_left(5) ^ word) * SEED`.
#[derive(Default, Clone, Copy)]
pub(crate) struct FastHasher {
    hash: u64,
}

impl FastHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for FastHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            self.add(u64::from_le_bytes(chunk.try_into().expect("an 8-byte chunk")));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut word = [0u8; 8];
            word[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(word));
        }
    }

    #[inline]
    fn write_u8(&mut self, value: u8) {
        self.add(u64::from(value));
    }

    #[inline]
    fn write_u64(&mut self, value: u64) {
        self.add(value);
    }

    #[inline]
    fn write_usize(&mut self, value: usize) {
        self.add(value as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.hash
    }
}

/// A `HashMap` with [`FastHasher`].
pub(crate) type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FastHasher>>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::{BuildHasher, Hash};
    use troupe_core::ActorId;

    fn hash_of(value: &impl Hash) -> u64 {
        BuildHasherDefault::<FastHasher>::default().hash_one(value)
    }

    #[test]
    fn equal_ids_hash_equal_and_the_hash_is_stable_across_runs() {
        let a = ActorId::new("agent", "a").unwrap();
        assert_eq!(hash_of(&a), hash_of(&ActorId::new("agent", "a").unwrap()));
        assert_ne!(hash_of(&a), hash_of(&ActorId::new("agent", "b").unwrap()));
        // Fixed, unkeyed: the same value in every process (seed replay relies on it).
        assert_eq!(hash_of(&0u64), 0);
        assert_eq!(hash_of(&1u64), SEED);
    }

    #[test]
    fn keys_that_differ_only_in_their_tail_hash_apart() {
        let keys: Vec<u64> = (0..1_000).map(|i| hash_of(&format!("agent-{i:05}"))).collect();
        let mut unique = keys.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), keys.len());
    }
}
