//! Tools an agent's model may call: [`Tool`], the [`ToolRegistry`], and the
//! [`ToolExecutionContext`] every handler receives.
//!
//! ```text
//! model's tool call {name, arguments: JSON}
//!   ──► registry: unknown name?                  → ToolError::UnknownTool
//!   ──► ArgumentSchema (compiled when the tool was built, jsonschema, no I/O)
//!                                                → ToolError::InvalidArguments
//!   ──► typed tools only: serde_json::from_value::<Args>
//!                                                → ToolError::InvalidArguments
//!   ──► handler, until the turn's deadline      → its error / DeadlineExceeded
//!   ──► result text (or the error's text) back to the model as the tool result
//! ```
//!
//! A typed tool ([`Tool::typed`]) declares a Rust argument type deriving
//! `serde::Deserialize` and `schemars::JsonSchema`: the schema the model sees is derived
//! from the type, and the handler receives the type. [`Tool::new`] and [`Tool::from_fn`]
//! take a hand-written schema and hand the handler raw JSON.
//!
//! Arguments come from a model and are untrusted: every failure becomes a [`ToolError`]
//! whose text is handed back to the model as the tool result. Nothing here panics on
//! model input. A handler runs under the calling turn's deadline and is cancelled
//! (dropped) when the turn is.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use async_trait::async_trait;
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde_json::Value;
use troupe_core::{ActorId, CallContext, Deadline};
use troupe_runtime::{Caller, Clock};

use crate::agent::AgentShared;
use crate::budget::BudgetMeter;
use crate::inbox::SharedSends;
use crate::{ArgumentSchema, Budget, SchemaError, ToolSpec};

/// Why a tool call produced no result. Its `Display` is what the model reads.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToolError {
    /// The model named a tool that does not exist.
    #[error("unknown tool {name:?}; available tools: {}", available.join(", "))]
    UnknownTool {
        /// The name asked for.
        name: String,
        /// The registered names.
        available: Vec<String>,
    },
    /// The arguments do not match the tool's schema, or (typed tools) do not
    /// deserialize into its argument type.
    #[error("invalid arguments for {tool}: {error}")]
    InvalidArguments {
        /// The tool.
        tool: String,
        /// What is wrong.
        error: SchemaError,
    },
    /// The handler ran and failed.
    #[error("{tool} failed: {message}")]
    Failed {
        /// The tool.
        tool: String,
        /// What the handler said.
        message: String,
    },
    /// The turn's deadline passed while the tool ran.
    #[error("{tool} did not finish before the turn's deadline")]
    DeadlineExceeded {
        /// The tool.
        tool: String,
    },
}

impl ToolError {
    /// A [`ToolError::Failed`] of `tool` with `message`.
    pub fn failed(tool: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Failed {
            tool: tool.into(),
            message: message.into(),
        }
    }
}

/// What a tool handler knows about the turn that called it, read-only.
///
/// The agent's identity, depth, chain and deadline come from the runtime (the turn's
/// [`Caller`]) and cannot be edited: a tool cannot call as another agent, step out of
/// its chain or stretch its deadline. Calls to other agents go through
/// [`crate::call_agent`] (admission, then the dispatcher's wait-for graph); the
/// calls-in-flight count is shared by every call of one agent activation, so
/// `AGENT_CONCURRENT_CALLS_MAX` holds across concurrent tool calls.
#[derive(Clone)]
pub struct ToolExecutionContext {
    caller: Caller,
    inbound_call: Option<u64>,
    shared: Arc<AgentShared>,
    /// The turn's queued notifications and delegations, written to the outbox when the
    /// turn commits.
    sends: Option<SharedSends>,
    /// The turn's budget meter: tool calls and grants are charged to it.
    budget: Arc<BudgetMeter>,
}

impl fmt::Debug for ToolExecutionContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolExecutionContext")
            .field("agent_id", self.agent_id())
            .field("call_depth", &self.call_depth())
            .field("call_chain", &self.call_chain())
            .field("deadline", &self.deadline())
            .field("calls_in_flight", &self.calls_in_flight())
            .finish_non_exhaustive()
    }
}

impl ToolExecutionContext {
    pub(crate) fn new(
        caller: Caller,
        inbound_call: Option<u64>,
        shared: Arc<AgentShared>,
        sends: Option<SharedSends>,
        budget: Arc<BudgetMeter>,
    ) -> Self {
        Self {
            caller,
            inbound_call,
            shared,
            sends,
            budget,
        }
    }

