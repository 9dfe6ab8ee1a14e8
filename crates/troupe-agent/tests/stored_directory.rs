//! Agents defined through the API are stored (`directory_store.rs`): they outlive the
//! process that defined them, and every process sharing the store sees a definition, a
//! replacement or a removal within `DIRECTORY_REFRESH_MS`. Two "processes" are two agent
//! systems on one store (in the simulator as well as on tokio); the model is scripted.

use std::sync::Arc;
use std::time::Duration;

use troupe_agent::{
    AgentCallError, AgentSpec, AgentSystem, DirectoryError, ScriptRule, ScriptedLlm, DIRECTORY_REFRESH_MS,
};
use troupe_core::CallRefused;
use troupe_runtime::{MemoryStore, StateStore};

/// Every agent answers `{agent} says hi`.
fn script() -> ScriptedLlm {
    ScriptedLlm::new().rule(ScriptRule::any_agent().on_user_containing("").reply("{agent} says hi"))
}

/// A system on `store`, built with `agents`.
fn start_on(llm: &ScriptedLlm, agents: &[&str], store: Arc<dyn StateStore>) -> AgentSystem {
    let mut builder = AgentSystem::builder().store(store).llm(Arc::new(llm.clone()));
    for agent in agents {
        builder = builder.agent(AgentSpec::new(*agent).role(format!("the {agent}")));
    }
    builder.start().expect("the system starts")
}

fn not_found(result: Result<troupe_agent::AgentReply, AgentCallError>) -> bool {
    matches!(result, Err(AgentCallError::Refused(CallRefused::AgentNotFound { .. })))
}

/// The system prompt of the last request agent `agent`'s model got.
fn last_prompt(llm: &ScriptedLlm, agent: &str) -> String {
    let request = llm.requests_of(agent).pop().expect("the agent's model was asked");
    request.messages.first().expect("a system message").content.clone()
}

/// Goal: what the API defines, replaces and removes is what the next process on the
/// store has, even an agent it was built with. Method: one system defines `x`, replaces
/// it, removes the built agent `a` and shuts down; a second one on the same store, built
/// with `a` again, answers as `x` (with the replacement) and refuses `a`, until it
/// defines `a` again.
#[tokio::test(start_paused = true)]
async fn what_the_api_defines_replaces_and_removes_outlives_the_process() {
    let llm = script();
    let store: Arc<dyn StateStore> = Arc::new(MemoryStore::new());
    let first = start_on(&llm, &["a"], Arc::clone(&store));
    first
        .define_agent(AgentSpec::new("x").system_prompt("version one"))
        .await
        .expect("x is defined");
    assert_eq!(first.ask("x", "hello").await.expect("x answers").text, "x says hi");
    assert!(matches!(
        first.define_agent(AgentSpec::new("x")).await,
        Err(DirectoryError::AgentExists { id }) if id == "x"
    ));
    assert!(matches!(
        first.define_agent(AgentSpec::new("a")).await,
        Err(DirectoryError::AgentExists { id }) if id == "a"
    ));
    assert!(matches!(
        first.replace_agent(AgentSpec::new("y")).await,
        Err(DirectoryError::NoSuchAgent { id }) if id == "y"
    ));
    assert!(matches!(
        first.define_agent(AgentSpec::new("")).await,
        Err(DirectoryError::Invalid(_))
    ));
    first
        .replace_agent(AgentSpec::new("x").system_prompt("version two"))
        .await
        .expect("x is replaced");
    let removed = first.remove_agent("a").await.expect("the removal is stored");
    assert_eq!(removed.map(|spec| spec.id), Some("a".to_string()));
    assert!(not_found(first.ask("a", "still there?").await));
    first.shutdown().await;

    let second = start_on(&llm, &["a"], Arc::clone(&store));
    assert_eq!(second.ask("x", "again").await.expect("x answers").text, "x says hi");
    assert!(
        last_prompt(&llm, "x").contains("version two"),
        "the replacement is used: {}",
        last_prompt(&llm, "x")
    );
    assert!(
        not_found(second.ask("a", "are you back?").await),
        "a stays removed, although this system was built with it"
    );
    second
        .define_agent(AgentSpec::new("a"))
        .await
        .expect("a is defined again");
    assert_eq!(second.ask("a", "back?").await.expect("a answers").text, "a says hi");
    second.shutdown().await;
}

