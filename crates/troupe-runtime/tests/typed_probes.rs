//! Typed actors probed from outside, as an embedder meets them on day one: a state type
//! that changed since its bytes were stored, a state that cannot be encoded, a handler
//! that panics, a tell flood past the mailbox bound, a reply of a large or over-aligned
//! type, a reference of the wrong type, and references kept past the runtime.
//! (Deadlines at their edges, cached routes across deactivation and shutdown under
//! traffic are in embedder_probes.rs and cached_route.rs.)

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use troupe_core::{ActorId, ActorKind, InvokeError};
use troupe_runtime::{ActorError, ActorRefError, KindConfig, MemoryStore, Runtime, StateStore, Turn, TypedActor};

/// What every wait in these probes is bounded by: a probe that hangs fails.
const HANG: Duration = Duration::from_secs(10);

async fn within<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(HANG, future).await {
        Ok(value) => value,
        Err(_) => panic!("{what}: no answer within {HANG:?}"),
    }
}

fn id(kind: &str, key: &str) -> ActorId {
    ActorId::new(kind, key).unwrap()
}

fn start_one<A: TypedActor>(store: &Arc<MemoryStore>, kind: &str, config: KindConfig) -> Runtime {
    Runtime::builder()
        .store(Arc::clone(store) as Arc<dyn StateStore>)
        .register_typed::<A>(ActorKind::new(kind).unwrap(), config)
        .unwrap()
        .start()
}

// ---------------------------------------------------------------------------------------
// A state type that changed between versions
// ---------------------------------------------------------------------------------------

/// Version 1 of a profile: a name, then a count.
#[derive(Default, Serialize, Deserialize)]
struct ProfileV1 {
    name: String,
    visits: u64,
}

impl TypedActor for ProfileV1 {
    type Message = String;
    type Reply = u64;

    async fn handle(&mut self, _turn: &mut Turn, name: String) -> Result<u64, ActorError> {
        self.name = name;
        self.visits += 1;
        Ok(self.visits)
    }
}

/// Version 2, deployed against version 1's stored bytes: the name was dropped and a
/// second counter added. Its encoding is shorter than version 1's whenever the name
/// is longer than 8 bytes... and bincode reads version 1's name length as `visits`.
#[derive(Default, Serialize, Deserialize)]
struct ProfileV2 {
    visits: u64,
    logins: u64,
}

impl TypedActor for ProfileV2 {
    type Message = String;
    type Reply = u64;

    async fn handle(&mut self, _turn: &mut Turn, _name: String) -> Result<u64, ActorError> {
        self.visits += 1;
        self.logins += 1;
        Ok(self.visits)
    }
}

/// Goal: a state type deployed against bytes another version of it stored is refused
/// with a typed error that names the actor and says what to do, every time it is
/// asked, and the stored bytes stay as they were: the new version never reads version
/// 1's name length as its count and commits that over them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_stored_by_another_version_is_refused_and_left_untouched() {
    let store = Arc::new(MemoryStore::new());
    let profile = id("profile", "ada");
    let v1 = start_one::<ProfileV1>(&store, "profile", KindConfig::default());
    let old = v1.actor_ref::<ProfileV1>(profile.clone()).unwrap();
    assert_eq!(
        within("v1 ask", old.ask("Ada Lovelace, Countess".into(), HANG)).await,
        Ok(1)
    );
    within("v1 shutdown", v1.shutdown()).await;
    let stored = store.load(&profile).await.unwrap().expect("v1 committed its state");

    let v2 = start_one::<ProfileV2>(&store, "profile", KindConfig::default());
    let new = v2.actor_ref::<ProfileV2>(profile.clone()).unwrap();
    for attempt in 0..2 {
        match within("v2 ask", new.ask("Ada".into(), HANG)).await {
            Err(InvokeError::ActorFailed { target, cause }) => {
                assert_eq!(target, profile, "attempt {attempt}");
                assert!(cause.contains("profile/ada"), "names the actor: {cause}");
                assert!(cause.contains("ProfileV2"), "names the type: {cause}");
                assert!(cause.contains("left as stored"), "says the bytes are kept: {cause}");
            }
            other => panic!("attempt {attempt}: version 2 read version 1's bytes: {other:?}"),
        }
    }
    within("v2 shutdown", v2.shutdown()).await;
    assert_eq!(
        store.load(&profile).await.unwrap(),
        Some(stored),
        "the stored bytes are untouched"
    );
}

