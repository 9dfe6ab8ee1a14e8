//! [`PlacedStore`]: the store a cluster node's runtime sees. Its `claim` places the actor
//! on this node in etcd first and claims the state with the placement's fence, so the
//! runtime's ordinary activation path becomes the cluster's ownership protocol.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::mpsc;
use troupe_core::{ActorId, ActorKind};
use troupe_etcd::{EtcdPlacement, Placement, PlacementError};
use troupe_runtime::{
    Claimed, Fence, FencedClaim, RuntimeEvent, RuntimeObserver, StateStore, StoreError, StoreOperation, TurnCommit,
};

/// Capacity of a node's queue of placements to release after their activations ended,
/// in actors. When it is full an ended activation's placement is not released at once;
/// it is released when the actor is next activated on this node (a placement this node
/// holds from an earlier activation is released and made anew, for a newer fence), or
/// it ends with the node's lease.
pub const RELEASE_QUEUE_CAPACITY: usize = 4_096;

/// What this node knows of one actor it placed.
#[derive(Default)]
struct Holding {
    /// Serializes this node's claim and release of the actor.
    gate: Arc<tokio::sync::Mutex<()>>,
    /// The fence of the placement this node made last and has not released.
    fence: Option<Fence>,
    /// Whether an activation on this node claimed under `fence` and has not ended.
    live: bool,
}

/// State shared by a node's [`PlacedStore`], its runtime observer and its release task.
pub(crate) struct Ownership {
    placement: EtcdPlacement,
    /// Set once the node's lease is lost: every claim and commit is refused after it.
    lost: AtomicBool,
    /// Ordered by id: [`Ownership::live_actors`] gives the order in which a fenced-off
    /// node spawns the deactivations, which must not depend on a per-process hash seed
    /// (std's `HashMap` differed between two runs of a seed in one process).
    held: Mutex<BTreeMap<ActorId, Holding>>,
    releases: mpsc::Sender<ActorId>,
    /// Placements left from an earlier activation here, released and made anew at a claim.
    pub(crate) replaced: AtomicU64,
}

impl Ownership {
    pub(crate) fn new(placement: EtcdPlacement) -> (Arc<Self>, mpsc::Receiver<ActorId>) {
        let (releases, queue) = mpsc::channel(RELEASE_QUEUE_CAPACITY);
        let ownership = Arc::new(Self {
            placement,
            lost: AtomicBool::new(false),
            held: Mutex::new(BTreeMap::new()),
            releases,
            replaced: AtomicU64::new(0),
        });
        (ownership, queue)
    }

    fn held(&self) -> MutexGuard<'_, BTreeMap<ActorId, Holding>> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn gate(&self, actor: &ActorId) -> Arc<tokio::sync::Mutex<()>> {
        Arc::clone(&self.held().entry(actor.clone()).or_default().gate)
    }

    /// Marks the lease lost: from now on every claim and commit is refused.
    pub(crate) fn mark_lost(&self) {
        self.lost.store(true, Ordering::SeqCst);
    }

    /// The node took a new lease after the lost one, every activation under the old one
    /// ended: claims and commits are allowed again (under the new lease, whose
    /// placements are new). What was recorded of the old placements (gone with the
    /// revoked lease) is forgotten.
    pub(crate) fn rejoined(&self) {
        self.held().retain(|_, holding| holding.live);
        self.lost.store(false, Ordering::SeqCst);
    }

    /// Whether the lease is known lost (for good: the node serves nothing more until it
    /// joins again with a new lease).
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    /// Whether this node may still claim and commit: the lease is not known lost and its
    /// last renewal is recent enough.
    pub(crate) fn may_serve(&self) -> bool {
        !self.lost.load(Ordering::SeqCst) && self.placement.holds_lease()
    }

    /// The actors with a live activation on this node.
    pub(crate) fn live_actors(&self) -> Vec<ActorId> {
        self.held()
            .iter()
            .filter(|(_, holding)| holding.live)
            .map(|(actor, _)| actor.clone())
            .collect()
    }

    /// Places `actor` here and returns the fence to claim it with; a placement left
    /// over from an earlier activation on this node is released and made anew, since
    /// the store refuses a fence it has already seen.
    async fn place(&self, actor: &ActorId) -> Result<Fence, StoreError> {
        let mut record = self
            .placement
            .place(actor)
            .await
            .map_err(|error| not_owner(actor, error))?;
        let previous = self.held().get(actor).and_then(|holding| holding.fence);
        if previous == Some(record.fence) {
            self.replaced.fetch_add(1, Ordering::Relaxed);
            self.placement
                .release(actor)
                .await
                .map_err(|error| not_owner(actor, error))?;
            self.held().entry(actor.clone()).or_default().fence = None;
            record = self
                .placement
                .place(actor)
                .await
                .map_err(|error| not_owner(actor, error))?;
        }
        self.held().entry(actor.clone()).or_default().fence = Some(record.fence);
        Ok(record.fence)
    }

    /// Whether etcd still has `actor` placed on this node under `fence` (a failed lookup
    /// counts as no).
    async fn still_placed_here(&self, actor: &ActorId, fence: Fence) -> bool {
        match self.placement.lookup(actor).await {
            Ok(Some(record)) => record.owner == *self.placement.node() && record.fence == fence,
            Ok(None) | Err(_) => false,
        }
    }

    /// Releases `actor`'s placement if no activation on this node holds it.
    pub(crate) async fn release_if_idle(&self, actor: &ActorId) {
        // No entry: nothing of it is placed here (an earlier release of an activation
        // that ended just before removed it). Taking the gate through `gate` would make
        // an empty entry that nothing removes: one per actor so released, for the
        // node's life.
        let Some(gate) = self.held().get(actor).map(|holding| Arc::clone(&holding.gate)) else {
            return;
        };
        let _guard = gate.lock().await;
        let idle = self
            .held()
            .get(actor)
            .is_some_and(|holding| !holding.live && holding.fence.is_some());
        if !idle || self.lost.load(Ordering::SeqCst) {
            return;
        }
        match self.placement.release(actor).await {
            Ok(_) => {
                let mut held = self.held();
                if held.get(actor).is_some_and(|holding| !holding.live) {
                    held.remove(actor);
                }
            }
            Err(error) => {
                // It stays recorded: the next activation here releases it and places anew.
                tracing::warn!(%actor, %error, "releasing a placement failed; it ends with the lease or the next activation");
            }
        }
    }
}

