//! Durable actor state: the [`StateStore`] trait that every backend implements.
//!
//! An actor has one state blob and a small key-value space of its own. A turn's writes
//! are buffered by the runtime and handed to [`StateStore::commit`] together with the
//! change to the actor's state ([`StateChange`]: unchanged, set or deleted) at the end
//! of the turn; a backend applies the whole commit atomically or not at all. A failed
//! claim or commit is an error the runtime returns to the caller; it never falls back to
//! a default state.
//!
//! Exclusive ownership is fenced ([`Fence`]): an activation starts with
//! [`StateStore::claim`], which issues the actor a fence newer than any before and
//! loads its state in one atomic step, and makes every commit under that fence. A store
//! refuses a commit under any fence but the actor's newest with [`StoreError::Fenced`],
//! writing nothing, so two runtimes on one store cannot both commit for one actor and
//! lose each other's updates: the older activation's commits fail.
//!
//! ```text
//! runtime A: claim(c) → fence 1, state s0      commit(c, fence 1, …) ✓
//! runtime B:            claim(c) → fence 2, s1  commit(c, fence 2, …) ✓
//! runtime A:                                    commit(c, fence 1, …) ✗ Fenced { held 1, current 2 }
//! ```
//!
//! Reads ([`StateStore::load`], [`StateStore::get`], [`StateStore::scan`]) are not
//! fenced: a stale activation may read, but what it computes from them never commits.
//!
//! Backends: [`crate::MemoryStore`] (tests and simulation, with fault injection) and
//! [`crate::SqliteStore`] (the embedded durable default, one file). Both pass the
//! conformance suite in `tests/state_store_conformance.rs`.

use std::fmt;

use async_trait::async_trait;
use bytes::Bytes;
use troupe_core::ActorId;
pub use troupe_core::{Fence, StoreError, StoreItem, StoreOperation};

/// Longest key in an actor's key-value space, in bytes.
pub const STATE_KEY_LENGTH_MAX: usize = 512;
/// Largest value, or state blob, a store accepts, in bytes.
pub const STATE_VALUE_SIZE_MAX: usize = 16 * 1024 * 1024;
/// Most writes one turn may buffer before committing.
pub const TURN_WRITES_MAX: usize = 4_096;
/// Most entries one [`StateStore::scan`] returns.
pub const STATE_SCAN_LIMIT_MAX: usize = 10_000;

/// What a commit does to the actor's state blob.
///
/// Three values, because "leave it as it is" and "it has none now" differ: an actor
/// whose snapshot goes from `Some` to `None` has cleared its state, and must be built
/// from `None` when it is next activated.
#[derive(Clone, Default, PartialEq, Eq)]
pub enum StateChange {
    /// The state blob stays as it is (or absent, if there is none).
    #[default]
    Unchanged,
    /// The state blob becomes these bytes.
    Set(Bytes),
    /// The state blob is removed: [`StateStore::load`] and [`StateStore::claim`] return
    /// `None` afterwards. The actor's key-value space is not touched.
    Deleted,
}

impl StateChange {
    /// The change that turns the committed snapshot `before` into `after`: `Unchanged`
    /// if they are equal, else `Set` or, for `after == None`, `Deleted`.
    #[inline]
    pub fn between(before: Option<&Bytes>, after: Option<Bytes>) -> Self {
        let unchanged = match (before, after.as_ref()) {
            (None, None) => true,
            (Some(before), Some(after)) => same_bytes(before, after),
            _ => false,
        };
        if unchanged {
            return Self::Unchanged;
        }
        match after {
            Some(state) => Self::Set(state),
            None => Self::Deleted,
        }
    }

    /// The state blob after this change is applied to `before`.
    pub fn applied_to(&self, before: Option<Bytes>) -> Option<Bytes> {
        match self {
            Self::Unchanged => before,
            Self::Set(state) => Some(state.clone()),
            Self::Deleted => None,
        }
    }
}

/// Whether two snapshots hold the same bytes, without calling `memcmp` for empty ones.
///
/// An empty `Bytes` made from an empty `Vec` (a stateless typed actor's snapshot, every
/// turn) points at a dangling address; glibc's AVX-512 `memcmp` reads even zero bytes
/// with a masked load from it, and a masked load from an unmapped page costs the CPU a
/// microcode assist: measured (perf, 2026-11-25) at 30 % of a typed `tell`'s time.
fn same_bytes(before: &[u8], after: &[u8]) -> bool {
    before.len() == after.len() && (before.is_empty() || before.as_ptr() == after.as_ptr() || before == after)
}

