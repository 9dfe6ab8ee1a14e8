//! Typed actors' activation hooks (`TypedActor::on_activate`, `on_deactivate`), and
//! what a rollback does to their `#[serde(skip)]` fields, as the trait documents it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use troupe_core::{ActorId, ActorKind, InvokeError};
use troupe_runtime::{ActorError, KindConfig, MemoryStore, Runtime, StateStore, Turn, TypedActor};

/// What every wait in these tests is bounded by: a test that hangs fails.
const HANG: Duration = Duration::from_secs(10);

async fn within<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(HANG, future).await {
        Ok(value) => value,
        Err(_) => panic!("{what}: no answer within {HANG:?}"),
    }
}

fn start<A: TypedActor>(store: &Arc<MemoryStore>, kind: &str) -> Runtime {
    Runtime::builder()
        .store(Arc::clone(store) as Arc<dyn StateStore>)
        .register_typed::<A>(ActorKind::new(kind).unwrap(), KindConfig::default())
        .unwrap()
        .start()
}

/// What the hooks of `Hooked` saw: (hook, actor, total), in order.
static SEEN: Mutex<Vec<(&'static str, String, u64)>> = Mutex::new(Vec::new());

fn seen() -> Vec<(&'static str, String, u64)> {
    SEEN.lock().unwrap().clone()
}

/// A counter whose hooks record what they see. A message of 0 fails its turn after
/// changing the total (rolled back); `on_deactivate` counts itself in the state.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Hooked {
    total: u64,
    deactivations: u64,
}

impl TypedActor for Hooked {
    type Message = u64;
    type Reply = u64;

    async fn on_activate(&mut self, id: &ActorId) -> Result<(), ActorError> {
        SEEN.lock().unwrap().push(("activate", id.to_string(), self.total));
        Ok(())
    }

    async fn on_deactivate(&mut self, id: &ActorId) -> Result<(), ActorError> {
        SEEN.lock().unwrap().push(("deactivate", id.to_string(), self.total));
        self.deactivations += 1;
        Ok(())
    }

    async fn handle(&mut self, _turn: &mut Turn, add: u64) -> Result<u64, ActorError> {
        if add == 0 {
            self.total += 1_000;
            return Err(ActorError::failed("0 is refused, after the total changed"));
        }
        self.total += add;
        Ok(self.total)
    }
}

/// Goal: a typed actor's `on_activate` runs once per activation, on the loaded state,
/// and not again after a failed turn's rollback; its `on_deactivate` runs once, on the
/// state of the last committed turn (not the failed turn's), and what it changes is
/// committed. Before the typed layer forwarded them, neither ran (`SEEN` stayed empty).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_hooks_run_once_each_per_activation_on_the_committed_state() {
    // The simulator runs seeds one after another in one process: start from zero.
    SEEN.lock().unwrap().clear();
    let store = Arc::new(MemoryStore::new());
    let id = ActorId::new("hooked", "h").unwrap();
    let runtime = start::<Hooked>(&store, "hooked");
    let hooked = runtime.actor_ref::<Hooked>(id.clone()).unwrap();
    assert_eq!(within("ask 2", hooked.ask(2, HANG)).await, Ok(2));
    assert!(matches!(
        within("ask 0", hooked.ask(0, HANG)).await,
        Err(InvokeError::ActorFailed { .. })
    ));
    assert_eq!(within("ask 3", hooked.ask(3, HANG)).await, Ok(5));
    assert!(matches!(
        within("ask 0 again", hooked.ask(0, HANG)).await,
        Err(InvokeError::ActorFailed { .. })
    ));
    within("shutdown", runtime.shutdown()).await;
    let name = id.to_string();
    assert_eq!(
        seen(),
        vec![("activate", name.clone(), 0), ("deactivate", name.clone(), 5)],
        "one on_activate on the loaded state, one on_deactivate on the committed one"
    );

    // The next activation: on_activate again, on the state on_deactivate committed.
    let runtime = start::<Hooked>(&store, "hooked");
    let hooked = runtime.actor_ref::<Hooked>(id.clone()).unwrap();
    assert_eq!(within("ask 1", hooked.ask(1, HANG)).await, Ok(6));
    within("shutdown", runtime.shutdown()).await;
    assert_eq!(
        seen()[2..],
        [("activate", name.clone(), 5), ("deactivate", name, 6)],
        "the second activation's hooks"
    );
    let stored: Hooked = bincode::deserialize(&store.load(&id).await.unwrap().unwrap()).unwrap();
    assert_eq!(stored.deactivations, 2, "each on_deactivate's change was committed");
}

