//! An organisation from a TOML file: agents, links, permissions and the policy, parsed
//! with `toml` + serde into typed structs and validated; every error names the file,
//! the line and column, and the field.
//!
//! ```toml
//! policy = "enforced"            # or "open" (the default): are links required?
//!
//! [[agents]]
//! id = "manager"                 # required; the agent's id
//! name = "Manager"               # default: the id
//! role = "runs the team"
//! system_prompt = "You run a small team."
//! model = "gpt-4o-mini"          # passed to the model client; default: its default;
//!                                # at most AGENT_MODEL_NAME_SIZE_MAX_BYTES (256)
//! provider = "openai"            # a provider registered with AgentSystemBuilder::provider;
//!                                # default: the system's default client (`llm`)
//! tools = ["call_agent"]         # registered tools (built-in, custom or MCP) it may use;
//!                                # default: every registered tool
//! max_steps = 4                  # model steps per turn,
//!                                # AGENT_TURN_STEPS_MIN..=AGENT_TURN_STEPS_MAX (1..=8)
//! window_messages = 16           # conversation messages its prompt shows when it answers a
//!                                # mention, 1..=CONVERSATION_WINDOW_MESSAGES_MAX (default: the max)
//! window_tokens = 2000           # and at most this many approximate tokens of them,
//!                                # 1..=CONVERSATION_WINDOW_TOKENS_MAX (default: the max)
//! history_messages = 200         # its own newest log messages its model sees at every turn,
//!                                # AGENT_HISTORY_WINDOW_MIN..=AGENT_HISTORY_WINDOW_MAX
//!                                # (default: AGENT_HISTORY_WINDOW_DEFAULT, 64)
//! manager = "ceo"                # another declared agent
//! mode = "supervised"            # autonomous (default), supervised, strict
//! call_approval = "delegate"     # a call_agent needing approval: wait_in_turn (default), or
//!                                # delegate (sent as a task that waits for it in the outbox)
//!
//! [[links]]
//! from = "manager"
//! to = "report"
//! direction = "two_way"          # or one_way (default two_way)
//! relationship = "superior"      # what `from` is to `to`: peer (default), superior, subordinate
//! enabled = true                 # default true
//!
//! [[permissions]]
//! agent = "report"
//! target = "*"                   # an agent id or "*"
//! effect = "deny"                # allow or deny
//! requires_approval = false      # default false
//!
//! [[remote_agents]]              # an agent on another A2A server (`remote.rs`)
//! id = "hq-analyst"              # required; the local id call_agent, links and rules use
//! url = "http://127.0.0.1:8080/a2a/analyst"   # required; its A2A endpoint
//! role = "analyses for HQ"       # listed to the agents that may call it
//! token_env = "HQ_TOKEN"         # the variable holding its server's bearer token
//! ```
//!
//! Provider and tool names can only be checked against a running system:
//! [`crate::AgentClient::apply_config`] refuses a name the system does not have (a tool:
//! neither registered at start nor listed now by an attached MCP server, the check of
//! `AgentClient::define_agent`) with a [`ConfigError::Agent`] naming the file, line and
//! column, before changing anything.
//!
//! [`crate::AgentClient::apply_config`] syncs a config into a running system: declared
//! agents are upserted into the directory, and the policy, links, memberships and rules
//! are written to the store in one commit. Config wins for what it declares; agents,
//! links and rules created at runtime and not declared are kept.

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use toml::Spanned;

use crate::permissions::{BehaviourMode, PermissionEffect, PermissionRule, PERMISSION_TARGET_ANY};
use crate::{AgentSpec, Link, LinkDirection, LinkRelationship, Membership, OrgPolicy};

/// Largest config file read, in bytes.
pub const CONFIG_FILE_SIZE_MAX_BYTES: u64 = 4 * 1024 * 1024;
/// Most agents one config file declares.
pub const CONFIG_AGENTS_MAX: usize = 1_000;

