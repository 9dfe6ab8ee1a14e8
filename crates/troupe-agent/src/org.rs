//! The organisation: who may talk to whom (the Spacebot design's communication graph and
//! the OpenCompany design's permissions), decided at admission for ask, delegate and
//! notify alike.
//!
//! An [`Organisation`] holds
//! - [`Link`]s: directed edges `from → to`, one per ordered pair, with a
//!   [`LinkDirection`] (one-way: only `from` may start contact; two-way: both), a
//!   [`LinkRelationship`] (what `from` is to `to`: peer, superior, subordinate) and an
//!   `enabled` flag;
//! - per-agent [`Membership`]: its manager and its [`BehaviourMode`];
//! - per-agent [`PermissionRule`]s (see [`crate::permissions`]);
//! - the [`OrgPolicy`] and a version, bumped by every change.
//!
//! [`Organisation::decide`] answers "may `from` start a `kind` contact with `to`?":
//!
//! ```text
//! from == to's manager, or to == from's manager      → permitted (hierarchy bypass:
//!                                                      skips links, rules and mode)
//! policy Enforced: no enabled link lets from start   → NotPermitted (NoLink,
//!                                                      LinkDisabled, OneWayLink)
//! permission rules of from, then its mode            → NotPermitted (Denied), or
//!                                                      approval needed, or permitted
//! ```
//!
//! The default policy is [`OrgPolicy::Open`]: links are not required (they only frame
//! the prompt), so a system with no organisation configured behaves as before (rules
//! default to allow). [`OrgPolicy::Enforced`] requires a link (or the hierarchy) for
//! every contact. Rules and behaviour modes apply under both policies.
//!
//! A one-way link `a → b` lets `b` answer `a`: the reply to `a`'s ask and the result of
//! `a`'s delegated task go back without admission (they are replies, not contacts). `b`
//! cannot start an ask, delegation or notification to `a`. (Within a thread `a` started,
//! `b` could not contact `a` anyway: `a` is in the chain, and admission refuses cycles.)
//!
//! This module does no I/O: the store and the cache live in `org_store.rs`.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use troupe_core::Deadline;

use crate::permissions::{resolve_permission, BehaviourMode, PermissionRule, PermissionVerdict, RuleMatch};

/// Most links an organisation holds.
pub const ORG_LINKS_MAX: usize = 10_000;
/// Most permission rules one agent holds.
pub const ORG_RULES_PER_AGENT_MAX: usize = 1_000;
/// Most agents listed in one organisation prompt section or tool description.
pub const ORG_PROMPT_AGENTS_LISTED_MAX: usize = 50;
/// Most approvals pending at once.
pub const ORG_APPROVALS_PENDING_MAX: usize = 1_000;
/// Most resolved approvals kept (the oldest are dropped first).
pub const ORG_APPROVALS_RESOLVED_KEPT_MAX: usize = 1_000;
/// Longest message summary kept in an approval record, in bytes.
pub const ORG_APPROVAL_MESSAGE_SIZE_MAX_BYTES: usize = 1_024;

/// Who may start contact over a link.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LinkDirection {
    /// Only `from` may start contact; `to` may only reply.
    OneWay,
    /// Both may start contact.
    #[default]
    TwoWay,
}

/// What `from` is to `to`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LinkRelationship {
    /// Equals.
    #[default]
    Peer,
    /// `from` is `to`'s superior.
    Superior,
    /// `from` is `to`'s subordinate.
    Subordinate,
}

impl LinkRelationship {
    /// The same relationship seen from the other end.
    pub fn inverse(self) -> Self {
        match self {
            Self::Peer => Self::Peer,
            Self::Superior => Self::Subordinate,
            Self::Subordinate => Self::Superior,
        }
    }
}

/// A directed edge of the communication graph.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Link {
    /// The source agent.
    pub from: String,
    /// The target agent.
    pub to: String,
    /// Who may start contact.
    pub direction: LinkDirection,
    /// What `from` is to `to`.
    pub relationship: LinkRelationship,
    /// A disabled link lets nobody start contact (and is left out of the prompt).
    pub enabled: bool,
}

impl Link {
    /// An enabled two-way peer link.
    pub fn new(from: impl Into<String>, to: impl Into<String>) -> Self {
        Self {
            from: from.into(),
            to: to.into(),
            direction: LinkDirection::TwoWay,
            relationship: LinkRelationship::Peer,
            enabled: true,
        }
    }

    /// Sets the direction.
    pub fn direction(mut self, direction: LinkDirection) -> Self {
        self.direction = direction;
        self
    }

    /// Sets the relationship.
    pub fn relationship(mut self, relationship: LinkRelationship) -> Self {
        self.relationship = relationship;
        self
    }

    /// Sets the enabled flag.
    pub fn enabled(mut self, enabled: bool) -> Self {
        self.enabled = enabled;
        self
    }
}

/// A change to some of a link's fields (`AgentClient::patch_link`): each field given
/// replaces the link's, each left `None` keeps it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LinkPatch {
    /// The new direction, if any.
    #[serde(default)]
    pub direction: Option<LinkDirection>,
    /// The new relationship, if any.
    #[serde(default)]
    pub relationship: Option<LinkRelationship>,
    /// The new enabled flag, if any.
    #[serde(default)]
    pub enabled: Option<bool>,
}

impl LinkPatch {
    /// `link` with the patch's fields applied.
    pub fn applied_to(self, link: Link) -> Link {
        Link {
            direction: self.direction.unwrap_or(link.direction),
            relationship: self.relationship.unwrap_or(link.relationship),
            enabled: self.enabled.unwrap_or(link.enabled),
            ..link
        }
    }
}

/// Whether links are required.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OrgPolicy {
    /// Links are not required; rules and modes still apply (the default).
    #[default]
    Open,
    /// Every contact needs an enabled link that lets its sender start it, or the
    /// hierarchy bypass.
    Enforced,
}

/// An agent's place in the hierarchy and its behaviour mode.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Membership {
    /// Its manager's id.
    #[serde(default)]
    pub manager: Option<String>,
    /// How much it may do without approval.
    #[serde(default)]
    pub mode: BehaviourMode,
}

