//! A scripted, deterministic [`LlmClient`] for tests, the simulator and the demo.
//!
//! A script is an ordered list of [`ScriptRule`]s. For each request the first rule whose
//! agent and condition match decides the answer: a text, one or more tool calls, or an
//! injected failure, after an optional latency (a `tokio::time::sleep`, so virtual time
//! under madsim and paused tokio). No rule matching is an error, so a script mistake
//! shows up in a test instead of a silent default. There is no randomness: the same
//! requests in the same order get the same answers.
//!
//! Templates in texts and in string arguments of tool calls:
//! `{input}` is the last user message, `{tool_result}` the tool results since the last
//! assistant message (joined with `"; "`), `{agent}` the asking agent's key.
//! For scripted call chains, a user message holding `route: x y z` gives
//! `{route_next}` = `x` and `{route_rest}` = ` y z` (the rest with its leading space,
//! empty at the end of the route), so a rule can pass the route on hop by hop.
//!
//! Every request is recorded ([`ScriptedLlm::requests`], unless
//! [`ScriptedLlm::without_recording`]), and every answer that was
//! actually delivered ([`ScriptedLlm::answers`]): a request whose turn was cancelled
//! during the latency is in the first list and not in the second.
//!
//! Token usage: every reply reports [`TokenUsage`] counted as whitespace-separated words
//! (prompt: every message's text and every tool call's arguments; completion: the
//! reply's), so it is deterministic and roughly the size a real model would report.
//! A request with `max_tokens` whose answer would count more is answered
//! [`LlmError::OverTokenLimit`] (nothing delivered, nothing charged), so a scripted turn
//! never spends past its budget.

use std::borrow::Cow;
use std::cell::OnceCell;
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::Value;
use troupe_core::ActorId;

use crate::limits::{SCRIPTED_LLM_COUNTED_AGENTS_MAX, SCRIPTED_LLM_RECORDED_MAX};
use crate::{ChatMessage, LlmClient, LlmError, LlmReply, LlmRequest, Prompt, Role, TokenUsage, ToolCall};

/// When a rule applies, judged on the request's last message.
#[derive(Debug, Clone, PartialEq)]
pub enum ScriptCondition {
    /// Always.
    Always,
    /// The last message is from the user (a person or another agent) and contains this.
    UserContains(String),
    /// The last message is a tool result.
    ToolResult,
    /// The last message is a tool result containing this.
    ToolResultContains(String),
}

/// What a rule answers.
#[derive(Debug, Clone, PartialEq)]
pub enum ScriptAction {
    /// An assistant text (a template).
    Reply(String),
    /// Tool calls, each a tool name and arguments (string values are templates).
    CallTools(Vec<(String, Value)>),
    /// An [`LlmError::Injected`] with this cause.
    Fail(String),
}

/// One rule of a script: which agent, when, what, and how slowly.
#[derive(Debug, Clone, PartialEq)]
pub struct ScriptRule {
    agent: Option<String>,
    condition: ScriptCondition,
    /// Shared, so choosing the rule for a request does not copy it.
    action: Arc<ScriptAction>,
    latency: Duration,
    uses_left: Option<u32>,
}

impl ScriptRule {
    /// A rule for the agent with key `agent` that answers an empty text.
    pub fn agent(agent: impl Into<String>) -> Self {
        Self {
            agent: Some(agent.into()),
            condition: ScriptCondition::Always,
            action: Arc::new(ScriptAction::Reply(String::new())),
            latency: Duration::ZERO,
            uses_left: None,
        }
    }

    /// A rule for every agent.
    pub fn any_agent() -> Self {
        Self {
            agent: None,
            ..Self::agent("")
        }
    }

    /// Applies when the last message is from the user and contains `needle`.
    pub fn on_user_containing(mut self, needle: impl Into<String>) -> Self {
        self.condition = ScriptCondition::UserContains(needle.into());
        self
    }

    /// Applies when the last message is a tool result.
    pub fn on_tool_result(mut self) -> Self {
        self.condition = ScriptCondition::ToolResult;
        self
    }

    /// Applies when the last message is a tool result containing `needle`.
    pub fn on_tool_result_containing(mut self, needle: impl Into<String>) -> Self {
        self.condition = ScriptCondition::ToolResultContains(needle.into());
        self
    }

    /// Answers with the text `template`.
    pub fn reply(mut self, template: impl Into<String>) -> Self {
        self.action = Arc::new(ScriptAction::Reply(template.into()));
        self
    }

    /// Answers with a call of tool `name` with `arguments` (added to any calls already
    /// set on this rule, so one step can request several).
    pub fn call(mut self, name: impl Into<String>, arguments: Value) -> Self {
        let call = (name.into(), arguments);
        match Arc::make_mut(&mut self.action) {
            ScriptAction::CallTools(calls) => calls.push(call),
            other => *other = ScriptAction::CallTools(vec![call]),
        }
        self
    }

