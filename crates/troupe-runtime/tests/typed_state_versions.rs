//! Typed state versions (`TypedActor::STATE_VERSION`, `TypedActor::migrate`): a state
//! type whose encoding reads another version's bytes whole but with another meaning is
//! refused instead of read; a `migrate` converts, and the converted state is committed;
//! a refused load leaves the stored bytes as they were; a state stored before versions
//! existed (no tag) loads as version 0.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use troupe_core::{ActorId, ActorKind, InvokeError};
use troupe_runtime::{
    ActorError, KindConfig, MemoryStore, Runtime, StateChange, StateStore, StateVersionError, StoredState, Turn,
    TurnCommit, TypedActor, STATE_VERSION_TAG_BYTES,
};

/// What every wait in these tests is bounded by: a test that hangs fails.
const HANG: Duration = Duration::from_secs(10);

async fn within<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(HANG, future).await {
        Ok(value) => value,
        Err(_) => panic!("{what}: no answer within {HANG:?}"),
    }
}

fn account(key: &str) -> ActorId {
    ActorId::new("account", key).unwrap()
}

fn start<A: TypedActor>(store: &Arc<MemoryStore>) -> Runtime {
    Runtime::builder()
        .store(Arc::clone(store) as Arc<dyn StateStore>)
        .register_typed::<A>(ActorKind::new("account").unwrap(), KindConfig::default())
        .unwrap()
        .start()
}

/// Asks `A` the actor `id` once, on a runtime of its own over `store`, and shuts down.
async fn ask_once<A: TypedActor>(
    store: &Arc<MemoryStore>,
    id: &ActorId,
    message: A::Message,
) -> Result<A::Reply, InvokeError> {
    let runtime = start::<A>(store);
    let reply = within("ask", runtime.actor_ref::<A>(id.clone()).unwrap().ask(message, HANG)).await;
    within("shutdown", runtime.shutdown()).await;
    reply
}

/// Version 1: a number of visits, never negative.
#[derive(Debug, Default, Serialize, Deserialize)]
struct VisitsV1 {
    visits: u64,
}

impl TypedActor for VisitsV1 {
    type Message = u64;
    type Reply = u64;
    const STATE_VERSION: u32 = 1;

    async fn handle(&mut self, _turn: &mut Turn, add: u64) -> Result<u64, ActorError> {
        self.visits += add;
        Ok(self.visits)
    }
}

/// Version 2 of the same kind: a signed balance in cents, whose encoding (an `i64`)
/// reads version 1's `u64` whole, as a balance of that many cents. No `migrate`.
#[derive(Debug, Default, Serialize, Deserialize)]
struct BalanceV2 {
    cents: i64,
}

impl TypedActor for BalanceV2 {
    type Message = i64;
    type Reply = i64;
    const STATE_VERSION: u32 = 2;

    async fn handle(&mut self, _turn: &mut Turn, add: i64) -> Result<i64, ActorError> {
        self.cents += add;
        Ok(self.cents)
    }
}

/// How many times `BalanceV2Migrating::migrate` ran.
static MIGRATIONS: AtomicU64 = AtomicU64::new(0);

/// Version 2 with a migration from version 1: a visit is worth 100 cents.
#[derive(Debug, Default, Serialize, Deserialize)]
struct BalanceV2Migrating {
    cents: i64,
}

impl TypedActor for BalanceV2Migrating {
    type Message = i64;
    type Reply = i64;
    const STATE_VERSION: u32 = 2;

    fn migrate(stored: StoredState<'_>) -> Result<Self, StateVersionError> {
        MIGRATIONS.fetch_add(1, Ordering::SeqCst);
        match stored.version() {
            1 => {
                let old: VisitsV1 = stored.decode()?;
                let cents = i64::try_from(old.visits)
                    .ok()
                    .and_then(|visits| visits.checked_mul(100))
                    .ok_or_else(|| stored.fail(format!("{} visits are too many to count in cents", old.visits)))?;
                Ok(Self { cents })
            }
            _ => Err(stored.refuse()),
        }
    }

