//! The organisation routes: links, permission rules, memberships, the policy and
//! pending approvals, over the organisation API of [`troupe_agent::AgentClient`]
//! (`org_api.rs`). Every change is committed to the store before the answer, and every
//! admission after the answer reads it.
//!
//! The bodies have the fields (and defaults) of the TOML config's `[[links]]`,
//! `[[permissions]]` and `[[agents]]` `manager`/`mode` (`troupe_agent::config`), and are
//! checked the same way: an agent named must exist (a local agent or a remote one), a
//! deny rule cannot require approval, unknown fields are refused.
//!
//! | status | code | when |
//! |---|---|---|
//! | 404 | `agent_not_found` | an agent of the path or the body is not known |
//! | 404 | `link_not_found`, `permission_not_found`, `approval_not_found` | nothing to update, delete or resolve |
//! | 409 | `link_exists` | `POST /v1/links` of an existing pair (PUT replaces it) |
//! | 409 | `approval_not_pending` | the approval was already approved or denied |
//! | 409 | `manager_cycle` | the manager would (indirectly) manage itself |
//! | 409 | `org_full` | a limit of the organisation (links, rules per agent, approvals) |
//! | 422 | `invalid_link`, `invalid_permission`, `invalid_agent_id` | a field's value is not allowed |
//! | 400 | `invalid_approval_id` | the path's approval id is not a number |

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use troupe_agent::{
    Approval, ApprovalState, BehaviourMode, Link, LinkDirection, LinkPatch, LinkRelationship, Membership, OrgError,
    OrgPolicy, PermissionEffect, PermissionRule, PERMISSION_TARGET_ANY,
};

use crate::error::{ApiError, ApiJson};
use crate::server::AppState;

type Shared = State<Arc<AppState>>;

/// The organisation routes.
pub(crate) fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/v1/org/policy", get(policy).put(set_policy))
        .route("/v1/links", get(links).post(add_link))
        .route(
            "/v1/links/{from}/{to}",
            put(update_link).patch(patch_link).delete(remove_link),
        )
        .route("/v1/agents/{id}/permissions", get(permissions))
        .route(
            "/v1/agents/{id}/permissions/{target}",
            put(set_permission).delete(remove_permission),
        )
        .route("/v1/agents/{id}/membership", get(membership).put(set_membership))
        .route("/v1/approvals", get(approvals))
        .route("/v1/approvals/{id}", get(approval))
        .route("/v1/approvals/{id}/approve", post(approve))
        .route("/v1/approvals/{id}/deny", post(deny))
}

impl From<OrgError> for ApiError {
    fn from(error: OrgError) -> Self {
        let message = error.to_string();
        match &error {
            OrgError::SelfLink { .. } => Self::unprocessable("invalid_link", message),
            OrgError::InvalidAgentId { .. } => Self::unprocessable("invalid_agent_id", message),
            OrgError::LinkExists { from, to } => Self::new(
                StatusCode::CONFLICT,
                "link_exists",
                format!("{message}: PUT /v1/links/{from}/{to}"),
            ),
            OrgError::NoSuchLink { .. } => Self::new(
                StatusCode::NOT_FOUND,
                "link_not_found",
                format!("{message}; GET /v1/links lists the links"),
            ),
            OrgError::TooMany { .. } => Self::new(StatusCode::CONFLICT, "org_full", message),
            OrgError::ManagerCycle { .. } => Self::new(StatusCode::CONFLICT, "manager_cycle", message),
            OrgError::NotPending { .. } => Self::new(StatusCode::CONFLICT, "approval_not_pending", message),
            OrgError::Expired { .. } => Self::new(StatusCode::CONFLICT, "approval_expired", message),
            OrgError::Store(store) => Self::storage(store, message),
            OrgError::Decode { .. } => Self::new(StatusCode::INTERNAL_SERVER_ERROR, "org_unreadable", message),
            OrgError::Config(_) => Self::unprocessable("invalid_config", message),
        }
    }
}