    pub(crate) fn budget(&self) -> &BudgetMeter {
        &self.budget
    }

    /// What is left of the turn's budget now (calls in flight hold their grants).
    pub fn budget_left(&self) -> Budget {
        self.budget.left()
    }

    pub(crate) fn sends(&self) -> Option<&SharedSends> {
        self.sends.as_ref()
    }

    /// The agent whose model called the tool.
    pub fn agent_id(&self) -> &ActorId {
        self.caller.id()
    }

    /// The depth of the agent's turn (0 when asked from outside).
    pub fn call_depth(&self) -> u32 {
        self.caller.depth()
    }

    /// The agents waiting on this turn, outermost first (the agent itself not included).
    pub fn call_chain(&self) -> &[ActorId] {
        self.caller.chain()
    }

    /// When the turn must have replied.
    pub fn deadline(&self) -> Deadline {
        self.caller.deadline()
    }

    /// The call context of the agent's turn.
    pub fn call_context(&self) -> &CallContext {
        self.caller.context()
    }

    /// The current time on the runtime's clock.
    pub fn now(&self) -> Deadline {
        self.caller.now()
    }

    /// The runtime's clock.
    pub fn clock(&self) -> Clock {
        self.caller.clock()
    }

    /// The turn's caller handle, for calling actors that are not agents (with the same
    /// admission, wait-for graph and deadline rules).
    pub fn caller(&self) -> &Caller {
        &self.caller
    }

    /// Calls this agent activation has in flight now.
    pub fn calls_in_flight(&self) -> u32 {
        self.caller.calls_in_flight()
    }

    pub(crate) fn inbound_call(&self) -> Option<u64> {
        self.inbound_call
    }

    pub(crate) fn shared(&self) -> &Arc<AgentShared> {
        &self.shared
    }
}

/// The body of a tool.
#[async_trait]
pub trait ToolHandler: Send + Sync + 'static {
    /// Runs the tool with arguments already validated against its schema.
    ///
    /// # Errors
    /// A [`ToolError`], shown to the model.
    async fn call(&self, context: &ToolExecutionContext, arguments: Value) -> Result<String, ToolError>;

    /// Runs the tool with borrowed arguments: what an agent's turn calls, as the
    /// arguments stay in the model's message (its log and later prompts). The default
    /// clones them for [`ToolHandler::call`]; a handler that only reads them (a typed
    /// tool deserializing its argument type) can borrow instead.
    ///
    /// # Errors
    /// As [`ToolHandler::call`].
    async fn call_borrowed(&self, context: &ToolExecutionContext, arguments: &Value) -> Result<String, ToolError> {
        self.call(context, arguments.clone()).await
    }
}

type BoxedToolFuture = Pin<Box<dyn Future<Output = Result<String, ToolError>> + Send>>;

struct FnHandler<F>(F);

#[async_trait]
impl<F> ToolHandler for FnHandler<F>
where
    F: Fn(ToolExecutionContext, Value) -> BoxedToolFuture + Send + Sync + 'static,
{
    async fn call(&self, context: &ToolExecutionContext, arguments: Value) -> Result<String, ToolError> {
        (self.0)(context.clone(), arguments).await
    }
}

/// Deserializes the validated arguments into `A`, then runs the typed handler.
struct TypedHandler<A, F> {
    tool: String,
    handler: F,
    arguments: std::marker::PhantomData<fn() -> A>,
}

#[async_trait]
impl<A, F, Fut> ToolHandler for TypedHandler<A, F>
where
    A: DeserializeOwned + Send + 'static,
    F: Fn(ToolExecutionContext, A) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<String, ToolError>> + Send + 'static,
{
    async fn call(&self, context: &ToolExecutionContext, arguments: Value) -> Result<String, ToolError> {
        let arguments = serde_json::from_value::<A>(arguments).map_err(|error| self.invalid(&error))?;
        (self.handler)(context.clone(), arguments).await
    }

    /// Deserializes `A` from the borrowed arguments: no copy of the JSON tree (only
    /// what `A` owns is allocated).
    async fn call_borrowed(&self, context: &ToolExecutionContext, arguments: &Value) -> Result<String, ToolError> {
        let arguments = A::deserialize(arguments).map_err(|error| self.invalid(&error))?;
        (self.handler)(context.clone(), arguments).await
    }
}