/// The three ways to contact an agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContactKind {
    /// `call_agent` / `AgentClient::ask_as`: wait for the answer.
    Ask,
    /// `delegate_to_agent` / `AgentClient::delegate`.
    Delegate,
    /// `notify_agent` / `AgentClient::notify_as`.
    Notify,
}

impl ContactKind {
    /// `ask`, `delegate to`, `notify`.
    pub fn verb(self) -> &'static str {
        match self {
            Self::Ask => "ask",
            Self::Delegate => "delegate to",
            Self::Notify => "notify",
        }
    }
}

/// Why a contact was refused.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum NotPermittedReason {
    /// The organisation is enforced and no link joins the two agents.
    NoLink,
    /// The only link between them is disabled.
    LinkDisabled,
    /// The link is one-way from the target to the sender: the sender may only reply.
    OneWayLink,
    /// A permission rule of the sender denies it.
    Denied(RuleMatch),
    /// The contact needs approval, and approval is not available on this path.
    ApprovalRequired {
        /// The step of the rules that allowed it.
        rule: RuleMatch,
        /// The sender's behaviour mode.
        mode: BehaviourMode,
    },
    /// A human (or an API caller) denied approval `id`.
    ApprovalDenied {
        /// The approval's id.
        id: u64,
    },
    /// Approval `id` was still pending when the contact's deadline passed; the record
    /// stays pending, and approving it later sends nothing.
    ApprovalTimedOut {
        /// The approval's id.
        id: u64,
    },
    /// The organisation's record could not be read from the store, or a change to it
    /// (an approval's record) could not be written; the cause says which.
    Unavailable {
        /// The store's error.
        cause: String,
    },
}

impl fmt::Display for NotPermittedReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoLink => write!(f, "no link joins them and the organisation requires one"),
            Self::LinkDisabled => write!(f, "the link between them is disabled"),
            Self::OneWayLink => write!(f, "the link is one-way towards the sender, which may only reply"),
            Self::Denied(rule) => write!(f, "a permission rule denies it ({})", rule.describe()),
            Self::ApprovalRequired { rule, mode } => write!(
                f,
                "it needs approval ({}, mode {mode:?}) and none can be given here",
                rule.describe()
            ),
            Self::ApprovalDenied { id } => write!(f, "approval {id} was denied"),
            Self::ApprovalTimedOut { id } => write!(f, "approval {id} was still pending at the deadline"),
            Self::Unavailable { cause } => write!(f, "the organisation could not be read or changed: {cause}"),
        }
    }
}

/// A contact refused by the organisation; nothing was sent.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, thiserror::Error)]
#[error("{from} may not {} {to}: {reason}", kind.verb())]
pub struct NotPermitted {
    /// The sender's id.
    pub from: String,
    /// The target's id.
    pub to: String,
    /// What it tried.
    pub kind: ContactKind,
    /// Why it was refused.
    pub reason: NotPermittedReason,
}

/// A contact the organisation lets through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Permitted {
    /// The hierarchy bypass: the target is the sender's manager or direct report.
    Hierarchy,
    /// The rules (and, when enforced, a link) allow it.
    Allowed,
    /// The rules allow it once approved.
    NeedsApproval {
        /// The step of the rules that allowed it.
        rule: RuleMatch,
        /// The sender's behaviour mode.
        mode: BehaviourMode,
    },
}

/// Why a change to the organisation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OrgError {
    /// A link from an agent to itself.
    #[error("a link must join two different agents, got {agent:?} to itself")]
    SelfLink {
        /// The agent.
        agent: String,
    },
    /// An id is empty, `*` where an agent is required, or not a valid actor key.
    #[error("{what} {id:?} is not a valid agent id: {cause}")]
    InvalidAgentId {
        /// Which field.
        what: &'static str,
        /// The id.
        id: String,
        /// Why.
        cause: String,
    },
    /// A link with this source and target exists already (update it instead).
    #[error("a link from {from:?} to {to:?} exists already; update it instead")]
    LinkExists {
        /// Its source.
        from: String,
        /// Its target.
        to: String,
    },
    /// The link does not exist.
    #[error("there is no link from {from:?} to {to:?}")]
    NoSuchLink {
        /// Its source.
        from: String,
        /// Its target.
        to: String,
    },
    /// Too many links or rules.
    #[error("the organisation holds at most {limit} {what}")]
    TooMany {
        /// Links or rules.
        what: &'static str,
        /// The limit.
        limit: usize,
    },
    /// An agent would become its own manager, directly or through a chain.
    #[error("{agent:?} cannot have {manager:?} as manager: it would manage itself")]
    ManagerCycle {
        /// The agent.
        agent: String,
        /// The manager given.
        manager: String,
    },
    /// The store failed; nothing changed.
    #[error("the organisation could not be stored: {0}")]
    Store(#[from] troupe_core::StoreError),
    /// The stored organisation cannot be decoded.
    #[error("the stored organisation cannot be decoded: {cause}")]
    Decode {
        /// The decoding error.
        cause: String,
    },
    /// The approval does not exist or is no longer pending.
    #[error("approval {id} is not pending")]
    NotPending {
        /// Its id.
        id: u64,
    },
    /// The approval's contact stopped waiting for it (its deadline passed while it was
    /// pending): approving or denying it would change nothing. It is now
    /// [`ApprovalState::Expired`].
    #[error(
        "approval {id} expired: the contact waiting for it reached its deadline and was refused as timed out; \
         nothing waits for this approval any more (the sender may try again, which asks for a new one)"
    )]
    Expired {
        /// Its id.
        id: u64,
    },
    /// A config file names a model provider or tool the system does not have; nothing
    /// was applied.
    #[error(transparent)]
    Config(#[from] crate::ConfigError),
}

/// Where an approval stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalState {
    /// Waiting for `approve` or `deny`.
    Pending,
    /// Approved: the contact may proceed.
    Approved,
    /// Denied: the contact is refused.
    Denied,
    /// Nobody waits for it any more: its contact's deadline passed while it was still
    /// pending (the contact was refused as timed out), or the call that waited for it in
    /// its turn stopped waiting (its caller gave up: [`Organisation::abandon_approval`]),
    /// so approving or denying it would change nothing. Made when it is resolved too
    /// late, when a new approval is requested after its deadline, or when its call
    /// stopped waiting; read as such from then on ([`Approval::state_at`]).
    Expired,
}

