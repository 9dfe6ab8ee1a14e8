//! Budgets along a call chain: tokens and tool calls, granted, reserved and settled.
//!
//! Deadlines shrink along a chain; so does cost. A request carries a [`Budget`] (in
//! [`crate::AgentRequest`], and in a delegated task or notification's inbox entry); the
//! turn that serves it keeps a meter:
//!
//! ```text
//! turn of A, budget B ─► before each model call: tokens left = 0? → BudgetExhausted
//!                        the request's max_tokens = tokens left (the call's cap)
//!                        after it: charge the reported usage (total_tokens)
//!                    ─► each tool call: charge one tool call; none left → the tool
//!                        result "error: ... budget ... exhausted" (the model sees it)
//!                    ─► call_agent / delegate / notify to C: grant = min(left, this
//!                        step's share), RESERVED at once (parallel siblings cannot
//!                        jointly overspend); the step's call_agents, one or more,
//!                        split equally what is left less
//!                        AGENT_CALL_PARENT_RESERVE_PERCENT; a task or a notification
//!                        gets 1/AGENT_SEND_GRANT_DIVISOR of its equal share of all
//!                        that is left; C's turn runs under the grant
//!                    ◄── C's reply reports C's spend (its own calls and its grants,
//!                        recursively): charge it, release the reservation (refund)
//! ```
//!
//! There is no shared meter across nodes, as there is no shared clock: like a deadline,
//! a grant is a value that travels with the call, and a spend is a value that travels
//! back. What a parent has charged or reserved is never granted twice, so the spend of a
//! whole chain, summed, stays within its root's budget as long as each turn keeps its
//! model calls within the cap it passes (`LlmRequest::max_tokens`) and reports what it
//! spent. When a child's spend is unknown (it failed, timed out or was cancelled), the
//! parent charges the whole grant: a model call cut in flight may still be billed up to
//! its cap, and a remote child's spend so far does not travel back without a reply. So
//! that such calls never leave their caller's turn nothing (not even the step that tells
//! its user they failed), the `call_agent`s of one step, alone or in parallel, split
//! equally what is left less [`AGENT_CALL_PARENT_RESERVE_PERCENT`]: the caller keeps
//! the rest even when every one of them fails (when only some fail, what the others did
//! not spend comes back too). A step that mixes calls with delegations or notifications
//! keeps the reserve as well (each send takes 1/`AGENT_SEND_GRANT_DIVISOR` of its equal
//! share). An in-process child cut between its model calls is charged its whole grant
//! too (its meter is its own; reading its spend so far is not built). A delegated task
//! or a notification is charged its whole grant at once (its result arrives in a later
//! turn); the result of a task comes back with what the task left, and the delegator's
//! turn that reads it runs on that.

use std::sync::Mutex;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use troupe_core::ActorId;

use crate::limits::{AGENT_ASK_TIMEOUT_MS_DEFAULT, AGENT_SEND_GRANT_DIVISOR};
use crate::{AgentCallError, AgentReply};

