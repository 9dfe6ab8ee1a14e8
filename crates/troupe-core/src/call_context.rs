//! The call context that travels with every invocation: depth, chain and deadline.

use serde::{Deserialize, Serialize};

use crate::{ActorId, Deadline};

/// Where an invocation sits in a tree of calls between actors.
///
/// - `depth`: 0 for a call from outside the runtime; a call made from a turn at depth
///   `d` runs at depth `d + 1`.
/// - `chain`: the actors whose turns are waiting, outermost first; the callee is not in
///   it. A call whose target is in `chain`, or is the caller itself, would deadlock a
///   non-reentrant actor and is refused by admission.
/// - `deadline`: absolute; a child's deadline is never later than its parent's.
///
/// It is plain data so it can cross a network inside a request envelope.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallContext {
    depth: u32,
    chain: Vec<ActorId>,
    deadline: Deadline,
}

impl CallContext {
    /// The context of a call from outside the runtime: depth 0, empty chain.
    pub fn root(deadline: Deadline) -> Self {
        Self {
            depth: 0,
            chain: Vec::new(),
            deadline,
        }
    }

    /// The context of a call that arrives from another process with its place in a
    /// call tree already set: `depth` and `chain` as the sender gave them (at least as
    /// deep as the chain is long), under `deadline`. For remote calls between
    /// servers (an A2A message carrying Troupe's call context): the callee's own calls
    /// then continue that chain and depth, so a cycle or a depth overflow across
    /// processes is refused like a local one.
    ///
    /// # Panics
    /// If `depth` is smaller than the chain's length (a caller bug: every actor in the
    /// chain is one call deeper).
    pub fn continued(depth: u32, chain: Vec<ActorId>, deadline: Deadline) -> Self {
        assert!(
            u32::try_from(chain.len()).is_ok_and(|length| length <= depth),
            "a chain of {} actors cannot arrive at depth {depth}",
            chain.len()
        );
        Self { depth, chain, deadline }
    }

    /// How many calls between actors lead to this one.
    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// The actors waiting on this call, outermost first.
    pub fn chain(&self) -> &[ActorId] {
        &self.chain
    }

    /// When this call must have finished.
    pub fn deadline(&self) -> Deadline {
        self.deadline
    }

    /// Whether `actor` is waiting somewhere up this call's chain.
    pub fn contains(&self, actor: &ActorId) -> bool {
        self.chain.iter().any(|waiting| waiting == actor)
    }

    /// The same depth and chain with another deadline: for a message an actor sends
    /// itself to run later (nobody waits on it, so its deadline is not clipped to this
    /// one's; see `Caller::tell`).
    pub fn with_deadline(&self, deadline: Deadline) -> Self {
        Self {
            depth: self.depth,
            chain: self.chain.clone(),
            deadline,
        }
    }

    /// Whether `self` is at least as restrictive as `base` for admission: its chain
    /// starts with `base`'s chain and it is at least as deep (deadlines aside).
    pub fn extends(&self, base: &CallContext) -> bool {
        self.depth >= base.depth && self.chain.starts_with(&base.chain)
    }

    /// The context of a call that `caller`, running under `self`, makes with `deadline`.
    ///
    /// The child's deadline is clipped to the parent's: it is the earlier of the two.
    /// This does not check admission; see [`crate::admit_call`].
    pub fn child(&self, caller: ActorId, deadline: Deadline) -> Self {
        let mut chain = Vec::with_capacity(self.chain.len() + 1);
        chain.extend(self.chain.iter().cloned());
        chain.push(caller);
        let child = Self {
            depth: self.depth.saturating_add(1),
            chain,
            deadline: self.deadline.min(deadline),
        };
        assert!(
            child.deadline <= self.deadline,
            "a child deadline grew: {child:?} > {self:?}"
        );
        child
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_continued_context_keeps_the_senders_depth_and_chain() {
        let (a, b) = (ActorId::new("agent", "a").unwrap(), ActorId::new("agent", "b").unwrap());
        let continued = CallContext::continued(3, vec![a.clone(), b.clone()], Deadline::from_micros(50));
        assert_eq!((continued.depth(), continued.chain()), (3, &[a.clone(), b][..]));
        let child = continued.child(ActorId::new("agent", "c").unwrap(), Deadline::from_micros(90));
        assert_eq!((child.depth(), child.deadline()), (4, Deadline::from_micros(50)));
        assert!(child.contains(&a));
    }

    #[test]
    #[should_panic(expected = "cannot arrive at depth 0")]
    fn a_continued_context_is_at_least_as_deep_as_its_chain() {
        let _ = CallContext::continued(0, vec![ActorId::new("agent", "a").unwrap()], Deadline::from_micros(1));
    }

    #[test]
    fn a_child_deadline_never_exceeds_its_parents() {
        let root = CallContext::root(Deadline::from_micros(100));
        let a = ActorId::new("agent", "a").unwrap();
        let child = root.child(a.clone(), Deadline::from_micros(500));
        assert_eq!(child.deadline(), Deadline::from_micros(100));
        assert_eq!(child.depth(), 1);
        assert_eq!(child.chain(), std::slice::from_ref(&a));
        let grandchild = child.child(ActorId::new("agent", "b").unwrap(), Deadline::from_micros(40));
        assert_eq!(grandchild.deadline(), Deadline::from_micros(40));
        assert!(grandchild.contains(&a));
    }
}