/// A durable record of a contact that waits for approval.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Approval {
    /// Its id, unique within the organisation.
    pub id: u64,
    /// The sender.
    pub from: String,
    /// The target.
    pub to: String,
    /// What the sender tried.
    pub kind: ContactKind,
    /// The start of the message, at most [`ORG_APPROVAL_MESSAGE_SIZE_MAX_BYTES`].
    pub message: String,
    /// Where it stands (as stored: see [`Approval::state_at`]).
    pub state: ApprovalState,
    /// When its contact stops waiting for it (the call's or the task's deadline): after
    /// it, a pending approval is [`ApprovalState::Expired`]. `None` in records stored
    /// before 2026-12-01, which never expire.
    #[serde(default)]
    pub deadline: Option<Deadline>,
    /// Whether it is listed as pending ([`Organisation::pending_approvals_at`]), for a
    /// person to resolve. A call waiting in its turn is listed at once. A delegation,
    /// notification or mention is listed once the turn that queued it has committed
    /// and its delivery waits for the approval ([`Organisation::list_approval`]);
    /// until then, and for ever if that turn was cut by a crash or rolled back, it is
    /// not listed (it expires at its deadline, and can still be resolved by its id,
    /// which then sends nothing). `true` in records stored before 2026-12-02.
    #[serde(default = "listed_by_default")]
    pub listed: bool,
}

/// Records stored before [`Approval::listed`] existed were all listed.
fn listed_by_default() -> bool {
    true
}

impl Approval {
    /// Where it stands at `now`: a pending approval whose deadline has passed is
    /// [`ApprovalState::Expired`] (whether or not that was stored yet).
    pub fn state_at(&self, now: Deadline) -> ApprovalState {
        match self.state {
            ApprovalState::Pending if self.deadline.is_some_and(|deadline| deadline.has_passed(now)) => {
                ApprovalState::Expired
            }
            state => state,
        }
    }

    /// It as it stands at `now` ([`Approval::state_at`]).
    pub fn at(mut self, now: Deadline) -> Self {
        self.state = self.state_at(now);
        self
    }
}

/// The organisation's whole state: what the store keeps and admission reads.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Organisation {
    /// Whether links are required.
    #[serde(default)]
    pub policy: OrgPolicy,
    /// Links by source, then target.
    #[serde(default)]
    links: BTreeMap<String, BTreeMap<String, Link>>,
    /// Managers and modes by agent.
    #[serde(default)]
    members: BTreeMap<String, Membership>,
    /// Rules by agent, then target.
    #[serde(default)]
    rules: BTreeMap<String, BTreeMap<String, PermissionRule>>,
    /// Approvals by id: every pending one, and the last resolved ones.
    #[serde(default)]
    approvals: BTreeMap<u64, Approval>,
    /// The id of the next approval.
    #[serde(default)]
    next_approval: u64,
    /// Bumped by every change; 0 for an organisation never changed.
    #[serde(default)]
    version: u64,
}

fn check_agent(what: &'static str, id: &str) -> Result<(), OrgError> {
    let invalid = |cause: String| OrgError::InvalidAgentId {
        what,
        id: id.to_string(),
        cause,
    };
    if id == crate::permissions::PERMISSION_TARGET_ANY {
        return Err(invalid("`*` names every agent, not one".to_string()));
    }
    crate::agent_id(id)
        .map(|_| ())
        .map_err(|error| invalid(error.to_string()))
}

impl Organisation {
    /// The version: how many changes were applied.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Every link, by source then target.
    pub fn links(&self) -> Vec<Link> {
        self.links.values().flat_map(|to| to.values().cloned()).collect()
    }

    /// The link from `from` to `to`, if any.
    pub fn link(&self, from: &str, to: &str) -> Option<&Link> {
        self.links.get(from).and_then(|to_map| to_map.get(to))
    }

    /// Agent `agent`'s membership (default: no manager, autonomous).
    pub fn membership(&self, agent: &str) -> Membership {
        self.members.get(agent).cloned().unwrap_or_default()
    }

    /// Agent `agent`'s rules, by target.
    pub fn rules(&self, agent: &str) -> Vec<PermissionRule> {
        self.rules
            .get(agent)
            .map(|rules| rules.values().cloned().collect())
            .unwrap_or_default()
    }

    /// Agent `agent`'s direct reports.
    pub fn reports_of(&self, agent: &str) -> Vec<String> {
        self.members
            .iter()
            .filter(|(_, member)| member.manager.as_deref() == Some(agent))
            .map(|(id, _)| id.clone())
            .collect()
    }

    fn bump(&mut self) {
        self.version += 1;
    }

    /// Adds `link`, or replaces the link with the same source and target.
    ///
    /// # Errors
    /// [`OrgError::SelfLink`], [`OrgError::InvalidAgentId`], [`OrgError::TooMany`].
    pub fn upsert_link(&mut self, link: Link) -> Result<(), OrgError> {
        check_agent("link source", &link.from)?;
        check_agent("link target", &link.to)?;
        if link.from == link.to {
            return Err(OrgError::SelfLink { agent: link.from });
        }
        let exists = self.link(&link.from, &link.to).is_some();
        if !exists && self.links.values().map(BTreeMap::len).sum::<usize>() >= ORG_LINKS_MAX {
            return Err(OrgError::TooMany {
                what: "links",
                limit: ORG_LINKS_MAX,
            });
        }
        self.links
            .entry(link.from.clone())
            .or_default()
            .insert(link.to.clone(), link);
        self.bump();
        Ok(())
    }

    /// Removes the link from `from` to `to` and returns it.
    ///
    /// # Errors
    /// [`OrgError::NoSuchLink`].
    pub fn remove_link(&mut self, from: &str, to: &str) -> Result<Link, OrgError> {
        let removed = self.links.get_mut(from).and_then(|to_map| to_map.remove(to));
        let Some(link) = removed else {
            return Err(OrgError::NoSuchLink {
                from: from.to_string(),
                to: to.to_string(),
            });
        };
        if self.links.get(from).is_some_and(BTreeMap::is_empty) {
            self.links.remove(from);
        }
        self.bump();
        Ok(link)
    }

