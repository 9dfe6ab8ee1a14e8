//! [`EtcdPlacement`]: the [`Placement`] directory on etcd.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{Client, Compare, CompareOp, GetOptions, KeyValue, PutOptions, Txn, TxnOp, TxnOpResponse};
use tokio::task::JoinHandle;
use troupe_core::ActorId;
use troupe_runtime::Fence;

use crate::config::{EtcdConfig, NodeId, ETCD_RETRY_PAUSE_MS};
use crate::error::{LeaseLostReason, PlacementError, PlacementOperation};
use crate::lease::{self, LeaseStanding};
use crate::placement::{NodeRecord, Placement, PlacementRecord};

/// One node's membership in a cluster and its view of the cluster's placements, on etcd.
///
/// Keys (all under `/troupe/<cluster>/`):
///
/// ```text
/// nodes/<node>                 = <address>           bound to the node's lease
/// http/<node>                  = <host:port>         bound to the node's lease, if the
///                                                    node serves HTTP (publish_http)
/// placement/<kind>/<actor key> = <lease hex>/<node>  bound to the owner's lease; its
///                                                    create_revision is the fence
/// ```
///
/// [`EtcdPlacement::join`] grants the node a lease of `lease_ttl_s`, writes its
/// membership record under it and starts a task that renews it every TTL/3 (sooner if
/// that would leave less than one request of validity). A placement
/// is created by one transaction, `if value(key) > "" then get(key) else put(key, owner,
/// lease); get(key)`, so of two nodes racing for an actor exactly one creates the key
/// and both read the winner. When the node dies or is cut off from etcd its lease
/// expires after the TTL, etcd deletes its membership record and every placement it
/// held, and the next `place` by another node creates the key anew, with a larger
/// create_revision: the fence only grows, across owners.
///
/// When the lease is lost ([`EtcdPlacement::lease_lost`]) the node must stop serving its
/// actors: other nodes may place them as soon as etcd expired the lease. The node knows
/// it is lost no later than TTL −
/// [`ETCD_LEASE_EXPIRY_SLACK_MS`](crate::config::ETCD_LEASE_EXPIRY_SLACK_MS) after its last
/// confirmed renewal, which is before etcd can expire it. Every request to etcd is
/// bounded by the configured request timeout; etcd not answering is
/// [`PlacementError::EtcdUnavailable`], never a hang.
///
/// Clones share the membership; the keep-alive task stops when the last clone is
/// dropped (the lease then ends on its own, as if the node had crashed) or on
/// [`EtcdPlacement::leave`].
#[derive(Clone, Debug)]
pub struct EtcdPlacement {
    inner: Arc<Inner>,
}

struct Inner {
    config: EtcdConfig,
    client: Client,
    prefix: String,
    /// The lease this node holds now: replaced by [`EtcdPlacement::rejoin_unless_in_use`]
    /// once the one before was lost.
    held: std::sync::Mutex<Arc<HeldLease>>,
    /// Placements that waited for a late renewal ([`EtcdPlacement::late_renewal_waits`]).
    late_renewal_waits: AtomicU64,
}

/// One lease of this node, its standing and its keep-alive task.
struct HeldLease {
    lease: i64,
    standing: Arc<LeaseStanding>,
    /// `<lease hex>/<node>`: the value of every placement made under this lease.
    owner_value: String,
    keep_alive_task: JoinHandle<()>,
}

impl Drop for HeldLease {
    fn drop(&mut self) {
        self.keep_alive_task.abort();
    }
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdPlacement")
            .field("node", &self.config.node)
            .field("cluster", &self.config.cluster)
            .field("lease", &format_args!("{:x}", self.held().lease))
            .finish_non_exhaustive()
    }
}