/// The share of what a turn has left (in percent) that the `call_agent`s of one step,
/// one or several, are NOT granted: the turn keeps it for its own next steps, and the
/// calls split the rest equally.
///
/// Why a reserve: a child whose spend is unknown (it timed out, failed or was
/// cancelled) is charged its whole grant, since a model call cut in flight may still be
/// billed up to its cap, which is what its turn had left. Calls granted everything left
/// therefore left their caller's turn nothing, not even the step that tells its user
/// they failed: a lone call (the reviewer's `budget_after_a_timed_out_call` probe:
/// `BudgetExhausted` under 2 times the run's unlimited spend, and under every budget
/// the reviewer tried up to 2.5 times), and parallel calls that all time out, which
/// until 2026-12-07 split everything left equally (`parallel_calls_that_time_out` in
/// `tests/budgets.rs`: `BudgetExhausted` "238 of 238 tokens" with two calls and "306
/// of 306" with three, under 2 times the unlimited spend, and under any budget, since
/// the whole of what was left was reserved and charged).
///
/// Why 50: the steps after a call read the caller's whole conversation again plus the
/// call's result, so each costs more than the step that made the call; in the probe,
/// what the caller spent after the timed-out call (two steps of its own and a second
/// call) came to 4.8 times its first step, and with 50 it answers from 1.87 times its
/// unlimited spend on, where with 25 it failed under every budget tried up to about 3
/// times. Parallel calls keep the same reserve, one rule for all: the step after them
/// reads every call's result, so it costs no less than after one call; with 50 the
/// boss of `parallel_calls_that_time_out` answers under 2 times its unlimited spend
/// with two and with three calls. 50 is also what a delegated task or a notification
/// keeps (`AGENT_SEND_GRANT_DIVISOR` = 2, whose grant never comes back either), so a
/// step that mixes calls and sends keeps it too. The cost: a chain of lone calls hands
/// its callee at depth d half of what its caller had left, d times over (3% at the
/// depth limit 5), and each of n parallel calls gets 1/(2n) of what is left (half what
/// an equal split of everything gave), so a budget for deep chains or wide fan-outs
/// must be larger.
pub const AGENT_CALL_PARENT_RESERVE_PERCENT: u64 = 50;

// A lone call is always granted something when anything is left.
const _: () = assert!(AGENT_CALL_PARENT_RESERVE_PERCENT < 100);
// A send keeps at least the calls' reserve (1/divisor <= (100 - reserve)%), so a step
// that mixes calls and sends keeps it too.
const _: () = assert!(AGENT_SEND_GRANT_DIVISOR * (100 - AGENT_CALL_PARENT_RESERVE_PERCENT) >= 100);

/// What a call may spend, its own model and tool calls and every call it makes
/// included. `None` is unlimited.
///
/// [`Budget::UNLIMITED`] is the default: a budget is a limit the caller chooses (a
/// token count is specific to a model and a task), and `AgentClient::ask` keeps running
/// turns as it did before budgets existed.
///
/// # Examples
/// ```
/// use troupe_agent::Budget;
/// let budget = Budget::tokens(2_000).with_tool_calls(10);
/// assert_eq!(budget.tokens, Some(2_000));
/// assert_eq!(budget.tool_calls, Some(10));
/// assert!(Budget::default().is_unlimited());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Budget {
    /// The most tokens (prompt and completion, as the model reports them) to spend.
    pub tokens: Option<u64>,
    /// The most tool calls to make (`call_agent` and the messaging tools included).
    pub tool_calls: Option<u64>,
}

impl Budget {
    /// No limit on tokens or tool calls.
    pub const UNLIMITED: Budget = Budget {
        tokens: None,
        tool_calls: None,
    };

    /// At most `tokens` tokens, any number of tool calls.
    pub fn tokens(tokens: u64) -> Self {
        Self {
            tokens: Some(tokens),
            tool_calls: None,
        }
    }

    /// This budget with at most `tool_calls` tool calls.
    #[must_use]
    pub fn with_tool_calls(mut self, tool_calls: u64) -> Self {
        self.tool_calls = Some(tool_calls);
        self
    }

    /// Whether nothing is limited.
    pub fn is_unlimited(&self) -> bool {
        self.tokens.is_none() && self.tool_calls.is_none()
    }

    /// What is left of this budget after `spent` (never negative).
    #[must_use]
    pub fn after(&self, spent: Spend) -> Budget {
        Budget {
            tokens: self.tokens.map(|limit| limit.saturating_sub(spent.tokens)),
            tool_calls: self.tool_calls.map(|limit| limit.saturating_sub(spent.tool_calls)),
        }
    }

    /// Whether `spent` stays within this budget.
    pub fn covers(&self, spent: Spend) -> bool {
        self.tokens.is_none_or(|limit| spent.tokens <= limit)
            && self.tool_calls.is_none_or(|limit| spent.tool_calls <= limit)
    }
}

