//! The organisation's part of [`AgentClient`]: links, permissions, memberships, the
//! policy, approvals, and asking as an agent. Every change is committed to the store
//! before it returns, and every admission after it returns reads it (see
//! `org_store.rs`).

use std::sync::Arc;
use std::time::Duration;

use troupe_core::limits::INVOKE_TIMEOUT_MS_MAX;
use troupe_core::{truncate_utf8, CallRefused};

use crate::agent::{agent_id, AgentRequest};
use crate::limits::AGENT_MESSAGE_SIZE_MAX_BYTES;
use crate::org_store::{admit_contact, Contact};
use crate::{
    AgentCallError, AgentClient, AgentEvent, AgentReply, Approval, ApprovalState, ContactKind, Link, LinkPatch,
    Membership, OrgError, OrgPolicy, Organisation, PermissionRule,
};

impl AgentClient {
    /// The organisation as admission sees it now: read from the store the first time,
    /// and again once the copy this process holds is older than
    /// [`crate::ORG_CACHE_MAX_AGE_MS`] (another process's changes). A store down for a
    /// moment with no copy young enough to keep ([`crate::ORG_CACHE_STALE_MAX_MS`]) is
    /// read again for up to [`crate::AGENT_API_STORE_WAIT_MS`]; a copy young enough is
    /// answered as admission decides on it: at once when the store fails, within
    /// [`crate::ORG_READ_LOCK_WAIT_MS`] when a change of this process holds the writers'
    /// lock (one waiting out the store).
    ///
    /// # Errors
    /// [`OrgError::Store`] or [`OrgError::Decode`].
    pub async fn organisation(&self) -> Result<Arc<Organisation>, OrgError> {
        let clock = self.runtime.clock();
        match self.shared.org.current(self.runtime.store().as_ref(), &clock).await {
            Err(OrgError::Store(error)) if error.is_transient() => {
                self.shared.org.current(&self.api_store(), &clock).await
            }
            done => done,
        }
    }

    /// Reads the organisation from the store again at once: changes made by another
    /// process on the same store are seen from then on (without it, at most
    /// [`crate::ORG_CACHE_MAX_AGE_MS`] later). A store down for a moment is read again
    /// for up to [`crate::AGENT_API_STORE_WAIT_MS`].
    ///
    /// # Errors
    /// As [`AgentClient::organisation`].
    pub async fn reload_org(&self) -> Result<Arc<Organisation>, OrgError> {
        self.shared.org.reload(&self.api_store(), &self.runtime.clock()).await
    }

    /// Applies `change` and reports it as [`AgentEvent::OrgChanged`] once committed. The
    /// claim and the commit are tried again while the store is unavailable, for up to
    /// [`crate::AGENT_API_STORE_WAIT_MS`] from the call (the commit as the same commit
    /// under the same fence: `store_wait.rs`).
    async fn change_org<T>(
        &self,
        mut change: impl FnMut(&mut Organisation) -> Result<T, OrgError>,
    ) -> Result<T, OrgError> {
        let mut version = 0;
        let output = self
            .shared
            .org
            .change(&self.api_store(), &self.runtime.clock(), |org| {
                let output = change(org)?;
                version = org.version();
                Ok(output)
            })
            .await?;
        self.shared.emit(&AgentEvent::OrgChanged {
            version,
            at: self.runtime.clock().now(),
        });
        Ok(output)
    }

    /// Resolves approval `id` and reports it as [`AgentEvent::ApprovalResolved`].
    async fn resolve_approval(&self, id: u64, approve: bool) -> Result<Approval, OrgError> {
        let now = self.runtime.clock().now();
        let approval = self.change_org(|org| org.resolve_approval(id, approve, now)).await?;
        if approval.state == ApprovalState::Expired {
            // Stored as expired: nothing waits for it, so nothing was resolved.
            return Err(OrgError::Expired { id });
        }
        self.shared.emit(&AgentEvent::ApprovalResolved {
            approval: approval.clone(),
            at: self.runtime.clock().now(),
        });
        Ok(approval)
    }

    /// Adds `link`. Its agents need not exist yet.
    ///
    /// # Errors
    /// [`OrgError::LinkExists`], [`OrgError::SelfLink`], [`OrgError::InvalidAgentId`],
    /// [`OrgError::TooMany`], [`OrgError::Store`].
    pub async fn add_link(&self, link: Link) -> Result<(), OrgError> {
        self.change_org(|org| {
            if org.link(&link.from, &link.to).is_some() {
                return Err(OrgError::LinkExists {
                    from: link.from.clone(),
                    to: link.to.clone(),
                });
            }
            org.upsert_link(link.clone())
        })
        .await
    }