impl Inner {
    fn held(&self) -> Arc<HeldLease> {
        Arc::clone(&self.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
    }
}

impl EtcdPlacement {
    /// Joins the cluster: connects to etcd, grants this node a lease, writes its
    /// membership record under the lease and starts renewing it.
    ///
    /// A node of the same name that is still a member (an earlier incarnation) has its
    /// membership record overwritten; its placements stay until its lease ends, and this
    /// node's `place` reports them as [`PlacementError::PlacementConflict`] until then.
    /// The name is claimed atomically: of two joins under one name at the same moment,
    /// one writes the record and the other is refused with
    /// [`PlacementError::NodeNameInUse`] naming the winner's address.
    ///
    /// # Errors
    /// [`PlacementError::Config`] if the configuration is invalid (nothing is sent);
    /// [`PlacementError::EtcdUnavailable`] if etcd does not answer in time;
    /// [`PlacementError::EtcdRefused`] if etcd refuses the lease or the record;
    /// [`PlacementError::StoreMismatch`] if [`EtcdConfig::store_identity`] is set and
    /// the cluster is bound to another store (checked before anything of this node is
    /// written; the first node with an identity binds the cluster to it).
    pub async fn join(config: EtcdConfig) -> Result<Self, PlacementError> {
        Self::join_unless_in_use(config, |_address| std::future::ready(false)).await
    }

    /// As [`EtcdPlacement::join`], but first reads the membership record of this node's
    /// name: if one names an address other than `config.address`, `in_use(address)`
    /// says whether a live node serves there (e.g. whether it accepts a connection).
    /// If it does, nothing is written and the join is refused: two live nodes under one
    /// name would share one membership record, and calls for the first one's actors
    /// would go to the second, which cannot serve them. A record of a node that is gone
    /// (crashed, or an earlier incarnation whose lease has not ended yet) is
    /// overwritten, as by `join`.
    ///
    /// The claim is one etcd transaction after the lease is granted: create the record
    /// if there is none, or overwrite the one read only if it is unchanged (its value,
    /// and on real etcd its mod_revision). A join that loses the race to another under
    /// the same name revokes its lease and is refused as above, naming the winner.
    ///
    /// # Errors
    /// As [`EtcdPlacement::join`], and [`PlacementError::NodeNameInUse`] naming the
    /// live node's address (or the address of the join that won a race for the name).
    pub async fn join_unless_in_use<F, Fut>(config: EtcdConfig, in_use: F) -> Result<Self, PlacementError>
    where
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = bool>,
    {
        config.validate()?;
        let endpoints = config.endpoints.join(",");
        let timeout = config.request_timeout();
        let client = bounded(&endpoints, timeout, PlacementOperation::Connect, None, || {
            connect(&config)
        })
        .await?;
        if let Some(identity) = &config.store_identity {
            bind_store(&client.kv_client(), &config, identity).await?;
        }
        let held = take_lease(&client, &config, in_use).await?;
        tracing::info!(node = %config.node, lease = format_args!("{:x}", held.lease), "joined the cluster");
        Ok(Self {
            inner: Arc::new(Inner {
                prefix: format!("/troupe/{}/", config.cluster),
                config,
                client,
                held: std::sync::Mutex::new(Arc::new(held)),
                late_renewal_waits: AtomicU64::new(0),
            }),
        })
    }

    /// Takes a new lease after this node's lease was lost
    /// ([`EtcdPlacement::lease_lost`]), as a join does: revokes the lost lease first
    /// (best effort: it may still live on etcd, for instance after etcd restarted, and
    /// its placements would keep the actors from this node and every other until it
    /// ends; the caller must have stopped everything it served under it), then grants
    /// a lease, writes the membership record under it and renews it. Every clone sees
    /// the new lease. Does nothing if the lease is not lost.
    ///
    /// # Errors
    /// As [`EtcdPlacement::join_unless_in_use`]: [`PlacementError::NodeNameInUse`]
    /// when a live node took this node's name meanwhile (`in_use` as there);
    /// [`PlacementError::EtcdUnavailable`] if etcd does not answer in time (try again
    /// later). The lost lease stays in place on an error.
    pub async fn rejoin_unless_in_use<F, Fut>(&self, in_use: F) -> Result<(), PlacementError>
    where
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = bool>,
    {
        let old = self.inner.held();
        if old.standing.lost().is_none() {
            return Ok(());
        }
        old.keep_alive_task.abort();
        let lease_client = self.inner.client.lease_client();
        let (old_lease, config) = (old.lease, &self.inner.config);
        let revoked = bounded(
            &config.endpoints.join(","),
            config.request_timeout(),
            PlacementOperation::Leave,
            None,
            || {
                let mut lease_client = lease_client.clone();
                async move { lease_client.revoke(old_lease).await }
            },
        )
        .await;
        if let Err(error) = revoked {
            // Gone already (expired), or etcd did not answer: the join below fails too
            // in that case, and the next attempt revokes it again.
            tracing::debug!(%error, lease = format_args!("{old_lease:x}"), "revoking the lost lease failed");
        }
        let held = take_lease(&self.inner.client, config, in_use).await?;
        tracing::info!(node = %config.node, lease = format_args!("{:x}", held.lease), "rejoined the cluster with a new lease");
        *self
            .inner
            .held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(held);
        Ok(())
    }