/// Goal: a state type that changed in a way its decoding notices (a field added at
/// the end: the stored bytes end too soon) is refused the same way, and the bytes stay.
#[tokio::test]
async fn a_state_too_short_for_the_new_type_is_refused_and_left_untouched() {
    #[derive(Default, Serialize, Deserialize)]
    struct Grown {
        name: String,
        visits: u64,
        since: u64,
    }
    impl TypedActor for Grown {
        type Message = String;
        type Reply = u64;
        async fn handle(&mut self, _turn: &mut Turn, _name: String) -> Result<u64, ActorError> {
            self.visits += 1;
            Ok(self.visits)
        }
    }
    let store = Arc::new(MemoryStore::new());
    let profile = id("profile", "bob");
    let v1 = start_one::<ProfileV1>(&store, "profile", KindConfig::default());
    within(
        "v1 ask",
        v1.actor_ref::<ProfileV1>(profile.clone())
            .unwrap()
            .ask("Bob".into(), HANG),
    )
    .await
    .unwrap();
    within("v1 shutdown", v1.shutdown()).await;
    let stored = store.load(&profile).await.unwrap();

    let v2 = start_one::<Grown>(&store, "profile", KindConfig::default());
    let reply = within(
        "grown ask",
        v2.actor_ref::<Grown>(profile.clone()).unwrap().ask("Bob".into(), HANG),
    )
    .await;
    assert!(
        matches!(&reply, Err(InvokeError::ActorFailed { cause, .. }) if cause.contains("profile/bob")),
        "{reply:?}"
    );
    within("v2 shutdown", v2.shutdown()).await;
    assert_eq!(store.load(&profile).await.unwrap(), stored);
}

// ---------------------------------------------------------------------------------------
// A state that cannot be encoded, a handler that panics
// ---------------------------------------------------------------------------------------

/// A state whose encoding fails while `poisoned` is set (a serde error at commit).
#[derive(Default, Deserialize)]
struct Fragile {
    total: u64,
    #[serde(skip)]
    poisoned: bool,
}

impl Serialize for Fragile {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if self.poisoned {
            return Err(serde::ser::Error::custom("a poisoned total"));
        }
        #[derive(Serialize)]
        struct Plain {
            total: u64,
        }
        Plain { total: self.total }.serialize(serializer)
    }
}

#[derive(Serialize, Deserialize)]
enum FragileMessage {
    Add(u64),
    AddAndPoison(u64),
    AddAndPanic(u64),
}

impl TypedActor for Fragile {
    type Message = FragileMessage;
    type Reply = u64;

    async fn handle(&mut self, _turn: &mut Turn, message: FragileMessage) -> Result<u64, ActorError> {
        match message {
            FragileMessage::Add(n) => self.total += n,
            FragileMessage::AddAndPoison(n) => {
                self.total += n;
                self.poisoned = true;
            }
            FragileMessage::AddAndPanic(n) => {
                self.total += n;
                tokio::task::yield_now().await;
                panic!("a handler bug, mid-turn");
            }
        }
        Ok(self.total)
    }
}

fn stored_total(bytes: Option<Bytes>) -> Option<u64> {
    bytes.map(|b| bincode::deserialize::<u64>(&b).unwrap())
}