    async fn handle(&mut self, _turn: &mut Turn, add: i64) -> Result<i64, ActorError> {
        self.cents += add;
        Ok(self.cents)
    }
}

/// The tag before a state of `version` (not 0), as the runtime writes it.
fn tagged(version: u32, encoding: &[u8]) -> Bytes {
    let mut bytes = vec![0xC7, b'T', b'R', b'P', b'S', b'V', 0xF7, 0xFF];
    bytes.extend_from_slice(&version.to_le_bytes());
    assert_eq!(bytes.len(), STATE_VERSION_TAG_BYTES);
    bytes.extend_from_slice(encoding);
    Bytes::from(bytes)
}

/// Goal: version 2 of a state type, whose encoding reads version 1's bytes whole but
/// with another meaning, is refused version 1's bytes when it has no `migrate`: the ask
/// fails `ActorFailed` naming the actor, the type, both versions and what to do, every
/// time, and the stored bytes stay version 1's. Before versions, version 2 read the 7
/// visits as 7 cents and answered `Ok(8)`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn version_2_refuses_version_1s_bytes_without_a_migrate_and_leaves_them() {
    let store = Arc::new(MemoryStore::new());
    let id = account("ada");
    assert_eq!(ask_once::<VisitsV1>(&store, &id, 7).await, Ok(7));
    let stored = store.load(&id).await.unwrap().expect("version 1 committed its state");
    assert_eq!(
        stored,
        tagged(1, &7u64.to_le_bytes()),
        "version 1's state is stored after its tag"
    );

    let v2 = start::<BalanceV2>(&store);
    let balance = v2.actor_ref::<BalanceV2>(id.clone()).unwrap();
    for attempt in 0..2 {
        match within("v2 ask", balance.ask(1, HANG)).await {
            Err(InvokeError::ActorFailed { target, cause }) => {
                assert_eq!(target, id, "attempt {attempt}");
                for needed in [
                    "account/ada",
                    "BalanceV2",
                    "version 1",
                    "version 2",
                    "TypedActor::migrate",
                    "left as stored",
                ] {
                    assert!(
                        cause.contains(needed),
                        "attempt {attempt}: the cause names {needed:?}: {cause}"
                    );
                }
            }
            other => panic!("attempt {attempt}: version 2 read version 1's bytes: {other:?}"),
        }
    }
    within("v2 shutdown", v2.shutdown()).await;
    assert_eq!(
        store.load(&id).await.unwrap(),
        Some(stored),
        "the stored bytes are untouched"
    );
}

/// Goal: with a `migrate`, version 1's state is converted (7 visits, 700 cents) and the
/// converted state is committed at version 2 by the first turn: the next activation
/// loads it as version 2, with no migration, and version 1 is refused it in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_migrate_version_1s_state_is_converted_and_committed() {
    let store = Arc::new(MemoryStore::new());
    let id = account("bob");
    assert_eq!(ask_once::<VisitsV1>(&store, &id, 7).await, Ok(7));
    let before = MIGRATIONS.load(Ordering::SeqCst);

    assert_eq!(ask_once::<BalanceV2Migrating>(&store, &id, 1).await, Ok(701));
    assert_eq!(MIGRATIONS.load(Ordering::SeqCst) - before, 1, "migrated once");
    assert_eq!(
        store.load(&id).await.unwrap(),
        Some(tagged(2, &701i64.to_le_bytes())),
        "the converted state is committed at version 2"
    );
    assert_eq!(ask_once::<BalanceV2Migrating>(&store, &id, 1).await, Ok(702));
    assert_eq!(
        MIGRATIONS.load(Ordering::SeqCst) - before,
        1,
        "a version-2 state is not migrated again"
    );

    // Rolled back to version 1 (a downgrade): refused, not read as 702 visits.
    match ask_once::<VisitsV1>(&store, &id, 1).await {
        Err(InvokeError::ActorFailed { cause, .. }) => {
            assert!(
                cause.contains("version 2 of") && cause.contains("now version 1"),
                "{cause}"
            );
        }
        other => panic!("version 1 read version 2's bytes: {other:?}"),
    }
    assert_eq!(store.load(&id).await.unwrap(), Some(tagged(2, &702i64.to_le_bytes())));
}

