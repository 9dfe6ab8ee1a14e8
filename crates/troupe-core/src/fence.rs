//! [`Fence`]: the token that makes a claim on an actor's state exclusive.
//!
//! Activating an actor claims its state: the store issues a fence newer than every
//! fence issued for that actor before, and from then on refuses a commit made under any
//! other fence. A stale activation (one whose actor was claimed again elsewhere, say by a
//! second runtime on the same file) therefore cannot overwrite what the newer one
//! committed: its commit fails with `StoreError::Fenced` and writes nothing.
//!
//! The token is an opaque, per-actor, strictly increasing number: the epoch of the
//! actor's owner record in a local store; in a cluster, the etcd revision of the
//! directory key that names the owner. Only order and equality mean anything.
//! This is the `Owns(n)` guard of the `Turn` action in `docs/tla/ActorLifecycle.tla`.

use std::fmt;
use std::num::NonZeroU64;

use serde::{Deserialize, Serialize};

/// A claim token for one actor's state; see the module documentation.
///
/// Fences of one actor are totally ordered: a later claim has a greater fence. Fences of
/// different actors are unrelated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Fence(NonZeroU64);

impl Fence {
    /// The fence of an actor's first claim.
    pub const FIRST: Self = Self(NonZeroU64::MIN);

    /// The fence with token `token`, or `None` for zero, which no claim ever issues.
    pub fn from_token(token: u64) -> Option<Self> {
        NonZeroU64::new(token).map(Self)
    }

    /// The token as a number, as a backend stores it.
    pub fn token(self) -> u64 {
        self.0.get()
    }

    /// The fence the claim after this one issues.
    ///
    /// # Panics
    /// If the token is `u64::MAX`: a store would need to claim one actor once a
    /// nanosecond for 584 years to get there.
    #[must_use]
    pub fn next(self) -> Self {
        Self(self.0.checked_add(1).expect("an actor's fence token overflowed u64"))
    }
}

impl fmt::Display for Fence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "fence {}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_next_fence_is_greater_and_zero_is_no_fence() {
        assert_eq!(Fence::from_token(0), None);
        assert_eq!(Fence::FIRST.token(), 1);
        assert_eq!(Fence::FIRST.next().token(), 2);
        assert!(Fence::FIRST < Fence::FIRST.next());
        assert_eq!(Fence::from_token(7).map(Fence::token), Some(7));
        assert_eq!(Fence::FIRST.next().to_string(), "fence 2");
    }
}
