//! [`StoreError`]: what a state store could not do.
//!
//! It lives in the core, not beside the `StateStore` trait in `troupe-runtime`, because
//! [`crate::InvokeError::StorageFailed`] carries it as its typed `source()`, and an
//! `InvokeError` crosses nodes: so the error is plain data (serializable, comparable),
//! with the operation and the item over a limit as enums rather than strings.
//! `troupe_runtime::StoreError` re-exports it unchanged.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::{ActorId, Fence};

/// The store operation that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum StoreOperation {
    /// Opening the store (a file, a connection, its schema).
    Open,
    /// Reading an actor's state blob without claiming it.
    Load,
    /// Claiming an actor's state: issuing a fence and loading its state.
    Claim,
    /// Committing a turn.
    Commit,
    /// Reading one key of an actor's key-value space.
    Get,
    /// Scanning a prefix of an actor's key-value space.
    Scan,
    /// Decoding a stored value, in a layer above the store.
    Decode,
}

impl fmt::Display for StoreOperation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Open => "open",
            Self::Load => "load",
            Self::Claim => "claim",
            Self::Commit => "commit",
            Self::Get => "get",
            Self::Scan => "scan",
            Self::Decode => "decode",
        })
    }
}

/// What is over a size limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum StoreItem {
    /// A key of an actor's key-value space (or a scan prefix).
    Key,
    /// A value, or an actor's state blob.
    Value,
}

impl fmt::Display for StoreItem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Key => "key",
            Self::Value => "value",
        })
    }
}

/// What a store could not do. Whatever the variant, a failed commit wrote nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum StoreError {
    /// The backend failed (I/O, lock, database error).
    #[error("{operation} failed: {cause}")]
    Backend {
        /// What the store was doing.
        operation: StoreOperation,
        /// The backend's error, as text (backend errors are neither serializable nor
        /// comparable).
        cause: String,
    },
    /// A fault injected by a test or the simulator.
    #[error("{operation} failed: injected fault")]
    Injected {
        /// The operation that was made to fail.
        operation: StoreOperation,
    },
    /// A key or value is over its limit; nothing was written.
    #[error("{what} is {size} bytes, more than the limit of {limit}")]
    TooLarge {
        /// A key or a value.
        what: StoreItem,
        /// Its size in bytes.
        size: usize,
        /// The limit in bytes.
        limit: usize,
    },
    /// A turn buffered more writes than the limit (`TURN_WRITES_MAX` in the runtime).
    #[error("a turn buffered {count} writes, more than the limit of {limit}")]
    TooManyWrites {
        /// Writes buffered.
        count: usize,
        /// The limit.
        limit: usize,
    },
    /// The commit was made under `held`, but `actor` has been claimed since (by another
    /// activation, perhaps in another runtime on the same store): the commit was
    /// refused and wrote nothing. The activation that holds `held` is stale; its actor
    /// must be activated again (which claims a new fence) before it can commit.
    #[error(
        "commit for {actor} was fenced off: it holds {held}, but {}",
        display_newest(current)
    )]
    Fenced {
        /// The actor whose commit was refused.
        actor: ActorId,
        /// The fence the commit was made under.
        held: Fence,
        /// The actor's newest fence, or `None` if the store holds no claim for it.
        current: Option<Fence>,
    },
    /// A cluster node refused to claim `actor`: the cluster's placement names another
    /// node as its owner (`owner`), or this node has lost its membership (`owner:
    /// None`). Nothing ran and nothing was written; the caller should look the owner up
    /// again and send the request there.
    #[error("{actor} is not owned by this node: {}", display_owner(owner))]
    NotOwner {
        /// The actor.
        actor: ActorId,
        /// The node the placement names, if this node could tell.
        owner: Option<String>,
    },
    /// A turn tried to write (or delete) a key under a prefix the runtime keeps for its
    /// own records in every actor's key-value space (`troupe_runtime`'s
    /// `IDEMPOTENCY_STORE_PREFIX`); nothing was written. Reading such keys is allowed.
    #[error("key {key:?} starts with {prefix:?}, which the runtime keeps for its own records")]
    ReservedKey {
        /// The key refused.
        key: String,
        /// The reserved prefix it starts with.
        prefix: String,
    },
}

fn display_owner(owner: &Option<String>) -> String {
    match owner {
        Some(owner) => format!("it is placed on node {owner}"),
        None => "this node has lost its cluster lease".to_string(),
    }
}

fn display_newest(current: &Option<Fence>) -> String {
    match current {
        Some(current) => format!("the newest claim holds {current}"),
        None => "the store holds no claim for it".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fenced_error_names_the_actor_the_fence_held_and_the_newest_one() {
        let error = StoreError::Fenced {
            actor: ActorId::new("counter", "c").unwrap(),
            held: Fence::FIRST,
            current: Some(Fence::FIRST.next()),
        };
        assert_eq!(
            error.to_string(),
            "commit for counter/c was fenced off: it holds fence 1, but the newest claim holds fence 2"
        );
    }

    #[test]
    fn store_error_survives_a_bincode_round_trip() {
        let errors = [
            StoreError::Backend {
                operation: StoreOperation::Commit,
                cause: "disk full".to_string(),
            },
            StoreError::TooLarge {
                what: StoreItem::Key,
                size: 600,
                limit: 512,
            },
            StoreError::Fenced {
                actor: ActorId::new("counter", "c").unwrap(),
                held: Fence::FIRST,
                current: None,
            },
            StoreError::ReservedKey {
                key: "\u{0}troupe/idem/next".to_string(),
                prefix: "\u{0}troupe/idem/".to_string(),
            },
        ];
        for error in errors {
            let bytes = bincode::serialize(&error).unwrap();
            assert_eq!(bincode::deserialize::<StoreError>(&bytes).unwrap(), error);
        }
    }
}