/// The claim refusal when etcd's placement of `actor` on this node, fence `held` (its
/// create revision), is current, yet the store holds a newer fence `current`. A newer
/// fence could only come from a placement made after this one ended, so etcd's
/// revisions went back: the nodes use a new etcd cluster, or one rebuilt without its
/// data. Every actor claimed before would be refused as `Fenced` (transient, so
/// retried until the callers' deadlines) until etcd's revision passes its fence, which
/// may be never: this error is not transient, and says what happened.
fn etcd_behind_the_store(actor: &ActorId, held: Fence, current: Fence) -> StoreError {
    let cause = format!(
        "etcd placed {actor} under revision {held_token}, but the store already holds its fence {current_token}: \
         etcd's revisions are behind the store's fences (a new etcd cluster, or one restored without its data), \
         so no actor claimed before can be claimed until etcd's revision passes its fence. Point every node at \
         the etcd the store was used with; or, with every node stopped, reset the store's fences (PostgreSQL: \
         UPDATE troupe_actor_owner SET fence = 1)",
        held_token = held.token(),
        current_token = current.token(),
    );
    tracing::error!(%actor, held = held.token(), current = current.token(), "etcd is behind the store's fences");
    StoreError::Backend {
        operation: StoreOperation::Claim,
        cause,
    }
}

/// Maps a placement refusal to the store error the runtime hands to the caller.
fn not_owner(actor: &ActorId, error: PlacementError) -> StoreError {
    match error {
        PlacementError::PlacementConflict { owner, .. } => StoreError::NotOwner {
            actor: actor.clone(),
            owner: Some(owner.to_string()),
        },
        PlacementError::LeaseExpired { .. } => StoreError::NotOwner {
            actor: actor.clone(),
            owner: None,
        },
        other => StoreError::Backend {
            operation: StoreOperation::Claim,
            cause: format!("placing {actor} in etcd failed: {other}"),
        },
    }
}

/// The store a cluster node's runtime uses: `S` for state, etcd for ownership.
///
/// - [`StateStore::claim`] (at every activation) places the actor on this node
///   ([`Placement::place`]) and claims its state with the placement's fence
///   ([`FencedClaim::claim_with_fence`]). If another node holds the placement, or this
///   node's lease is lost, the claim fails with [`StoreError::NotOwner`] before anything
///   runs: the caller looks the owner up again.
/// - [`StateStore::commit`] is refused with [`StoreError::NotOwner`] (`owner: None`)
///   once the lease is lost or its last renewal is too old; otherwise `S` checks the
///   fence, so a commit that slips past this check after the lease ended is still refused
///   once the new owner has claimed.
/// - Reads go straight to `S`.
/// - Shared records (kinds declared with `RuntimeBuilder::shared_record_kind`, such as
///   the agent layer's organisation record) are not placed: their claims and commits go
///   straight to `S`, whose own fences order the writers, so every node may write them.
///   A writer whose claim another overtook is refused [`StoreError::Fenced`] and claims
///   again (see docs/cluster.md, "The organisation on a cluster"). Every other kind,
///   registered or not, is placed.
pub struct PlacedStore<S> {
    store: S,
    ownership: Arc<Ownership>,
    /// The shared-record kinds: not placed.
    shared: BTreeSet<ActorKind>,
}

