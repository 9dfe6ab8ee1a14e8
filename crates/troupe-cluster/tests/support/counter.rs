//! What the cluster tests share: a counter actor that says which node served it, and a
//! store wrapper that logs every claim and commit with its node and fence.
//!
//! The log is read, never trusted blindly: the invariants below are computed from it
//! and from the replies, so a second owner (two nodes serving one actor from one state)
//! shows up as two commits or two replies of the same count.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use troupe_core::{ActorId, ActorKind};
use troupe_runtime::{
    Actor, ActorBox, ActorError, Claimed, Fence, FencedClaim, KindConfig, RuntimeBuilder, StateChange, StateStore,
    StoreError, Turn, TurnCommit,
};

/// How long a counter sleeps in a turn for `slow@<its node>` before counting, in ms.
pub(crate) const SLOW_TURN_MS: u64 = 3_000;

/// Counts its calls; each reply is `node:count`.
struct Counter {
    node: String,
    count: u64,
}

impl Actor for Counter {
    async fn handle(&mut self, _turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        // `slow@<node>`: slow only where `<node>` serves it (a rerouted retry is quick).
        if payload.strip_prefix(b"slow@".as_slice()) == Some(self.node.as_bytes()) {
            tokio::time::sleep(Duration::from_millis(SLOW_TURN_MS)).await;
        }
        self.count += 1;
        Ok(Bytes::from(format!("{}:{}", self.node, self.count)))
    }

    fn snapshot(&self) -> Result<Option<Bytes>, ActorError> {
        Ok(Some(Bytes::from(self.count.to_string())))
    }
}

/// Starts a node with a counter runtime for each of `names`, each with its own handle
/// on the SQLite file at `path` (as separate processes would), in that order; `config`
/// gives a node's etcd configuration from its name (`TestEtcd::config`).
#[cfg(not(madsim))]
#[allow(dead_code)] // cluster_etcd.rs starts its nodes with logging stores instead
pub(crate) async fn start_counter_nodes(
    names: &[&str],
    config: impl Fn(&str) -> troupe_etcd::EtcdConfig,
    path: &std::path::Path,
) -> Vec<troupe_cluster::ClusterNode> {
    let mut nodes = Vec::new();
    for &node in names {
        let store = troupe_runtime::SqliteStore::open(path).expect("open the shared SQLite file");
        let started = troupe_cluster::ClusterNode::start(
            config(node),
            "127.0.0.1:0".parse().expect("an address"),
            counter_runtime(node),
            store,
        )
        .await
        .expect("start the node");
        nodes.push(started);
    }
    nodes
}

/// A runtime builder with the `counter` kind, whose replies name `node`.
pub(crate) fn counter_runtime(node: &str) -> RuntimeBuilder {
    let node = node.to_string();
    troupe_runtime::Runtime::builder()
        .register(
            ActorKind::new("counter").expect("a kind name"),
            move |_id: &ActorId, saved: Option<Bytes>| -> Result<ActorBox, ActorError> {
                let count = match saved {
                    None => 0,
                    Some(bytes) => std::str::from_utf8(&bytes)
                        .ok()
                        .and_then(|text| text.parse().ok())
                        .ok_or_else(|| ActorError::failed("the saved count is not a number"))?,
                };
                Ok(ActorBox::new(Counter {
                    node: node.clone(),
                    count,
                }))
            },
            KindConfig::default(),
        )
        .expect("register the counter")
}

pub(crate) fn counter(key: &str) -> ActorId {
    ActorId::new("counter", key).expect("an actor id")
}

/// Splits a reply `node:count`.
pub(crate) fn parse_reply(reply: &[u8]) -> (String, u64) {
    let text = std::str::from_utf8(reply).expect("a text reply");
    let (node, count) = text.rsplit_once(':').expect("node:count");
    (node.to_string(), count.parse().expect("a count"))
}

/// One store operation, as the node that made it saw it end.
#[derive(Clone, Debug)]
pub(crate) struct Logged {
    pub(crate) node: String,
    pub(crate) actor: String,
    pub(crate) fence: u64,
    /// `None` for a claim; the committed count for a commit.
    pub(crate) count: Option<u64>,
    pub(crate) ok: bool,
}

/// The shared log of every node's store operations.
#[derive(Clone, Default)]
pub(crate) struct StoreLog(Arc<Mutex<Vec<Logged>>>);

impl StoreLog {
    fn push(&self, entry: Logged) {
        self.0.lock().expect("the log").push(entry);
    }

    pub(crate) fn entries(&self) -> Vec<Logged> {
        self.0.lock().expect("the log").clone()
    }

