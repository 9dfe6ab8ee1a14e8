//! Where the organisation lives: one state blob in the store, under the system key
//! space `troupe-org/org` (an actor id of a kind no runtime registers, so no actor ever
//! activates there), and a cache in memory that admission reads.
//!
//! ```text
//! change(f):  writer lock ─► claim(org) → fence, stored state ─► f(state)
//!             ─► commit(fence, new state) ─► cache = new state ─► version watchers woken
//!             (Fenced: another process changed it meanwhile → pause, claim again:
//!              `shared_record.rs`)
//! current():  the cache while it is younger than ORG_CACHE_MAX_AGE_MS, else
//!             writer lock (waited for ORG_READ_LOCK_WAIT_MS at most while a cache
//!             younger than ORG_CACHE_STALE_MAX_MS is there to decide on) ─► a load
//!             from the store (the first time, and after that age)
//! ```
//!
//! Guarantees:
//! - Once a change has returned, every later admission in this process reads it (the
//!   cache is replaced before `change` returns). A change whose future is dropped
//!   mid-way empties the cache, so the next read loads what the store holds.
//! - Another process sharing the store (two processes on one SQLite file or one
//!   PostgreSQL database) sees a change at most [`ORG_CACHE_MAX_AGE_MS`] after it was
//!   committed, while its store answers and no change of this process holds the
//!   writers' lock past [`ORG_READ_LOCK_WAIT_MS`]: a read of an older cache loads the
//!   organisation again, and a call waiting for an approval looks again at that age, so
//!   an approval resolved in the other process reaches it too.
//!   [`crate::AgentClient::reload_org`] reads it at once.
//! - A read of an older cache waits for the writers' lock at most
//!   [`ORG_READ_LOCK_WAIT_MS`] while the cache is younger than [`ORG_CACHE_STALE_MAX_MS`]
//!   (logged), then decides on it: a change waiting out a store that fails for a moment
//!   (it holds the lock up to `AGENT_API_STORE_WAIT_MS`, `store_wait.rs`) does not hold
//!   up admission. That cache is the newest this process knows of: a change replaces
//!   it before it releases the lock, or empties it if it failed (and with no cache the
//!   read waits for the lock as long as it takes).
//! - A load that fails keeps the cache (logged) while it is younger than
//!   [`ORG_CACHE_STALE_MAX_MS`], and the next read tries again; an older cache (or none)
//!   makes admission refuse with `Unavailable`: no contact is decided on an organisation
//!   that old.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use bytes::Bytes;
use troupe_core::{ActorId, Deadline};
use troupe_runtime::{Clock, RuntimeHandle, StateStore};

use crate::org::{ApprovalState, ContactKind, NotPermitted, NotPermittedReason, OrgError, Organisation, Permitted};
use crate::store_wait::WaitingStore;
use crate::AgentEvent;

/// The kind of the organisation's system key space.
pub const ORG_STORE_KIND: &str = "troupe-org";
/// The key of the organisation's system key space.
pub const ORG_STORE_KEY: &str = "org";
/// How many times one change of a shared record (the organisation; also the stored
/// agent directory, `shared_record.rs`) claims it and commits: another process (another
/// node of a cluster) that claimed it between this claim and commit fences the commit,
/// and the change claims again.
pub const ORG_WRITE_ATTEMPTS_MAX: u32 = 6;
/// The pause before a fenced change claims again, in milliseconds, times the attempts
/// made: two writers that keep claiming in lockstep would fence each other's every
/// commit, the pause lets the other's commit land first.
pub const ORG_WRITE_RETRY_PAUSE_MS: u64 = 5;
/// How long a process decides on the organisation it read before it reads the store
/// again, in milliseconds: the most another process's change can take to reach its
/// admission (while the store answers). One store read per this period at most, and
/// only when something is admitted.
pub const ORG_CACHE_MAX_AGE_MS: u64 = 1_000;
/// How old a cached organisation may become while the store fails to give a newer one,
/// in milliseconds; past it, admission refuses (`Unavailable`) until a load succeeds.
pub const ORG_CACHE_STALE_MAX_MS: u64 = 30_000;
/// How long a read of a cache older than [`ORG_CACHE_MAX_AGE_MS`] waits for the writers'
/// lock before it decides on that cache (when it is younger than
/// [`ORG_CACHE_STALE_MAX_MS`]; with none it waits as long as the lock is held), in
/// milliseconds. The lock is normally held for one store round trip (a load) or two (a
/// change's claim and commit): well under 10 ms on PostgreSQL or SQLite, and a change
/// fenced by another process pauses [`ORG_WRITE_RETRY_PAUSE_MS`] times its attempts (5,
/// then 10 ms, ...) before it claims again. 100 ms covers these several times over, and
/// a change that meets one `Unavailable` and succeeds after the first pause (10 ms); a
/// lock held longer is held by a change waiting out a store that fails (up to
/// `AGENT_API_STORE_WAIT_MS`, 10 s, or an admission's approval write up to
/// [`ORG_APPROVAL_STORE_WAIT_MS`]), whose read would fail too: admission, every turn's
/// prompt and every `call_agent`, would wait for it and then decide on the same cache.
pub const ORG_READ_LOCK_WAIT_MS: u64 = 100;

