//! Admission of a call from one actor to another: the pure decision, no I/O.
//!
//! Checks, in this order, and the first that fails refuses the call before anything is
//! queued anywhere:
//!
//! 1. the target is the caller or waits somewhere up the chain → [`CallRefused::CycleDetected`]
//!    with the whole chain (a non-reentrant actor would wait on itself);
//! 2. the caller's depth is at least [`AGENT_CALL_DEPTH_MAX`] → [`CallRefused::DepthExceeded`];
//! 3. the target is unknown → [`CallRefused::AgentNotFound`];
//! 4. the caller already has [`AGENT_CONCURRENT_CALLS_MAX`] calls in flight →
//!    [`CallRefused::TooManyCalls`];
//! 5. a requested timeout of zero → [`CallRefused::InvalidTimeout`]; the caller's own
//!    deadline has passed → [`CallRefused::DeadlineExpired`].
//!
//! The timeout is the requested one (default [`AGENT_CALL_TIMEOUT_MS_DEFAULT`], capped
//! at [`AGENT_CALL_TIMEOUT_MS_MAX`]), then clipped to the caller's remaining deadline.
//!
//! Implements NoCycleInCallChain, DepthBounded and DeadlineMonotone of
//! `docs/tla/MultiAgentInvocation.tla`.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::limits::{
    AGENT_CALL_DEPTH_MAX, AGENT_CALL_TIMEOUT_MS_DEFAULT, AGENT_CALL_TIMEOUT_MS_MAX, AGENT_CONCURRENT_CALLS_MAX,
};
use crate::{ActorId, CallContext, Deadline};

/// Everything admission looks at.
#[derive(Debug, Clone, Copy)]
pub struct AdmissionRequest<'a> {
    /// The actor making the call.
    pub caller: &'a ActorId,
    /// The context of the caller's current turn.
    pub context: &'a CallContext,
    /// The actor being called.
    pub target: &'a ActorId,
    /// Whether the target exists (a registry knows it).
    pub target_known: bool,
    /// Calls the caller has in flight now, this one not counted.
    pub calls_in_flight: u32,
    /// The timeout the caller asked for, in milliseconds; `None` means the default.
    pub requested_timeout_ms: Option<u64>,
    /// The current time on the runtime's clock.
    pub now: Deadline,
}

/// An admitted call: the context the callee runs under and the time the caller waits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallAdmitted {
    /// Depth + 1, chain + caller, clipped deadline.
    pub child: CallContext,
    /// How long the caller waits: `child.deadline() - now`.
    pub timeout: Duration,
}

/// Why a call was refused. Each variant reads well as a tool result for an LLM.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum CallRefused {
    /// The target already waits in the chain (or is the caller): the call would deadlock.
    #[error(
        "cycle detected: {} (an agent in a call chain cannot be called again until it answers)",
        display_chain(chain)
    )]
    CycleDetected {
        /// The chain with the caller and the repeated target appended.
        chain: Vec<ActorId>,
    },
    /// The call would be deeper than the limit.
    #[error("call depth {depth} has reached the limit of {max}: this agent may not call further agents")]
    DepthExceeded {
        /// The caller's depth.
        depth: u32,
        /// [`AGENT_CALL_DEPTH_MAX`].
        max: u32,
    },
    /// No such agent.
    #[error("agent {target} not found")]
    AgentNotFound {
        /// The unknown target.
        target: ActorId,
    },
    /// The caller has too many calls in flight.
    #[error("too many calls in flight: {in_flight} already, the limit is {max}")]
    TooManyCalls {
        /// Calls already in flight.
        in_flight: u32,
        /// [`AGENT_CONCURRENT_CALLS_MAX`].
        max: u32,
    },
    /// A timeout of zero was asked for.
    #[error("timeout_ms must be at least 1, got {requested_ms}")]
    InvalidTimeout {
        /// The requested timeout.
        requested_ms: u64,
    },
    /// The caller's own deadline has passed: there is no time left to call anyone.
    #[error("the caller's deadline has passed; no time is left for a call")]
    DeadlineExpired,
    /// The turn the call was made from has already ended (a task it spawned outlived
    /// it): calls belong to a running turn.
    #[error("the calling turn of {caller} has ended; a call must be made while its turn runs")]
    CallerTurnEnded {
        /// The actor whose turn ended.
        caller: ActorId,
    },
    /// A root invocation (`RuntimeHandle::invoke`, `AgentClient::ask`, through a handle
    /// captured by the actor or tool) was made from inside a turn: it would skip the
    /// chain, depth, wait-for graph and deadline checks, so a deadlock through it could
    /// only end at a timeout.
    #[error(
        "a root invocation from inside an actor's turn is refused: call through the turn's caller \
         (call_agent, Turn::invoke, Caller::call, ActorRef::ask_from), or use Caller::invoke_as_root for \
         independent work"
    )]
    RootInvokeInsideTurn,
    /// The runtime is shutting down and admits no new calls.
    #[error("the runtime is shutting down")]
    ShuttingDown,
}