/// What a call spent: its own model and tool calls, plus what it charged for the calls
/// it made (their reported spend, or their whole grant when that is unknown).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Spend {
    /// Tokens, as the model reported them (`TokenUsage::total_tokens`).
    pub tokens: u64,
    /// Tool calls.
    pub tool_calls: u64,
}

impl Spend {
    /// The sum of two spends (saturating).
    #[must_use]
    pub fn plus(self, other: Spend) -> Spend {
        Spend {
            tokens: self.tokens.saturating_add(other.tokens),
            tool_calls: self.tool_calls.saturating_add(other.tool_calls),
        }
    }

    /// All of `budget`, as a spend (unlimited parts count as nothing).
    pub fn all_of(budget: Budget) -> Spend {
        Spend {
            tokens: budget.tokens.unwrap_or(0),
            tool_calls: budget.tool_calls.unwrap_or(0),
        }
    }
}

/// Which part of a budget ran out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum BudgetResource {
    /// Tokens.
    Tokens,
    /// Tool calls.
    ToolCalls,
}

impl std::fmt::Display for BudgetResource {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(match self {
            Self::Tokens => "tokens",
            Self::ToolCalls => "tool calls",
        })
    }
}

/// A budget ran out: what was spent of which limit, by whose turn.
///
/// The model sees it as a tool result when a call it asked for is refused for want of
/// budget; the caller of `AgentClient::ask_with` sees it as
/// `AgentCallError::BudgetExhausted` when the turn it asked for runs out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[error(
    "the budget of {agent}'s turn is exhausted: {spent} of {limit} {resource} spent or reserved; \
     ask with a larger budget or do less"
)]
pub struct BudgetExhausted {
    /// The agent whose turn ran out.
    pub agent: ActorId,
    /// Which limit.
    pub resource: BudgetResource,
    /// What the turn had spent or reserved for calls in flight.
    pub spent: u64,
    /// The turn's limit (its grant).
    pub limit: u64,
}

/// How [`crate::AgentClient::ask_with`] asks: how long to wait and what the request may spend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AskOptions {
    /// How long to wait for the reply (capped at the runtime's maximum); default
    /// [`AGENT_ASK_TIMEOUT_MS_DEFAULT`].
    pub timeout: Duration,
    /// What the request may spend; default [`Budget::UNLIMITED`] (see [`Budget`]).
    pub budget: Budget,
    /// The request's trace id, set on its root call context and inherited by every call
    /// it leads to (also to remote agents); default none.
    pub trace_id: Option<troupe_core::TraceId>,
}

impl Default for AskOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_millis(AGENT_ASK_TIMEOUT_MS_DEFAULT),
            budget: Budget::UNLIMITED,
            trace_id: None,
        }
    }
}

impl AskOptions {
    /// These options with `timeout`.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// These options with trace id `trace_id` (see [`AskOptions::trace_id`]).
    #[must_use]
    pub fn traced(mut self, trace_id: troupe_core::TraceId) -> Self {
        self.trace_id = Some(trace_id);
        self
    }

    /// These options with `budget`.
    #[must_use]
    pub fn budget(mut self, budget: Budget) -> Self {
        self.budget = budget;
        self
    }
}

/// How [`crate::AgentClient::notify_with`] sends a notification from outside.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NotifyOptions {
    /// The caller's id for it (non-empty): a retry with the same id never makes a second
    /// entry. Default: an id is made for it, and a retry makes another.
    pub msg_id: Option<String>,
    /// It is processed within this many milliseconds; default and cap as for tasks
    /// ([`crate::limits::AGENT_TASK_TIMEOUT_MS_DEFAULT`]).
    pub timeout_ms: Option<u64>,
    /// The trace the turn that processes it runs under; default none.
    pub trace_id: Option<troupe_core::TraceId>,
}

