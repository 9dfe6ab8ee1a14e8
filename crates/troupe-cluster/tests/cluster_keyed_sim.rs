//! Keyed requests across a simulated cluster: a request whose caller did not learn its
//! outcome is sent again with the same idempotency key, through another node, and the
//! target's effect lands once.
//!
//! Three `ClusterNode`s on madsim's simulated etcd and one shared `MemoryStore`. A
//! `counter` is placed on node-3; its effect is counted in its committed state (the key
//! `count`, read from the store). The first attempt goes from node-1 with a slow turn;
//! the link between node-1 and node-3 is cut while the turn runs, so the turn commits on
//! node-3 but its reply is held back and node-1's caller times out. The retry goes
//! through node-2. Keyed (`RuntimeHandle::invoke_routed_keyed`, through the node's root
//! router and the transport), the retry gets the first attempt's reply and the count
//! stays; unkeyed (`invoke_routed`, the control), the retry applies the effect again.
//!
//! A second case kills the first attempt's node while the owner commits the attempt's
//! turn (the shared store's commits are held up for [`COMMIT_STALL_MS`] then): the turn
//! keeps its commit, and the retry through node-2, queued behind that commit, lands once
//! keyed and twice unkeyed (two tests, each its own cluster).
//!
//! Another kills the counter's node while a request's turn runs there: sent through
//! `ClusterClient::invoke_keyed`, node-1's router sends it again by itself until the
//! counter is placed anew (once the dead node's lease has ended) and it lands there;
//! sent through `ClusterClient::invoke`, the caller gets `Unreachable`.
//!
//! A third does the same for a turn's keyed call (`Caller::call_keyed` from an `order` actor on
//! node-1 to the counter on node-3, through the node's turn router), the turn run again
//! after it failed.
//!
//! Run with `CARGO_TARGET_DIR=target/madsim RUSTFLAGS="--cfg madsim" cargo nextest run
//! -p troupe-cluster --test cluster_keyed_sim`.
#![cfg(madsim)]

#[path = "../../troupe-agent/tests/support/forwarding_store.rs"]
mod forwarding_store;
#[path = "support/sim_etcd.rs"]
mod sim_etcd;

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use forwarding_store::{forwarding_state_store, ForwardingStore};
use madsim::net::NetSim;
use madsim::runtime::{Handle, NodeHandle};
use sim_etcd::start_sim_etcd;
use troupe_cluster::{ClusterClient, ClusterNode};
use troupe_core::{ActorId, ActorKind, InvokeError};
use troupe_etcd::{EtcdConfig, NodeId};
use troupe_runtime::{
    Actor, ActorBox, ActorError, Fence, IdempotencyKey, KindConfig, MemoryStore, RuntimeBuilder, RuntimeHandle,
    StateStore, StoreError, Turn, TurnCommit,
};

const ETCD_ADDRESS: &str = "10.0.0.1:2379";
/// The nodes' transport port.
const NODE_PORT: u16 = 7100;
const NODE_NAMES: [&str; 3] = ["node-1", "node-2", "node-3"];
/// Lease TTL, in seconds.
const SIM_LEASE_TTL_S: u64 = 3;
/// etcd request timeout, in milliseconds.
const SIM_REQUEST_TIMEOUT_MS: u64 = 500;
/// Pause before a node retries joining, in milliseconds.
const REJOIN_DELAY_MS: u64 = 500;
/// How long a counter's `slow` turn sleeps before it counts, in milliseconds.
const SLOW_TURN_MS: u64 = 500;
/// When the link between the first attempt's node and the counter's is cut, after the
/// attempt is sent, in milliseconds: the request has arrived (the connection is warm),
/// the slow turn has not committed yet.
const CUT_AFTER_MS: u64 = 200;
/// The deadline of the first attempt, in milliseconds: longer than the slow turn (so it
/// commits), ended by the cut (so its caller never hears of it).
const FIRST_ATTEMPT_MS: u64 = 2_000;
/// The deadline of every other request, in milliseconds.
const CALL_MS: u64 = 5_000;
/// How long a store commit takes while commits are stalled, in milliseconds.
const COMMIT_STALL_MS: u64 = 1_000;
/// When the first attempt's node is killed, after the attempt is sent, in milliseconds:
/// its turn has run and its commit is stalled.
const KILL_AFTER_MS: u64 = 300;
/// When the counter's node is killed, after a request is sent, in milliseconds: its
/// `slow` turn is running there, not yet counted.
const KILL_OWNER_AFTER_MS: u64 = 200;
/// The deadline of a request whose owner is killed, in milliseconds: longer than the
/// dead owner's lease ([`SIM_LEASE_TTL_S`]), so the actor can be placed anew in time.
const OWNER_DIES_CALL_MS: u64 = 10_000;
/// The turn's call timeout the `order` actor asks for, in milliseconds: its own deadline
/// clips it.
const ORDER_CALL_TIMEOUT_MS: u64 = 60_000;

