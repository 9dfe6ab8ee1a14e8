//! Size caps on text that never split a UTF-8 character.

/// Returns the longest prefix of `text` that is at most `limit_bytes` long and ends on a
/// character boundary.
///
/// # Examples
/// ```
/// assert_eq!(troupe_core::truncate_utf8("héllo", 2), "h");
/// assert_eq!(troupe_core::truncate_utf8("héllo", 3), "hé");
/// ```
pub fn truncate_utf8(text: &str, limit_bytes: usize) -> &str {
    if text.len() <= limit_bytes {
        return text;
    }
    let mut end = limit_bytes;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn truncation_is_a_prefix_on_a_boundary_within_the_limit(text in ".{0,40}", limit in 0usize..80) {
            let cut = truncate_utf8(&text, limit);
            prop_assert!(cut.len() <= limit);
            prop_assert!(text.starts_with(cut));
            // Maximal: adding the next character would exceed the limit.
            if cut.len() < text.len() {
                let next = text[cut.len()..].chars().next().unwrap();
                prop_assert!(cut.len() + next.len_utf8() > limit);
            }
        }
    }
}
