//! `EtcdPlacement` under the simulator, against madsim's simulated etcd (`SimServer`).
//!
//! Goal: the lease and fencing rules hold through a partition between a node and etcd
//! and through a node kill, and a run is a function of its seed. Method: three simulated
//! machines (etcd, node A, node B) and one `MemoryStore` that both nodes reach (the
//! worst case: the cut-off owner can still write to the store). A places `x` and
//! commits; its links to etcd are cut; A's `lease_lost` fires before etcd can expire the
//! lease; B then places `x` with a newer fence and claims it; A's commit under its old
//! fence is refused and A's `place` is refused without asking etcd. The links heal, B is
//! killed, A joins anew and takes `x` back with a fence newer than B's. Every step is
//! recorded with its virtual time; the replay test runs several seeds twice each and
//! requires identical records.
//!
//! Run with `CARGO_TARGET_DIR=target/madsim RUSTFLAGS="--cfg madsim" cargo nextest run -p troupe-etcd`.
#![cfg(madsim)]

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use bytes::Bytes;
use madsim::net::NetSim;
use madsim::runtime::Handle;
use tokio::time::Instant;
use troupe_core::ActorId;
use troupe_etcd::{EtcdConfig, EtcdPlacement, LeaseLostReason, NodeId, Placement, PlacementError, PlacementRecord};
use troupe_runtime::{FencedClaim, MemoryStore, StateChange, StateStore, StoreError, TurnCommit};

/// The simulated etcd's address.
const ETCD_ADDRESS: &str = "10.0.0.1:2379";
/// Lease TTL of the simulated nodes, in seconds.
const SIM_LEASE_TTL_S: u64 = 3;
/// Request timeout of the simulated nodes, in milliseconds.
const SIM_REQUEST_TIMEOUT_MS: u64 = 500;
/// How long a step may poll for a takeover, in virtual milliseconds: TTL, one tick of
/// the simulated etcd's lease clock, and the request timeout.
const TAKEOVER_BOUND_MS: u64 = SIM_LEASE_TTL_S * 1_000 + 1_000 + SIM_REQUEST_TIMEOUT_MS;
/// Seeds the replay test runs, each twice.
const REPLAY_SEEDS: u64 = 4;

fn config(node: &str) -> EtcdConfig {
    EtcdConfig::new(
        vec![ETCD_ADDRESS.to_string()],
        "sim",
        NodeId::new(node).expect("a valid node name"),
        format!("{node}:7100"),
    )
    .with_lease_ttl_s(SIM_LEASE_TTL_S)
    .with_request_timeout_ms(SIM_REQUEST_TIMEOUT_MS)
}

fn commit(text: &str) -> TurnCommit {
    TurnCommit {
        state: StateChange::Set(Bytes::copy_from_slice(text.as_bytes())),
        writes: Vec::new(),
    }
}

/// The simulated etcd's machine, serving at [`ETCD_ADDRESS`].
fn start_etcd(handle: &Handle) -> madsim::runtime::NodeHandle {
    let etcd_address: SocketAddr = ETCD_ADDRESS.parse().expect("an address");
    handle
        .create_node()
        .name("etcd")
        .ip(etcd_address.ip())
        .init(move || async move {
            etcd_client::SimServer::builder()
                .serve(etcd_address)
                .await
                .expect("the simulated etcd serves");
        })
        .build()
}

fn ip(text: &str) -> IpAddr {
    text.parse().expect("an IP address")
}

