//! An agent's private history window is its own setting (`AgentSpec::history`): what
//! its model sees of its log at every turn, after a restart, and after the definition
//! changes; a value out of range is refused before anything runs.

use std::sync::Arc;

use troupe_agent::limits::{AGENT_HISTORY_WINDOW_DEFAULT, AGENT_HISTORY_WINDOW_MAX, AGENT_HISTORY_WINDOW_MIN};
use troupe_agent::{
    AgentSpec, AgentSpecError, AgentSystem, AgentSystemError, OrgConfig, Role, ScriptRule, ScriptedLlm,
};
use troupe_runtime::MemoryStore;

/// An agent `a` that answers "r: {question}" in one step.
fn replying_llm() -> ScriptedLlm {
    ScriptedLlm::new().rule(ScriptRule::agent("a").reply("r: {input}"))
}

fn start(llm: &ScriptedLlm, store: Arc<MemoryStore>, spec: AgentSpec) -> AgentSystem {
    AgentSystem::builder()
        .store(store)
        .llm(Arc::new(llm.clone()))
        .agent(spec)
        .start()
        .expect("the system starts")
}

/// The contents of `a`'s last model prompt, without its system message.
fn last_prompt(llm: &ScriptedLlm) -> Vec<String> {
    let request = llm.requests_of("a").pop().expect("a model request");
    request
        .messages
        .iter()
        .filter(|message| message.role != Role::System)
        .map(|message| message.content.clone())
        .collect()
}

/// What the prompt must hold when `a` is asked `question` after `turns` questions
/// `q0`, `q1`, … with a window of `window` messages: the last `window` messages of the
/// log (each turn is a question and its answer), then the question.
fn expected_prompt(turns: usize, window: usize, question: &str) -> Vec<String> {
    let log: Vec<String> = (0..turns)
        .flat_map(|turn| [format!("q{turn}"), format!("r: q{turn}")])
        .collect();
    let mut prompt = log[log.len().saturating_sub(window)..].to_vec();
    prompt.push(question.to_string());
    prompt
}

async fn ask_turns(system: &AgentSystem, turns: std::ops::Range<usize>) {
    for turn in turns {
        let reply = system.ask("a", &format!("q{turn}")).await.unwrap();
        assert_eq!(reply.text, format!("r: q{turn}"));
    }
}

/// Goal: an agent with a window of 6 messages shows its model its last 6 (three
/// exchanges) and no more, at every turn and after a restart from the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_history_window_is_what_the_model_sees_before_and_after_a_restart() {
    let (llm, store) = (replying_llm(), Arc::new(MemoryStore::new()));
    let system = start(&llm, store.clone(), AgentSpec::new("a").history(6));
    ask_turns(&system, 0..10).await;
    assert_eq!(last_prompt(&llm), expected_prompt(9, 6, "q9"));
    assert_eq!(system.history_window("a").await.unwrap().len(), 6);
    system.shutdown().await;

    let system = start(&llm, store, AgentSpec::new("a").history(6));
    assert_eq!(
        system.history_window("a").await.unwrap().len(),
        6,
        "read back from the log"
    );
    assert_eq!(system.ask("a", "again").await.unwrap().text, "r: again");
    assert_eq!(last_prompt(&llm), expected_prompt(10, 6, "again"));
    system.shutdown().await;
}

/// Goal: a window larger than the default is kept whole, and read back whole after a
/// restart (the default of 64 used to be the most any agent could keep).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_history_window_larger_than_the_default_is_kept_and_read_back() {
    let window = 100;
    assert!(window > AGENT_HISTORY_WINDOW_DEFAULT);
    let (llm, store) = (replying_llm(), Arc::new(MemoryStore::new()));
    let system = start(&llm, store.clone(), AgentSpec::new("a").history(window));
    ask_turns(&system, 0..60).await;
    assert_eq!(last_prompt(&llm), expected_prompt(59, window, "q59"));
    assert_eq!(last_prompt(&llm).len(), window + 1);
    system.shutdown().await;

    let system = start(&llm, store, AgentSpec::new("a").history(window));
    assert_eq!(system.history_window("a").await.unwrap().len(), window);
    system.ask("a", "again").await.unwrap();
    assert_eq!(last_prompt(&llm), expected_prompt(60, window, "again"));
    system.shutdown().await;
}

