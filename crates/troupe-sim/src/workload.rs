//! Randomized workloads and the standard two-phase scenario.
//!
//! [`random_op`] draws one request from the seed: adds, gets, atomic batches (some that
//! fail half-way), calls and chains of calls between probes (some that cycle or go too
//! deep), slow turns, failing and rejecting turns, calls to unknown kinds. [`run_standard`]
//! drives such requests concurrently while injecting the allowed faults, then heals
//! everything and requires all pending work to finish and every acknowledged effect to
//! be readable.

use std::time::Duration;

use crate::faults::Fault;
use crate::harness::Sim;
use crate::probe::ProbeOp;
use crate::rng::SimRng;

/// Which faults the standard scenario may inject.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultMix {
    /// Kill nodes (memory lost) and restart them later.
    pub kills: bool,
    /// Kill nodes and crash their disks (unflushed commits lost).
    pub disk_crashes: bool,
    /// Fail commits, loads and reads.
    pub storage: bool,
    /// Partitions (symmetric, one-way, isolation), latency and packet loss; healed
    /// again at random.
    pub network: bool,
}

impl FaultMix {
    /// Every fault.
    pub fn all() -> Self {
        Self {
            kills: true,
            disk_crashes: true,
            storage: true,
            network: true,
        }
    }
}

/// The shape of a standard run.
#[derive(Debug, Clone, Copy)]
pub struct Standard {
    /// The probes' keys are `p0`..`p{actors}`.
    pub actors: usize,
    /// Virtual time the safety phase lasts.
    pub safety: Duration,
    /// Mean gap between requests, in virtual microseconds.
    pub mean_gap_us: u64,
    /// Percent chance of a fault per request.
    pub fault_percent: u64,
    /// The faults allowed.
    pub faults: FaultMix,
}

impl Default for Standard {
    fn default() -> Self {
        Self {
            actors: 4,
            safety: Duration::from_millis(300),
            mean_gap_us: 2_000,
            fault_percent: 4,
            faults: FaultMix::default(),
        }
    }
}

/// The probe keys of a run with `actors` actors.
pub fn keys(actors: usize) -> Vec<String> {
    (0..actors).map(|index| format!("p{index}")).collect()
}

fn target(key: &str) -> String {
    format!("probe/{key}")
}

/// One random request: (receiver, operation, timeout).
pub fn random_op(rng: &mut SimRng, keys: &[String]) -> (String, ProbeOp, Duration) {
    let key = rng.pick(keys).clone();
    let other = rng.pick(keys).clone();
    let timeout = Duration::from_millis(rng.range(20, 200));
    let roll = rng.range(0, 100);
    let op = match roll {
        0..=29 => ProbeOp::Add {
            amount: rng.range(1, 6),
        },
        30..=39 => ProbeOp::Get,
        40..=49 => {
            let keys = rng.range(1, 5) as u32;
            let fail_after = if rng.chance(25) {
                Some(rng.range(0, u64::from(keys)) as u32)
            } else {
                None
            };
            ProbeOp::Batch { keys, fail_after }
        }
        50..=64 => ProbeOp::Call {
            target: target(&other),
            op: Box::new(if rng.chance(70) {
                ProbeOp::Add {
                    amount: rng.range(1, 4),
                }
            } else {
                ProbeOp::Get
            }),
            timeout_ms: rng.range(5, 150),
            delay_ms: rng.range(0, 3),
        },
        65..=74 => {
            // A chain through random probes: may repeat one (a cycle) or go deep.
            let hops: Vec<String> = (0..rng.range(2, 8)).map(|_| rng.pick(keys).clone()).collect();
            let hops: Vec<&str> = hops.iter().map(String::as_str).collect();
            ProbeOp::chain(&hops, ProbeOp::Add { amount: 1 }, rng.range(10, 150))
        }
        75..=82 => ProbeOp::Sleep {
            ms: rng.range(1, 60),
            then: Box::new(ProbeOp::Add {
                amount: rng.range(1, 4),
            }),
        },
        83..=87 => ProbeOp::Fail,
        88..=91 => ProbeOp::Reject,
        92..=94 => ProbeOp::Call {
            target: "ghost/nobody".to_string(),
            op: Box::new(ProbeOp::Get),
            timeout_ms: 50,
            delay_ms: 0,
        },
        _ => ProbeOp::Call {
            // Crossing calls between independent requests: the wait-for graph's case.
            target: target(&other),
            op: Box::new(ProbeOp::Call {
                target: target(&key),
                op: Box::new(ProbeOp::Get),
                timeout_ms: 100,
                delay_ms: 0,
            }),
            timeout_ms: 150,
            delay_ms: rng.range(0, 2),
        },
    };
    (key, op, timeout)
}

