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
use std::hash::BuildHasher;

use hashbrown::hash_table::{self, HashTable};
use troupe_core::ActorId;

/// A `HashMap` with rustc's unkeyed FxHash.
pub(crate) type FastMap<K, V> = HashMap<K, V, rustc_hash::FxBuildHasher>;

/// A `HashSet` with rustc's unkeyed FxHash.
pub(crate) type FastSet<K> = HashSet<K, rustc_hash::FxBuildHasher>;

/// Shards of an [`IdMap`] (a power of two). A table that outgrows its room moves every
/// entry into a new one twice as large, and nothing else happens in it meanwhile: with one
/// table per map, the activation that made the runtime's 917,504th activation (7/8 of
/// 2^20, where a table of 2^20 slots grows) waited 1.24 s on 2026-12-03, because the
/// activation table, the route map and the memory store all grew at that count, each
/// moving every entry. Split in 64, a table grows 1/64 at a time: the longest wait in
/// the same run of 1.2 million activations was 19–27 ms (`IdMap`'s tests check its
/// answers; the wait was measured with a temporary bench, not kept).
const ID_MAP_SHARDS: usize = 64;

/// A map keyed by actor id, for the runtime's tables that hold one entry per actor (the
/// activation table, the route map, the memory store's actors): split into
/// [`ID_MAP_SHARDS`] tables by the id's hash, so that a table that grows moves 1/64 of
/// the entries. Lookups hash the id once, as a `FastMap`'s do. (Keeping each entry's hash
/// beside it, so that a growing table need not hash its ids again, was measured and not
/// kept: the longest wait stayed about 20 ms, for 24 more bytes per actor.)
pub(crate) struct IdMap<V> {
    /// Inline rather than boxed: a lookup reads no pointer to reach its shard's table.
    shards: [HashTable<Slot<V>>; ID_MAP_SHARDS],
    len: usize,
}

struct Slot<V> {
    id: ActorId,
    value: V,
}

/// The id's FxHash, as a [`FastMap`] computes it.
#[inline]
fn hash_of(id: &ActorId) -> u64 {
    rustc_hash::FxBuildHasher.hash_one(id)
}

/// The shard of a hash: bits 32 to 37, which a table's slot index (the low bits, for any
/// table under 2^32 slots) and its tag (the top 7 bits) do not use, so the entries of one
/// shard still spread over all of its slots and tags.
#[inline]
fn shard_of(hash: u64) -> usize {
    (hash >> 32) as usize & (ID_MAP_SHARDS - 1)
}

/// An entry's hash, for a table that moves its entries.
fn slot_hash<V>(slot: &Slot<V>) -> u64 {
    hash_of(&slot.id)
}

impl<V> Default for IdMap<V> {
    fn default() -> Self {
        Self {
            shards: std::array::from_fn(|_| HashTable::new()),
            len: 0,
        }
    }
}

impl<V> IdMap<V> {
    /// Entries in all shards.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    #[inline]
    pub(crate) fn get(&self, id: &ActorId) -> Option<&V> {
        let hash = hash_of(id);
        self.shards[shard_of(hash)]
            .find(hash, |slot| slot.id == *id)
            .map(|slot| &slot.value)
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, id: &ActorId) -> Option<&mut V> {
        let hash = hash_of(id);
        self.shards[shard_of(hash)]
            .find_mut(hash, |slot| slot.id == *id)
            .map(|slot| &mut slot.value)
    }

    /// Puts `value` under `id`; the value it replaces, if any.
    pub(crate) fn insert(&mut self, id: ActorId, value: V) -> Option<V> {
        match self.entry(id) {
            IdEntry::Occupied(place) => Some(std::mem::replace(place, value)),
            IdEntry::Vacant(vacant) => {
                vacant.insert(value);
                None
            }
        }
    }

    pub(crate) fn remove(&mut self, id: &ActorId) -> Option<V> {
        let hash = hash_of(id);
        let found = self.shards[shard_of(hash)]
            .find_entry(hash, |slot| slot.id == *id)
            .ok()?;
        self.len -= 1;
        Some(found.remove().0.value)
    }

