//! The key of the in-memory store's ordered maps: a `String` in `str`'s order (byte by
//! byte), compared eight bytes at a time.
//!
//! An actor's entries sit in a `BTreeMap`, whose search compares the new key with up to
//! eleven keys per node on its way down. The keys an agent writes most share a long
//! prefix (`log/` and twenty digits, `msg/`, `id/call:...`), so `String`'s comparison
//! reached glibc's `memcmp` every time, through a call, for keys that differ only in
//! their last bytes: about 1,500 instructions per insert into a log of a few thousand
//! entries (callgrind, docs/architecture.md "Where an agent call's time goes"). Eight
//! bytes read as a big-endian `u64` compare as those bytes do, so the same order costs a
//! few instructions per eight bytes, inline.

use std::borrow::Borrow;
use std::cmp::Ordering;

use ref_cast::RefCast;

/// An owned key, ordered as [`KeyStr`] (and so as `str`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Key(pub(crate) String);

/// A borrowed key: a `str` with the same order, compared faster; what lookups and
/// ranges of a `BTreeMap<Key, _>` take.
#[derive(Debug, PartialEq, Eq, RefCast)]
#[repr(transparent)]
pub(crate) struct KeyStr(str);

impl KeyStr {
    pub(crate) fn new(key: &str) -> &Self {
        Self::ref_cast(key)
    }
}

impl Ord for KeyStr {
    fn cmp(&self, other: &Self) -> Ordering {
        compare(self.0.as_bytes(), other.0.as_bytes())
    }
}

impl PartialOrd for KeyStr {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Key {
    fn cmp(&self, other: &Self) -> Ordering {
        compare(self.0.as_bytes(), other.0.as_bytes())
    }
}

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Borrow<KeyStr> for Key {
    fn borrow(&self) -> &KeyStr {
        KeyStr::new(&self.0)
    }
}

/// `a.cmp(b)` for byte strings: whole eight-byte words first (as big-endian numbers,
/// which order as their bytes do), then the bytes left, then the lengths.
#[inline]
fn compare(a: &[u8], b: &[u8]) -> Ordering {
    let shorter = a.len().min(b.len());
    let mut at = 0;
    while at + 8 <= shorter {
        let x = u64::from_be_bytes(a[at..at + 8].try_into().expect("eight bytes"));
        let y = u64::from_be_bytes(b[at..at + 8].try_into().expect("eight bytes"));
        if x != y {
            return x.cmp(&y);
        }
        at += 8;
    }
    while at < shorter {
        if a[at] != b[at] {
            return a[at].cmp(&b[at]);
        }
        at += 1;
    }
    a.len().cmp(&b.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// Any two byte strings compare as slices do, also when they share a long
        /// prefix (the common case in the store: the prefix is drawn from a few bytes).
        #[test]
        fn bytes_compare_as_slices_do(
            prefix in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..40),
            a in proptest::collection::vec(0u8..4, 0..20),
            b in proptest::collection::vec(0u8..4, 0..20),
        ) {
            let a = [prefix.as_slice(), &a].concat();
            let b = [prefix.as_slice(), &b].concat();
            proptest::prop_assert_eq!(compare(&a, &b), a.as_slice().cmp(b.as_slice()));
            proptest::prop_assert_eq!(compare(&b, &a), b.as_slice().cmp(a.as_slice()));
            proptest::prop_assert_eq!(compare(&a, &a), Ordering::Equal);
        }

        /// Keys and borrowed keys order as their strings do.
        #[test]
        fn keys_order_as_their_strings(a in "[a-c/0-9]{0,30}", b in "[a-c/0-9]{0,30}") {
            let (key_a, key_b) = (Key(a.clone()), Key(b.clone()));
            proptest::prop_assert_eq!(key_a.cmp(&key_b), a.cmp(&b));
            proptest::prop_assert_eq!(KeyStr::new(&a).cmp(KeyStr::new(&b)), a.cmp(&b));
            proptest::prop_assert_eq!(key_a == key_b, a == b);
        }
    }

    #[test]
    fn zero_padded_log_keys_sort_by_their_number() {
        let keys: Vec<String> = [0_u64, 9, 10, 99, 100, 12_345_678_901, u64::MAX]
            .iter()
            .map(|seq| format!("log/{seq:020}"))
            .collect();
        for pair in keys.windows(2) {
            assert_eq!(Key(pair[0].clone()).cmp(&Key(pair[1].clone())), Ordering::Less);
        }
        assert_eq!(KeyStr::new("log/").cmp(KeyStr::new("log/0")), Ordering::Less);
        assert_eq!(KeyStr::new("").cmp(KeyStr::new("")), Ordering::Equal);
    }
}