    /// Answers with an injected failure.
    pub fn fail(mut self, cause: impl Into<String>) -> Self {
        self.action = Arc::new(ScriptAction::Fail(cause.into()));
        self
    }

    /// Waits `latency` before answering.
    pub fn latency(mut self, latency: Duration) -> Self {
        self.latency = latency;
        self
    }

    /// Applies at most `count` times, then is skipped.
    pub fn times(mut self, count: u32) -> Self {
        self.uses_left = Some(count);
        self
    }

    fn matches(&self, request: &LlmRequest) -> bool {
        if self.uses_left == Some(0) {
            return false;
        }
        if self.agent.as_deref().is_some_and(|agent| agent != request.agent.key()) {
            return false;
        }
        let last = request.messages.last();
        let is = |role: Role| last.is_some_and(|m| m.role == role);
        let contains = |needle: &str| last.is_some_and(|m| m.content.contains(needle));
        match &self.condition {
            ScriptCondition::Always => true,
            ScriptCondition::UserContains(needle) => is(Role::User) && contains(needle),
            ScriptCondition::ToolResult => is(Role::Tool),
            ScriptCondition::ToolResultContains(needle) => is(Role::Tool) && contains(needle),
        }
    }
}

/// A request the scripted model answered, with the answer.
#[derive(Debug, Clone, PartialEq)]
pub struct ScriptedAnswer {
    /// The agent that asked.
    pub agent: ActorId,
    /// What it was given.
    pub message: ChatMessage,
}

struct Recorded {
    on: bool,
    requests: VecDeque<LlmRequest>,
    answers: VecDeque<ScriptedAnswer>,
}

impl Default for Recorded {
    fn default() -> Self {
        Self {
            on: true,
            requests: VecDeque::new(),
            answers: VecDeque::new(),
        }
    }
}

/// Appends `item`, dropping the oldest past [`SCRIPTED_LLM_RECORDED_MAX`].
fn record<T>(queue: &mut VecDeque<T>, item: T) {
    if queue.len() == SCRIPTED_LLM_RECORDED_MAX {
        queue.pop_front();
    }
    queue.push_back(item);
}

/// The scripted model; see the module documentation. Cheap to clone (shared state).
#[derive(Clone, Default)]
pub struct ScriptedLlm {
    rules: Arc<Mutex<Vec<ScriptRule>>>,
    recorded: Arc<Mutex<Recorded>>,
    next_call: Arc<AtomicU64>,
    counted: Arc<Mutex<CountedParts>>,
}

impl std::fmt::Debug for ScriptedLlm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScriptedLlm")
            .field("rules", &self.rules.lock().unwrap().len())
            .finish()
    }
}

impl ScriptedLlm {
    /// A model with an empty script.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `rule` to the script (rules are tried in the order added).
    pub fn rule(self, rule: ScriptRule) -> Self {
        self.push(rule);
        self
    }

    /// Appends `rule` to a shared script.
    pub fn push(&self, rule: ScriptRule) {
        self.rules.lock().unwrap().push(rule);
    }

    /// Stops recording requests and answers (for benchmarks and long simulations).
    pub fn without_recording(self) -> Self {
        self.recorded.lock().unwrap().on = false;
        self
    }

    /// Every request received so far, in order (the last
    /// [`SCRIPTED_LLM_RECORDED_MAX`]).
    pub fn requests(&self) -> Vec<LlmRequest> {
        self.recorded.lock().unwrap().requests.iter().cloned().collect()
    }

    /// The requests of the agent with key `agent`, in order.
    pub fn requests_of(&self, agent: &str) -> Vec<LlmRequest> {
        self.requests().into_iter().filter(|r| r.agent.key() == agent).collect()
    }

    /// Every tool result the agent with key `agent` was shown, in order (each once, at
    /// the request where it was new).
    pub fn tool_results_seen_by(&self, agent: &str) -> Vec<String> {
        self.requests_of(agent)
            .iter()
            .flat_map(|request| {
                request
                    .messages
                    .iter()
                    .rev()
                    .take_while(|m| m.role == Role::Tool)
                    .map(|m| m.content.clone())
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
            })
            .collect()
    }

    /// Every answer delivered so far, in order.
    pub fn answers(&self) -> Vec<ScriptedAnswer> {
        self.recorded.lock().unwrap().answers.iter().cloned().collect()
    }

    /// Picks the rule for `request`, consumes one of its uses, and gives its latency
    /// and action.
    fn choose(&self, request: &LlmRequest) -> Option<(Duration, Arc<ScriptAction>)> {
        let mut rules = self.rules.lock().unwrap();
        let rule = rules.iter_mut().find(|rule| rule.matches(request))?;
        if let Some(left) = &mut rule.uses_left {
            *left -= 1;
        }
        Some((rule.latency, Arc::clone(&rule.action)))
    }
}