    /// Sets agent `agent`'s membership (manager and mode).
    ///
    /// # Errors
    /// [`OrgError::InvalidAgentId`], [`OrgError::ManagerCycle`].
    pub fn set_membership(&mut self, agent: &str, membership: Membership) -> Result<(), OrgError> {
        check_agent("agent", agent)?;
        if let Some(manager) = &membership.manager {
            check_agent("manager", manager)?;
            // Walk up from the manager: reaching `agent` means a cycle.
            let mut current = Some(manager.clone());
            let mut steps = 0;
            while let Some(id) = current {
                if id == agent {
                    return Err(OrgError::ManagerCycle {
                        agent: agent.to_string(),
                        manager: manager.clone(),
                    });
                }
                steps += 1;
                assert!(steps <= self.members.len() + 1, "the manager chains are acyclic");
                current = self.members.get(&id).and_then(|member| member.manager.clone());
            }
        }
        self.members.insert(agent.to_string(), membership);
        self.bump();
        Ok(())
    }

    /// Sets `rule` for agent `agent` (replacing its rule for the same target).
    ///
    /// # Errors
    /// [`OrgError::InvalidAgentId`], [`OrgError::TooMany`].
    pub fn set_rule(&mut self, agent: &str, rule: PermissionRule) -> Result<(), OrgError> {
        check_agent("agent", agent)?;
        if !rule.is_wildcard() {
            check_agent("rule target", &rule.target)?;
        }
        let rules = self.rules.entry(agent.to_string()).or_default();
        if !rules.contains_key(&rule.target) && rules.len() >= ORG_RULES_PER_AGENT_MAX {
            return Err(OrgError::TooMany {
                what: "rules per agent",
                limit: ORG_RULES_PER_AGENT_MAX,
            });
        }
        rules.insert(rule.target.clone(), rule);
        self.bump();
        Ok(())
    }

    /// Removes agent `agent`'s rule for `target` and returns it, if there was one.
    pub fn remove_rule(&mut self, agent: &str, target: &str) -> Option<PermissionRule> {
        let removed = self.rules.get_mut(agent).and_then(|rules| rules.remove(target));
        if removed.is_some() {
            if self.rules.get(agent).is_some_and(BTreeMap::is_empty) {
                self.rules.remove(agent);
            }
            self.bump();
        }
        removed
    }

    /// Records a pending approval for `from` contacting `to`, whose contact waits until
    /// `deadline`, listed at once (a call waiting for it in its turn); returns its id.
    /// Pending approvals whose deadline has passed at `now` are marked
    /// [`ApprovalState::Expired`] first, so that abandoned ones do not hold the room of
    /// [`ORG_APPROVALS_PENDING_MAX`].
    ///
    /// # Errors
    /// [`OrgError::TooMany`] if [`ORG_APPROVALS_PENDING_MAX`] are pending (and not past
    /// their deadline).
    pub fn request_approval(
        &mut self,
        from: &str,
        to: &str,
        kind: ContactKind,
        message: &str,
        deadline: Deadline,
        now: Deadline,
    ) -> Result<u64, OrgError> {
        self.record_approval(from, to, kind, message, deadline, now, true)
    }

    /// [`Organisation::request_approval`] for a contact queued by a turn that has not
    /// committed yet (a delegation, notification or mention): not listed until its
    /// delivery waits for it ([`Organisation::list_approval`]), so that an approval
    /// whose turn is then cut or rolled back is never shown to a person.
    ///
    /// # Errors
    /// As [`Organisation::request_approval`].
    pub fn request_unlisted_approval(
        &mut self,
        from: &str,
        to: &str,
        kind: ContactKind,
        message: &str,
        deadline: Deadline,
        now: Deadline,
    ) -> Result<u64, OrgError> {
        self.record_approval(from, to, kind, message, deadline, now, false)
    }

    #[allow(clippy::too_many_arguments)] // the record's fields, each named at the two callers
    fn record_approval(
        &mut self,
        from: &str,
        to: &str,
        kind: ContactKind,
        message: &str,
        deadline: Deadline,
        now: Deadline,
        listed: bool,
    ) -> Result<u64, OrgError> {
        self.expire_approvals(now);
        if self.pending_approvals().len() >= ORG_APPROVALS_PENDING_MAX {
            return Err(OrgError::TooMany {
                what: "pending approvals",
                limit: ORG_APPROVALS_PENDING_MAX,
            });
        }
        let id = self.next_approval;
        self.next_approval += 1;
        let message = troupe_core::truncate_utf8(message, ORG_APPROVAL_MESSAGE_SIZE_MAX_BYTES).to_string();
        let approval = Approval {
            id,
            from: from.to_string(),
            to: to.to_string(),
            kind,
            message,
            state: ApprovalState::Pending,
            deadline: Some(deadline),
            listed,
        };
        self.approvals.insert(id, approval);
        self.bump();
        Ok(id)
    }

    /// Lists approval `id` as pending at `now` (its contact's delivery now waits for it);
    /// returns whether that changed anything (false if it was listed already, is
    /// resolved, is past its deadline at `now`, or is gone).
    pub fn list_approval(&mut self, id: u64, now: Deadline) -> bool {
        let Some(approval) = self
            .approvals
            .get_mut(&id)
            .filter(|approval| !approval.listed && approval.state_at(now) == ApprovalState::Pending)
        else {
            return false;
        };
        approval.listed = true;
        self.bump();
        true
    }

    /// Removes approval `id` if it is pending and was never listed: its contact was not
    /// queued after all (the send it was recorded for failed a later check), so nobody
    /// saw it and nothing waits for it; returns whether it was removed. It no longer
    /// holds room of [`ORG_APPROVALS_PENDING_MAX`].
    pub fn withdraw_approval(&mut self, id: u64) -> bool {
        let unlisted = self
            .approvals
            .get(&id)
            .is_some_and(|approval| !approval.listed && approval.state == ApprovalState::Pending);
        if unlisted {
            self.approvals.remove(&id);
            self.bump();
        }
        unlisted
    }

