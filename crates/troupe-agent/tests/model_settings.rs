//! An agent's model settings are checked the same way on every path a definition
//! takes: the builder, the API (`define_agent`, `replace_agent`: the server's
//! `POST`/`PUT /v1/agents`), a config file, and the stored directory another process
//! (or an older Troupe) wrote.
//!
//! Runs in both builds: `cargo test -p troupe-agent --test model_settings` (tokio with
//! paused time) and `CARGO_TARGET_DIR=target/madsim RUSTFLAGS="--cfg madsim" cargo test
//! -p troupe-agent --test model_settings` (the madsim simulator).

use std::sync::Arc;

use troupe_agent::limits::{AGENT_MODEL_NAME_SIZE_MAX_BYTES, AGENT_TURN_STEPS_MAX, AGENT_TURN_STEPS_MIN};
use troupe_agent::{
    AgentSpec, AgentSpecError, AgentSystem, AgentSystemError, ConfigError, DirectoryError, OrgConfig, ScriptRule,
    ScriptedLlm,
};

fn script() -> ScriptedLlm {
    ScriptedLlm::new().rule(ScriptRule::any_agent().reply("{agent} says hi"))
}

/// A system with agent `a`, on a store of its own.
fn start(llm: &ScriptedLlm) -> AgentSystem {
    AgentSystem::builder()
        .llm(Arc::new(llm.clone()))
        .agent(AgentSpec::new("a"))
        .start()
        .expect("the system starts")
}

/// The message of the config file's refusal of `max_steps = {steps}` for agent `b`.
fn config_refusal(steps: u32) -> (String, String) {
    let toml = format!("[[agents]]\nid = \"b\"\nmax_steps = {steps}\n");
    match OrgConfig::from_toml(&toml, "org.toml") {
        Err(ConfigError::Invalid { field, message, .. }) => (field, message),
        other => panic!("the config file refuses max_steps = {steps}: {other:?}"),
    }
}

/// Goal: `max_steps` out of `1..=AGENT_TURN_STEPS_MAX` is refused through the API as
/// it is in a config file, with the same error, instead of being taken and silently
/// clipped at the agent's turns. Method: 0 and `AGENT_TURN_STEPS_MAX + 1` through
/// `define_agent`, `replace_agent` and the builder, compared with the config file's
/// refusal of the same values (`AgentSpecError::MaxStepsOutOfRange`, the config file
/// adding the field's line and column); nothing is stored; the maximum is taken.
#[tokio::test(start_paused = true)]
async fn max_steps_out_of_range_is_refused_through_the_api_as_in_a_config_file() {
    let llm = script();
    let system = start(&llm);
    for steps in [AGENT_TURN_STEPS_MAX + 1, 0, u32::MAX] {
        let expected = AgentSpecError::MaxStepsOutOfRange {
            id: "b".into(),
            value: steps,
            min: AGENT_TURN_STEPS_MIN,
            max: AGENT_TURN_STEPS_MAX,
        };
        let (field, message) = config_refusal(steps);
        assert_eq!(field, "agents[0].max_steps");
        assert_eq!(message, expected.to_string());
        assert_eq!(
            message,
            format!("the max_steps of b is {steps}, which is not in 1..={AGENT_TURN_STEPS_MAX}; pick a value in range")
        );
        let defined = system
            .define_agent(AgentSpec::new("b").max_steps(steps))
            .await
            .expect_err("define_agent refuses max_steps out of range");
        assert!(
            matches!(&defined, DirectoryError::Invalid(error) if *error == expected),
            "{defined:?}, expected {expected:?}"
        );
        assert!(!system.directory().contains("b"), "nothing defined");
        let replaced = system
            .replace_agent(AgentSpec::new("a").max_steps(steps))
            .await
            .expect_err("replace_agent refuses max_steps out of range");
        assert!(
            matches!(&replaced, DirectoryError::Invalid(AgentSpecError::MaxStepsOutOfRange { id, value, .. })
                if id == "a" && *value == steps),
            "{replaced:?}"
        );
        assert_eq!(
            system.directory().get("a").unwrap().model.max_steps,
            AGENT_TURN_STEPS_MAX,
            "the definition is kept"
        );
        let built = AgentSystem::builder()
            .llm(Arc::new(llm.clone()))
            .agent(AgentSpec::new("b").max_steps(steps))
            .start()
            .expect_err("the builder refuses max_steps out of range");
        assert!(matches!(built, AgentSystemError::Spec(error) if error == expected));
    }
    system
        .define_agent(AgentSpec::new("b").max_steps(AGENT_TURN_STEPS_MAX))
        .await
        .expect("the maximum is taken");
    assert_eq!(system.ask("b", "hi").await.unwrap().text, "b says hi");
    system.shutdown().await;
}