/// How long admission's write of an approval (its request, its listing for a person)
/// tries the organisation's store again while it is unavailable
/// (`StoreError::Unavailable`), in milliseconds from the write at most: the contact's
/// deadline ends the tries if it comes sooner. Before 2026-12-07 (third session) one
/// `Unavailable` refused the contact at once (`NotPermitted`, reason `Unavailable`),
/// though it had time left. The same 10 s as `AGENT_API_STORE_WAIT_MS` (it rides out a
/// PostgreSQL restart, 1–5 s), and no more though a delegation's deadline may be 300 s
/// away: the write holds the organisation's writers' lock (other changes wait for it),
/// and a send's write is made in its sender's turn.
pub(crate) const ORG_APPROVAL_STORE_WAIT_MS: u64 = crate::AGENT_API_STORE_WAIT_MS;
/// How long withdrawing an approval recorded for a send that was then not queued tries
/// the organisation's store again while it is unavailable, in milliseconds. Best
/// effort, in the sender's turn (which waits for it): long enough for a store that
/// fails for a moment, short of a PostgreSQL restart; an approval not withdrawn stays
/// unlisted until its deadline (no person sees it, nothing waits for it).
pub(crate) const ORG_WITHDRAW_STORE_WAIT_MS: u64 = 2_000;

const _: () = assert!(ORG_READ_LOCK_WAIT_MS < ORG_CACHE_MAX_AGE_MS);
const _: () = assert!(ORG_READ_LOCK_WAIT_MS >= 4 * troupe_runtime::STORE_RETRY_PAUSE_MS_FIRST);
const _: () = assert!(ORG_WITHDRAW_STORE_WAIT_MS >= 4 * troupe_runtime::STORE_RETRY_PAUSE_MS_MAX);
const _: () = assert!(ORG_WITHDRAW_STORE_WAIT_MS <= ORG_APPROVAL_STORE_WAIT_MS);

/// The organisation's actor id in the store.
pub(crate) fn org_store_id() -> ActorId {
    ActorId::new(ORG_STORE_KIND, ORG_STORE_KEY).expect("the organisation's id is valid")
}

fn decode_error(cause: String) -> OrgError {
    OrgError::Decode { cause }
}

fn decode(bytes: Option<&Bytes>) -> Result<Organisation, OrgError> {
    crate::shared_record::decode(bytes, decode_error)
}

/// The organisation as this process last read or wrote it, and when (the runtime's
/// clock).
struct Cached {
    org: Arc<Organisation>,
    read_at: Deadline,
}

impl Cached {
    /// Its age at `now`, in milliseconds.
    fn age_ms(&self, now: Deadline) -> u64 {
        now.as_micros().saturating_sub(self.read_at.as_micros()) / 1_000
    }
}

/// The cache and the writers' lock (one per system).
pub(crate) struct OrgStore {
    cache: RwLock<Option<Cached>>,
    writer: tokio::sync::Mutex<()>,
    /// Woken at every change, for waiters on approvals. A `Notify`, not a `watch`
    /// channel: a `watch` receiver waits on one of eight `Notify`s picked by tokio's
    /// thread-local random generator, which under the simulator carries over from one
    /// run to the next in a process, so two runs of one seed woke the waiters in a
    /// different order (the determinism check's divergence at an approval, 2026-11-28).
    /// A `Notify` wakes its waiters in the order they registered.
    changed: tokio::sync::Notify,
}

impl OrgStore {
    pub(crate) fn new() -> Self {
        Self {
            cache: RwLock::new(None),
            writer: tokio::sync::Mutex::new(()),
            changed: tokio::sync::Notify::new(),
        }
    }

    /// The cached organisation, if it was loaded (however old).
    pub(crate) fn cached(&self) -> Option<Arc<Organisation>> {
        self.cache
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map(|cached| Arc::clone(&cached.org))
    }

    /// The cached organisation if it is younger than [`ORG_CACHE_MAX_AGE_MS`] at `now`.
    fn fresh(&self, now: Deadline) -> Option<Arc<Organisation>> {
        self.cache
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .filter(|cached| cached.age_ms(now) < ORG_CACHE_MAX_AGE_MS)
            .map(|cached| Arc::clone(&cached.org))
    }

    /// Whether the cache is younger than [`ORG_CACHE_MAX_AGE_MS`] at `now` ([`Self::fresh`]
    /// without taking the organisation).
    fn is_fresh(&self, now: Deadline) -> bool {
        self.cache
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .is_some_and(|cached| cached.age_ms(now) < ORG_CACHE_MAX_AGE_MS)
    }

    /// How long until the cache is older than [`ORG_CACHE_MAX_AGE_MS`] (zero if it is, or
    /// if there is none).
    fn fresh_for(&self, now: Deadline) -> Duration {
        let age_ms = self
            .cache
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map_or(ORG_CACHE_MAX_AGE_MS, |cached| cached.age_ms(now));
        Duration::from_millis(ORG_CACHE_MAX_AGE_MS.saturating_sub(age_ms))
    }