impl fmt::Debug for StateChange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unchanged => f.write_str("Unchanged"),
            Self::Set(state) => write!(f, "Set({} bytes)", state.len()),
            Self::Deleted => f.write_str("Deleted"),
        }
    }
}

/// Everything one turn changes, applied atomically.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct TurnCommit {
    /// What happens to the actor's state blob.
    pub state: StateChange,
    /// Key-value writes in order; `None` deletes the key.
    pub writes: Vec<(String, Option<Bytes>)>,
}

impl TurnCommit {
    /// Whether the commit changes nothing.
    pub fn is_empty(&self) -> bool {
        self.state == StateChange::Unchanged && self.writes.is_empty()
    }

    /// Checks every limit; backends call this before writing anything.
    ///
    /// # Errors
    /// [`StoreError::TooLarge`] or [`StoreError::TooManyWrites`].
    pub fn validate(&self) -> Result<(), StoreError> {
        if self.writes.len() > TURN_WRITES_MAX {
            return Err(StoreError::TooManyWrites {
                count: self.writes.len(),
                limit: TURN_WRITES_MAX,
            });
        }
        if let StateChange::Set(state) = &self.state {
            check_value(state)?;
        }
        for (key, value) in &self.writes {
            check_key(key)?;
            if let Some(value) = value {
                check_value(value)?;
            }
        }
        Ok(())
    }
}

impl fmt::Debug for TurnCommit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TurnCommit")
            .field("state", &self.state)
            .field("writes", &self.writes.len())
            .finish()
    }
}

/// Checks a key against [`STATE_KEY_LENGTH_MAX`].
///
/// # Errors
/// [`StoreError::TooLarge`] if the key is longer than the limit.
pub fn check_key(key: &str) -> Result<(), StoreError> {
    if key.len() > STATE_KEY_LENGTH_MAX {
        return Err(StoreError::TooLarge {
            what: StoreItem::Key,
            size: key.len(),
            limit: STATE_KEY_LENGTH_MAX,
        });
    }
    Ok(())
}

fn check_value(value: &Bytes) -> Result<(), StoreError> {
    if value.len() > STATE_VALUE_SIZE_MAX {
        return Err(StoreError::TooLarge {
            what: StoreItem::Value,
            size: value.len(),
            limit: STATE_VALUE_SIZE_MAX,
        });
    }
    Ok(())
}

/// What [`StateStore::claim`] returns: the new fence and the state it was issued with.
#[derive(Clone, PartialEq, Eq)]
pub struct Claimed {
    /// The actor's new fence, newer than every fence issued for it before; commits under
    /// it are accepted until the actor is claimed again.
    pub fence: Fence,
    /// The actor's last committed state blob at the moment of the claim, or `None` if it
    /// has none (never committed one, or deleted it).
    pub state: Option<Bytes>,
}

impl fmt::Debug for Claimed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Claimed")
            .field("fence", &self.fence)
            .field("state_bytes", &self.state.as_ref().map(Bytes::len))
            .finish()
    }
}

