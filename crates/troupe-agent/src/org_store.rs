//! Where the organisation lives: one state blob in the store, under the system key
//! space `troupe-org/org` (an actor id of a kind no runtime registers, so no actor ever
//! activates there), and a cache in memory that admission reads.
//!
//! ```text
//! change(f):  writer lock ─► claim(org) → fence, stored state ─► f(state)
//!             ─► commit(fence, new state) ─► cache = new state ─► version watchers woken
//!             (Fenced: another process changed it meanwhile → claim again, at most
//!              ORG_WRITE_ATTEMPTS_MAX times)
//! current():  the cache, or a load from the store the first time
//! ```
//!
//! Guarantee: once a change has returned, every later admission in this process reads
//! it (the cache is replaced before `change` returns). A change whose future is dropped
//! mid-way empties the cache, so the next read loads what the store holds. Another
//! process sharing the store sees the change after [`crate::AgentClient::reload_org`];
//! this cache is per process.

use std::sync::{Arc, RwLock};

use bytes::Bytes;
use troupe_core::{ActorId, Deadline, StoreError};
use troupe_runtime::{Clock, RuntimeHandle, StateChange, StateStore, TurnCommit};

use crate::org::{ApprovalState, ContactKind, NotPermitted, NotPermittedReason, OrgError, Organisation, Permitted};
use crate::AgentEvent;

/// The kind of the organisation's system key space.
pub const ORG_STORE_KIND: &str = "troupe-org";
/// The key of the organisation's system key space.
pub const ORG_STORE_KEY: &str = "org";
/// How many times one change claims the organisation again when another process
/// changed it between the claim and the commit.
pub const ORG_WRITE_ATTEMPTS_MAX: u32 = 3;

/// The organisation's actor id in the store.
pub(crate) fn org_store_id() -> ActorId {
    ActorId::new(ORG_STORE_KIND, ORG_STORE_KEY).expect("the organisation's id is valid")
}

fn decode(bytes: Option<&Bytes>) -> Result<Organisation, OrgError> {
    match bytes {
        None => Ok(Organisation::default()),
        Some(bytes) => serde_json::from_slice(bytes).map_err(|error| OrgError::Decode {
            cause: error.to_string(),
        }),
    }
}

/// The cache and the writers' lock (one per system).
pub(crate) struct OrgStore {
    cache: RwLock<Option<Arc<Organisation>>>,
    writer: tokio::sync::Mutex<()>,
    /// Woken at every change, for waiters on approvals. A `Notify`, not a `watch`
    /// channel: a `watch` receiver waits on one of eight `Notify`s picked by tokio's
    /// thread-local random generator, which under the simulator carries over from one
    /// run to the next in a process, so two runs of one seed woke the waiters in a
    /// different order (the determinism check's divergence at an approval, 2026-11-28).
    /// A `Notify` wakes its waiters in the order they registered.
    changed: tokio::sync::Notify,
}

/// Empties the cache unless disarmed: a change dropped mid-way leaves the next reader
/// to load what the store holds.
struct ClearOnDrop<'a> {
    cache: &'a RwLock<Option<Arc<Organisation>>>,
    armed: bool,
}

impl Drop for ClearOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            *self.cache.write().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
        }
    }
}

impl OrgStore {
    pub(crate) fn new() -> Self {
        Self {
            cache: RwLock::new(None),
            writer: tokio::sync::Mutex::new(()),
            changed: tokio::sync::Notify::new(),
        }
    }

    /// The cached organisation, if it was loaded.
    pub(crate) fn cached(&self) -> Option<Arc<Organisation>> {
        self.cache
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn publish(&self, org: Organisation) -> Arc<Organisation> {
        let org = Arc::new(org);
        *self.cache.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Arc::clone(&org));
        self.changed.notify_waiters();
        org
    }

    /// The organisation: the cache, or the store the first time.
    ///
    /// # Errors
    /// The store's error, or [`OrgError::Decode`].
    pub(crate) async fn current(&self, store: &dyn StateStore) -> Result<Arc<Organisation>, OrgError> {
        if let Some(org) = self.cached() {
            return Ok(org);
        }
        // Under the writers' lock: a load never overwrites a newer change.
        let _writer = self.writer.lock().await;
        if let Some(org) = self.cached() {
            return Ok(org);
        }
        self.load(store).await
    }

    async fn load(&self, store: &dyn StateStore) -> Result<Arc<Organisation>, OrgError> {
        let bytes = store.load(&org_store_id()).await?;
        Ok(self.publish(decode(bytes.as_ref())?))
    }

