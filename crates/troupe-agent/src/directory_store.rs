//! Agents defined, replaced and removed at runtime ([`AgentClient::define_agent`],
//! [`AgentClient::replace_agent`], [`AgentClient::remove_agent`], the server's
//! `POST`/`PUT`/`DELETE /v1/agents`): one shared record in the store, under the system
//! key space `troupe-directory/agents` (a shared record kind: see
//! `RuntimeBuilder::shared_record_kind`), laid over the agents the system was built
//! with.
//!
//! ```text
//! define/replace/remove:  writer lock ─► claim(record) ─► check against the newest
//!                         record ─► commit ─► apply to this process's directory
//!                         (Fenced: another process wrote meanwhile → pause, claim
//!                         again: `shared_record.rs`)
//! refresh (reload_directory; and, once the last read is DIRECTORY_REFRESH_MS old or
//! there was none, at a lookup of an agent, at an agent's turn, at current_directory):
//!                         load(record) ─► a newer version? apply it
//! apply:                  every defined agent upserted, every removed agent removed
//!                         (its activation in this process deactivated)
//! ```
//!
//! So a definition made through the API outlives the process (a restart on the same
//! store reads it at its first lookup), and every process sharing the store (two
//! processes on one SQLite file, the nodes of a cluster) sees a definition, a
//! replacement or a removal within [`DIRECTORY_REFRESH_MS`]: its lookups and its
//! agents' turns read the record again once their copy is that old. At most one read
//! per that period, and none in a process that looks nothing up. Creating an agent is decided on the newest record: two
//! processes creating one id at once give one definition and one `AgentExists`.
//! Agents the system was built with (its builder, its config file) are the base: the
//! record's entries replace or remove them, and an agent the record does not name is
//! left as built. A stored definition this process cannot run (it names a provider or
//! tool this system does not have, or is invalid: a field over its limit) is skipped
//! with a warning; one whose `max_steps` is out of range (an older Troupe stored any and
//! clipped it at the turns) is clipped into range with a warning and kept.
//!
//! Each stored definition carries when it was defined or last replaced, on the
//! runtime's clock (`defined_at_us`, [`AgentSpec::defined_at_us`]: `GET /v1/models`'s
//! `created`); one stored by an older Troupe has none and loads as before. The time is
//! not part of the definition's equality: a record whose entry differs from this
//! process's only by it updates the time, not the directory's generation.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, PoisonError};

use serde::{Deserialize, Serialize};
use troupe_core::{ActorId, Deadline, InvokeError, StoreError};
use troupe_runtime::{RuntimeHandle, StateStore};

use crate::agent::AgentShared;
use crate::{agent_id, AgentClient, AgentSpec, AgentSpecError};

/// The kind of the directory's system key space (a shared record kind).
pub const DIRECTORY_STORE_KIND: &str = "troupe-directory";
/// The key of the directory's system key space.
pub const DIRECTORY_STORE_KEY: &str = "agents";
/// How old this process's read of the record may be before a lookup reads it again,
/// in milliseconds: the most a change made by another process sharing the store takes
/// to reach this one's lookups and turns. At most one read per this period.
pub const DIRECTORY_REFRESH_MS: u64 = 1_000;

