//! Per-kind configuration, validated when the kind is registered.

use std::time::Duration;

use troupe_core::limits::{
    ACTOR_IDLE_TIMEOUT_MS_DEFAULT, ACTOR_IDLE_TIMEOUT_MS_MAX, ACTOR_IDLE_TIMEOUT_MS_MIN, MAILBOX_CAPACITY_DEFAULT,
    MAILBOX_CAPACITY_MAX,
};

/// A configuration value out of range; the message states the violated inequality.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The mailbox capacity is out of range.
    #[error("mailbox_capacity must satisfy 1 <= {value} <= {max}")]
    MailboxCapacity {
        /// The value given.
        value: usize,
        /// [`MAILBOX_CAPACITY_MAX`].
        max: usize,
    },
    /// The idle timeout is out of range.
    #[error("idle_timeout must satisfy {min_ms} ms <= {value_ms} ms <= {max_ms} ms")]
    IdleTimeout {
        /// The value given, in milliseconds.
        value_ms: u128,
        /// [`ACTOR_IDLE_TIMEOUT_MS_MIN`].
        min_ms: u64,
        /// [`ACTOR_IDLE_TIMEOUT_MS_MAX`].
        max_ms: u64,
    },
    /// The shutdown grace period is too long.
    #[error("shutdown_grace must satisfy {value_ms} ms <= {max_ms} ms")]
    ShutdownGrace {
        /// The value given, in milliseconds.
        value_ms: u128,
        /// [`crate::SHUTDOWN_GRACE_MS_MAX`].
        max_ms: u64,
    },
    /// The kind was registered twice.
    #[error("actor kind {kind:?} is already registered")]
    DuplicateKind {
        /// The kind.
        kind: String,
    },
}

/// How the runtime treats actors of one kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KindConfig {
    /// Messages that may wait in one actor's mailbox; one more gets `Busy`.
    pub mailbox_capacity: usize,
    /// Idle time after which an actor with nothing queued and no calls in flight is
    /// deactivated.
    pub idle_timeout: Duration,
}

impl Default for KindConfig {
    fn default() -> Self {
        Self {
            mailbox_capacity: MAILBOX_CAPACITY_DEFAULT,
            idle_timeout: Duration::from_millis(ACTOR_IDLE_TIMEOUT_MS_DEFAULT),
        }
    }
}

impl KindConfig {
    /// Sets the mailbox capacity.
    pub fn with_mailbox_capacity(mut self, capacity: usize) -> Self {
        self.mailbox_capacity = capacity;
        self
    }

    /// Sets the idle timeout.
    pub fn with_idle_timeout(mut self, timeout: Duration) -> Self {
        self.idle_timeout = timeout;
        self
    }

    /// Checks every value against its limits.
    ///
    /// # Errors
    /// The first [`ConfigError`] found.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.mailbox_capacity == 0 || self.mailbox_capacity > MAILBOX_CAPACITY_MAX {
            return Err(ConfigError::MailboxCapacity {
                value: self.mailbox_capacity,
                max: MAILBOX_CAPACITY_MAX,
            });
        }
        let range = Duration::from_millis(ACTOR_IDLE_TIMEOUT_MS_MIN)..=Duration::from_millis(ACTOR_IDLE_TIMEOUT_MS_MAX);
        if !range.contains(&self.idle_timeout) {
            return Err(ConfigError::IdleTimeout {
                value_ms: self.idle_timeout.as_millis(),
                min_ms: ACTOR_IDLE_TIMEOUT_MS_MIN,
                max_ms: ACTOR_IDLE_TIMEOUT_MS_MAX,
            });
        }
        Ok(())
    }
}
