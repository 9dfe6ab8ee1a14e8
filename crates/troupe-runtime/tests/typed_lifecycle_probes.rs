//! The typed layer's lifecycle probed from outside on the multi-thread runtime, as an
//! embedder meets it: many callers reaching an actor whose state must be migrated,
//! hooks that panic, and hooks around idle deactivation.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use troupe_core::{ActorId, ActorKind};
use troupe_runtime::{
    ActorError, KindConfig, MemoryStore, Runtime, StateChange, StateStore, StateVersionError, StoredState, Turn,
    TurnCommit, TypedActor,
};

/// What every wait in these probes is bounded by: a probe that hangs fails.
const HANG: Duration = Duration::from_secs(10);
/// Callers that reach one actor at once.
const CALLERS: u64 = 16;

async fn within<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(HANG, future).await {
        Ok(value) => value,
        Err(_) => panic!("{what}: no answer within {HANG:?}"),
    }
}

fn start<A: TypedActor>(store: &Arc<MemoryStore>, kind: &str, config: KindConfig) -> Runtime {
    Runtime::builder()
        .store(Arc::clone(store) as Arc<dyn StateStore>)
        .register_typed::<A>(ActorKind::new(kind).unwrap(), config)
        .unwrap()
        .start()
}

/// Puts `bytes` in the store as the actor's state.
async fn store_state(store: &MemoryStore, id: &ActorId, bytes: Bytes) {
    let claimed = store.claim(id).await.unwrap();
    let commit = TurnCommit {
        state: StateChange::Set(bytes),
        writes: Vec::new(),
    };
    store.commit(id, claimed.fence, commit).await.unwrap();
}

/// How many times `Migrating::migrate` ran.
static MIGRATIONS: AtomicU64 = AtomicU64::new(0);

/// Version 1 of a counter whose version 0 was a bare `u32`.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Migrating {
    count: u64,
}

impl TypedActor for Migrating {
    type Message = ();
    type Reply = u64;
    const STATE_VERSION: u32 = 1;

    fn migrate(stored: StoredState<'_>) -> Result<Self, StateVersionError> {
        MIGRATIONS.fetch_add(1, Ordering::SeqCst);
        match stored.version() {
            0 => Ok(Self {
                count: u64::from(stored.decode::<u32>()?),
            }),
            _ => Err(stored.refuse()),
        }
    }

    async fn handle(&mut self, _turn: &mut Turn, (): ()) -> Result<u64, ActorError> {
        self.count += 1;
        Ok(self.count)
    }
}

/// Goal: many callers reaching at once an actor whose stored state needs a migration
/// see one activation: `migrate` runs once, and every caller's turn counts on from the
/// converted state (each reply once, 101 to 116).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_first_callers_of_a_migrating_actor_share_one_migration() {
    // The simulator runs seeds one after another in one process: start from zero.
    MIGRATIONS.store(0, Ordering::SeqCst);
    let store = Arc::new(MemoryStore::new());
    let id = ActorId::new("migrating", "m").unwrap();
    store_state(&store, &id, Bytes::copy_from_slice(&100u32.to_le_bytes())).await;
    let runtime = start::<Migrating>(&store, "migrating", KindConfig::default());
    let mut callers = Vec::new();
    for _ in 0..CALLERS {
        let actor = runtime.actor_ref::<Migrating>(id.clone()).unwrap();
        callers.push(tokio::spawn(async move { actor.ask((), HANG).await }));
    }
    let mut replies = Vec::new();
    for caller in callers {
        replies.push(within("a caller", caller).await.unwrap().expect("served"));
    }
    replies.sort_unstable();
    assert_eq!(replies, (101..=100 + CALLERS).collect::<Vec<_>>());
    assert_eq!(MIGRATIONS.load(Ordering::SeqCst), 1);
    within("shutdown", runtime.shutdown()).await;
}

/// A typed actor whose hooks panic when its key says so.
#[cfg(not(madsim))]
#[derive(Debug, Default, Serialize, Deserialize)]
struct Panicky {
    count: u64,
}

#[cfg(not(madsim))]
impl TypedActor for Panicky {
    type Message = ();
    type Reply = u64;

    async fn on_activate(&mut self, id: &ActorId) -> Result<(), ActorError> {
        assert!(id.key() != "activate", "on_activate panics for {id}");
        Ok(())
    }

    async fn on_deactivate(&mut self, id: &ActorId) -> Result<(), ActorError> {
        self.count += 1_000;
        assert!(id.key() != "deactivate", "on_deactivate panics for {id}");
        Ok(())
    }

