//! A store that "crashes the process" at its k-th commit counted from when it is armed
//! ([`CrashStore::arm`]): that commit is applied but reported failed
//! (`StoreError::Injected`), and every later operation fails the same way (persisted but
//! not acknowledged, and nothing after). A second system started on the inner store's
//! data is the process after the crash.
//!
//! It logs every commit it applied since armed, one line each: `actor: key…`, a
//! deletion's key after `-`, each key as its [`CommitKeys`] writes it.

#![allow(dead_code)] // each test file uses part of it

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use troupe_core::ActorId;
use troupe_runtime::{Fence, StateStore, StoreError, StoreOperation, TurnCommit};

#[path = "forwarding_store.rs"]
mod forwarding_store;
use forwarding_store::{forwarding_state_store, ForwardingStore};

/// How [`CrashStore`]'s log writes a commit's keys.
#[derive(Clone, Copy)]
pub(crate) enum CommitKeys {
    /// As stored.
    AsStored,
    /// A sequence number's 20 digits without padding, and an ended task's
    /// (`task_end/`) or open task's (`task_due/`) key without the time in it, which
    /// depends on the run's timing: the same in every run of one protocol.
    Short,
}

impl CommitKeys {
    fn write(self, key: &str) -> String {
        match self {
            Self::AsStored => key.to_string(),
            Self::Short => short(key),
        }
    }
}

fn short(key: &str) -> String {
    for prefix in ["task_end/", "task_due/"] {
        if let Some(task) = key.strip_prefix(prefix).and_then(|rest| rest.split_once('/')) {
            return format!("{prefix}{}", task.1);
        }
    }
    match key.rsplit_once('/') {
        Some((prefix, seq)) if seq.len() == 20 => format!("{prefix}/{}", seq.parse::<u64>().unwrap()),
        _ => key.to_string(),
    }
}

pub(crate) struct CrashStore {
    inner: Arc<dyn StateStore>,
    keys: CommitKeys,
    /// Commits applied since armed.
    commits: AtomicU64,
    /// The commit it crashes at, counted from when armed; 0: never.
    crash_at: AtomicU64,
    crashed: AtomicBool,
    /// Every commit applied since armed.
    log: Mutex<Vec<String>>,
}

impl CrashStore {
    /// Over `inner`, its log writing keys as `keys`; never crashes until armed.
    pub(crate) fn new(inner: Arc<dyn StateStore>, keys: CommitKeys) -> Self {
        Self {
            inner,
            keys,
            commits: AtomicU64::new(0),
            crash_at: AtomicU64::new(0),
            crashed: AtomicBool::new(false),
            log: Mutex::new(Vec::new()),
        }
    }

    /// Counts commits from now, the log emptied; crashes at the `crash_at`-th (0: never).
    pub(crate) fn arm(&self, crash_at: u64) {
        self.commits.store(0, Ordering::SeqCst);
        self.log.lock().unwrap().clear();
        self.crash_at.store(crash_at, Ordering::SeqCst);
    }

    /// Whether it has crashed.
    pub(crate) fn crashed(&self) -> bool {
        self.crashed.load(Ordering::SeqCst)
    }

    /// The commits applied since armed, in order.
    pub(crate) fn log(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }
}

#[async_trait]
impl ForwardingStore for CrashStore {
    type Inner = dyn StateStore;

    fn inner(&self) -> &Self::Inner {
        &*self.inner
    }

    fn gate(&self, _actor: &ActorId, operation: StoreOperation) -> Result<(), StoreError> {
        if self.crashed() {
            return Err(StoreError::Injected { operation });
        }
        Ok(())
    }

    async fn forward_commit(&self, actor: &ActorId, fence: Fence, commit: TurnCommit) -> Result<(), StoreError> {
        self.gate(actor, StoreOperation::Commit)?;
        let keys: Vec<String> = commit
            .writes
            .iter()
            .map(|(key, value)| format!("{}{}", if value.is_some() { "" } else { "-" }, self.keys.write(key)))
            .collect();
        let record = format!("{}: {}", actor.key(), keys.join(" "));
        self.inner.commit(actor, fence, commit).await?;
        self.log.lock().unwrap().push(record);
        let n = self.commits.fetch_add(1, Ordering::SeqCst) + 1;
        if n == self.crash_at.load(Ordering::SeqCst) {
            self.crashed.store(true, Ordering::SeqCst);
            return Err(StoreError::Injected {
                operation: StoreOperation::Commit,
            });
        }
        Ok(())
    }
}

forwarding_state_store!(CrashStore);