/// `add` or `slow`: adds one to `count` (after [`SLOW_TURN_MS`] for `slow`) and replies
/// `<node>:<new count>`.
struct Counter {
    node: &'static str,
}

impl Actor for Counter {
    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        if payload.as_ref() == b"slow" {
            tokio::time::sleep(Duration::from_millis(SLOW_TURN_MS)).await;
        }
        let count = read_count(turn.get("count").await?);
        turn.put("count", Bytes::from((count + 1).to_string()))?;
        Ok(Bytes::from(format!("{}:{}", self.node, count + 1)))
    }
}

fn read_count(value: Option<Bytes>) -> u64 {
    value.map_or(0, |bytes| std::str::from_utf8(&bytes).unwrap().parse().unwrap())
}

/// Its payload is `<key> <counter payload>`, or `- <counter payload>` for an unkeyed
/// call: calls `counter:c` under the key `<key>` (or without one), then fails while the
/// shared flag is set, else replies with the counter's reply. Prefixed `tell `, it tells
/// the counter instead (keyed or not) and replies `told`.
struct Order {
    fail_after_call: Arc<AtomicBool>,
}

impl Actor for Order {
    async fn handle(&mut self, turn: &mut Turn, payload: Bytes) -> Result<Bytes, ActorError> {
        let text = std::str::from_utf8(&payload).map_err(|_| ActorError::rejected("not text"))?;
        let (tell, text) = match text.strip_prefix("tell ") {
            Some(rest) => (true, rest),
            None => (false, text),
        };
        let (key, add) = text
            .split_once(' ')
            .ok_or_else(|| ActorError::rejected("<key> <payload>"))?;
        let add = Bytes::from(add.to_string());
        let timeout = Duration::from_millis(ORDER_CALL_TIMEOUT_MS);
        let caller = turn.caller();
        let told = |()| Bytes::from_static(b"told");
        let reply = match (key, tell) {
            ("-", false) => caller.call(&counter("c"), add, timeout).await,
            ("-", true) => caller.tell(&counter("c"), add, timeout).await.map(told),
            (key, tell) => {
                let key = IdempotencyKey::new(key).map_err(|error| ActorError::rejected(error.to_string()))?;
                if tell {
                    caller.tell_keyed(&counter("c"), &key, add, timeout).await.map(told)
                } else {
                    caller.call_keyed(&counter("c"), &key, add, timeout).await
                }
            }
        };
        let reply = reply.map_err(|error| ActorError::failed(format!("the counter: {error}")))?;
        if self.fail_after_call.load(Ordering::SeqCst) {
            return Err(ActorError::failed("told to fail after the call"));
        }
        Ok(reply)
    }
}

fn counter(key: &str) -> ActorId {
    ActorId::new("counter", key).expect("an actor id")
}

fn order(key: &str) -> ActorId {
    ActorId::new("order", key).expect("an actor id")
}

fn runtime(node: &'static str, fail_after_call: Arc<AtomicBool>) -> RuntimeBuilder {
    troupe_runtime::Runtime::builder()
        .register(
            ActorKind::new("counter").expect("a kind name"),
            move |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> {
                Ok(ActorBox::new(Counter { node }))
            },
            KindConfig::default(),
        )
        .expect("register the counter")
        .register(
            ActorKind::new("order").expect("a kind name"),
            move |_: &ActorId, _: Option<Bytes>| -> Result<ActorBox, ActorError> {
                Ok(ActorBox::new(Order {
                    fail_after_call: Arc::clone(&fail_after_call),
                }))
            },
            KindConfig::default(),
        )
        .expect("register the order")
}