    async fn handle(&mut self, _turn: &mut Turn, (): ()) -> Result<u64, ActorError> {
        self.count += 1;
        Ok(self.count)
    }
}

/// Goal: a typed `on_activate` that panics fails its callers, every time, without
/// hanging them, and the runtime goes on serving other actors; an `on_deactivate` that
/// panics at shutdown does not hang the shutdown, and commits nothing of its own: the
/// last turn's state stays stored. (Normal build only: the simulator ends the whole
/// simulation at a task's panic.)
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panicking_typed_hooks_fail_their_callers_and_nothing_else() {
    let store = Arc::new(MemoryStore::new());
    let runtime = start::<Panicky>(&store, "panicky", KindConfig::default());
    let refusing = runtime
        .actor_ref::<Panicky>(ActorId::new("panicky", "activate").unwrap())
        .unwrap();
    for attempt in 0..2 {
        let reply = within("ask the actor that cannot start", refusing.ask((), HANG)).await;
        assert!(
            matches!(reply, Err(troupe_core::InvokeError::ActorFailed { .. })),
            "attempt {attempt}: {reply:?}"
        );
    }
    let leaving = ActorId::new("panicky", "deactivate").unwrap();
    let leaving_ref = runtime.actor_ref::<Panicky>(leaving.clone()).unwrap();
    assert_eq!(within("ask", leaving_ref.ask((), HANG)).await, Ok(1));
    let fine = runtime
        .actor_ref::<Panicky>(ActorId::new("panicky", "fine").unwrap())
        .unwrap();
    assert_eq!(within("ask another", fine.ask((), HANG)).await, Ok(1));
    within("shutdown", runtime.shutdown()).await;
    let stored: Panicky = bincode::deserialize(&store.load(&leaving).await.unwrap().unwrap()).unwrap();
    assert_eq!(stored.count, 1, "the panicking on_deactivate committed nothing");
    let stored: Panicky = bincode::deserialize(
        &store
            .load(&ActorId::new("panicky", "fine").unwrap())
            .await
            .unwrap()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        stored.count, 1_001,
        "the other actor's on_deactivate committed its change"
    );
}

/// How many times `Idle`'s hooks ran: (activations, deactivations).
static IDLE_ACTIVATIONS: AtomicU64 = AtomicU64::new(0);
static IDLE_DEACTIVATIONS: AtomicU64 = AtomicU64::new(0);

#[derive(Debug, Default, Serialize, Deserialize)]
struct Idle {
    count: u64,
}

impl TypedActor for Idle {
    type Message = ();
    type Reply = u64;

    async fn on_activate(&mut self, _id: &ActorId) -> Result<(), ActorError> {
        IDLE_ACTIVATIONS.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    async fn on_deactivate(&mut self, _id: &ActorId) -> Result<(), ActorError> {
        IDLE_DEACTIVATIONS.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    async fn handle(&mut self, _turn: &mut Turn, (): ()) -> Result<u64, ActorError> {
        self.count += 1;
        Ok(self.count)
    }
}

/// Goal: an idle deactivation runs the typed `on_deactivate`, and the next message's
/// activation runs `on_activate` again, on the committed state: the hooks pair up across
/// idle timeouts, not only at shutdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_hooks_pair_up_across_idle_deactivations() {
    // The simulator runs seeds one after another in one process: start from zero.
    IDLE_ACTIVATIONS.store(0, Ordering::SeqCst);
    IDLE_DEACTIVATIONS.store(0, Ordering::SeqCst);
    const IDLE_TIMEOUT_MS: u64 = 20;
    let store = Arc::new(MemoryStore::new());
    let config = KindConfig::default().with_idle_timeout(Duration::from_millis(IDLE_TIMEOUT_MS));
    let runtime = start::<Idle>(&store, "idle", config);
    let actor = runtime.actor_ref::<Idle>(ActorId::new("idle", "i").unwrap()).unwrap();
    for round in 1..=3u64 {
        assert_eq!(within("ask", actor.ask((), HANG)).await, Ok(round));
        within("the idle deactivation", async {
            while IDLE_DEACTIVATIONS.load(Ordering::SeqCst) < round {
                tokio::time::sleep(Duration::from_millis(IDLE_TIMEOUT_MS)).await;
            }
        })
        .await;
        assert_eq!(IDLE_ACTIVATIONS.load(Ordering::SeqCst), round, "round {round}");
    }
    within("shutdown", runtime.shutdown()).await;
    assert_eq!(
        IDLE_DEACTIVATIONS.load(Ordering::SeqCst),
        3,
        "nothing active at shutdown"
    );
}