/// Goal: a turn whose new state cannot be encoded fails with a typed error, commits
/// nothing, and the actor serves the next message from its last committed state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_that_cannot_be_encoded_fails_its_turn_and_keeps_the_committed_one() {
    let store = Arc::new(MemoryStore::new());
    let runtime = start_one::<Fragile>(&store, "fragile", KindConfig::default());
    let target = id("fragile", "f");
    let actor = runtime.actor_ref::<Fragile>(target.clone()).unwrap();
    assert_eq!(within("add", actor.ask(FragileMessage::Add(5), HANG)).await, Ok(5));
    let reply = within("poison", actor.ask(FragileMessage::AddAndPoison(100), HANG)).await;
    assert!(
        matches!(&reply, Err(InvokeError::ActorFailed { target: t, cause }) if t == &target && cause.contains("poisoned")),
        "{reply:?}"
    );
    assert_eq!(stored_total(store.load(&target).await.unwrap()), Some(5));
    assert_eq!(
        within("add after", actor.ask(FragileMessage::Add(1), HANG)).await,
        Ok(6)
    );
    within("shutdown", runtime.shutdown()).await;
    assert_eq!(stored_total(store.load(&target).await.unwrap()), Some(6));
}

/// Goal: a handler that panics mid-turn gives its caller a typed error (not a hang, not
/// a reply), commits nothing, and the actor serves the next message from its last
/// committed state, through the same reference (whose cached route went stale).
/// (Normal build only: the simulator ends the whole simulation at a task's panic.)
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_panics_fails_its_caller_and_the_next_message_is_served() {
    let store = Arc::new(MemoryStore::new());
    let runtime = start_one::<Fragile>(&store, "fragile", KindConfig::default());
    let target = id("fragile", "p");
    let actor = runtime.actor_ref::<Fragile>(target.clone()).unwrap();
    assert_eq!(within("add", actor.ask(FragileMessage::Add(7), HANG)).await, Ok(7));
    let reply = within("panic", actor.ask(FragileMessage::AddAndPanic(100), HANG)).await;
    assert!(
        matches!(&reply, Err(InvokeError::ActorFailed { target: t, .. }) if t == &target),
        "{reply:?}"
    );
    assert_eq!(stored_total(store.load(&target).await.unwrap()), Some(7));
    // A tell that panics: nobody waits for it. A request queued behind it when it
    // panics never started, and is served by the next activation, from the committed
    // total.
    within("panic tell", actor.tell(FragileMessage::AddAndPanic(100), HANG))
        .await
        .unwrap();
    let after = within("add after", actor.ask(FragileMessage::Add(1), HANG)).await;
    assert_eq!(after, Ok(8));
    within("shutdown", runtime.shutdown()).await;
    assert_eq!(stored_total(store.load(&target).await.unwrap()), Some(8));
}

// ---------------------------------------------------------------------------------------
// A tell flood past the mailbox bound
// ---------------------------------------------------------------------------------------

/// Counts every message it runs, in its state and in a process-wide counter.
#[derive(Default, Serialize, Deserialize)]
struct Tally {
    seen: u64,
}

static TALLY_RUNS: AtomicU64 = AtomicU64::new(0);

impl TypedActor for Tally {
    /// Microseconds to hold the turn (0 for none).
    type Message = u64;
    type Reply = u64;

    async fn handle(&mut self, _turn: &mut Turn, hold_us: u64) -> Result<u64, ActorError> {
        if hold_us > 0 {
            tokio::time::sleep(Duration::from_micros(hold_us)).await;
        }
        self.seen += 1;
        TALLY_RUNS.fetch_add(1, Ordering::Relaxed);
        Ok(self.seen)
    }
}

/// Mailbox bound of the flood probe, in messages.
const FLOOD_MAILBOX: usize = 4;
/// Tells in the flood, from each of its tasks.
const FLOOD_TELLS_PER_TASK: usize = 200;
/// Tasks telling at once.
const FLOOD_TASKS: usize = 4;

