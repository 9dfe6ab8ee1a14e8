//! [`StoreError`]: what a state store could not do.
//!
//! It lives in the core, not beside the `StateStore` trait in `troupe-runtime`, because
//! [`crate::InvokeError::StorageFailed`] carries it as its typed `source()`, and an
//! `InvokeError` crosses nodes: so the error is plain data (serializable, comparable),
//! with the operation and the item over a limit as enums rather than strings.
//! `troupe_runtime::StoreError` re-exports it unchanged.
//!
//! **Transient failures.** [`StoreError::Unavailable`] is a store that failed for a
//! moment (its connection refused, reset or closed, its server shutting down or starting
//! up, a file locked by another process, no pooled connection in time): the same
//! operation may succeed if tried again, and the runtime tries a claim or a commit again
//! within the deadline of the request it serves ([`StoreError::is_transient`]). Every
//! other variant is not transient: the operation would fail the same way again, or (a
//! fence refused, an owner elsewhere) the activation itself must be replaced.
//!
//! **On the wire** `Unavailable` is encoded exactly as [`StoreError::Backend`] with the
//! same fields (bincode numbers variants, and nodes of one transport protocol version
//! must decode each other's errors): a node that receives it sees `Backend`, with the
//! same text. Transience matters only where the store is reached: by the time another
//! node sees the error, the node that served the request has tried again until the
//! request's deadline. Every other variant is encoded as it always was.

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

/// What a store could not do. Whatever the variant, a failed commit wrote nothing, with
/// the one exception said at [`StoreError::Unavailable`]: a commit whose connection
/// failed while its last step (PostgreSQL's `COMMIT`) was on its way.
///
/// Encoded by serde as before `Unavailable` existed (see the module documentation);
/// decoding takes every variant.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Deserialize)]
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
    /// The backend failed for a moment and the same operation may succeed if tried
    /// again ([`StoreError::is_transient`]): its connection was refused, reset or closed,
    /// its server is shutting down or starting up, the file is locked by another process
    /// for longer than the store waits, or no pooled connection came in time. Its text
    /// is [`StoreError::Backend`]'s, and so is its encoding (see the module
    /// documentation).
    ///
    /// What was written: nothing, except for a commit whose connection failed while its
    /// last step was on its way (PostgreSQL's `COMMIT` sent, its answer lost): then the
    /// store may have applied it. A commit is a set of absolute writes made under one
    /// fence, so the same commit made again under the same fence leaves the store as
    /// one application would (or is refused, [`StoreError::Fenced`], if the actor was
    /// claimed since): that is how the runtime settles it, trying the commit again until
    /// it is made or the request's deadline passes. A runtime that gives up on such a
    /// commit closes the activation, so that the next one reads what the store holds.
    #[error("{operation} failed: {cause}")]
    Unavailable {
        /// What the store was doing.
        operation: StoreOperation,
        /// The backend's error, as text.
        cause: String,
    },
}

impl StoreError {
    /// Whether the same operation may succeed if tried again soon: only
    /// [`StoreError::Unavailable`]. A fence refused ([`StoreError::Fenced`]) or an owner
    /// elsewhere ([`StoreError::NotOwner`]) is not: trying the same operation again
    /// fails the same way (a new activation, which claims again, may succeed; see
    /// `InvokeError::is_transient` for the caller's side). Nor is a fault injected by a
    /// test or the simulator ([`StoreError::Injected`]), a limit, or a backend error that
    /// is not known to pass.
    #[inline]
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Unavailable { .. })
    }
}

/// How a [`StoreError`] is encoded: the variants as they were before
/// [`StoreError::Unavailable`], which is encoded as [`StoreError::Backend`]. Borrowed,
/// so that encoding copies nothing.
#[derive(Serialize)]
#[serde(rename = "StoreError")]
enum Encoded<'a> {
    Backend {
        operation: StoreOperation,
        cause: &'a str,
    },
    Injected {
        operation: StoreOperation,
    },
    TooLarge {
        what: StoreItem,
        size: usize,
        limit: usize,
    },
    TooManyWrites {
        count: usize,
        limit: usize,
    },
    Fenced {
        actor: &'a ActorId,
        held: Fence,
        current: Option<Fence>,
    },
    NotOwner {
        actor: &'a ActorId,
        owner: &'a Option<String>,
    },
    ReservedKey {
        key: &'a str,
        prefix: &'a str,
    },
}