    /// How many placements by this node (and its clones, across rejoins) found less
    /// than one request timeout of confirmed validity left and waited for a renewal
    /// before they went on or were refused: a healthy node's renewals land before that
    /// (see [`crate::ETCD_RENEWAL_HEADROOM_MS`]), so a growing count means late
    /// renewals (a loaded node, a slow etcd).
    pub fn late_renewal_waits(&self) -> u64 {
        self.inner.late_renewal_waits.load(Ordering::Relaxed)
    }

    /// This node's lease id.
    pub fn lease(&self) -> i64 {
        self.inner.held().lease
    }

    /// Whether the lease is still held (not lost, and its last renewal recent enough).
    pub fn holds_lease(&self) -> bool {
        let held = self.inner.held();
        held.standing.lost().is_none() && tokio::time::Instant::now() < held.standing.valid_until()
    }

    /// Resolves when this node's lease is lost, with the reason: the signal for the
    /// runtime to drop every activation. Resolves at once if it is already lost.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future only stops waiting.
    pub async fn lease_lost(&self) -> LeaseLostReason {
        let standing = Arc::clone(&self.inner.held().standing);
        standing.wait_lost().await
    }

    /// Stops renewing the lease without revoking it, as a crashed node does: etcd
    /// removes the membership and every placement of this node one TTL after the last
    /// renewal. For tests and for a node that must stop at once; prefer
    /// [`EtcdPlacement::leave`].
    pub fn stop_renewing(&self) {
        self.inner.held().keep_alive_task.abort();
    }

    /// Leaves the cluster: stops renewing and revokes the lease, which removes this
    /// node's membership record and every placement it holds at once. The lease counts
    /// as lost ([`LeaseLostReason::Left`]) whether or not the revoke reached etcd.
    ///
    /// # Errors
    /// [`PlacementError::EtcdUnavailable`] if etcd did not answer in time; the lease
    /// then ends after its TTL.
    pub async fn leave(&self) -> Result<(), PlacementError> {
        let held = self.inner.held();
        held.keep_alive_task.abort();
        held.standing.lose(LeaseLostReason::Left);
        let lease_client = self.inner.client.lease_client();
        let lease = held.lease;
        let revoke = || {
            let mut lease_client = lease_client.clone();
            async move { lease_client.revoke(lease).await }
        };
        match self.request(PlacementOperation::Leave, revoke).await {
            // etcd no longer knows the lease: it already ended, which is what leaving wants.
            Ok(_) | Err(PlacementError::LeaseExpired { .. }) => Ok(()),
            Err(other) => Err(other),
        }
    }

    /// Publishes `address` (`host:port`) as the one this node serves HTTP on, so that
    /// other nodes can send a client's request here ([`EtcdPlacement::http_address`]).
    /// The record is bound to the node's lease: it goes with the node.
    ///
    /// # Errors
    /// [`PlacementError::LeaseExpired`] if the lease is gone;
    /// [`PlacementError::EtcdUnavailable`] if etcd does not answer in time.
    pub async fn publish_http(&self, address: &str) -> Result<(), PlacementError> {
        let key = format!("{}http/{}", self.inner.prefix, self.inner.config.node);
        let kv = self.inner.client.kv_client();
        let options = PutOptions::new().with_lease(self.inner.held().lease);
        let put = || {
            let (mut kv, key, address, options) = (kv.clone(), key.clone(), address.to_string(), options.clone());
            async move { kv.put(key, address, Some(options)).await }
        };
        self.request(PlacementOperation::PublishHttp, put).await.map(|_| ())
    }