/// Goal: typed tells from several worker threads past a small mailbox bound: each is
/// accepted or refused `Busy` naming the actor (nothing else, nothing dropped
/// silently), and the accepted ones all run, each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_typed_tell_flood_past_the_bound_is_busy_or_run_once() {
    let store = Arc::new(MemoryStore::new());
    let runtime = start_one::<Tally>(
        &store,
        "tally",
        KindConfig::default().with_mailbox_capacity(FLOOD_MAILBOX),
    );
    let target = id("tally", "flood");
    let first = runtime.actor_ref::<Tally>(target.clone()).unwrap();
    let before = TALLY_RUNS.load(Ordering::Relaxed);
    assert_eq!(within("first", first.ask(0, HANG)).await, Ok(1));
    let tasks: Vec<_> = (0..FLOOD_TASKS)
        .map(|_| {
            let actor = first.clone();
            let target = target.clone();
            tokio::spawn(async move {
                let (mut accepted, mut busy) = (0u64, 0u64);
                for _ in 0..FLOOD_TELLS_PER_TASK {
                    match actor.tell(50, HANG).await {
                        Ok(()) => accepted += 1,
                        Err(InvokeError::Busy { target: t, .. }) => {
                            assert_eq!(t, target);
                            busy += 1;
                        }
                        Err(other) => panic!("a tell was neither accepted nor busy: {other:?}"),
                    }
                }
                (accepted, busy)
            })
        })
        .collect();
    let (mut accepted, mut busy) = (0, 0);
    for task in tasks {
        let (a, b) = within("flood", task).await.unwrap();
        accepted += a;
        busy += b;
    }
    assert_eq!(accepted + busy, (FLOOD_TASKS * FLOOD_TELLS_PER_TASK) as u64);
    assert!(busy > 0, "the bound was never met ({accepted} accepted)");
    // The last ask runs after every accepted tell (one mailbox, in order): retry it
    // while the mailbox is still full.
    let seen = loop {
        match within("last", first.ask(0, HANG)).await {
            Ok(seen) => break seen,
            Err(InvokeError::Busy { .. }) => tokio::time::sleep(Duration::from_millis(1)).await,
            Err(other) => panic!("{other:?}"),
        }
    };
    assert_eq!(seen, accepted + 2, "each accepted tell ran once ({busy} busy)");
    assert_eq!(TALLY_RUNS.load(Ordering::Relaxed) - before, accepted + 2);
    within("shutdown", runtime.shutdown()).await;
}

// ---------------------------------------------------------------------------------------
// Replies of unusual types, references of the wrong type, references kept too long
// ---------------------------------------------------------------------------------------

/// A reply aligned past the inline space of a value, and a large one.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize)]
#[repr(align(64))]
struct Aligned(u64);

#[derive(Default, Serialize, Deserialize)]
struct Shapes;

#[derive(Serialize, Deserialize, PartialEq, Eq, Debug)]
enum ShapeReply {
    Aligned(Aligned),
    Large(Vec<u8>),
    Array(#[serde(with = "serde_bytes_array")] Box<[u8; 4096]>),
}

mod serde_bytes_array {
    use serde::{Deserialize, Deserializer, Serializer};
    pub(crate) fn serialize<S: Serializer>(value: &[u8; 4096], serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(value)
    }
    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Box<[u8; 4096]>, D::Error> {
        let bytes = Vec::<u8>::deserialize(deserializer)?;
        bytes
            .try_into()
            .map(Box::new)
            .map_err(|_| serde::de::Error::custom("not 4096 bytes"))
    }
}

impl TypedActor for Shapes {
    type Message = u8;
    type Reply = ShapeReply;

    async fn handle(&mut self, _turn: &mut Turn, which: u8) -> Result<ShapeReply, ActorError> {
        Ok(match which {
            0 => ShapeReply::Aligned(Aligned(0xA11C)),
            1 => ShapeReply::Large(vec![7; 1 << 20]),
            _ => ShapeReply::Array(Box::new([9; 4096])),
        })
    }
}

/// An actor whose message and reply are over-aligned themselves.
#[derive(Default, Serialize, Deserialize)]
struct AlignedEcho;

impl TypedActor for AlignedEcho {
    type Message = Aligned;
    type Reply = Aligned;