/// The values templates refer to, borrowed from the request where they can be. Each is
/// found when a template first names it: most templates name one or none, and finding
/// them all for every answer (the tool results joined, the route split) was about 2,500
/// instructions of a `call_agent` round trip's three answers (callgrind, 2026-11-28).
struct TemplateValues<'a> {
    request: &'a LlmRequest,
    input: OnceCell<&'a str>,
    /// Borrowed when there is one result (the usual step), joined when there are more.
    tool_result: OnceCell<Cow<'a, str>>,
    /// `{route_next}` and `{route_rest}`.
    route: OnceCell<(&'a str, String)>,
}

impl<'a> TemplateValues<'a> {
    fn of(request: &'a LlmRequest) -> Self {
        Self {
            request,
            input: OnceCell::new(),
            tool_result: OnceCell::new(),
            route: OnceCell::new(),
        }
    }

    fn input(&self) -> &'a str {
        let messages = &self.request.messages;
        self.input.get_or_init(|| {
            messages
                .iter()
                .rev()
                .find(|m| m.role == Role::User)
                .map_or("", |m| m.content.as_str())
        })
    }

    fn tool_result(&self) -> &str {
        let messages = &self.request.messages;
        self.tool_result.get_or_init(|| {
            let mut results = messages.iter().rev().take_while(|m| m.role == Role::Tool);
            match (results.next(), results.next()) {
                (None, _) => Cow::Borrowed(""),
                (Some(only), None) => Cow::Borrowed(only.content.as_str()),
                (Some(_), Some(_)) => {
                    let mut results: Vec<&str> = messages
                        .iter()
                        .rev()
                        .take_while(|m| m.role == Role::Tool)
                        .map(|m| m.content.as_str())
                        .collect();
                    results.reverse();
                    Cow::Owned(results.join("; "))
                }
            }
        })
    }

    fn route(&self) -> &(&'a str, String) {
        let input = self.input();
        self.route.get_or_init(|| {
            let route: Vec<&str> = input
                .split_once("route:")
                .map(|(_, route)| route.split_whitespace().collect())
                .unwrap_or_default();
            let next = route.first().copied().unwrap_or_default();
            let rest = route.iter().skip(1).map(|hop| format!(" {hop}")).collect();
            (next, rest)
        })
    }

    /// The value of `placeholder` (one of [`PLACEHOLDERS`]).
    fn value(&self, placeholder: &str) -> &str {
        match placeholder {
            "{input}" => self.input(),
            "{tool_result}" => self.tool_result(),
            "{agent}" => self.request.agent.key(),
            "{route_next}" => self.route().0,
            "{route_rest}" => self.route().1.as_str(),
            other => unreachable!("{other} is not a placeholder"),
        }
    }

    /// Replaces each placeholder in turn (a value may hold a later placeholder, which is
    /// then replaced too); a placeholder that is not there costs no copy, and a text
    /// without a `{` has none left to replace.
    fn fill(&self, template: &str) -> String {
        // Borrowed until a placeholder is replaced: a template is copied once, filled or
        // not, rather than copied first and then again by each replacement.
        let mut text = Cow::Borrowed(template);
        for placeholder in PLACEHOLDERS {
            if !text.contains('{') {
                break;
            }
            if let Some(filled) = replace_placeholder(&text, placeholder, || self.value(placeholder)) {
                text = Cow::Owned(filled);
            }
        }
        text.into_owned()
    }

    /// `value` with every string filled in (see [`TemplateValues::fill`]).
    fn fill_json(&self, value: &Value) -> Value {
        let mut filled = value.clone();
        self.fill_json_in_place(&mut filled);
        filled
    }

    fn fill_json_in_place(&self, value: &mut Value) {
        match value {
            Value::String(text) => {
                if text.contains('{') {
                    *text = self.fill(text);
                }
            }
            Value::Array(items) => items.iter_mut().for_each(|item| self.fill_json_in_place(item)),
            Value::Object(fields) => fields.values_mut().for_each(|item| self.fill_json_in_place(item)),
            Value::Null | Value::Bool(_) | Value::Number(_) => {}
        }
    }
}

/// `text.replace(placeholder, value())` when `text` holds `placeholder` (a `{` and
/// more), `None` when it does not: found by looking at each `{` of `text` in turn
/// rather than through `str`'s substring search, whose set-up for each of the five
/// placeholders cost more than the fill itself (callgrind, 2026-11-29).
fn replace_placeholder<'a>(text: &str, placeholder: &str, value: impl FnOnce() -> &'a str) -> Option<String> {
    let at = |from: usize| {
        text[from..]
            .match_indices('{')
            .map(|(offset, _)| from + offset)
            .find(|&start| text[start..].starts_with(placeholder))
    };
    let mut next = at(0)?;
    let value = value();
    let mut filled = String::with_capacity(text.len() + value.len());
    let mut copied = 0;
    loop {
        filled.push_str(&text[copied..next]);
        filled.push_str(value);
        copied = next + placeholder.len();
        match at(copied) {
            Some(found) => next = found,
            None => break,
        }
    }
    filled.push_str(&text[copied..]);
    Some(filled)
}

