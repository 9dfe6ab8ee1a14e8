//! The key of the in-memory store's ordered maps: a `String` in `str`'s order (byte by
//! byte), compared a word at a time.
//!
//! An actor's entries sit in a `BTreeMap`, whose search compares the new key with every
//! key of a node, up to eleven, on each level on its way down. The keys an agent writes
//! most share a long prefix (`log/` and twenty digits, `msg/`, `id/call:...`) and are
//! appended at the end of their range, so an insert into a log of a few thousand
//! entries made about 45 comparisons, each reaching glibc's `memcmp` through a call for
//! keys that differ only in their last bytes: about 1,500 instructions per insert
//! (callgrind, docs/architecture.md "Where an agent call's time goes").
//!
//! So an owned [`Key`] carries its first [`KEY_HEAD_BYTES`] bytes as four big-endian
//! words, zero-padded, beside the string: two keys whose heads differ are ordered by the
//! heads (four integer comparisons, no pointer followed), and only keys whose heads
//! agree are compared through their text, a word at a time ([`compare`]). Why the heads
//! order as the strings do: if two heads first differ at byte `i`, the keys agree on
//! bytes `0..i`; if both have a byte `i`, those bytes decide, as the heads say; if one
//! key ends before `i` (its head is padded with zero there), the other has a non-zero
//! byte `i`, and the shorter key is a prefix of the longer, so it sorts first, as its
//! zero does. Lookups and ranges take a borrowed [`KeyStr`], compared through the text.

use std::borrow::Borrow;
use std::cmp::Ordering;

use ref_cast::RefCast;

/// The bytes of a key kept beside it as words, for comparisons that need not follow its
/// pointer: the log's keys (24 bytes) and most message and id keys fit.
pub(crate) const KEY_HEAD_BYTES: usize = 32;

/// An owned key, ordered as [`KeyStr`] (and so as `str`), by its head first.
#[derive(Debug, Clone)]
pub(crate) struct Key {
    /// The first [`KEY_HEAD_BYTES`] bytes as big-endian words, zero-padded.
    head: [u64; KEY_HEAD_BYTES / 8],
    text: String,
}

impl Key {
    pub(crate) fn new(text: String) -> Self {
        let mut padded = [0_u8; KEY_HEAD_BYTES];
        let kept = text.len().min(KEY_HEAD_BYTES);
        padded[..kept].copy_from_slice(&text.as_bytes()[..kept]);
        let mut head = [0_u64; KEY_HEAD_BYTES / 8];
        for (word, bytes) in head.iter_mut().zip(padded.chunks_exact(8)) {
            *word = u64::from_be_bytes(bytes.try_into().expect("eight bytes"));
        }
        Self { head, text }
    }

    pub(crate) fn as_str(&self) -> &str {
        &self.text
    }
}

impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}

impl Eq for Key {}

impl Ord for Key {
    #[inline]
    fn cmp(&self, other: &Self) -> Ordering {
        // Word by word, unrolled (an array's `cmp` went through a slice comparison
        // loop, out of line).
        for (mine, theirs) in self.head.iter().zip(&other.head) {
            if mine != theirs {
                return mine.cmp(theirs);
            }
        }
        compare(self.text.as_bytes(), other.text.as_bytes())
    }
}

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// A borrowed key: a `str` with the same order, compared a word at a time; what lookups
/// and ranges of a `BTreeMap<Key, _>` take.
#[derive(Debug, PartialEq, Eq, RefCast)]
#[repr(transparent)]
pub(crate) struct KeyStr(str);

impl KeyStr {
    pub(crate) fn new(key: &str) -> &Self {
        Self::ref_cast(key)
    }
}

impl Ord for KeyStr {
    #[inline]
    fn cmp(&self, other: &Self) -> Ordering {
        compare(self.0.as_bytes(), other.0.as_bytes())
    }
}

impl PartialOrd for KeyStr {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Borrow<KeyStr> for Key {
    fn borrow(&self) -> &KeyStr {
        KeyStr::new(&self.text)
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

        /// Owned keys order as their strings do where heads decide and where they tie:
        /// strings from a few bytes, NUL among them (a padded head's byte), around the
        /// head's length.
        #[test]
        fn owned_keys_order_as_their_strings_around_the_head(
            prefix in "[a\\x00]{0,40}",
            a in "[ab\\x00]{0,6}",
            b in "[ab\\x00]{0,6}",
        ) {
            let (a, b) = ([prefix.as_str(), &a].concat(), [prefix.as_str(), &b].concat());
            let (key_a, key_b) = (Key::new(a.clone()), Key::new(b.clone()));
            proptest::prop_assert_eq!(key_a.cmp(&key_b), a.cmp(&b));
            proptest::prop_assert_eq!(key_a.cmp(&key_b), KeyStr::new(&a).cmp(KeyStr::new(&b)));
            proptest::prop_assert_eq!(key_a == key_b, a == b);
        }

        /// Keys and borrowed keys order as their strings do.
        #[test]
        fn keys_order_as_their_strings(a in "[a-c/0-9]{0,30}", b in "[a-c/0-9]{0,30}") {
            let (key_a, key_b) = (Key::new(a.clone()), Key::new(b.clone()));
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
            assert_eq!(
                Key::new(pair[0].clone()).cmp(&Key::new(pair[1].clone())),
                Ordering::Less
            );
        }
        assert_eq!(KeyStr::new("log/").cmp(KeyStr::new("log/0")), Ordering::Less);
        assert_eq!(KeyStr::new("").cmp(KeyStr::new("")), Ordering::Equal);
    }
}