    /// The address `node` serves HTTP on, as it published it; `None` if it published
    /// none or is no longer a member (the record went with its lease).
    ///
    /// # Errors
    /// [`PlacementError::EtcdUnavailable`] if etcd does not answer in time;
    /// [`PlacementError::MalformedRecord`] if the record is not UTF-8.
    pub async fn http_address(&self, node: &NodeId) -> Result<Option<String>, PlacementError> {
        let key = format!("{}http/{node}", self.inner.prefix);
        let response = self
            .request(PlacementOperation::LookupHttp, self.get(&key, None))
            .await?;
        response
            .kvs()
            .first()
            .map(|kv| {
                String::from_utf8(kv.value().to_vec()).map_err(|error| PlacementError::MalformedRecord {
                    key: key.clone(),
                    reason: error.to_string(),
                })
            })
            .transpose()
    }

    fn placement_key(&self, actor: &ActorId) -> String {
        format!(
            "{}placement/{}/{}",
            self.inner.prefix,
            actor.kind().as_str(),
            actor.key()
        )
    }

    /// One attempt of a read of `key`, for [`EtcdPlacement::request`].
    fn get(
        &self,
        key: &str,
        options: Option<GetOptions>,
    ) -> impl FnMut() -> std::pin::Pin<Box<dyn Future<Output = Result<etcd_client::GetResponse, etcd_client::Error>> + Send>>
    {
        let kv = self.inner.client.kv_client();
        let key = key.to_string();
        move || {
            let (mut kv, key, options) = (kv.clone(), key.clone(), options.clone());
            Box::pin(async move { kv.get(key, options).await })
        }
    }

    /// One attempt of a transaction, for [`EtcdPlacement::request`].
    fn txn(
        &self,
        txn: Txn,
    ) -> impl FnMut() -> std::pin::Pin<Box<dyn Future<Output = Result<etcd_client::TxnResponse, etcd_client::Error>> + Send>>
    {
        let kv = self.inner.client.kv_client();
        move || {
            let (mut kv, txn) = (kv.clone(), txn.clone());
            Box::pin(async move { kv.txn(txn).await })
        }
    }

    /// Runs the request `attempt` makes, sent again while etcd is unavailable, within
    /// the request timeout (see [`bounded`]).
    async fn request<T, F, Fut>(&self, operation: PlacementOperation, attempt: F) -> Result<T, PlacementError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let uses_lease = matches!(
            operation,
            PlacementOperation::Place
                | PlacementOperation::Release
                | PlacementOperation::Leave
                | PlacementOperation::PublishHttp
        );
        let held = self.inner.held();
        let result = bounded(
            &self.inner.config.endpoints.join(","),
            self.inner.config.request_timeout(),
            operation,
            uses_lease.then_some((&self.inner.config.node, held.lease)),
            attempt,
        )
        .await;
        if let Err(PlacementError::LeaseExpired { reason, .. }) = &result {
            held.standing.lose(reason.clone());
        }
        result
    }

    fn lease_expired(&self, lease: i64, reason: LeaseLostReason) -> PlacementError {
        PlacementError::LeaseExpired {
            node: self.inner.config.node.clone(),
            lease,
            reason,
        }
    }

