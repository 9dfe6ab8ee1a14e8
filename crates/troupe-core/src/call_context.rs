//! The call context that travels with every invocation: depth, chain, deadline and an
//! optional trace id.

use std::sync::Arc;

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
/// - `trace_id`: set by whoever starts a request ([`CallContext::with_trace_id`]) and
///   inherited by every call it leads to, on this node and across nodes, so the turns
///   of one request can be told apart from others' (in logs, spans, replies). None
///   unless set.
///
/// It is plain data so it can cross a network inside a request envelope.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallContext {
    depth: u32,
    chain: Chain,
    deadline: Deadline,
    /// Absent in contexts stored before trace ids existed (self-describing formats).
    #[serde(default)]
    trace_id: Option<TraceId>,
}

/// A call's chain, shared: cloning a context (a turn's caller handle, a message an actor
/// sends itself) copies a pointer, not the list; an empty chain allocates nothing. On
/// the wire it is the list of ids, as a `Vec` is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Chain(Option<Arc<[ActorId]>>);

impl Chain {
    fn from_vec(actors: Vec<ActorId>) -> Self {
        if actors.is_empty() {
            Self(None)
        } else {
            Self(Some(actors.into()))
        }
    }

    fn as_slice(&self) -> &[ActorId] {
        self.0.as_deref().unwrap_or_default()
    }
}

impl Serialize for Chain {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.as_slice())
    }
}

impl<'de> Deserialize<'de> for Chain {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Vec::<ActorId>::deserialize(deserializer).map(Self::from_vec)
    }
}

/// The id of one request's tree of calls: 128 bits, the size of a W3C/OpenTelemetry
/// trace id, shown as 32 lowercase hex digits. Chosen by the caller that starts the
/// request (the runtime draws no random numbers); [`CallContext::child`] passes it on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct TraceId(u128);

impl TraceId {
    /// The trace id `value`.
    pub const fn new(value: u128) -> Self {
        Self(value)
    }

    /// Its 128 bits.
    pub const fn get(self) -> u128 {
        self.0
    }

    /// Reads the form [`TraceId`]'s `Display` writes: exactly
    /// [`TRACE_ID_HEX_DIGITS`] lowercase hex digits, not all zero (W3C Trace Context
    /// calls the all-zero id invalid). `None` for anything else.
    pub fn parse_hex(text: &str) -> Option<Self> {
        if text.len() != TRACE_ID_HEX_DIGITS || !text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return None;
        }
        u128::from_str_radix(text, 16)
            .ok()
            .filter(|value| *value != 0)
            .map(Self)
    }

    /// The trace id of a W3C Trace Context `traceparent` header
    /// (`{version}-{trace-id}-{parent-id}-{flags}`, e.g.
    /// `00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01`): `None` when the
    /// header does not have that shape (two hex digits of version other than `ff`, 32 of
    /// trace id, 16 of parent id, 2 of flags) or its trace id is all zero.
    pub fn from_traceparent(header: &str) -> Option<Self> {
        let mut fields = header.trim().split('-');
        let (version, trace, parent, flags) = (fields.next()?, fields.next()?, fields.next()?, fields.next()?);
        let hex = |field: &str, digits: usize| {
            field.len() == digits && field.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        };
        // Version 00 has exactly four fields; later versions may append more.
        if !hex(version, 2) || version == "ff" || (version == "00" && fields.next().is_some()) {
            return None;
        }
        if !hex(parent, 16) || !hex(flags, 2) {
            return None;
        }
        Self::parse_hex(trace)
    }
}

/// Hex digits of a [`TraceId`] as text (128 bits, four per digit).
pub const TRACE_ID_HEX_DIGITS: usize = 32;

impl std::fmt::Display for TraceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl CallContext {
    /// The context of a call from outside the runtime: depth 0, empty chain.
    pub fn root(deadline: Deadline) -> Self {
        Self {
            depth: 0,
            chain: Chain(None),
            deadline,
            trace_id: None,
        }
    }