/// Where actors keep their state between activations.
///
/// Implementations must be safe to share between actor tasks. Every method may fail;
/// callers surface the error, they never substitute a default.
///
/// The fencing contract, which the conformance suite checks: per actor, the fences that
/// [`StateStore::claim`] issues strictly increase, across every handle on the same
/// underlying data (two [`crate::SqliteStore`]s opened on one file, clones of one
/// [`crate::MemoryStore`]); a commit is applied only if its fence is the actor's
/// newest, checked in the same atomic step that applies it.
#[async_trait]
pub trait StateStore: Send + Sync + 'static {
    /// Claims `actor`'s state for a new activation: in one atomic step, issues a fence
    /// newer than any issued for `actor` before (which fences off every older one) and
    /// reads the actor's last committed state blob.
    ///
    /// # Errors
    /// [`StoreError`] if the backend fails; then no fence was issued, and the caller
    /// must not start the actor from a default state.
    async fn claim(&self, actor: &ActorId) -> Result<Claimed, StoreError>;

    /// [`StateStore::claim`] done at once, without a future, by a store that can (its
    /// data in this process, behind a lock held only briefly): `None` if it cannot, and
    /// then the runtime awaits `claim`. The default is `None`. A store that answers
    /// `Some` must answer exactly as `claim` would (the same fences, the same faults):
    /// an activation's start then costs no boxed future for its claim (`MemoryStore`
    /// implements `claim` as this; see "Thirtieth pass" in docs/architecture.md).
    fn claim_now(&self, _actor: &ActorId) -> Option<Result<Claimed, StoreError>> {
        None
    }

    /// Whether this store may fail an operation for a moment, with
    /// [`StoreError::Unavailable`]. The runtime tries a claim or a commit that failed so
    /// again, within the deadline of the request it serves; to try a commit again it
    /// needs the commit's writes, which [`StateStore::commit`] takes, so for a store that
    /// may be unavailable it keeps a copy of a turn's writes until its commit is made
    /// (a commit without writes needs no copy). The default is `true`; a store that
    /// never answers `Unavailable` may answer `false` to spare the copy, as
    /// [`crate::MemoryStore`] does (it fails only by injected faults, which are not
    /// transient). A store that answers `false` and then `Unavailable` for a commit with
    /// writes sees that commit fail at once, as before the runtime tried again.
    fn may_be_unavailable(&self) -> bool {
        true
    }

    /// The actor's last committed state blob, or `None` if it has none; a plain read
    /// that claims nothing (for tools that inspect state, not for activations).
    ///
    /// # Errors
    /// [`StoreError`] if the backend fails; the caller must not treat that as `None`.
    async fn load(&self, actor: &ActorId) -> Result<Option<Bytes>, StoreError>;

    /// Applies `commit` atomically if `fence` is `actor`'s newest fence: afterwards
    /// either all of it is visible or none. Every commit is checked, an empty one too.
    ///
    /// # Errors
    /// [`StoreError::Fenced`] if `actor` was claimed after `fence` was issued, or never
    /// under `fence`; [`StoreError::TooLarge`] or [`StoreError::TooManyWrites`] if the
    /// commit breaks a limit ([`TurnCommit::validate`]); [`StoreError::Backend`] (or
    /// [`StoreError::Injected`]) if the backend fails. In every case nothing of the
    /// commit is visible.
    async fn commit(&self, actor: &ActorId, fence: Fence, commit: TurnCommit) -> Result<(), StoreError>;

    /// Whether `fence` is still `actor`'s newest fence: what [`StateStore::commit`] would
    /// find, without writing anything. For a turn to learn that its activation is stale
    /// (another runtime on the same data claimed the actor since) before it does
    /// expensive work whose commit would be refused ([`crate::Turn::check_fence`]).
    ///
    /// Advisory: `Ok(())` does not promise that a commit under `fence` will be accepted
    /// (a claim may come in between; the commit checks again), but `Err(Fenced)` means
    /// that every commit under `fence` will be refused. The default answers `Ok(())`
    /// without looking: a store that cannot check cheaply leaves it to the commit.
    ///
    /// # Errors
    /// [`StoreError::Fenced`] (as [`StateStore::commit`] gives it, with the newest fence)
    /// if `actor` was claimed after `fence` was issued, or never under `fence`;
    /// [`StoreError::Backend`] (or [`StoreError::Injected`]) if the backend fails.
    async fn check_fence(&self, actor: &ActorId, fence: Fence) -> Result<(), StoreError> {
        let _ = (actor, fence);
        Ok(())
    }

    /// One committed value from the actor's key-value space.
    ///
    /// # Errors
    /// [`StoreError`] if the backend fails.
    async fn get(&self, actor: &ActorId, key: &str) -> Result<Option<Bytes>, StoreError>;

    /// Up to `limit` (at most [`STATE_SCAN_LIMIT_MAX`]) committed entries whose keys start
    /// with `prefix`, in key order, starting after `after` if given.
    ///
    /// # Errors
    /// [`StoreError`] if the backend fails.
    async fn scan(
        &self,
        actor: &ActorId,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Bytes)>, StoreError>;
}