impl<A, F> TypedHandler<A, F> {
    fn invalid(&self, error: &serde_json::Error) -> ToolError {
        ToolError::InvalidArguments {
            tool: self.tool.clone(),
            error: SchemaError::at("$", error.to_string()),
        }
    }
}

/// The JSON schema `schemars` derives for `A`, as the model sees it: draft 2020-12
/// without the `$schema` marker (providers take the bare schema).
///
/// # Panics
/// If the derived schema is not an object schema (`A` is not a struct or map): a tool's
/// arguments are a JSON object.
pub fn tool_parameters_schema<A: JsonSchema>() -> Value {
    let mut schema = schemars::schema_for!(A).to_value();
    if let Some(fields) = schema.as_object_mut() {
        fields.remove("$schema");
    }
    assert_eq!(
        schema.get("type"),
        Some(&Value::String("object".to_string())),
        "the arguments of a tool must be a JSON object; {} derives {schema}",
        std::any::type_name::<A>()
    );
    schema
}

/// A tool: what the model sees ([`ToolSpec`]), its compiled argument schema and the
/// handler that runs.
#[derive(Clone)]
pub struct Tool {
    spec: ToolSpec,
    schema: ArgumentSchema,
    handler: Arc<dyn ToolHandler>,
}

impl fmt::Debug for Tool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tool")
            .field("name", &self.spec.name)
            .finish_non_exhaustive()
    }
}

impl Tool {
    /// A tool with a [`ToolHandler`] and a hand-written JSON schema, compiled here once.
    ///
    /// # Panics
    /// If `parameters` is not a JSON object, or not a valid self-contained JSON schema
    /// (a programmer error in the tool's definition).
    pub fn new(
        name: impl Into<String>,
        description: impl Into<String>,
        parameters: Value,
        handler: impl ToolHandler,
    ) -> Self {
        let name = name.into();
        assert!(
            parameters.is_object(),
            "the schema of tool {name} must be a JSON object"
        );
        let schema = match ArgumentSchema::compile(&parameters) {
            Ok(schema) => schema,
            Err(invalid) => panic!("the schema of tool {name} does not compile: {invalid}"),
        };
        Self {
            spec: ToolSpec {
                name,
                description: description.into(),
                parameters,
            },
            schema,
            handler: Arc::new(handler),
        }
    }

    /// A typed tool: the model sees the JSON schema `schemars` derives for `A`, and the
    /// handler receives the arguments deserialized into `A`. Arguments that break the
    /// schema or do not deserialize are refused with [`ToolError::InvalidArguments`]
    /// before the handler runs; the model reads the reason as the tool result.
    ///
    /// # Panics
    /// If `A`'s schema is not an object schema (see [`tool_parameters_schema`]).
    ///
    /// # Examples
    /// ```
    /// use serde::Deserialize;
    /// use troupe_agent::schemars::JsonSchema;
    /// use troupe_agent::{Tool, ToolExecutionContext};
    ///
    /// /// Adds two numbers.
    /// #[derive(Deserialize, JsonSchema)]
    /// #[schemars(crate = "troupe_agent::schemars")]
    /// struct AddArguments {
    ///     /// The first term.
    ///     a: i64,
    ///     /// The second term.
    ///     b: i64,
    /// }
    ///
    /// let add = Tool::typed::<AddArguments, _, _>(
    ///     "add",
    ///     "Adds two integers.",
    ///     |_context: ToolExecutionContext, arguments: AddArguments| async move {
    ///         Ok((arguments.a + arguments.b).to_string())
    ///     },
    /// );
    /// assert_eq!(add.spec().parameters["required"], serde_json::json!(["a", "b"]));
    /// ```
    pub fn typed<A, F, Fut>(name: impl Into<String>, description: impl Into<String>, handler: F) -> Self
    where
        A: DeserializeOwned + JsonSchema + Send + 'static,
        F: Fn(ToolExecutionContext, A) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<String, ToolError>> + Send + 'static,
    {
        let name = name.into();
        let typed = TypedHandler {
            tool: name.clone(),
            handler,
            arguments: std::marker::PhantomData,
        };
        Self::new(name, description, tool_parameters_schema::<A>(), typed)
    }

    /// A tool whose handler is an async closure taking the context and the arguments.
    ///
    /// # Panics
    /// As [`Tool::new`].
    pub fn from_fn<F, Fut>(
        name: impl Into<String>,
        description: impl Into<String>,
        parameters: Value,
        handler: F,
    ) -> Self
    where
        F: Fn(ToolExecutionContext, Value) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<String, ToolError>> + Send + 'static,
    {
        let boxed = move |context, arguments| -> BoxedToolFuture { Box::pin(handler(context, arguments)) };
        Self::new(name, description, parameters, FnHandler(boxed))
    }