impl NotifyOptions {
    /// These options with the caller's id `msg_id`.
    #[must_use]
    pub fn msg_id(mut self, msg_id: impl Into<String>) -> Self {
        self.msg_id = Some(msg_id.into());
        self
    }

    /// These options with a timeout of `timeout_ms`.
    #[must_use]
    pub fn timeout_ms(mut self, timeout_ms: u64) -> Self {
        self.timeout_ms = Some(timeout_ms);
        self
    }

    /// These options with trace id `trace_id`.
    #[must_use]
    pub fn traced(mut self, trace_id: troupe_core::TraceId) -> Self {
        self.trace_id = Some(trace_id);
        self
    }
}

/// How [`crate::AgentClient::delegate_with`] makes an agent delegate a task.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DelegateOptions {
    /// The task's deadline, this many milliseconds from now; default and cap
    /// [`crate::limits::AGENT_TASK_TIMEOUT_MS_DEFAULT`] and its maximum.
    pub timeout_ms: Option<u64>,
    /// The trace the delegation runs under: the delegating agent's turn, the task's turn
    /// and the turn that takes its result back; default none.
    pub trace_id: Option<troupe_core::TraceId>,
}

impl DelegateOptions {
    /// These options with a timeout of `timeout_ms`.
    #[must_use]
    pub fn timeout_ms(mut self, timeout_ms: u64) -> Self {
        self.timeout_ms = Some(timeout_ms);
        self
    }

    /// These options with trace id `trace_id`.
    #[must_use]
    pub fn traced(mut self, trace_id: troupe_core::TraceId) -> Self {
        self.trace_id = Some(trace_id);
        self
    }
}

#[derive(Debug, Default)]
struct MeterState {
    spent: Spend,
    /// Granted to calls in flight, not yet settled.
    reserved: Spend,
    /// The most one grant may take in the current step: the step's budget left divided
    /// by its number of calls that may grant (`None`: no split).
    share: Budget,
    /// The most one `call_agent` grant may take in the current step: what is left less
    /// [`AGENT_CALL_PARENT_RESERVE_PERCENT`], divided by the step's number of calls that
    /// may grant.
    call_share: Budget,
}

/// The meter of one turn: its limit, what it spent and what it reserved for calls in
/// flight. Shared by the turn's loop and its tool calls (behind a mutex, never held
/// across an `.await`).
#[derive(Debug)]
pub(crate) struct BudgetMeter {
    agent: ActorId,
    limit: Budget,
    state: Mutex<MeterState>,
}