    fn publish(&self, org: Organisation, read_at: Deadline) -> Arc<Organisation> {
        let org = Arc::new(org);
        *self.cache.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Cached {
            org: Arc::clone(&org),
            read_at,
        });
        self.changed.notify_waiters();
        org
    }

    /// The cached organisation and its age if it is younger than
    /// [`ORG_CACHE_STALE_MAX_MS`] at `now`: what a read may decide on when the store
    /// cannot give a newer one.
    fn kept(&self, now: Deadline) -> Option<(Arc<Organisation>, u64)> {
        self.cache
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .filter(|cached| cached.age_ms(now) < ORG_CACHE_STALE_MAX_MS)
            .map(|cached| (Arc::clone(&cached.org), cached.age_ms(now)))
    }

    /// The organisation: the cache while it is younger than [`ORG_CACHE_MAX_AGE_MS`],
    /// else the store (the first time, and to see other processes' changes). A failed
    /// load keeps a cache younger than [`ORG_CACHE_STALE_MAX_MS`], and so does a writers'
    /// lock held past [`ORG_READ_LOCK_WAIT_MS`] (a change waiting out the store).
    ///
    /// # Errors
    /// The store's error, or [`OrgError::Decode`], when there is no cache young enough
    /// to keep.
    pub(crate) async fn current(&self, store: &dyn StateStore, clock: &Clock) -> Result<Arc<Organisation>, OrgError> {
        if let Some(org) = self.fresh(clock.now()) {
            return Ok(org);
        }
        // Under the writers' lock: a load never overwrites a newer change, and callers
        // that find the cache old at once load it once. A lock held longer than a store
        // round trip or two is a change being tried again: the cache it would replace
        // is decided on meanwhile (the newest this process knows of: see the module doc).
        let lock_wait = Duration::from_millis(ORG_READ_LOCK_WAIT_MS);
        let _writer = match tokio::time::timeout(lock_wait, self.writer.lock()).await {
            Ok(writer) => writer,
            Err(_elapsed) => {
                if let Some((org, age_ms)) = self.kept(clock.now()) {
                    tracing::warn!(
                        age_ms,
                        waited_ms = ORG_READ_LOCK_WAIT_MS,
                        "the organisation is being changed and the change has not landed yet (its store may be failing); deciding on the one read before"
                    );
                    return Ok(org);
                }
                // No cache young enough to decide on: wait for the change, as before.
                self.writer.lock().await
            }
        };
        let now = clock.now();
        if let Some(org) = self.fresh(now) {
            return Ok(org);
        }
        match self.load(store, now).await {
            Ok(org) => Ok(org),
            Err(error) => match self.kept(now) {
                Some((org, age_ms)) => {
                    tracing::warn!(%error, age_ms, "the organisation could not be read again; deciding on the one read before");
                    Ok(org)
                }
                None => Err(error),
            },
        }
    }

    /// Reads the organisation from the store at `now` (the caller holds the writers'
    /// lock).
    async fn load(&self, store: &dyn StateStore, now: Deadline) -> Result<Arc<Organisation>, OrgError> {
        let bytes = store.load(&org_store_id()).await?;
        let org = decode(bytes.as_ref())?;
        {
            // Every change bumps the version, and changes are fenced one after the other:
            // the same version is the same organisation. Kept, only younger: the prompt
            // built on it stays, and nobody waiting is woken for nothing.
            let mut cache = self.cache.write().unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(cached) = cache.as_mut().filter(|cached| cached.org.version() == org.version()) {
                cached.read_at = now;
                return Ok(Arc::clone(&cached.org));
            }
        }
        Ok(self.publish(org, now))
    }

    /// Reads the organisation from the store again (changes made by another process).
    ///
    /// # Errors
    /// The store's error, or [`OrgError::Decode`].
    pub(crate) async fn reload(&self, store: &dyn StateStore, clock: &Clock) -> Result<Arc<Organisation>, OrgError> {
        let _writer = self.writer.lock().await;
        self.load(store, clock.now()).await
    }

    /// Applies `change` to the stored organisation and commits it; the cache holds the
    /// result before this returns. `change` may run more than once (after a fenced
    /// commit), always on the newest stored state; an error from it changes nothing.
    ///
    /// # Errors
    /// `change`'s error, the store's error, [`OrgError::Decode`].
    pub(crate) async fn change<T>(
        &self,
        store: &dyn StateStore,
        clock: &Clock,
        change: impl FnMut(&mut Organisation) -> Result<T, OrgError>,
    ) -> Result<T, OrgError> {
        let _writer = self.writer.lock().await;
        let read_at = clock.now();
        // A commit that failed or was dropped may have landed: the cache is emptied, and
        // the next reader loads what the store holds.
        let clear = || *self.cache.write().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
        let (org, output) = crate::shared_record::change(store, &org_store_id(), decode_error, clear, change).await?;
        self.publish(org, read_at);
        Ok(output)
    }

    /// Waits until approval `id` is resolved or `deadline` passes; `None` at the
    /// deadline (or if the record is gone). A resolution made in this process wakes it at
    /// once; one made by another process is seen when the cache is read again, at most
    /// [`ORG_CACHE_MAX_AGE_MS`] later.
    pub(crate) async fn wait_resolved(
        &self,
        id: u64,
        store: &dyn StateStore,
        clock: &Clock,
        deadline: Deadline,
    ) -> Option<ApprovalState> {
        let wait = async {
            loop {
                // Registered before the cache is read: a change published after the read
                // wakes it (`notify_waiters` reaches every `Notified` created before it).
                let changed = self.changed.notified();
                let state = self
                    .cached()
                    .and_then(|org| org.approval(id).map(|approval| approval.state));
                match state {
                    Some(ApprovalState::Pending) => {}
                    // Not in the cache (emptied by a dropped change): wait for the next.
                    None if self.cached().is_none() => {}
                    other => return other,
                }
                let fresh_for = self.fresh_for(clock.now());
                tokio::select! {
                    biased;
                    () = changed => {}
                    () = tokio::time::sleep(fresh_for.max(Duration::from_millis(1))) => {
                        // The cache is old: read the store (another process may have
                        // resolved it). A read that failed (the old copy kept, or none)
                        // is tried again one age later, not at once.
                        let read = self.current(store, clock).await;
                        if let Err(error) = &read {
                            tracing::warn!(%error, approval = id, "the organisation could not be read while waiting for an approval");
                        }
                        if read.is_err() || self.fresh(clock.now()).is_none() {
                            tokio::time::sleep(Duration::from_millis(ORG_CACHE_MAX_AGE_MS)).await;
                        }
                    }
                }
            }
        };
        clock.run_until(deadline, wait).await.ok().flatten()
    }
}