    /// What the model sees.
    pub fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    /// Validates `arguments` against the schema, then runs the handler until the turn's
    /// deadline.
    ///
    /// # Errors
    /// [`ToolError::InvalidArguments`], [`ToolError::DeadlineExceeded`] or the handler's
    /// error.
    pub async fn execute(&self, context: &ToolExecutionContext, arguments: Value) -> Result<String, ToolError> {
        self.validate(&arguments)?;
        self.until_deadline(context, self.handler.call(context, arguments))
            .await
    }

    /// As [`Tool::execute`], with borrowed arguments ([`ToolHandler::call_borrowed`]).
    ///
    /// # Errors
    /// As [`Tool::execute`].
    pub async fn execute_borrowed(
        &self,
        context: &ToolExecutionContext,
        arguments: &Value,
    ) -> Result<String, ToolError> {
        self.validate(arguments)?;
        self.until_deadline(context, self.handler.call_borrowed(context, arguments))
            .await
    }

    /// As [`Tool::execute_borrowed`], without a timer of its own: for the turn loop,
    /// which runs its tool calls under its own timer at the turn's deadline or earlier
    /// (a second timer at the same instant cost a registration in the timer wheel).
    pub(crate) async fn execute_in_turn(
        &self,
        context: &ToolExecutionContext,
        arguments: &Value,
    ) -> Result<String, ToolError> {
        self.validate(arguments)?;
        self.handler.call_borrowed(context, arguments).await
    }

    fn validate(&self, arguments: &Value) -> Result<(), ToolError> {
        self.schema
            .validate(arguments)
            .map_err(|error| ToolError::InvalidArguments {
                tool: self.spec.name.clone(),
                error,
            })
    }

    async fn until_deadline(
        &self,
        context: &ToolExecutionContext,
        call: impl Future<Output = Result<String, ToolError>>,
    ) -> Result<String, ToolError> {
        match context.clock().until(context.deadline(), call).await {
            Ok(result) => result,
            Err(troupe_runtime::DeadlinePassed) => Err(ToolError::DeadlineExceeded {
                tool: self.spec.name.clone(),
            }),
        }
    }
}

/// The longest tool name model providers accept, in bytes (OpenAI-compatible ones take
/// `^[a-zA-Z0-9_-]{1,64}$`); a longer name is refused when the tool is registered.
pub const TOOL_NAME_BYTES_MAX: usize = 64;

/// Why a tool could not be registered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToolRegistryError {
    /// A tool of that name exists.
    #[error("a tool named {name:?} is already registered")]
    Duplicate {
        /// The name.
        name: String,
    },
    /// The name breaks the model providers' rule for tool names: 1 to
    /// [`TOOL_NAME_BYTES_MAX`] bytes of `a-zA-Z0-9_-`. A provider refuses a request that
    /// offers such a tool (a 400 for every turn of every agent that has it), so it is
    /// refused here, when the system is built.
    #[error(
        "tool name {name:?} is not one model providers accept: {cause}; a tool name is 1 to {TOOL_NAME_BYTES_MAX} \
         bytes of a-zA-Z0-9_- (rename it, e.g. `files_read` for `files.read`)"
    )]
    InvalidName {
        /// The name.
        name: String,
        /// What breaks the rule.
        cause: String,
    },
    /// A tool new in a source's list (an attached MCP server's, after it said its list
    /// changed or was started again) has a name already taken: it is not offered, and
    /// the tool that has the name keeps it (a built-in such as `call_agent` is never
    /// shadowed).
    #[error(
        "the tool {name:?} that {offered_by} lists now is not offered: the name is taken by {taken_by}; attach the \
         server with a prefix (AgentSystemBuilder::mcp_server_with_prefix) to offer it"
    )]
    Clash {
        /// The name.
        name: String,
        /// The source that lists it (`MCP server "files"`).
        offered_by: String,
        /// What has the name.
        taken_by: String,
    },
}