/// 404 `agent_not_found` unless `agent` is a local agent or a remote agent. The stored
/// directory is read again if this process's read is stale (as every agent route does):
/// an agent defined over REST by an earlier run, or by another server on the store, is
/// known.
async fn known_agent(state: &AppState, agent: &str) -> Result<(), ApiError> {
    let known = state.client.current_directory().await.contains(agent)
        || state.client.remote_agents().iter().any(|remote| remote.id == agent);
    if known {
        Ok(())
    } else {
        Err(ApiError::agent_not_found(agent))
    }
}

/// 422 `code` when a body repeats a path field with another value.
fn same_as_path(code: &'static str, field: &str, given: Option<&String>, path: &str) -> Result<(), ApiError> {
    match given {
        Some(given) if given != path => Err(ApiError::unprocessable(
            code,
            format!("the body's {field} {given:?} differs from the path's {path:?}; leave it out or make them equal"),
        )),
        _ => Ok(()),
    }
}

// ---- policy ----

/// The body of `PUT /v1/org/policy`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PolicyBody {
    policy: OrgPolicy,
}

/// `GET /v1/org/policy`: the policy and the organisation's version.
async fn policy(State(state): Shared) -> Result<Json<Value>, ApiError> {
    let org = state.client.organisation().await?;
    Ok(Json(json!({"policy": org.policy, "version": org.version()})))
}

/// `PUT /v1/org/policy`: `open` (links not required) or `enforced`.
async fn set_policy(State(state): Shared, ApiJson(body): ApiJson<PolicyBody>) -> Result<Json<Value>, ApiError> {
    state.client.set_org_policy(body.policy).await?;
    policy(State(state)).await
}

// ---- links ----

/// The body of `POST /v1/links` and `PUT /v1/links/{from}/{to}`: the TOML `[[links]]`
/// fields with their defaults (`two_way`, `peer`, enabled).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct LinkBody {
    from: Option<String>,
    to: Option<String>,
    #[serde(default)]
    direction: LinkDirection,
    #[serde(default)]
    relationship: LinkRelationship,
    #[serde(default = "enabled_by_default")]
    enabled: bool,
}

fn enabled_by_default() -> bool {
    true
}

impl LinkBody {
    fn link(&self, from: String, to: String) -> Link {
        Link::new(from, to)
            .direction(self.direction)
            .relationship(self.relationship)
            .enabled(self.enabled)
    }
}

/// `GET /v1/links`: every link, by source then target.
async fn links(State(state): Shared) -> Result<Json<Value>, ApiError> {
    let links = state.client.links().await?;
    Ok(Json(json!({ "links": links })))
}

/// `POST /v1/links`: 201 with the link; 409 `link_exists` if the pair has one.
async fn add_link(State(state): Shared, ApiJson(body): ApiJson<LinkBody>) -> Result<Response, ApiError> {
    let (Some(from), Some(to)) = (body.from.clone(), body.to.clone()) else {
        return Err(ApiError::unprocessable(
            "invalid_link",
            "a link needs \"from\" and \"to\" (agent ids)",
        ));
    };
    known_agent(&state, &from).await?;
    known_agent(&state, &to).await?;
    let link = body.link(from, to);
    state.client.add_link(link.clone()).await?;
    Ok((StatusCode::CREATED, Json(json!(link))).into_response())
}

/// `PUT /v1/links/{from}/{to}`: replaces the link (fields left out take their
/// defaults); 404 `link_not_found` if there is none.
async fn update_link(
    State(state): Shared,
    Path((from, to)): Path<(String, String)>,
    ApiJson(body): ApiJson<LinkBody>,
) -> Result<Json<Value>, ApiError> {
    same_as_path("invalid_link", "from", body.from.as_ref(), &from)?;
    same_as_path("invalid_link", "to", body.to.as_ref(), &to)?;
    let link = body.link(from, to);
    state.client.update_link(link.clone()).await?;
    Ok(Json(json!(link)))
}