/// Why a definition was not changed.
#[derive(Debug, thiserror::Error)]
pub enum DirectoryError {
    /// The agent exists (create only: replace it instead).
    #[error("agent {id:?} already exists; replace_agent (PUT /v1/agents/{id}) replaces it")]
    AgentExists {
        /// The agent.
        id: String,
    },
    /// There is no such agent.
    #[error("agent {id:?} does not exist")]
    NoSuchAgent {
        /// The agent.
        id: String,
    },
    /// The definition is invalid, or names a provider or tool this system lacks.
    #[error("{0}")]
    Invalid(#[from] AgentSpecError),
    /// The record could not be read or written.
    #[error("the agent directory could not be stored: {0}")]
    Store(#[from] StoreError),
    /// The stored record is not valid JSON of the directory.
    #[error("the stored agent directory cannot be read: {cause}")]
    Decode {
        /// The decoder's message.
        cause: String,
    },
}

/// The stored record: what the API changed, laid over the built agents. Each stored
/// definition carries the time it was defined or last replaced (`defined_at_us`, see
/// [`AgentSpec::defined_at_us`]); one stored by an older Troupe has none.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
struct DefinedAgents {
    /// Counts the changes.
    version: u64,
    /// Agents defined or replaced through the API, by id.
    agents: BTreeMap<String, AgentSpec>,
    /// Agents removed through the API (built ones included), by id.
    removed: BTreeSet<String>,
}

impl DefinedAgents {
    /// Whether `id` exists under this record for a process whose directory lists it
    /// (`listed`) or not: defined in the record, or listed and not removed by it (an
    /// agent the record removed is gone even if this process has not applied that yet).
    fn has(&self, id: &str, listed: bool) -> bool {
        self.agents.contains_key(id) || (listed && !self.removed.contains(id))
    }
}

/// `spec` with its `max_steps` clipped into
/// `AGENT_TURN_STEPS_MIN..=AGENT_TURN_STEPS_MAX`, with a warning if it was out of it.
/// An older Troupe stored any value and clipped it at the agent's turns; now such a
/// definition is refused when defined, and one already stored keeps running as it did
/// (rather than being skipped as an invalid definition is).
fn clip_stored_steps(spec: &AgentSpec) -> std::borrow::Cow<'_, AgentSpec> {
    use crate::limits::{AGENT_TURN_STEPS_MAX, AGENT_TURN_STEPS_MIN};
    let steps = spec.model.max_steps;
    let clipped = steps.clamp(AGENT_TURN_STEPS_MIN, AGENT_TURN_STEPS_MAX);
    if clipped == steps {
        return std::borrow::Cow::Borrowed(spec);
    }
    tracing::warn!(
        agent = %spec.id,
        stored = steps,
        used = clipped,
        "a stored agent definition's max_steps is out of range; clipped (replace the definition to fix it)"
    );
    std::borrow::Cow::Owned(spec.clone().max_steps(clipped))
}

fn record_id() -> ActorId {
    ActorId::new(DIRECTORY_STORE_KIND, DIRECTORY_STORE_KEY).expect("the directory's record id is valid")
}

fn decode_error(cause: String) -> DirectoryError {
    DirectoryError::Decode { cause }
}

/// This process's side of the record.
pub(crate) struct DirectoryStore {
    /// One change at a time in this process.
    writer: tokio::sync::Mutex<()>,
    /// The version last applied to the directory; held while one is applied, so two
    /// versions are never applied interleaved (an older one is skipped).
    applied: tokio::sync::Mutex<u64>,
    /// When the record was last read (or a read tried), if ever.
    read_at: Mutex<Option<Deadline>>,
    /// The agents the record last applied has removed: the agent factory makes a
    /// draining activation of one of them (`AgentActor::draining`), so its stored
    /// boxes are relayed and its unworked tasks ended, not stranded.
    removed: Mutex<BTreeSet<String>>,
}

impl DirectoryStore {
    pub(crate) fn new() -> Self {
        Self {
            writer: tokio::sync::Mutex::new(()),
            applied: tokio::sync::Mutex::new(0),
            read_at: Mutex::new(None),
            removed: Mutex::new(BTreeSet::new()),
        }
    }

    /// Whether the record last applied removed agent `id` (and did not define it again).
    pub(crate) fn was_removed(&self, id: &str) -> bool {
        self.removed.lock().unwrap_or_else(PoisonError::into_inner).contains(id)
    }

    /// The agents the record last applied removed (and did not define again).
    pub(crate) fn removed_ids(&self) -> Vec<String> {
        self.removed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .cloned()
            .collect()
    }

    /// Whether the last read (or try) is younger than [`DIRECTORY_REFRESH_MS`] at `now`.
    fn is_fresh(&self, now: Deadline) -> bool {
        self.read_at
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some_and(|at| now.as_micros().saturating_sub(at.as_micros()) < DIRECTORY_REFRESH_MS * 1_000)
    }

    /// Reads the record if the last read (or try) is [`DIRECTORY_REFRESH_MS`] old or
    /// there was none; a failure is logged (the next lookup after that age tries again).
    pub(crate) async fn refresh_if_stale(&self, shared: &AgentShared, runtime: &RuntimeHandle) {
        if self.is_fresh(runtime.now()) {
            return;
        }
        // Not tried again while the store is unavailable: a lookup decides on the
        // directory as last read rather than wait, and the next lookup reads again.
        if let Err(error) = self.refresh(shared, runtime, runtime.store().as_ref()).await {
            tracing::warn!(%error, "reading the stored agent directory failed");
        }
    }