impl BudgetMeter {
    pub(crate) fn new(agent: ActorId, limit: Budget) -> Self {
        Self {
            agent,
            limit,
            state: Mutex::new(MeterState::default()),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, MeterState> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The turn's limit.
    pub(crate) fn limit(&self) -> Budget {
        self.limit
    }

    /// What the turn spent so far (settled calls included, reservations not).
    pub(crate) fn spent(&self) -> Spend {
        self.state().spent
    }

    /// What is left: the limit less the spent and the reserved.
    pub(crate) fn left(&self) -> Budget {
        let state = self.state();
        self.limit.after(state.spent.plus(state.reserved))
    }

    fn exhausted(&self, resource: BudgetResource, state: &MeterState) -> BudgetExhausted {
        let (used, limit) = match resource {
            BudgetResource::Tokens => (
                state.spent.tokens.saturating_add(state.reserved.tokens),
                self.limit.tokens,
            ),
            BudgetResource::ToolCalls => (
                state.spent.tool_calls.saturating_add(state.reserved.tool_calls),
                self.limit.tool_calls,
            ),
        };
        BudgetExhausted {
            agent: self.agent.clone(),
            resource,
            spent: used,
            limit: limit.unwrap_or(u64::MAX),
        }
    }

    /// Before a model call: the most tokens it may use (`None`: unlimited).
    ///
    /// # Errors
    /// [`BudgetExhausted`] when no token is left: the call must not start.
    pub(crate) fn model_call_cap(&self) -> Result<Option<u64>, BudgetExhausted> {
        let state = self.state();
        match self.limit.after(state.spent.plus(state.reserved)).tokens {
            Some(0) => Err(self.exhausted(BudgetResource::Tokens, &state)),
            left => Ok(left),
        }
    }

    /// Charges a model call's reported tokens (all of them, even past the limit: the
    /// spend is what it is).
    ///
    /// # Errors
    /// [`BudgetExhausted`] when the charge went past the limit (a model that ignored
    /// its cap).
    pub(crate) fn charge_tokens(&self, tokens: u64) -> Result<(), BudgetExhausted> {
        let mut state = self.state();
        state.spent.tokens = state.spent.tokens.saturating_add(tokens);
        if self.limit.covers(state.spent.plus(state.reserved)) {
            Ok(())
        } else {
            Err(self.exhausted(BudgetResource::Tokens, &state))
        }
    }

    /// Charges one tool call, if one is left.
    ///
    /// # Errors
    /// [`BudgetExhausted`] when none is left; nothing is charged and the tool must not
    /// run.
    pub(crate) fn charge_tool_call(&self) -> Result<(), BudgetExhausted> {
        let mut state = self.state();
        if self.limit.after(state.spent.plus(state.reserved)).tool_calls == Some(0) {
            return Err(self.exhausted(BudgetResource::ToolCalls, &state));
        }
        state.spent.tool_calls = state.spent.tool_calls.saturating_add(1);
        Ok(())
    }

    /// Starts a step whose calls include `granting` calls that may take a grant
    /// (`call_agent`, delegations, notifications): each may take at most an equal share
    /// of what is left now, so the first of them cannot starve the others; for a
    /// `call_agent`, an equal share of what is left less
    /// [`AGENT_CALL_PARENT_RESERVE_PERCENT`], so the turn keeps the reserve even when
    /// every call is charged its whole grant.
    pub(crate) fn begin_step(&self, granting: usize) {
        let mut state = self.state();
        let left = self.limit.after(state.spent.plus(state.reserved));
        let parts = u64::try_from(granting.max(1)).unwrap_or(u64::MAX);
        state.share = Budget {
            tokens: left.tokens.map(|tokens| tokens / parts),
            tool_calls: left.tool_calls.map(|calls| calls / parts),
        };
        state.call_share = Budget {
            tokens: left.tokens.map(|tokens| less_parent_reserve(tokens) / parts),
            tool_calls: left.tool_calls.map(|calls| less_parent_reserve(calls) / parts),
        };
    }

    /// Reserves a grant for a call: at most what is left and at most this step's share.
    ///
    /// # Errors
    /// [`BudgetExhausted`] when the grant would hold no token: the call must not be
    /// sent (its turn could not call its model).
    pub(crate) fn grant(&self) -> Result<Budget, BudgetExhausted> {
        let mut state = self.state();
        let share = state.call_share;
        self.reserve_grant(&mut state, share, 1)
    }

    /// Reserves a grant for a delegated task or a notification: as [`BudgetMeter::grant`],
    /// divided by [`AGENT_SEND_GRANT_DIVISOR`] (the grant is charged whole and never comes
    /// back to this turn, so the turn keeps the rest for its own next steps).
    ///
    /// # Errors
    /// As [`BudgetMeter::grant`].
    pub(crate) fn grant_for_send(&self) -> Result<Budget, BudgetExhausted> {
        self.grant_part(AGENT_SEND_GRANT_DIVISOR)
    }

    fn grant_part(&self, divisor: u64) -> Result<Budget, BudgetExhausted> {
        let mut state = self.state();
        let share = state.share;
        self.reserve_grant(&mut state, share, divisor)
    }

    fn reserve_grant(&self, state: &mut MeterState, share: Budget, divisor: u64) -> Result<Budget, BudgetExhausted> {
        let left = self.limit.after(state.spent.plus(state.reserved));
        let grant = Budget {
            tokens: min_limit(left.tokens, share.tokens).map(|tokens| tokens / divisor),
            tool_calls: min_limit(left.tool_calls, share.tool_calls).map(|calls| calls / divisor),
        };
        if grant.tokens == Some(0) {
            return Err(self.exhausted(BudgetResource::Tokens, state));
        }
        state.reserved = state.reserved.plus(Spend::all_of(grant));
        Ok(grant)
    }

    /// Settles a grant: releases its reservation and charges what the call spent
    /// (`spent`, as reported; the whole grant when unknown). A spend past the grant (a
    /// child that ignored it) is charged as it is, so it shows in this turn's spend.
    pub(crate) fn settle(&self, grant: Budget, spent: Spend) {
        let mut state = self.state();
        let reserved = Spend::all_of(grant);
        state.reserved.tokens = state.reserved.tokens.saturating_sub(reserved.tokens);
        state.reserved.tool_calls = state.reserved.tool_calls.saturating_sub(reserved.tool_calls);
        state.spent = state.spent.plus(spent);
    }
}

/// A decoded reply as the caller sees it: an exhausted turn is an error.
pub(crate) fn reply_or_exhausted(reply: AgentReply) -> Result<AgentReply, AgentCallError> {
    match reply.exhausted {
        Some(exhausted) => Err(AgentCallError::BudgetExhausted(exhausted)),
        None => Ok(reply),
    }
}

/// Settles the grant of a call that has ended: charges the callee's reported spend
/// (the whole grant when there is no reply to read it from) and releases the rest.
pub(crate) fn settle_call(
    meter: &BudgetMeter,
    grant: Budget,
    result: Result<AgentReply, AgentCallError>,
) -> Result<AgentReply, AgentCallError> {
    let spent = result.as_ref().map_or(Spend::all_of(grant), |reply| reply.spent);
    meter.settle(grant, spent);
    result.and_then(reply_or_exhausted)
}

/// What the `call_agent`s of one step may be granted of `left`, together: all but
/// [`AGENT_CALL_PARENT_RESERVE_PERCENT`] of it (the reserve rounded down, so it never
/// refuses a lone call that one token or one tool call could serve).
fn less_parent_reserve(left: u64) -> u64 {
    let reserve = u128::from(left) * u128::from(AGENT_CALL_PARENT_RESERVE_PERCENT) / 100;
    left - u64::try_from(reserve).unwrap_or(left)
}

fn min_limit(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, None) => a,
        (None, b) => b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn new_meter(budget: Budget) -> BudgetMeter {
        BudgetMeter::new(ActorId::new("agent", "a").unwrap(), budget)
    }

    #[test]
    fn a_model_call_gets_the_tokens_left_as_its_cap_and_none_when_none_are_left() {
        let meter = new_meter(Budget::tokens(100));
        assert_eq!(meter.model_call_cap(), Ok(Some(100)));
        meter.charge_tokens(60).unwrap();
        assert_eq!(meter.model_call_cap(), Ok(Some(40)));
        meter.charge_tokens(40).unwrap();
        let refused = meter.model_call_cap().unwrap_err();
        assert_eq!(
            (refused.resource, refused.spent, refused.limit),
            (BudgetResource::Tokens, 100, 100)
        );
        assert_eq!(new_meter(Budget::UNLIMITED).model_call_cap(), Ok(None));
    }

    #[test]
    fn a_charge_past_the_limit_is_kept_and_reported() {
        let meter = new_meter(Budget::tokens(10));
        let error = meter.charge_tokens(15).unwrap_err();
        assert_eq!((error.spent, error.limit), (15, 10));
        assert_eq!(meter.spent().tokens, 15);
    }

    #[test]
    fn tool_calls_are_refused_once_the_limit_is_reached_and_not_charged() {
        let meter = new_meter(Budget::tokens(10).with_tool_calls(2));
        meter.charge_tool_call().unwrap();
        meter.charge_tool_call().unwrap();
        let refused = meter.charge_tool_call().unwrap_err();
        assert_eq!(
            (refused.resource, refused.spent, refused.limit),
            (BudgetResource::ToolCalls, 2, 2)
        );
        assert_eq!(meter.spent().tool_calls, 2);
    }

    #[test]
    fn parallel_grants_are_reserved_and_partitioned_then_refunded() {
        let meter = new_meter(Budget::tokens(100).with_tool_calls(9));
        meter.charge_tokens(10).unwrap();
        meter.begin_step(3);
        // 90 tokens and 9 tool calls left: the reserve keeps 45 and 4 (rounded down),
        // the three calls split 45 and 5.
        let grants: Vec<Budget> = (0..3).map(|_| meter.grant().unwrap()).collect();
        for grant in &grants {
            assert_eq!(*grant, Budget::tokens(15).with_tool_calls(1));
        }
        assert_eq!(meter.left(), Budget::tokens(45).with_tool_calls(6));
        // Each child reports what it spent; the rest comes back.
        meter.settle(
            grants[0],
            Spend {
                tokens: 5,
                tool_calls: 1,
            },
        );
        meter.settle(
            grants[1],
            Spend {
                tokens: 15,
                tool_calls: 0,
            },
        );
        meter.settle(grants[2], Spend::all_of(grants[2])); // unknown: the whole grant
        assert_eq!(
            meter.spent(),
            Spend {
                tokens: 45,
                tool_calls: 2
            }
        );
        assert_eq!(meter.left(), Budget::tokens(55).with_tool_calls(7));
    }

    #[test]
    fn the_calls_of_a_step_alone_or_parallel_or_mixed_with_sends_keep_the_callers_reserve() {
        let meter = new_meter(Budget::tokens(101).with_tool_calls(5));
        meter.begin_step(1);
        // 101 left: the reserve is 50 (rounded down), the call gets 51.
        assert_eq!(meter.grant().unwrap(), Budget::tokens(51).with_tool_calls(3));
        // Its spend unknown (timed out): charged whole, and the caller keeps the reserve.
        meter.settle(
            Budget::tokens(51).with_tool_calls(3),
            Spend::all_of(Budget::tokens(51).with_tool_calls(3)),
        );
        assert_eq!(meter.left(), Budget::tokens(50).with_tool_calls(2));
        // One token or tool call left is still granted (the reserve rounds down).
        let last = new_meter(Budget::tokens(1).with_tool_calls(1));
        last.begin_step(1);
        assert_eq!(last.grant().unwrap(), Budget::tokens(1).with_tool_calls(1));
        // Two and three calls in a step split what the reserve leaves; every one of
        // them charged whole (all timed out), the caller keeps the reserve.
        for (calls, each) in [(2, 25), (3, 16)] {
            let meter = new_meter(Budget::tokens(100));
            meter.begin_step(calls);
            let grants: Vec<Budget> = (0..calls).map(|_| meter.grant().unwrap()).collect();
            for grant in grants {
                assert_eq!(grant, Budget::tokens(each), "{calls} calls");
                meter.settle(grant, Spend::all_of(grant));
            }
            assert_eq!(meter.left(), Budget::tokens(100 - calls as u64 * each), "{calls} calls");
            assert!(meter.left().tokens >= Some(100 * AGENT_CALL_PARENT_RESERVE_PERCENT / 100));
        }
        // A call and a delegation in one step: the call gets half of what the reserve
        // leaves, the delegation its half of all left over the divisor; both charged
        // whole, the caller keeps the reserve.
        let meter = new_meter(Budget::tokens(100));
        meter.begin_step(2);
        let call = meter.grant().unwrap();
        let send = meter.grant_for_send().unwrap();
        assert_eq!(call, Budget::tokens(25));
        assert_eq!(send, Budget::tokens(50 / AGENT_SEND_GRANT_DIVISOR));
        meter.settle(call, Spend::all_of(call));
        meter.settle(send, Spend::all_of(send));
        assert!(meter.left().tokens >= Some(100 * AGENT_CALL_PARENT_RESERVE_PERCENT / 100));
        // A lone task keeps its own rule: its share (all left) over the divisor.
        let meter = new_meter(Budget::tokens(100));
        meter.begin_step(1);
        assert_eq!(
            meter.grant_for_send().unwrap(),
            Budget::tokens(100 / AGENT_SEND_GRANT_DIVISOR)
        );
    }

    #[test]
    fn grants_never_exceed_what_is_left_whatever_the_order() {
        // Any interleaving of grants, settles and charges keeps spent + reserved within
        // the limit as long as every child spends within its grant.
        let limit = Budget::tokens(1_000).with_tool_calls(50);
        for seed in 0..200_u64 {
            let meter = new_meter(limit);
            let mut open: Vec<Budget> = Vec::new();
            let mut x = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            for _ in 0..60 {
                x = x
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                match (x >> 33) % 5 {
                    0 => meter.begin_step(1 + ((x >> 40) % 4) as usize),
                    1 => {
                        if let Ok(grant) = meter.grant() {
                            open.push(grant);
                        }
                    }
                    2 if !open.is_empty() => {
                        let grant = open.remove(((x >> 20) as usize) % open.len());
                        let fraction = (x >> 50) % 101;
                        let spent = Spend {
                            tokens: grant.tokens.unwrap() * fraction / 100,
                            tool_calls: grant.tool_calls.unwrap() * fraction / 100,
                        };
                        meter.settle(grant, spent);
                    }
                    3 => {
                        if let Ok(Some(cap)) = meter.model_call_cap() {
                            meter.charge_tokens(cap.min((x >> 45) % 80)).unwrap();
                        }
                    }
                    _ => {
                        let _ = meter.charge_tool_call();
                    }
                }
                let state = meter.state();
                assert!(limit.covers(state.spent.plus(state.reserved)), "seed {seed}: {state:?}");
            }
        }
    }

    /// Goal: on tokio's multi-thread runtime, children racing for grants on one meter
    /// (each spending all of its grant, or a random part, and settling) never make the
    /// turn's spent plus reserved exceed its limit, and the final spend is exactly the
    /// sum the children reported.
    #[cfg(not(madsim))]
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn racing_children_never_jointly_overspend_on_the_multi_thread_runtime() {
        const CHILDREN: u64 = 64;
        const LIMIT: u64 = 10_000;
        let meter = std::sync::Arc::new(new_meter(Budget::tokens(LIMIT).with_tool_calls(CHILDREN)));
        meter.begin_step(8);
        let mut tasks = Vec::new();
        for child in 0..CHILDREN {
            let meter = std::sync::Arc::clone(&meter);
            tasks.push(tokio::spawn(async move {
                let Ok(grant) = meter.grant() else {
                    return Spend::default();
                };
                tokio::task::yield_now().await;
                {
                    let state = meter.state();
                    assert!(Budget::tokens(LIMIT).covers(state.spent.plus(state.reserved)));
                }
                let tokens = grant.tokens.unwrap() * (child % 4) / 3;
                let spent = Spend { tokens, tool_calls: 0 };
                meter.settle(grant, spent);
                spent
            }));
        }
        let mut reported = 0;
        for task in tasks {
            reported += task.await.unwrap().tokens;
        }
        assert_eq!(meter.spent().tokens, reported);
        assert!(reported <= LIMIT, "{reported} > {LIMIT}");
        assert_eq!(meter.left(), Budget::tokens(LIMIT - reported).with_tool_calls(CHILDREN));
    }
}