    /// Reads the organisation from the store again (changes made by another process).
    ///
    /// # Errors
    /// As [`OrgStore::current`].
    pub(crate) async fn reload(&self, store: &dyn StateStore) -> Result<Arc<Organisation>, OrgError> {
        let _writer = self.writer.lock().await;
        self.load(store).await
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
        mut change: impl FnMut(&mut Organisation) -> Result<T, OrgError>,
    ) -> Result<T, OrgError> {
        let _writer = self.writer.lock().await;
        let id = org_store_id();
        let mut attempt = 0;
        loop {
            attempt += 1;
            let claimed = store.claim(&id).await?;
            let mut org = decode(claimed.state.as_ref())?;
            let output = change(&mut org)?;
            let bytes = serde_json::to_vec(&org).map_err(|error| OrgError::Decode {
                cause: error.to_string(),
            })?;
            let commit = TurnCommit {
                state: StateChange::Set(Bytes::from(bytes)),
                writes: Vec::new(),
            };
            let mut guard = ClearOnDrop {
                cache: &self.cache,
                armed: true,
            };
            match store.commit(&id, claimed.fence, commit).await {
                Ok(()) => {
                    guard.armed = false;
                    self.publish(org);
                    return Ok(output);
                }
                Err(StoreError::Fenced { .. }) if attempt < ORG_WRITE_ATTEMPTS_MAX => continue,
                Err(error) => return Err(error.into()),
            }
        }
    }

    /// Waits until approval `id` is resolved or `deadline` passes; `None` at the
    /// deadline (or if the record is gone).
    pub(crate) async fn wait_resolved(&self, id: u64, clock: &Clock, deadline: Deadline) -> Option<ApprovalState> {
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
                changed.await;
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

/// The organisation's first decision on one contact, made without waiting.
pub(crate) enum FirstDecision {
    /// Decided now (and reported as [`AgentEvent::ContactDecided`]).
    Decided(Permitted),
    /// It needs approval: pending approval `id` was recorded (durably).
    Pending {
        /// The approval's id.
        id: u64,
    },
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
/// [`FirstDecision::Pending`]; the final decision is then [`await_approval`]'s.
///
/// # Errors
/// [`NotPermitted`] (reported as [`AgentEvent::ContactDecided`]).
pub(crate) async fn decide_contact(
    shared: &crate::agent::AgentShared,
    clock: &Clock,
    contact: &Contact<'_>,
) -> Result<FirstDecision, NotPermitted> {
    let (from, to, kind) = (contact.from.key(), contact.to.key(), contact.kind);
    let runtime = contact_runtime(shared, contact)?;
    let store = runtime.store().as_ref();
    let unavailable = |error: OrgError| unavailable(contact, error);
    let org = shared.org.current(store).await.map_err(unavailable)?;
    match org.decide(from, to, kind) {
        Ok(Permitted::NeedsApproval { .. }) => {
            let id = shared
                .org
                .change(store, |org| org.request_approval(from, to, kind, contact.message))
                .await
                .map_err(unavailable)?;
            shared.emit(&AgentEvent::ApprovalRequested {
                id,
                from: contact.from.clone(),
                to: contact.to.clone(),
                kind,
                at: clock.now(),
            });
            Ok(FirstDecision::Pending { id })
        }
        other => {
            emit_decided(shared, clock, contact, org.version(), other.is_ok());
            other.map(FirstDecision::Decided)
        }
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
    shared.org.current(store).await.map_err(unavailable)?;
    let state = shared.org.wait_resolved(id, clock, contact.deadline).await;
    let now = shared.org.current(store).await.map_err(unavailable)?;
    let decision = match state {
        Some(ApprovalState::Approved) => match now.decide(from, to, kind) {
            Ok(Permitted::NeedsApproval { rule, mode }) => Ok(Permitted::NeedsApproval { rule, mode }),
            other => other,
        },
        Some(ApprovalState::Denied) => Err(refusal(contact, NotPermittedReason::ApprovalDenied { id })),
        Some(ApprovalState::Pending) | None => Err(refusal(contact, NotPermittedReason::ApprovalTimedOut { id })),
    };
    emit_decided(shared, clock, contact, now.version(), decision.is_ok());
    decision
}

/// The organisation's admission of one contact, waiting: [`decide_contact`], then, if
/// it needs approval, [`await_approval`] until the contact's deadline.
///
/// # Errors
/// [`NotPermitted`].
pub(crate) async fn admit_contact(
    shared: &crate::agent::AgentShared,
    clock: &Clock,
    contact: Contact<'_>,
) -> Result<Permitted, NotPermitted> {
    match decide_contact(shared, clock, &contact).await? {
        FirstDecision::Decided(permitted) => Ok(permitted),
        FirstDecision::Pending { id } => await_approval(shared, clock, &contact, id).await,
    }
}

/// Loads the organisation into the cache if it is not there yet, so the prompt can show
/// it; a failure is left for admission to report.
pub(crate) async fn ensure_loaded(shared: &crate::agent::AgentShared) {
    if shared.org.cached().is_some() {
        return;
    }
    if let Some(runtime) = shared.runtime() {
        if let Err(error) = shared.org.current(runtime.store().as_ref()).await {
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
    match decide_contact(shared, clock, &contact).await {
        Ok(FirstDecision::Decided(_)) => Ok(None),
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
) -> Result<troupe_runtime::Admitted, crate::AgentCallError> {
    let contact = Contact {
        from: context.agent_id(),
        to: target,
        kind: ContactKind::Ask,
        message,
        deadline: admitted.child().deadline(),
    };
    admit_contact(context.shared(), &context.clock(), contact).await?;
    Ok(admitted)
}