/// What admission needs to decide one contact.
pub(crate) struct Contact<'a> {
    pub(crate) from: &'a ActorId,
    pub(crate) to: &'a ActorId,
    pub(crate) kind: ContactKind,
    pub(crate) message: &'a str,
    /// Approval is waited for until then.
    pub(crate) deadline: Deadline,
}

/// When the approval a contact needs is listed for a person ([`crate::Approval::listed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Listing {
    /// At once: the caller waits for the approval where it is (a call in its turn).
    Now,
    /// Once the contact's delivery waits for it ([`await_approval_outside_turn`]), which
    /// starts after the turn that queued the contact committed (a delegation, a
    /// notification, a mention). An approval whose turn is cut or rolled back before
    /// that is never listed.
    OnDelivery,
}

/// The organisation's first decision on one contact, made without waiting. `D` is what
/// a caller that may make the contact another way gets when it does
/// ([`decide_contact`]'s `defer`); [`Never`] for a caller that never does.
pub(crate) enum FirstDecision<D = Never> {
    /// Decided now (and reported as [`AgentEvent::ContactDecided`]).
    Decided(Permitted),
    /// It needs approval: pending approval `id` was recorded (durably).
    Pending {
        /// The approval's id.
        id: u64,
    },
    /// It needs approval, and the caller chose to make the contact another way
    /// ([`decide_contact`]'s `defer`): nothing was recorded or reported.
    Deferred(D),
}

/// No value: the `Deferred` of a caller that never defers cannot be made.
pub(crate) type Never = std::convert::Infallible;

/// The `defer` of a caller that never makes a contact another way.
fn never_defer() -> Option<Never> {
    None
}

/// The refusal of `contact` when the organisation cannot be read or changed.
fn unavailable(contact: &Contact<'_>, cause: impl std::fmt::Display) -> NotPermitted {
    refusal(
        contact,
        NotPermittedReason::Unavailable {
            cause: cause.to_string(),
        },
    )
}

/// The runtime whose store holds the organisation, or the refusal of `contact` before
/// it started.
fn contact_runtime(shared: &crate::agent::AgentShared, contact: &Contact<'_>) -> Result<RuntimeHandle, NotPermitted> {
    shared
        .runtime()
        .ok_or_else(|| unavailable(contact, "the runtime has not started, or has stopped"))
}

/// The organisation's store for one of admission's approval writes for `contact` (see
/// [`OrgStore::change`] on why a change may be applied twice, and `store_wait.rs` on
/// what a try made again makes twice): each operation tried again while unavailable
/// until the contact's deadline or [`ORG_APPROVAL_STORE_WAIT_MS`] from now, whichever
/// comes first.
fn approval_store(runtime: &RuntimeHandle, contact: &Contact<'_>) -> WaitingStore {
    let bound = runtime.deadline_in(Duration::from_millis(ORG_APPROVAL_STORE_WAIT_MS));
    WaitingStore::until(runtime, contact.deadline.min(bound))
}

fn refusal(contact: &Contact<'_>, reason: NotPermittedReason) -> NotPermitted {
    NotPermitted {
        from: contact.from.key().to_string(),
        to: contact.to.key().to_string(),
        kind: contact.kind,
        reason,
    }
}

fn emit_decided(
    shared: &crate::agent::AgentShared,
    clock: &Clock,
    contact: &Contact<'_>,
    version: u64,
    permitted: bool,
) {
    if shared.has_listeners() {
        shared.emit(&AgentEvent::ContactDecided {
            from: contact.from.clone(),
            to: contact.to.clone(),
            kind: contact.kind,
            org_version: version,
            permitted,
            at: clock.now(),
        });
    }
}