    /// Replaces the link with `link`'s source and target (direction, relationship,
    /// enabled).
    ///
    /// # Errors
    /// [`OrgError::NoSuchLink`], [`OrgError::Store`].
    pub async fn update_link(&self, link: Link) -> Result<(), OrgError> {
        self.change_org(|org| {
            if org.link(&link.from, &link.to).is_none() {
                return Err(OrgError::NoSuchLink {
                    from: link.from.clone(),
                    to: link.to.clone(),
                });
            }
            org.upsert_link(link.clone())
        })
        .await
    }

    /// Changes the fields `patch` gives of the link from `from` to `to`, keeping the
    /// others, and returns the link as changed. The link is read and written in one
    /// change of the organisation, so two patches of different fields made at once both
    /// land (a [`AgentClient::update_link`] of the whole link from a copy read before
    /// would undo the other's).
    ///
    /// # Errors
    /// [`OrgError::NoSuchLink`], [`OrgError::Store`].
    pub async fn patch_link(&self, from: &str, to: &str, patch: LinkPatch) -> Result<Link, OrgError> {
        self.change_org(|org| {
            let Some(link) = org.link(from, to).cloned() else {
                return Err(OrgError::NoSuchLink {
                    from: from.to_string(),
                    to: to.to_string(),
                });
            };
            let patched = patch.applied_to(link);
            org.upsert_link(patched.clone())?;
            Ok(patched)
        })
        .await
    }

    /// Removes the link from `from` to `to` and returns it.
    ///
    /// # Errors
    /// [`OrgError::NoSuchLink`], [`OrgError::Store`].
    pub async fn remove_link(&self, from: &str, to: &str) -> Result<Link, OrgError> {
        self.change_org(|org| org.remove_link(from, to)).await
    }

    /// Every link.
    ///
    /// # Errors
    /// As [`AgentClient::organisation`].
    pub async fn links(&self) -> Result<Vec<Link>, OrgError> {
        Ok(self.organisation().await?.links())
    }

    /// Sets agent `agent`'s rule for `rule.target` (replacing the one it had).
    ///
    /// # Errors
    /// [`OrgError::InvalidAgentId`], [`OrgError::TooMany`], [`OrgError::Store`].
    pub async fn set_permission(&self, agent: &str, rule: PermissionRule) -> Result<(), OrgError> {
        self.change_org(|org| org.set_rule(agent, rule.clone())).await
    }

    /// Removes agent `agent`'s rule for `target`; returns it, if there was one.
    ///
    /// # Errors
    /// [`OrgError::Store`].
    pub async fn remove_permission(&self, agent: &str, target: &str) -> Result<Option<PermissionRule>, OrgError> {
        self.change_org(|org| Ok(org.remove_rule(agent, target))).await
    }

    /// Sets agent `agent`'s manager and behaviour mode.
    ///
    /// # Errors
    /// [`OrgError::InvalidAgentId`], [`OrgError::ManagerCycle`], [`OrgError::Store`].
    pub async fn set_membership(&self, agent: &str, membership: Membership) -> Result<(), OrgError> {
        self.change_org(|org| org.set_membership(agent, membership.clone()))
            .await
    }

    /// Sets whether links are required.
    ///
    /// # Errors
    /// [`OrgError::Store`].
    pub async fn set_org_policy(&self, policy: OrgPolicy) -> Result<(), OrgError> {
        self.change_org(|org| {
            org.set_policy(policy);
            Ok(())
        })
        .await
    }

    /// Every listed pending approval, oldest first: what a person has to resolve
    /// ([`Organisation::pending_approvals_at`]; an approval whose contact's turn has not
    /// committed is not listed, see [`Approval::listed`]).
    ///
    /// # Errors
    /// As [`AgentClient::organisation`].
    pub async fn pending_approvals(&self) -> Result<Vec<Approval>, OrgError> {
        let now = self.runtime.clock().now();
        Ok(self.organisation().await?.pending_approvals_at(now))
    }

    /// Approval `id` as it stands now (a pending one past its deadline reads
    /// [`ApprovalState::Expired`]), if it is pending or among the last resolved.
    ///
    /// # Errors
    /// As [`AgentClient::organisation`].
    pub async fn approval(&self, id: u64) -> Result<Option<Approval>, OrgError> {
        let now = self.runtime.clock().now();
        Ok(self
            .organisation()
            .await?
            .approval(id)
            .cloned()
            .map(|approval| approval.at(now)))
    }

    /// Approves pending approval `id`: the contact waiting for it proceeds (if the
    /// organisation still allows it).
    ///
    /// # Errors
    /// [`OrgError::NotPending`], [`OrgError::Expired`] (its contact's deadline passed: it
    /// is marked expired, nothing proceeds), [`OrgError::Store`].
    pub async fn approve(&self, id: u64) -> Result<Approval, OrgError> {
        self.resolve_approval(id, true).await
    }

    /// Denies pending approval `id`: the contact waiting for it is refused with
    /// [`crate::NotPermittedReason::ApprovalDenied`] (the model reads it as its tool
    /// result).
    ///
    /// # Errors
    /// [`OrgError::NotPending`], [`OrgError::Expired`], [`OrgError::Store`].
    pub async fn deny(&self, id: u64) -> Result<Approval, OrgError> {
        self.resolve_approval(id, false).await
    }