    /// [`Self::refresh_if_stale`] reading through `store` (one that tries again while
    /// the store is unavailable, counting each try: `resume_pending`'s).
    pub(crate) async fn refresh_if_stale_through(
        &self,
        shared: &AgentShared,
        runtime: &RuntimeHandle,
        store: &dyn StateStore,
    ) {
        if self.is_fresh(runtime.now()) {
            return;
        }
        if let Err(error) = self.refresh(shared, runtime, store).await {
            tracing::warn!(%error, "reading the stored agent directory failed");
        }
    }

    /// Applies `record` to `shared`'s directory if it is newer than what was applied,
    /// deactivating (without waiting) the agents it removed that are active in this
    /// process.
    async fn apply(&self, shared: &AgentShared, runtime: &RuntimeHandle, record: &DefinedAgents) {
        let mut applied = self.applied.lock().await;
        if record.version <= *applied {
            return;
        }
        *applied = record.version;
        *self.removed.lock().unwrap_or_else(PoisonError::into_inner) = record
            .removed
            .iter()
            .filter(|id| !record.agents.contains_key(*id))
            .cloned()
            .collect();
        for (id, spec) in &record.agents {
            let spec = clip_stored_steps(spec);
            match shared.directory.get(id) {
                // The same definition (the time is not part of it): only its time may
                // have changed (replaced by an equal one), which is not a change of the
                // directory's contents.
                Some(current) if current == *spec => {
                    if current.defined_at_us != spec.defined_at_us {
                        shared.directory.set_defined_at(id, spec.defined_at_us);
                    }
                }
                _ => {
                    if let Err(error) = shared.directory.upsert_stored(spec.into_owned()) {
                        tracing::warn!(agent = %id, %error, "a stored agent definition cannot run in this process; skipped");
                    }
                }
            }
        }
        for id in &record.removed {
            if shared.directory.remove(id).is_some() {
                if let Ok(actor) = agent_id(id) {
                    // Not awaited: this may run inside that agent's own turn, which its
                    // deactivation waits for.
                    let runtime = runtime.clone();
                    tokio::spawn(async move {
                        if let Err(error) = runtime.deactivate(&actor).await {
                            tracing::warn!(%actor, %error, "deactivating a removed agent failed");
                        }
                        // What it left in its boxes is drained (see `remove_agent`).
                        let store = runtime.store();
                        if let Err(error) = crate::system::resume_if_pending(&runtime, store.as_ref(), &actor).await {
                            tracing::warn!(%actor, %error, "could not start draining a removed agent; the next resume_pending does");
                        }
                    });
                }
            }
        }
    }

    /// Reads the record from `store` (the runtime's, or one that tries it again while
    /// unavailable: `store_wait.rs`) and applies it if it is newer.
    pub(crate) async fn refresh(
        &self,
        shared: &AgentShared,
        runtime: &RuntimeHandle,
        store: &dyn StateStore,
    ) -> Result<(), DirectoryError> {
        // The try counts from its start, but only once it ended (applied, or failed): a
        // lookup made while it runs reads too, rather than take the directory as fresh
        // before this read applied it (`resume_pending`'s read at start ran alongside
        // the A2A server's first lookup, which then missed an agent defined over REST).
        let at = runtime.now();
        let read = async {
            let record: DefinedAgents =
                crate::shared_record::decode(store.load(&record_id()).await?.as_ref(), decode_error)?;
            self.apply(shared, runtime, &record).await;
            Ok(())
        }
        .await;
        *self.read_at.lock().unwrap_or_else(PoisonError::into_inner) = Some(at);
        read
    }