/// Polls `place` until it succeeds, for at most [`TAKEOVER_BOUND_MS`].
async fn place_when_free(placement: &EtcdPlacement, actor: &ActorId) -> PlacementRecord {
    let started = Instant::now();
    loop {
        match placement.place(actor).await {
            Ok(record) => return record,
            Err(PlacementError::PlacementConflict { .. } | PlacementError::EtcdUnavailable { .. }) => {
                assert!(
                    started.elapsed() < Duration::from_millis(TAKEOVER_BOUND_MS),
                    "{actor} was not free within {TAKEOVER_BOUND_MS} ms"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(other) => panic!("placing {actor}: {other}"),
        }
    }
}

async fn member_names(placement: &EtcdPlacement) -> Vec<String> {
    placement
        .nodes()
        .await
        .expect("list the members")
        .into_iter()
        .map(|member| member.node.to_string())
        .collect()
}

/// The scenario of the module documentation; returns its record of steps.
async fn partition_and_kill_scenario() -> Vec<String> {
    let handle = Handle::current();
    let start = Instant::now();
    let mut record = Vec::new();
    let mut note = |step: String| record.push(format!("{:>6} ms {step}", start.elapsed().as_millis()));
    let etcd = start_etcd(&handle);
    let node_a = handle.create_node().name("node-a").ip(ip("10.0.1.1")).build();
    let node_b = handle.create_node().name("node-b").ip(ip("10.0.1.2")).build();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let store = MemoryStore::new();
    let x = ActorId::new("counter", "x").expect("an actor id");

    // A places x, claims it with the placement's fence and commits.
    let (placement_a, fence_a) = node_a
        .spawn({
            let (store, x) = (store.clone(), x.clone());
            async move {
                let placement = EtcdPlacement::join(config("node-a")).await.expect("A joins");
                let placed = placement.place(&x).await.expect("A places x");
                store.claim_with_fence(&x, placed.fence).await.expect("A claims x");
                store.commit(&x, placed.fence, commit("A1")).await.expect("A commits");
                (placement, placed.fence)
            }
        })
        .await
        .expect("A's task");
    note(format!("A placed x with {fence_a} and committed"));

    let placement_b = node_b
        .spawn({
            let x = x.clone();
            async move {
                let placement = EtcdPlacement::join(config("node-b")).await.expect("B joins");
                match placement.place(&x).await {
                    Err(PlacementError::PlacementConflict { owner, .. }) => assert_eq!(owner.as_str(), "node-a"),
                    other => panic!("B must not place x while A holds it: {other:?}"),
                }
                assert_eq!(member_names(&placement).await, ["node-a", "node-b"]);
                placement
            }
        })
        .await
        .expect("B's task");
    note("B joined; x is A's".to_string());

    // Cut A off from etcd (only from etcd: A still reaches the store).
    let net = NetSim::current();
    net.clog_link(node_a.id(), etcd.id());
    net.clog_link(etcd.id(), node_a.id());
    let cut = Instant::now();
    let lost = node_a
        .spawn({
            let placement = placement_a.clone();
            async move { placement.lease_lost().await }
        })
        .await
        .expect("A's task");
    let lost_after = cut.elapsed();
    assert_eq!(lost, LeaseLostReason::NotRenewedInTime);
    assert!(
        lost_after < Duration::from_secs(SIM_LEASE_TTL_S),
        "A must know its lease is lost before etcd can expire it; knew after {lost_after:?}"
    );
    note(format!("A cut off from etcd; A's lease_lost fired ({lost:?})"));

    let fence_b = node_b
        .spawn({
            let (store, x, placement) = (store.clone(), x.clone(), placement_b.clone());
            async move {
                let placed = place_when_free(&placement, &x).await;
                let claimed = store.claim_with_fence(&x, placed.fence).await.expect("B claims x");
                assert_eq!(claimed.state.as_deref(), Some(&b"A1"[..]));
                placed.fence
            }
        })
        .await
        .expect("B's task");
    let moved_after = cut.elapsed();
    assert!(
        fence_b > fence_a,
        "B's fence {fence_b} must be newer than A's {fence_a}"
    );
    note(format!("x moved to B with {fence_b}"));
    eprintln!("A knew its lease lost {lost_after:?} after the cut; x moved to B {moved_after:?} after it");

    // A, the zombie, still reaches the store: its commit and its re-claim are refused,
    // and its placement is refused without asking etcd.
    node_a
        .spawn({
            let (store, x, placement) = (store.clone(), x.clone(), placement_a.clone());
            async move {
                match store.commit(&x, fence_a, commit("zombie A")).await {
                    Err(StoreError::Fenced { held, current, .. }) => {
                        assert_eq!((held, current), (fence_a, Some(fence_b)));
                    }
                    other => panic!("the zombie's commit must be fenced: {other:?}"),
                }
                assert!(matches!(
                    store.claim_with_fence(&x, fence_a).await,
                    Err(StoreError::Fenced { .. })
                ));
                assert!(matches!(
                    placement.place(&x).await,
                    Err(PlacementError::LeaseExpired { .. })
                ));
            }
        })
        .await
        .expect("A's task");
    node_b
        .spawn({
            let (store, x) = (store.clone(), x.clone());
            async move { store.commit(&x, fence_b, commit("B1")).await.expect("B commits") }
        })
        .await
        .expect("B's task");
    assert_eq!(store.load(&x).await.expect("load").as_deref(), Some(&b"B1"[..]));
    note("the zombie A was refused; B committed".to_string());

    // Heal A's links, kill B; A joins anew and takes x back with a newer fence.
    net.unclog_link(node_a.id(), etcd.id());
    net.unclog_link(etcd.id(), node_a.id());
    drop(placement_a);
    drop(placement_b);
    handle.kill(node_b.id());
    let fence_c = node_a
        .spawn({
            let (store, x) = (store.clone(), x.clone());
            async move {
                let placement = EtcdPlacement::join(config("node-a")).await.expect("A joins again");
                let placed = place_when_free(&placement, &x).await;
                let claimed = store
                    .claim_with_fence(&x, placed.fence)
                    .await
                    .expect("A claims x again");
                assert_eq!(claimed.state.as_deref(), Some(&b"B1"[..]));
                assert_eq!(
                    member_names(&placement).await,
                    ["node-a"],
                    "the killed B left the member list with its lease"
                );
                placed.fence
            }
        })
        .await
        .expect("A's task");
    assert!(
        fence_c > fence_b,
        "A's new fence {fence_c} must be newer than B's {fence_b}"
    );
    note(format!("B killed; x back on A with {fence_c}"));
    record
}

/// The scenario under the seed madsim picks (`MADSIM_TEST_SEED` replays one).
#[madsim::test]
async fn partitioned_owner_loses_its_actor_and_its_fenced_commit_is_refused() {
    let record = partition_and_kill_scenario().await;
    for step in &record {
        eprintln!("{step}");
    }
    assert_eq!(record.len(), 6, "every step ran");
}

/// Replays: each of [`REPLAY_SEEDS`] seeds runs the scenario twice in fresh simulations;
/// both runs of a seed record the same steps at the same virtual times.
#[test]
fn scenario_replays_identically_from_its_seed() {
    let mut distinct = std::collections::BTreeSet::new();
    for seed in 1..=REPLAY_SEEDS {
        let run = || {
            let mut runtime = madsim::runtime::Runtime::with_seed_and_config(seed, madsim::Config::default());
            runtime.set_time_limit(Duration::from_secs(120));
            runtime.block_on(partition_and_kill_scenario())
        };
        let first = run();
        let second = run();
        assert_eq!(first, second, "seed {seed} did not replay");
        distinct.insert(first);
    }
    eprintln!("{} distinct records from {REPLAY_SEEDS} seeds", distinct.len());
}

/// Goal (simulated): the store binding and the atomic name claim hold against the
/// simulated etcd, which compares values only. Method: node-a joins with store-1;
/// node-b with store-2 is refused `StoreMismatch` and is no member; two node-c joins
/// from two machines at one instant: exactly one joins, the other is refused
/// `NodeNameInUse` naming the winner.
#[madsim::test]
async fn the_store_binding_and_the_name_claim_hold_on_the_simulated_etcd() {
    let handle = Handle::current();
    let _etcd = start_etcd(&handle);
    let machines: Vec<_> = (1..=3)
        .map(|index| {
            handle
                .create_node()
                .name(format!("machine-{index}"))
                .ip(ip(&format!("10.0.1.{index}")))
                .build()
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let a = machines[0]
        .spawn(EtcdPlacement::join(config("node-a").with_store_identity("store-1")))
        .await
        .expect("the task")
        .expect("node-a binds the cluster to store-1");
    let refused = machines[1]
        .spawn(EtcdPlacement::join(config("node-b").with_store_identity("store-2")))
        .await
        .expect("the task");
    match refused {
        Err(PlacementError::StoreMismatch { recorded, store, .. }) => {
            assert_eq!((recorded.as_str(), store.as_str()), ("store-1", "store-2"));
        }
        other => panic!("node-b of store-2 was not refused: {other:?}"),
    }
    assert_eq!(member_names(&a).await, ["node-a"]);

    let racing: Vec<_> = machines[1..]
        .iter()
        .enumerate()
        .map(|(index, machine)| {
            let mut config = config("node-c").with_store_identity("store-1");
            config.address = format!("10.0.1.{}:7100", index + 2);
            machine.spawn(EtcdPlacement::join_unless_in_use(config, |_address: String| {
                std::future::ready(true)
            }))
        })
        .collect();
    let mut won = Vec::new();
    let mut refused = Vec::new();
    for join in racing {
        match join.await.expect("the task") {
            Ok(placement) => won.push(placement),
            Err(PlacementError::NodeNameInUse { address, .. }) => refused.push(address),
            Err(other) => panic!("a racing join failed otherwise: {other}"),
        }
    }
    assert_eq!((won.len(), refused.len()), (1, 1), "one winner, one refused");
    let members = won[0].nodes().await.expect("nodes");
    let recorded = members
        .iter()
        .find(|member| member.node.as_str() == "node-c")
        .expect("node-c is a member");
    assert_eq!(recorded.address, refused[0], "the refusal names the winner");
}

/// The largest request timeout a 3 s lease accepts, in milliseconds
/// (`TTL − slack − TTL/3 − 1`): what the CI tests of the cluster run with, where a
/// renewal answered a few milliseconds late left less than one request of trust.
const LATE_RENEWAL_REQUEST_TIMEOUT_MS: u64 = 999;
/// When, after the join (and the first renewal it starts), the etcd → node link is
/// clogged, in virtual milliseconds: before the next renewal, sent 901 ms in (TTL −
/// slack − request timeout − `ETCD_RENEWAL_HEADROOM_MS`, sooner than TTL/3).
const LATE_RENEWAL_CLOG_AT_MS: u64 = 850;
/// When, after the join, the node places an actor, in virtual milliseconds: after the
/// renewal was sent (its answer is held back), so the last confirmed renewal leaves
/// about 900 ms, less than one request.
const LATE_RENEWAL_PLACE_AT_MS: u64 = 1_100;
/// When, after the join, the link heals in the test where the renewal lands, in virtual
/// milliseconds: the held-back answer reaches the node at the simulator's next retry
/// (by about 1.4 s), within the renewal's request timeout and the lease's validity.
const LATE_RENEWAL_HEAL_AT_MS: u64 = 1_300;
/// How much later than the lease's validity (2 s after the first renewal) a waiting
/// placement may be refused, in virtual milliseconds: the first renewal is sent a few
/// simulated network delays after the join returns.
const LEASE_END_SLACK_MS: u64 = 50;

/// A node of a 3 s lease and a 999 ms request timeout on its own machine, the etcd
/// → node link clogged [`LATE_RENEWAL_CLOG_AT_MS`] after its join; returns the
/// node's machine, the placement, the join's instant and etcd's machine.
async fn node_whose_renewal_is_held_back() -> (
    madsim::runtime::NodeHandle,
    EtcdPlacement,
    Instant,
    madsim::runtime::NodeHandle,
) {
    let handle = Handle::current();
    let etcd = start_etcd(&handle);
    let node = handle.create_node().name("node-a").ip(ip("10.0.1.1")).build();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let placement = node
        .spawn(EtcdPlacement::join(
            config("node-a").with_request_timeout_ms(LATE_RENEWAL_REQUEST_TIMEOUT_MS),
        ))
        .await
        .expect("the task")
        .expect("node-a joins");
    let joined = Instant::now();
    tokio::time::sleep_until(joined + Duration::from_millis(LATE_RENEWAL_CLOG_AT_MS)).await;
    NetSim::current().clog_link(etcd.id(), node.id());
    tokio::time::sleep_until(joined + Duration::from_millis(LATE_RENEWAL_PLACE_AT_MS)).await;
    (node, placement, joined, etcd)
}

/// Goal (simulated): a node whose lease renewal is merely late places an actor once
/// the renewal lands, instead of refusing. Method: a 3 s lease, 999 ms requests; the
/// answer to the renewal sent 901 ms after the join is held back (etcd → node clogged);
/// 1.1 s in, with about 900 ms of confirmed validity left (less than one request), the
/// node places `x`; 1.3 s in the link heals. The placement succeeds after the heal
/// (it waited for the renewal) and the node holds its lease. Before the wait it was
/// refused at once: `EtcdUnavailable` "the lease's last confirmed renewal leaves ...
/// less than one request (999 ms)".
#[madsim::test]
async fn a_placement_waits_for_a_late_renewal_and_succeeds_once_it_lands() {
    let (node, placement, joined, etcd) = node_whose_renewal_is_held_back().await;
    let x = ActorId::new("counter", "x").expect("an actor id");
    let placing = node.spawn({
        let (placement, x) = (placement.clone(), x.clone());
        async move {
            let result = placement.place(&x).await;
            (result, Instant::now())
        }
    });
    tokio::time::sleep_until(joined + Duration::from_millis(LATE_RENEWAL_HEAL_AT_MS)).await;
    NetSim::current().unclog_link(etcd.id(), node.id());
    let (placed, answered) = placing.await.expect("the task");
    let record = placed.expect("the placement waits for the late renewal and succeeds");
    assert_eq!(record.owner.as_str(), "node-a");
    let waited = answered - (joined + Duration::from_millis(LATE_RENEWAL_PLACE_AT_MS));
    eprintln!("the placement waited {} ms for the late renewal", waited.as_millis());
    assert!(
        answered >= joined + Duration::from_millis(LATE_RENEWAL_HEAL_AT_MS),
        "the placement was answered before the renewal could land"
    );
    assert!(placement.holds_lease(), "the renewed lease is held");
    let lookup = placement.lookup(&x).await.expect("a lookup").expect("x is placed");
    assert_eq!(lookup.owner.as_str(), "node-a");
}

/// Goal (simulated): a placement waiting for a renewal that never lands is refused by
/// the end of the lease's validity, not later, and the node places nothing afterwards.
/// Method: as the test above, but the link stays clogged until 5 s after the join
/// (past the lease's end on etcd). The placement is refused `LeaseExpired`
/// (`NotRenewedInTime`) no earlier than 1.9 s and no later than 2 s +
/// [`LEASE_END_SLACK_MS`] after the join; the lease counts as lost from then on; after
/// the link heals, the node's next placement is refused `LeaseExpired` without
/// reaching etcd, and another node places `x`. Before the wait it was refused at once
/// (1.1 s in) as `EtcdUnavailable`.
#[madsim::test]
async fn a_placement_waiting_for_a_renewal_that_never_lands_is_refused_by_the_leases_end() {
    let (node, placement, joined, etcd) = node_whose_renewal_is_held_back().await;
    let x = ActorId::new("counter", "x").expect("an actor id");
    let (refused, answered) = node
        .spawn({
            let (placement, x) = (placement.clone(), x.clone());
            async move {
                let result = placement.place(&x).await;
                (result, Instant::now())
            }
        })
        .await
        .expect("the task");
    let after_join = answered - joined;
    eprintln!(
        "the waiting placement was refused {} ms after the join",
        after_join.as_millis()
    );
    match refused {
        Err(PlacementError::LeaseExpired { reason, .. }) => assert_eq!(reason, LeaseLostReason::NotRenewedInTime),
        other => panic!("a placement past the lease's validity must be refused LeaseExpired: {other:?}"),
    }
    assert!(
        after_join >= Duration::from_millis(1_900),
        "refused {after_join:?} after the join, before the lease's validity ended"
    );
    assert!(
        after_join <= Duration::from_millis((SIM_LEASE_TTL_S - 1) * 1_000 + LEASE_END_SLACK_MS),
        "refused {after_join:?} after the join, later than the lease's validity"
    );
    assert!(!placement.holds_lease(), "the lease counts as lost once refused");
    assert_eq!(placement.lease_lost().await, LeaseLostReason::NotRenewedInTime);

    tokio::time::sleep_until(joined + Duration::from_millis(5_000)).await;
    NetSim::current().unclog_link(etcd.id(), node.id());
    let again = node
        .spawn({
            let (placement, x) = (placement.clone(), x.clone());
            async move { placement.place(&x).await }
        })
        .await
        .expect("the task");
    assert!(
        matches!(again, Err(PlacementError::LeaseExpired { .. })),
        "a node whose lease was lost places nothing: {again:?}"
    );
    let other = Handle::current()
        .create_node()
        .name("node-b")
        .ip(ip("10.0.1.2"))
        .build();
    let taken = other
        .spawn({
            let x = x.clone();
            async move {
                let placement = EtcdPlacement::join(config("node-b")).await.expect("node-b joins");
                place_when_free(&placement, &x).await
            }
        })
        .await
        .expect("the task");
    assert_eq!(taken.owner.as_str(), "node-b", "x is free for another node");
}

/// Placements the healthy node makes, one every [`STEADY_PLACE_EVERY_MS`].
const STEADY_PLACEMENTS: u64 = 600;
/// Pause between two placements of the healthy node, in virtual milliseconds: 600 of
/// them span 6 s, six renewals.
const STEADY_PLACE_EVERY_MS: u64 = 10;

/// Goal (simulated): a healthy node never waits for a renewal, even with the largest
/// request timeout its lease accepts (3 s lease, 999 ms: the CI tests' settings).
/// Method: no fault; the node places 600 actors, one every 10 ms over 6 s (six
/// renewals); every placement succeeds and `late_renewal_waits` stays 0. Renewing
/// every TTL/3 left exactly one request of validity when each renewal was sent, so
/// each renewal's round trip made the placements in it wait.
#[madsim::test]
async fn a_healthy_node_with_the_largest_request_timeout_never_waits_for_a_renewal() {
    let handle = Handle::current();
    let _etcd = start_etcd(&handle);
    let node = handle.create_node().name("node-a").ip(ip("10.0.1.1")).build();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let placement = node
        .spawn(async move {
            let placement =
                EtcdPlacement::join(config("node-a").with_request_timeout_ms(LATE_RENEWAL_REQUEST_TIMEOUT_MS))
                    .await
                    .expect("node-a joins");
            for index in 0..STEADY_PLACEMENTS {
                let actor = ActorId::new("counter", format!("p{index}")).expect("an actor id");
                placement.place(&actor).await.expect("a healthy node places");
                tokio::time::sleep(Duration::from_millis(STEADY_PLACE_EVERY_MS)).await;
            }
            placement
        })
        .await
        .expect("the task");
    eprintln!(
        "{} of {STEADY_PLACEMENTS} placements waited for a renewal",
        placement.late_renewal_waits()
    );
    assert_eq!(placement.late_renewal_waits(), 0, "a healthy node's placements waited");
    assert!(placement.holds_lease());
}

/// When, after the join, node and etcd are cut from each other in the failed-round
/// test, in virtual milliseconds: before the renewal sent 1 s in (3 s lease, 500 ms
/// requests: TTL/3).
const FAILED_ROUND_CUT_AT_MS: u64 = 950;
/// When, after the join, the cut heals in the failed-round test, in virtual
/// milliseconds: after that renewal's round (500 ms) failed, before the validity (2 s
/// after the first renewal) ends.
const FAILED_ROUND_HEAL_AT_MS: u64 = 1_700;
/// When, after the join, the failed-round test checks the lease, in virtual
/// milliseconds: past the validity the failed round left.
const FAILED_ROUND_CHECK_AT_MS: u64 = 2_500;

/// Goal (simulated): a renewal round that fails (no answer within the request timeout)
/// is followed by another at once, so a lease whose etcd comes back before the
/// validity ends is kept. Method: 3 s lease, 500 ms requests (renewals every 1 s,
/// validity 2 s); node and etcd cut from each other 0.95-1.7 s after the join, so the
/// round sent at 1 s fails at 1.5 s; 2.5 s in the node holds its lease and places an
/// actor. Before, the next round waited for the interval (2 s in), the end of the
/// validity: the lease was lost (`NotRenewedInTime`) 2 s in although etcd answered
/// again from 1.7 s.
#[madsim::test]
async fn a_failed_renewal_round_is_tried_again_at_once_and_the_lease_kept() {
    let handle = Handle::current();
    let etcd = start_etcd(&handle);
    let node = handle.create_node().name("node-a").ip(ip("10.0.1.1")).build();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let placement = node
        .spawn(EtcdPlacement::join(config("node-a")))
        .await
        .expect("the task")
        .expect("node-a joins");
    let joined = Instant::now();
    let net = NetSim::current();
    tokio::time::sleep_until(joined + Duration::from_millis(FAILED_ROUND_CUT_AT_MS)).await;
    net.clog_link(etcd.id(), node.id());
    net.clog_link(node.id(), etcd.id());
    tokio::time::sleep_until(joined + Duration::from_millis(FAILED_ROUND_HEAL_AT_MS)).await;
    net.unclog_link(etcd.id(), node.id());
    net.unclog_link(node.id(), etcd.id());
    tokio::time::sleep_until(joined + Duration::from_millis(FAILED_ROUND_CHECK_AT_MS)).await;
    assert!(
        placement.holds_lease(),
        "the lease was lost although etcd answered again before its validity ended"
    );
    let x = ActorId::new("counter", "x").expect("an actor id");
    let placed = node
        .spawn({
            let placement = placement.clone();
            async move { placement.place(&x).await }
        })
        .await
        .expect("the task");
    assert_eq!(placed.expect("the node places").owner.as_str(), "node-a");
}