/// Checks `name` against the providers' rule for tool names (see
/// [`ToolRegistryError::InvalidName`]).
fn check_tool_name(name: &str) -> Result<(), ToolRegistryError> {
    let cause = if name.is_empty() {
        "it is empty".to_owned()
    } else if name.len() > TOOL_NAME_BYTES_MAX {
        format!("it is {} bytes long", name.len())
    } else if let Some(character) = name
        .chars()
        .find(|character| !(character.is_ascii_alphanumeric() || *character == '_' || *character == '-'))
    {
        format!("it holds {character:?}")
    } else {
        return Ok(());
    };
    Err(ToolRegistryError::InvalidName {
        name: name.to_owned(),
        cause,
    })
}

/// The most tools kept callable after their source stopped listing them (so a model
/// that still calls one reads [`crate::McpError::ToolGone`]'s text, not "unknown tool").
/// Past it, the oldest gone tools are forgotten: a call of one is
/// [`ToolError::UnknownTool`].
pub const TOOLS_GONE_KEPT_MAX: usize = 1_024;

/// A source of tools whose list may change while the system runs: an MCP server
/// attached with `AgentSystemBuilder::mcp_server`.
#[async_trait]
pub(crate) trait ToolSource: Send + Sync + 'static {
    /// What the warnings and errors call it (`MCP server "files"`).
    fn describe(&self) -> String;

    /// Grows each time the source's list may have changed: read before
    /// [`ToolSource::tools`], so a change made between the two leaves a stale key.
    fn generation(&self) -> u64;

    /// The tools it offers now.
    fn tools(&self) -> Vec<Tool>;

    /// Reads the list again now if the source was told it changed and has not read it
    /// yet (an MCP server's `notifications/tools/list_changed`); bounded by the source's
    /// own timeout. A failure is logged and the last list kept.
    async fn refresh(&self);
}

/// The tools of the registry's sources as last built: what every model step is
/// offered, until a source's generation moves.
struct LiveView {
    /// The sum of the sources' generations it was built at.
    generation: u64,
    /// The sources' tools, by offered name, and the index of the source that owns each.
    tools: BTreeMap<String, (Arc<Tool>, usize)>,
    /// Tools a source no longer lists, kept callable (they fail with the source's own
    /// error), at most [`TOOLS_GONE_KEPT_MAX`], oldest first in `gone_order`.
    gone: BTreeMap<String, Arc<Tool>>,
    gone_order: std::collections::VecDeque<String>,
    /// Every tool's spec, fixed and live, by name.
    specs: Arc<[ToolSpec]>,
    /// The sources' tools refused: their name is taken.
    refused: Vec<ToolRegistryError>,
}

/// A tool found by name: a fixed one, borrowed, or a source's, shared.
enum Found<'a> {
    Fixed(&'a Tool),
    Live(Arc<Tool>),
}

impl std::ops::Deref for Found<'_> {
    type Target = Tool;

    fn deref(&self) -> &Tool {
        match self {
            Found::Fixed(tool) => tool,
            Found::Live(tool) => tool,
        }
    }
}

/// Tools by name: the fixed ones ([`ToolRegistry::register`]) and those of the sources
/// whose lists change while the system runs (an attached MCP server's).
///
/// A source's list is read again when its generation moves: at the next model step of
/// any agent, through [`ToolRegistry::offered_specs`]. A source's tool whose name is
/// taken (by a fixed tool, built-ins included, or by another source's tool that had it
/// first) is not offered: it is listed by [`ToolRegistry::refused`] as
/// [`ToolRegistryError::Clash`] and logged once; a name never changes owner while its
/// owner lists it.
#[derive(Default)]
pub struct ToolRegistry {
    tools: BTreeMap<String, Tool>,
    sources: Vec<Arc<dyn ToolSource>>,
    live: std::sync::Mutex<Option<Arc<LiveView>>>,
}

impl fmt::Debug for ToolRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolRegistry")
            .field("tools", &self.names())
            .field("sources", &self.sources.len())
            .finish()
    }
}

impl Clone for ToolRegistry {
    fn clone(&self) -> Self {
        Self {
            tools: self.tools.clone(),
            sources: self.sources.clone(),
            live: std::sync::Mutex::new(None),
        }
    }
}