    /// Applies `change` to the newest record and commits it (again after a fenced
    /// commit, as the organisation's changes do), then to this process's directory. The
    /// claim and the commit are tried again while the store is unavailable, for up to
    /// [`crate::AGENT_API_STORE_WAIT_MS`] from the call (the commit as the same commit
    /// under the same fence: `store_wait.rs`); the writer's lock is held meanwhile.
    async fn change<T>(
        &self,
        shared: &AgentShared,
        runtime: &RuntimeHandle,
        mut change: impl FnMut(&mut DefinedAgents) -> Result<T, DirectoryError>,
    ) -> Result<T, DirectoryError> {
        let store = crate::store_wait::WaitingStore::for_api(runtime);
        let _writer = self.writer.lock().await;
        let versioned = |record: &mut DefinedAgents| {
            let output = change(record)?;
            record.version += 1;
            Ok(output)
        };
        let (record, output) =
            crate::shared_record::change(&store, &record_id(), decode_error, || {}, versioned).await?;
        self.apply(shared, runtime, &record).await;
        Ok(output)
    }
}

impl AgentClient {
    /// Defines a new agent and stores its definition, so that it outlives this process
    /// and every process sharing the store has it within [`DIRECTORY_REFRESH_MS`] (this
    /// one at once). `POST /v1/agents` of the server.
    ///
    /// # Errors
    /// [`DirectoryError::AgentExists`] if the agent exists (decided on the newest stored
    /// record: of two processes defining one id at once, one succeeds);
    /// [`DirectoryError::Invalid`]; [`DirectoryError::Store`].
    pub async fn define_agent(&self, spec: AgentSpec) -> Result<(), DirectoryError> {
        self.store_definition(spec, false).await
    }

    /// Replaces an existing agent's definition (its next turn uses it and keeps its
    /// history) and stores it, as [`AgentClient::define_agent`] does. `PUT
    /// /v1/agents/{id}` of the server.
    ///
    /// # Errors
    /// [`DirectoryError::NoSuchAgent`]; [`DirectoryError::Invalid`];
    /// [`DirectoryError::Store`].
    pub async fn replace_agent(&self, spec: AgentSpec) -> Result<(), DirectoryError> {
        self.store_definition(spec, true).await
    }

    /// Stores `spec` if agent `spec.id` exists (`replace`) or does not (define), as
    /// decided on the newest record.
    async fn store_definition(&self, spec: AgentSpec, replace: bool) -> Result<(), DirectoryError> {
        self.shared.directory.check_definition(&spec).await?;
        let shared = &self.shared;
        let listed = shared.directory.contains(&spec.id);
        shared
            .defined
            .change(shared, &self.runtime, |record| {
                let id = &spec.id;
                match (record.has(id, listed), replace) {
                    (true, false) => return Err(DirectoryError::AgentExists { id: id.clone() }),
                    (false, true) => return Err(DirectoryError::NoSuchAgent { id: id.clone() }),
                    _ => {}
                }
                record.removed.remove(id);
                let defined = spec.clone().defined_at(self.runtime.now().as_micros());
                record.agents.insert(id.clone(), defined);
                Ok(())
            })
            .await
    }

    /// Removes agent `agent` and stores the removal (it holds after a restart and in
    /// every process sharing the store, within [`DIRECTORY_REFRESH_MS`]): it leaves the
    /// directory (new calls to it are refused with `AgentNotFound`), then its live
    /// activation in this process, if any, is deactivated with the same handshake as
    /// idle deactivation (its running turn and already queued requests finish, then it
    /// saves and stops); another process's at its next read of the record. Its stored
    /// conversation is kept. Returns its definition, `None` if there was no such agent.
    ///
    /// # Errors
    /// [`InvokeError::StorageFailed`] (naming the record) if the removal could not be
    /// stored; [`InvokeError::Shutdown`] if the runtime stopped.
    pub async fn remove_agent(&self, agent: &str) -> Result<Option<AgentSpec>, InvokeError> {
        let shared = &self.shared;
        let local = shared.directory.get(agent);
        let removed = shared
            .defined
            .change(shared, &self.runtime, |record| {
                if !record.has(agent, local.is_some()) {
                    return Ok(None);
                }
                let spec = record.agents.remove(agent).or_else(|| local.clone());
                record.removed.insert(agent.to_string());
                Ok(spec)
            })
            .await
            .map_err(|error| InvokeError::StorageFailed {
                target: record_id(),
                source: match error {
                    DirectoryError::Store(error) => error,
                    other => StoreError::Backend {
                        operation: troupe_core::StoreOperation::Decode,
                        cause: other.to_string(),
                    },
                },
            })?;
        if removed.is_some() {
            // The record applied above removed it from the directory; the activation
            // here (if any) ends after its queued requests.
            if let Ok(id) = agent_id(agent) {
                self.runtime.deactivate(&id).await?;
                // Its stored boxes are drained by an activation that runs no model:
                // results in its outbox delivered, unworked tasks ended rejected.
                let store = self.api_store();
                if let Err(error) = self.resume_if_pending(&store, &id).await {
                    tracing::warn!(agent = %id, %error, "could not start draining a removed agent; the next resume_pending does");
                }
            }
        }
        Ok(removed)
    }