/// Decides one contact on the current organisation without waiting: a contact that
/// needs approval records a pending [`crate::Approval`] (durably) and is returned as
/// [`FirstDecision::Pending`], unless `defer` gives what the caller makes it another way
/// with ([`FirstDecision::Deferred`]); the final decision is then [`await_approval`]'s.
/// `watch`, given by a caller that waits for the approval itself, is armed from the
/// moment the approval's write starts (see [`ApprovalWatch`]).
///
/// # Errors
/// [`NotPermitted`] (reported as [`AgentEvent::ContactDecided`]).
pub(crate) async fn decide_contact<D>(
    shared: &crate::agent::AgentShared,
    clock: &Clock,
    contact: &Contact<'_>,
    listing: Listing,
    defer: impl FnOnce() -> Option<D>,
    watch: Option<&mut ApprovalWatch<'_>>,
) -> Result<FirstDecision<D>, NotPermitted> {
    let (from, to, kind) = (contact.from.key(), contact.to.key(), contact.kind);
    let runtime = contact_runtime(shared, contact)?;
    let store = runtime.store().as_ref();
    let unavailable = |error: OrgError| unavailable(contact, error);
    let org = shared.org.current(store, clock).await.map_err(unavailable)?;
    match org.decide(from, to, kind) {
        Ok(Permitted::NeedsApproval { .. }) => {
            if let Some(deferred) = defer() {
                return Ok(FirstDecision::Deferred(deferred));
            }
            let id = request_approval(shared, clock, &runtime, contact, listing, watch).await?;
            Ok(FirstDecision::Pending { id })
        }
        other => {
            emit_decided(shared, clock, contact, org.version(), other.is_ok());
            other.map(FirstDecision::Decided)
        }
    }
}

/// Records a pending [`crate::Approval`] of `contact` (durably, until the contact's
/// deadline) in `runtime`'s store, listed as `listing` says, and reports it as
/// [`AgentEvent::ApprovalRequested`] when it is listed; returns its id. A store that
/// fails for a moment is tried again ([`approval_store`]). `watch` is armed before the
/// write starts and told each id a write carries: a write in flight when its waiter
/// stops waiting may still land.
///
/// # Errors
/// [`NotPermitted`] with reason `Unavailable` when the organisation cannot be changed
/// (the store still unavailable at the end of the tries, or failing otherwise), or is
/// full of pending approvals.
pub(crate) async fn request_approval(
    shared: &crate::agent::AgentShared,
    clock: &Clock,
    runtime: &RuntimeHandle,
    contact: &Contact<'_>,
    listing: Listing,
    mut watch: Option<&mut ApprovalWatch<'_>>,
) -> Result<u64, NotPermitted> {
    let (from, to, kind) = (contact.from.key(), contact.to.key(), contact.kind);
    if let Some(watch) = watch.as_deref_mut() {
        watch.arm(contact);
    }
    // The ids this request's tries recorded. A try whose commit landed unseen and was
    // then fenced by another process's claim is made again on the newest record, which
    // holds that try's approval: it is this contact's, and is answered instead of a
    // second one (which would stay pending, waited for by nobody, until its deadline).
    let mut recorded: Vec<u64> = Vec::new();
    let id = shared
        .org
        .change(&approval_store(runtime, contact), clock, |org| {
            let (message, deadline, now) = (contact.message, contact.deadline, clock.now());
            let earlier = recorded.iter().copied().find(|&id| {
                org.approval(id).is_some_and(|approval| {
                    (
                        approval.from.as_str(),
                        approval.to.as_str(),
                        approval.kind,
                        approval.deadline,
                    ) == (from, to, kind, Some(deadline))
                })
            });
            if let Some(id) = earlier {
                return Ok(id);
            }
            let id = match listing {
                Listing::Now => org.request_approval(from, to, kind, message, deadline, now),
                Listing::OnDelivery => org.request_unlisted_approval(from, to, kind, message, deadline, now),
            }?;
            recorded.push(id);
            if let Some(watch) = watch.as_deref_mut() {
                watch.writing(id);
            }
            Ok(id)
        })
        .await
        .map_err(|error| unavailable(contact, error))?;
    if listing == Listing::Now {
        emit_requested(shared, clock, contact, id);
    }
    Ok(id)
}

fn emit_requested(shared: &crate::agent::AgentShared, clock: &Clock, contact: &Contact<'_>, id: u64) {
    shared.emit(&AgentEvent::ApprovalRequested {
        id,
        from: contact.from.clone(),
        to: contact.to.clone(),
        kind: contact.kind,
        at: clock.now(),
    });
}

/// Lists approval `id` of `contact` for a person ([`Listing::OnDelivery`]), once: its
/// contact's turn committed and its delivery now waits for it. Reports it as
/// [`AgentEvent::ApprovalRequested`] when this listed it, or when it finds it listed
/// and `tried_before` (an earlier attempt's change may have landed though it failed:
/// reported then rather than never).
///
/// The read is admission's (`current`: a cached copy when the store fails); the write
/// tries a store that fails for a moment again ([`approval_store`]).
///
/// # Errors
/// [`NotPermitted`] with reason `Unavailable` when the organisation cannot be read or
/// changed.
async fn list_approval(
    shared: &crate::agent::AgentShared,
    clock: &Clock,
    runtime: &RuntimeHandle,
    contact: &Contact<'_>,
    id: u64,
    tried_before: bool,
) -> Result<(), NotPermitted> {
    let unavailable = |error: OrgError| unavailable(contact, error);
    let org = shared
        .org
        .current(runtime.store().as_ref(), clock)
        .await
        .map_err(unavailable)?;
    let now = clock.now();
    // A resumed delivery, or one listed by an earlier attempt, finds it listed (or
    // resolved, or past its deadline) already: no write then. One this cache does not
    // hold (it was recorded by another process since the cache was read) is looked up
    // by the change itself.
    let found = org
        .approval(id)
        .map(|approval| (approval.listed, approval.state_at(now)));
    let listed = match found {
        Some((true, ApprovalState::Pending)) => tried_before,
        Some((_, state)) if state != ApprovalState::Pending => false,
        _ => shared
            .org
            .change(&approval_store(runtime, contact), clock, |org| {
                Ok(org.list_approval(id, now))
            })
            .await
            .map_err(unavailable)?,
    };
    if listed {
        emit_requested(shared, clock, contact, id);
    }
    Ok(())
}

