//! The faults a scenario can inject into a simulated deployment.
//!
//! Node and storage faults act on the real runtime's environment: a killed node's tasks
//! die (madsim `Handle::kill`), a crashed disk drops unflushed commits
//! (`MemoryStore::crash`), storage failures come from `MemoryStoreFaults`. Faults of
//! the calls between actors (a callee that times out, rejects, does not exist or is
//! busy) are workload shapes, built with [`crate::ProbeOp`] in the scenarios.

use crate::cluster::NodeId;

/// One fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Kill a node: its runtime and every actor task die; memory is lost.
    KillNode(NodeId),
    /// Kill a node and crash its disk: also lose every commit not yet flushed.
    CrashNode(NodeId),
    /// Restart a killed node from its disk.
    RestartNode(NodeId),
    /// Fail the next `count` commits on a node's disk.
    FailCommits {
        /// The node whose disk fails.
        node: NodeId,
        /// How many commits.
        count: u64,
    },
    /// Fail the next `count` loads on a node's disk (activations fail).
    FailLoads {
        /// The node whose disk fails.
        node: NodeId,
        /// How many loads.
        count: u64,
    },
    /// Fail the next `count` reads on a node's disk (`get`/`scan` inside turns).
    FailReads {
        /// The node whose disk fails.
        node: NodeId,
        /// How many reads.
        count: u64,
    },
    /// Fail every storage operation of a node's disk until healed.
    FailStorage(NodeId),
    /// Cut the link between two nodes both ways (0 is the client node). Packets wait
    /// in madsim's TCP until the link heals; new connections are refused.
    Partition(NodeId, NodeId),
    /// Cut the link from the first node to the second only.
    OneWay {
        /// The sender whose packets are dropped.
        from: NodeId,
        /// The receiver.
        to: NodeId,
    },
    /// Cut a node off from everyone, both ways.
    Isolate(NodeId),
    /// Set every link's latency to `min_ms..max_ms`.
    Latency {
        /// Shortest, in milliseconds.
        min_ms: u64,
        /// Longest (exclusive), in milliseconds.
        max_ms: u64,
    },
    /// Every model answer takes `ms` longer.
    LlmLatency {
        /// Added latency, in milliseconds.
        ms: u64,
    },
    /// The next `count` model requests fail.
    LlmFail {
        /// How many.
        count: u64,
    },
    /// The next `count` calls of the `lookup` tool fail.
    ToolFail {
        /// How many.
        count: u64,
    },
    /// Lose `percent` of packets (madsim's TCP retransmits with backoff: lost packets
    /// arrive late; connection attempts fail).
    PacketLoss {
        /// Percent of packets lost.
        percent: u8,
    },
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::KillNode(node) => write!(f, "kill node {node}"),
            Self::CrashNode(node) => write!(f, "kill node {node} and crash its disk"),
            Self::RestartNode(node) => write!(f, "restart node {node}"),
            Self::FailCommits { node, count } => write!(f, "fail the next {count} commits on node {node}"),
            Self::FailLoads { node, count } => write!(f, "fail the next {count} loads on node {node}"),
            Self::FailReads { node, count } => write!(f, "fail the next {count} reads on node {node}"),
            Self::FailStorage(node) => write!(f, "fail all storage on node {node}"),
            Self::Partition(a, b) => write!(f, "partition nodes {a} and {b}"),
            Self::OneWay { from, to } => write!(f, "drop packets from node {from} to node {to}"),
            Self::Isolate(node) => write!(f, "isolate node {node}"),
            Self::Latency { min_ms, max_ms } => write!(f, "latency {min_ms}..{max_ms} ms"),
            Self::PacketLoss { percent } => write!(f, "lose {percent}% of packets"),
            Self::LlmLatency { ms } => write!(f, "model answers {ms} ms slower"),
            Self::LlmFail { count } => write!(f, "fail the next {count} model requests"),
            Self::ToolFail { count } => write!(f, "fail the next {count} tool calls"),
        }
    }
}
