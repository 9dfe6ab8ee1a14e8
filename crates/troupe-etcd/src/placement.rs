//! The [`Placement`] trait: which node hosts an actor, and the fencing token that goes
//! with that answer.

use async_trait::async_trait;
use troupe_core::ActorId;
use troupe_runtime::Fence;

use crate::config::NodeId;
use crate::error::PlacementError;

/// Where an actor is placed, and the fence of that placement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlacementRecord {
    /// The actor.
    pub actor: ActorId,
    /// The node that hosts it.
    pub owner: NodeId,
    /// The placement's fencing token: strictly newer than the fence of every earlier
    /// placement of the actor, whichever node held it. The owner claims the actor's
    /// state with it ([`troupe_runtime::FencedClaim::claim_with_fence`]).
    pub fence: Fence,
}

/// A member of the cluster, as its membership record says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeRecord {
    /// The node.
    pub node: NodeId,
    /// What other nodes dial to reach it.
    pub address: String,
}

/// A cluster directory: membership, and at most one owner per actor.
///
/// How a runtime uses it (`troupe_cluster::PlacedStore` does this, see docs/cluster.md):
/// before activating actor `a`, call [`Placement::place`]; on `Ok(record)` claim the
/// state with `store.claim_with_fence(a, record.fence)` and commit every turn under
/// that fence; on [`PlacementError::PlacementConflict`] route the call to the owner.
/// On deactivation call [`Placement::release`]. When the node's lease is lost
/// (`EtcdPlacement::lease_lost`), drop every activation at once: other nodes may place
/// the actors, and the store refuses the old fences' commits.
#[async_trait]
pub trait Placement: Send + Sync + 'static {
    /// This node.
    fn node(&self) -> &NodeId;

    /// Places `actor` on this node unless another node holds it: atomically, creates the
    /// placement if there is none, bound to this node's lease. Placing an actor this node
    /// already holds returns the same record (same fence).
    ///
    /// # Errors
    /// [`PlacementError::PlacementConflict`] naming the owner if another node holds it;
    /// [`PlacementError::LeaseExpired`] if this node's lease is lost;
    /// [`PlacementError::EtcdUnavailable`] if etcd did not answer in time.
    async fn place(&self, actor: &ActorId) -> Result<PlacementRecord, PlacementError>;

    /// Who hosts `actor` now, if anyone.
    ///
    /// # Errors
    /// [`PlacementError::EtcdUnavailable`] or [`PlacementError::MalformedRecord`].
    async fn lookup(&self, actor: &ActorId) -> Result<Option<PlacementRecord>, PlacementError>;

    /// Removes this node's placement of `actor` (made under its current lease); returns
    /// whether it removed one. Another node's placement is never removed: the delete is
    /// conditional on the record naming this node and lease, in one transaction.
    ///
    /// # Errors
    /// [`PlacementError::EtcdUnavailable`] if etcd did not answer in time.
    async fn release(&self, actor: &ActorId) -> Result<bool, PlacementError>;

    /// The cluster's live members, in name order.
    ///
    /// # Errors
    /// [`PlacementError::EtcdUnavailable`] or [`PlacementError::MalformedRecord`].
    async fn nodes(&self) -> Result<Vec<NodeRecord>, PlacementError>;
}