/// Picks a fault allowed by `mix` against the current state of the deployment.
async fn random_fault(sim: &mut Sim, mix: FaultMix) {
    let nodes = sim.cluster().len();
    let node = sim.rng().range(1, u64::from(nodes) + 1) as u32;
    let mut choices = Vec::new();
    if !sim.cluster().is_alive(node) {
        choices.push(Fault::RestartNode(node));
    } else {
        if mix.kills {
            choices.push(Fault::KillNode(node));
        }
        if mix.disk_crashes {
            choices.push(Fault::CrashNode(node));
        }
        if mix.storage {
            let count = sim.rng().range(1, 4);
            choices.push(Fault::FailCommits { node, count });
            choices.push(Fault::FailLoads { node, count });
            choices.push(Fault::FailReads { node, count });
        }
    }
    if mix.network {
        // Node 0 is the client node.
        let a = sim.rng().range(0, u64::from(nodes) + 1) as u32;
        let b = (a + 1 + sim.rng().range(0, u64::from(nodes)) as u32) % (nodes + 1);
        let max_ms = sim.rng().range(5, 60);
        let percent = sim.rng().range(5, 40) as u8;
        choices.push(Fault::Partition(a, b));
        choices.push(Fault::OneWay { from: a, to: b });
        choices.push(Fault::Isolate(node));
        choices.push(Fault::Latency { min_ms: 1, max_ms });
        choices.push(Fault::PacketLoss { percent });
    }
    if choices.is_empty() {
        return;
    }
    if mix.network && sim.rng().chance(30) {
        sim.heal_network_now();
        return;
    }
    let fault = *sim.rng().pick(&choices);
    sim.inject(fault).await;
}

/// Runs the standard scenario on `sim`: a safety phase of random requests and faults,
/// then a liveness phase with every fault healed in which all pending requests must
/// resolve, every probe must read back at least what was acknowledged, and every
/// probe's batches must be whole.
pub async fn run_standard(sim: &mut Sim, shape: Standard) {
    let keys = keys(shape.actors);
    sim.phase("safety");
    let started = tokio::time::Instant::now();
    while started.elapsed() < shape.safety {
        let (key, op, timeout) = random_op(&mut sim.rng(), &keys);
        sim.spawn_request(&key, op, timeout);
        if sim.rng().chance(shape.fault_percent) {
            random_fault(sim, shape.faults).await;
        }
        let gap = sim.rng().range(0, 2 * shape.mean_gap_us);
        sim.advance(Duration::from_micros(gap)).await;
    }
    sim.phase("liveness");
    sim.heal().await;
    sim.drain().await;
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    sim.read_back(&keys).await;
    sim.audit(&keys).await;
}

/// `count` probe keys owned by `node` of `nodes` (searched in order `k0`, `k1`, ...).
pub fn keys_on(node: u32, nodes: u32, count: usize) -> Vec<String> {
    (0..)
        .map(|index| format!("k{index}"))
        .filter(|key| crate::probe::owner_of(key, nodes) == node)
        .take(count)
        .collect()
}
