//! Per-agent contact permissions, resolved in the OpenCompany design's order.
//!
//! Each agent has at most one [`PermissionRule`] per target: an agent id, or the
//! wildcard [`PERMISSION_TARGET_ANY`]. Whether agent `a` may contact `b` is resolved by
//! [`resolve_permission`], exactly in this order:
//!
//! ```text
//! 1. a has an explicit deny for b       → Deny
//! 2. a has an explicit allow for b      → Allow (or RequiresApproval if the rule says so)
//! 3. a has a wildcard deny ("*")        → Deny
//! 4. a has a wildcard allow ("*")       → Allow (or RequiresApproval if the rule says so)
//! 5. no rule applies                    → Allow (the default: backward compatible)
//! 6. a's behaviour mode on top:
//!      autonomous → unchanged
//!      supervised → an Allow becomes RequiresApproval (contacting an agent is a write)
//!      strict     → an Allow becomes RequiresApproval (everything needs approval)
//! ```
//!
//! A deny is never softened by the mode. The manager hierarchy bypass (an agent's own
//! manager and its direct reports are always reachable) is applied before these rules,
//! in [`crate::Organisation::decide`]: it skips them entirely, as in the seed.
//!
//! This module does no I/O; it is what the table-driven and property tests cover.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The target of a rule that applies to every agent without a rule of its own.
pub const PERMISSION_TARGET_ANY: &str = "*";

/// Whether a rule allows or denies contact.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PermissionEffect {
    /// Contact is allowed (possibly only after approval).
    Allow,
    /// Contact is refused.
    Deny,
}

/// One rule of an agent: may it contact `target` (an agent id, or `*`)?
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PermissionRule {
    /// An agent id, or [`PERMISSION_TARGET_ANY`].
    pub target: String,
    /// Allow or deny.
    pub effect: PermissionEffect,
    /// For an allow: contact waits for a human's (or an API caller's) approval.
    #[serde(default)]
    pub requires_approval: bool,
}

impl PermissionRule {
    /// Allows contact with `target` without approval.
    pub fn allow(target: impl Into<String>) -> Self {
        Self {
            target: target.into(),
            effect: PermissionEffect::Allow,
            requires_approval: false,
        }
    }

    /// Allows contact with `target` after approval.
    pub fn allow_with_approval(target: impl Into<String>) -> Self {
        Self {
            requires_approval: true,
            ..Self::allow(target)
        }
    }

    /// Denies contact with `target`.
    pub fn deny(target: impl Into<String>) -> Self {
        Self {
            target: target.into(),
            effect: PermissionEffect::Deny,
            requires_approval: false,
        }
    }

    /// Whether the rule is the wildcard.
    pub fn is_wildcard(&self) -> bool {
        self.target == PERMISSION_TARGET_ANY
    }
}

/// How much an agent may do on its own (the seed's behaviour modes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BehaviourMode {
    /// No additional approval.
    #[default]
    Autonomous,
    /// Write tools need approval; contacting an agent is a write.
    Supervised,
    /// Every tool needs approval.
    Strict,
}

/// Which step of the resolution order decided (steps 1 to 5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RuleMatch {
    /// Step 1: an explicit deny for the target.
    ExplicitDeny,
    /// Step 2: an explicit allow for the target.
    ExplicitAllow {
        /// The rule's approval flag.
        requires_approval: bool,
    },
    /// Step 3: the wildcard deny.
    WildcardDeny,
    /// Step 4: the wildcard allow.
    WildcardAllow {
        /// The rule's approval flag.
        requires_approval: bool,
    },
    /// Step 5: no rule applies.
    Default,
}

impl RuleMatch {
    /// A short description: `explicit deny`, `wildcard allow`, ...
    pub fn describe(self) -> &'static str {
        match self {
            Self::ExplicitDeny => "explicit deny",
            Self::ExplicitAllow { .. } => "explicit allow",
            Self::WildcardDeny => "wildcard deny",
            Self::WildcardAllow { .. } => "wildcard allow",
            Self::Default => "default",
        }
    }
}

/// The result of resolving the rules and the behaviour mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PermissionVerdict {
    /// Contact may start now.
    Allow,
    /// Contact may start once approved.
    RequiresApproval {
        /// The step that allowed it.
        rule: RuleMatch,
        /// The mode of the contacting agent (an approval may come from the rule or
        /// from the mode).
        mode: BehaviourMode,
    },
    /// Contact is refused by this step (an explicit or wildcard deny).
    Deny(RuleMatch),
}