/// The body of `PATCH /v1/links/{from}/{to}`: the fields to change (each left out is
/// kept); `from` and `to`, if given, must match the path.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct LinkPatchBody {
    from: Option<String>,
    to: Option<String>,
    direction: Option<LinkDirection>,
    relationship: Option<LinkRelationship>,
    enabled: Option<bool>,
}

/// `PATCH /v1/links/{from}/{to}`: changes the fields given, keeps the others, returns
/// the link as changed (read and written in one change of the organisation: two
/// patches at once both land); 404 `link_not_found` if there is none.
async fn patch_link(
    State(state): Shared,
    Path((from, to)): Path<(String, String)>,
    ApiJson(body): ApiJson<LinkPatchBody>,
) -> Result<Json<Value>, ApiError> {
    same_as_path("invalid_link", "from", body.from.as_ref(), &from)?;
    same_as_path("invalid_link", "to", body.to.as_ref(), &to)?;
    let patch = LinkPatch {
        direction: body.direction,
        relationship: body.relationship,
        enabled: body.enabled,
    };
    let link = state.client.patch_link(&from, &to, patch).await?;
    Ok(Json(json!(link)))
}

/// `DELETE /v1/links/{from}/{to}`: 204; 404 `link_not_found` if there is none. The
/// agents need not exist any more.
async fn remove_link(State(state): Shared, Path((from, to)): Path<(String, String)>) -> Result<StatusCode, ApiError> {
    state.client.remove_link(&from, &to).await?;
    Ok(StatusCode::NO_CONTENT)
}

// ---- permissions and membership ----

/// The body of `PUT /v1/agents/{id}/permissions/{target}`: the TOML `[[permissions]]`
/// fields (`agent` and `target` come from the path; given, they must match it).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PermissionBody {
    agent: Option<String>,
    target: Option<String>,
    effect: PermissionEffect,
    #[serde(default)]
    requires_approval: bool,
}

/// `GET /v1/agents/{id}/permissions`: the agent's rules (one per target) and its
/// membership.
async fn permissions(State(state): Shared, Path(agent): Path<String>) -> Result<Json<Value>, ApiError> {
    known_agent(&state, &agent).await?;
    let org = state.client.organisation().await?;
    Ok(Json(json!({
        "agent": agent,
        "rules": org.rules(&agent),
        "membership": org.membership(&agent),
    })))
}

/// `PUT /v1/agents/{id}/permissions/{target}`: sets the agent's rule for `target` (an
/// agent id or `*`), replacing the one it had.
async fn set_permission(
    State(state): Shared,
    Path((agent, target)): Path<(String, String)>,
    ApiJson(body): ApiJson<PermissionBody>,
) -> Result<Json<Value>, ApiError> {
    same_as_path("invalid_permission", "agent", body.agent.as_ref(), &agent)?;
    same_as_path("invalid_permission", "target", body.target.as_ref(), &target)?;
    known_agent(&state, &agent).await?;
    if target != PERMISSION_TARGET_ANY {
        known_agent(&state, &target).await?;
    }
    if body.effect == PermissionEffect::Deny && body.requires_approval {
        return Err(ApiError::unprocessable(
            "invalid_permission",
            "field `requires_approval`: a deny rule cannot require approval; use \"effect\": \"allow\"",
        ));
    }
    let rule = PermissionRule {
        target,
        effect: body.effect,
        requires_approval: body.requires_approval,
    };
    state.client.set_permission(&agent, rule.clone()).await?;
    Ok(Json(json!({"agent": agent, "rule": rule})))
}

/// `DELETE /v1/agents/{id}/permissions/{target}`: 204; 404 `permission_not_found` if
/// the agent has no rule for `target`.
async fn remove_permission(
    State(state): Shared,
    Path((agent, target)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    match state.client.remove_permission(&agent, &target).await? {
        Some(_) => Ok(StatusCode::NO_CONTENT),
        None => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "permission_not_found",
            format!("agent {agent:?} has no rule for {target:?}; GET /v1/agents/{agent}/permissions lists its rules"),
        )),
    }
}

