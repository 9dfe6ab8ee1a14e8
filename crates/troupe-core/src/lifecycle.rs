//! The activation lifecycle of one actor, as an explicit transition table.
//!
//! ```text
//!            Activate            Activated            Deactivate
//! Inactive ───────────► Activating ─────────► Active ───────────► Deactivating
//!    ▲                      │                                         │
//!    │   ActivationFailed   │                 Deactivated             │
//!    └──────────────────────┴─────────────────────────────────────────┘
//! ```
//!
//! `Crashed` (a panic in the actor's task) leads from any live state to `Inactive`.
//!
//! The dispatcher holds one [`Lifecycle`] per actor id and applies every event through
//! [`Lifecycle::apply`], which panics on an illegal transition: an illegal transition is
//! a bug in the runtime, never an operating error. This is the state machine of
//! `docs/tla/ActorLifecycle.tla` (SingleActivation: a new activation starts only from
//! `Inactive`, so never while the previous one is still deactivating).

use std::fmt;

/// Where an actor is in its lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LifecycleState {
    /// No task runs for the actor; its state, if any, is in the store.
    Inactive,
    /// Its task is loading state and running `on_activate`; messages queue in its mailbox.
    Activating,
    /// Its task is taking turns.
    Active,
    /// Its mailbox is closed; its task is running `on_deactivate` and saving state.
    Deactivating,
}

/// What happened to an actor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LifecycleEvent {
    /// A message arrived for an inactive actor; its task is spawned.
    Activate,
    /// State loaded and `on_activate` returned.
    Activated,
    /// Loading state or `on_activate` failed; the task has ended.
    ActivationFailed,
    /// The actor was idle with nothing queued and no calls in flight; its mailbox closes.
    Deactivate,
    /// `on_deactivate` ran and the task has ended.
    Deactivated,
    /// The actor's task ended abnormally (a panic, or its state could not be restored
    /// after a failed turn); whatever it had not committed is gone.
    Crashed,
}

/// An illegal transition: the event cannot happen in that state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("illegal lifecycle transition: {event:?} in state {state:?}")]
pub struct IllegalTransition {
    /// The state the actor was in.
    pub state: LifecycleState,
    /// The event that cannot happen there.
    pub event: LifecycleEvent,
}

/// One actor's lifecycle state with its legal transitions.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Lifecycle {
    state: LifecycleState,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Self {
            state: LifecycleState::Inactive,
        }
    }
}

impl Lifecycle {
    /// The transition table: the state after `event` in `state`, or `None` if illegal.
    pub const fn next(state: LifecycleState, event: LifecycleEvent) -> Option<LifecycleState> {
        use LifecycleEvent as E;
        use LifecycleState as S;
        match (state, event) {
            (S::Inactive, E::Activate) => Some(S::Activating),
            (S::Activating, E::Activated) => Some(S::Active),
            (S::Activating, E::ActivationFailed) => Some(S::Inactive),
            (S::Active, E::Deactivate) => Some(S::Deactivating),
            (S::Deactivating, E::Deactivated) => Some(S::Inactive),
            (S::Activating | S::Active | S::Deactivating, E::Crashed) => Some(S::Inactive),
            _ => None,
        }
    }

    /// The current state.
    pub fn state(&self) -> LifecycleState {
        self.state
    }

    /// Applies `event`, or says why it is illegal without changing anything.
    ///
    /// # Errors
    /// [`IllegalTransition`] if the table has no entry for the current state and `event`.
    pub fn try_apply(&mut self, event: LifecycleEvent) -> Result<LifecycleState, IllegalTransition> {
        let next = Self::next(self.state, event).ok_or(IllegalTransition {
            state: self.state,
            event,
        })?;
        self.state = next;
        Ok(next)
    }

    /// Applies `event`.
    ///
    /// # Panics
    /// On an illegal transition: that is a bug in the runtime.
    pub fn apply(&mut self, event: LifecycleEvent) -> LifecycleState {
        match self.try_apply(event) {
            Ok(next) => next,
            Err(illegal) => panic!("{illegal}"),
        }
    }
}

impl fmt::Debug for Lifecycle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Lifecycle({:?})", self.state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use LifecycleEvent as E;
    use LifecycleState as S;

    const STATES: [S; 4] = [S::Inactive, S::Activating, S::Active, S::Deactivating];
    const EVENTS: [E; 6] = [
        E::Activate,
        E::Activated,
        E::ActivationFailed,
        E::Deactivate,
        E::Deactivated,
        E::Crashed,
    ];

    #[test]
    fn exactly_eight_transitions_are_legal() {
        let legal: usize = STATES
            .iter()
            .map(|s| EVENTS.iter().filter(|e| Lifecycle::next(*s, **e).is_some()).count())
            .sum();
        assert_eq!(legal, 8);
    }

    #[test]
    fn an_actor_cannot_be_activated_while_it_is_deactivating() {
        let mut lifecycle = Lifecycle::default();
        lifecycle.apply(E::Activate);
        lifecycle.apply(E::Activated);
        lifecycle.apply(E::Deactivate);
        assert_eq!(
            lifecycle.try_apply(E::Activate),
            Err(IllegalTransition {
                state: S::Deactivating,
                event: E::Activate
            })
        );
        assert_eq!(lifecycle.state(), S::Deactivating);
        assert_eq!(lifecycle.apply(E::Deactivated), S::Inactive);
    }

    #[test]
    #[should_panic(expected = "illegal lifecycle transition")]
    fn an_illegal_transition_panics() {
        Lifecycle::default().apply(E::Deactivate);
    }
}
