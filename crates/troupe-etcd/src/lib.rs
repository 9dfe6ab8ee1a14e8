//! Placement and membership for a Troupe cluster, on etcd.
//!
//! Owns: each node's membership record under a lease it keeps alive, at most one
//! placement per actor (created by a compare-and-swap transaction bound to the owner's
//! lease), lookups of an actor's owner, and the placement's fencing token: the etcd
//! `create_revision` of the placement key, which grows with every new placement of the
//! actor, whichever node makes it. The owner claims the actor's state with that token
//! ([`troupe_runtime::FencedClaim::claim_with_fence`]), so once a new owner has claimed,
//! a zombie old owner (paused, partitioned, or slow to notice its lease ended) can no
//! longer claim or commit: the store refuses it.
//!
//! ```text
//!  node A                      etcd                                  store
//!  join: grant lease LA ─────► nodes/A = addr   (lease LA)
//!  place(x) ─── txn ─────────► placement/x = LA/A (lease LA, create_revision 7)
//!  claim_with_fence(x, 7) ─────────────────────────────────────────► fence(x) = 7
//!        … A is cut off; LA expires; etcd deletes nodes/A and placement/x …
//!  node B: place(x) ─────────► placement/x = LB/B (create_revision 12)
//!  B: claim_with_fence(x, 12) ─────────────────────────────────────► fence(x) = 12
//!  A: commit(x, fence 7) ──────────────────────────────────────────► Fenced { held 7, current 12 }
//! ```
//!
//! Under `--cfg madsim` the same code runs against madsim's simulated etcd
//! (`madsim-etcd-client`, which re-exports the real `etcd-client` otherwise). Only what
//! both offer is used: key-value, transactions comparing values, leases.
//!
//! The crate `troupe-cluster` puts this directory to work: its cluster node places each
//! actor before activating it, claims the state with the fence and routes calls to the
//! owner; see docs/cluster.md.

mod config;
mod error;
mod etcd_placement;
mod lease;
mod placement;

pub use config::{
    EtcdConfig, NodeId, ETCD_KEEP_ALIVES_PER_TTL, ETCD_LEASE_EXPIRY_SLACK_MS, ETCD_LEASE_TTL_S_DEFAULT,
    ETCD_LEASE_TTL_S_MAX, ETCD_LEASE_TTL_S_MIN, ETCD_RENEWAL_HEADROOM_MS, ETCD_REQUEST_TIMEOUT_MS_DEFAULT,
    ETCD_REQUEST_TIMEOUT_MS_MIN, ETCD_RETRY_PAUSE_MS, NAME_LENGTH_MAX, STORE_IDENTITY_LENGTH_MAX,
};
pub use error::{ConfigError, LeaseLostReason, PlacementError, PlacementOperation};
pub use etcd_placement::EtcdPlacement;
pub use placement::{NodeRecord, Placement, PlacementRecord};