    /// Checks single ownership from the log and returns, per actor, the highest fence
    /// each node claimed with:
    /// - a fence is claimed by one node only;
    /// - a count is committed once only (two owners serving from one state would both
    ///   commit the same next count);
    /// - ordered by count, the commits' fences never go down (no older owner wrote after a
    ///   newer one).
    pub(crate) fn check_single_owner(&self) -> BTreeMap<String, BTreeMap<String, u64>> {
        let entries = self.entries();
        let mut claimed_by: BTreeMap<(String, u64), String> = BTreeMap::new();
        let mut commits: BTreeMap<String, BTreeMap<u64, (u64, String)>> = BTreeMap::new();
        let mut fences: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
        for entry in entries.iter().filter(|entry| entry.ok) {
            match entry.count {
                None => {
                    if let Some(other) = claimed_by.insert((entry.actor.clone(), entry.fence), entry.node.clone()) {
                        assert_eq!(
                            other, entry.node,
                            "{} fence {} claimed by two nodes",
                            entry.actor, entry.fence
                        );
                    }
                    let highest = fences
                        .entry(entry.actor.clone())
                        .or_default()
                        .entry(entry.node.clone())
                        .or_default();
                    *highest = (*highest).max(entry.fence);
                }
                Some(count) => {
                    let previous = commits
                        .entry(entry.actor.clone())
                        .or_default()
                        .insert(count, (entry.fence, entry.node.clone()));
                    assert!(
                        previous.is_none(),
                        "{} count {count} committed twice: {previous:?} and {} under {}",
                        entry.actor,
                        entry.node,
                        entry.fence
                    );
                    assert_eq!(
                        claimed_by.get(&(entry.actor.clone(), entry.fence)),
                        Some(&entry.node),
                        "{} committed under fence {} that {} never claimed",
                        entry.actor,
                        entry.fence,
                        entry.node
                    );
                }
            }
        }
        for (actor, by_count) in &commits {
            let fences: Vec<u64> = by_count.values().map(|(fence, _)| *fence).collect();
            assert!(
                fences.windows(2).all(|pair| pair[0] <= pair[1]),
                "{actor}: a newer count was committed under an older fence: {by_count:?}"
            );
        }
        fences
    }
}

impl StoreLog {
    /// Checks, for each of `actors`, that the log's successful commits hold exactly the
    /// counts 1..=n, n being the count `store` holds at the end (nothing lost, nothing
    /// committed that the store does not hold), and that no acknowledged reply in
    /// `acks` carries a count over n (no acknowledged count was lost).
    #[allow(dead_code)] // the tests that check counts at their end use it
    pub(crate) async fn check_committed_counts(
        &self,
        store: &impl StateStore,
        actors: impl IntoIterator<Item = ActorId>,
        acks: &[(ActorId, String, u64)],
    ) {
        let mut committed: BTreeMap<String, BTreeSet<u64>> = BTreeMap::new();
        for entry in self.entries().into_iter().filter(|entry| entry.ok) {
            if let Some(count) = entry.count {
                committed.entry(entry.actor).or_default().insert(count);
            }
        }
        for actor in actors {
            let stored = store.load(&actor).await.expect("load");
            let final_count: u64 = stored.map_or(0, |bytes| {
                std::str::from_utf8(&bytes).expect("text").parse().expect("a count")
            });
            let counts = committed.remove(&actor.to_string()).unwrap_or_default();
            assert_eq!(
                counts,
                (1..=final_count).collect::<BTreeSet<_>>(),
                "{actor}: the committed counts must be exactly 1..={final_count}"
            );
            let highest_ack = acks
                .iter()
                .filter(|(acked, _, _)| *acked == actor)
                .map(|(_, _, count)| *count)
                .max();
            assert!(
                highest_ack.unwrap_or(0) <= final_count,
                "{actor}: acknowledged {highest_ack:?} but the store holds {final_count}"
            );
        }
    }
}

/// Checks that no two acknowledged replies of one actor carry the same count, and
/// returns how many distinct counts each actor acknowledged.
pub(crate) fn check_distinct_acks(acks: &[(ActorId, String, u64)]) -> BTreeMap<String, usize> {
    let mut seen: BTreeMap<String, BTreeSet<u64>> = BTreeMap::new();
    for (actor, node, count) in acks {
        assert!(
            seen.entry(actor.to_string()).or_default().insert(*count),
            "{actor}: count {count} acknowledged twice (the second from {node})"
        );
    }
    seen.into_iter().map(|(actor, counts)| (actor, counts.len())).collect()
}

/// A store that logs each claim and commit of one node into a shared [`StoreLog`].
#[derive(Clone)]
pub(crate) struct LoggingStore<S> {
    pub(crate) inner: S,
    pub(crate) node: String,
    pub(crate) log: StoreLog,
}

#[async_trait]
impl<S: FencedClaim + Clone> StateStore for LoggingStore<S> {
    async fn claim(&self, actor: &ActorId) -> Result<Claimed, StoreError> {
        self.inner.claim(actor).await
    }

    async fn load(&self, actor: &ActorId) -> Result<Option<Bytes>, StoreError> {
        self.inner.load(actor).await
    }

    async fn commit(&self, actor: &ActorId, fence: Fence, commit: TurnCommit) -> Result<(), StoreError> {
        let count = match &commit.state {
            StateChange::Set(bytes) => std::str::from_utf8(bytes).ok().and_then(|text| text.parse().ok()),
            StateChange::Unchanged | StateChange::Deleted => None,
        };
        let result = self.inner.commit(actor, fence, commit).await;
        if let Some(count) = count {
            self.log.push(Logged {
                node: self.node.clone(),
                actor: actor.to_string(),
                fence: fence.token(),
                count: Some(count),
                ok: result.is_ok(),
            });
        }
        result
    }

    async fn get(&self, actor: &ActorId, key: &str) -> Result<Option<Bytes>, StoreError> {
        self.inner.get(actor, key).await
    }

    async fn scan(
        &self,
        actor: &ActorId,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Bytes)>, StoreError> {
        self.inner.scan(actor, prefix, after, limit).await
    }
}

#[async_trait]
impl<S: FencedClaim + Clone> FencedClaim for LoggingStore<S> {
    async fn claim_with_fence(&self, actor: &ActorId, fence: Fence) -> Result<Claimed, StoreError> {
        let result = self.inner.claim_with_fence(actor, fence).await;
        self.log.push(Logged {
            node: self.node.clone(),
            actor: actor.to_string(),
            fence: fence.token(),
            count: None,
            ok: result.is_ok(),
        });
        result
    }
}