/// Goal: a smaller window takes effect at the agent's next turn, whether the definition
/// changes while the agent runs or between two runs: the model never sees more than it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_made_smaller_applies_from_the_next_turn_while_running_and_after_a_restart() {
    let (llm, store) = (replying_llm(), Arc::new(MemoryStore::new()));
    let system = start(&llm, store.clone(), AgentSpec::new("a").history(20));
    ask_turns(&system, 0..15).await;
    assert_eq!(last_prompt(&llm), expected_prompt(14, 20, "q14"));

    // While it runs (the agent is active): the next turn shows 4.
    system.directory().upsert(AgentSpec::new("a").history(4)).unwrap();
    ask_turns(&system, 15..16).await;
    assert_eq!(last_prompt(&llm), expected_prompt(15, 4, "q15"));
    system.shutdown().await;

    // Kept 4 and restarted with 20 again: it grows back from the 4 it kept.
    let system = start(&llm, store.clone(), AgentSpec::new("a").history(20));
    ask_turns(&system, 16..17).await;
    assert_eq!(last_prompt(&llm), expected_prompt(16, 4, "q16"), "the 4 it kept");
    ask_turns(&system, 17..18).await;
    assert_eq!(
        last_prompt(&llm),
        expected_prompt(17, 6, "q17"),
        "the 4 kept and the next exchange"
    );
    ask_turns(&system, 18..30).await;
    assert_eq!(last_prompt(&llm), expected_prompt(29, 20, "q29"));
    system.shutdown().await;

    // Kept 20 and restarted with 2: the first turn after the restart already shows 2.
    let system = start(&llm, store, AgentSpec::new("a").history(AGENT_HISTORY_WINDOW_MIN));
    ask_turns(&system, 30..31).await;
    assert_eq!(last_prompt(&llm), expected_prompt(30, 2, "q30"));
    system.shutdown().await;
}

/// Goal: a window out of range is refused, naming the agent, the value and the range,
/// by the builder, by the directory and in a config file (naming the line and field).
#[tokio::test]
async fn a_history_window_out_of_range_is_refused_naming_the_range() {
    for bad in [0, 1, AGENT_HISTORY_WINDOW_MAX + 1] {
        let Err(error) = AgentSystem::builder()
            .llm(Arc::new(replying_llm()))
            .agent(AgentSpec::new("a").history(bad))
            .start()
        else {
            panic!("a history window of {bad} was taken");
        };
        match &error {
            AgentSystemError::Spec(AgentSpecError::HistoryOutOfRange { id, value, min, max }) => {
                assert_eq!(
                    (id.as_str(), *value, *min, *max),
                    ("a", bad, AGENT_HISTORY_WINDOW_MIN, AGENT_HISTORY_WINDOW_MAX)
                );
            }
            other => panic!("expected HistoryOutOfRange, got {other:?}"),
        }
        let text = error.to_string();
        assert!(
            text.contains(&format!("is {bad} messages"))
                && text.contains(&format!("{AGENT_HISTORY_WINDOW_MIN}..={AGENT_HISTORY_WINDOW_MAX}")),
            "{text}"
        );
    }

    let system = start(&replying_llm(), Arc::new(MemoryStore::new()), AgentSpec::new("a"));
    let refused = system.directory().upsert(AgentSpec::new("a").history(1)).unwrap_err();
    assert!(
        matches!(refused, AgentSpecError::HistoryOutOfRange { value: 1, .. }),
        "{refused:?}"
    );
    assert_eq!(
        system.directory().get("a").unwrap().history,
        AGENT_HISTORY_WINDOW_DEFAULT,
        "the old definition stays"
    );
    system.shutdown().await;

    let file = "[[agents]]\nid = \"a\"\nhistory_messages = 5000\n";
    let error = OrgConfig::from_toml(file, "org.toml").unwrap_err().to_string();
    assert!(
        error.contains("org.toml:3:") && error.contains("field `agents[0].history_messages`"),
        "{error}"
    );
    assert!(
        error.contains(&format!(
            "5000 is not in {AGENT_HISTORY_WINDOW_MIN}..={AGENT_HISTORY_WINDOW_MAX}"
        )),
        "{error}"
    );
    let taken = OrgConfig::from_toml("[[agents]]\nid = \"a\"\nhistory_messages = 200\n", "org.toml").unwrap();
    assert_eq!(taken.agent_specs()[0].history, 200);
}