/// Goal: a model name is bounded (`AGENT_MODEL_NAME_SIZE_MAX_BYTES`: it goes into every
/// request to the model's provider): a longer one is refused by the builder, by
/// `define_agent` (nothing stored) and in a config file, with
/// `AgentSpecError::FieldTooLong` naming the field, the size and the limit; one at the
/// limit is taken and reaches the model's requests.
#[tokio::test(start_paused = true)]
async fn a_model_name_longer_than_its_limit_is_refused() {
    let long = "m".repeat(AGENT_MODEL_NAME_SIZE_MAX_BYTES + 1);
    let expected = AgentSpecError::FieldTooLong {
        id: "b".into(),
        field: "model",
        size: AGENT_MODEL_NAME_SIZE_MAX_BYTES + 1,
        limit: AGENT_MODEL_NAME_SIZE_MAX_BYTES,
    };
    assert_eq!(
        expected.to_string(),
        format!(
            "the model of b is {} bytes, more than the limit of {AGENT_MODEL_NAME_SIZE_MAX_BYTES}; shorten it",
            AGENT_MODEL_NAME_SIZE_MAX_BYTES + 1
        )
    );
    let llm = script();
    let built = AgentSystem::builder()
        .llm(Arc::new(llm.clone()))
        .agent(AgentSpec::new("b").model(long.clone()))
        .start()
        .expect_err("the builder refuses a model name over the limit");
    assert!(matches!(built, AgentSystemError::Spec(error) if error == expected));
    let system = start(&llm);
    let defined = system
        .define_agent(AgentSpec::new("b").model(long.clone()))
        .await
        .expect_err("define_agent refuses a model name over the limit");
    assert!(matches!(&defined, DirectoryError::Invalid(error) if *error == expected));
    assert!(!system.directory().contains("b"), "nothing defined");
    let toml = format!("[[agents]]\nid = \"b\"\nmodel = \"{long}\"\n");
    let configured = OrgConfig::from_toml(&toml, "org.toml").expect_err("the config file refuses it");
    assert!(
        matches!(&configured, ConfigError::Invalid { message, .. } if *message == expected.to_string()),
        "{configured:?}"
    );
    let at_limit = "m".repeat(AGENT_MODEL_NAME_SIZE_MAX_BYTES);
    system
        .define_agent(AgentSpec::new("b").model(at_limit.clone()))
        .await
        .expect("a model name at the limit is taken");
    assert_eq!(system.ask("b", "hi").await.unwrap().text, "b says hi");
    assert_eq!(llm.requests_of("b").pop().unwrap().model, at_limit);
    system.shutdown().await;
}

/// Goal: a stored definition written before these checks (by an older Troupe, whose API
/// took any `max_steps` and clipped it at the agent's turns, and any model name) is
/// handled when the directory is read: `max_steps` out of range is clipped into
/// `1..=AGENT_TURN_STEPS_MAX` with a warning, so the agent runs as it did; a model name
/// over the limit makes the definition skipped with a warning, as other invalid stored
/// definitions are. Method: one system defines `x` and `y` and shuts down; the stored
/// record is edited as an older Troupe could have written it (`x` with 20 steps, `y`
/// with a 64 KiB model name); a second system on the store reads it.
#[tokio::test(start_paused = true)]
async fn stored_definitions_out_of_range_are_clipped_or_skipped_when_read() {
    use troupe_agent::{AgentCallError, DIRECTORY_STORE_KEY, DIRECTORY_STORE_KIND};
    use troupe_core::{ActorId, CallRefused};
    use troupe_runtime::{MemoryStore, StateChange, StateStore, TurnCommit};

    let llm = script();
    let store: Arc<dyn StateStore> = Arc::new(MemoryStore::new());
    let start_on = |store: &Arc<dyn StateStore>| {
        AgentSystem::builder()
            .store(Arc::clone(store))
            .llm(Arc::new(llm.clone()))
            .agent(AgentSpec::new("a"))
            .start()
            .expect("the system starts")
    };
    let first = start_on(&store);
    first.define_agent(AgentSpec::new("x")).await.unwrap();
    first.define_agent(AgentSpec::new("y")).await.unwrap();
    first.shutdown().await;

    let record = ActorId::new(DIRECTORY_STORE_KIND, DIRECTORY_STORE_KEY).unwrap();
    let claimed = store.claim(&record).await.unwrap();
    let mut stored: serde_json::Value = serde_json::from_slice(&claimed.state.expect("a stored record")).unwrap();
    stored["agents"]["x"]["model"]["max_steps"] = 20.into();
    stored["agents"]["y"]["model"]["model"] = "m".repeat(64 * 1024).into();
    let commit = TurnCommit {
        state: StateChange::Set(serde_json::to_vec(&stored).unwrap().into()),
        writes: Vec::new(),
    };
    store.commit(&record, claimed.fence, commit).await.unwrap();

    let second = start_on(&store);
    assert_eq!(second.ask("x", "hi").await.unwrap().text, "x says hi");
    assert_eq!(
        second.directory().get("x").unwrap().model.max_steps,
        AGENT_TURN_STEPS_MAX,
        "x's steps are clipped"
    );
    assert!(
        matches!(
            second.ask("y", "hi").await,
            Err(AgentCallError::Refused(CallRefused::AgentNotFound { .. }))
        ),
        "y is skipped"
    );
    assert_eq!(second.ask("a", "hi").await.unwrap().text, "a says hi");
    second.shutdown().await;
}