/// Why a config file was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read (or is larger than [`CONFIG_FILE_SIZE_MAX_BYTES`]).
    #[error("{path}: cannot read the config file: {cause}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        cause: String,
    },
    /// The file is not valid TOML, or a field is missing, unknown or of the wrong type.
    #[error("{}: {message}", Location(path, *line, *column))]
    Parse {
        /// The file.
        path: PathBuf,
        /// 1-based line, 0 if unknown.
        line: usize,
        /// 1-based column, 0 if unknown.
        column: usize,
        /// TOML's message (it names the field).
        message: String,
    },
    /// A field's value is well-formed but not allowed.
    #[error("{}: field `{field}`: {message}", Location(path, *line, *column))]
    Invalid {
        /// The file.
        path: PathBuf,
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// The field, as a path: `agents[2].manager`.
        field: String,
        /// What is wrong and what to do.
        message: String,
    },
    /// A declared agent's definition is refused by the system it is applied to: it
    /// names a model provider or tool the system does not have (a tool neither
    /// registered at start nor listed now by an attached MCP server), or breaks a limit
    /// of [`crate::AgentSpec`]. The location is the name's (the provider, the tool) or
    /// else the agent's `id`.
    #[error("{}: field `{field}`: {error}", Location(path, *line, *column))]
    Agent {
        /// The file.
        path: PathBuf,
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// The field, as a path: `agents[0].tools[1]`.
        field: String,
        /// Why the system refused the definition (it says what to do):
        /// [`crate::AgentSpecError::UnknownTool`] names the tool, the tools the system
        /// has now and the attached servers. Boxed: it is the largest part, and a
        /// `ConfigError` is returned often.
        error: Box<crate::AgentSpecError>,
    },
}

struct Location<'a>(&'a PathBuf, usize, usize);

impl fmt::Display for Location<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.1 == 0 {
            write!(f, "{}", self.0.display())
        } else {
            write!(f, "{}:{}:{}", self.0.display(), self.1, self.2)
        }
    }
}

/// One declared agent.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    /// Its id.
    pub id: Spanned<String>,
    /// Display name (default: the id).
    #[serde(default)]
    pub name: Option<String>,
    /// Its role, shown to other agents.
    #[serde(default)]
    pub role: String,
    /// Its system prompt.
    #[serde(default)]
    pub system_prompt: String,
    /// The model name passed to the model client.
    #[serde(default)]
    pub model: String,
    /// The name of the model provider its turns use (one registered with
    /// [`crate::AgentSystemBuilder::provider`]); default: the system's default client.
    #[serde(default)]
    pub provider: Option<Spanned<String>>,
    /// The tools it may use, each listed once; default: every registered tool.
    #[serde(default)]
    pub tools: Option<Spanned<Vec<Spanned<String>>>>,
    /// Model steps per turn.
    #[serde(default)]
    pub max_steps: Option<Spanned<u32>>,
    /// Conversation messages its prompt shows when it answers a mention.
    #[serde(default)]
    pub window_messages: Option<Spanned<usize>>,
    /// Approximate tokens of them at most.
    #[serde(default)]
    pub window_tokens: Option<Spanned<usize>>,
    /// Its own newest log messages its model sees at every turn (its history window).
    #[serde(default)]
    pub history_messages: Option<Spanned<usize>>,
    /// Its manager, another declared agent.
    #[serde(default)]
    pub manager: Option<Spanned<String>>,
    /// Its behaviour mode.
    #[serde(default)]
    pub mode: BehaviourMode,
    /// What its `call_agent` does when a call needs approval.
    #[serde(default)]
    pub call_approval: crate::CallApproval,
}

/// One declared link.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkConfig {
    /// Its source.
    pub from: Spanned<String>,
    /// Its target.
    pub to: Spanned<String>,
    /// Who may start contact.
    #[serde(default)]
    pub direction: LinkDirection,
    /// What `from` is to `to`.
    #[serde(default)]
    pub relationship: LinkRelationship,
    /// Whether it is enabled.
    #[serde(default = "enabled_by_default")]
    pub enabled: bool,
}

fn enabled_by_default() -> bool {
    true
}