/// Goal: a `migrate` that fails (the value does not convert) fails the activation with
/// its reason, every time, and the stored bytes stay as they were.
#[tokio::test]
async fn a_failed_migration_leaves_the_stored_bytes_untouched() {
    let store = Arc::new(MemoryStore::new());
    let id = account("carol");
    assert_eq!(ask_once::<VisitsV1>(&store, &id, u64::MAX).await, Ok(u64::MAX));
    let stored = store.load(&id).await.unwrap();
    for attempt in 0..2 {
        match ask_once::<BalanceV2Migrating>(&store, &id, 1).await {
            Err(InvokeError::ActorFailed { cause, .. }) => {
                assert!(
                    cause.contains("too many to count in cents"),
                    "attempt {attempt}: {cause}"
                );
                assert!(
                    cause.contains("account/carol") && cause.contains("left as stored"),
                    "{cause}"
                );
            }
            other => panic!("attempt {attempt}: {other:?}"),
        }
        assert_eq!(store.load(&id).await.unwrap(), stored, "attempt {attempt}: untouched");
    }
}

/// Puts `bytes` in the store as the actor's state, as a runtime would have committed
/// them.
async fn store_state(store: &MemoryStore, id: &ActorId, bytes: &'static [u8]) {
    let claimed = store.claim(id).await.unwrap();
    let commit = TurnCommit {
        state: StateChange::Set(Bytes::from_static(bytes)),
        writes: Vec::new(),
    };
    store.commit(id, claimed.fence, commit).await.unwrap();
}

/// A state as a typed actor stored it before versions existed: `VisitsV0 { visits: 7 }`
/// in bincode, with no tag.
const STORED_BEFORE_VERSIONS: &[u8] = &[7, 0, 0, 0, 0, 0, 0, 0];

/// Version 0 (no `STATE_VERSION` said): what every typed actor was before versions.
#[derive(Debug, Default, Serialize, Deserialize)]
struct VisitsV0 {
    visits: u64,
}

impl TypedActor for VisitsV0 {
    type Message = u64;
    type Reply = u64;

    async fn handle(&mut self, _turn: &mut Turn, add: u64) -> Result<u64, ActorError> {
        self.visits += add;
        Ok(self.visits)
    }
}

/// Version 1 of `VisitsV0`, converting version 0 (the states stored before versions).
#[derive(Debug, Default, Serialize, Deserialize)]
struct VisitsCounted {
    visits: u64,
    since_upgrade: u64,
}

impl TypedActor for VisitsCounted {
    type Message = u64;
    type Reply = (u64, u64);
    const STATE_VERSION: u32 = 1;

    fn migrate(stored: StoredState<'_>) -> Result<Self, StateVersionError> {
        if stored.version() != 0 {
            return Err(stored.refuse());
        }
        let old: VisitsV0 = stored.decode()?;
        Ok(Self {
            visits: old.visits,
            since_upgrade: 0,
        })
    }

    async fn handle(&mut self, _turn: &mut Turn, add: u64) -> Result<(u64, u64), ActorError> {
        self.visits += add;
        self.since_upgrade += add;
        Ok((self.visits, self.since_upgrade))
    }
}