/// Withdraws approval `id`, recorded unlisted for a send that then failed a later check
/// (nothing was queued: [`crate::Organisation::withdraw_approval`]). Best effort: a
/// store that fails for a moment is tried again for [`ORG_WITHDRAW_STORE_WAIT_MS`]; if
/// the organisation cannot be changed by then, the approval stays unlisted until its
/// deadline.
pub(crate) async fn withdraw_approval(shared: &crate::agent::AgentShared, clock: &Clock, id: u64) {
    let Some(runtime) = shared.runtime() else {
        return;
    };
    let deadline = runtime.deadline_in(Duration::from_millis(ORG_WITHDRAW_STORE_WAIT_MS));
    let withdrawn = shared
        .org
        .change(&WaitingStore::until(&runtime, deadline), clock, |org| {
            Ok(org.withdraw_approval(id))
        })
        .await;
    if let Err(error) = withdrawn {
        tracing::warn!(%error, approval = id, "an approval recorded for a send that was not queued could not be withdrawn; it expires at its deadline");
    }
}

/// Waits for pending approval `id` of `contact` until the contact's deadline, then
/// decides again on the organisation of that moment (a deny added meanwhile wins), and
/// reports the final decision as [`AgentEvent::ContactDecided`] with the version it was
/// made on. Works in a later process too: the approval is read from the store.
///
/// # Errors
/// [`NotPermitted`]: denied, still pending at the deadline, refused by the organisation
/// of that moment, or the organisation unavailable.
pub(crate) async fn await_approval(
    shared: &crate::agent::AgentShared,
    clock: &Clock,
    contact: &Contact<'_>,
    id: u64,
) -> Result<Permitted, NotPermitted> {
    let (from, to, kind) = (contact.from.key(), contact.to.key(), contact.kind);
    let runtime = contact_runtime(shared, contact)?;
    let store = runtime.store().as_ref();
    let unavailable = |error: OrgError| unavailable(contact, error);
    // Loads the cache first (after a restart nothing else may have).
    shared.org.current(store, clock).await.map_err(unavailable)?;
    let state = shared.org.wait_resolved(id, store, clock, contact.deadline).await;
    let now = shared.org.current(store, clock).await.map_err(unavailable)?;
    let decision = match state {
        Some(ApprovalState::Approved) => match now.decide(from, to, kind) {
            Ok(Permitted::NeedsApproval { rule, mode }) => Ok(Permitted::NeedsApproval { rule, mode }),
            other => other,
        },
        Some(ApprovalState::Denied) => Err(refusal(contact, NotPermittedReason::ApprovalDenied { id })),
        Some(ApprovalState::Pending | ApprovalState::Expired) | None => {
            Err(refusal(contact, NotPermittedReason::ApprovalTimedOut { id }))
        }
    };
    emit_decided(shared, clock, contact, now.version(), decision.is_ok());
    decision
}

/// Waits, outside any turn, for pending approval `id` of `contact` until the contact's
/// deadline ([`await_approval`]), trying again every [`AGENT_DELIVERY_RETRY_MS`] while
/// the organisation's store cannot be read: `Ok` when the contact may go ahead, else
/// the final refusal (denied, refused by the organisation of that moment, still pending
/// at the deadline, or the store unavailable at it).
///
/// [`AGENT_DELIVERY_RETRY_MS`]: crate::limits::AGENT_DELIVERY_RETRY_MS
///
/// # Errors
/// [`NotPermitted`].
pub(crate) async fn await_approval_outside_turn(
    runtime: &RuntimeHandle,
    shared: &crate::agent::AgentShared,
    contact: &Contact<'_>,
    id: u64,
) -> Result<(), NotPermitted> {
    let clock = runtime.clock();
    let mut tried_before = false;
    loop {
        let listed = list_approval(shared, &clock, runtime, contact, id, tried_before).await;
        tried_before = listed.is_err();
        let waited = match listed {
            Ok(()) => await_approval(shared, &clock, contact, id).await,
            Err(refused) => Err(refused),
        };
        match waited {
            Ok(_) => return Ok(()),
            Err(NotPermitted {
                reason: NotPermittedReason::Unavailable { .. },
                ..
            }) if !contact.deadline.has_passed(runtime.now()) => {
                tokio::time::sleep(Duration::from_millis(crate::limits::AGENT_DELIVERY_RETRY_MS)).await;
            }
            Err(refused) => return Err(refused),
        }
    }
}

