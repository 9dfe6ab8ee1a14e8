//! Errors of placement and membership.

use troupe_core::ActorId;

use crate::config::NodeId;

/// What a placement was doing when it failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlacementOperation {
    /// Connecting to etcd.
    Connect,
    /// Granting the node's lease.
    GrantLease,
    /// Renewing the node's lease.
    KeepAlive,
    /// Writing the node's membership record.
    Join,
    /// Revoking the node's lease on leaving.
    Leave,
    /// Placing an actor.
    Place,
    /// Looking up an actor's owner.
    Lookup,
    /// Releasing an actor.
    Release,
    /// Listing the cluster's nodes.
    ListNodes,
    /// Writing the address the node serves HTTP on.
    PublishHttp,
    /// Reading the address a node serves HTTP on.
    LookupHttp,
}

/// Why a node's lease counts as lost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaseLostReason {
    /// etcd said the lease does not exist: it expired or was revoked.
    ExpiredOnServer,
    /// No renewal was confirmed for the lease's TTL minus the expiry slack: the lease
    /// may have expired, so the node must act as if it had.
    NotRenewedInTime,
    /// The node left the cluster ([`crate::EtcdPlacement::leave`]).
    Left,
}

/// A configuration that [`crate::EtcdConfig::validate`] refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A cluster or node name breaks the naming rules.
    #[error("{what} name {name:?} is invalid: {reason}")]
    BadName {
        /// `"cluster"` or `"node"`.
        what: &'static str,
        /// The name given.
        name: String,
        /// Which rule it breaks.
        reason: String,
    },
    /// No etcd endpoint was given.
    #[error("no etcd endpoint given: pass at least one `host:port`")]
    NoEndpoints,
    /// The store identity is empty or too long.
    #[error("store identity {identity:?} is invalid: {reason}")]
    BadStoreIdentity {
        /// The identity given.
        identity: String,
        /// Which rule it breaks.
        reason: String,
    },
    /// A number is outside its allowed range.
    #[error("{field} is {value}, must be in {min}..={max}")]
    OutOfRange {
        /// The field.
        field: &'static str,
        /// The value given.
        value: u64,
        /// The smallest allowed value.
        min: u64,
        /// The largest allowed value (for the request timeout: what the lease TTL leaves).
        max: u64,
    },
}

/// Why a placement or membership operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// The configuration was refused; nothing was sent to etcd.
    #[error("invalid etcd configuration: {0}")]
    Config(#[from] ConfigError),
    /// etcd did not answer within the request timeout, or the connection failed. The
    /// operation may or may not have been applied; a placement that was is bound to
    /// this node's lease, so it is either visible to [`crate::Placement::lookup`] or
    /// ends with the lease.
    #[error("etcd at {endpoints} is unavailable during {operation:?}: {cause}")]
    EtcdUnavailable {
        /// The endpoints tried.
        endpoints: String,
        /// What was being done.
        operation: PlacementOperation,
        /// The timeout or transport error.
        cause: String,
    },
    /// etcd answered with an error other than unavailability (a request too large, a
    /// permission refused, …).
    #[error("etcd refused {operation:?}: {cause}")]
    EtcdRefused {
        /// What was being done.
        operation: PlacementOperation,
        /// etcd's answer.
        cause: String,
    },
    /// The actor is placed on another node (or on an earlier incarnation of this node,
    /// whose lease has not ended yet). Route the call to `owner`, or wait for the
    /// owner's lease to end.
    #[error("{actor} is placed on node {owner}")]
    PlacementConflict {
        /// The actor.
        actor: ActorId,
        /// The node that holds it.
        owner: NodeId,
    },
    /// This node's lease is lost (a placement that waited for a late renewal meets this
    /// when the lease's validity ends first): the node must stop serving its actors; it
    /// places nothing more.
    #[error("the lease {lease:x} of node {node} is lost ({reason:?})")]
    LeaseExpired {
        /// This node.
        node: NodeId,
        /// The lost lease's id.
        lease: i64,
        /// Why it counts as lost.
        reason: LeaseLostReason,
    },
    /// Another live node serves under this node's name
    /// ([`crate::EtcdPlacement::join_unless_in_use`]); nothing was written.
    #[error(
        "node name {node} is in use by a live node at {address}; give this node another name, or stop \
         that node first (a node that crashed or lost its lease frees its name when its lease ends)"
    )]
    NodeNameInUse {
        /// The name asked for.
        node: NodeId,
        /// Where the live node serves, as its membership record says.
        address: String,
    },
    /// The cluster is bound to another store: the first node of the cluster recorded
    /// its store's identity under `/troupe/<cluster>/store`, and this node's store has
    /// another ([`crate::EtcdConfig::store_identity`]). Two deployments share the
    /// cluster name on this etcd; nothing of this node was written.
    #[error(
        "cluster {cluster:?} on this etcd keeps its actors in store {recorded:?}, but this node's store is \
         {store:?}: two deployments share the cluster name, and their placements would mix. Give this \
         deployment its own cluster name (troupe node: --cluster), or point this node at the cluster's \
         store; if the whole cluster moved to this store, stop every node and delete the etcd key \
         /troupe/{cluster}/store"
    )]
    StoreMismatch {
        /// The cluster's name.
        cluster: String,
        /// The identity recorded for the cluster.
        recorded: String,
        /// This node's store identity.
        store: String,
    },
    /// A record in etcd does not have the form this crate writes.
    #[error("the etcd record at {key} is malformed: {reason}")]
    MalformedRecord {
        /// The key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
}