    /// The same context carrying `trace_id`: every call it leads to carries it too.
    #[must_use]
    pub fn with_trace_id(mut self, trace_id: TraceId) -> Self {
        self.trace_id = Some(trace_id);
        self
    }

    /// The trace id of the request this call belongs to, if its root set one.
    pub fn trace_id(&self) -> Option<TraceId> {
        self.trace_id
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
        Self {
            depth,
            chain: Chain::from_vec(chain),
            deadline,
            trace_id: None,
        }
    }

    /// How many calls between actors lead to this one.
    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// The actors waiting on this call, outermost first.
    pub fn chain(&self) -> &[ActorId] {
        self.chain.as_slice()
    }

    /// When this call must have finished.
    pub fn deadline(&self) -> Deadline {
        self.deadline
    }

    /// Whether `actor` is waiting somewhere up this call's chain.
    pub fn contains(&self, actor: &ActorId) -> bool {
        self.chain().iter().any(|waiting| waiting == actor)
    }

    /// The same depth and chain with another deadline: for a message an actor sends
    /// itself to run later (nobody waits on it, so its deadline is not clipped to this
    /// one's; see `Caller::tell`).
    pub fn with_deadline(&self, deadline: Deadline) -> Self {
        Self {
            depth: self.depth,
            chain: self.chain.clone(),
            deadline,
            trace_id: self.trace_id,
        }
    }

    /// Whether `self` is at least as restrictive as `base` for admission: its chain
    /// starts with `base`'s chain and it is at least as deep (deadlines aside).
    pub fn extends(&self, base: &CallContext) -> bool {
        self.depth >= base.depth && self.chain().starts_with(base.chain())
    }