/// One declared permission rule.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PermissionConfig {
    /// The agent the rule belongs to.
    pub agent: Spanned<String>,
    /// An agent id or `*`.
    pub target: Spanned<String>,
    /// Allow or deny.
    pub effect: PermissionEffect,
    /// For an allow: contact waits for approval.
    #[serde(default)]
    pub requires_approval: bool,
}

/// One remote agent: an agent on another A2A server, called by a local id.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoteAgentConfig {
    /// The local id.
    pub id: Spanned<String>,
    /// Its A2A JSON-RPC endpoint.
    pub url: Spanned<String>,
    /// What it does.
    #[serde(default)]
    pub role: String,
    /// The environment variable holding its server's bearer token (read at each call).
    #[serde(default)]
    pub token_env: Option<Spanned<String>>,
}

impl RemoteAgentConfig {
    /// As a [`crate::RemoteAgent`].
    pub fn remote_agent(&self) -> crate::RemoteAgent {
        let remote =
            crate::RemoteAgent::new(self.id.get_ref().clone(), self.url.get_ref().clone()).role(self.role.clone());
        match &self.token_env {
            Some(variable) => remote.token_env(variable.get_ref().clone()),
            None => remote,
        }
    }
}

/// A whole config file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OrgConfig {
    /// Whether links are required.
    #[serde(default)]
    pub policy: OrgPolicy,
    /// The agents.
    #[serde(default)]
    pub agents: Vec<AgentConfig>,
    /// The links.
    #[serde(default)]
    pub links: Vec<LinkConfig>,
    /// The permission rules.
    #[serde(default)]
    pub permissions: Vec<PermissionConfig>,
    /// The agents of other A2A servers, by local id.
    #[serde(default)]
    pub remote_agents: Vec<RemoteAgentConfig>,
    /// The file it was read from and its text: errors found when it is applied name
    /// the line and column.
    #[serde(skip)]
    source: ConfigSource,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct ConfigSource {
    path: PathBuf,
    text: String,
}

/// 1-based line and column of byte `offset` in `text`.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |last| last.chars().count()) + 1;
    (line, column)
}