/// The shared store, whose commits each take [`COMMIT_STALL_MS`] while `stalled` is set
/// (checked when the commit starts).
#[derive(Clone)]
struct StallingStore {
    inner: MemoryStore,
    stalled: Arc<AtomicBool>,
}

#[async_trait::async_trait]
impl ForwardingStore for StallingStore {
    type Inner = MemoryStore;

    fn inner(&self) -> &MemoryStore {
        &self.inner
    }

    async fn forward_commit(&self, actor: &ActorId, fence: Fence, commit: TurnCommit) -> Result<(), StoreError> {
        if self.stalled.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(COMMIT_STALL_MS)).await;
        }
        self.inner.commit(actor, fence, commit).await
    }
}

forwarding_state_store!(StallingStore, fenced);

fn node_ip(index: usize) -> IpAddr {
    format!("10.0.1.{}", index + 1).parse().expect("an IP address")
}

/// Three nodes on one store, with each node's runtime handle.
struct Cluster {
    nodes: Vec<NodeHandle>,
    handles: Vec<RuntimeHandle>,
    clients: Vec<ClusterClient>,
    store: StallingStore,
    fail_after_call: Arc<AtomicBool>,
    _etcd: NodeHandle,
}

async fn start_cluster() -> Cluster {
    let handle = Handle::current();
    let etcd = start_sim_etcd(&handle, ETCD_ADDRESS).await;
    let store = StallingStore {
        inner: MemoryStore::new(),
        stalled: Arc::default(),
    };
    let fail_after_call = Arc::new(AtomicBool::new(false));
    type Slots = Vec<Option<(RuntimeHandle, ClusterClient)>>;
    let slots: Arc<Mutex<Slots>> = Arc::new(Mutex::new(vec![None; NODE_NAMES.len()]));
    let nodes = (0..NODE_NAMES.len())
        .map(|index| {
            let (slots, store, fail_after_call) = (Arc::clone(&slots), store.clone(), Arc::clone(&fail_after_call));
            handle
                .create_node()
                .name(NODE_NAMES[index])
                .ip(node_ip(index))
                .init(move || {
                    let (slots, store, fail_after_call) =
                        (Arc::clone(&slots), store.clone(), Arc::clone(&fail_after_call));
                    async move {
                        let name = NODE_NAMES[index];
                        let node = loop {
                            let config = EtcdConfig::new(
                                vec![ETCD_ADDRESS.to_string()],
                                "sim",
                                NodeId::new(name).expect("a node name"),
                                SocketAddr::new(node_ip(index), NODE_PORT).to_string(),
                            )
                            .with_lease_ttl_s(SIM_LEASE_TTL_S)
                            .with_request_timeout_ms(SIM_REQUEST_TIMEOUT_MS);
                            let listen = SocketAddr::new("0.0.0.0".parse().expect("an address"), NODE_PORT);
                            let runtime = runtime(name, Arc::clone(&fail_after_call));
                            match ClusterNode::start(config, listen, runtime, store.clone()).await {
                                Ok(node) => break node,
                                Err(_) => tokio::time::sleep(Duration::from_millis(REJOIN_DELAY_MS)).await,
                            }
                        };
                        slots.lock().expect("slots")[index] = Some((node.handle().clone(), node.client()));
                        std::future::pending::<()>().await;
                        drop(node);
                    }
                })
                .build()
        })
        .collect();
    let (handles, clients) = loop {
        let ready: Option<Vec<(RuntimeHandle, ClusterClient)>> = slots.lock().expect("slots").iter().cloned().collect();
        if let Some(ready) = ready {
            break ready.into_iter().unzip();
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    Cluster {
        nodes,
        handles,
        clients,
        store,
        fail_after_call,
        _etcd: etcd,
    }
}

/// How a request is sent.
#[derive(Clone, Copy, Debug)]
enum Sent {
    /// `invoke_routed_keyed` with this key.
    Keyed(&'static str),
    /// `invoke_routed` (the control).
    Unkeyed,
}

impl Cluster {
    /// Sends `payload` to `target` through node `index`'s root router (from inside that
    /// node), within `timeout_ms`.
    async fn send(
        &self,
        index: usize,
        target: ActorId,
        send: Sent,
        payload: &'static str,
        timeout_ms: u64,
    ) -> Result<String, InvokeError> {
        let handle = self.handles[index].clone();
        self.nodes[index]
            .spawn(async move {
                let deadline = handle.deadline_in(Duration::from_millis(timeout_ms));
                let payload = Bytes::from_static(payload.as_bytes());
                let reply = match send {
                    Sent::Keyed(key) => {
                        let key = IdempotencyKey::new(key).expect("a key");
                        handle.invoke_routed_keyed(&target, &key, payload, deadline).await
                    }
                    Sent::Unkeyed => handle.invoke_routed(&target, payload, deadline).await,
                };
                reply.map(|reply| String::from_utf8(reply.to_vec()).expect("text"))
            })
            .await
            .expect("the request's task")
    }

    /// The counter's committed count.
    async fn count(&self) -> u64 {
        read_count(self.store.get(&counter("c"), "count").await.expect("the store"))
    }

    /// The first attempt: from node-1, `add` to the counter sent as `send`; while its
    /// turn's commit on node-3 is stalled, node-1 is killed (the stall ends for later
    /// commits). Returns once the stalled commit is under way and node-1 is dead.
    async fn first_attempt_then_kill_its_node(&self, send: Sent) {
        let handle = self.handles[0].clone();
        self.store.stalled.store(true, Ordering::SeqCst);
        let attempt = self.nodes[0].spawn(async move {
            let deadline = handle.deadline_in(Duration::from_millis(CALL_MS));
            let payload = Bytes::from_static(b"add");
            match send {
                Sent::Keyed(key) => {
                    let key = IdempotencyKey::new(key).expect("a key");
                    handle.invoke_routed_keyed(&counter("c"), &key, payload, deadline).await
                }
                Sent::Unkeyed => handle.invoke_routed(&counter("c"), payload, deadline).await,
            }
        });
        tokio::time::sleep(Duration::from_millis(KILL_AFTER_MS)).await;
        Handle::current().kill(self.nodes[0].id());
        self.store.stalled.store(false, Ordering::SeqCst);
        drop(attempt);
    }

    /// Cuts (or heals) both directions of the link between nodes `a` and `b`.
    fn cut(&self, a: usize, b: usize, cut: bool) {
        let net = NetSim::current();
        let (a, b) = (self.nodes[a].id(), self.nodes[b].id());
        if cut {
            net.clog_link(a, b);
            net.clog_link(b, a);
        } else {
            net.unclog_link(a, b);
            net.unclog_link(b, a);
        }
    }

    /// Places the counter on node-3 (its first count) and warms node-1's and node-2's
    /// routes and connections to node-3 (a keyed request each, which counts once).
    async fn place_counter_on_node_3(&self) {
        let placed = self.send(2, counter("c"), Sent::Keyed("place"), "add", CALL_MS).await;
        assert_eq!(placed.expect("placed"), "node-3:1");
        let warm = self.send(0, counter("c"), Sent::Keyed("warm-1"), "add", CALL_MS).await;
        assert_eq!(warm.expect("warm from node-1"), "node-3:2");
        let warm = self.send(1, counter("c"), Sent::Keyed("warm-2"), "add", CALL_MS).await;
        assert_eq!(warm.expect("warm from node-2"), "node-3:3");
    }

    /// The first attempt: from node-1, `payload` to `target` sent as `send`, its
    /// `slow` turn on node-3 committing while the link node-1–node-3 is cut, so node-1's
    /// caller times out; the link is healed once it has. Returns the caller's error.
    async fn first_attempt_unheard(&self, target: ActorId, send: Sent, payload: &'static str) -> InvokeError {
        let handle = self.handles[0].clone();
        let attempt = self.nodes[0].spawn(async move {
            let deadline = handle.deadline_in(Duration::from_millis(FIRST_ATTEMPT_MS));
            let payload = Bytes::from_static(payload.as_bytes());
            match send {
                Sent::Keyed(key) => {
                    let key = IdempotencyKey::new(key).expect("a key");
                    handle.invoke_routed_keyed(&target, &key, payload, deadline).await
                }
                Sent::Unkeyed => handle.invoke_routed(&target, payload, deadline).await,
            }
        });
        tokio::time::sleep(Duration::from_millis(CUT_AFTER_MS)).await;
        self.cut(0, 2, true);
        let outcome = attempt.await.expect("the attempt's task");
        self.cut(0, 2, false);
        outcome.expect_err("the caller did not hear the reply")
    }
}

/// Goal: a keyed root request whose first attempt committed on the owner while its
/// caller timed out (the reply held up by a partition), sent again with the same key
/// through another node, lands the effect once and gets the first attempt's reply;
/// unkeyed, the same retry applies it twice. Method: count the counter's committed
/// effects in the shared store.
#[madsim::test]
async fn a_keyed_root_request_retried_through_another_node_lands_once() {
    let cluster = start_cluster().await;
    cluster.place_counter_on_node_3().await;

    let unheard = cluster
        .first_attempt_unheard(counter("c"), Sent::Keyed("order-7"), "slow")
        .await;
    assert!(
        matches!(unheard, InvokeError::Timeout { .. } | InvokeError::Unreachable { .. }),
        "{unheard:?}"
    );
    assert_eq!(cluster.count().await, 4, "the first attempt committed on node-3");
    let retry = cluster
        .send(1, counter("c"), Sent::Keyed("order-7"), "slow", CALL_MS)
        .await;
    assert_eq!(retry.expect("the retry"), "node-3:4", "the first attempt's reply");
    assert_eq!(cluster.count().await, 4, "keyed, the effect landed once");

    let unheard = cluster.first_attempt_unheard(counter("c"), Sent::Unkeyed, "slow").await;
    assert!(
        matches!(unheard, InvokeError::Timeout { .. } | InvokeError::Unreachable { .. }),
        "{unheard:?}"
    );
    assert_eq!(cluster.count().await, 5, "the first attempt committed on node-3");
    let retry = cluster.send(1, counter("c"), Sent::Unkeyed, "slow", CALL_MS).await;
    assert_eq!(retry.expect("the retry"), "node-3:6");
    assert_eq!(cluster.count().await, 6, "unkeyed, the retry applied it again");
}

/// Goal: a turn's keyed call to an actor on another node (through the node's turn
/// router and the transport) lands once when the turn is run again: the `order` turn on
/// node-1 calls the counter on node-3 under a key, then fails; run again, it makes the
/// same call and gets the recorded reply. Unkeyed, the same two attempts apply the effect
/// twice. Method: count the counter's committed effects in the shared store.
#[madsim::test]
async fn a_turns_keyed_call_to_another_node_lands_once_when_the_turn_is_run_again() {
    let cluster = start_cluster().await;
    cluster.place_counter_on_node_3().await;
    let placed = cluster.send(0, order("o"), Sent::Unkeyed, "- add", CALL_MS).await;
    assert_eq!(placed.expect("the order placed on node-1"), "node-3:4");

    cluster.fail_after_call.store(true, Ordering::SeqCst);
    let failed = cluster.send(0, order("o"), Sent::Unkeyed, "step-1 add", CALL_MS).await;
    assert!(failed.is_err(), "{failed:?}");
    assert_eq!(cluster.count().await, 5, "the counter's turn committed");
    cluster.fail_after_call.store(false, Ordering::SeqCst);
    let again = cluster.send(0, order("o"), Sent::Unkeyed, "step-1 add", CALL_MS).await;
    assert_eq!(again.expect("run again"), "node-3:5", "the recorded reply");
    assert_eq!(cluster.count().await, 5, "keyed, the effect landed once");

    cluster.fail_after_call.store(true, Ordering::SeqCst);
    let failed = cluster.send(0, order("o"), Sent::Unkeyed, "- add", CALL_MS).await;
    assert!(failed.is_err(), "{failed:?}");
    cluster.fail_after_call.store(false, Ordering::SeqCst);
    let again = cluster.send(0, order("o"), Sent::Unkeyed, "- add", CALL_MS).await;
    assert_eq!(again.expect("run again"), "node-3:7");
    assert_eq!(cluster.count().await, 7, "unkeyed, both attempts applied it");
}

/// Goal: a turn's keyed tell to an actor on another node (through the node's turn router
/// and the transport) lands once when the turn is run again: the `order` turn on node-1
/// tells the counter on node-3 under a key, then fails; run again, it tells it again
/// under the same key. Unkeyed, the same two attempts apply the effect twice. Method:
/// the count an `add` sent from node-1 behind the tells replies (a tell is in the
/// counter's mailbox when its turn goes on), and the committed count.
#[madsim::test]
async fn a_turns_keyed_tell_to_another_node_lands_once_when_the_turn_is_run_again() {
    let cluster = start_cluster().await;
    cluster.place_counter_on_node_3().await;
    let placed = cluster.send(0, order("o"), Sent::Unkeyed, "- add", CALL_MS).await;
    assert_eq!(placed.expect("the order placed on node-1"), "node-3:4");

    cluster.fail_after_call.store(true, Ordering::SeqCst);
    let failed = cluster
        .send(0, order("o"), Sent::Unkeyed, "tell deposit-1 add", CALL_MS)
        .await;
    assert!(failed.is_err(), "{failed:?}");
    cluster.fail_after_call.store(false, Ordering::SeqCst);
    let again = cluster
        .send(0, order("o"), Sent::Unkeyed, "tell deposit-1 add", CALL_MS)
        .await;
    assert_eq!(again.expect("run again"), "told");
    let behind = cluster.send(0, counter("c"), Sent::Unkeyed, "add", CALL_MS).await;
    assert_eq!(
        behind.expect("an add behind the tells"),
        "node-3:6",
        "keyed, the tell landed once"
    );

    cluster.fail_after_call.store(true, Ordering::SeqCst);
    let failed = cluster.send(0, order("o"), Sent::Unkeyed, "tell - add", CALL_MS).await;
    assert!(failed.is_err(), "{failed:?}");
    cluster.fail_after_call.store(false, Ordering::SeqCst);
    let again = cluster.send(0, order("o"), Sent::Unkeyed, "tell - add", CALL_MS).await;
    assert_eq!(again.expect("run again"), "told");
    let behind = cluster.send(0, counter("c"), Sent::Unkeyed, "add", CALL_MS).await;
    assert_eq!(
        behind.expect("an add behind the tells"),
        "node-3:9",
        "unkeyed, both applied it"
    );
    assert_eq!(cluster.count().await, 9);
}

/// The counter placed on node-3 (count 4 with the order's placing call), node-3 is
/// killed, then the `order` turn on node-1 tells the counter `told` (`tell <key> add` or
/// `tell - add`) under a deadline longer than node-3's lease: the order's reply, and the
/// reply of an `add` sent behind the tell once it was accepted.
async fn tell_from_a_turn_after_the_owner_died(told: &'static str) -> (Result<String, InvokeError>, Option<String>) {
    let cluster = start_cluster().await;
    cluster.place_counter_on_node_3().await;
    let placed = cluster.send(0, order("o"), Sent::Unkeyed, "- add", CALL_MS).await;
    assert_eq!(placed.expect("the order placed on node-1"), "node-3:4");
    Handle::current().kill(cluster.nodes[2].id());
    let outcome = cluster
        .send(0, order("o"), Sent::Unkeyed, told, OWNER_DIES_CALL_MS)
        .await;
    let behind = match outcome {
        Ok(_) => Some(
            cluster
                .send(0, counter("c"), Sent::Unkeyed, "add", CALL_MS)
                .await
                .expect("an add behind the tell"),
        ),
        Err(_) => None,
    };
    (outcome, behind)
}

/// Goal: a turn's keyed tell whose target's owner is dead is sent again by the node's
/// router until the actor is placed anew (once the dead owner's lease ended), and lands
/// once there. Method: the order's reply, and the count an `add` behind the tell sees.
#[madsim::test]
async fn a_turns_keyed_tell_to_a_dead_owner_is_sent_again_until_a_new_owner_accepts_it() {
    let (outcome, behind) = tell_from_a_turn_after_the_owner_died("tell deposit-2 add").await;
    assert_eq!(outcome.expect("accepted by the new owner"), "told");
    let behind = behind.expect("an add behind the tell");
    assert!(
        behind == "node-1:6" || behind == "node-2:6",
        "the tell landed once, on a live node: {behind}"
    );
}

/// Goal: the control of the test above: unkeyed, the router does not send the tell
/// again (it may have been accepted), and the turn hears `Unreachable`.
#[madsim::test]
async fn a_turns_unkeyed_tell_to_a_dead_owner_ends_unreachable() {
    let (outcome, _) = tell_from_a_turn_after_the_owner_died("tell - add").await;
    let error = outcome.expect_err("unreachable").to_string();
    assert!(error.contains("unreachable"), "{error}");
}

/// Tells the counter `add` through node `index`'s `ClusterClient`, keyed with `key` or
/// not, under a deadline `timeout_ms` away.
async fn client_tell(
    cluster: &Cluster,
    index: usize,
    key: Option<&'static str>,
    timeout_ms: u64,
) -> Result<(), InvokeError> {
    let client = cluster.clients[index].clone();
    cluster.nodes[index]
        .spawn(async move {
            let deadline = client.deadline_in(Duration::from_millis(timeout_ms));
            let payload = Bytes::from_static(b"add");
            match key {
                Some(key) => {
                    let key = IdempotencyKey::new(key).expect("a key");
                    client.tell_keyed(&counter("c"), &key, payload, deadline).await
                }
                None => client.tell(&counter("c"), payload, deadline).await,
            }
        })
        .await
        .expect("the tell's task")
}

/// Goal: `ClusterClient::tell` from outside any turn reaches the owner on another node;
/// `ClusterClient::tell_keyed` sent three times with one key, through node-1 twice and
/// node-2 once, lands once. Method: the count an `add` sent from node-1 behind the tells
/// replies (3 after placing).
#[madsim::test]
async fn a_clients_tell_reaches_the_owner_and_a_keyed_one_sent_again_through_any_node_lands_once() {
    let cluster = start_cluster().await;
    cluster.place_counter_on_node_3().await;
    client_tell(&cluster, 0, None, CALL_MS)
        .await
        .expect("accepted on node-3");
    let behind = cluster.send(0, counter("c"), Sent::Unkeyed, "add", CALL_MS).await;
    assert_eq!(behind.expect("an add behind the tell"), "node-3:5", "the tell landed");
    for index in [0, 0, 1] {
        client_tell(&cluster, index, Some("deposit-3"), CALL_MS)
            .await
            .expect("accepted on node-3");
    }
    let behind = cluster.send(0, counter("c"), Sent::Unkeyed, "add", CALL_MS).await;
    assert_eq!(
        behind.expect("an add behind the tells"),
        "node-3:7",
        "three copies, one effect"
    );
}

/// Goal: a client's keyed tell whose target's owner is dead is sent again by the node
/// until the actor is placed anew, and lands once; unkeyed, it ends `Unreachable` (it
/// may have been accepted). Method: the outcome, and the count an `add` behind sees.
#[madsim::test]
async fn a_clients_keyed_tell_to_a_dead_owner_is_sent_again_and_an_unkeyed_one_ends_unreachable() {
    let cluster = start_cluster().await;
    cluster.place_counter_on_node_3().await;
    Handle::current().kill(cluster.nodes[2].id());
    let unkeyed = client_tell(&cluster, 0, None, OWNER_DIES_CALL_MS).await;
    assert!(matches!(unkeyed, Err(InvokeError::Unreachable { .. })), "{unkeyed:?}");
    client_tell(&cluster, 0, Some("deposit-4"), OWNER_DIES_CALL_MS)
        .await
        .expect("accepted by the new owner");
    let behind = cluster
        .send(0, counter("c"), Sent::Unkeyed, "add", CALL_MS)
        .await
        .expect("an add behind the tell");
    assert!(
        behind == "node-1:5" || behind == "node-2:5",
        "the keyed tell landed once, on a live node: {behind}"
    );
}

/// Sends a `slow` request to the counter (placed on node-3) through node-1's
/// `ClusterClient`, as `send`, and kills node-3 while its turn runs: the request's
/// outcome and the count after it.
async fn send_while_the_owner_dies(send: Sent) -> (Result<String, InvokeError>, u64) {
    let cluster = start_cluster().await;
    cluster.place_counter_on_node_3().await;
    let client = cluster.clients[0].clone();
    let request = cluster.nodes[0].spawn(async move {
        let deadline = client.deadline_in(Duration::from_millis(OWNER_DIES_CALL_MS));
        let payload = Bytes::from_static(b"slow");
        let reply = match send {
            Sent::Keyed(key) => {
                let key = IdempotencyKey::new(key).expect("a key");
                client.invoke_keyed(&counter("c"), &key, payload, deadline).await
            }
            Sent::Unkeyed => client.invoke(&counter("c"), payload, deadline).await,
        };
        reply.map(|reply| String::from_utf8(reply.to_vec()).expect("text"))
    });
    tokio::time::sleep(Duration::from_millis(KILL_OWNER_AFTER_MS)).await;
    Handle::current().kill(cluster.nodes[2].id());
    let outcome = request.await.expect("the request's task");
    (outcome, cluster.count().await)
}

/// Goal: a keyed request whose owner dies while its turn runs is sent again by the
/// node's router by itself, the owner looked up again each time, until the actor is
/// placed anew once the dead owner's lease has ended; it lands once, on a live node.
/// Method: the caller's reply and the counter's committed count (3 before).
#[madsim::test]
async fn a_keyed_request_whose_owner_dies_is_sent_again_by_the_router_until_a_new_owner_answers() {
    let (outcome, count) = send_while_the_owner_dies(Sent::Keyed("order-11")).await;
    let reply = outcome.expect("the router sent it again until it got through");
    assert!(
        reply == "node-1:4" || reply == "node-2:4",
        "placed anew on a live node: {reply}"
    );
    assert_eq!(count, 4, "the dead owner's turn never counted; the retry did, once");
}

/// Goal: the control of the test above: unkeyed, the router does not send the request
/// again (it may have run), and the caller hears `Unreachable`.
#[madsim::test]
async fn an_unkeyed_request_whose_owner_dies_ends_unreachable() {
    let (outcome, count) = send_while_the_owner_dies(Sent::Unkeyed).await;
    assert!(matches!(outcome, Err(InvokeError::Unreachable { .. })), "{outcome:?}");
    assert_eq!(count, 3, "the dead owner's turn never counted");
}

/// Kills the first attempt's node while the owner commits its turn, then sends the
/// request again through node-2 as `send`: the retry's reply and the count after it.
async fn retry_after_the_first_attempts_node_is_killed(send: Sent) -> (String, u64) {
    let cluster = start_cluster().await;
    cluster.place_counter_on_node_3().await;
    cluster.first_attempt_then_kill_its_node(send).await;
    let retry = cluster.send(1, counter("c"), send, "add", CALL_MS).await;
    (retry.expect("the retry"), cluster.count().await)
}

/// Goal: a keyed root request whose first attempt's node is killed while the owner
/// commits the attempt's turn (a turn already committing keeps its commit), sent again
/// with the same key through another node, lands once and gets the first attempt's
/// reply. Method: count the counter's committed effects in the shared store.
#[madsim::test]
async fn a_keyed_request_retried_after_its_node_is_killed_in_the_commit_window_lands_once() {
    let (reply, count) = retry_after_the_first_attempts_node_is_killed(Sent::Keyed("order-9")).await;
    assert_eq!(reply, "node-3:4", "the first attempt's reply");
    assert_eq!(count, 4, "keyed, the effect landed once");
}

/// Goal: the control of the test above: unkeyed, the retry applies the effect again.
#[madsim::test]
async fn an_unkeyed_request_retried_after_its_node_is_killed_in_the_commit_window_lands_twice() {
    let (reply, count) = retry_after_the_first_attempts_node_is_killed(Sent::Unkeyed).await;
    assert_eq!(reply, "node-3:5");
    assert_eq!(
        count, 5,
        "unkeyed, the killed node's attempt and the retry both applied it"
    );
}