    /// Lets a write under the lease start once the lease is held and a request started
    /// now ends before the lease can have expired on the server: when the last
    /// confirmed renewal leaves less than one request, waits for the next renewal, at
    /// most until the lease's validity ends (then refused [`PlacementError::LeaseExpired`],
    /// the lease lost). See [`LeaseStanding::wait_for_write`] for why the wait never
    /// lets a node act on a lease the server may have expired.
    ///
    /// The wait is bounded by the lease alone, not by the caller's deadline, which the
    /// [`Placement`] API does not carry: it is shorter than one request timeout, the
    /// time the caller budgets for the request it is about to make anyway.
    async fn lease_for_write(&self, held: &HeldLease) -> Result<(), PlacementError> {
        let waited = held
            .standing
            .wait_for_write(self.inner.config.request_timeout())
            .await
            .map_err(|reason| self.lease_expired(held.lease, reason))?;
        if waited {
            self.inner.late_renewal_waits.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    fn record(&self, actor: &ActorId, key: &str, kv: &KeyValue) -> Result<PlacementRecord, PlacementError> {
        let malformed = |reason: String| PlacementError::MalformedRecord {
            key: key.to_string(),
            reason,
        };
        let value = std::str::from_utf8(kv.value()).map_err(|error| malformed(format!("not UTF-8: {error}")))?;
        let (_lease, owner) = value
            .split_once('/')
            .ok_or_else(|| malformed(format!("{value:?} is not <lease hex>/<node>")))?;
        let owner = NodeId::new(owner).map_err(|error| malformed(error.to_string()))?;
        let fence = u64::try_from(kv.create_revision())
            .ok()
            .and_then(Fence::from_token)
            .ok_or_else(|| malformed(format!("create_revision {} is no fence", kv.create_revision())))?;
        Ok(PlacementRecord {
            actor: actor.clone(),
            owner,
            fence,
        })
    }
}

#[async_trait]
impl Placement for EtcdPlacement {
    fn node(&self) -> &NodeId {
        &self.inner.config.node
    }

    async fn place(&self, actor: &ActorId) -> Result<PlacementRecord, PlacementError> {
        let held = self.inner.held();
        self.lease_for_write(&held).await?;
        let key = self.placement_key(actor);
        let create = PutOptions::new().with_lease(held.lease);
        // Compare by value only (all the simulator offers): every record this crate
        // writes is non-empty, and a missing key fails `> ""` in etcd and the simulator.
        let txn = Txn::new()
            .when(vec![Compare::value(key.clone(), CompareOp::Greater, "")])
            .and_then(vec![TxnOp::get(key.clone(), None)])
            .or_else(vec![
                TxnOp::put(key.clone(), held.owner_value.clone(), Some(create)),
                TxnOp::get(key.clone(), None),
            ]);
        let response = self.request(PlacementOperation::Place, self.txn(txn)).await?;
        let kv = response
            .op_responses()
            .into_iter()
            .find_map(|op| match op {
                TxnOpResponse::Get(get) => get.kvs().first().cloned(),
                _ => None,
            })
            .ok_or_else(|| PlacementError::MalformedRecord {
                key: key.clone(),
                reason: "the placement transaction returned no record".to_string(),
            })?;
        let record = self.record(actor, &key, &kv)?;
        if kv.value() != held.owner_value.as_bytes() {
            return Err(PlacementError::PlacementConflict {
                actor: actor.clone(),
                owner: record.owner,
            });
        }
        Ok(record)
    }

    async fn lookup(&self, actor: &ActorId) -> Result<Option<PlacementRecord>, PlacementError> {
        let key = self.placement_key(actor);
        let response = self.request(PlacementOperation::Lookup, self.get(&key, None)).await?;
        response
            .kvs()
            .first()
            .map(|kv| self.record(actor, &key, kv))
            .transpose()
    }

    async fn release(&self, actor: &ActorId) -> Result<bool, PlacementError> {
        let key = self.placement_key(actor);
        let txn = Txn::new()
            .when(vec![Compare::value(
                key.clone(),
                CompareOp::Equal,
                self.inner.held().owner_value.clone(),
            )])
            .and_then(vec![TxnOp::delete(key, None)]);
        let response = self.request(PlacementOperation::Release, self.txn(txn)).await?;
        Ok(response.succeeded())
    }

    async fn nodes(&self) -> Result<Vec<NodeRecord>, PlacementError> {
        let prefix = format!("{}nodes/", self.inner.prefix);
        let response = self
            .request(
                PlacementOperation::ListNodes,
                self.get(&prefix, Some(GetOptions::new().with_prefix())),
            )
            .await?;
        let mut nodes = Vec::with_capacity(response.kvs().len());
        for kv in response.kvs() {
            let key = String::from_utf8_lossy(kv.key()).into_owned();
            let malformed = |reason: String| PlacementError::MalformedRecord {
                key: key.clone(),
                reason,
            };
            let name = key
                .strip_prefix(&prefix)
                .ok_or_else(|| malformed("outside the nodes prefix".to_string()))?;
            let node = NodeId::new(name).map_err(|error| malformed(error.to_string()))?;
            let address = String::from_utf8(kv.value().to_vec()).map_err(|error| malformed(error.to_string()))?;
            nodes.push(NodeRecord { node, address });
        }
        nodes.sort_by(|a, b| a.node.cmp(&b.node));
        Ok(nodes)
    }
}

/// Claims this node's name under a new lease and starts renewing it: reads the
/// membership record (a live node under the name at another address refuses it, as
/// `in_use` says), grants the lease, writes the record under it in one transaction.
async fn take_lease<F, Fut>(client: &Client, config: &EtcdConfig, in_use: F) -> Result<HeldLease, PlacementError>
where
    F: FnOnce(String) -> Fut,
    Fut: Future<Output = bool>,
{
    let endpoints = config.endpoints.join(",");
    let timeout = config.request_timeout();
    let kv = client.kv_client();
    let node_key = format!("/troupe/{}/nodes/{}", config.cluster, config.node);
    let previous = bounded(&endpoints, timeout, PlacementOperation::Join, None, || {
        let (mut kv, key) = (kv.clone(), node_key.clone());
        async move { kv.get(key, None).await }
    })
    .await?;
    let mut expected = None;
    if let Some(record) = previous.kvs().first() {
        let address = String::from_utf8_lossy(record.value()).into_owned();
        if address != config.address && in_use(address.clone()).await {
            return Err(PlacementError::NodeNameInUse {
                node: config.node.clone(),
                address,
            });
        }
        expected = Some(Expected {
            value: record.value().to_vec(),
            mod_revision: record.mod_revision(),
        });
    }
    let ttl_s = i64::try_from(config.lease_ttl_s).expect("validate bounds the lease TTL");
    let lease_client = client.lease_client();
    let granted_at = tokio::time::Instant::now();
    // A grant sent again after an answer was lost leaves a lease nobody renews: it
    // holds no key, and expires after its TTL.
    let granted = bounded(&endpoints, timeout, PlacementOperation::GrantLease, None, || {
        let mut lease_client = lease_client.clone();
        async move { lease_client.grant(ttl_s, None).await }
    })
    .await?;
    // A grant longer than asked for is trusted only as far as asked.
    let (lease, granted_ttl_s) = (granted.id(), granted.ttl().min(ttl_s));
    let valid_until = lease::trusted_until(granted_at, granted_ttl_s, granted_ttl_s);
    let standing = Arc::new(LeaseStanding::new(valid_until));
    let mut claimed = claim_name(&kv, config, &node_key, expected.take(), lease).await;
    if matches!(claimed, Ok(NameClaim::Vanished)) {
        // The record read above ended with its lease in the meantime: the name is
        // free, claim it as an absent one (that never vanishes).
        claimed = claim_name(&kv, config, &node_key, None, lease).await;
    }
    let refusal = match claimed {
        Ok(NameClaim::Claimed) => None,
        Ok(NameClaim::HeldBy(address)) => Some(PlacementError::NodeNameInUse {
            node: config.node.clone(),
            address,
        }),
        Ok(NameClaim::Vanished) => Some(PlacementError::MalformedRecord {
            key: node_key.clone(),
            reason: "the membership transaction returned no record".to_string(),
        }),
        Err(error) => Some(error),
    };
    if let Some(refusal) = refusal {
        // The lease holds nothing; revoked so that it does not linger for its TTL.
        // If the revoke fails the lease simply expires.
        let revoked = bounded(&endpoints, timeout, PlacementOperation::Leave, None, || {
            let mut lease_client = lease_client.clone();
            async move { lease_client.revoke(lease).await }
        })
        .await;
        if let Err(error) = revoked {
            tracing::debug!(%error, "revoking the lease of a refused join failed; it expires by itself");
        }
        return Err(refusal);
    }
    let keep_alive_task = tokio::spawn(lease::keep_alive(
        Arc::clone(&standing),
        lease_client,
        lease,
        granted_ttl_s,
        config.keep_alive_interval(),
        timeout,
    ));
    Ok(HeldLease {
        owner_value: format!("{lease:x}/{}", config.node),
        lease,
        standing,
        keep_alive_task,
    })
}

/// The membership record a join read and found free to take (a gone node's, or this
/// node's own address): the claim overwrites it only if it is still that record.
struct Expected {
    value: Vec<u8>,
    mod_revision: i64,
}

/// How a claim of a node name ended.
enum NameClaim {
    /// The membership record is this node's, under its lease.
    Claimed,
    /// Another join wrote the record since it was read: a node starting under the same
    /// name at the same moment, at this address.
    HeldBy(String),
    /// The record read before is gone (its lease ended) and nothing replaced it.
    Vanished,
}

/// Claims the name `config.node` for `lease` in one transaction: creates the membership
/// record if there is none (`expected` is `None`), or overwrites the one read before
/// only if it is still that one. Of two joins racing for one name exactly one writes;
/// the other reads the winner's record. The answer is judged by the lease the record
/// is bound to, so a transaction sent again after its answer was lost finds its own
/// record.
async fn claim_name(
    kv: &etcd_client::KvClient,
    config: &EtcdConfig,
    key: &str,
    expected: Option<Expected>,
    lease: i64,
) -> Result<NameClaim, PlacementError> {
    let put = TxnOp::put(
        key.to_string(),
        config.address.clone(),
        Some(PutOptions::new().with_lease(lease)),
    );
    let get = TxnOp::get(key.to_string(), None);
    let txn = match expected {
        // Value comparisons only (all the simulator offers): every record written is
        // non-empty, and a missing key fails `> ""` in etcd and the simulator.
        None => Txn::new()
            .when(vec![Compare::value(key.to_string(), CompareOp::Greater, "")])
            .and_then(vec![get])
            .or_else(vec![put, get_again(key)]),
        Some(expected) => {
            #[cfg_attr(madsim, allow(unused_mut))]
            let mut compares = vec![Compare::value(key.to_string(), CompareOp::Equal, expected.value)];
            // Real etcd also tells two writes of the same address apart by revision; the
            // simulator compares values only (two of its machines never share an address).
            #[cfg(not(madsim))]
            compares.push(Compare::mod_revision(
                key.to_string(),
                CompareOp::Equal,
                expected.mod_revision,
            ));
            #[cfg(madsim)]
            let _ = expected.mod_revision;
            Txn::new()
                .when(compares)
                .and_then(vec![put, get])
                .or_else(vec![get_again(key)])
        }
    };
    let response = bounded(
        &config.endpoints.join(","),
        config.request_timeout(),
        PlacementOperation::Join,
        Some((&config.node, lease)),
        || {
            let (mut kv, txn) = (kv.clone(), txn.clone());
            async move { kv.txn(txn).await }
        },
    )
    .await?;
    let record = response.op_responses().into_iter().find_map(|op| match op {
        TxnOpResponse::Get(get) => get.kvs().first().cloned(),
        _ => None,
    });
    Ok(match record {
        None => NameClaim::Vanished,
        Some(record) if record.lease() == lease => NameClaim::Claimed,
        Some(record) => NameClaim::HeldBy(String::from_utf8_lossy(record.value()).into_owned()),
    })
}

/// Binds the cluster to the store `identity`, or checks that it is bound to it: one
/// transaction creates `/troupe/<cluster>/store` if absent (not bound to any lease: the
/// binding outlives every node) and reads it. Another identity there is
/// [`PlacementError::StoreMismatch`].
async fn bind_store(kv: &etcd_client::KvClient, config: &EtcdConfig, identity: &str) -> Result<(), PlacementError> {
    let key = format!("/troupe/{}/store", config.cluster);
    // Value comparisons only (all the simulator offers); validate refuses an empty
    // identity, so a missing key is the only one that fails `> ""`.
    let txn = Txn::new()
        .when(vec![Compare::value(key.clone(), CompareOp::Greater, "")])
        .and_then(vec![TxnOp::get(key.clone(), None)])
        .or_else(vec![TxnOp::put(key.clone(), identity, None), get_again(&key)]);
    let response = bounded(
        &config.endpoints.join(","),
        config.request_timeout(),
        PlacementOperation::Join,
        None,
        || {
            let (mut kv, txn) = (kv.clone(), txn.clone());
            async move { kv.txn(txn).await }
        },
    )
    .await?;
    let recorded = response
        .op_responses()
        .into_iter()
        .find_map(|op| match op {
            TxnOpResponse::Get(get) => get.kvs().first().cloned(),
            _ => None,
        })
        .ok_or_else(|| PlacementError::MalformedRecord {
            key: key.clone(),
            reason: "the store transaction returned no record".to_string(),
        })?;
    if recorded.value() == identity.as_bytes() {
        return Ok(());
    }
    Err(PlacementError::StoreMismatch {
        cluster: config.cluster.clone(),
        recorded: String::from_utf8_lossy(recorded.value()).into_owned(),
        store: identity.to_string(),
    })
}

fn get_again(key: &str) -> TxnOp {
    TxnOp::get(key.to_string(), None)
}

#[cfg(not(madsim))]
async fn connect(config: &EtcdConfig) -> Result<Client, etcd_client::Error> {
    let options = etcd_client::ConnectOptions::new()
        .with_connect_timeout(config.request_timeout())
        .with_timeout(config.request_timeout());
    Client::connect(&config.endpoints, Some(options)).await
}

#[cfg(madsim)]
async fn connect(config: &EtcdConfig) -> Result<Client, etcd_client::Error> {
    Client::connect(&config.endpoints, None).await
}

/// Runs one etcd request within `timeout` and types its failure; `attempt` makes one
/// attempt of it.
///
/// An attempt that fails as etcd being unavailable (a connection refused or broken, an
/// `Unavailable` answer, ...) is made again after [`ETCD_RETRY_PAUSE_MS`], until
/// `timeout` has passed since the first: the client spreads requests over all its
/// endpoints, so with one etcd member down a request may meet the dead one and the
/// next the live ones. Every request this crate sends may be sent twice: a placement
/// finds its own record, a release deletes only its own, a revoke of a revoked lease is
/// "not found", puts write the same value, and a second lease granted holds nothing.
/// Any other error ends the request at once.
///
/// `lease_holder` is the node and lease the request uses, if it uses one: etcd saying
/// "not found" to such a request means the lease is gone.
async fn bounded<T, F, Fut>(
    endpoints: &str,
    timeout: Duration,
    operation: PlacementOperation,
    lease_holder: Option<(&NodeId, i64)>,
    mut attempt: F,
) -> Result<T, PlacementError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, etcd_client::Error>>,
{
    let mut last_unavailable: Option<PlacementError> = None;
    let attempts = async {
        loop {
            match attempt().await {
                Ok(value) => return Ok(value),
                Err(error) => match classify(endpoints, operation, lease_holder, &error) {
                    unavailable @ PlacementError::EtcdUnavailable { .. } => {
                        last_unavailable = Some(unavailable);
                        tokio::time::sleep(Duration::from_millis(ETCD_RETRY_PAUSE_MS)).await;
                    }
                    other => return Err(other),
                },
            }
        }
    };
    match tokio::time::timeout(timeout, attempts).await {
        Ok(result) => result,
        Err(_elapsed) => Err(last_unavailable.unwrap_or_else(|| PlacementError::EtcdUnavailable {
            endpoints: endpoints.to_string(),
            operation,
            cause: format!("no answer within {} ms", timeout.as_millis()),
        })),
    }
}

/// Whether etcd's answer says a lease does not exist (expired or revoked).
pub(crate) fn says_lease_gone(error: &etcd_client::Error) -> bool {
    match error {
        etcd_client::Error::GRpcStatus(status) => status.code() == tonic::Code::NotFound,
        // The real client's keep-alive refuses a lease the server reports with TTL 0.
        etcd_client::Error::LeaseKeepAliveError(_) => true,
        _ => false,
    }
}

fn classify(
    endpoints: &str,
    operation: PlacementOperation,
    lease_holder: Option<(&NodeId, i64)>,
    error: &etcd_client::Error,
) -> PlacementError {
    let unavailable = || PlacementError::EtcdUnavailable {
        endpoints: endpoints.to_string(),
        operation,
        cause: error.to_string(),
    };
    match error {
        etcd_client::Error::GRpcStatus(status) => match status.code() {
            tonic::Code::Unavailable
            | tonic::Code::DeadlineExceeded
            | tonic::Code::Cancelled
            | tonic::Code::Aborted
            | tonic::Code::Unknown => unavailable(),
            tonic::Code::NotFound if lease_holder.is_some() => {
                let (node, lease) = lease_holder.expect("checked by the guard");
                PlacementError::LeaseExpired {
                    node: node.clone(),
                    lease,
                    reason: LeaseLostReason::ExpiredOnServer,
                }
            }
            _ => PlacementError::EtcdRefused {
                operation,
                cause: error.to_string(),
            },
        },
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => unavailable(),
        _ => PlacementError::EtcdRefused {
            operation,
            cause: error.to_string(),
        },
    }
}
