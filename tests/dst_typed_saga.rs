//! DST: a saga of typed calls from a turn under a crash. Each transfer is a `teller`
//! turn that debits one typed `account` and credits another from inside the turn
//! (`ActorRef::ask_keyed_from`, under keys named by the transfer); its driver asks the
//! teller again, with the same transfer, until an attempt succeeds. The node is killed at
//! a random moment while transfers run, its disk loses what it had not flushed, and it
//! restarts from the disk after a random down time.
//!
//! Faults: node kill during turns and commits, disk crash (commits acknowledged only
//! after their fsync), retried attempts. Invariant: once every transfer has succeeded,
//! each account's balance is exactly the sum of its transfers, each applied once. The
//! control runs the same saga with unkeyed calls (`ask_from`): across seeds, a crash
//! between an account's commit and the teller's reply must make a retry apply a step
//! twice, so the invariant is one a crash can break.
#![cfg(madsim)]

use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use troupe::core::{ActorId, ActorKind};
use troupe::runtime::{ActorError, IdempotencyKey, KindConfig, MemoryStore, Runtime, RuntimeHandle, Turn, TypedActor};
use troupe_sim::{SimRng, StoreMode, SyncingStore};

/// Accounts the transfers move money between.
const ACCOUNTS: u64 = 4;
/// Transfers per run, all started at once.
const TRANSFERS: u64 = 24;
/// The largest amount moved by one transfer.
const AMOUNT_MAX: u64 = 100;
/// How long a commit's fsync takes, in virtual milliseconds: the window a crash can
/// land in between a step's commit and the teller's reply.
const FSYNC_MS: u64 = 3;
/// The deadline of one attempt of a transfer, and of each of its steps, in milliseconds.
const ATTEMPT_TIMEOUT_MS: u64 = 2_000;
/// The longest pause before a driver tries a transfer again, in milliseconds.
const RETRY_PAUSE_MS_MAX: u64 = 20;
/// The crash lands this long after the transfers start, at most, in milliseconds: the
/// runs take about as long (24 transfers of two 3 ms steps over four accounts).
const CRASH_WITHIN_MS: u64 = 60;
/// The longest time the node stays down, in milliseconds.
const DOWN_MS_MAX: u64 = 50;
/// Seeds of the control, each run keyed then unkeyed.
const CONTROL_SEEDS: u64 = 16;

#[derive(Default, Serialize, Deserialize)]
struct Account {
    balance: i64,
}

impl TypedActor for Account {
    /// How much to add (a debit is negative).
    type Message = i64;
    /// The new balance.
    type Reply = i64;

    async fn handle(&mut self, _turn: &mut Turn, amount: i64) -> Result<i64, ActorError> {
        self.balance += amount;
        Ok(self.balance)
    }
}

/// One transfer: `amount` from account `from` to account `to`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Transfer {
    id: u64,
    from: u64,
    to: u64,
    amount: i64,
    /// Whether its steps go under idempotency keys (the saga) or not (the control).
    keyed: bool,
}

/// Runs transfers: stateless, one per transfer (`teller/<id>`), so they run at once.
#[derive(Default, Serialize, Deserialize)]
struct Teller;

fn key(transfer: &Transfer, step: &str) -> Result<IdempotencyKey, ActorError> {
    IdempotencyKey::new(&format!("transfer-{}/{step}", transfer.id))
        .map_err(|error| ActorError::failed(error.to_string()))
}

impl TypedActor for Teller {
    type Message = Transfer;
    type Reply = ();

    async fn handle(&mut self, turn: &mut Turn, transfer: Transfer) -> Result<(), ActorError> {
        let from = turn.actor_ref::<Account>(account(transfer.from))?;
        let to = turn.actor_ref::<Account>(account(transfer.to))?;
        let timeout = Duration::from_millis(ATTEMPT_TIMEOUT_MS);
        let caller = turn.caller();
        if transfer.keyed {
            from.ask_keyed_from(caller, &key(&transfer, "debit")?, -transfer.amount, timeout)
                .await?;
            to.ask_keyed_from(caller, &key(&transfer, "credit")?, transfer.amount, timeout)
                .await?;
        } else {
            from.ask_from(caller, -transfer.amount, timeout).await?;
            to.ask_from(caller, transfer.amount, timeout).await?;
        }
        Ok(())
    }
}

fn account(index: u64) -> ActorId {
    ActorId::new("account", format!("a{index}")).expect("an account id")
}

fn node_ip() -> IpAddr {
    "10.0.1.1".parse().expect("an IP address")
}

/// What one run of the saga showed.
#[derive(Debug)]
struct Outcome {
    /// Accounts whose balance is not the sum of their transfers: (account, expected, read).
    wrong: Vec<(u64, i64, i64)>,
    /// Attempts that failed and were tried again (the crash interrupted them).
    retried: u64,
}