    /// The context of a call that `caller`, running under `self`, makes with `deadline`.
    ///
    /// The child's deadline is clipped to the parent's: it is the earlier of the two.
    /// This does not check admission; see [`crate::admit_call`].
    pub fn child(&self, caller: ActorId, deadline: Deadline) -> Self {
        let parent = self.chain();
        let chain: Arc<[ActorId]> = parent.iter().cloned().chain(std::iter::once(caller)).collect();
        let child = Self {
            depth: self.depth.saturating_add(1),
            chain: Chain(Some(chain)),
            deadline: self.deadline.min(deadline),
            trace_id: self.trace_id,
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
    fn a_trace_id_reads_back_what_it_writes_and_nothing_else() {
        let trace = TraceId::new(0x0af7_6519_16cd_43dd_8448_eb21_1c80_319c);
        assert_eq!(trace.to_string(), "0af7651916cd43dd8448eb211c80319c");
        assert_eq!(TraceId::parse_hex(&trace.to_string()), Some(trace));
        assert_eq!(TraceId::parse_hex(&TraceId::new(1).to_string()), Some(TraceId::new(1)));
        for bad in [
            "",
            "0af7651916cd43dd8448eb211c80319",
            "0af7651916cd43dd8448eb211c80319c0",
            "0AF7651916CD43DD8448EB211C80319C",
            "0af7651916cd43dd8448eb211c80319g",
            "00000000000000000000000000000000",
            "a-call-7",
            "+af7651916cd43dd8448eb211c80319c",
        ] {
            assert_eq!(TraceId::parse_hex(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_traceparent_gives_its_trace_id_field() {
        let trace = TraceId::new(0x0af7_6519_16cd_43dd_8448_eb21_1c80_319c);
        assert_eq!(
            TraceId::from_traceparent("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
            Some(trace)
        );
        assert_eq!(
            TraceId::from_traceparent("01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00-more"),
            Some(trace),
            "a later version may add fields"
        );
        for bad in [
            "",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b716920333-01",
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            "0-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ] {
            assert_eq!(TraceId::from_traceparent(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_trace_id_set_at_the_root_is_inherited_by_every_descendant() {
        let trace = TraceId::new(0x0af7_6519_16cd_43dd_8448_eb21_1c80_319c);
        assert_eq!(trace.to_string(), "0af7651916cd43dd8448eb211c80319c");
        let root = CallContext::root(Deadline::from_micros(100));
        assert_eq!(root.trace_id(), None);
        let root = root.with_trace_id(trace);
        let grandchild = root
            .child(ActorId::new("agent", "a").unwrap(), Deadline::from_micros(90))
            .child(ActorId::new("agent", "b").unwrap(), Deadline::from_micros(80));
        assert_eq!(grandchild.trace_id(), Some(trace));
        assert_eq!(
            grandchild.with_deadline(Deadline::from_micros(5)).trace_id(),
            Some(trace)
        );
        let untraced = CallContext::root(Deadline::from_micros(100))
            .child(ActorId::new("agent", "a").unwrap(), Deadline::from_micros(90));
        assert_eq!(untraced.trace_id(), None);
    }

    #[test]
    fn a_context_stored_without_a_trace_id_still_decodes() {
        // A context stored (as JSON, e.g. in an agent's inbox) before trace ids existed.
        let context = CallContext::root(Deadline::from_micros(7))
            .child(ActorId::new("agent", "a").unwrap(), Deadline::from_micros(7));
        let mut stored = serde_json::to_value(&context).unwrap();
        let removed = stored.as_object_mut().unwrap().remove("trace_id");
        assert_eq!(removed, Some(serde_json::Value::Null));
        let decoded: CallContext = serde_json::from_value(stored).unwrap();
        assert_eq!(decoded, context);
        // Binary (bincode) contexts carry it; a traced one round-trips.
        let traced = context.with_trace_id(TraceId::new(42));
        let bytes = bincode::serialize(&traced).unwrap();
        assert_eq!(bincode::deserialize::<CallContext>(&bytes).unwrap(), traced);
    }

    /// The encoding of a context as it was when the chain was a `Vec` (stored inbox
    /// entries, frames of another node): the shared chain must encode the same bytes.
    #[derive(Serialize, Deserialize, PartialEq, Debug)]
    struct VecChainContext {
        depth: u32,
        chain: Vec<ActorId>,
        deadline: Deadline,
        trace_id: Option<TraceId>,
    }

    #[test]
    fn the_shared_chain_encodes_as_the_list_did() {
        let (a, b) = (ActorId::new("agent", "a").unwrap(), ActorId::new("agent", "b").unwrap());
        let root = CallContext::root(Deadline::from_micros(50)).with_trace_id(TraceId::new(7));
        for context in [
            root.clone(),
            root.child(a.clone(), Deadline::from_micros(40)),
            root.child(a.clone(), Deadline::from_micros(40))
                .child(b.clone(), Deadline::from_micros(30)),
            CallContext::continued(3, Vec::new(), Deadline::from_micros(9)),
        ] {
            let old = VecChainContext {
                depth: context.depth(),
                chain: context.chain().to_vec(),
                deadline: context.deadline(),
                trace_id: context.trace_id(),
            };
            let bytes = bincode::serialize(&context).unwrap();
            assert_eq!(bytes, bincode::serialize(&old).unwrap());
            assert_eq!(bincode::deserialize::<CallContext>(&bytes).unwrap(), context);
            let json = serde_json::to_string(&context).unwrap();
            assert_eq!(json, serde_json::to_string(&old).unwrap());
            assert_eq!(serde_json::from_str::<CallContext>(&json).unwrap(), context);
        }
        // A chain decoded from an empty list equals the root's (no list either way).
        let empty: CallContext = serde_json::from_str(&serde_json::to_string(&root).unwrap()).unwrap();
        assert_eq!(empty, root);
        let child = root.child(a.clone(), Deadline::from_micros(40));
        assert_eq!(child.clone().chain(), [a].as_slice());
        assert_ne!(child, root);
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
