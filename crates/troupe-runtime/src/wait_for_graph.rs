//! The wait-for graph: which actor's turn is blocked on which actor.
//!
//! An edge `caller → target` exists from the moment a call made inside `caller`'s turn
//! is sent (the caller's task adds it, under the graph's lock, before the message is put
//! anywhere) until the call ends: whoever answers it removes the edge before replying
//! (the callee, or the dispatcher when it refuses the call), and a caller that stops
//! waiting without a reply (timeout, cancellation) removes it itself. Actors are
//! non-reentrant, so a cycle in this graph is a deadlock that only deadlines would
//! break. [`WaitForGraph::try_add`] refuses an edge that would close a cycle and returns
//! the cycle; the graph therefore stays acyclic (WaitForGraphAcyclic in
//! `docs/tla/MultiAgentInvocation.tla`): the check and the insert are one critical
//! section, as they were one step of the dispatcher's loop when it owned the graph.
//!
//! This catches what the call chain cannot: two independent requests where A waits on B
//! while B waits on A. Edges are keyed by call id, so several concurrent calls between
//! the same pair are counted separately and released exactly.

use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::fast_hash::{FastMap, FastSet};

use troupe_core::limits::WAIT_FOR_EDGES_MAX;
use troupe_core::ActorId;

/// A unique id of one call between actors.
pub(crate) type CallId = u64;

/// Why an edge was not added.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum EdgeRefused {
    /// The edge would close this cycle (caller first and last).
    Cycle(Vec<ActorId>),
    /// The graph holds [`WAIT_FOR_EDGES_MAX`] edges.
    Full,
}

/// The runtime's one wait-for graph, shared by the tasks that add and remove edges (a
/// turn's calls, the activations that answer them, the dispatcher's refusals, the
/// cluster layer's remote waits). Each critical section is a lookup or two and, for an
/// added edge, the search for a path back: short, and never held across an `.await`.
/// Lock order: this lock is taken alone (no other lock of the runtime is taken while
/// it is held, nor is it taken under one).
#[derive(Debug, Default)]
pub(crate) struct SharedWaits(Mutex<WaitForGraph>);

impl SharedWaits {
    pub(crate) fn lock(&self) -> MutexGuard<'_, WaitForGraph> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Removes `call`'s edge, if it is there (a call id not in the graph is ignored:
    /// both ends of a call may remove it).
    pub(crate) fn remove(&self, call: CallId) {
        self.lock().remove(call);
    }
}

/// The blocked-on relation between actors, with multiplicities. Its tables hash with
/// FxHash (`fast_hash.rs`): every nested call adds an edge and removes it, which cost
/// about 1,000 instructions of a `call_agent` round trip with SipHash (callgrind,
/// 2026-11-28), and the search's order, hence the cycle reported, is the same in every
/// process.
#[derive(Debug, Default)]
pub(crate) struct WaitForGraph {
    /// Each live call: who waits on whom.
    calls: FastMap<CallId, (ActorId, ActorId)>,
    /// Out-edges with the number of calls behind each.
    out_edges: FastMap<ActorId, Targets>,
    /// The live calls whose target runs on another node.
    remote: FastSet<CallId>,
}

impl WaitForGraph {
    /// Number of live calls (edges counted with multiplicity).
    pub(crate) fn len(&self) -> usize {
        self.calls.len()
    }

    /// Whether `actor` waits on anyone.
    pub(crate) fn is_waiting(&self, actor: &ActorId) -> bool {
        self.out_edges.contains_key(actor)
    }

    /// Adds `caller → target` for `call`, unless it would close a cycle.
    pub(crate) fn try_add(&mut self, call: CallId, caller: &ActorId, target: &ActorId) -> Result<(), EdgeRefused> {
        assert!(!self.calls.contains_key(&call), "call id {call} added twice");
        if let Some(path) = self.path(target, caller) {
            let mut cycle = Vec::with_capacity(path.len() + 1);
            cycle.push(caller.clone());
            cycle.extend(path);
            return Err(EdgeRefused::Cycle(cycle));
        }
        if self.calls.len() >= WAIT_FOR_EDGES_MAX {
            return Err(EdgeRefused::Full);
        }
        self.calls.insert(call, (caller.clone(), target.clone()));
        match self.out_edges.get_mut(caller) {
            Some(targets) => targets.add(target),
            None => {
                self.out_edges.insert(caller.clone(), Targets::One(target.clone(), 1));
            }
        }
        Ok(())
    }