    async fn handle(&mut self, _turn: &mut Turn, message: Aligned) -> Result<Aligned, ActorError> {
        assert_eq!(&message as *const Aligned as usize % 64, 0);
        Ok(Aligned(message.0 + 1))
    }
}

/// Goal: replies that do not fit a value's inline space (over-aligned, a megabyte, a
/// boxed array) and over-aligned messages arrive whole, on worker threads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_and_over_aligned_values_arrive_whole() {
    let runtime = Runtime::builder()
        .register_typed::<Shapes>(ActorKind::new("shapes").unwrap(), KindConfig::default())
        .unwrap()
        .register_typed::<AlignedEcho>(ActorKind::new("echo").unwrap(), KindConfig::default())
        .unwrap()
        .start();
    let shapes = runtime.actor_ref::<Shapes>(id("shapes", "s")).unwrap();
    assert_eq!(
        within("aligned", shapes.ask(0, HANG)).await,
        Ok(ShapeReply::Aligned(Aligned(0xA11C)))
    );
    assert_eq!(
        within("large", shapes.ask(1, HANG)).await,
        Ok(ShapeReply::Large(vec![7; 1 << 20]))
    );
    assert_eq!(
        within("array", shapes.ask(2, HANG)).await,
        Ok(ShapeReply::Array(Box::new([9; 4096])))
    );
    let echo = runtime.actor_ref::<AlignedEcho>(id("echo", "e")).unwrap();
    for n in 0..64 {
        assert_eq!(within("echo", echo.ask(Aligned(n), HANG)).await, Ok(Aligned(n + 1)));
    }
    within("shutdown", runtime.shutdown()).await;
}