/// The identity stored in the SQLite store file at `path`
/// ([`crate::SqliteStore::identity`]), read by opening the file as
/// [`crate::SqliteStore::open`] does (which gives a file that has none its identity
/// first). For crates that take a store's identity by its path without depending on
/// this crate's `sqlite` feature (`troupe_cluster::sqlite_store_identity`): it answers
/// whenever anything in the build enables the feature, as a program that uses a
/// `SqliteStore` does.
///
/// # Errors
/// As [`crate::SqliteStore::open`] (it creates a file that does not exist: check first
/// if that matters); [`StoreError::Backend`] with operation `"open"` if this build of
/// the crate has no SQLite (the `sqlite` feature is off).
pub fn sqlite_file_identity(path: &std::path::Path) -> Result<String, StoreError> {
    #[cfg(feature = "sqlite")]
    {
        crate::SqliteStore::open(path).map(|store| store.identity().to_string())
    }
    #[cfg(not(feature = "sqlite"))]
    {
        Err(StoreError::Backend {
            operation: StoreOperation::Open,
            cause: format!(
                "cannot read the identity of {}: this build of troupe-runtime has no SQLite (its `sqlite` feature \
                 is off)",
                path.display()
            ),
        })
    }
}

/// A store that also accepts fences issued outside it: a cluster's placement service
/// (the etcd revision of the key that names the actor's owner) hands out the fencing
/// token, and the store holds every claim and commit to it.
///
/// [`FencedClaim::claim_with_fence`] is [`StateStore::claim`] with the fence chosen by
/// the caller instead of the store. It is accepted only if the fence is newer than the
/// actor's newest (from either kind of claim), so a stale owner that claims again with
/// its old token is refused, and once the new owner has claimed, the old owner's
/// commits are refused as for any other fence.
#[async_trait]
pub trait FencedClaim: StateStore {
    /// Claims `actor` under `fence`: in one atomic step, checks that `fence` is newer
    /// than the actor's newest fence, makes it the newest (fencing off every older one)
    /// and reads the actor's last committed state blob.
    ///
    /// # Errors
    /// [`StoreError::Fenced`] (with `held: fence` and the newer `current`) if the
    /// actor's newest fence is `fence` or newer; then nothing changed.
    /// [`StoreError::Backend`] (or [`StoreError::Injected`]) if the backend fails; then
    /// no fence was issued.
    async fn claim_with_fence(&self, actor: &ActorId, fence: Fence) -> Result<Claimed, StoreError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_change_between_snapshots_tells_unchanged_set_and_deleted_apart() {
        let one = Bytes::from_static(b"1");
        let two = Bytes::from_static(b"2");
        assert_eq!(StateChange::between(None, None), StateChange::Unchanged);
        assert_eq!(
            StateChange::between(Some(&one), Some(one.clone())),
            StateChange::Unchanged
        );
        assert_eq!(
            StateChange::between(None, Some(one.clone())),
            StateChange::Set(one.clone())
        );
        assert_eq!(
            StateChange::between(Some(&one), Some(two.clone())),
            StateChange::Set(two.clone())
        );
        assert_eq!(StateChange::between(Some(&one), None), StateChange::Deleted);
    }

    /// The shortcuts of `same_bytes` (empty, same address) give what a byte compare
    /// gives: empty snapshots of either origin, equal bytes at other addresses, one
    /// byte apart, a prefix, and an empty against a non-empty one.
    #[test]
    fn state_change_between_compares_bytes_whatever_their_origin() {
        let empty_vec = Bytes::from(Vec::new());
        let empty_static = Bytes::from_static(b"");
        assert_eq!(
            StateChange::between(Some(&empty_vec), Some(empty_static.clone())),
            StateChange::Unchanged
        );
        let ab = Bytes::from(b"ab".to_vec());
        assert_eq!(
            StateChange::between(Some(&ab), Some(Bytes::from_static(b"ab"))),
            StateChange::Unchanged
        );
        for other in [&b"ac"[..], b"a", b"abc", b""] {
            let other = Bytes::copy_from_slice(other);
            assert_eq!(
                StateChange::between(Some(&ab), Some(other.clone())),
                StateChange::Set(other.clone())
            );
            assert_eq!(
                StateChange::between(Some(&other), Some(ab.clone())),
                StateChange::Set(ab.clone())
            );
        }
    }

    #[test]
    fn state_change_applied_to_a_snapshot_gives_the_new_snapshot() {
        let one = Bytes::from_static(b"1");
        let two = Bytes::from_static(b"2");
        assert_eq!(StateChange::Unchanged.applied_to(Some(one.clone())), Some(one.clone()));
        assert_eq!(StateChange::Unchanged.applied_to(None), None);
        assert_eq!(StateChange::Set(two.clone()).applied_to(Some(one.clone())), Some(two));
        assert_eq!(StateChange::Deleted.applied_to(Some(one)), None);
    }
}