impl Serialize for StoreError {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let encoded = match self {
            Self::Backend { operation, cause } | Self::Unavailable { operation, cause } => Encoded::Backend {
                operation: *operation,
                cause,
            },
            Self::Injected { operation } => Encoded::Injected { operation: *operation },
            Self::TooLarge { what, size, limit } => Encoded::TooLarge {
                what: *what,
                size: *size,
                limit: *limit,
            },
            Self::TooManyWrites { count, limit } => Encoded::TooManyWrites {
                count: *count,
                limit: *limit,
            },
            Self::Fenced { actor, held, current } => Encoded::Fenced {
                actor,
                held: *held,
                current: *current,
            },
            Self::NotOwner { actor, owner } => Encoded::NotOwner { actor, owner },
            Self::ReservedKey { key, prefix } => Encoded::ReservedKey { key, prefix },
        };
        encoded.serialize(serializer)
    }
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

    /// `StoreError` as it was derived before `Unavailable`: what nodes of the same
    /// transport protocol version decode.
    #[derive(Serialize, Deserialize, Debug, PartialEq)]
    #[serde(rename = "StoreError")]
    enum Before {
        Backend {
            operation: StoreOperation,
            cause: String,
        },
        Injected {
            operation: StoreOperation,
        },
        TooLarge {
            what: StoreItem,
            size: usize,
            limit: usize,
        },
        TooManyWrites {
            count: usize,
            limit: usize,
        },
        Fenced {
            actor: ActorId,
            held: Fence,
            current: Option<Fence>,
        },
        NotOwner {
            actor: ActorId,
            owner: Option<String>,
        },
        ReservedKey {
            key: String,
            prefix: String,
        },
    }

    /// Goal: adding `Unavailable` changed no byte on the wire. Method: every variant
    /// encodes (bincode and JSON) as the enum derived before it did, `Unavailable` as
    /// `Backend` with its fields, which is what a node decodes it as.
    #[test]
    fn unavailable_is_encoded_as_backend_and_every_other_variant_as_before() {
        let actor = ActorId::new("counter", "c").unwrap();
        let pairs = [
            (
                StoreError::Backend {
                    operation: StoreOperation::Commit,
                    cause: "disk full".to_string(),
                },
                Before::Backend {
                    operation: StoreOperation::Commit,
                    cause: "disk full".to_string(),
                },
            ),
            (
                StoreError::Unavailable {
                    operation: StoreOperation::Claim,
                    cause: "connection refused".to_string(),
                },
                Before::Backend {
                    operation: StoreOperation::Claim,
                    cause: "connection refused".to_string(),
                },
            ),
            (
                StoreError::Injected {
                    operation: StoreOperation::Scan,
                },
                Before::Injected {
                    operation: StoreOperation::Scan,
                },
            ),
            (
                StoreError::TooLarge {
                    what: StoreItem::Value,
                    size: 9,
                    limit: 8,
                },
                Before::TooLarge {
                    what: StoreItem::Value,
                    size: 9,
                    limit: 8,
                },
            ),
            (
                StoreError::TooManyWrites { count: 5, limit: 4 },
                Before::TooManyWrites { count: 5, limit: 4 },
            ),
            (
                StoreError::Fenced {
                    actor: actor.clone(),
                    held: Fence::FIRST,
                    current: Some(Fence::FIRST.next()),
                },
                Before::Fenced {
                    actor: actor.clone(),
                    held: Fence::FIRST,
                    current: Some(Fence::FIRST.next()),
                },
            ),
            (
                StoreError::NotOwner {
                    actor: actor.clone(),
                    owner: Some("node-2".to_string()),
                },
                Before::NotOwner {
                    actor,
                    owner: Some("node-2".to_string()),
                },
            ),
            (
                StoreError::ReservedKey {
                    key: "k".to_string(),
                    prefix: "p".to_string(),
                },
                Before::ReservedKey {
                    key: "k".to_string(),
                    prefix: "p".to_string(),
                },
            ),
        ];
        for (error, before) in pairs {
            let bytes = bincode::serialize(&error).unwrap();
            assert_eq!(bytes, bincode::serialize(&before).unwrap(), "{error:?}");
            assert_eq!(bincode::deserialize::<Before>(&bytes).unwrap(), before);
            let json = serde_json::to_string(&error).unwrap();
            assert_eq!(json, serde_json::to_string(&before).unwrap(), "{error:?}");
            let decoded = bincode::deserialize::<StoreError>(&bytes).unwrap();
            match error {
                StoreError::Unavailable { operation, cause } => {
                    assert_eq!(decoded, StoreError::Backend { operation, cause });
                }
                error => assert_eq!(decoded, error),
            }
        }
    }

    #[test]
    fn only_an_unavailable_store_is_transient_and_its_text_is_a_backend_failures() {
        let unavailable = StoreError::Unavailable {
            operation: StoreOperation::Commit,
            cause: "connection refused".to_string(),
        };
        assert!(unavailable.is_transient());
        assert_eq!(unavailable.to_string(), "commit failed: connection refused");
        let not_transient = [
            StoreError::Backend {
                operation: StoreOperation::Commit,
                cause: "connection refused".to_string(),
            },
            StoreError::Injected {
                operation: StoreOperation::Commit,
            },
            StoreError::Fenced {
                actor: ActorId::new("counter", "c").unwrap(),
                held: Fence::FIRST,
                current: None,
            },
            StoreError::NotOwner {
                actor: ActorId::new("counter", "c").unwrap(),
                owner: None,
            },
            StoreError::TooManyWrites { count: 2, limit: 1 },
        ];
        for error in not_transient {
            assert!(!error.is_transient(), "{error:?}");
        }
    }
}