/// Goal: a reference asked for under a kind registered for another type, or an
/// unregistered kind, is refused with what was registered and what was asked for.
#[tokio::test]
async fn a_reference_of_the_wrong_type_is_refused_by_name() {
    let store = Arc::new(MemoryStore::new());
    let runtime = start_one::<Tally>(&store, "tally", KindConfig::default());
    match runtime.actor_ref::<Shapes>(id("tally", "t")) {
        Err(ActorRefError::WrongType {
            kind,
            registered,
            requested,
        }) => {
            assert_eq!(kind, "tally");
            assert!(registered.ends_with("Tally"), "{registered}");
            assert!(requested.ends_with("Shapes"), "{requested}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        runtime.actor_ref::<Tally>(id("nobody", "t")).unwrap_err(),
        ActorRefError::UnknownKind { kind: "nobody".into() }
    );
    within("shutdown", runtime.shutdown()).await;
}

/// Goal: references kept after `shutdown()` (one whose cached route reached the actor,
/// clones of it on other tasks, a fresh one) answer `Shutdown` at once for every typed
/// entry point, on worker threads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn references_kept_past_shutdown_answer_shutdown() {
    let store = Arc::new(MemoryStore::new());
    let runtime = start_one::<Tally>(&store, "tally", KindConfig::default());
    let handle = runtime.handle();
    let cached = runtime.actor_ref::<Tally>(id("tally", "kept")).unwrap();
    assert_eq!(within("warm", cached.ask(0, HANG)).await, Ok(1));
    within("warm tell", cached.tell(0, HANG)).await.unwrap();
    within("shutdown", runtime.shutdown()).await;
    let fresh = handle.actor_ref::<Tally>(id("tally", "kept")).unwrap();
    let key = troupe_runtime::IdempotencyKey::new("k").unwrap();
    for actor in [cached.clone(), fresh] {
        let clone = actor.clone();
        let on_task = tokio::spawn(async move { clone.ask(0, HANG).await });
        assert_eq!(
            within("ask on a task", on_task).await.unwrap(),
            Err(InvokeError::Shutdown)
        );
        assert_eq!(within("ask", actor.ask(0, HANG)).await, Err(InvokeError::Shutdown));
        assert_eq!(within("tell", actor.tell(0, HANG)).await, Err(InvokeError::Shutdown));
        let by = actor.deadline_in(HANG);
        assert_eq!(
            within("tell_by", actor.tell_by(0, by)).await,
            Err(InvokeError::Shutdown)
        );
        assert_eq!(
            within("ask_keyed", actor.ask_keyed(&key, 0, HANG)).await,
            Err(InvokeError::Shutdown)
        );
        assert_eq!(
            within("tell_keyed", actor.tell_keyed(&key, 0, HANG)).await,
            Err(InvokeError::Shutdown)
        );
    }
    // The cached reference itself, once more (its cache may have been cleared above).
    assert_eq!(within("cached", cached.tell(0, HANG)).await, Err(InvokeError::Shutdown));
}

// ---------------------------------------------------------------------------------------
// Shutdown with typed tells in flight
// ---------------------------------------------------------------------------------------

/// Actors the in-flight probe tells, each from tasks of its own.
const IN_FLIGHT_ACTORS: usize = 8;
/// Tasks telling each actor.
const IN_FLIGHT_TASKS_PER_ACTOR: usize = 3;
/// How long each told turn holds, in microseconds.
const IN_FLIGHT_TURN_US: u64 = 200;
/// The shutdown grace of the in-flight probe: far longer than the queued turns need.
const IN_FLIGHT_GRACE: Duration = Duration::from_secs(5);
/// How long the tells run before `shutdown()` begins.
const IN_FLIGHT_BEFORE_SHUTDOWN: Duration = Duration::from_millis(20);

/// Goal: `shutdown()` while tasks on worker threads tell typed actors (some of them not
/// yet active, some deactivating when idle): each tell is accepted, refused `Busy`, or
/// refused `Shutdown`, and within the grace period every accepted tell runs and is
/// committed, once (`Runtime::shutdown`, step 2: the requests already in mailboxes
/// finish).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_typed_tell_accepted_before_shutdown_runs_once_within_the_grace() {
    let store = Arc::new(MemoryStore::new());
    let runtime = Runtime::builder()
        .store(Arc::clone(&store) as Arc<dyn StateStore>)
        .shutdown_grace(IN_FLIGHT_GRACE)
        .unwrap()
        .register_typed::<Tally>(
            ActorKind::new("tally").unwrap(),
            KindConfig::default()
                .with_mailbox_capacity(FLOOD_MAILBOX)
                .with_idle_timeout(Duration::from_millis(2)),
        )
        .unwrap()
        .start();
    let accepted: Arc<Vec<AtomicU64>> = Arc::new((0..IN_FLIGHT_ACTORS).map(|_| AtomicU64::new(0)).collect());
    let mut tasks = Vec::new();
    for actor in 0..IN_FLIGHT_ACTORS {
        let tally = runtime.actor_ref::<Tally>(id("tally", &format!("t{actor}"))).unwrap();
        for _ in 0..IN_FLIGHT_TASKS_PER_ACTOR {
            let tally = tally.clone();
            let accepted = Arc::clone(&accepted);
            tasks.push(tokio::spawn(async move {
                loop {
                    match tally.tell(IN_FLIGHT_TURN_US, HANG).await {
                        Ok(()) => {
                            accepted[actor].fetch_add(1, Ordering::Relaxed);
                        }
                        Err(InvokeError::Busy { .. }) => tokio::task::yield_now().await,
                        Err(InvokeError::Shutdown) => return,
                        Err(other) => panic!("a tell ended neither accepted, busy nor shutdown: {other:?}"),
                    }
                }
            }));
        }
    }
    tokio::time::sleep(IN_FLIGHT_BEFORE_SHUTDOWN).await;
    within("shutdown", runtime.shutdown()).await;
    for task in tasks {
        within("teller", task).await.unwrap();
    }
    let mut total = 0;
    for (actor, accepted) in accepted.iter().enumerate() {
        let accepted = accepted.load(Ordering::Relaxed);
        let key = id("tally", &format!("t{actor}"));
        let stored = store
            .load(&key)
            .await
            .unwrap()
            .map_or(0, |bytes| bincode::deserialize::<Tally>(&bytes).unwrap().seen);
        assert_eq!(stored, accepted, "{key}: committed turns against accepted tells");
        total += accepted;
    }
    assert!(total > 0, "no tell was accepted before the shutdown");
}