/// Goal: two processes sharing a store see each other's definitions, replacements and
/// removals within `DIRECTORY_REFRESH_MS`, and not from memory alone. Method: two
/// systems on one store; each change made by one is looked for by the other at once (the
/// other's copy is fresh: not seen) and after one refresh period (seen).
#[tokio::test(start_paused = true)]
async fn two_processes_on_one_store_see_each_others_agents_within_the_refresh_period() {
    let llm = script();
    let store: Arc<dyn StateStore> = Arc::new(MemoryStore::new());
    let one = start_on(&llm, &["a"], Arc::clone(&store));
    let two = start_on(&llm, &["a"], Arc::clone(&store));
    let period = Duration::from_millis(DIRECTORY_REFRESH_MS);
    assert_eq!(two.ask("a", "hi").await.expect("a answers").text, "a says hi");

    one.define_agent(AgentSpec::new("x").system_prompt("version one"))
        .await
        .expect("x is defined");
    assert!(not_found(two.ask("x", "hi").await), "two read the directory just now");
    tokio::time::sleep(period).await;
    assert_eq!(two.ask("x", "hi").await.expect("x answers in two").text, "x says hi");

    one.replace_agent(AgentSpec::new("x").system_prompt("version two"))
        .await
        .expect("x is replaced");
    two.ask("x", "hi").await.expect("x answers in two");
    assert!(last_prompt(&llm, "x").contains("version one"));
    tokio::time::sleep(period).await;
    two.ask("x", "hi").await.expect("x answers in two");
    assert!(
        last_prompt(&llm, "x").contains("version two"),
        "{}",
        last_prompt(&llm, "x")
    );

    one.remove_agent("x").await.expect("the removal is stored");
    assert!(not_found(one.ask("x", "hi").await));
    assert!(two.ask("x", "hi").await.is_ok(), "two read the directory just now");
    tokio::time::sleep(period).await;
    assert!(not_found(two.ask("x", "hi").await), "the removal reached two");
    assert!(two.current_directory().await.get("x").is_none(), "and its listing");
    one.shutdown().await;
    two.shutdown().await;
}

/// Goal: creating an agent is decided on the stored directory, so two processes
/// creating one id at once make one agent. Method: two systems on one SQLite store, on
/// the multi-thread runtime, each defining the same 12 ids at once with its own prompt:
/// per id one definition succeeds and the other is `AgentExists`, and after a reload
/// both systems hold the winner's definition.
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_defining_one_id_at_once_make_one_agent() {
    const IDS: usize = 12;
    let llm = script();
    let store: Arc<dyn StateStore> =
        Arc::new(troupe_runtime::SqliteStore::open_in_memory().expect("open a SQLite store"));
    let one = start_on(&llm, &[], Arc::clone(&store));
    let two = start_on(&llm, &[], Arc::clone(&store));
    let define = |system: &AgentSystem, index: usize, author: &'static str| {
        let client = system.client();
        tokio::spawn(async move {
            client
                .define_agent(AgentSpec::new(format!("x{index}")).system_prompt(author))
                .await
        })
    };
    // Spawned in turn order: first one then two for even ids, two then one for odd.
    let attempts: Vec<_> = (0..IDS)
        .map(|index| {
            if index % 2 == 0 {
                let first = define(&one, index, "by one");
                (first, define(&two, index, "by two"))
            } else {
                let second = define(&two, index, "by two");
                (define(&one, index, "by one"), second)
            }
        })
        .collect();
    let mut winners = Vec::new();
    for (index, (from_one, from_two)) in attempts.into_iter().enumerate() {
        let (from_one, from_two) = (from_one.await.expect("a task"), from_two.await.expect("a task"));
        let winner = match (&from_one, &from_two) {
            (Ok(()), Err(DirectoryError::AgentExists { .. })) => "by one",
            (Err(DirectoryError::AgentExists { .. }), Ok(())) => "by two",
            other => panic!("x{index}: one definition and one AgentExists, got {other:?}"),
        };
        winners.push(winner);
    }
    for system in [&one, &two] {
        system.reload_directory().await.expect("the directory reads");
        for (index, winner) in winners.iter().enumerate() {
            let spec = system.directory().get(&format!("x{index}")).expect("defined");
            assert_eq!(spec.system_prompt, *winner, "x{index}");
        }
    }
    eprintln!(
        "{} of {IDS} ids won by the first system",
        winners.iter().filter(|winner| **winner == "by one").count()
    );
    one.shutdown().await;
    two.shutdown().await;
}

