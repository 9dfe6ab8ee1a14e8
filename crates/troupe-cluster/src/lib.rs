//! A Troupe cluster node: the runtime, placement and membership on etcd, a state store
//! shared by every node and fenced by the placement, and the TCP transport between nodes.
//!
//! ```text
//!  caller ──ClusterNode::invoke(x)──► route: cached owner, else etcd lookup(x)
//!     │ owner = this node, or none ──► local runtime ── activation: PlacedStore::claim(x)
//!     │                                    place(x) in etcd (create-if-absent under the lease)
//!     │                                    claim_with_fence(x, create_revision) in the store
//!     │ owner = node B ──────────────► TransportClient ── TCP ──► B's TransportServer ──► B's runtime
//!     │ reply, or NotOwner ◄────────────────────────────────────── (B's claim refused: not placed on B)
//!     └ NotOwner: forget the route, look up again, retry until the deadline
//!  a turn's call (Caller) ──► the node's TurnCallRouter: the same routing, with the
//!     callee's context (chain, depth, caller, deadline); remote: wait-for edge recorded
//!     here, marked remote, and a deadlock probe sent to the owner (see probes.rs)
//!  a root request through the runtime (RuntimeHandle::invoke_routed, a turn's
//!     invoke_as_root: an embedded AgentClient's asks) ──► the node's RootCallRouter:
//!     the same routing as ClusterNode::invoke
//!  activation ends ──► ActivationEnded event ──► release(x) in etcd (if no newer activation)
//!  lease lost ──► refuse every claim and commit here, deactivate every activation
//! ```
//!
//! One owner per actor: only the holder of the actor's etcd placement can claim it
//! (the placement is created atomically, bound to the holder's lease), and the store
//! accepts commits only under the newest fence, the placement's etcd revision. A node
//! that loses its lease stops committing at once (its own check) and, should a commit
//! slip past that check, the store refuses it once the new owner has claimed.
//!
//! A cycle of waits across nodes is found by edge chasing: each node keeps its own
//! wait-for edges, and probes follow them from node to node until one comes back to
//! the call that started it, which then fails with `DeadlockDetected`.
//!
//! See docs/cluster.md for the failure table, the probe protocol and what the tests show.

mod node;
mod placed_store;
mod probes;
mod store_identity;

pub use node::{
    ClusterClient, ClusterError, ClusterNode, ClusterStats, LEAVE_REPLY_DRAIN_MS_MAX, LEAVE_REPLY_DRAIN_POLL_MS,
    NODE_NAME_CHECK_TIMEOUT_MS, NOT_SENT_RETRIES_MAX, NOT_SENT_RETRY_PAUSE_MS, REJOIN_ATTEMPTS_MAX,
    REJOIN_RETRY_PAUSE_MS, ROUTE_CACHE_ENTRIES_MAX, ROUTE_RETRY_DELAY_MS,
};
pub use placed_store::{PlacedStore, RELEASE_QUEUE_CAPACITY};
pub use probes::{
    PROBES_SENT_PER_SECOND_MAX, PROBE_LOCAL_VISITS_MAX, PROBE_PATH_ACTORS_MAX, PROBE_QUEUE_CAPACITY,
    PROBE_SEND_TIMEOUT_MS,
};
pub use store_identity::sqlite_store_identity;