/// The placeholders, in the order [`TemplateValues::fill`] replaces them.
const PLACEHOLDERS: [&str; 5] = ["{input}", "{tool_result}", "{agent}", "{route_next}", "{route_rest}"];

#[async_trait]
impl LlmClient for ScriptedLlm {
    async fn complete(&self, request: LlmRequest) -> Result<LlmReply, LlmError> {
        {
            let mut recorded = self.recorded.lock().unwrap();
            if recorded.on {
                record(&mut recorded.requests, request.clone());
            }
        }
        let Some((latency, action)) = self.choose(&request) else {
            let last = request
                .messages
                .last()
                .map(|m| format!("{:?}: {}", m.role, m.content))
                .unwrap_or_default();
            return Err(LlmError::Malformed {
                cause: format!(
                    "scripted model: no rule for {} matches the last message ({last})",
                    request.agent
                ),
            });
        };
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        let values = TemplateValues::of(&request);
        let message = match &*action {
            ScriptAction::Fail(cause) => {
                return Err(LlmError::Injected {
                    cause: values.fill(cause),
                })
            }
            ScriptAction::Reply(template) => ChatMessage::new(Role::Assistant, values.fill(template)),
            ScriptAction::CallTools(calls) => {
                let mut message = ChatMessage::new(Role::Assistant, "");
                for (name, arguments) in calls {
                    let number = self.next_call.fetch_add(1, Ordering::Relaxed) + 1;
                    let id = ["call_", itoa::Buffer::new().format(number)].concat();
                    message.tool_calls.push(ToolCall {
                        id,
                        name: name.clone(),
                        arguments: values.fill_json(arguments),
                    });
                }
                message
            }
        };
        let prompt_tokens = self
            .counted
            .lock()
            .unwrap()
            .prompt_words(&request.agent, &request.messages);
        let usage = scripted_usage(prompt_tokens, &message);
        if let Some(max_tokens) = request.max_tokens {
            if usage.total_tokens > max_tokens {
                return Err(LlmError::OverTokenLimit {
                    needed: usage.total_tokens,
                    max_tokens,
                });
            }
        }
        let mut recorded = self.recorded.lock().unwrap();
        if recorded.on {
            record(
                &mut recorded.answers,
                ScriptedAnswer {
                    agent: request.agent.clone(),
                    message: message.clone(),
                },
            );
        }
        drop(recorded);
        Ok(LlmReply::new(message).with_usage(usage))
    }
}

/// Words (whitespace-separated) of a message's text and its tool calls' arguments.
fn message_words(message: &ChatMessage) -> u64 {
    let text = text_words(&message.content);
    let arguments: usize = message
        .tool_calls
        .iter()
        .map(|call| 1 + json_words(&call.arguments))
        .sum();
    u64::try_from(text + arguments).unwrap_or(u64::MAX)
}

/// `text.split_whitespace().count()`, a byte at a time when `text` is ASCII (whose
/// whitespace is `\t`..=`\r` and the space, as for [`char::is_whitespace`]).
fn text_words(text: &str) -> usize {
    if !text.is_ascii() {
        return text.split_whitespace().count();
    }
    let mut words = 0;
    let mut after_blank = true;
    for &byte in text.as_bytes() {
        let blank = matches!(byte, b'\t'..=b'\r' | b' ');
        if after_blank && !blank {
            words += 1;
        }
        after_blank = blank;
    }
    words
}

/// `value.to_string().split_whitespace().count()`, without building the text: compact
/// JSON starts and ends with a non-whitespace character and has whitespace only inside
/// strings (keys and values), so its words are one more than the whitespace runs in
/// those strings as serialized (control characters, whitespace or not, are written as
/// escapes, which are not whitespace).
fn json_words(value: &Value) -> usize {
    1 + json_whitespace_runs(value)
}

fn json_whitespace_runs(value: &Value) -> usize {
    match value {
        Value::String(text) => string_whitespace_runs(text),
        Value::Array(items) => items.iter().map(json_whitespace_runs).sum(),
        Value::Object(fields) => fields
            .iter()
            .map(|(key, value)| string_whitespace_runs(key) + json_whitespace_runs(value))
            .sum(),
        Value::Null | Value::Bool(_) | Value::Number(_) => 0,
    }
}

/// Whitespace runs in `text` as a JSON string literal writes it (see [`json_words`]).
fn string_whitespace_runs(text: &str) -> usize {
    if text.is_ascii() {
        // ASCII whitespace other than the space is a control character: escaped.
        let mut runs = 0;
        let mut in_run = false;
        for &byte in text.as_bytes() {
            let blank = byte == b' ';
            if blank && !in_run {
                runs += 1;
            }
            in_run = blank;
        }
        return runs;
    }
    let mut runs = 0;
    let mut in_run = false;
    for c in text.chars() {
        let blank = c >= ' ' && c.is_whitespace();
        if blank && !in_run {
            runs += 1;
        }
        in_run = blank;
    }
    runs
}