impl<S> PlacedStore<S> {
    pub(crate) fn new(store: S, ownership: Arc<Ownership>, shared: BTreeSet<ActorKind>) -> Self {
        Self {
            store,
            ownership,
            shared,
        }
    }

    /// Whether `actor` is placed in etcd, rather than a shared record fenced by the
    /// store alone.
    fn is_placed(&self, actor: &ActorId) -> bool {
        !self.shared.contains(actor.kind())
    }
}

#[async_trait]
impl<S: FencedClaim> StateStore for PlacedStore<S> {
    async fn claim(&self, actor: &ActorId) -> Result<Claimed, StoreError> {
        if !self.is_placed(actor) {
            return self.store.claim(actor).await;
        }
        let ownership = &self.ownership;
        if !ownership.may_serve() {
            return Err(StoreError::NotOwner {
                actor: actor.clone(),
                owner: None,
            });
        }
        let gate = ownership.gate(actor);
        let _guard = gate.lock().await;
        let claimed = match ownership.place(actor).await {
            Ok(fence) => match self.store.claim_with_fence(actor, fence).await {
                Err(StoreError::Fenced {
                    held,
                    current: Some(current),
                    ..
                }) if current > held && ownership.still_placed_here(actor, held).await => {
                    Err(etcd_behind_the_store(actor, held, current))
                }
                other => other,
            },
            Err(error) => Err(error),
        };
        let mut held = ownership.held();
        match &claimed {
            Ok(_) => held.entry(actor.clone()).or_default().live = true,
            Err(_) => {
                // Nothing placed here (refused): forget the actor, so the table holds
                // only actors this node placed.
                if held
                    .get(actor)
                    .is_some_and(|holding| holding.fence.is_none() && !holding.live)
                {
                    held.remove(actor);
                }
            }
        }
        claimed
    }

    async fn load(&self, actor: &ActorId) -> Result<Option<Bytes>, StoreError> {
        self.store.load(actor).await
    }

    async fn commit(&self, actor: &ActorId, fence: Fence, commit: TurnCommit) -> Result<(), StoreError> {
        if self.is_placed(actor) && !self.ownership.may_serve() {
            return Err(StoreError::NotOwner {
                actor: actor.clone(),
                owner: None,
            });
        }
        self.store.commit(actor, fence, commit).await
    }

    /// What [`StateStore::commit`] would find before the store's own check: a placed
    /// actor on a node that may no longer serve (its lease is gone) is `NotOwner`, and
    /// the store then answers for the fence (PostgreSQL reads it; a store that cannot
    /// check answers `Ok`). A turn that meets either refusal closes its activation.
    async fn check_fence(&self, actor: &ActorId, fence: Fence) -> Result<(), StoreError> {
        if self.is_placed(actor) && !self.ownership.may_serve() {
            return Err(StoreError::NotOwner {
                actor: actor.clone(),
                owner: None,
            });
        }
        self.store.check_fence(actor, fence).await
    }

    async fn get(&self, actor: &ActorId, key: &str) -> Result<Option<Bytes>, StoreError> {
        self.store.get(actor, key).await
    }

    async fn scan(
        &self,
        actor: &ActorId,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Bytes)>, StoreError> {
        self.store.scan(actor, prefix, after, limit).await
    }
}

/// Hears the runtime's activations end and queues their placements for release.
pub(crate) struct ReleaseObserver {
    pub(crate) ownership: Arc<Ownership>,
}

impl RuntimeObserver for ReleaseObserver {
    fn on_event(&self, event: &RuntimeEvent) {
        if let RuntimeEvent::ActivationEnded { actor } = event {
            let placed = {
                let mut held = self.ownership.held();
                match held.get_mut(actor) {
                    Some(holding) => {
                        holding.live = false;
                        holding.fence.is_some()
                    }
                    None => false,
                }
            };
            // Reported before the next activation of `actor` can claim, so `live` is
            // false here only for the activation that ended. A full queue leaves the
            // placement to the next activation or the lease (RELEASE_QUEUE_CAPACITY).
            if placed {
                let _ = self.ownership.releases.try_send(actor.clone());
            }
        }
    }
}