    /// Adds `caller → target` for `call`, a call to another node, unless it would close
    /// a cycle of this graph.
    pub(crate) fn try_add_remote(
        &mut self,
        call: CallId,
        caller: &ActorId,
        target: &ActorId,
    ) -> Result<(), EdgeRefused> {
        self.try_add(call, caller, target)?;
        self.remote.insert(call);
        Ok(())
    }

    /// Whether any live edge points to another node.
    pub(crate) fn has_remote(&self) -> bool {
        !self.remote.is_empty()
    }

    /// The edges whose waiter is `actor`.
    pub(crate) fn edges_of(&self, actor: &ActorId) -> Vec<crate::WaitEdge> {
        if !self.out_edges.contains_key(actor) {
            return Vec::new();
        }
        let mut edges: Vec<crate::WaitEdge> = self
            .calls
            .iter()
            .filter(|(_, (waiter, _))| waiter == actor)
            .map(|(call, (waiter, target))| crate::WaitEdge {
                waiter: waiter.clone(),
                call: *call,
                target: target.clone(),
                remote: self.remote.contains(call),
            })
            .collect();
        edges.sort_by_key(|edge| edge.call);
        edges
    }

    /// The remote edges whose waiter is `from` or an actor `from` waits on, directly or
    /// not.
    pub(crate) fn remote_edges_reachable(&self, from: &ActorId) -> Vec<crate::WaitEdge> {
        let mut seen: FastSet<&ActorId> = FastSet::default();
        seen.insert(from);
        let mut stack = vec![from];
        while let Some(node) = stack.pop() {
            if let Some(targets) = self.out_edges.get(node) {
                for next in targets.keys() {
                    if seen.insert(next) {
                        stack.push(next);
                    }
                }
            }
        }
        let mut edges: Vec<crate::WaitEdge> = self
            .remote
            .iter()
            .filter_map(|call| {
                let (waiter, target) = self.calls.get(call)?;
                seen.contains(waiter).then(|| crate::WaitEdge {
                    waiter: waiter.clone(),
                    call: *call,
                    target: target.clone(),
                    remote: true,
                })
            })
            .collect();
        edges.sort_by_key(|edge| edge.call);
        edges
    }

    /// Removes the edge of `call`; a call that was never added (refused, or routed after
    /// its caller gave up) is ignored.
    pub(crate) fn remove(&mut self, call: CallId) {
        let Some((caller, target)) = self.calls.remove(&call) else {
            return;
        };
        self.remote.remove(&call);
        let targets = self.out_edges.get_mut(&caller).expect("an edge without out-edges");
        if targets.remove(&target) {
            self.out_edges.remove(&caller);
        }
    }

    /// A path `from → … → to` (both ends included), or `None`. A path from an actor to
    /// itself is the one-element path: a self-call is a cycle.
    fn path(&self, from: &ActorId, to: &ActorId) -> Option<Vec<ActorId>> {
        if from == to {
            return Some(vec![from.clone()]);
        }
        // The usual call: its target waits on nobody, so no path leaves it (and no search
        // allocates its stack).
        if !self.out_edges.contains_key(from) {
            return None;
        }
        // Depth-first search with parent links; the graph holds only blocked actors, so
        // it is small compared with the activation table.
        let mut parent: FastMap<&ActorId, &ActorId> = FastMap::default();
        let mut stack = vec![from];
        while let Some(node) = stack.pop() {
            let Some(targets) = self.out_edges.get(node) else {
                continue;
            };
            for next in targets.keys() {
                if next == from || parent.contains_key(next) {
                    continue;
                }
                parent.insert(next, node);
                if next == to {
                    let mut path = vec![to.clone()];
                    let mut current = to;
                    while let Some(previous) = parent.get(current) {
                        path.push((*previous).clone());
                        current = previous;
                    }
                    path.reverse();
                    return Some(path);
                }
                stack.push(next);
            }
        }
        None
    }

    /// Whether the graph has a cycle (for tests and invariant checks).
    #[cfg(test)]
    pub(crate) fn has_cycle(&self) -> bool {
        self.out_edges.keys().any(|actor| {
            self.out_edges[actor]
                .keys()
                .any(|next| self.path(next, actor).is_some())
        })
    }
}

/// The actors one actor's calls wait on, with the number of calls behind each: the usual
/// one target inline, a map only for a turn that waits on several (calls from tasks it
/// spawned). A map per waiting actor was an allocation and a free per call from a turn
/// (about 250 instructions of a `call_agent` round trip, callgrind, 2026-12-01).
#[derive(Debug)]
enum Targets {
    One(ActorId, u32),
    Many(FastMap<ActorId, u32>),
}

impl Targets {
    /// One more call to `target`.
    fn add(&mut self, target: &ActorId) {
        match self {
            Targets::One(only, count) if only == target => *count += 1,
            Targets::One(only, count) => {
                let mut many = FastMap::default();
                many.insert(only.clone(), *count);
                many.insert(target.clone(), 1);
                *self = Targets::Many(many);
            }
            Targets::Many(many) => *many.entry(target.clone()).or_insert(0) += 1,
        }
    }