/// The words of `messages`, saturating.
fn messages_words<'a>(messages: impl IntoIterator<Item = &'a ChatMessage>) -> u64 {
    messages.into_iter().map(message_words).fold(0_u64, u64::saturating_add)
}

/// The word counts of the prompt parts each agent was last shown, so the next prompt
/// counts only its new parts: an agent's prompts share most parts (the system message,
/// the window's turns, the turn's earlier steps; see [`Prompt`]). A part is known by its
/// address, held here so it cannot be reused while it is compared; parts are immutable,
/// so a count kept is the count of the part. Holds at most
/// [`SCRIPTED_LLM_COUNTED_AGENTS_MAX`] agents' prompts (then starts over).
#[derive(Default)]
struct CountedParts {
    agents: BTreeMap<ActorId, Vec<CountedPart>>,
}

/// A prompt part, held, with its words.
type CountedPart = (Arc<[ChatMessage]>, u64);

impl CountedParts {
    /// The words of `prompt` (equal to `messages_words(prompt)`), remembering its
    /// parts' counts as `agent`'s.
    fn prompt_words(&mut self, agent: &ActorId, prompt: &Prompt) -> u64 {
        if let Some(counted) = self.agents.get_mut(agent) {
            return count_parts(counted, prompt);
        }
        if self.agents.len() >= SCRIPTED_LLM_COUNTED_AGENTS_MAX {
            self.agents.clear();
        }
        let mut counted = Vec::new();
        let total = count_parts(&mut counted, prompt);
        self.agents.insert(agent.clone(), counted);
        total
    }
}

/// The words of `prompt`, making `counted` (the parts last shown, with their counts)
/// the prompt's parts with their counts; a part seen before keeps its count.
///
/// Edited in place: the parts no longer shown are removed, a new part is inserted, and
/// nothing is cloned but a new part's `Arc`. A prompt holds a part per turn of the
/// agent's window, so building a new list at every step (an allocation of the whole
/// list, each part moved, the old list freed) cost more than the counting (callgrind,
/// 2026-11-25: 17,000 instructions of a `call_agent` round trip's 176,000, three
/// steps).
fn count_parts(counted: &mut Vec<CountedPart>, prompt: &Prompt) -> u64 {
    // The parts seen before come in the same order (some dropped, new ones added), so
    // one pass walks the list once: `counted[..at]` are this prompt's parts so far.
    // Almost every part is the next one counted (a window of 64 messages is about 55
    // parts, of which one or two are new per step), so that case is a pointer
    // comparison in a loop over each run of parts, and the rest is out of line.
    let mut at = 0;
    // Summed wide, with no check per part: fewer than 2^64 counts below 2^64 cannot
    // overflow a `u128`; the total is saturated to `u64` once, at the end.
    let mut total = 0_u128;
    for run in prompt.part_runs() {
        let mut rest = run;
        while !rest.is_empty() {
            // The longest stretch of `rest` that is the next parts counted, summed in a
            // tight loop of pointer comparisons (callgrind, 2026-12-01: the loop it
            // replaced, a lookup and a saturating add per part, cost 3,300 instructions
            // of a `call_agent` round trip's 76,500).
            let known = counted.get(at..).unwrap_or_default();
            let same = rest
                .iter()
                .zip(known)
                .take_while(|(part, (seen, _))| Arc::ptr_eq(seen, part))
                .count();
            total += known[..same].iter().map(|(_, words)| u128::from(*words)).sum::<u128>();
            at += same;
            rest = &rest[same..];
            if let Some((part, after)) = rest.split_first() {
                total += u128::from(count_part_out_of_order(counted, at, part));
                at += 1;
                rest = after;
            }
        }
    }
    counted.truncate(at);
    u64::try_from(total).unwrap_or(u64::MAX)
}

/// The words of `part`, which is not `counted[at]`: a part further on (the ones before
/// it are no longer in the prompt and are removed), or a new part (counted and inserted
/// at `at`).
#[cold]
#[inline(never)]
fn count_part_out_of_order(counted: &mut Vec<CountedPart>, at: usize, part: &Arc<[ChatMessage]>) -> u64 {
    match counted[at..].iter().position(|(seen, _)| Arc::ptr_eq(seen, part)) {
        Some(dropped) => {
            counted.drain(at..at + dropped);
            counted[at].1
        }
        None => {
            let words = messages_words(part.iter());
            counted.insert(at, (Arc::clone(part), words));
            words
        }
    }
}