/// A typed actor whose `on_activate` fails.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Refusing;

impl TypedActor for Refusing {
    type Message = ();
    type Reply = ();

    async fn on_activate(&mut self, id: &ActorId) -> Result<(), ActorError> {
        Err(ActorError::failed(format!("{id} will not start")))
    }

    async fn handle(&mut self, _turn: &mut Turn, (): ()) -> Result<(), ActorError> {
        Ok(())
    }
}

/// Goal: a typed actor's `on_activate` that fails ends the activation: the message
/// fails `ActorFailed` with its error, and the handler does not run. Before, the typed
/// layer had no hook, so a typed actor could not refuse to start.
#[tokio::test]
async fn a_failing_typed_on_activate_fails_the_activation() {
    let store = Arc::new(MemoryStore::new());
    let runtime = start::<Refusing>(&store, "refusing");
    let id = ActorId::new("refusing", "r").unwrap();
    let reply = within("ask", runtime.actor_ref::<Refusing>(id).unwrap().ask((), HANG)).await;
    assert!(
        matches!(&reply, Err(InvokeError::ActorFailed { cause, .. }) if cause.contains("refusing/r will not start")),
        "{reply:?}"
    );
    within("shutdown", runtime.shutdown()).await;
}

/// How many times `Skipping::on_activate` ran.
static SKIPPING_ACTIVATIONS: AtomicU64 = AtomicU64::new(0);

/// A typed actor with fields that are not state: a per-activation counter of turns, and
/// a "connection" `on_activate` opens.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Skipping {
    turns_committed: u64,
    #[serde(skip)]
    turns_seen: u64,
    #[serde(skip)]
    connection: Option<String>,
}

impl TypedActor for Skipping {
    /// `true` fails the turn.
    type Message = bool;
    /// (turns committed, turns seen by this instance, whether it has its connection).
    type Reply = (u64, u64, bool);

    async fn on_activate(&mut self, _id: &ActorId) -> Result<(), ActorError> {
        SKIPPING_ACTIVATIONS.fetch_add(1, Ordering::SeqCst);
        self.connection = Some("open".into());
        Ok(())
    }

    async fn handle(&mut self, _turn: &mut Turn, fail: bool) -> Result<(u64, u64, bool), ActorError> {
        self.turns_seen += 1;
        if fail {
            return Err(ActorError::failed("asked to fail"));
        }
        self.turns_committed += 1;
        Ok((self.turns_committed, self.turns_seen, self.connection.is_some()))
    }
}

/// Goal: what `TypedActor`'s documentation says of `#[serde(skip)]` fields holds: they
/// keep their values from one successful turn to the next, are reset to their default
/// by the rollback of a failed turn (the actor is decoded again from its committed
/// state), and `on_activate` does not run again then, so what it put in a skipped field
/// is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serde_skip_fields_reset_at_every_rollback_as_documented() {
    // The simulator runs seeds one after another in one process: start from zero.
    SKIPPING_ACTIVATIONS.store(0, Ordering::SeqCst);
    let store = Arc::new(MemoryStore::new());
    let runtime = start::<Skipping>(&store, "skipping");
    let actor = runtime
        .actor_ref::<Skipping>(ActorId::new("skipping", "s").unwrap())
        .unwrap();
    assert_eq!(within("turn 1", actor.ask(false, HANG)).await, Ok((1, 1, true)));
    assert_eq!(within("turn 2", actor.ask(false, HANG)).await, Ok((2, 2, true)));
    assert!(within("failed turn", actor.ask(true, HANG)).await.is_err());
    assert_eq!(
        within("turn after the rollback", actor.ask(false, HANG)).await,
        Ok((3, 1, false)),
        "the skipped fields are back to their defaults; the state is kept"
    );
    assert_eq!(
        SKIPPING_ACTIVATIONS.load(Ordering::SeqCst),
        1,
        "no on_activate at the rollback"
    );
    within("shutdown", runtime.shutdown()).await;
}