/// Goal: every agent carries when it was defined, on the runtime's clock (what `GET
/// /v1/models` answers as `created`): one the system was built with, the time the
/// system started; one defined through the API, the time of its definition, stored with
/// it; a definition stored by an older Troupe, without that time, still loads and has
/// none. The time is not part of what makes two definitions equal. Method: a system
/// built with `a` defines `x` and `y` and shuts down; `x`'s time is taken out of the
/// stored record, as an older Troupe wrote it; a second system on the store reads it.
#[tokio::test(start_paused = true)]
async fn definitions_carry_when_they_were_defined_and_older_records_load_without() {
    use troupe_agent::{DIRECTORY_STORE_KEY, DIRECTORY_STORE_KIND};
    use troupe_core::ActorId;
    use troupe_runtime::{StateChange, TurnCommit};

    let llm = script();
    let store: Arc<dyn StateStore> = Arc::new(MemoryStore::new());
    let first = start_on(&llm, &["a"], Arc::clone(&store));
    let started = first.directory().get("a").unwrap().defined_at_us();
    assert!(
        started.is_some_and(|at| at <= first.runtime().now().as_micros()),
        "a built agent has the time the system started: {started:?}"
    );
    let before = first.runtime().now().as_micros();
    first.define_agent(AgentSpec::new("x")).await.expect("x is defined");
    first.define_agent(AgentSpec::new("y")).await.expect("y is defined");
    let after = first.runtime().now().as_micros();
    let x = first.directory().get("x").unwrap();
    let defined = x.defined_at_us().expect("a stored definition has a time");
    assert!(
        (before..=after).contains(&defined),
        "{defined} not in {before}..={after}"
    );
    assert_eq!(x, AgentSpec::new("x"), "the time does not make definitions differ");
    let y_defined = first.directory().get("y").unwrap().defined_at_us();
    first.shutdown().await;

    let record = ActorId::new(DIRECTORY_STORE_KIND, DIRECTORY_STORE_KEY).unwrap();
    let claimed = store.claim(&record).await.unwrap();
    let mut stored: serde_json::Value = serde_json::from_slice(&claimed.state.expect("a stored record")).unwrap();
    let x_stored = stored["agents"]["x"].as_object_mut().expect("x is stored");
    assert_eq!(
        x_stored.remove("defined_at_us").and_then(|at| at.as_u64()),
        Some(defined)
    );
    let commit = TurnCommit {
        state: StateChange::Set(serde_json::to_vec(&stored).unwrap().into()),
        writes: Vec::new(),
    };
    store.commit(&record, claimed.fence, commit).await.unwrap();

    let second = start_on(&llm, &["a"], Arc::clone(&store));
    assert_eq!(second.ask("x", "hello").await.expect("x answers").text, "x says hi");
    assert_eq!(
        second.directory().get("x").unwrap().defined_at_us(),
        None,
        "an older record has no time"
    );
    assert_eq!(second.directory().get("y").unwrap().defined_at_us(), y_defined);
    let restarted = second.directory().get("a").unwrap().defined_at_us();
    assert!(restarted >= started, "a built agent is defined anew at each start");
    second.shutdown().await;
}