/// The current runtime's handle, once the node is up.
async fn current(slot: &Mutex<Option<RuntimeHandle>>) -> RuntimeHandle {
    loop {
        if let Some(handle) = slot.lock().expect("the slot").clone() {
            return handle;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// One run: [`TRANSFERS`] random transfers, each retried until it succeeds, a crash of
/// the node while they run, then every balance read back.
async fn saga(keyed: bool) -> Outcome {
    let sim = madsim::runtime::Handle::current();
    let disk = MemoryStore::new();
    let slot: Arc<Mutex<Option<RuntimeHandle>>> = Arc::default();
    let node = {
        let (disk, slot) = (disk.clone(), Arc::clone(&slot));
        sim.create_node()
            .name("node-1")
            .ip(node_ip())
            .init(move || {
                let (disk, slot) = (disk.clone(), Arc::clone(&slot));
                async move {
                    let runtime = Runtime::builder()
                        .store(SyncingStore::new(disk, StoreMode::Fsync { latency_ms: FSYNC_MS }))
                        .register_typed::<Account>(ActorKind::new("account").expect("a kind"), KindConfig::default())
                        .expect("register the account")
                        .register_typed::<Teller>(ActorKind::new("teller").expect("a kind"), KindConfig::default())
                        .expect("register the teller")
                        .start();
                    *slot.lock().expect("the slot") = Some(runtime.handle());
                    std::future::pending::<()>().await;
                    drop(runtime);
                }
            })
            .build()
    };
    current(&slot).await;

    let mut rng = SimRng::new();
    let mut expected = vec![0_i64; ACCOUNTS as usize];
    let retried = Arc::new(Mutex::new(0_u64));
    let mut drivers = Vec::new();
    for id in 0..TRANSFERS {
        let from = rng.range(0, ACCOUNTS);
        let to = (from + rng.range(1, ACCOUNTS)) % ACCOUNTS;
        let amount = i64::try_from(rng.range(1, AMOUNT_MAX + 1)).expect("a small amount");
        expected[from as usize] -= amount;
        expected[to as usize] += amount;
        let transfer = Transfer {
            id,
            from,
            to,
            amount,
            keyed,
        };
        let pause_ms = rng.range(1, RETRY_PAUSE_MS_MAX + 1);
        let (slot, retried) = (Arc::clone(&slot), Arc::clone(&retried));
        drivers.push(tokio::spawn(async move {
            loop {
                let handle = current(&slot).await;
                let teller = handle
                    .actor_ref::<Teller>(ActorId::new("teller", format!("t{id}")).expect("an id"))
                    .expect("a teller ref");
                match teller
                    .ask(transfer.clone(), Duration::from_millis(ATTEMPT_TIMEOUT_MS))
                    .await
                {
                    Ok(()) => return,
                    Err(_) => {
                        *retried.lock().expect("the count") += 1;
                        tokio::time::sleep(Duration::from_millis(pause_ms)).await;
                    }
                }
            }
        }));
    }

    tokio::time::sleep(Duration::from_millis(rng.range(1, CRASH_WITHIN_MS + 1))).await;
    *slot.lock().expect("the slot") = None;
    sim.kill(node.id());
    disk.crash();
    tokio::time::sleep(Duration::from_millis(rng.range(1, DOWN_MS_MAX + 1))).await;
    sim.restart(node.id());
    for driver in drivers {
        driver.await.expect("a transfer's driver");
    }

    let handle = current(&slot).await;
    let mut wrong = Vec::new();
    for (index, want) in expected.iter().enumerate() {
        let account = handle
            .actor_ref::<Account>(account(index as u64))
            .expect("an account ref");
        let read = account
            .ask(0, Duration::from_millis(ATTEMPT_TIMEOUT_MS))
            .await
            .expect("a balance read after the transfers");
        if read != *want {
            wrong.push((index as u64, *want, read));
        }
    }
    let retried = *retried.lock().expect("the count");
    Outcome { wrong, retried }
}

/// Goal: a saga whose steps are keyed typed calls from a turn applies each step once
/// however the crash cuts its attempts: every balance is the sum of its transfers.
#[madsim::test]
async fn a_saga_of_keyed_typed_calls_applies_each_step_once_across_a_crash() {
    let outcome = saga(true).await;
    assert!(outcome.wrong.is_empty(), "{outcome:?}");
    eprintln!("{} attempts retried after the crash", outcome.retried);
}

/// Goal: the saga's check can fail. Across seeds the crash interrupts attempts (they are
/// retried) in most runs, the keyed saga stays exact in every one, and the unkeyed
/// control applies some step twice in at least one.
#[test]
fn across_seeds_a_crash_interrupts_the_saga_and_only_unkeyed_steps_apply_twice() {
    let (mut interrupted, mut doubled) = (0, 0);
    for seed in 1..=CONTROL_SEEDS {
        let keyed =
            madsim::runtime::Runtime::with_seed_and_config(seed, madsim::Config::default()).block_on(saga(true));
        assert!(keyed.wrong.is_empty(), "seed {seed}, keyed: {keyed:?}");
        if keyed.retried > 0 {
            interrupted += 1;
        }
        let unkeyed =
            madsim::runtime::Runtime::with_seed_and_config(seed, madsim::Config::default()).block_on(saga(false));
        if !unkeyed.wrong.is_empty() {
            doubled += 1;
        }
        eprintln!(
            "seed {seed}: keyed retried {}; unkeyed retried {}, wrong {:?}",
            keyed.retried, unkeyed.retried, unkeyed.wrong
        );
    }
    assert!(
        interrupted * 2 >= CONTROL_SEEDS,
        "the crash interrupted attempts in only {interrupted} of {CONTROL_SEEDS} seeds"
    );
    assert!(
        doubled > 0,
        "no unkeyed run applied a step twice in {CONTROL_SEEDS} seeds: the crash never landed in a step's window"
    );
}