    /// Sends `text` to agent `to` as agent `from` (the message is introduced as coming
    /// from `from`) and waits up to `timeout` for the reply, after the organisation's
    /// admission as for `from`'s `call_agent` (a contact that needs approval waits for
    /// it within `timeout`). The call is a root of the call tree: `from` is not waiting
    /// in a turn.
    ///
    /// # Errors
    /// [`AgentCallError::NotPermitted`] (nothing sent), [`AgentCallError::Refused`]
    /// (`AgentNotFound` for `from` or `to`), and as [`AgentClient::ask_with_timeout`].
    pub async fn ask_as(
        &self,
        from: &str,
        to: &str,
        text: &str,
        timeout: Duration,
    ) -> Result<AgentReply, AgentCallError> {
        let invalid = |agent: &str, error: troupe_core::IdError| AgentCallError::InvalidAgentId {
            agent_id: agent.to_string(),
            cause: error.to_string(),
        };
        let sender = agent_id(from).map_err(|error| invalid(from, error))?;
        let target = agent_id(to).map_err(|error| invalid(to, error))?;
        for (key, id) in [(from, &sender), (to, &target)] {
            if !self.lists_agent(key).await {
                return Err(AgentCallError::Refused(CallRefused::AgentNotFound {
                    target: id.clone(),
                }));
            }
        }
        let timeout = timeout.min(Duration::from_millis(INVOKE_TIMEOUT_MS_MAX));
        let deadline = self.runtime.deadline_in(timeout);
        let contact = Contact {
            from: &sender,
            to: &target,
            kind: ContactKind::Ask,
            message: text,
            deadline,
        };
        admit_contact(&self.shared, &self.runtime.clock(), contact).await?;
        let request = AgentRequest {
            text: truncate_utf8(text, AGENT_MESSAGE_SIZE_MAX_BYTES).to_string(),
            from: Some(sender),
            call: None,
            budget: crate::Budget::UNLIMITED,
        };
        let bytes = self.runtime.invoke_routed(&target, request.encode(), deadline).await?;
        AgentReply::decode(&bytes).map_err(|cause| AgentCallError::MalformedReply { target, cause })
    }
}

impl AgentClient {
    /// Syncs `config` into this system: every declared agent is upserted into the
    /// directory (its definition replaces one of the same id), then the agents'
    /// definitions and the policy, the declared links, memberships and rules are written
    /// to the store ([`AgentClient::store_config`]).
    /// Config wins for what it declares; agents, links and rules created at runtime and
    /// not declared are kept.
    ///
    /// Each agent's `provider` and `tools` are applied: its turns use that provider's
    /// client and its model is offered (and may run) only those tools.
    ///
    /// Every declared agent is checked first as [`AgentClient::define_agent`] checks a
    /// definition: a tool is accepted when the system had it at start or an attached MCP
    /// server lists it now (a server that said its list changed is read again first).
    ///
    /// # Errors
    /// [`OrgError::Config`] (nothing applied) with [`crate::ConfigError::Agent`] when an
    /// agent names a provider or tool the system does not have
    /// ([`crate::AgentSpecError::UnknownTool`] names the attached servers), naming the
    /// file, line and column; other [`OrgError`]s from the store.
    pub async fn apply_config(&self, config: &crate::OrgConfig) -> Result<(), OrgError> {
        let specs = config.agent_specs();
        for (index, spec) in specs.iter().enumerate() {
            self.shared
                .directory
                .check_definition(spec)
                .await
                .map_err(|error| config.refused_agent(index, error))?;
        }
        for spec in specs {
            let id = spec.id.clone();
            self.shared
                .directory
                .upsert(spec)
                .map_err(|error| OrgError::InvalidAgentId {
                    what: "agent",
                    id,
                    cause: error.to_string(),
                })?;
        }
        for remote in config.remote_agent_list() {
            let id = remote.id.clone();
            self.add_remote_agent(remote)
                .map_err(|error| OrgError::InvalidAgentId {
                    what: "remote agent",
                    id,
                    cause: error.to_string(),
                })?;
        }
        self.store_config(config).await
    }

    /// Writes `config`'s organisation (policy, links, memberships, rules) to the store,
    /// in one change (see [`AgentClient::store_config`]).
    pub(crate) async fn apply_org(&self, config: &crate::OrgConfig) -> Result<(), OrgError> {
        let (links, memberships, rules) = (config.org_links(), config.memberships(), config.rules());
        self.change_org(|org| {
            org.set_policy(config.policy);
            for link in &links {
                org.upsert_link(link.clone())?;
            }
            for (agent, membership) in &memberships {
                org.set_membership(agent, membership.clone())?;
            }
            for (agent, rule) in &rules {
                org.set_rule(agent, rule.clone())?;
            }
            Ok(())
        })
        .await
    }
}