/// The body of `PUT /v1/agents/{id}/membership`: the TOML `[[agents]]` `manager` and
/// `mode` (default: no manager, `autonomous`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct MembershipBody {
    #[serde(default)]
    manager: Option<String>,
    #[serde(default)]
    mode: BehaviourMode,
}

/// `GET /v1/agents/{id}/membership`.
async fn membership(State(state): Shared, Path(agent): Path<String>) -> Result<Json<Value>, ApiError> {
    known_agent(&state, &agent).await?;
    let org = state.client.organisation().await?;
    Ok(Json(json!({"agent": agent, "membership": org.membership(&agent)})))
}

/// `PUT /v1/agents/{id}/membership`: sets the agent's manager and behaviour mode; 409
/// `manager_cycle` if the manager is managed by the agent (directly or not).
async fn set_membership(
    State(state): Shared,
    Path(agent): Path<String>,
    ApiJson(body): ApiJson<MembershipBody>,
) -> Result<Json<Value>, ApiError> {
    known_agent(&state, &agent).await?;
    if let Some(manager) = &body.manager {
        known_agent(&state, manager).await?;
    }
    let membership = Membership {
        manager: body.manager,
        mode: body.mode,
    };
    state.client.set_membership(&agent, membership.clone()).await?;
    Ok(Json(json!({"agent": agent, "membership": membership})))
}

// ---- approvals ----

/// The path's approval id, or 400 `invalid_approval_id`.
fn approval_id(id: &str) -> Result<u64, ApiError> {
    id.parse().map_err(|_| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_approval_id",
            format!("approval id {id:?} is not a number; GET /v1/approvals lists the pending ones"),
        )
    })
}

fn approval_not_found(id: u64) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "approval_not_found",
        format!("there is no approval {id} (or it was resolved long ago); GET /v1/approvals lists the pending ones"),
    )
}

/// `GET /v1/approvals`: every listed pending approval, oldest first.
async fn approvals(State(state): Shared) -> Result<Json<Value>, ApiError> {
    let pending = state.client.pending_approvals().await?;
    Ok(Json(json!({ "approvals": pending })))
}

/// `GET /v1/approvals/{id}`: a pending approval or one of the last resolved, as it
/// stands now (a pending one past its deadline reads `expired`).
async fn approval(State(state): Shared, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let id = approval_id(&id)?;
    state
        .client
        .approval(id)
        .await?
        .map(|approval| Json(json!(approval)))
        .ok_or_else(|| approval_not_found(id))
}

/// Approves or denies approval `id`: 200 with the record; 404 if there is no such
/// approval, 409 `approval_not_pending` if it was resolved already (of two racing
/// resolutions exactly one wins: the organisation's changes are serialized).
async fn resolve(state: &AppState, id: &str, approve: bool) -> Result<Json<Value>, ApiError> {
    let id = approval_id(id)?;
    let resolved: Result<Approval, OrgError> = if approve {
        state.client.approve(id).await
    } else {
        state.client.deny(id).await
    };
    match resolved {
        Ok(approval) => Ok(Json(json!(approval))),
        Err(OrgError::NotPending { id }) => {
            let org = state.client.organisation().await?;
            match org.approval(id) {
                Some(approval) => {
                    let state = match approval.state {
                        ApprovalState::Approved => "approved",
                        ApprovalState::Denied => "denied",
                        ApprovalState::Expired => "expired (its contact reached its deadline)",
                        ApprovalState::Pending => "resolved",
                    };
                    Err(ApiError::new(
                        StatusCode::CONFLICT,
                        "approval_not_pending",
                        format!("approval {id} is not pending: it was {state} already"),
                    ))
                }
                None => Err(approval_not_found(id)),
            }
        }
        Err(error) => Err(error.into()),
    }
}

/// `POST /v1/approvals/{id}/approve`: the contact waiting for it proceeds.
async fn approve(State(state): Shared, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    resolve(&state, &id, true).await
}

/// `POST /v1/approvals/{id}/deny`: the contact waiting for it is refused.
async fn deny(State(state): Shared, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    resolve(&state, &id, false).await
}