/// The scripted model's token count: one token per word (see the module doc), the
/// prompt's already counted.
fn scripted_usage(prompt_tokens: u64, reply: &ChatMessage) -> TokenUsage {
    let completion_tokens = message_words(reply);
    TokenUsage {
        prompt_tokens,
        completion_tokens,
        total_tokens: prompt_tokens.saturating_add(completion_tokens),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use troupe_core::Deadline;

    fn request(agent: &str, messages: Vec<ChatMessage>) -> LlmRequest {
        LlmRequest {
            agent: ActorId::new("agent", agent).unwrap(),
            model: "scripted".into(),
            max_tokens: None,
            messages: messages.into(),
            tools: Vec::new().into(),
            deadline: Deadline::from_micros(u64::MAX),
        }
    }

    fn script() -> ScriptedLlm {
        ScriptedLlm::new()
            .rule(ScriptRule::agent("researcher").on_user_containing("papers").call(
                "call_agent",
                json!({"agent_id": "analyst", "message": "check: {input}"}),
            ))
            .rule(
                ScriptRule::agent("researcher")
                    .on_tool_result()
                    .reply("summary: {tool_result}"),
            )
            .rule(ScriptRule::agent("flaky").fail("overloaded").times(1))
            .rule(ScriptRule::agent("flaky").reply("recovered"))
    }

    #[tokio::test(start_paused = true)]
    async fn the_first_matching_rule_answers_with_templates_filled() {
        let llm = script();
        let user = ChatMessage::new(Role::User, "find papers");
        let first = llm.complete(request("researcher", vec![user.clone()])).await.unwrap();
        assert_eq!(first.message.tool_calls.len(), 1);
        assert_eq!(first.message.tool_calls[0].name, "call_agent");
        assert_eq!(
            first.message.tool_calls[0].arguments,
            json!({"agent_id": "analyst", "message": "check: find papers"})
        );
        let id = first.message.tool_calls[0].id.clone();
        let second = llm
            .complete(request(
                "researcher",
                vec![user, first.message, ChatMessage::tool_result(id, "42")],
            ))
            .await
            .unwrap();
        assert_eq!(second.message.content, "summary: 42");
        // One token per word: "find papers" (2) + the call (1 for the call, 3 for its
        // compact JSON `{..."check: find papers"}`) + "42" (1) = 7 prompt tokens;
        // "summary: 42" = 2 completion tokens.
        assert_eq!(
            second.usage,
            Some(TokenUsage {
                prompt_tokens: 7,
                completion_tokens: 2,
                total_tokens: 9
            })
        );
        assert_eq!(llm.tool_results_seen_by("researcher"), vec!["42".to_string()]);
        assert_eq!(llm.answers().len(), 2);
    }

    /// Every placeholder, in text and in nested tool arguments; a value holding a later
    /// placeholder has it replaced too (`{input}` below holds `{agent}` and
    /// `{tool_result}`), an earlier one stays (the tool result's `{input}`); keys, and
    /// placeholders that are not one, are kept as they are.
    #[tokio::test(start_paused = true)]
    async fn every_placeholder_is_filled_in_order_in_text_and_nested_arguments() {
        let llm = ScriptedLlm::new()
            .rule(ScriptRule::agent("hop").on_tool_result().reply(
                "[{tool_result}] next={route_next} rest={route_rest} in={input} me={agent} {unknown}",
            ))
            .rule(ScriptRule::agent("hop").call(
                "call_agent",
                json!({"agent_id": "{route_next}", "message": {"text": "route:{route_rest}", "n": [1, "{agent}", null]}, "{input}": "key"}),
            ))
            .without_recording();
        let user = ChatMessage::new(Role::User, "for {agent} {tool_result} route: b  c d");
        let first = llm.complete(request("hop", vec![user.clone()])).await.unwrap();
        assert_eq!(
            first.message.tool_calls[0].arguments,
            json!({"agent_id": "b", "message": {"text": "route: c d", "n": [1, "hop", null]}, "{input}": "key"})
        );
        let id = first.message.tool_calls[0].id.clone();
        let results = vec![
            user,
            first.message,
            ChatMessage::tool_result(id.clone(), "x {input}"),
            ChatMessage::tool_result(id, "y"),
        ];
        let second = llm.complete(request("hop", results)).await.unwrap();
        assert_eq!(
            second.message.content,
            "[x {input}; y] next=b rest= c d in=for hop x {input}; y route: b  c d me=hop {unknown}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn no_matching_rule_is_an_error_and_limited_rules_run_out() {
        let llm = script();
        let unknown = llm
            .complete(request("nobody", vec![ChatMessage::new(Role::User, "hi")]))
            .await;
        assert!(matches!(unknown, Err(LlmError::Malformed { .. })), "{unknown:?}");
        let hello = || request("flaky", vec![ChatMessage::new(Role::User, "hi")]);
        assert_eq!(
            llm.complete(hello()).await,
            Err(LlmError::Injected {
                cause: "overloaded".into()
            })
        );
        assert_eq!(llm.complete(hello()).await.unwrap().message.content, "recovered");
    }

    #[tokio::test(start_paused = true)]
    async fn latency_is_slept_on_the_clock_and_a_dropped_request_records_no_answer() {
        let llm = ScriptedLlm::new().rule(ScriptRule::any_agent().reply("late").latency(Duration::from_secs(5)));
        let started = tokio::time::Instant::now();
        let cut = tokio::time::timeout(Duration::from_secs(1), llm.complete(request("a", Vec::new()))).await;
        assert!(cut.is_err());
        assert_eq!(llm.requests().len(), 1);
        assert!(
            llm.answers().is_empty(),
            "a cancelled request must not deliver an answer"
        );
        let answer = llm.complete(request("a", Vec::new())).await.unwrap();
        assert_eq!(answer.message.content, "late");
        // madsim adds a few microseconds of scheduling jitter to virtual time.
        let elapsed = started.elapsed();
        assert!(
            elapsed >= Duration::from_secs(6) && elapsed < Duration::from_millis(6_010),
            "{elapsed:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_same_requests_get_the_same_answers() {
        let run = || async {
            let llm = script();
            let mut out = Vec::new();
            for text in ["papers please", "more papers"] {
                out.push(
                    llm.complete(request("researcher", vec![ChatMessage::new(Role::User, text)]))
                        .await
                        .unwrap(),
                );
            }
            out
        };
        assert_eq!(run().await, run().await);
    }

    proptest::proptest! {
        /// Over random request sequences: a rule limited to `n` uses answers exactly the
        /// first `min(n, matching requests)` of them, the fallback the rest, other agents
        /// never match, and the choice depends on nothing but the script and the requests.
        #[test]
        fn limited_rules_answer_exactly_their_first_uses_and_choices_are_reproducible(
            limit in 0u32..5,
            agents in proptest::collection::vec(proptest::prop_oneof![proptest::strategy::Just("a"), proptest::strategy::Just("b")], 0..20),
        ) {
            let build = || {
                ScriptedLlm::new()
                    .rule(ScriptRule::agent("a").reply("limited").times(limit))
                    .rule(ScriptRule::agent("a").reply("fallback"))
            };
            let (first, second) = (build(), build());
            let mut limited_seen = 0;
            for agent in &agents {
                let req = request(agent, vec![ChatMessage::new(Role::User, "x")]);
                let chosen = first.choose(&req).map(|(_, action)| action);
                proptest::prop_assert_eq!(&chosen, &second.choose(&req).map(|(_, action)| action));
                match (*agent, chosen.as_deref()) {
                    ("b", None) => {}
                    ("a", Some(ScriptAction::Reply(text))) if text == "limited" => {
                        limited_seen += 1;
                        proptest::prop_assert!(limited_seen <= limit);
                    }
                    ("a", Some(ScriptAction::Reply(text))) if text == "fallback" => {
                        proptest::prop_assert_eq!(limited_seen, limit);
                    }
                    other => proptest::prop_assert!(false, "unexpected choice {:?}", other),
                }
            }
            let a_requests = agents.iter().filter(|a| **a == "a").count() as u32;
            proptest::prop_assert_eq!(limited_seen, limit.min(a_requests));
        }

        /// The word count walked over a JSON value is the count of its compact text's
        /// whitespace-separated words, for strings (keys included) mixing ASCII and
        /// Unicode whitespace, control characters, quotes and backslashes.
        #[test]
        fn json_words_counts_the_words_of_the_compact_text(value in json_value()) {
            proptest::prop_assert_eq!(json_words(&value), value.to_string().split_whitespace().count());
        }
    }

    proptest::proptest! {
        /// The byte-wise count agrees with `split_whitespace` on ASCII (every ASCII
        /// control and blank character) and on text that is not ASCII.
        #[test]
        fn text_words_counts_as_split_whitespace_does(
            bytes in proptest::collection::vec(0u8..0x80, 0..40),
            other in "[ a\u{a0}\u{3000}\t\u{0b}é]{0,20}",
        ) {
            let ascii = String::from_utf8(bytes).unwrap();
            proptest::prop_assert_eq!(text_words(&ascii), ascii.split_whitespace().count());
            proptest::prop_assert_eq!(text_words(&other), other.split_whitespace().count());
        }
    }

    /// Arbitrary JSON whose strings are drawn from characters that matter to the count.
    fn json_value() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let text = proptest::collection::vec(
            prop_oneof![
                Just('a'),
                Just('z'),
                Just(' '),
                Just('\t'),
                Just('\n'),
                Just('\r'),
                Just('\u{0b}'),
                Just('\u{0c}'),
                Just('\u{1f}'),
                Just('\u{85}'),
                Just('\u{a0}'),
                Just('\u{2028}'),
                Just('\u{3000}'),
                Just('"'),
                Just('\\'),
                Just('é'),
            ],
            0..12,
        )
        .prop_map(|chars| chars.into_iter().collect::<String>());
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            text.clone().prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 32, 6, move |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                proptest::collection::btree_map(text.clone(), inner, 0..6)
                    .prop_map(|fields| Value::Object(fields.into_iter().collect())),
            ]
        })
    }

    proptest::proptest! {
        /// The counted parts give every prompt the count of all its messages walked
        /// afresh (the count before prompts were shared), over prompts built the way
        /// agents build them: a system part, the window's parts (the oldest dropping
        /// off), a turn's new parts, some prompts of other agents and some of parts
        /// never seen, interleaved.
        #[test]
        fn counted_parts_give_the_count_of_every_message_walked(
            steps in proptest::collection::vec((0u8..3, 0usize..3, 0u8..4, proptest::collection::vec("[ a\u{a0}x]{0,6}", 1..4)), 1..40),
            tiny_cache in proptest::bool::ANY,
        ) {
            let agents = [ActorId::new("agent", "a").unwrap(), ActorId::new("agent", "b").unwrap(), ActorId::new("agent", "c").unwrap()];
            let system: Arc<[ChatMessage]> = Arc::new([ChatMessage::new(Role::System, "you are a")]);
            let mut windows: Vec<Vec<Arc<[ChatMessage]>>> = vec![Vec::new(); agents.len()];
            let mut counted = CountedParts::default();
            for (agent, dropped, kind, texts) in steps {
                let agent_index = usize::from(agent);
                let window = &mut windows[agent_index];
                let part: Arc<[ChatMessage]> = texts
                    .iter()
                    .map(|text| {
                        let mut message = ChatMessage::new(Role::Assistant, text.clone());
                        if text.len() % 2 == 0 {
                            message.tool_calls.push(ToolCall {
                                id: "c".into(),
                                name: "t".into(),
                                arguments: serde_json::json!({"m": text}),
                            });
                        }
                        message
                    })
                    .collect::<Vec<_>>()
                    .into();
                let mut prompt = Prompt::new();
                match kind {
                    // A step: the system part, the window, the new part (kept).
                    0 | 1 => {
                        window.drain(..dropped.min(window.len()));
                        window.push(part);
                        prompt.push_part(Arc::clone(&system));
                        window.iter().for_each(|part| prompt.push_part(Arc::clone(part)));
                    }
                    // A copy of the window's messages in new parts.
                    2 => {
                        window.iter().for_each(|part| prompt.push_part(part.to_vec().into()));
                        prompt.push_part(part);
                    }
                    // The window reversed: parts seen, out of order.
                    _ => {
                        window.iter().rev().for_each(|part| prompt.push_part(Arc::clone(part)));
                    }
                }
                if tiny_cache && agent_index == 2 {
                    counted.agents.clear();
                }
                let expected = messages_words(prompt.iter());
                proptest::prop_assert_eq!(counted.prompt_words(&agents[agent_index], &prompt), expected);
                // What is kept is this prompt's parts, in order, each with its own count.
                let kept = &counted.agents[&agents[agent_index]];
                proptest::prop_assert_eq!(kept.len(), prompt.parts().count());
                for ((held, words), part) in kept.iter().zip(prompt.parts()) {
                    proptest::prop_assert!(Arc::ptr_eq(held, part));
                    proptest::prop_assert_eq!(*words, messages_words(part.iter()));
                }
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_prompt_sharing_parts_with_the_last_is_counted_the_same() {
        let llm = ScriptedLlm::new().rule(ScriptRule::any_agent().reply("fine thanks"));
        let user: Arc<[ChatMessage]> = Arc::new([ChatMessage::new(Role::User, "how are you")]);
        let first = Prompt::from(Arc::clone(&user));
        let mut second = first.clone();
        second.push(ChatMessage::new(Role::Assistant, "fine thanks"));
        second.push(ChatMessage::new(Role::User, "and now?"));
        let mut usages = Vec::new();
        for messages in [first, second.clone(), second] {
            let mut request = request("a", Vec::new());
            request.messages = messages;
            usages.push(llm.complete(request).await.unwrap().usage.unwrap().prompt_tokens);
        }
        assert_eq!(usages, [3, 3 + 2 + 2, 7]);
    }

    #[test]
    fn json_words_of_simple_arguments() {
        assert_eq!(json_words(&json!({})), 1);
        assert_eq!(json_words(&json!({"agent_id": "b", "message": "what is 6 x 7?"})), 5);
        assert_eq!(json_words(&json!({" a ": [" ", "\n x"]})), 5);
    }

    proptest::proptest! {
        /// A placeholder is replaced as `str::replace` replaces it, everywhere, also next
        /// to braces, another placeholder or a part of one.
        #[test]
        fn a_placeholder_is_replaced_as_str_replace_does(
            pieces in proptest::collection::vec(
                proptest::prop_oneof![
                    proptest::strategy::Just("{input}"),
                    proptest::strategy::Just("{agent}"),
                    proptest::strategy::Just("{in"),
                    proptest::strategy::Just("{"),
                    proptest::strategy::Just("}"),
                    proptest::strategy::Just("put}"),
                    proptest::strategy::Just("a b"),
                    proptest::strategy::Just("é"),
                ],
                0..12,
            ),
            value in "[a-z{}]{0,8}",
        ) {
            let text = pieces.concat();
            for placeholder in ["{input}", "{agent}"] {
                let expected = text.contains(placeholder).then(|| text.replace(placeholder, &value));
                proptest::prop_assert_eq!(replace_placeholder(&text, placeholder, || value.as_str()), expected);
            }
        }
    }
}