/// Goal: an upgrade loses nothing: bytes stored before versions existed (no tag) load
/// as version 0, as they are for a version-0 type (and a version-0 type still stores
/// them without a tag), and through `migrate` from version 0 for a versioned one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_stored_before_versions_loads_as_version_0() {
    let store = Arc::new(MemoryStore::new());
    let (plain, upgraded) = (account("dan"), account("eve"));
    store_state(&store, &plain, STORED_BEFORE_VERSIONS).await;
    store_state(&store, &upgraded, STORED_BEFORE_VERSIONS).await;

    assert_eq!(ask_once::<VisitsV0>(&store, &plain, 1).await, Ok(8));
    assert_eq!(
        store.load(&plain).await.unwrap(),
        Some(Bytes::from_static(&[8, 0, 0, 0, 0, 0, 0, 0])),
        "a version-0 state is stored as before: no tag"
    );

    assert_eq!(ask_once::<VisitsCounted>(&store, &upgraded, 1).await, Ok((8, 1)));
    let mut encoding = 8u64.to_le_bytes().to_vec();
    encoding.extend_from_slice(&1u64.to_le_bytes());
    assert_eq!(store.load(&upgraded).await.unwrap(), Some(tagged(1, &encoding)));
}

/// Goal: a version-0 type is refused a state stored by a later version (it does not read
/// the tag as part of its encoding), and a version-0 tag is no tag: bytes that begin
/// with the tag's 8 fixed bytes and a version of 0 are a version-0 state, read whole.
#[tokio::test]
async fn a_version_0_type_is_refused_a_tagged_state_and_reads_an_untagged_one_whole() {
    let store = Arc::new(MemoryStore::new());
    let id = account("fay");
    assert_eq!(ask_once::<VisitsV1>(&store, &id, 3).await, Ok(3));
    match ask_once::<VisitsV0>(&store, &id, 1).await {
        Err(InvokeError::ActorFailed { cause, .. }) => {
            assert!(
                cause.contains("version 1 of") && cause.contains("now version 0"),
                "{cause}"
            );
        }
        other => panic!("version 0 read version 1's tagged bytes: {other:?}"),
    }

    /// A version-0 state whose encoding begins as a tag would, with version 0.
    #[derive(Debug, Default, Serialize, Deserialize)]
    struct Raw {
        head: [u8; 12],
    }
    impl TypedActor for Raw {
        type Message = ();
        type Reply = [u8; 12];
        async fn handle(&mut self, _turn: &mut Turn, (): ()) -> Result<[u8; 12], ActorError> {
            Ok(self.head)
        }
    }
    const LOOKS_TAGGED: &[u8] = &[0xC7, b'T', b'R', b'P', b'S', b'V', 0xF7, 0xFF, 0, 0, 0, 0];
    let raw = account("raw");
    store_state(&store, &raw, LOOKS_TAGGED).await;
    let mut head = [0; 12];
    head.copy_from_slice(LOOKS_TAGGED);
    assert_eq!(ask_once::<Raw>(&store, &raw, ()).await, Ok(head));
}

/// Goal: an embedder can test a migration without a runtime or a store: the stored
/// state the runtime hands `migrate` can be made (`StoredState::of`), and the default's
/// refusal compared as a value.
#[test]
fn a_migration_is_testable_without_a_runtime() {
    let id = account("unit");
    let migrated = VisitsCounted::migrate(StoredState::of::<VisitsCounted>(&id, 0, STORED_BEFORE_VERSIONS))
        .expect("version 0 converts");
    assert_eq!((migrated.visits, migrated.since_upgrade), (7, 0));
    let refused = BalanceV2::migrate(StoredState::of::<BalanceV2>(&id, 1, STORED_BEFORE_VERSIONS)).unwrap_err();
    assert_eq!(
        refused,
        StateVersionError::NotMigrated {
            actor: id.clone(),
            state: std::any::type_name::<BalanceV2>(),
            stored: 1,
            expected: 2,
        }
    );
    let unreadable = VisitsCounted::migrate(StoredState::of::<VisitsCounted>(&id, 0, &[1, 2, 3])).unwrap_err();
    assert!(
        matches!(
            &unreadable,
            StateVersionError::Unconvertible {
                stored: 0,
                expected: 1,
                ..
            }
        ),
        "{unreadable}"
    );
}
