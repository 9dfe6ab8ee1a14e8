//! The direct conversation of a pair with a human is that pair's alone: a human and an
//! agent of the same name never share one, and a conversation created under the id an
//! older version gave such a pair is still found.
//!
//! Runs in both builds: `cargo test -p troupe-agent --test direct_conversation_kinds`
//! (tokio with paused time) and under madsim (`RUSTFLAGS="--cfg madsim"`).

use std::sync::Arc;

use serde_json::json;
use troupe_agent::{
    direct_conversation_id, direct_conversation_id_of, AgentSpec, AgentSystem, ConversationKind, Participant,
    ScriptRule, ScriptedLlm, Sender,
};
use troupe_runtime::MemoryStore;

fn agent(name: &str) -> Participant {
    Participant::Agent(name.to_string())
}

fn human(name: &str) -> Participant {
    Participant::Human(name.to_string())
}

/// Agents `alice` and `bob`; `alice` asks `bob` (`call_agent`) when told "go".
fn start() -> AgentSystem {
    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("alice").on_tool_result().reply("{tool_result}"))
        .rule(
            ScriptRule::agent("alice")
                .on_user_containing("go")
                .call("call_agent", json!({"agent_id": "bob", "message": "from alice"})),
        )
        .rule(ScriptRule::agent("bob").reply("bob answers"));
    AgentSystem::builder()
        .store(Arc::new(MemoryStore::new()))
        .llm(Arc::new(llm))
        .agent(AgentSpec::new("alice"))
        .agent(AgentSpec::new("bob"))
        .start()
        .expect("the system starts")
}

/// Goal: the human `alice`'s direct conversation with agent `bob` and agent `alice`'s
/// with agent `bob` are two conversations, each with its own participants, in either
/// order of creation, and agent `alice`'s `call_agent` exchange with `bob` is recorded
/// in the agents' one. Before, both were `dm:alice|bob`: the second creation failed
/// with `Conflict` and the exchange was not recorded (its conversation's creation
/// conflicted too, logged).
#[tokio::test(start_paused = true)]
async fn a_human_and_an_agent_of_the_same_name_have_their_own_direct_conversations() {
    for human_first in [true, false] {
        let system = start();
        let with_human = || {
            let (a, b) = if human_first {
                (human("alice"), agent("bob"))
            } else {
                (agent("bob"), human("alice"))
            };
            system.direct_conversation(a, b)
        };
        let with_agent = || system.direct_conversation(agent("alice"), agent("bob"));
        let (humans, agents) = if human_first {
            let humans = with_human().await.expect("the human's conversation");
            (
                humans,
                with_agent().await.expect("the agents' conversation, after the human's"),
            )
        } else {
            let agents = with_agent().await.expect("the agents' conversation");
            (
                with_human().await.expect("the human's conversation, after the agents'"),
                agents,
            )
        };
        assert_ne!(humans.id, agents.id, "one conversation for two pairs");
        assert_eq!(humans.participants, [agent("bob"), human("alice")]);
        assert_eq!(agents.participants, [agent("alice"), agent("bob")]);
        assert_eq!(
            agents.id,
            direct_conversation_id("alice", "bob"),
            "an agent pair keeps its id"
        );
        assert_eq!(humans.id, direct_conversation_id_of(&human("alice"), &agent("bob")));
        assert_eq!(humans.id, direct_conversation_id_of(&agent("bob"), &human("alice")));
        // Each again, either way round: the same conversation.
        assert_eq!(with_human().await.unwrap(), humans);
        assert_eq!(
            system.direct_conversation(agent("bob"), agent("alice")).await.unwrap(),
            agents
        );

        // The human posts in theirs; the agents' exchange goes into theirs.
        system
            .post_message(&humans.id, Sender::Human("alice".into()), "m-1", "hello bob")
            .await
            .unwrap();
        assert_eq!(system.ask("alice", "go").await.unwrap().text, "bob answers");
        let texts = |id: String| {
            let system = &system;
            async move {
                let messages = system.read_messages(&id, None, 10).await.unwrap();
                messages.into_iter().map(|m| (m.sender, m.text)).collect::<Vec<_>>()
            }
        };
        assert_eq!(
            texts(humans.id.clone()).await,
            [(Sender::Human("alice".into()), "hello bob".to_string())]
        );
        assert_eq!(
            texts(agents.id.clone()).await,
            [
                (Sender::Agent("alice".into()), "from alice".to_string()),
                (Sender::Agent("bob".into()), "bob answers".to_string()),
            ],
            "the agents' exchange is recorded in their conversation"
        );
        system.shutdown().await;
    }
}

/// Goal: the id of a pair with a human equals no agent pair's id, whatever the names
/// hold (the escaping of `|` and `\` cannot make the human's mark), is the same either
/// way round, and differs between two humans and a human with an agent.
#[test]
fn a_pair_with_a_human_has_an_id_no_agent_pair_has() {
    let names = [
        "a", "b", "h", r"\h", r"\", "|", r"a\", r"h\", r"\hb", "b|", r"\\h", "", r"a|\hb",
    ];
    let mut ids = std::collections::HashMap::new();
    for first in names {
        for second in names {
            for (x, y) in [
                (agent(first), agent(second)),
                (human(first), agent(second)),
                (agent(first), human(second)),
                (human(first), human(second)),
            ] {
                let id = direct_conversation_id_of(&x, &y);
                assert_eq!(id, direct_conversation_id_of(&y, &x), "{x:?} {y:?}");
                let mut pair = vec![x.clone(), y.clone()];
                pair.sort();
                if let Some(other) = ids.insert(id.clone(), pair.clone()) {
                    assert_eq!(other, pair, "{id} names two pairs");
                }
                if let (Participant::Agent(x), Participant::Agent(y)) = (&x, &y) {
                    assert_eq!(id, direct_conversation_id(x, y), "an agent pair keeps its id");
                }
            }
        }
    }
}

/// Goal: a human's direct conversation stored by an older version, under the agent
/// pair's id, is found by `direct_conversation` (not made again under the new id). (A
/// pair whose old id holds the agents' conversation gets a new one: the first test.)
/// Method: created through the public `create_conversation` as an older version would
/// have, with a message in it; then `direct_conversation` either way round.
#[tokio::test(start_paused = true)]
async fn a_human_direct_conversation_stored_under_the_old_id_is_still_found() {
    let system = start();
    let old = direct_conversation_id("alice", "bob");
    let created = system
        .create_conversation(&old, vec![human("alice"), agent("bob")], ConversationKind::Direct)
        .await
        .unwrap();
    system
        .post_message(&old, Sender::Human("alice".into()), "m-1", "from before")
        .await
        .unwrap();
    for (a, b) in [(human("alice"), agent("bob")), (agent("bob"), human("alice"))] {
        let found = system.direct_conversation(a, b).await.unwrap();
        assert_eq!(found, created, "the old conversation is found");
    }
    let new = direct_conversation_id_of(&human("alice"), &agent("bob"));
    assert_eq!(
        system.conversation(&new).await.unwrap(),
        None,
        "nothing made under the new id"
    );

    system.shutdown().await;
}