/// Decides whether a call may go ahead; see the module documentation for the rules.
///
/// # Errors
/// The first [`CallRefused`] rule that the request breaks.
pub fn admit_call(request: AdmissionRequest<'_>) -> Result<CallAdmitted, CallRefused> {
    let AdmissionRequest {
        caller,
        context,
        target,
        target_known,
        calls_in_flight,
        requested_timeout_ms,
        now,
    } = request;
    if target == caller || context.contains(target) {
        let mut chain = context.chain().to_vec();
        chain.push(caller.clone());
        chain.push(target.clone());
        return Err(CallRefused::CycleDetected { chain });
    }
    if context.depth() >= AGENT_CALL_DEPTH_MAX {
        return Err(CallRefused::DepthExceeded {
            depth: context.depth(),
            max: AGENT_CALL_DEPTH_MAX,
        });
    }
    if !target_known {
        return Err(CallRefused::AgentNotFound { target: target.clone() });
    }
    if calls_in_flight >= AGENT_CONCURRENT_CALLS_MAX {
        return Err(CallRefused::TooManyCalls {
            in_flight: calls_in_flight,
            max: AGENT_CONCURRENT_CALLS_MAX,
        });
    }
    let requested_ms = requested_timeout_ms.unwrap_or(AGENT_CALL_TIMEOUT_MS_DEFAULT);
    if requested_ms == 0 {
        return Err(CallRefused::InvalidTimeout { requested_ms });
    }
    if context.deadline().has_passed(now) {
        return Err(CallRefused::DeadlineExpired);
    }
    let capped = Duration::from_millis(requested_ms.min(AGENT_CALL_TIMEOUT_MS_MAX));
    let child = context.child(caller.clone(), Deadline::after(now, capped));
    let timeout = child.deadline().remaining(now);
    assert!(timeout <= capped, "timeout {timeout:?} exceeds the cap {capped:?}");
    assert!(child.deadline() <= context.deadline());
    assert!(child.depth() <= AGENT_CALL_DEPTH_MAX);
    Ok(CallAdmitted { child, timeout })
}