    /// Marks pending approval `id` [`ApprovalState::Expired`] because nothing waits for
    /// it any more: the call that waited for it in its turn stopped waiting (its caller
    /// gave up, or its client left), so it is no longer listed and approving it is
    /// refused rather than accepted for a call that will never be made. Returns whether
    /// that changed anything (false if it is resolved, gone, or expired already, also by
    /// its deadline at `now`: that one is left to read as expired by its deadline, so
    /// resolving it is refused as [`OrgError::Expired`], as before).
    pub fn abandon_approval(&mut self, id: u64, now: Deadline) -> bool {
        let Some(approval) = self
            .approvals
            .get_mut(&id)
            .filter(|approval| approval.state_at(now) == ApprovalState::Pending)
        else {
            return false;
        };
        approval.state = ApprovalState::Expired;
        self.trim_resolved();
        self.bump();
        true
    }

    /// Marks every pending approval whose deadline has passed at `now` as
    /// [`ApprovalState::Expired`]; returns how many.
    pub fn expire_approvals(&mut self, now: Deadline) -> usize {
        let mut expired = 0;
        for approval in self.approvals.values_mut() {
            if approval.state == ApprovalState::Pending && approval.state_at(now) == ApprovalState::Expired {
                approval.state = ApprovalState::Expired;
                expired += 1;
            }
        }
        if expired > 0 {
            self.trim_resolved();
            self.bump();
        }
        expired
    }

    /// Approves (`approve`) or denies pending approval `id` at `now`; returns the
    /// record. One whose deadline has passed is marked [`ApprovalState::Expired`]
    /// instead, and returned so: nothing waits for it any more (the caller reports
    /// [`OrgError::Expired`], after the change is stored).
    ///
    /// # Errors
    /// [`OrgError::NotPending`] if there is no such approval or it is resolved.
    pub fn resolve_approval(&mut self, id: u64, approve: bool, now: Deadline) -> Result<Approval, OrgError> {
        let approval = self
            .approvals
            .get_mut(&id)
            .filter(|approval| approval.state == ApprovalState::Pending)
            .ok_or(OrgError::NotPending { id })?;
        approval.state = match approval.state_at(now) {
            ApprovalState::Expired => ApprovalState::Expired,
            _ if approve => ApprovalState::Approved,
            _ => ApprovalState::Denied,
        };
        let resolved = approval.clone();
        self.trim_resolved();
        self.bump();
        Ok(resolved)
    }

    /// Keeps at most [`ORG_APPROVALS_RESOLVED_KEPT_MAX`] resolved (or expired)
    /// approvals, the newest.
    fn trim_resolved(&mut self) {
        let mut resolved_ids: Vec<u64> = self
            .approvals
            .values()
            .filter(|approval| approval.state != ApprovalState::Pending)
            .map(|approval| approval.id)
            .collect();
        while resolved_ids.len() > ORG_APPROVALS_RESOLVED_KEPT_MAX {
            self.approvals.remove(&resolved_ids.remove(0));
        }
    }

    /// Approval `id`, if it is pending or among the last resolved.
    pub fn approval(&self, id: u64) -> Option<&Approval> {
        self.approvals.get(&id)
    }

    /// Every approval stored as pending, listed or not, oldest first (some may be past
    /// their deadline: see [`Organisation::pending_approvals_at`]).
    pub fn pending_approvals(&self) -> Vec<Approval> {
        self.approvals
            .values()
            .filter(|approval| approval.state == ApprovalState::Pending)
            .cloned()
            .collect()
    }

    /// Every approval kept (pending, and the latest resolved ones, at most
    /// [`ORG_APPROVALS_RESOLVED_KEPT_MAX`]), by id.
    pub fn approvals(&self) -> impl Iterator<Item = &Approval> {
        self.approvals.values()
    }

    /// Every listed approval pending at `now` (stored as pending, its deadline not
    /// passed, [`Approval::listed`]), oldest first: what a person has to resolve.
    pub fn pending_approvals_at(&self, now: Deadline) -> Vec<Approval> {
        self.approvals
            .values()
            .filter(|approval| approval.listed && approval.state_at(now) == ApprovalState::Pending)
            .cloned()
            .collect()
    }

    /// Sets the policy.
    pub fn set_policy(&mut self, policy: OrgPolicy) {
        self.policy = policy;
        self.bump();
    }

    /// Whether `manager` manages `report` directly.
    fn manages(&self, manager: &str, report: &str) -> bool {
        self.members
            .get(report)
            .is_some_and(|member| member.manager.as_deref() == Some(manager))
    }

    /// The link layer: may `from` start contact with `to`? (Ignores the policy.)
    fn link_allows(&self, from: &str, to: &str) -> Result<(), NotPermittedReason> {
        let forward = self.link(from, to);
        let backward = self.link(to, from);
        let starts = |link: Option<&Link>, own: bool| {
            link.is_some_and(|link| link.enabled && (own || link.direction == LinkDirection::TwoWay))
        };
        if starts(forward, true) || starts(backward, false) {
            return Ok(());
        }
        if backward.is_some_and(|link| link.enabled) {
            return Err(NotPermittedReason::OneWayLink);
        }
        if forward.is_some() || backward.is_some() {
            return Err(NotPermittedReason::LinkDisabled);
        }
        Err(NotPermittedReason::NoLink)
    }

    /// May agent `from` start a `kind` contact with agent `to`? See the module docs
    /// for the order. Contact with oneself is not the organisation's business (the
    /// runtime's admission refuses it as a cycle): it is permitted here.
    ///
    /// # Errors
    /// [`NotPermitted`] naming the reason.
    pub fn decide(&self, from: &str, to: &str, kind: ContactKind) -> Result<Permitted, NotPermitted> {
        if from == to || self.manages(to, from) || self.manages(from, to) {
            return Ok(Permitted::Hierarchy);
        }
        let refuse = |reason| NotPermitted {
            from: from.to_string(),
            to: to.to_string(),
            kind,
            reason,
        };
        if self.policy == OrgPolicy::Enforced {
            self.link_allows(from, to).map_err(refuse)?;
        }
        let empty = BTreeMap::new();
        let rules = self.rules.get(from).unwrap_or(&empty);
        match resolve_permission(rules, self.membership(from).mode, to) {
            PermissionVerdict::Allow => Ok(Permitted::Allowed),
            PermissionVerdict::RequiresApproval { rule, mode } => Ok(Permitted::NeedsApproval { rule, mode }),
            PermissionVerdict::Deny(rule) => Err(refuse(NotPermittedReason::Denied(rule))),
        }
    }