/// The organisation's admission of one contact, waiting: [`decide_contact`], then, if
/// it needs approval, [`await_approval`] until the contact's deadline.
///
/// # Errors
/// [`NotPermitted`].
pub(crate) async fn admit_contact(
    shared: &Arc<crate::agent::AgentShared>,
    clock: &Clock,
    contact: Contact<'_>,
) -> Result<Permitted, NotPermitted> {
    let mut watch = ApprovalWatch::new(shared);
    let decided = decide_contact(shared, clock, &contact, Listing::Now, never_defer, Some(&mut watch)).await?;
    let waited = match decided {
        FirstDecision::Decided(permitted) => Ok(permitted),
        FirstDecision::Pending { id } => await_approval(shared, clock, &contact, id).await,
        FirstDecision::Deferred(never) => match never {},
    };
    watch.disarm(); // the wait ended: nothing to take off the list
    waited
}

/// Loads the organisation into the cache if it is not there yet, or again once it is
/// older than [`ORG_CACHE_MAX_AGE_MS`], so the prompt shows the one admission decides
/// on; a failure is left for admission to report.
///
/// `now` is the caller's reading of the runtime's clock: a cache young enough at it is
/// kept without taking the runtime's handle or reading the clock again.
pub(crate) async fn ensure_loaded(shared: &crate::agent::AgentShared, now: Deadline) {
    if shared.org.is_fresh(now) {
        return;
    }
    if let Some(runtime) = shared.runtime() {
        if let Err(error) = shared.org.current(runtime.store().as_ref(), &runtime.clock()).await {
            tracing::warn!(%error, "the organisation could not be loaded");
        }
    }
}

/// The organisation's admission of a delegation or notification from `from` to `to`
/// (see [`decide_contact`]), without waiting: `Some(id)` when it needs approval `id`
/// (the message then waits in the outbox, see `inbox.rs`). A target that is unknown or
/// not a valid id is left to the runtime's admission, which refuses it with its own
/// error.
///
/// # Errors
/// [`crate::InboxError::NotPermitted`].
pub(crate) async fn admit_send(
    shared: &crate::agent::AgentShared,
    clock: &Clock,
    from: &ActorId,
    to: &str,
    message: &str,
    deadline: Deadline,
    task: bool,
) -> Result<Option<u64>, crate::InboxError> {
    let Ok(target) = crate::agent_id(to) else {
        return Ok(None);
    };
    if !shared.directory.contains(to) {
        return Ok(None);
    }
    let contact = Contact {
        from,
        to: &target,
        kind: send_kind(task),
        message,
        deadline,
    };
    match decide_contact(shared, clock, &contact, Listing::OnDelivery, never_defer, None).await {
        Ok(FirstDecision::Decided(_)) => Ok(None),
        Ok(FirstDecision::Deferred(never)) => match never {},
        Ok(FirstDecision::Pending { id }) => Ok(Some(id)),
        Err(refused) => Err(crate::InboxError::NotPermitted(refused)),
    }
}

/// The contact kind of a delegation (`task`) or a notification.
pub(crate) fn send_kind(task: bool) -> ContactKind {
    if task {
        ContactKind::Delegate
    } else {
        ContactKind::Notify
    }
}

/// The organisation's admission of `call_agent` from the turn of `context` to `target`,
/// after the runtime admitted it (`admitted`, whose slot is held while approval is
/// waited for, until the call's deadline).
///
/// # Errors
/// [`crate::AgentCallError::NotPermitted`].
pub(crate) async fn admit_call(
    context: &crate::ToolExecutionContext,
    target: &ActorId,
    message: &str,
    admitted: troupe_runtime::Admitted,
) -> Result<CallAdmission, crate::AgentCallError> {
    let contact = Contact {
        from: context.agent_id(),
        to: target,
        kind: ContactKind::Ask,
        message,
        deadline: admitted.child().deadline(),
    };
    let (shared, clock) = (context.shared(), context.clock());
    // Read only when the call needs approval: the caller's choice of how to wait. Only
    // a local agent can be sent a task: a call to a remote agent waits in the turn.
    let as_task = || {
        (shared.directory.contains(contact.to.key())
            && shared.directory.call_approval_of(contact.from.key()) == crate::CallApproval::Delegate)
            .then_some(())
    };
    let mut watch = ApprovalWatch::new(shared);
    let decided = decide_contact(shared, &clock, &contact, Listing::Now, as_task, Some(&mut watch)).await?;
    let waited = match decided {
        FirstDecision::Decided(_) => Ok(()),
        FirstDecision::Pending { id } => await_approval(shared, &clock, &contact, id).await.map(drop),
        FirstDecision::Deferred(()) => Ok(()),
    };
    watch.disarm(); // the wait ended: nothing to take off the list
    waited?;
    Ok(match decided {
        FirstDecision::Deferred(()) => CallAdmission::AsTask,
        FirstDecision::Decided(_) | FirstDecision::Pending { .. } => CallAdmission::Call(admitted),
    })
}