fn display_chain(chain: &[ActorId]) -> String {
    chain.iter().map(ToString::to_string).collect::<Vec<_>>().join(" -> ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn agent(key: &str) -> ActorId {
        ActorId::new("agent", key).unwrap()
    }

    fn request<'a>(caller: &'a ActorId, context: &'a CallContext, target: &'a ActorId) -> AdmissionRequest<'a> {
        AdmissionRequest {
            caller,
            context,
            target,
            target_known: true,
            calls_in_flight: 0,
            requested_timeout_ms: None,
            now: Deadline::from_micros(0),
        }
    }

    const HOUR_US: u64 = 3_600_000_000;

    #[test]
    fn a_call_back_up_the_chain_is_refused_with_the_whole_chain() {
        let (a, b) = (agent("a"), agent("b"));
        let context =
            CallContext::root(Deadline::from_micros(HOUR_US)).child(a.clone(), Deadline::from_micros(HOUR_US));
        let refused = admit_call(request(&b, &context, &a)).unwrap_err();
        assert_eq!(
            refused,
            CallRefused::CycleDetected {
                chain: vec![a.clone(), b.clone(), a]
            }
        );
        assert!(refused
            .to_string()
            .starts_with("cycle detected: agent/a -> agent/b -> agent/a"));
    }

    #[test]
    fn a_self_call_is_a_cycle() {
        let a = agent("a");
        let context = CallContext::root(Deadline::from_micros(HOUR_US));
        assert_eq!(
            admit_call(request(&a, &context, &a)),
            Err(CallRefused::CycleDetected {
                chain: vec![a.clone(), a]
            })
        );
    }

    #[test]
    fn five_hops_are_admitted_and_the_sixth_is_refused() {
        let agents: Vec<ActorId> = (0..7).map(|i| agent(&format!("a{i}"))).collect();
        let mut context = CallContext::root(Deadline::from_micros(HOUR_US));
        for hop in 0..5 {
            let admitted = admit_call(request(&agents[hop], &context, &agents[hop + 1])).unwrap();
            context = admitted.child;
        }
        assert_eq!(context.depth(), 5);
        assert_eq!(
            admit_call(request(&agents[5], &context, &agents[6])),
            Err(CallRefused::DepthExceeded {
                depth: 5,
                max: AGENT_CALL_DEPTH_MAX
            })
        );
    }

    #[test]
    fn unknown_targets_too_many_calls_zero_timeouts_and_expired_deadlines_are_refused() {
        let (a, b) = (agent("a"), agent("b"));
        let context = CallContext::root(Deadline::from_micros(1_000));
        let mut unknown = request(&a, &context, &b);
        unknown.target_known = false;
        assert_eq!(
            admit_call(unknown),
            Err(CallRefused::AgentNotFound { target: b.clone() })
        );
        let mut busy = request(&a, &context, &b);
        busy.calls_in_flight = AGENT_CONCURRENT_CALLS_MAX;
        assert_eq!(
            admit_call(busy),
            Err(CallRefused::TooManyCalls { in_flight: 10, max: 10 })
        );
        let mut zero = request(&a, &context, &b);
        zero.requested_timeout_ms = Some(0);
        assert_eq!(admit_call(zero), Err(CallRefused::InvalidTimeout { requested_ms: 0 }));
        let mut late = request(&a, &context, &b);
        late.now = Deadline::from_micros(1_000);
        assert_eq!(admit_call(late), Err(CallRefused::DeadlineExpired));
    }

    #[test]
    fn the_timeout_defaults_to_30_s_caps_at_300_s_and_clips_to_the_parent() {
        let (a, b) = (agent("a"), agent("b"));
        let long = CallContext::root(Deadline::from_micros(HOUR_US));
        let default = admit_call(request(&a, &long, &b)).unwrap();
        assert_eq!(default.timeout, Duration::from_millis(AGENT_CALL_TIMEOUT_MS_DEFAULT));
        let mut huge = request(&a, &long, &b);
        huge.requested_timeout_ms = Some(10_000_000);
        assert_eq!(
            admit_call(huge).unwrap().timeout,
            Duration::from_millis(AGENT_CALL_TIMEOUT_MS_MAX)
        );
        let short = CallContext::root(Deadline::from_micros(2_000_000));
        let clipped = admit_call(request(&a, &short, &b)).unwrap();
        assert_eq!(clipped.timeout, Duration::from_secs(2));
        assert_eq!(clipped.child.deadline(), short.deadline());
    }

    proptest! {
        /// Over random chains and targets: admitted calls never exceed the depth limit,
        /// never put an actor twice in a chain, and never outlive the parent's deadline.
        #[test]
        fn admitted_calls_keep_depth_chain_and_deadline_invariants(
            path in proptest::collection::vec(0u8..8, 1..12),
            deadline_ms in 1u64..400_000,
            requested in proptest::option::of(0u64..1_000_000),
            now_ms in 0u64..400_000,
        ) {
            let now = Deadline::from_micros(now_ms * 1_000);
            let mut context = CallContext::root(Deadline::from_micros(deadline_ms * 1_000));
            let mut caller = agent(&format!("a{}", path[0]));
            for step in &path[1..] {
                let target = agent(&format!("a{step}"));
                let mut req = request(&caller, &context, &target);
                req.requested_timeout_ms = requested;
                req.now = now;
                match admit_call(req) {
                    Ok(admitted) => {
                        prop_assert!(admitted.child.depth() <= AGENT_CALL_DEPTH_MAX);
                        prop_assert!(admitted.child.deadline() <= context.deadline());
                        let mut seen = admitted.child.chain().to_vec();
                        seen.push(target.clone());
                        let mut unique = seen.clone();
                        unique.sort();
                        unique.dedup();
                        prop_assert_eq!(unique.len(), seen.len());
                        context = admitted.child;
                        caller = target;
                    }
                    Err(CallRefused::CycleDetected { chain }) => {
                        prop_assert_eq!(chain.last(), Some(&target));
                        prop_assert!(context.contains(&target) || target == caller);
                        break;
                    }
                    Err(_) => break,
                }
            }
        }
    }
}