    /// Reads the stored directory now and applies it. A store down for a moment is read
    /// again for up to [`crate::AGENT_API_STORE_WAIT_MS`].
    ///
    /// # Errors
    /// [`DirectoryError::Store`], [`DirectoryError::Decode`].
    pub async fn reload_directory(&self) -> Result<(), DirectoryError> {
        self.shared
            .defined
            .refresh(&self.shared, &self.runtime, &self.api_store())
            .await
    }

    /// The directory, after reading the stored one again if this process's read is
    /// [`DIRECTORY_REFRESH_MS`] old (a failed read is logged; the directory is then as
    /// last read). For listings that should show agents defined by other processes.
    pub async fn current_directory(&self) -> &crate::AgentDirectory {
        self.shared.defined.refresh_if_stale(&self.shared, &self.runtime).await;
        &self.shared.directory
    }

    /// Whether agent `agent` exists here, after reading the stored directory again if
    /// this process's read is [`DIRECTORY_REFRESH_MS`] old (or there was none: a
    /// removal stored by an earlier run holds from the first lookup).
    pub(crate) async fn lists_agent(&self, agent: &str) -> bool {
        self.current_directory().await.contains(agent)
    }
}

/// Reads the stored directory if this process's read is [`DIRECTORY_REFRESH_MS`] old
/// (at an agent's turn: a replacement or removal made elsewhere reaches it).
pub(crate) async fn ensure_fresh(shared: &AgentShared) {
    if let Some(runtime) = shared.runtime() {
        shared.defined.refresh_if_stale(shared, &runtime).await;
    }
}

/// [`ensure_fresh`] at an agent's turn, with `now` the turn's reading of the runtime's
/// clock: a read young enough at it is kept without taking the runtime's handle or
/// reading the clock again.
pub(crate) async fn ensure_fresh_at(shared: &AgentShared, now: Deadline) {
    if shared.defined.is_fresh(now) {
        return;
    }
    ensure_fresh(shared).await;
}

impl AgentClient {
    /// Writes what `config` declares to the store, in two changes: its agents'
    /// definitions (to the stored directory: the file wins over earlier API changes to
    /// the agents it declares, a removal included) and its organisation (policy, links,
    /// memberships, rules). Agents, links and rules not declared are kept. For a system
    /// whose agents came from the same file through its builder, such as each node of a
    /// cluster (`troupe node --config`): every node may write it, and the same file
    /// gives the same records (but for the agents' definition times,
    /// [`AgentSpec::defined_at_us`]: the time of the last write, as the file's agents are
    /// defined anew at each start).
    ///
    /// # Errors
    /// [`crate::OrgError::Store`] if a record could not be written, other
    /// [`crate::OrgError`]s from a declared item.
    pub async fn store_config(&self, config: &crate::OrgConfig) -> Result<(), crate::OrgError> {
        let specs = config.agent_specs();
        let shared = &self.shared;
        let stored = shared
            .defined
            .change(shared, &self.runtime, |record| {
                // The file's agents are defined anew at each start, as built ones are.
                let now = self.runtime.now().as_micros();
                for spec in &specs {
                    record.removed.remove(&spec.id);
                    record.agents.insert(spec.id.clone(), spec.clone().defined_at(now));
                }
                Ok(())
            })
            .await;
        match stored {
            Ok(()) => {}
            Err(DirectoryError::Store(error)) => return Err(error.into()),
            Err(other) => {
                return Err(crate::OrgError::Decode {
                    cause: other.to_string(),
                })
            }
        }
        self.apply_org(config).await
    }
}