    /// The value under `id`, or the place to put one (which keeps `id`).
    pub(crate) fn entry(&mut self, id: ActorId) -> IdEntry<'_, V> {
        let hash = hash_of(&id);
        let Self { shards, len } = self;
        match shards[shard_of(hash)].entry(hash, |slot| slot.id == id, slot_hash) {
            hash_table::Entry::Occupied(found) => IdEntry::Occupied(&mut found.into_mut().value),
            hash_table::Entry::Vacant(entry) => IdEntry::Vacant(VacantId { entry, id, len }),
        }
    }

    /// The value under `id`, made by `make` (and `id` cloned) only if there is none.
    pub(crate) fn get_or_insert_with(&mut self, id: &ActorId, make: impl FnOnce() -> V) -> &mut V {
        let hash = hash_of(id);
        let Self { shards, len } = self;
        match shards[shard_of(hash)].entry(hash, |slot| slot.id == *id, slot_hash) {
            hash_table::Entry::Occupied(found) => &mut found.into_mut().value,
            hash_table::Entry::Vacant(entry) => {
                *len += 1;
                let slot = Slot {
                    id: id.clone(),
                    value: make(),
                };
                &mut entry.insert(slot).into_mut().value
            }
        }
    }

    /// The most entries any one shard has room for: what its next growth moves.
    #[cfg(test)]
    fn largest_shard_capacity(&self) -> usize {
        self.shards.iter().map(HashTable::capacity).max().unwrap_or(0)
    }

    /// Every value, shard by shard (an order fixed by the ids, as a `FastMap`'s).
    pub(crate) fn values(&self) -> impl Iterator<Item = &V> {
        self.shards
            .iter()
            .flat_map(|shard| shard.iter().map(|slot| &slot.value))
    }

    /// Every id and its value, mutably.
    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = (&ActorId, &mut V)> {
        self.shards
            .iter_mut()
            .flat_map(|shard| shard.iter_mut().map(|slot| (&slot.id, &mut slot.value)))
    }
}

/// [`IdMap::entry`]'s answer.
pub(crate) enum IdEntry<'a, V> {
    Occupied(&'a mut V),
    Vacant(VacantId<'a, V>),
}

/// The place for an id an [`IdMap`] does not hold.
pub(crate) struct VacantId<'a, V> {
    entry: hash_table::VacantEntry<'a, Slot<V>>,
    id: ActorId,
    len: &'a mut usize,
}

impl<'a, V> VacantId<'a, V> {
    pub(crate) fn key(&self) -> &ActorId {
        &self.id
    }

    pub(crate) fn into_key(self) -> ActorId {
        self.id
    }

    pub(crate) fn insert(self, value: V) -> &'a mut V {
        *self.len += 1;
        let slot = Slot { id: self.id, value };
        &mut self.entry.insert(slot).into_mut().value
    }
}

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

    /// Goal: an `IdMap` answers as a `FastMap` does, through growth of its shards, and
    /// keeps its count. Method: 20,000 ids inserted, a third removed, some replaced, each
    /// step mirrored in a `FastMap`; every answer and the final contents compared.
    #[test]
    fn an_id_map_answers_as_a_hash_map_does() {
        let mut map = super::IdMap::default();
        let mut model: super::FastMap<ActorId, u64> = super::FastMap::default();
        let id = |i: u64| ActorId::new("agent", format!("a-{i}")).unwrap();
        for i in 0..20_000 {
            assert_eq!(map.insert(id(i), i), model.insert(id(i), i));
        }
        for i in (0..20_000).step_by(3) {
            assert_eq!(map.remove(&id(i)), model.remove(&id(i)));
        }
        assert_eq!(map.remove(&id(0)), None);
        for i in (1..20_000).step_by(7) {
            assert_eq!(map.insert(id(i), i + 1), model.insert(id(i), i + 1));
        }
        for i in 20_000..20_100 {
            match map.entry(id(i)) {
                super::IdEntry::Vacant(vacant) => {
                    assert_eq!(vacant.key(), &id(i));
                    *vacant.insert(i) += 1;
                }
                super::IdEntry::Occupied(_) => panic!("{i} was never inserted"),
            }
            model.insert(id(i), i + 1);
            *map.get_or_insert_with(&id(i), || unreachable!("present")) += 1;
            *model.get_mut(&id(i)).unwrap() += 1;
        }
        assert_eq!(*map.get_or_insert_with(&id(30_000), || 5), 5);
        model.insert(id(30_000), 5);
        assert_eq!(map.len(), model.len());
        assert!(!map.is_empty());
        for i in 0..30_001 {
            assert_eq!(map.get(&id(i)), model.get(&id(i)), "id {i}");
        }
        let mut all: Vec<(ActorId, u64)> = map.iter_mut().map(|(id, value)| (id.clone(), *value)).collect();
        let mut expected: Vec<(ActorId, u64)> = model.into_iter().collect();
        all.sort();
        expected.sort();
        assert_eq!(all, expected);
        assert_eq!(map.values().count(), map.len());
    }

    /// Goal: the shards share the ids evenly, so that a growth moves a small part of the
    /// map (a shard function that put them all in one shard would make every growth move
    /// them all, as one table did). Method: 100,000 ids of one kind with numbered keys, as
    /// the benchmarks name them; no shard has room for more than 1/16 of them.
    #[test]
    fn an_id_map_s_shards_share_the_ids() {
        let mut map = super::IdMap::default();
        for i in 0..100_000u64 {
            map.insert(ActorId::new("echo", i.to_string()).unwrap(), ());
        }
        let largest = map.largest_shard_capacity();
        assert!(
            largest <= 100_000 / 16,
            "one shard has room for {largest} of 100,000 ids"
        );
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