    /// One call fewer to `target`, which has at least one; whether none is left to any.
    fn remove(&mut self, target: &ActorId) -> bool {
        match self {
            Targets::One(only, count) => {
                assert!(only == target && *count >= 1, "an edge without a count");
                *count -= 1;
                *count == 0
            }
            Targets::Many(many) => {
                let count = many.get_mut(target).expect("an edge without a count");
                assert!(*count >= 1);
                *count -= 1;
                if *count == 0 {
                    many.remove(target);
                }
                many.is_empty()
            }
        }
    }

    /// The actors waited on.
    fn keys(&self) -> impl Iterator<Item = &ActorId> {
        let (one, many) = match self {
            Targets::One(only, _) => (Some(only), None),
            Targets::Many(many) => (None, Some(many.keys())),
        };
        one.into_iter().chain(many.into_iter().flatten())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn actor(key: &str) -> ActorId {
        ActorId::new("test", key).unwrap()
    }

    #[test]
    fn an_edge_closing_a_cycle_is_refused_with_the_cycle() {
        let (a, b, c) = (actor("a"), actor("b"), actor("c"));
        let mut graph = WaitForGraph::default();
        graph.try_add(1, &a, &b).unwrap();
        graph.try_add(2, &b, &c).unwrap();
        assert_eq!(
            graph.try_add(3, &c, &a),
            Err(EdgeRefused::Cycle(vec![c.clone(), a.clone(), b.clone(), c.clone()]))
        );
        assert_eq!(
            graph.try_add(4, &a, &a),
            Err(EdgeRefused::Cycle(vec![a.clone(), a.clone()]))
        );
        assert!(!graph.has_cycle());
        graph.remove(2);
        graph.try_add(5, &c, &a).unwrap();
        assert!(graph.is_waiting(&c));
        assert_eq!(graph.len(), 2);
    }

    #[test]
    fn parallel_calls_between_one_pair_are_released_one_by_one() {
        let (a, b) = (actor("a"), actor("b"));
        let mut graph = WaitForGraph::default();
        graph.try_add(1, &a, &b).unwrap();
        graph.try_add(2, &a, &b).unwrap();
        graph.remove(1);
        assert!(matches!(graph.try_add(3, &b, &a), Err(EdgeRefused::Cycle(_))));
        graph.remove(2);
        graph.remove(2);
        assert!(!graph.is_waiting(&a));
        graph.try_add(3, &b, &a).unwrap();
    }

    /// Goal: an actor that waits on several targets (its one target inline, then a map)
    /// keeps each edge, with its count, until its last call to it is released, and
    /// cycles through any of them are found. Method: add and remove calls in an order
    /// that goes from one target to three and back, checking cycles and waiting.
    #[test]
    fn an_actor_waiting_on_several_targets_keeps_each_until_its_last_call() {
        let (a, b, c, d) = (actor("a"), actor("b"), actor("c"), actor("d"));
        let mut graph = WaitForGraph::default();
        graph.try_add(1, &a, &b).unwrap();
        graph.try_add(2, &a, &c).unwrap();
        graph.try_add(3, &a, &c).unwrap();
        graph.try_add(4, &a, &d).unwrap();
        for target in [&b, &c, &d] {
            assert!(
                matches!(graph.try_add(9, target, &a), Err(EdgeRefused::Cycle(_))),
                "{target}"
            );
        }
        graph.remove(1);
        graph.try_add(5, &b, &a).unwrap();
        graph.remove(5);
        graph.remove(2);
        assert!(
            matches!(graph.try_add(9, &c, &a), Err(EdgeRefused::Cycle(_))),
            "one call to c left"
        );
        graph.remove(3);
        assert!(graph.is_waiting(&a), "still on d");
        graph.try_add(6, &c, &a).unwrap();
        graph.remove(6);
        graph.remove(4);
        assert!(!graph.is_waiting(&a));
        assert_eq!(graph.len(), 0);
        assert!(!graph.has_cycle());
    }
}