/// Goal: a message that arrives as bytes (the untyped `invoke`, or another node) with
/// bytes left over after it is rejected, not run as whatever its first bytes read as;
/// the exact encoding runs.
#[tokio::test]
async fn a_message_with_bytes_left_over_is_rejected_not_run() {
    let store = Arc::new(MemoryStore::new());
    let runtime = start_one::<ProfileV1>(&store, "profile", KindConfig::default());
    let target = id("profile", "bytes");
    let exact = Bytes::from(bincode::serialize("Ada").unwrap());
    let reply = within("exact", runtime.invoke_within(&target, exact.clone(), HANG)).await;
    assert_eq!(reply.map(|b| bincode::deserialize::<u64>(&b).unwrap()), Ok(1));
    let mut longer = exact.to_vec();
    longer.extend_from_slice(b"and more");
    let reply = within("longer", runtime.invoke_within(&target, Bytes::from(longer), HANG)).await;
    assert!(
        matches!(&reply, Err(InvokeError::Rejected { target: t, .. }) if t == &target),
        "{reply:?}"
    );
    let reply = within("after", runtime.invoke_within(&target, exact, HANG)).await;
    assert_eq!(reply.map(|b| bincode::deserialize::<u64>(&b).unwrap()), Ok(2));
    within("shutdown", runtime.shutdown()).await;
}

// ---------------------------------------------------------------------------------------
// Panics outside the handler, a state too large to store
// ---------------------------------------------------------------------------------------

/// An actor whose `Default` panics (an `unwrap` on day one): it has no first state.
#[cfg(not(madsim))]
#[derive(Serialize, Deserialize)]
struct NoDefault;

#[cfg(not(madsim))]
impl Default for NoDefault {
    fn default() -> Self {
        panic!("no configuration for a new NoDefault");
    }
}

#[cfg(not(madsim))]
impl TypedActor for NoDefault {
    type Message = ();
    type Reply = ();

    async fn handle(&mut self, _turn: &mut Turn, (): ()) -> Result<(), ActorError> {
        Ok(())
    }
}

/// A state whose encoding panics once `armed` (a `Serialize` with an `unwrap`), which
/// the runtime calls after the turn, outside the handler.
#[cfg(not(madsim))]
#[derive(Default, Deserialize)]
struct Bomb {
    total: u64,
    #[serde(skip)]
    armed: bool,
}

#[cfg(not(madsim))]
impl Serialize for Bomb {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        assert!(!self.armed, "a Serialize that unwraps");
        serializer.serialize_newtype_struct("Bomb", &self.total)
    }
}

#[cfg(not(madsim))]
impl TypedActor for Bomb {
    /// Whether to arm the bomb, and what to add.
    type Message = (bool, u64);
    type Reply = u64;

    async fn handle(&mut self, _turn: &mut Turn, (arm, add): (bool, u64)) -> Result<u64, ActorError> {
        self.total += add;
        self.armed = arm;
        Ok(self.total)
    }
}