/// The waiter of a listed approval: a call waiting in its turn ([`admit_call`]) or an
/// [`crate::AgentClient::ask_as`] waiting in its caller's task ([`admit_contact`]).
/// Armed from the moment the approval's write starts; disarmed once the wait for it
/// ended. Dropped while armed (the turn was cancelled because its caller gave up or the
/// HTTP client that asked left, the caller's future was dropped, or the write failed and
/// may have landed all the same), it takes the approval off the list from a task of its
/// own: the approval is marked expired ([`Organisation::abandon_approval`]), so a person
/// no longer sees it and approving it is refused rather than accepted for a call that
/// will never be made. One past its deadline is left as it is (it reads expired by its
/// deadline).
///
/// The write may still be in flight when the waiter goes: a store that runs it on a
/// thread of its own (SQLite) or on a server (PostgreSQL) finishes it whether or not
/// anyone waits. The task's change claims the organisation's record first, which fences
/// every earlier claim, so that write has either landed before (and the approval is
/// found and marked) or never lands. The approval is found by the id the write carried
/// and by its contact (sender, target, kind, message and deadline): a write that did not
/// land leaves its id to be given again, to another contact.
///
/// A crashed process runs no destructor, the simulator never runs a task spawned on a
/// node it killed, and a runtime dropped or aborted marks nothing, so this writes
/// nothing after a crash. Best effort: an approval the organisation could not be
/// changed for stays listed until its deadline.
///
/// [`Organisation::abandon_approval`]: crate::Organisation::abandon_approval
pub(crate) struct ApprovalWatch<'a> {
    shared: &'a Arc<crate::agent::AgentShared>,
    armed: Option<Watched>,
}

/// What an armed [`ApprovalWatch`] takes off the list.
struct Watched {
    shared: Arc<crate::agent::AgentShared>,
    /// The id of the approval the latest write carried; `None` before a write had one.
    id: Option<u64>,
    from: String,
    to: String,
    kind: ContactKind,
    /// As stored: at most [`crate::limits::ORG_APPROVAL_MESSAGE_SIZE_MAX_BYTES`].
    message: String,
    deadline: Deadline,
}

impl<'a> ApprovalWatch<'a> {
    /// Unarmed, for the contacts of `shared`'s agents.
    pub(crate) fn new(shared: &'a Arc<crate::agent::AgentShared>) -> Self {
        Self { shared, armed: None }
    }

    /// Armed for an approval of `contact` about to be written.
    fn arm(&mut self, contact: &Contact<'_>) {
        let message = troupe_core::truncate_utf8(contact.message, crate::org::ORG_APPROVAL_MESSAGE_SIZE_MAX_BYTES);
        self.armed = Some(Watched {
            shared: Arc::clone(self.shared),
            id: None,
            from: contact.from.key().to_string(),
            to: contact.to.key().to_string(),
            kind: contact.kind,
            message: message.to_string(),
            deadline: contact.deadline,
        });
    }

    /// A write of the approval as `id` is about to be sent.
    fn writing(&mut self, id: u64) {
        if let Some(watched) = self.armed.as_mut() {
            watched.id = Some(id);
        }
    }

    /// The wait ended (or never began): nothing to take off the list.
    pub(crate) fn disarm(&mut self) {
        self.armed = None;
    }
}

impl Drop for ApprovalWatch<'_> {
    fn drop(&mut self) {
        let Some(Watched {
            shared,
            id: Some(id),
            from,
            to,
            kind,
            message,
            deadline,
        }) = self.armed.take()
        else {
            return; // disarmed, or no write carried the approval
        };
        // A runtime dropped or aborted is a process going away: like a crashed one, it
        // writes nothing more (and the turns of a dropped system are cut this way).
        let Some(runtime) = shared.runtime().filter(|runtime| !runtime.is_aborted()) else {
            return;
        };
        // A turn cancelled while its runtime shuts down may be dropped outside it.
        let Ok(tasks) = tokio::runtime::Handle::try_current() else {
            return;
        };
        tasks.spawn(async move {
            let clock = runtime.clock();
            let ours = |approval: &crate::Approval| {
                approval.from == from
                    && approval.to == to
                    && approval.kind == kind
                    && approval.message == message
                    && approval.deadline == Some(deadline)
            };
            let abandoned = shared
                .org
                .change(runtime.store().as_ref(), &clock, |org| {
                    let now = clock.now();
                    // Nothing of ours to mark: an error, so nothing is written (the claim
                    // has fenced a write still in flight all the same).
                    if !(org.approval(id).is_some_and(ours) && org.abandon_approval(id, now)) {
                        return Err(OrgError::NotPending { id });
                    }
                    Ok(org.approval(id).cloned())
                })
                .await;
            match abandoned {
                Ok(Some(approval)) => shared.emit(&AgentEvent::ApprovalResolved {
                    approval,
                    at: clock.now(),
                }),
                // Resolved meanwhile, expired already, or its write never landed.
                Ok(None) | Err(OrgError::NotPending { .. }) => {}
                Err(error) => {
                    tracing::warn!(%error, approval = id, "the approval of a contact whose waiter stopped waiting could not be marked expired; it stays listed until its deadline");
                }
            }
        });
    }
}

/// What the organisation's admission made of a `call_agent`.
pub(crate) enum CallAdmission {
    /// Permitted (approved, if it needed approval): make the call, in this slot.
    Call(troupe_runtime::Admitted),
    /// It needs approval, and its caller sends such calls as delegated tasks
    /// ([`crate::CallApproval::Delegate`]): nothing was recorded; send it as one.
    AsTask,
}