/// Steps 1 to 5: which rule of `rules` (one per target) decides for `target`.
pub fn match_rules(rules: &BTreeMap<String, PermissionRule>, target: &str) -> RuleMatch {
    let explicit = rules.get(target).filter(|rule| !rule.is_wildcard());
    let wildcard = rules.get(PERMISSION_TARGET_ANY);
    match (explicit, wildcard) {
        (Some(rule), _) if rule.effect == PermissionEffect::Deny => RuleMatch::ExplicitDeny,
        (Some(rule), _) => RuleMatch::ExplicitAllow {
            requires_approval: rule.requires_approval,
        },
        (None, Some(rule)) if rule.effect == PermissionEffect::Deny => RuleMatch::WildcardDeny,
        (None, Some(rule)) => RuleMatch::WildcardAllow {
            requires_approval: rule.requires_approval,
        },
        (None, None) => RuleMatch::Default,
    }
}

/// Steps 1 to 6: the verdict for an agent with `rules` and `mode` contacting `target`.
pub fn resolve_permission(
    rules: &BTreeMap<String, PermissionRule>,
    mode: BehaviourMode,
    target: &str,
) -> PermissionVerdict {
    let rule = match_rules(rules, target);
    let rule_requires_approval = match rule {
        RuleMatch::ExplicitDeny | RuleMatch::WildcardDeny => return PermissionVerdict::Deny(rule),
        RuleMatch::ExplicitAllow { requires_approval } | RuleMatch::WildcardAllow { requires_approval } => {
            requires_approval
        }
        RuleMatch::Default => false,
    };
    let mode_requires_approval = match mode {
        BehaviourMode::Autonomous => false,
        BehaviourMode::Supervised | BehaviourMode::Strict => true,
    };
    if rule_requires_approval || mode_requires_approval {
        PermissionVerdict::RequiresApproval { rule, mode }
    } else {
        PermissionVerdict::Allow
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn rules(list: &[PermissionRule]) -> BTreeMap<String, PermissionRule> {
        list.iter().map(|rule| (rule.target.clone(), rule.clone())).collect()
    }

    /// Goal: the seed's examples resolve as the seed says. Method: one row per example
    /// (and per step of the order), each with the rules, the mode, the target and the
    /// expected verdict.
    #[test]
    fn the_seed_examples_resolve_in_the_seed_order() {
        use BehaviourMode::{Autonomous, Strict, Supervised};
        let approval = |rule, mode| PermissionVerdict::RequiresApproval { rule, mode };
        let allow_any = PermissionRule::allow(PERMISSION_TARGET_ANY);
        type Row = (
            &'static str,
            Vec<PermissionRule>,
            BehaviourMode,
            &'static str,
            PermissionVerdict,
        );
        let table: Vec<Row> = vec![
            // DataBot can contact anyone freely.
            (
                "databot: wildcard allow",
                vec![allow_any.clone()],
                Autonomous,
                "writer",
                PermissionVerdict::Allow,
            ),
            // WriterBot may contact CoordinatorBot; no wildcard: default allow for others.
            (
                "writer: explicit allow",
                vec![PermissionRule::allow("coordinator")],
                Autonomous,
                "coordinator",
                PermissionVerdict::Allow,
            ),
            (
                "writer: default for others",
                vec![PermissionRule::allow("coordinator")],
                Autonomous,
                "archive",
                PermissionVerdict::Allow,
            ),
            // ... "but you could add a wildcard deny".
            (
                "writer: wildcard deny for others",
                vec![
                    PermissionRule::allow("coordinator"),
                    PermissionRule::deny(PERMISSION_TARGET_ANY),
                ],
                Autonomous,
                "archive",
                PermissionVerdict::Deny(RuleMatch::WildcardDeny),
            ),
            (
                "writer: explicit allow beats wildcard deny",
                vec![
                    PermissionRule::allow("coordinator"),
                    PermissionRule::deny(PERMISSION_TARGET_ANY),
                ],
                Autonomous,
                "coordinator",
                PermissionVerdict::Allow,
            ),
            // InternBot needs approval for all agent contact.
            (
                "intern: wildcard allow with approval",
                vec![PermissionRule::allow_with_approval(PERMISSION_TARGET_ANY)],
                Autonomous,
                "senior",
                approval(
                    RuleMatch::WildcardAllow {
                        requires_approval: true,
                    },
                    Autonomous,
                ),
            ),
            // No one can contact ArchiveBot.
            (
                "anyone: explicit deny of archive",
                vec![PermissionRule::deny("archive"), allow_any.clone()],
                Autonomous,
                "archive",
                PermissionVerdict::Deny(RuleMatch::ExplicitDeny),
            ),
            (
                "anyone: others still allowed",
                vec![PermissionRule::deny("archive"), allow_any.clone()],
                Autonomous,
                "writer",
                PermissionVerdict::Allow,
            ),
            // Step 5: no rules at all.
            (
                "no rules: default allow",
                vec![],
                Autonomous,
                "anyone",
                PermissionVerdict::Allow,
            ),
            // Step 6: Example 7, a supervised intern needs approval even where rules allow.
            (
                "supervised: default needs approval",
                vec![],
                Supervised,
                "senior",
                approval(RuleMatch::Default, Supervised),
            ),
            (
                "supervised: explicit allow needs approval",
                vec![PermissionRule::allow("senior")],
                Supervised,
                "senior",
                approval(
                    RuleMatch::ExplicitAllow {
                        requires_approval: false,
                    },
                    Supervised,
                ),
            ),
            (
                "strict: wildcard allow needs approval",
                vec![allow_any],
                Strict,
                "senior",
                approval(
                    RuleMatch::WildcardAllow {
                        requires_approval: false,
                    },
                    Strict,
                ),
            ),
            // A deny is never turned into an approval by the mode.
            (
                "strict: explicit deny stays deny",
                vec![PermissionRule::deny("senior")],
                Strict,
                "senior",
                PermissionVerdict::Deny(RuleMatch::ExplicitDeny),
            ),
            (
                "supervised: wildcard deny stays deny",
                vec![PermissionRule::deny(PERMISSION_TARGET_ANY)],
                Supervised,
                "senior",
                PermissionVerdict::Deny(RuleMatch::WildcardDeny),
            ),
        ];
        for (name, list, mode, target, expected) in table {
            assert_eq!(resolve_permission(&rules(&list), mode, target), expected, "{name}");
        }
    }

    fn arbitrary_rule() -> impl Strategy<Value = PermissionRule> {
        (
            prop::sample::select(vec!["a", "b", "c", PERMISSION_TARGET_ANY]),
            any::<bool>(),
            any::<bool>(),
        )
            .prop_map(|(target, deny, requires_approval)| PermissionRule {
                target: target.to_string(),
                effect: if deny {
                    PermissionEffect::Deny
                } else {
                    PermissionEffect::Allow
                },
                requires_approval,
            })
    }

    fn arbitrary_mode() -> impl Strategy<Value = BehaviourMode> {
        prop::sample::select(vec![
            BehaviourMode::Autonomous,
            BehaviourMode::Supervised,
            BehaviourMode::Strict,
        ])
    }

    proptest! {
        /// Goal: the resolution agrees with a direct reading of the seed's list, for any
        /// rules, mode and target. Method: an independent model walks the five steps as
        /// a list of (applies?, outcome) and takes the first that applies.
        #[test]
        fn resolution_matches_a_step_by_step_model(
            list in prop::collection::vec(arbitrary_rule(), 0..6),
            mode in arbitrary_mode(),
            target in prop::sample::select(vec!["a", "b", "c", "d"]),
        ) {
            let rules = rules(&list);
            let explicit = rules.get(target);
            let wildcard = rules.get(PERMISSION_TARGET_ANY);
            let is = |rule: Option<&PermissionRule>, effect| rule.is_some_and(|rule| rule.effect == effect);
            let approval_flag = |rule: Option<&PermissionRule>| rule.is_some_and(|rule| rule.requires_approval);
            // None: blocked; Some(flag): allowed, with the rule's approval flag.
            let steps: [(bool, Option<bool>); 5] = [
                (is(explicit, PermissionEffect::Deny), None),
                (is(explicit, PermissionEffect::Allow), Some(approval_flag(explicit))),
                (is(wildcard, PermissionEffect::Deny), None),
                (is(wildcard, PermissionEffect::Allow), Some(approval_flag(wildcard))),
                (true, Some(false)),
            ];
            let (_, outcome) = steps.iter().find(|(applies, _)| *applies).copied().unwrap();
            let verdict = resolve_permission(&rules, mode, target);
            match outcome {
                None => prop_assert!(matches!(verdict, PermissionVerdict::Deny(_)), "{verdict:?}"),
                Some(flag) => {
                    let needs = flag || mode != BehaviourMode::Autonomous;
                    prop_assert_eq!(needs, matches!(verdict, PermissionVerdict::RequiresApproval { .. }), "{:?}", verdict);
                    prop_assert_eq!(!needs, verdict == PermissionVerdict::Allow, "{:?}", verdict);
                }
            }
            // A wildcard rule never overrides an explicit rule for the target.
            if let Some(rule) = explicit {
                prop_assert_eq!(rule.effect == PermissionEffect::Deny, matches!(verdict, PermissionVerdict::Deny(RuleMatch::ExplicitDeny)));
            }
        }
    }
}
