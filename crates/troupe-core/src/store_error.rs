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
//! **On the wire** every variant is encoded as serde derives it, `Unavailable` as itself
//! (since transport protocol version 8): a node that calls an actor hosted on another
//! node whose store is down gets `Unavailable`, as the host's own callers do, and
//! answers it as a store that failed for a moment (503 `storage_unavailable`), not as a
//! backend failure. `Unavailable` is the last variant, so every other variant keeps its
//! bincode index and its bytes (bincode numbers variants); a node of version 7 or
//! earlier, which encoded `Unavailable` as `Backend` and cannot decode the new index,
//! is refused at the transport's handshake.

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
/// Serializable (see the module documentation for the wire); a variant added later goes
/// last, so that the others keep their encoding.
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
    /// The backend failed for a moment and the same operation may succeed if tried
    /// again ([`StoreError::is_transient`]): its connection was refused, reset or closed,
    /// its server is shutting down or starting up, the file is locked by another process
    /// for longer than the store waits, or no pooled connection came in time. Its text
    /// is [`StoreError::Backend`]'s; it crosses nodes as itself (transport protocol
    /// version 8; see the module documentation).
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
    use bincode::Options;

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

    /// `StoreError` as it was derived before `Unavailable` (and as nodes of transport
    /// protocol version 7 and earlier encoded every variant, `Unavailable` as `Backend`).
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

    /// Goal: encoding `Unavailable` as itself (transport protocol version 8) changed no
    /// byte of any other variant. Method: every other variant encodes (bincode and
    /// JSON) as the enum derived before `Unavailable` did, and decodes as itself;
    /// `Unavailable` takes the next bincode index, 7, which the old enum refuses to
    /// decode (so a node of version 7 could not read it: it is refused at the handshake).
    #[test]
    fn every_variant_but_unavailable_is_encoded_as_before_and_unavailable_as_the_next_index() {
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
        // The transport's frames use bincode's varint configuration; `bincode::serialize`
        // (fixed-size integers) is checked too.
        let wire = bincode::DefaultOptions::new();
        for (error, before) in pairs {
            let bytes = bincode::serialize(&error).unwrap();
            assert_eq!(bytes, bincode::serialize(&before).unwrap(), "{error:?}");
            assert_eq!(bincode::deserialize::<Before>(&bytes).unwrap(), before);
            assert_eq!(bincode::deserialize::<StoreError>(&bytes).unwrap(), error);
            let framed = wire.serialize(&error).unwrap();
            assert_eq!(framed, wire.serialize(&before).unwrap(), "{error:?}");
            assert_eq!(wire.deserialize::<StoreError>(&framed).unwrap(), error);
            let json = serde_json::to_string(&error).unwrap();
            assert_eq!(json, serde_json::to_string(&before).unwrap(), "{error:?}");
        }
        let unavailable = StoreError::Unavailable {
            operation: StoreOperation::Claim,
            cause: "connection refused".to_string(),
        };
        let backend = StoreError::Backend {
            operation: StoreOperation::Claim,
            cause: "connection refused".to_string(),
        };
        let bytes = bincode::serialize(&unavailable).unwrap();
        assert_eq!(
            bytes[..4],
            7u32.to_le_bytes(),
            "the variant index after ReservedKey's 6"
        );
        assert_eq!(
            bytes[4..],
            bincode::serialize(&backend).unwrap()[4..],
            "the fields as Backend's"
        );
        assert!(
            bincode::deserialize::<Before>(&bytes).is_err(),
            "the old layout refuses it"
        );
        let framed = wire.serialize(&unavailable).unwrap();
        assert_eq!(framed[0], 7, "the variant index after ReservedKey's 6, one varint byte");
        assert_eq!(
            framed[1..],
            wire.serialize(&backend).unwrap()[1..],
            "the fields as Backend's"
        );
        assert!(
            wire.deserialize::<Before>(&framed).is_err(),
            "the old layout refuses it"
        );
        assert_eq!(
            serde_json::to_string(&unavailable).unwrap(),
            r#"{"Unavailable":{"operation":"Claim","cause":"connection refused"}}"#
        );
    }

    /// Goal: a store down for a moment on another node is still `Unavailable` where the
    /// error lands (transport protocol version 8), so that node answers it as
    /// transient. Before version 8 it was encoded as `Backend` and decoded as one (this
    /// test failed: `left: Backend { operation: Claim, .. }`).
    #[test]
    fn unavailable_survives_a_bincode_and_json_round_trip_as_itself() {
        let unavailable = StoreError::Unavailable {
            operation: StoreOperation::Claim,
            cause: "connection refused".to_string(),
        };
        let bytes = bincode::serialize(&unavailable).unwrap();
        assert_eq!(bincode::deserialize::<StoreError>(&bytes).unwrap(), unavailable);
        let json = serde_json::to_string(&unavailable).unwrap();
        assert_eq!(serde_json::from_str::<StoreError>(&json).unwrap(), unavailable);
        let failed = crate::InvokeError::StorageFailed {
            target: ActorId::new("counter", "c").unwrap(),
            source: unavailable,
        };
        let bytes = bincode::serialize(&failed).unwrap();
        let decoded = bincode::deserialize::<crate::InvokeError>(&bytes).unwrap();
        assert!(decoded.is_transient(), "{decoded:?}");
        assert_eq!(decoded, failed);
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