/// Goal: panics in what the runtime calls outside the handler (an actor's `Default` at
/// activation, its `Serialize` after a turn) answer the caller with a typed error, not a
/// hang; the runtime serves other actors meanwhile, and an actor whose state encoding
/// panicked serves its next message from its last committed state.
/// (Normal build only: the simulator ends the whole simulation at a task's panic.)
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panics_in_default_or_serialize_fail_the_caller_and_nothing_else() {
    let store = Arc::new(MemoryStore::new());
    let runtime = Runtime::builder()
        .store(Arc::clone(&store) as Arc<dyn StateStore>)
        .register_typed::<NoDefault>(ActorKind::new("nodefault").unwrap(), KindConfig::default())
        .unwrap()
        .register_typed::<Bomb>(ActorKind::new("bomb").unwrap(), KindConfig::default())
        .unwrap()
        .register_typed::<Tally>(ActorKind::new("tally").unwrap(), KindConfig::default())
        .unwrap()
        .start();
    let broken = runtime.actor_ref::<NoDefault>(id("nodefault", "n")).unwrap();
    for attempt in 0..2 {
        let reply = within("no default", broken.ask((), HANG)).await;
        assert!(
            matches!(&reply, Err(InvokeError::ActorFailed { target, .. }) if target == broken.id()),
            "attempt {attempt}: {reply:?}"
        );
    }
    let tally = runtime.actor_ref::<Tally>(id("tally", "beside")).unwrap();
    assert_eq!(within("beside", tally.ask(0, HANG)).await, Ok(1));

    let bomb = runtime.actor_ref::<Bomb>(id("bomb", "b")).unwrap();
    assert_eq!(within("safe", bomb.ask((false, 2), HANG)).await, Ok(2));
    let reply = within("armed", bomb.ask((true, 40), HANG)).await;
    assert!(
        matches!(&reply, Err(InvokeError::ActorFailed { target, .. }) if target == bomb.id()),
        "{reply:?}"
    );
    // The next request, sent as soon as the failure is in, is served from the committed
    // total: the panic's unwinding answers the failing turn's caller before the crashed
    // task's mailbox closes, and a request that enters the mailbox meanwhile goes to the
    // next activation (before: it failed `ActorFailed` "ended before it replied", in 6 of
    // 12 runs).
    let after = within("after", bomb.ask((false, 1), HANG)).await;
    assert_eq!(after, Ok(3));
    within("shutdown", runtime.shutdown()).await;
    let stored = store.load(bomb.id()).await.unwrap().expect("committed");
    assert_eq!(bincode::deserialize::<u64>(&stored).unwrap(), 3);
}

/// A state that grows by half the largest value a store takes, a message.
#[derive(Default, Serialize, Deserialize)]
struct Hoard {
    /// A string: bincode writes it in one piece (a `Vec<u8>` goes byte by byte).
    items: String,
}

/// What a message adds to a hoard, in bytes.
const HOARD_STEP_BYTES: usize = troupe_runtime::STATE_VALUE_SIZE_MAX / 2;

impl TypedActor for Hoard {
    /// Whether to add `HOARD_STEP_BYTES` (else only reads).
    type Message = bool;
    type Reply = usize;

    async fn handle(&mut self, _turn: &mut Turn, grow: bool) -> Result<usize, ActorError> {
        if grow {
            self.items.extend(std::iter::repeat_n('x', HOARD_STEP_BYTES));
        }
        Ok(self.items.len())
    }
}

/// Goal: a turn whose new state is larger than a store accepts fails with the store's
/// typed `TooLarge` (naming the size and the limit), commits nothing, and the actor
/// serves the next message from its last committed state.
#[tokio::test]
async fn a_state_larger_than_the_store_takes_fails_its_turn_with_too_large() {
    let store = Arc::new(MemoryStore::new());
    let runtime = start_one::<Hoard>(&store, "hoard", KindConfig::default());
    let hoard = runtime.actor_ref::<Hoard>(id("hoard", "h")).unwrap();
    assert_eq!(within("grow", hoard.ask(true, HANG)).await, Ok(HOARD_STEP_BYTES));
    // Twice the step and the string's length prefix: past the limit.
    let reply = within("too large", hoard.ask(true, HANG)).await;
    match &reply {
        Err(InvokeError::StorageFailed {
            target,
            source: troupe_runtime::StoreError::TooLarge { size, limit, .. },
        }) => {
            assert_eq!(target, hoard.id());
            assert_eq!(*limit, troupe_runtime::STATE_VALUE_SIZE_MAX);
            assert!(size > limit, "{size} > {limit}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(within("read", hoard.ask(false, HANG)).await, Ok(HOARD_STEP_BYTES));
    within("shutdown", runtime.shutdown()).await;
}