impl ToolRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `tool`.
    ///
    /// # Errors
    /// [`ToolRegistryError::InvalidName`] if its name is not one model providers accept,
    /// [`ToolRegistryError::Duplicate`] if it is taken.
    pub fn register(&mut self, tool: Tool) -> Result<(), ToolRegistryError> {
        check_tool_name(&tool.spec.name)?;
        let name = tool.spec.name.clone();
        if self.tools.contains_key(&name) || (self.has_sources() && self.live_view().tools.contains_key(&name)) {
            return Err(ToolRegistryError::Duplicate { name });
        }
        self.tools.insert(name, tool);
        *self.live.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
        Ok(())
    }

    /// Adds `source`, whose tools are offered as it lists them now and later.
    ///
    /// # Errors
    /// [`ToolRegistryError::Duplicate`] if one of the tools it lists now has the name of
    /// a tool already here (at start a clash is the embedder's to fix; later, a tool
    /// new in a source that clashes is refused, see [`ToolRegistry::refused`]).
    pub(crate) fn add_source(&mut self, source: Arc<dyn ToolSource>) -> Result<(), ToolRegistryError> {
        let taken = self.names();
        for tool in source.tools() {
            check_tool_name(&tool.spec.name)?;
            if taken.contains(&tool.spec.name) {
                return Err(ToolRegistryError::Duplicate {
                    name: tool.spec.name.clone(),
                });
            }
        }
        self.sources.push(source);
        *self.live.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
        let refused = self.live_view().refused.clone();
        match refused.into_iter().next() {
            // Two tools of the source itself that became one name.
            Some(ToolRegistryError::Clash { name, .. }) => {
                self.sources.pop();
                *self.live.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
                Err(ToolRegistryError::Duplicate { name })
            }
            _ => Ok(()),
        }
    }

    /// Whether any source's list may change (an MCP server is attached).
    pub(crate) fn has_sources(&self) -> bool {
        !self.sources.is_empty()
    }

    /// Reads again the lists of the sources that were told theirs changed (see
    /// [`ToolSource::refresh`]): called before a model step, so a change the process
    /// heard of before the step is in the step's list.
    pub(crate) async fn refresh_sources(&self) {
        for source in &self.sources {
            source.refresh().await;
        }
    }

    /// Grows whenever the tools offered may have changed (0 without sources).
    pub(crate) fn generation(&self) -> u64 {
        self.sources
            .iter()
            .fold(0_u64, |sum, source| sum.wrapping_add(source.generation()))
    }

    /// The view of the sources' tools at the current generation, built again if a
    /// source's moved.
    fn live_view(&self) -> Arc<LiveView> {
        // Read before the lists (see `ToolSource::generation`).
        let generation = self.generation();
        let mut live = self.live.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(view) = live.as_ref() {
            if view.generation == generation {
                return Arc::clone(view);
            }
        }
        let view = Arc::new(self.build_view(generation, live.as_deref()));
        for refused in &view.refused {
            let known = live.as_ref().is_some_and(|previous| previous.refused.contains(refused));
            if !known {
                tracing::warn!(%refused, "a tool new in a source's list is not offered");
            }
        }
        *live = Some(Arc::clone(&view));
        view
    }

    fn build_view(&self, generation: u64, previous: Option<&LiveView>) -> LiveView {
        let lists: Vec<Vec<Tool>> = self.sources.iter().map(|source| source.tools()).collect();
        let mut tools: BTreeMap<String, (Arc<Tool>, usize)> = BTreeMap::new();
        let mut refused = Vec::new();
        // First the names each source held before and still lists (a name keeps its
        // owner), then the new ones, in the sources' order.
        for keeping in [true, false] {
            for (index, list) in lists.iter().enumerate() {
                for tool in list {
                    let name = &tool.spec.name;
                    let held = previous
                        .and_then(|previous| previous.tools.get(name))
                        .is_some_and(|(_, owner)| *owner == index);
                    if held != keeping {
                        continue;
                    }
                    let taken_by = if self.tools.contains_key(name) {
                        Some("a tool registered when the system was built (built-ins included)".to_owned())
                    } else if let Some((_, owner)) = tools.get(name) {
                        Some(self.sources[*owner].describe())
                    } else if let Err(invalid) = check_tool_name(name) {
                        refused.push(invalid);
                        continue;
                    } else {
                        None
                    };
                    match taken_by {
                        Some(taken_by) => refused.push(ToolRegistryError::Clash {
                            name: name.clone(),
                            offered_by: self.sources[index].describe(),
                            taken_by,
                        }),
                        None => {
                            tools.insert(name.clone(), (Arc::new(tool.clone()), index));
                        }
                    }
                }
            }
        }
        let (mut gone, mut gone_order) = match previous {
            Some(previous) => (previous.gone.clone(), previous.gone_order.clone()),
            None => Default::default(),
        };
        gone_order.retain(|name| !tools.contains_key(name));
        gone.retain(|name, _| !tools.contains_key(name));
        if let Some(previous) = previous {
            for (name, (tool, _)) in &previous.tools {
                if !tools.contains_key(name) && !self.tools.contains_key(name) && !gone.contains_key(name) {
                    gone.insert(name.clone(), Arc::clone(tool));
                    gone_order.push_back(name.clone());
                }
            }
        }
        while gone_order.len() > TOOLS_GONE_KEPT_MAX {
            if let Some(oldest) = gone_order.pop_front() {
                gone.remove(&oldest);
            }
        }
        let mut specs: Vec<ToolSpec> = self
            .tools
            .values()
            .map(|tool| tool.spec.clone())
            .chain(tools.values().map(|(tool, _)| tool.spec.clone()))
            .collect();
        specs.sort_by(|a, b| a.name.cmp(&b.name));
        LiveView {
            generation,
            tools,
            gone,
            gone_order,
            specs: specs.into(),
            refused,
        }
    }

    /// Every tool's spec offered now, by name: what a model step is offered (the caller
    /// filters by the agent's own tools). Shared: built again only when a source's list
    /// changed.
    pub(crate) fn offered_specs(&self) -> Arc<[ToolSpec]> {
        Arc::clone(&self.live_view().specs)
    }

    /// The tools of the sources not offered because their name is taken, each a
    /// [`ToolRegistryError::Clash`] (or [`ToolRegistryError::InvalidName`]) naming it,
    /// its source and what has the name.
    pub fn refused(&self) -> Vec<ToolRegistryError> {
        self.live_view().refused.clone()
    }

    /// The tool called `name` among those registered with [`ToolRegistry::register`]
    /// (a source's tools are found by [`ToolRegistry::execute`] and listed by
    /// [`ToolRegistry::specs`]).
    pub fn get(&self, name: &str) -> Option<&Tool> {
        self.tools.get(name)
    }

    /// Every tool's spec offered now, fixed and the sources', by name.
    pub fn specs(&self) -> Vec<ToolSpec> {
        self.offered_specs().to_vec()
    }

    /// The names offered now, fixed and the sources', sorted.
    pub fn names(&self) -> Vec<String> {
        if self.sources.is_empty() {
            return self.tools.keys().cloned().collect();
        }
        self.offered_specs().iter().map(|spec| spec.name.clone()).collect()
    }

    /// Runs the tool `name` with `arguments`.
    ///
    /// # Errors
    /// [`ToolError::UnknownTool`], or as [`Tool::execute`].
    pub async fn execute(
        &self,
        context: &ToolExecutionContext,
        name: &str,
        arguments: Value,
    ) -> Result<String, ToolError> {
        self.tool(name)?.execute(context, arguments).await
    }

    /// As [`ToolRegistry::execute`], with borrowed arguments ([`Tool::execute_borrowed`]).
    ///
    /// # Errors
    /// As [`ToolRegistry::execute`].
    pub async fn execute_borrowed(
        &self,
        context: &ToolExecutionContext,
        name: &str,
        arguments: &Value,
    ) -> Result<String, ToolError> {
        self.tool(name)?.execute_borrowed(context, arguments).await
    }

    /// As [`ToolRegistry::execute_borrowed`], bounded by the caller's timer only
    /// ([`Tool::execute_in_turn`]).
    pub(crate) async fn execute_in_turn(
        &self,
        context: &ToolExecutionContext,
        name: &str,
        arguments: &Value,
    ) -> Result<String, ToolError> {
        self.tool(name)?.execute_in_turn(context, arguments).await
    }

    /// The tool called `name`: a fixed one, else a source's offered now, else one a
    /// source no longer lists (its call fails with the source's error, e.g.
    /// [`crate::McpError::ToolGone`]'s text).
    fn tool(&self, name: &str) -> Result<Found<'_>, ToolError> {
        if let Some(tool) = self.tools.get(name) {
            return Ok(Found::Fixed(tool));
        }
        if !self.sources.is_empty() {
            let view = self.live_view();
            if let Some(tool) = view
                .tools
                .get(name)
                .map(|(tool, _)| tool)
                .or_else(|| view.gone.get(name))
            {
                return Ok(Found::Live(Arc::clone(tool)));
            }
        }
        Err(ToolError::UnknownTool {
            name: name.to_string(),
            available: self.names(),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;

    /// A source listing the names it was last given.
    struct ListSource {
        name: &'static str,
        names: std::sync::Mutex<Vec<String>>,
        generation: AtomicU64,
    }

    impl ListSource {
        fn new(name: &'static str) -> Arc<Self> {
            Arc::new(Self {
                name,
                names: std::sync::Mutex::default(),
                generation: AtomicU64::new(0),
            })
        }

        fn list(&self, names: impl IntoIterator<Item = impl Into<String>>) {
            *self.names.lock().unwrap() = names.into_iter().map(Into::into).collect();
            self.generation.fetch_add(1, Ordering::AcqRel);
        }
    }

    #[async_trait]
    impl ToolSource for ListSource {
        fn describe(&self) -> String {
            format!("source {}", self.name)
        }

        fn generation(&self) -> u64 {
            self.generation.load(Ordering::Acquire)
        }

        fn tools(&self) -> Vec<Tool> {
            self.names
                .lock()
                .unwrap()
                .iter()
                .map(|name| {
                    Tool::from_fn(name.clone(), "", serde_json::json!({"type": "object"}), |_, _| async {
                        Ok(String::new())
                    })
                })
                .collect()
        }

        async fn refresh(&self) {}
    }

    fn owner(registry: &ToolRegistry, name: &str) -> Option<usize> {
        registry.live_view().tools.get(name).map(|(_, owner)| *owner)
    }

    /// Goal: a name a source lists keeps its owner while the owner lists it, whatever
    /// the sources' order: a later clash is refused naming both; once the owner drops
    /// it, the other source's tool takes it. A built-in's name is never taken.
    #[test]
    fn a_name_keeps_its_owner_while_the_owner_lists_it() {
        let (first, second) = (ListSource::new("first"), ListSource::new("second"));
        let mut registry = ToolRegistry::new();
        registry
            .register(Tool::from_fn(
                "call_agent",
                "",
                serde_json::json!({"type": "object"}),
                |_, _| async { Ok(String::new()) },
            ))
            .unwrap();
        registry.add_source(first.clone()).unwrap();
        registry.add_source(second.clone()).unwrap();
        second.list(["x"]);
        assert_eq!(owner(&registry, "x"), Some(1));
        first.list(["x", "call_agent"]);
        assert_eq!(owner(&registry, "x"), Some(1), "the second source had it first");
        assert_eq!(
            registry.refused(),
            [
                ToolRegistryError::Clash {
                    name: "x".into(),
                    offered_by: "source first".into(),
                    taken_by: "source second".into(),
                },
                ToolRegistryError::Clash {
                    name: "call_agent".into(),
                    offered_by: "source first".into(),
                    taken_by: "a tool registered when the system was built (built-ins included)".into(),
                },
            ]
        );
        assert!(registry.get("call_agent").is_some());
        second.list(Vec::<String>::new());
        assert_eq!(owner(&registry, "x"), Some(0), "its owner dropped it");
        second.list(["x"]);
        assert_eq!(owner(&registry, "x"), Some(0));
        assert_eq!(registry.names(), ["call_agent", "x"]);
    }

    /// Goal: a tool a source stops listing leaves the names offered but stays findable
    /// (its call fails with the source's own error), at most `TOOLS_GONE_KEPT_MAX` of
    /// them, the oldest forgotten first; listed again, it is offered again.
    #[test]
    fn gone_tools_stay_findable_within_their_limit() {
        let source = ListSource::new("s");
        let mut registry = ToolRegistry::new();
        registry.add_source(source.clone()).unwrap();
        // Each list is seen (a step reads the names offered) before the next.
        source.list(["old"]);
        assert_eq!(registry.names(), ["old"]);
        source.list(Vec::<String>::new());
        assert!(registry.names().is_empty());
        assert!(registry.tool("old").is_ok());
        source.list((0..TOOLS_GONE_KEPT_MAX).map(|index| format!("t{index}")));
        assert_eq!(registry.names().len(), TOOLS_GONE_KEPT_MAX);
        source.list(Vec::<String>::new());
        assert_eq!(registry.live_view().gone.len(), TOOLS_GONE_KEPT_MAX);
        assert!(
            matches!(registry.tool("old"), Err(ToolError::UnknownTool { .. })),
            "the oldest is forgotten"
        );
        assert!(registry.tool("t0").is_ok());
        source.list(["t0"]);
        assert_eq!(registry.names(), ["t0"]);
        assert_eq!(registry.live_view().gone.len(), TOOLS_GONE_KEPT_MAX - 1);
    }
}