impl OrgConfig {
    /// Reads and validates the config file at `path`.
    ///
    /// # Errors
    /// [`ConfigError`], naming the file, line, column and field.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let read_error = |cause: String| ConfigError::Read {
            path: path.to_path_buf(),
            cause,
        };
        let size = std::fs::metadata(path)
            .map_err(|error| read_error(error.to_string()))?
            .len();
        if size > CONFIG_FILE_SIZE_MAX_BYTES {
            return Err(read_error(format!(
                "it is {size} bytes, more than the limit of {CONFIG_FILE_SIZE_MAX_BYTES}"
            )));
        }
        let text = std::fs::read_to_string(path).map_err(|error| read_error(error.to_string()))?;
        Self::from_toml(&text, path)
    }

    /// Parses and validates `text`; errors name `path`.
    ///
    /// # Errors
    /// [`ConfigError::Parse`] or [`ConfigError::Invalid`].
    pub fn from_toml(text: &str, path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref().to_path_buf();
        let mut config: Self = toml::from_str(text).map_err(|error| {
            let (line, column) = error.span().map_or((0, 0), |span| line_column(text, span.start));
            ConfigError::Parse {
                path: path.clone(),
                line,
                column,
                message: error.message().trim_end().to_string(),
            }
        })?;
        config.validate(text, &path)?;
        config.source = ConfigSource {
            path,
            text: text.to_string(),
        };
        Ok(config)
    }

    /// Checks that every provider and tool the agents name is in `catalog` (a running
    /// system's, [`crate::AgentDirectory::catalog`]), as [`crate::AgentCatalog::check`]
    /// does. A running system's [`crate::AgentClient::apply_config`] checks more: a tool
    /// an attached MCP server lists now is accepted too.
    ///
    /// # Errors
    /// [`ConfigError::Agent`] naming the file, line and column of the first unknown
    /// name, with the catalog's [`crate::AgentSpecError`] (it lists the names the system
    /// has).
    pub fn check_names(&self, catalog: &crate::AgentCatalog) -> Result<(), ConfigError> {
        for (index, spec) in self.agent_specs().iter().enumerate() {
            catalog.check(spec).map_err(|error| self.refused_agent(index, error))?;
        }
        Ok(())
    }

    /// `error`, a system's refusal of the definition of declared agent `index`
    /// ([`OrgConfig::agent_specs`]'s order), located in the file: at the provider or tool
    /// it names, else at the agent's `id`.
    pub(crate) fn refused_agent(&self, index: usize, error: crate::AgentSpecError) -> ConfigError {
        let agent = &self.agents[index];
        let named = match &error {
            crate::AgentSpecError::UnknownProvider { .. } => agent
                .provider
                .as_ref()
                .map(|provider| (provider.span(), format!("agents[{index}].provider"))),
            crate::AgentSpecError::UnknownTool { tool, .. } => agent
                .tools
                .iter()
                .flat_map(|tools| tools.get_ref().iter())
                .enumerate()
                .find(|(_, named)| named.get_ref() == tool)
                .map(|(position, named)| (named.span(), format!("agents[{index}].tools[{position}]"))),
            _ => None,
        };
        let (span, field) = named.unwrap_or_else(|| (agent.id.span(), format!("agents[{index}]")));
        let (line, column) = line_column(&self.source.text, span.start);
        ConfigError::Agent {
            path: self.source.path.clone(),
            line,
            column,
            field,
            error: Box::new(error),
        }
    }

    fn validate(&self, text: &str, path: &Path) -> Result<(), ConfigError> {
        let invalid = |span: std::ops::Range<usize>, field: String, message: String| {
            let (line, column) = line_column(text, span.start);
            ConfigError::Invalid {
                path: path.to_path_buf(),
                line,
                column,
                field,
                message,
            }
        };
        if self.agents.len() > CONFIG_AGENTS_MAX {
            let span = self.agents[CONFIG_AGENTS_MAX].id.span();
            return Err(invalid(
                span,
                "agents".into(),
                format!("at most {CONFIG_AGENTS_MAX} agents may be declared"),
            ));
        }
        let mut ids = BTreeSet::new();
        for (index, agent) in self.agents.iter().enumerate() {
            let field = |name: &str| format!("agents[{index}].{name}");
            let id = agent.id.get_ref();
            let windows = [
                (
                    "window_messages",
                    &agent.window_messages,
                    crate::CONVERSATION_WINDOW_MESSAGES_MAX,
                ),
                (
                    "window_tokens",
                    &agent.window_tokens,
                    crate::CONVERSATION_WINDOW_TOKENS_MAX,
                ),
            ];
            for (name, value, limit) in windows {
                if let Some(value) = value.as_ref().filter(|value| !(1..=limit).contains(value.get_ref())) {
                    return Err(invalid(
                        value.span(),
                        field(name),
                        format!("{} is not in 1..={limit}", value.get_ref()),
                    ));
                }
            }
            if let Some(history) = agent.history_messages.as_ref().filter(|history| {
                !(crate::limits::AGENT_HISTORY_WINDOW_MIN..=crate::limits::AGENT_HISTORY_WINDOW_MAX)
                    .contains(history.get_ref())
            }) {
                return Err(invalid(
                    history.span(),
                    field("history_messages"),
                    format!(
                        "{} is not in {}..={}",
                        history.get_ref(),
                        crate::limits::AGENT_HISTORY_WINDOW_MIN,
                        crate::limits::AGENT_HISTORY_WINDOW_MAX
                    ),
                ));
            }
            // The definition's own check, reported at the field rather than at the id.
            if let Some(steps) = &agent.max_steps {
                if let Err(error) = AgentSpec::check_max_steps(id, *steps.get_ref()) {
                    return Err(invalid(steps.span(), field("max_steps"), error.to_string()));
                }
            }
            if let Err(error) = self.spec(agent).validate() {
                return Err(invalid(agent.id.span(), field("id"), error.to_string()));
            }
            if id == PERMISSION_TARGET_ANY {
                return Err(invalid(
                    agent.id.span(),
                    field("id"),
                    "`*` cannot be an agent id".into(),
                ));
            }
            if !ids.insert(id.clone()) {
                return Err(invalid(
                    agent.id.span(),
                    field("id"),
                    format!("agent {id:?} is declared twice; give each agent its own id"),
                ));
            }
            if let Some(tools) = &agent.tools {
                let mut seen = BTreeSet::new();
                if let Some(repeated) = tools
                    .get_ref()
                    .iter()
                    .find(|tool| !seen.insert(tool.get_ref().as_str()))
                {
                    return Err(invalid(
                        repeated.span(),
                        field("tools"),
                        format!("tool {:?} is listed twice", repeated.get_ref()),
                    ));
                }
            }
        }
        if self.remote_agents.len() > crate::REMOTE_AGENTS_MAX {
            return Err(invalid(
                self.remote_agents[crate::REMOTE_AGENTS_MAX].id.span(),
                "remote_agents".into(),
                format!("at most {} remote agents may be declared", crate::REMOTE_AGENTS_MAX),
            ));
        }
        let mut remote_ids = BTreeSet::new();
        for (index, remote) in self.remote_agents.iter().enumerate() {
            let field = |name: &str| format!("remote_agents[{index}].{name}");
            let id = remote.id.get_ref();
            if let Err(cause) = crate::agent::agent_id(id) {
                return Err(invalid(remote.id.span(), field("id"), cause.to_string()));
            }
            if id == PERMISSION_TARGET_ANY || ids.contains(id) || !remote_ids.insert(id.clone()) {
                return Err(invalid(
                    remote.id.span(),
                    field("id"),
                    format!("{id:?} is already the id of a declared agent or remote agent; give each its own id"),
                ));
            }
            if let Err(cause) = crate::remote::check_url(remote.url.get_ref()) {
                return Err(invalid(
                    remote.url.span(),
                    field("url"),
                    format!(
                        "{:?} is not valid: {cause}; give the agent's A2A endpoint, such as http://127.0.0.1:8080/a2a/analyst",
                        remote.url.get_ref()
                    ),
                ));
            }
            if let Some(variable) = &remote.token_env {
                if let Err(cause) = crate::remote::check_env_name(variable.get_ref()) {
                    return Err(invalid(
                        variable.span(),
                        field("token_env"),
                        format!("{:?} is not an environment variable name: {cause}", variable.get_ref()),
                    ));
                }
            }
        }
        // Links and rules may name remote agents as targets (by local id).
        let targets: BTreeSet<String> = ids.union(&remote_ids).cloned().collect();
        let declared = |value: &Spanned<String>, field: String, allow_any: bool| {
            let id = value.get_ref();
            if ids.contains(id) || (allow_any && id == PERMISSION_TARGET_ANY) {
                Ok(())
            } else {
                Err(invalid(
                    value.span(),
                    field,
                    format!("{id:?} is not a declared agent; declare it under [[agents]] or fix the id"),
                ))
            }
        };
        let reachable = |value: &Spanned<String>, field: String, allow_any: bool| {
            let id = value.get_ref();
            if targets.contains(id) || (allow_any && id == PERMISSION_TARGET_ANY) {
                Ok(())
            } else {
                Err(invalid(
                    value.span(),
                    field,
                    format!(
                        "{id:?} is not a declared agent or remote agent; declare it under [[agents]] or [[remote_agents]], or fix the id"
                    ),
                ))
            }
        };
        for (index, agent) in self.agents.iter().enumerate() {
            if let Some(manager) = &agent.manager {
                declared(manager, format!("agents[{index}].manager"), false)?;
                if manager.get_ref() == agent.id.get_ref() {
                    return Err(invalid(
                        manager.span(),
                        format!("agents[{index}].manager"),
                        "an agent cannot manage itself".into(),
                    ));
                }
            }
        }
        // Manager cycles (a → b → a): walk up from each agent.
        for (index, agent) in self.agents.iter().enumerate() {
            let mut current = agent.manager.as_ref().map(|manager| manager.get_ref().clone());
            let mut steps = 0;
            while let Some(id) = current {
                steps += 1;
                if id == *agent.id.get_ref() || steps > self.agents.len() {
                    let manager = agent.manager.as_ref().expect("walking up from a manager");
                    return Err(invalid(
                        manager.span(),
                        format!("agents[{index}].manager"),
                        format!("the managers form a cycle through {:?}", agent.id.get_ref()),
                    ));
                }
                current = self
                    .agents
                    .iter()
                    .find(|other| *other.id.get_ref() == id)
                    .and_then(|other| other.manager.as_ref().map(|manager| manager.get_ref().clone()));
            }
        }
        let mut pairs = BTreeSet::new();
        for (index, link) in self.links.iter().enumerate() {
            reachable(&link.from, format!("links[{index}].from"), false)?;
            reachable(&link.to, format!("links[{index}].to"), false)?;
            if link.from.get_ref() == link.to.get_ref() {
                return Err(invalid(
                    link.to.span(),
                    format!("links[{index}].to"),
                    "a link must join two different agents".into(),
                ));
            }
            if !pairs.insert((link.from.get_ref().clone(), link.to.get_ref().clone())) {
                return Err(invalid(
                    link.from.span(),
                    format!("links[{index}]"),
                    format!(
                        "a link from {:?} to {:?} is declared twice",
                        link.from.get_ref(),
                        link.to.get_ref()
                    ),
                ));
            }
        }
        let mut rules = BTreeSet::new();
        for (index, rule) in self.permissions.iter().enumerate() {
            declared(&rule.agent, format!("permissions[{index}].agent"), false)?;
            reachable(&rule.target, format!("permissions[{index}].target"), true)?;
            if rule.effect == PermissionEffect::Deny && rule.requires_approval {
                return Err(invalid(
                    rule.target.span(),
                    format!("permissions[{index}].requires_approval"),
                    "a deny rule cannot require approval; use effect = \"allow\"".into(),
                ));
            }
            if !rules.insert((rule.agent.get_ref().clone(), rule.target.get_ref().clone())) {
                return Err(invalid(
                    rule.agent.span(),
                    format!("permissions[{index}]"),
                    format!(
                        "agent {:?} has two rules for {:?}",
                        rule.agent.get_ref(),
                        rule.target.get_ref()
                    ),
                ));
            }
        }
        Ok(())
    }

    fn spec(&self, agent: &AgentConfig) -> AgentSpec {
        let id = agent.id.get_ref().clone();
        let mut spec = AgentSpec::new(id.clone())
            .name(agent.name.clone().unwrap_or(id))
            .role(agent.role.clone())
            .system_prompt(agent.system_prompt.clone())
            .model(agent.model.clone());
        if let Some(steps) = &agent.max_steps {
            spec = spec.max_steps(*steps.get_ref());
        }
        if let Some(provider) = &agent.provider {
            spec = spec.provider(provider.get_ref().clone());
        }
        let default = crate::ContextWindow::default();
        spec = spec.window(
            agent
                .window_messages
                .as_ref()
                .map_or(default.messages, |m| *m.get_ref()),
            agent.window_tokens.as_ref().map_or(default.tokens, |t| *t.get_ref()),
        );
        if let Some(history) = &agent.history_messages {
            spec = spec.history(*history.get_ref());
        }
        if let Some(tools) = &agent.tools {
            spec = spec.tools(tools.get_ref().iter().map(|tool| tool.get_ref().clone()));
        }
        spec.call_approval(agent.call_approval)
    }

    /// The declared remote agents.
    pub fn remote_agent_list(&self) -> Vec<crate::RemoteAgent> {
        self.remote_agents.iter().map(RemoteAgentConfig::remote_agent).collect()
    }

    /// The declared agents' definitions.
    pub fn agent_specs(&self) -> Vec<AgentSpec> {
        self.agents.iter().map(|agent| self.spec(agent)).collect()
    }

    /// The declared links.
    pub fn org_links(&self) -> Vec<Link> {
        self.links
            .iter()
            .map(|link| {
                Link::new(link.from.get_ref().clone(), link.to.get_ref().clone())
                    .direction(link.direction)
                    .relationship(link.relationship)
                    .enabled(link.enabled)
            })
            .collect()
    }

    /// Each declared agent's membership (manager and mode).
    pub fn memberships(&self) -> Vec<(String, Membership)> {
        self.agents
            .iter()
            .map(|agent| {
                let membership = Membership {
                    manager: agent.manager.as_ref().map(|manager| manager.get_ref().clone()),
                    mode: agent.mode,
                };
                (agent.id.get_ref().clone(), membership)
            })
            .collect()
    }

    /// The declared rules, with the agent each belongs to.
    pub fn rules(&self) -> Vec<(String, PermissionRule)> {
        self.permissions
            .iter()
            .map(|rule| {
                let permission = PermissionRule {
                    target: rule.target.get_ref().clone(),
                    effect: rule.effect,
                    requires_approval: rule.requires_approval,
                };
                (rule.agent.get_ref().clone(), permission)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = r#"
policy = "enforced"

[[agents]]
id = "boss"
role = "runs the team"

[[agents]]
id = "worker"
manager = "boss"
mode = "supervised"
max_steps = 3
window_messages = 4
window_tokens = 500
call_approval = "delegate"

[[links]]
from = "boss"
to = "worker"
relationship = "superior"
direction = "one_way"

[[permissions]]
agent = "worker"
target = "*"
effect = "deny"
"#;

    #[test]
    fn a_valid_file_gives_typed_agents_links_and_rules() {
        let config = OrgConfig::from_toml(VALID, "org.toml").unwrap();
        assert_eq!(config.policy, OrgPolicy::Enforced);
        let specs = config.agent_specs();
        assert_eq!(specs.len(), 2);
        assert_eq!(specs[1].model.max_steps, 3);
        assert_eq!(
            specs[1].window,
            crate::ContextWindow {
                messages: 4,
                tokens: 500
            }
        );
        assert_eq!(specs[0].window, crate::ContextWindow::default());
        assert_eq!(specs[0].call_approval, crate::CallApproval::WaitInTurn);
        assert_eq!(specs[1].call_approval, crate::CallApproval::Delegate);
        let links = config.org_links();
        assert_eq!(links[0].direction, LinkDirection::OneWay);
        assert_eq!(links[0].relationship, LinkRelationship::Superior);
        assert!(links[0].enabled);
        assert_eq!(
            config.memberships()[1],
            (
                "worker".to_string(),
                Membership {
                    manager: Some("boss".into()),
                    mode: BehaviourMode::Supervised
                }
            )
        );
        assert_eq!(
            config.rules(),
            vec![("worker".to_string(), PermissionRule::deny(PERMISSION_TARGET_ANY))]
        );
    }

    /// Goal: every kind of bad input names the file, the line and the field. Method: one
    /// broken variant of a valid file per row, with the expected text of the error.
    #[test]
    fn errors_name_the_file_the_line_and_the_field() {
        let table: Vec<(&str, String, &str)> = vec![
            (
                "unknown agent in a link",
                VALID.replace("to = \"worker\"", "to = \"wroker\""),
                "org.toml:19:6: field `links[0].to`: \"wroker\" is not a declared agent",
            ),
            (
                "unknown field",
                VALID.replace("role = \"runs the team\"", "rol = \"runs the team\""),
                "org.toml:6:1: unknown field `rol`",
            ),
            ("missing id", VALID.replace("id = \"boss\"", ""), "missing field `id`"),
            (
                "bad enum value",
                VALID.replace("\"one_way\"", "\"sideways\""),
                "org.toml:21:13: unknown variant `sideways`",
            ),
            (
                "bad call_approval",
                VALID.replace("\"delegate\"", "\"wait\""),
                "org.toml:15:17: unknown variant `wait`, expected `wait_in_turn` or `delegate`",
            ),
            (
                "steps out of range",
                VALID.replace("max_steps = 3", "max_steps = 0"),
                "org.toml:12:13: field `agents[1].max_steps`: the max_steps of worker is 0, which is not in 1..=8",
            ),
            (
                "window out of range",
                VALID.replace("window_messages = 4", "window_messages = 0"),
                "org.toml:13:19: field `agents[1].window_messages`: 0 is not in 1..=32",
            ),
            (
                "window tokens out of range",
                VALID.replace("window_tokens = 500", "window_tokens = 9000"),
                "org.toml:14:17: field `agents[1].window_tokens`: 9000 is not in 1..=8000",
            ),
            (
                "duplicate agent",
                VALID.replace("id = \"worker\"", "id = \"boss\""),
                "org.toml:9:6: field `agents[1].id`: agent \"boss\" is declared twice",
            ),
            (
                "manager cycle",
                VALID.replace("role = \"runs the team\"", "manager = \"worker\""),
                "field `agents[0].manager`: the managers form a cycle",
            ),
            (
                "syntax",
                VALID.replace("policy = \"enforced\"", "policy = "),
                "org.toml:2:10:",
            ),
        ];
        for (name, text, expected) in table {
            let error = OrgConfig::from_toml(&text, "org.toml").expect_err(name).to_string();
            assert!(error.contains(expected), "{name}: {error}");
            assert!(error.starts_with("org.toml"), "{name}: {error}");
        }
    }

    const REMOTE: &str = r#"
[[agents]]
id = "boss"

[[remote_agents]]
id = "hq"
url = "http://127.0.0.1:8080/a2a/analyst"
role = "analyses for HQ"
token_env = "HQ_TOKEN"

[[links]]
from = "boss"
to = "hq"

[[permissions]]
agent = "boss"
target = "hq"
effect = "allow"
"#;

    #[test]
    fn remote_agents_are_declared_and_links_and_rules_may_name_them() {
        let config = OrgConfig::from_toml(REMOTE, "org.toml").unwrap();
        let remotes = config.remote_agent_list();
        assert_eq!(
            remotes,
            vec![crate::RemoteAgent::new("hq", "http://127.0.0.1:8080/a2a/analyst")
                .role("analyses for HQ")
                .token_env("HQ_TOKEN")]
        );
        assert_eq!(config.org_links().len(), 1);
        assert_eq!(config.rules().len(), 1);
    }

    #[test]
    fn bad_remote_agents_are_refused_naming_the_line_and_field() {
        let table: Vec<(&str, String, &str)> = vec![
            (
                "bad url",
                REMOTE.replace("http://127.0.0.1:8080/a2a/analyst", "ftp://hq/a2a/analyst"),
                "org.toml:7:7: field `remote_agents[0].url`: \"ftp://hq/a2a/analyst\" is not valid: it must start with http:// or https://",
            ),
            (
                "clash with a local agent",
                REMOTE.replace("id = \"hq\"", "id = \"boss\""),
                "org.toml:6:6: field `remote_agents[0].id`: \"boss\" is already the id of a declared agent",
            ),
            (
                "bad token variable",
                REMOTE.replace("\"HQ_TOKEN\"", "\"HQ-TOKEN\""),
                "org.toml:9:13: field `remote_agents[0].token_env`: \"HQ-TOKEN\" is not an environment variable name",
            ),
            (
                "invalid id",
                REMOTE.replace("id = \"hq\"", "id = \"\""),
                "org.toml:6:6: field `remote_agents[0].id`:",
            ),
            (
                "unknown field",
                REMOTE.replace("token_env", "tokn_env"),
                "org.toml:9:1: unknown field `tokn_env`",
            ),
            (
                "a remote agent cannot have rules of its own",
                REMOTE.replace("agent = \"boss\"", "agent = \"hq\""),
                "field `permissions[0].agent`: \"hq\" is not a declared agent",
            ),
        ];
        for (name, text, expected) in table {
            let error = OrgConfig::from_toml(&text, "org.toml").expect_err(name).to_string();
            assert!(error.contains(expected), "{name}: {error}");
        }
    }

    #[test]
    fn a_missing_file_is_a_read_error_naming_it() {
        let error = OrgConfig::from_file("/nonexistent/org.toml").unwrap_err();
        assert!(matches!(error, ConfigError::Read { .. }));
        assert!(
            error.to_string().starts_with("/nonexistent/org.toml: cannot read"),
            "{error}"
        );
    }
}