    /// The agents among `agents` that `from` may start contact with (possibly after
    /// approval), with what each is to `from`; at most [`ORG_PROMPT_AGENTS_LISTED_MAX`].
    pub fn reachable(&self, from: &str, agents: &[String]) -> Vec<(String, Option<LinkRelationship>)> {
        agents
            .iter()
            .filter(|agent| agent.as_str() != from)
            .filter(|agent| self.decide(from, agent, ContactKind::Ask).is_ok())
            .take(ORG_PROMPT_AGENTS_LISTED_MAX)
            .map(|agent| (agent.clone(), self.relationship(from, agent)))
            .collect()
    }

    /// What `other` is to `agent`: from the hierarchy first, then from an enabled link.
    pub fn relationship(&self, agent: &str, other: &str) -> Option<LinkRelationship> {
        if self.manages(other, agent) {
            return Some(LinkRelationship::Superior);
        }
        if self.manages(agent, other) {
            return Some(LinkRelationship::Subordinate);
        }
        // A link agent → other says what agent is to other: invert it.
        if let Some(link) = self.link(agent, other).filter(|link| link.enabled) {
            return Some(link.relationship.inverse());
        }
        self.link(other, agent)
            .filter(|link| link.enabled)
            .map(|link| link.relationship)
    }

    /// The organisation section of `agent`'s system prompt (empty when the agent has
    /// no manager, reports or enabled links): who it reports to, who reports to it, its
    /// peers, each with whether it may start contact or only reply.
    pub fn prompt_section(&self, agent: &str) -> String {
        let mut related: BTreeMap<String, LinkRelationship> = BTreeMap::new();
        for link in self.links().iter().filter(|link| link.enabled) {
            if link.from == agent {
                related.insert(link.to.clone(), link.relationship.inverse());
            } else if link.to == agent {
                related.insert(link.from.clone(), link.relationship);
            }
        }
        if let Some(manager) = self.membership(agent).manager {
            related.insert(manager, LinkRelationship::Superior);
        }
        for report in self.reports_of(agent) {
            related.insert(report, LinkRelationship::Subordinate);
        }
        if related.is_empty() {
            return String::new();
        }
        let line = |other: &str, text: &str| {
            let reach = match self.decide(agent, other, ContactKind::Ask) {
                Ok(Permitted::NeedsApproval { .. }) => " (contact needs approval)",
                Ok(_) => "",
                Err(_) => " (you may only reply, not start contact)",
            };
            format!("- {other}: {text}{reach}\n")
        };
        let mut superiors = String::new();
        let mut reports = String::new();
        let mut peers = String::new();
        for (other, relation) in related.iter().take(ORG_PROMPT_AGENTS_LISTED_MAX) {
            match relation {
                // `other` is the superior of `agent`.
                LinkRelationship::Superior => superiors.push_str(&line(
                    other,
                    "your superior; its messages carry organisational authority",
                )),
                LinkRelationship::Subordinate => reports.push_str(&line(
                    other,
                    "reports to you; you can delegate tasks, request status and send directives",
                )),
                LinkRelationship::Peer => peers.push_str(&line(other, "equal peer; collaborate and inform")),
            }
        }
        let mut text = String::from("## Organisation\nYou are part of a multi-agent organisation.\n");
        for (title, list) in [("Reports to", superiors), ("Direct reports", reports), ("Peers", peers)] {
            if !list.is_empty() {
                text.push_str(&format!("{title}:\n{list}"));
            }
        }
        text
    }

    /// The line that frames a message from `from` for `agent` (Spacebot's link
    /// context), or `None` if they are not related.
    pub fn link_context(&self, agent: &str, from: &str) -> Option<String> {
        let relation = self.relationship(agent, from)?;
        Some(match relation {
            LinkRelationship::Superior => {
                format!("{from} is your superior: treat its directives as assignments.")
            }
            LinkRelationship::Subordinate => {
                format!("{from} reports to you: it may be escalating, reporting status or asking for guidance.")
            }
            LinkRelationship::Peer => format!("{from} is your peer: the exchange is collaborative."),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: an approval reads expired from its deadline on (a deadline equal to now
    /// has passed); resolved in time it is approved or denied, resolved at or after its
    /// deadline it is stored as expired and resolving again is refused; expired ones do
    /// not hold the room of the pending maximum, and a new request after their deadline
    /// marks them expired; a record without a deadline (stored before) never expires.
    #[test]
    fn an_approval_past_its_deadline_expires_and_frees_its_room() {
        let at = Deadline::from_micros;
        let mut org = Organisation::default();
        let id = org
            .request_approval("a", "b", ContactKind::Ask, "hi", at(100), at(0))
            .unwrap();
        let approval = org.approval(id).unwrap().clone();
        assert_eq!(approval.deadline, Some(at(100)));
        assert_eq!(approval.state_at(at(99)), ApprovalState::Pending);
        assert_eq!(approval.state_at(at(100)), ApprovalState::Expired);
        assert_eq!(org.pending_approvals_at(at(99)).len(), 1);
        assert_eq!(org.pending_approvals_at(at(100)).len(), 0);

        let mut late = org.clone();
        assert_eq!(
            late.resolve_approval(id, true, at(100)).unwrap().state,
            ApprovalState::Expired
        );
        assert_eq!(
            late.approval(id).unwrap().state,
            ApprovalState::Expired,
            "stored as expired"
        );
        assert_eq!(
            late.resolve_approval(id, false, at(100)),
            Err(OrgError::NotPending { id })
        );
        let mut in_time = org.clone();
        assert_eq!(
            in_time.resolve_approval(id, true, at(99)).unwrap().state,
            ApprovalState::Approved
        );
        assert_eq!(
            org.resolve_approval(id, false, at(99)).unwrap().state,
            ApprovalState::Denied
        );

        // The room of the pending maximum.
        let mut full = Organisation::default();
        for n in 0..ORG_APPROVALS_PENDING_MAX {
            full.request_approval("a", "b", ContactKind::Ask, &n.to_string(), at(1_000), at(0))
                .unwrap();
        }
        assert!(matches!(
            full.request_approval("a", "b", ContactKind::Ask, "one more", at(5_000), at(999)),
            Err(OrgError::TooMany { .. })
        ));
        let newest = full
            .request_approval("a", "b", ContactKind::Ask, "one more", at(5_000), at(1_000))
            .unwrap();
        let pending = full.pending_approvals();
        assert_eq!(pending.len(), 1, "the expired ones are stored as expired");
        assert_eq!(pending[0].id, newest);
        let expired = full
            .approvals
            .values()
            .filter(|approval| approval.state == ApprovalState::Expired)
            .count();
        assert_eq!(expired, ORG_APPROVALS_RESOLVED_KEPT_MAX.min(ORG_APPROVALS_PENDING_MAX));

        // A record stored before deadlines were kept never expires.
        let old: Approval = serde_json::from_str(
            r#"{"id": 7, "from": "a", "to": "b", "kind": "ask", "message": "hi", "state": "pending"}"#,
        )
        .unwrap();
        assert_eq!(old.deadline, None);
        assert_eq!(old.state_at(at(u64::MAX)), ApprovalState::Pending);
        assert!(old.listed, "records stored before the listing existed were all listed");
    }

    /// Goal: an approval requested for a contact that a turn has not committed yet is
    /// not listed for a person until its delivery lists it, once, before its deadline;
    /// it can be resolved by its id meanwhile, and a resolved one is never listed; an
    /// unlisted pending one can be withdrawn (its send failed a later check).
    #[test]
    fn an_unlisted_approval_is_listed_once_its_delivery_waits_for_it() {
        let at = Deadline::from_micros;
        let mut org = Organisation::default();
        let listed = org
            .request_approval("a", "b", ContactKind::Ask, "now", at(100), at(0))
            .unwrap();
        let held = org
            .request_unlisted_approval("a", "b", ContactKind::Delegate, "later", at(100), at(0))
            .unwrap();
        let ids = |org: &Organisation| -> Vec<u64> { org.pending_approvals_at(at(1)).iter().map(|a| a.id).collect() };
        assert_eq!(ids(&org), vec![listed]);
        assert_eq!(org.pending_approvals().len(), 2, "both are stored as pending");
        assert!(!org.approval(held).unwrap().listed);

        let version = org.version();
        assert!(org.list_approval(held, at(1)));
        assert_eq!(org.version(), version + 1, "listing is a change");
        assert_eq!(ids(&org), vec![listed, held]);
        assert!(!org.list_approval(held, at(1)), "listed once");
        assert!(!org.list_approval(listed, at(1)));
        assert!(!org.list_approval(99, at(1)), "no such approval");
        assert_eq!(org.version(), version + 1);

        // Past its deadline it is not listed: nothing waits for it any more.
        let late = org
            .request_unlisted_approval("a", "b", ContactKind::Delegate, "late", at(10), at(0))
            .unwrap();
        assert!(!org.list_approval(late, at(10)));
        assert!(!org.approval(late).unwrap().listed);

        // Withdrawn: only an unlisted pending one, and it frees its room.
        let withdrawn = org
            .request_unlisted_approval("a", "b", ContactKind::Notify, "not sent after all", at(100), at(0))
            .unwrap();
        let pending = org.pending_approvals().len();
        assert!(!org.withdraw_approval(listed), "a listed approval stays");
        assert!(org.withdraw_approval(withdrawn));
        assert_eq!(org.approval(withdrawn), None);
        assert_eq!(org.pending_approvals().len(), pending - 1);
        assert!(!org.withdraw_approval(withdrawn));

        let resolved = org
            .request_unlisted_approval("a", "b", ContactKind::Notify, "resolved first", at(100), at(0))
            .unwrap();
        assert_eq!(
            org.resolve_approval(resolved, true, at(1)).unwrap().state,
            ApprovalState::Approved
        );
        assert!(!org.list_approval(resolved, at(1)), "a resolved approval is not listed");
        assert!(!org.withdraw_approval(resolved), "nor withdrawn");
        assert_eq!(ids(&org), vec![listed, held]);
    }

    #[test]
    fn an_approval_whose_call_stopped_waiting_is_expired_and_no_longer_listed() {
        let at = Deadline::from_micros;
        let mut org = Organisation::default();
        let gone = org
            .request_approval("a", "b", ContactKind::Ask, "caller gave up", at(100), at(0))
            .unwrap();
        let kept = org
            .request_approval("a", "c", ContactKind::Ask, "still waits", at(100), at(0))
            .unwrap();
        let version = org.version();
        assert!(
            !org.abandon_approval(gone, at(100)),
            "past its deadline it expires by it"
        );
        assert_eq!(org.approval(gone).unwrap().state, ApprovalState::Pending);
        assert!(org.abandon_approval(gone, at(1)));
        assert_eq!(org.version(), version + 1, "a change");
        assert_eq!(org.approval(gone).unwrap().state, ApprovalState::Expired);
        let ids: Vec<u64> = org.pending_approvals_at(at(1)).iter().map(|a| a.id).collect();
        assert_eq!(ids, vec![kept]);
        assert_eq!(org.pending_approvals().len(), 1, "it no longer holds room");
        assert_eq!(
            org.resolve_approval(gone, true, at(1)),
            Err(OrgError::NotPending { id: gone })
        );
        assert!(!org.abandon_approval(gone, at(1)), "once");
        org.resolve_approval(kept, false, at(1)).unwrap();
        assert!(!org.abandon_approval(kept, at(1)), "a resolved one stays as resolved");
        assert_eq!(org.approval(kept).unwrap().state, ApprovalState::Denied);
        assert!(!org.abandon_approval(99, at(1)), "no such approval");
        assert_eq!(org.version(), version + 2);
    }

    fn org(policy: OrgPolicy) -> Organisation {
        let mut org = Organisation::default();
        org.set_policy(policy);
        org
    }

    fn reason(result: Result<Permitted, NotPermitted>) -> Option<NotPermittedReason> {
        result.err().map(|refused| refused.reason)
    }

    /// Goal: links decide under the enforced policy exactly as the Spacebot design says.
    /// Method: one row per case: the links, the contact, the expected refusal.
    #[test]
    fn links_decide_who_may_start_contact_under_the_enforced_policy() {
        use NotPermittedReason::{LinkDisabled, NoLink, OneWayLink};
        let two_way = Link::new("a", "b");
        let one_way = Link::new("a", "b").direction(LinkDirection::OneWay);
        type Row = (
            &'static str,
            Vec<Link>,
            &'static str,
            &'static str,
            Option<NotPermittedReason>,
        );
        let table: Vec<Row> = vec![
            ("no links: refused", vec![], "a", "b", Some(NoLink)),
            ("two-way: source starts", vec![two_way.clone()], "a", "b", None),
            ("two-way: target starts", vec![two_way.clone()], "b", "a", None),
            (
                "two-way: a third agent has no link",
                vec![two_way.clone()],
                "a",
                "c",
                Some(NoLink),
            ),
            ("one-way: source starts", vec![one_way.clone()], "a", "b", None),
            (
                "one-way: target may only reply",
                vec![one_way.clone()],
                "b",
                "a",
                Some(OneWayLink),
            ),
            (
                "disabled: source refused",
                vec![two_way.clone().enabled(false)],
                "a",
                "b",
                Some(LinkDisabled),
            ),
            (
                "disabled: target refused",
                vec![two_way.enabled(false)],
                "b",
                "a",
                Some(LinkDisabled),
            ),
            (
                "one-way both ways: both start",
                vec![one_way.clone(), Link::new("b", "a").direction(LinkDirection::OneWay)],
                "b",
                "a",
                None,
            ),
        ];
        for (name, links, from, to, expected) in table {
            let mut org = org(OrgPolicy::Enforced);
            for link in links {
                org.upsert_link(link).unwrap();
            }
            assert_eq!(reason(org.decide(from, to, ContactKind::Notify)), expected, "{name}");
        }
    }

    /// Goal: the open policy ignores links but not rules; the hierarchy bypasses links,
    /// rules and modes under both policies.
    #[test]
    fn open_policy_ignores_links_and_the_hierarchy_bypasses_everything() {
        let mut open = org(OrgPolicy::Open);
        assert_eq!(open.decide("a", "b", ContactKind::Ask), Ok(Permitted::Allowed));
        open.set_rule("a", PermissionRule::deny("b")).unwrap();
        assert_eq!(
            reason(open.decide("a", "b", ContactKind::Ask)),
            Some(NotPermittedReason::Denied(RuleMatch::ExplicitDeny))
        );
        for policy in [OrgPolicy::Open, OrgPolicy::Enforced] {
            let mut org = org(policy);
            org.set_rule("boss", PermissionRule::deny("*")).unwrap();
            org.set_rule("worker", PermissionRule::deny("*")).unwrap();
            org.set_membership(
                "worker",
                Membership {
                    manager: Some("boss".into()),
                    mode: BehaviourMode::Strict,
                },
            )
            .unwrap();
            assert_eq!(org.decide("worker", "boss", ContactKind::Ask), Ok(Permitted::Hierarchy));
            assert_eq!(
                org.decide("boss", "worker", ContactKind::Delegate),
                Ok(Permitted::Hierarchy)
            );
            assert!(
                org.decide("worker", "other", ContactKind::Notify).is_err(),
                "{policy:?}"
            );
        }
    }

    /// Goal: a supervised agent's contact needs approval; the rules come after links.
    #[test]
    fn rules_and_modes_apply_after_links() {
        let mut org = org(OrgPolicy::Enforced);
        org.upsert_link(Link::new("intern", "senior")).unwrap();
        org.set_membership(
            "intern",
            Membership {
                manager: None,
                mode: BehaviourMode::Supervised,
            },
        )
        .unwrap();
        assert_eq!(
            org.decide("intern", "senior", ContactKind::Ask),
            Ok(Permitted::NeedsApproval {
                rule: RuleMatch::Default,
                mode: BehaviourMode::Supervised
            })
        );
        // The link check refuses before the rules are read.
        org.set_rule("intern", PermissionRule::allow("other")).unwrap();
        assert_eq!(
            reason(org.decide("intern", "other", ContactKind::Ask)),
            Some(NotPermittedReason::NoLink)
        );
    }

    #[test]
    fn bad_changes_are_refused_with_what_was_wrong() {
        let mut org = Organisation::default();
        assert_eq!(
            org.upsert_link(Link::new("a", "a")),
            Err(OrgError::SelfLink { agent: "a".into() })
        );
        assert!(matches!(
            org.upsert_link(Link::new("*", "a")),
            Err(OrgError::InvalidAgentId {
                what: "link source",
                ..
            })
        ));
        assert_eq!(
            org.remove_link("a", "b"),
            Err(OrgError::NoSuchLink {
                from: "a".into(),
                to: "b".into()
            })
        );
        let managed_by = |manager: &str| Membership {
            manager: Some(manager.to_string()),
            mode: BehaviourMode::Autonomous,
        };
        org.set_membership("b", managed_by("a")).unwrap();
        org.set_membership("c", managed_by("b")).unwrap();
        assert!(matches!(
            org.set_membership("a", managed_by("c")),
            Err(OrgError::ManagerCycle { .. })
        ));
        assert_eq!(org.version(), 2);
    }

    #[test]
    fn the_prompt_section_groups_by_relationship_and_marks_reply_only_agents() {
        let mut org = org(OrgPolicy::Enforced);
        org.upsert_link(
            Link::new("boss", "me")
                .relationship(LinkRelationship::Superior)
                .direction(LinkDirection::OneWay),
        )
        .unwrap();
        org.upsert_link(Link::new("me", "peer")).unwrap();
        org.set_membership(
            "report",
            Membership {
                manager: Some("me".into()),
                mode: BehaviourMode::Autonomous,
            },
        )
        .unwrap();
        let text = org.prompt_section("me");
        assert!(text.contains("Reports to:\n- boss: your superior"), "{text}");
        assert!(text.contains("(you may only reply, not start contact)"), "{text}");
        assert!(text.contains("Direct reports:\n- report: reports to you"), "{text}");
        assert!(text.contains("Peers:\n- peer: equal peer"), "{text}");
        assert_eq!(org.prompt_section("stranger"), "");
        assert_eq!(
            org.link_context("me", "boss").unwrap(),
            "boss is your superior: treat its directives as assignments."
        );
        let agents: Vec<String> = ["boss", "me", "peer", "report", "stranger"].map(String::from).to_vec();
        let reachable: Vec<String> = org.reachable("me", &agents).into_iter().map(|(id, _)| id).collect();
        assert_eq!(reachable, ["peer", "report"]);
    }
}
