//! Conversations end to end through the real runtime; only the model is scripted.
//!
//! Runs in both builds: `cargo test -p troupe-agent --test conversations` (tokio with
//! paused time) and under madsim (`RUSTFLAGS="--cfg madsim"`).

use std::sync::Arc;
use std::time::Duration;

use troupe_agent::limits::AGENT_TASK_TIMEOUT_MS_DEFAULT;
use troupe_agent::{
    AgentEvent, AgentSpec, AgentSystem, ApprovalState, BehaviourMode, CallRecorder, ContactKind, ConversationError,
    ConversationKind, ConversationMessage, Membership, NoteKind, Participant, PermissionRule, Role, ScriptRule,
    ScriptedLlm, Sender,
};
use troupe_core::TraceId;
use troupe_runtime::{MemoryStore, SqliteStore, StateStore};

#[path = "support/gate_store.rs"]
mod gate_store;
use gate_store::GateStore;

fn start(llm: &ScriptedLlm, agents: &[&str], store: Arc<dyn StateStore>) -> AgentSystem {
    let mut builder = AgentSystem::builder().store(store).llm(Arc::new(llm.clone()));
    for agent in agents {
        builder = builder.agent(AgentSpec::new(*agent));
    }
    builder.start().expect("the system starts")
}

fn agent(name: &str) -> Participant {
    Participant::Agent(name.to_string())
}

fn human(name: &str) -> Participant {
    Participant::Human(name.to_string())
}

async fn all(system: &AgentSystem, id: &str) -> Vec<ConversationMessage> {
    system.read_messages(id, None, 500).await.unwrap()
}

fn answers_to(messages: &[ConversationMessage], seq: u64, who: &str) -> usize {
    messages
        .iter()
        .filter(|m| m.reply_to == Some(seq))
        .filter(|m| m.sender == Sender::Agent(who.to_string()) || m.note.as_ref().is_some_and(|n| n.agent == who))
        .count()
}

fn assert_gap_free(messages: &[ConversationMessage]) {
    let seqs: Vec<u64> = messages.iter().map(|m| m.seq).collect();
    assert_eq!(seqs, (0..messages.len() as u64).collect::<Vec<_>>());
}

/// Goal: an agent's conversations page by id (`conversations_of_after`), each once and
/// in order; a definition reads back as created (`conversation`); and a creation that
/// stopped after the index recorded the id (its conversation's commit refused) is
/// listed without a definition until the creation is retried, which completes it.
#[tokio::test(start_paused = true)]
async fn conversations_page_by_id_and_a_half_made_one_has_no_definition_until_retried() {
    let llm = ScriptedLlm::new();
    let store = GateStore::new(Arc::new(MemoryStore::new()), false);
    let system = start(&llm, &["alice", "bob"], store.clone());
    for id in ["g3", "g1", "g2"] {
        let created = system
            .create_conversation(id, vec![human("hugo"), agent("alice")], ConversationKind::Group)
            .await
            .unwrap();
        assert_eq!(system.conversation(id).await.unwrap(), Some(created));
    }
    let mut pages = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let page = system
            .conversations_of_after("alice", after.as_deref(), 2)
            .await
            .unwrap();
        pages.push(page.clone());
        assert!(pages.len() <= 3, "the cursor does not move: {pages:?}");
        if page.len() < 2 {
            break;
        }
        after = page.last().cloned();
    }
    assert_eq!(pages, [vec!["g1", "g2"], vec!["g3"]]);
    assert_eq!(
        system.conversations_of_after("alice", Some("g1"), 10).await.unwrap(),
        ["g2", "g3"]
    );
    assert_eq!(
        system.conversations_of_after("alice", Some("g3"), 10).await.unwrap(),
        Vec::<String>::new()
    );
    assert_eq!(system.conversation("nowhere").await.unwrap(), None);
    assert_eq!(
        system.conversation("_index").await.unwrap(),
        None,
        "a reserved id has no definition"
    );
    assert!(matches!(
        system.conversations_of_after("alice", Some(""), 10).await,
        Err(ConversationError::InvalidName { .. })
    ));

    // The conversation's own commit of its creation is refused: the index has it.
    store.refuse_one_commit(|actor, _| actor.key() == "half");
    let people = vec![human("hugo"), agent("bob")];
    let failed = system
        .create_conversation("half", people.clone(), ConversationKind::Direct)
        .await;
    assert!(store.refused_the_commit(), "{failed:?}");
    assert!(failed.is_err(), "{failed:?}");
    assert_eq!(system.conversations_of("bob").await.unwrap(), ["half"]);
    assert_eq!(system.conversation("half").await.unwrap(), None);
    let created = system
        .create_conversation("half", people, ConversationKind::Direct)
        .await
        .unwrap();
    assert_eq!(system.conversation("half").await.unwrap(), Some(created));
    system.shutdown().await;
}

/// Goal: a human mentions two agents of a group of three; each replies once, one
/// reply mentions the third, which replies too; every reply is stored in order, with
/// the chain it came from, and the mentioned agents' prompts show the conversation
/// role-relative.
#[tokio::test(start_paused = true)]
async fn a_group_mention_fans_out_and_every_agent_answers_once() {
    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("alice").reply("alice here; @carol please check"))
        .rule(ScriptRule::agent("bob").reply("bob agrees"))
        .rule(ScriptRule::agent("carol").reply("carol checked"));
    let system = start(&llm, &["alice", "bob", "carol"], Arc::new(MemoryStore::new()));
    let people = vec![agent("alice"), agent("bob"), agent("carol"), human("hugo")];
    system
        .create_conversation("plan", people.clone(), ConversationKind::Group)
        .await
        .unwrap();
    // Creating again is idempotent; a different definition is a conflict.
    system
        .create_conversation("plan", people, ConversationKind::Group)
        .await
        .unwrap();
    let conflict = system
        .create_conversation("plan", vec![agent("alice"), human("hugo")], ConversationKind::Group)
        .await;
    assert!(
        matches!(conflict, Err(ConversationError::Conflict { .. })),
        "{conflict:?}"
    );

    let posted = system
        .post_message("plan", Sender::Human("hugo".into()), "m1", "@alice and @bob: ship it?")
        .await
        .unwrap();
    assert_eq!((posted.seq, posted.duplicate), (0, false));
    let again = system
        .post_message("plan", Sender::Human("hugo".into()), "m1", "@alice and @bob: ship it?")
        .await
        .unwrap();
    assert_eq!((again.seq, again.duplicate), (0, true));
    tokio::time::sleep(Duration::from_secs(20)).await;

    let messages = all(&system, "plan").await;
    assert_gap_free(&messages);
    assert_eq!(messages.len(), 4, "{messages:#?}");
    assert_eq!(messages[0].mentions, ["alice", "bob"]);
    assert_eq!(answers_to(&messages, 0, "alice"), 1);
    assert_eq!(answers_to(&messages, 0, "bob"), 1);
    let alice = messages
        .iter()
        .find(|m| m.sender == Sender::Agent("alice".into()))
        .unwrap();
    assert_eq!(alice.chain, ["alice"]);
    assert_eq!(answers_to(&messages, alice.seq, "carol"), 1);
    let carol = messages
        .iter()
        .find(|m| m.sender == Sender::Agent("carol".into()))
        .unwrap();
    assert_eq!(carol.chain, ["alice", "carol"]);
    assert!(carol.seq > alice.seq);
    assert_eq!(carol.text, "carol checked");

    // Carol's prompt: the human and alice as users with their names, then the trigger.
    let carol_prompt = llm
        .requests()
        .into_iter()
        .find(|request| request.agent.key() == "carol")
        .expect("carol was asked");
    let views: Vec<(Role, String)> = carol_prompt
        .messages
        .iter()
        .skip(1)
        .map(|m| (m.role, m.content.clone()))
        .collect();
    assert_eq!(views[0], (Role::User, "hugo: @alice and @bob: ship it?".to_string()));
    assert!(views
        .last()
        .unwrap()
        .1
        .contains("alice: alice here; @carol please check"));

    let mut of_alice = system.conversations_of("alice").await.unwrap();
    of_alice.sort();
    assert_eq!(of_alice, ["plan"]);
    // Mentioning a stranger is a typed error and appends nothing.
    let unknown = system
        .post_message("plan", Sender::Human("hugo".into()), "m2", "@zed hello")
        .await;
    assert!(
        matches!(unknown, Err(ConversationError::UnknownMention { ref name, .. }) if name == "zed"),
        "{unknown:?}"
    );
    let outsider = system
        .post_message("plan", Sender::Human("eve".into()), "m3", "hi")
        .await;
    assert!(
        matches!(outsider, Err(ConversationError::NotParticipant { .. })),
        "{outsider:?}"
    );
    assert_eq!(all(&system, "plan").await.len(), 4);
    system.shutdown().await;
}

/// Goal: two agents that always mention each other stop at the cycle rule: the
/// refusal is a system note, not an endless exchange.
/// Goal: each agent's prompt shows its own window of the conversation: `short` (2
/// messages) sees the mention and one message before it, `wide` (the default) all of
/// them, and `terse` (a token window of 9) only what fits. Method: six human posts, the
/// last mentions all three; the prompts the scripted model received are compared.
#[tokio::test(start_paused = true)]
async fn each_agent_builds_its_prompt_from_its_own_window() {
    let llm = ScriptedLlm::new().rule(ScriptRule::any_agent().reply("ok"));
    let system = AgentSystem::builder()
        .store(Arc::new(MemoryStore::new()))
        .llm(Arc::new(llm.clone()))
        .agent(AgentSpec::new("short").window(2, 8_000))
        .agent(AgentSpec::new("wide"))
        .agent(AgentSpec::new("terse").window(32, 9))
        .start()
        .unwrap();
    let people = vec![agent("short"), agent("wide"), agent("terse"), human("hugo")];
    system
        .create_conversation("room", people, ConversationKind::Group)
        .await
        .unwrap();
    for i in 0..5 {
        let text = format!("note {i}");
        system
            .post_message("room", Sender::Human("hugo".into()), &format!("n{i}"), &text)
            .await
            .unwrap();
    }
    system
        .post_message("room", Sender::Human("hugo".into()), "ask", "@short @wide @terse go")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    // The prompt after the system prompt: the window's older messages, then the mention.
    let shown = |who: &str| -> Vec<String> {
        let requests = llm.requests_of(who);
        assert_eq!(requests.len(), 1, "{who} answered once");
        requests[0].messages.iter().skip(1).map(|m| m.content.clone()).collect()
    };
    let mention = "[conversation room, message #5] hugo: @short @wide @terse go".to_string();
    assert_eq!(shown("short"), vec!["hugo: note 4".to_string(), mention.clone()]);
    let mut all_notes: Vec<String> = (0..5).map(|i| format!("hugo: note {i}")).collect();
    all_notes.push(mention.clone());
    assert_eq!(shown("wide"), all_notes);
    // Tokens are bytes / 4, rounded up: the mention "hugo: @short @wide @terse go" (28
    // bytes, 7 tokens) is always kept; "hugo: note 4" (3 tokens) would make 10 > 9.
    assert_eq!(shown("terse"), vec![mention]);
    assert_eq!(
        AgentSpec::new("bad").window(0, 10).validate().unwrap_err().to_string(),
        "the conversation window of bad has messages = 0, which is not in 1..=32; pick a value in range"
    );
    system.shutdown().await;
}

/// Goal: every answered `call_agent` lands in the pair's direct conversation (the same
/// one either way round): the caller's question, then the callee's answer replying to
/// it; a `@mention` inside a recorded exchange triggers nobody; a failed call is not
/// recorded. Method: `a`'s scripted model asks `b` (twice, the second question
/// mentions `c`), then `b` asks `a`; then a call to an agent whose model fails.
#[tokio::test(start_paused = true)]
async fn call_agent_exchanges_are_recorded_in_the_pairs_direct_conversation() {
    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("a").on_user_containing("ask b").call(
            "call_agent",
            serde_json::json!({"agent_id": "b", "message": "{input} (cc @c)"}),
        ))
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("ask d")
                .call("call_agent", serde_json::json!({"agent_id": "d", "message": "hello d"})),
        )
        .rule(ScriptRule::agent("a").on_tool_result().reply("a got: {tool_result}"))
        .rule(ScriptRule::agent("a").reply("a answers"))
        .rule(ScriptRule::agent("b").on_user_containing("ask a").call(
            "call_agent",
            serde_json::json!({"agent_id": "a", "message": "and you?"}),
        ))
        .rule(ScriptRule::agent("b").on_tool_result().reply("b got: {tool_result}"))
        .rule(ScriptRule::agent("b").reply("b answers"))
        .rule(ScriptRule::agent("c").reply("c should not speak"))
        .rule(ScriptRule::agent("d").fail("d's model is down"));
    let store = Arc::new(MemoryStore::new());
    let system = start(&llm, &["a", "b", "c", "d"], store.clone());
    assert_eq!(system.ask("a", "ask b one").await.unwrap().text, "a got: b answers");
    assert_eq!(system.ask("a", "ask b two").await.unwrap().text, "a got: b answers");
    assert_eq!(system.ask("b", "ask a").await.unwrap().text, "b got: a answers");
    let failed = system.ask("a", "ask d").await.unwrap().text;
    assert!(failed.starts_with("a got: error: call_agent failed"), "{failed}");
    tokio::time::sleep(Duration::from_secs(5)).await;

    let id = troupe_agent::direct_conversation_id("b", "a");
    assert_eq!(id, troupe_agent::direct_conversation_id("a", "b"));
    let messages = all(&system, &id).await;
    let seen: Vec<(Sender, String, Option<u64>)> = messages
        .iter()
        .map(|m| (m.sender.clone(), m.text.clone(), m.reply_to))
        .collect();
    let from = |who: &str| Sender::Agent(who.to_string());
    assert_eq!(
        seen,
        vec![
            (from("a"), "ask b one (cc @c)".to_string(), None),
            (from("b"), "b answers".to_string(), Some(0)),
            (from("a"), "ask b two (cc @c)".to_string(), None),
            (from("b"), "b answers".to_string(), Some(2)),
            (from("b"), "and you?".to_string(), None),
            (from("a"), "a answers".to_string(), Some(4)),
        ]
    );
    assert!(
        messages.iter().all(|m| m.mentions.is_empty()),
        "recorded mentions are not delivered"
    );
    assert!(llm.requests_of("c").is_empty(), "c was never triggered");
    assert_gap_free(&messages);
    // A record is sent once, so the conversation keeps no client-id index for it: its
    // messages, and no `id/` entry (a posted message with a client id has one).
    let actor = troupe_core::ActorId::new(troupe_agent::CONVERSATION_KIND, &id).unwrap();
    let stored = |prefix: &'static str| {
        let (store, actor) = (store.clone(), actor.clone());
        async move { store.scan(&actor, prefix, None, 100).await.unwrap().len() }
    };
    // An exchange is one entry (a JSON array), keyed by its answer's seq.
    let entries = store.scan(&actor, "msg/", None, 100).await.unwrap();
    let keys: Vec<&str> = entries.iter().map(|(key, _)| key.as_str()).collect();
    assert_eq!(
        keys,
        [1, 3, 5].map(|seq| format!("msg/{seq:020}")),
        "the three recorded exchanges are stored, one entry each"
    );
    for (key, value) in &entries {
        let pair: Vec<ConversationMessage> = serde_json::from_slice(value).unwrap();
        assert_eq!(pair.len(), 2, "{key}");
        assert_eq!(
            value.as_ref(),
            serde_json::to_vec(&pair).unwrap(),
            "{key} is serde_json's encoding"
        );
    }
    assert_eq!(stored("id/").await, 0, "a recorded exchange writes no client-id index");
    // Pages that start or end inside an exchange's entry.
    let page = |after: Option<u64>, limit: usize| {
        let system = &system;
        let id = id.clone();
        async move {
            let messages = system.read_messages(&id, after, limit).await.unwrap();
            messages.iter().map(|m| m.seq).collect::<Vec<u64>>()
        }
    };
    assert_eq!(page(Some(0), 1).await, [1], "after a question: its answer");
    assert_eq!(page(Some(0), 3).await, [1, 2, 3]);
    assert_eq!(page(None, 3).await, [0, 1, 2], "a page ending inside an exchange");
    assert_eq!(page(Some(4), 10).await, [5]);
    assert_eq!(page(Some(5), 10).await, Vec::<u64>::new());
    assert!(system.conversations_of("a").await.unwrap().contains(&id));
    assert!(system.conversations_of("b").await.unwrap().contains(&id));
    let failed_pair = troupe_agent::direct_conversation_id("a", "d");
    assert!(
        !system.conversations_of("d").await.unwrap().contains(&failed_pair),
        "a failed call is not recorded"
    );
    system.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_mention_ping_pong_stops_with_a_system_note() {
    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("ping").reply("@pong your turn"))
        .rule(ScriptRule::agent("pong").reply("@ping your turn"));
    let system = start(&llm, &["ping", "pong"], Arc::new(MemoryStore::new()));
    system
        .create_conversation(
            "rally",
            vec![agent("ping"), agent("pong"), human("ref")],
            ConversationKind::Group,
        )
        .await
        .unwrap();
    system
        .post_message("rally", Sender::Human("ref".into()), "serve", "@ping start")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(30)).await;
    let messages = all(&system, "rally").await;
    assert_gap_free(&messages);
    let senders: Vec<&Sender> = messages.iter().map(|m| &m.sender).collect();
    assert_eq!(
        senders,
        [
            &Sender::Human("ref".into()),
            &Sender::Agent("ping".into()),
            &Sender::Agent("pong".into()),
            &Sender::System
        ]
    );
    let note = messages[3].note.clone().unwrap();
    assert_eq!((note.agent.as_str(), note.kind), ("ping", NoteKind::Cycle));
    assert_eq!(messages[3].reply_to, Some(2));
    system.shutdown().await;
}

/// Goal: a chain of distinct agents, each mentioning the next, stops at the system's
/// depth limit (5) with a depth note.
#[tokio::test(start_paused = true)]
async fn a_mention_chain_stops_at_the_depth_limit() {
    let names = ["a1", "a2", "a3", "a4", "a5", "a6", "a7"];
    let mut llm = ScriptedLlm::new();
    for pair in names.windows(2) {
        llm = llm.rule(ScriptRule::agent(pair[0]).reply(format!("@{} next", pair[1])));
    }
    llm = llm.rule(ScriptRule::agent("a7").reply("end"));
    let system = start(&llm, &names, Arc::new(MemoryStore::new()));
    let mut people: Vec<Participant> = names.iter().map(|name| agent(name)).collect();
    people.push(human("h"));
    system
        .create_conversation("relay", people, ConversationKind::Group)
        .await
        .unwrap();
    system
        .post_message("relay", Sender::Human("h".into()), "go", "@a1 go")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(60)).await;
    let messages = all(&system, "relay").await;
    assert_gap_free(&messages);
    let replies: Vec<&str> = messages
        .iter()
        .filter_map(|m| match &m.sender {
            Sender::Agent(name) => Some(name.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(replies, ["a1", "a2", "a3", "a4", "a5"]);
    let note = messages.last().unwrap().note.clone().unwrap();
    assert_eq!((note.agent.as_str(), note.kind), ("a6", NoteKind::DepthLimit));
    system.shutdown().await;
}

/// Goal: a mention the organisation forbids (a deny rule) triggers nothing and is
/// recorded as a NotPermitted note.
#[tokio::test(start_paused = true)]
async fn a_mention_of_a_forbidden_agent_is_recorded_as_not_permitted() {
    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("dev").reply("asking @boss"))
        .rule(ScriptRule::agent("boss").reply("boss answers"));
    let system = start(&llm, &["dev", "boss"], Arc::new(MemoryStore::new()));
    system
        .set_permission("dev", PermissionRule::deny("boss"))
        .await
        .unwrap();
    system
        .create_conversation(
            "floor",
            vec![agent("dev"), agent("boss"), human("h")],
            ConversationKind::Group,
        )
        .await
        .unwrap();
    system
        .post_message("floor", Sender::Human("h".into()), "q", "@dev what now?")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(20)).await;
    let messages = all(&system, "floor").await;
    assert_gap_free(&messages);
    assert_eq!(messages.len(), 3, "{messages:#?}");
    let note = messages[2].note.clone().unwrap();
    assert_eq!((note.agent.as_str(), note.kind), ("boss", NoteKind::NotPermitted));
    assert!(llm.requests().iter().all(|request| request.agent.key() != "boss"));
    system.shutdown().await;
}

/// Every message of conversation `id` whose text contains `needle`.
async fn containing(system: &AgentSystem, id: &str, needle: &str) -> Vec<ConversationMessage> {
    let mut messages = all(system, id).await;
    messages.retain(|m| m.text.contains(needle));
    messages
}

/// The one pending approval, checked to be `dev`'s notification of `boss`.
async fn the_pending_approval(system: &AgentSystem) -> u64 {
    let pending = system.pending_approvals().await.unwrap();
    assert_eq!(pending.len(), 1, "{pending:?}");
    assert_eq!(
        (pending[0].from.as_str(), pending[0].to.as_str(), pending[0].kind),
        ("dev", "boss", ContactKind::Notify)
    );
    assert_eq!(pending[0].message, "asking @boss");
    pending[0].id
}

/// Makes `dev` supervised (its every contact needs approval) and creates the group
/// conversation `floor` of `dev`, `boss` and the human `h`.
async fn supervised_dev_on_the_floor(system: &AgentSystem) {
    let supervised = Membership {
        manager: None,
        mode: BehaviourMode::Supervised,
    };
    system.set_membership("dev", supervised).await.unwrap();
    system
        .create_conversation(
            "floor",
            vec![agent("dev"), agent("boss"), human("h")],
            ConversationKind::Group,
        )
        .await
        .unwrap();
}

/// Goal: a mention whose contact needs approval waits for it, durably, instead of being
/// refused: approved (also after a restart on the same store), the agent answers it
/// once; denied, or not approved by the mention's deadline, it is recorded as a
/// NotPermitted note naming the approval, and the agent never sees it. Method: `dev` is
/// supervised, so its every contact needs approval; each round a human asks `dev`, whose
/// scripted reply mentions `boss`; the approvals are resolved through the API.
#[tokio::test(start_paused = true)]
async fn a_mention_needing_approval_waits_for_it_across_a_restart() {
    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("dev").reply("asking @boss"))
        .rule(ScriptRule::agent("boss").reply("boss answers"));
    let store: Arc<dyn StateStore> = Arc::new(SqliteStore::open_in_memory().unwrap());
    let system = start(&llm, &["dev", "boss"], Arc::clone(&store));
    supervised_dev_on_the_floor(&system).await;
    let boss_asked = || llm.requests_of("boss").len();

    // Approved: boss answers dev's mention once, only after the approval.
    system
        .post_message("floor", Sender::Human("h".into()), "q1", "@dev round one")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let id = the_pending_approval(&system).await;
    assert_eq!(boss_asked(), 0, "nothing reached boss before the approval");
    assert_eq!(all(&system, "floor").await.len(), 2, "the question and dev's reply");
    system.approve(id).await.unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let messages = all(&system, "floor").await;
    assert_gap_free(&messages);
    assert_eq!(messages.len(), 3, "{messages:#?}");
    assert_eq!(
        (&messages[2].sender, messages[2].text.as_str(), messages[2].reply_to),
        (&Sender::Agent("boss".into()), "boss answers", Some(1))
    );
    assert_eq!(boss_asked(), 1);

    // Denied: a NotPermitted note naming the approval; boss is not asked.
    system
        .post_message("floor", Sender::Human("h".into()), "q2", "@dev round two")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let id = the_pending_approval(&system).await;
    system.deny(id).await.unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let notes = containing(&system, "floor", &format!("approval {id} was denied")).await;
    assert_eq!(notes.len(), 1, "{:#?}", all(&system, "floor").await);
    let note = notes[0].note.clone().unwrap();
    assert_eq!((note.agent.as_str(), note.kind), ("boss", NoteKind::NotPermitted));
    assert_eq!(notes[0].sender, Sender::System);
    assert_eq!(boss_asked(), 1, "the denied mention never reached boss");

    // Pending across a restart, approved through the second system: answered once.
    system
        .post_message("floor", Sender::Human("h".into()), "q3", "@dev round three")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let id = the_pending_approval(&system).await;
    system.shutdown().await;
    let system = start(&llm, &["dev", "boss"], Arc::clone(&store));
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(boss_asked(), 1, "still waiting for the approval after the restart");
    system.approve(id).await.unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(boss_asked(), 2);
    assert_eq!(containing(&system, "floor", "boss answers").await.len(), 2);

    // Never resolved: refused at the mention's deadline, and the approval expired.
    system
        .post_message("floor", Sender::Human("h".into()), "q4", "@dev round four")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let id = the_pending_approval(&system).await;
    tokio::time::sleep(Duration::from_millis(AGENT_TASK_TIMEOUT_MS_DEFAULT)).await;
    let notes = containing(
        &system,
        "floor",
        &format!("approval {id} was still pending at the deadline"),
    )
    .await;
    assert_eq!(notes.len(), 1, "{:#?}", all(&system, "floor").await);
    assert_eq!(
        system.approval(id).await.unwrap().unwrap().state,
        ApprovalState::Expired
    );
    assert_eq!(boss_asked(), 2);
    let messages = all(&system, "floor").await;
    assert_gap_free(&messages);
    // Four rounds of a question and dev's reply, two answers, two notes.
    assert_eq!(messages.len(), 12, "{messages:#?}");
    system.shutdown().await;
}

/// The traces (by agent key) of the turns `recorder` saw start, in order.
fn turn_traces(recorder: &CallRecorder, agent: &str) -> Vec<Option<TraceId>> {
    recorder
        .events()
        .into_iter()
        .filter_map(|event| match event {
            AgentEvent::TurnStarted {
                agent: started,
                trace_id,
                ..
            } if started.key() == agent => Some(trace_id),
            _ => None,
        })
        .collect()
}

/// Goal: a post's trace id goes with the mentions it triggers, hop by hop and across a
/// restart: a human's post under trace T mentions `dev`, whose turn runs under T; its
/// reply mentions `boss`, and that mention (waiting for an approval, so pending when
/// the system restarts) is delivered after the restart from its stored relay record,
/// and boss's turn runs under T too. An untraced post's mentions run untraced.
#[tokio::test(start_paused = true)]
async fn a_posts_trace_reaches_the_mentioned_agents_also_after_a_restart() {
    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("dev").reply("asking @boss"))
        .rule(ScriptRule::agent("boss").reply("boss answers"));
    let store: Arc<dyn StateStore> = Arc::new(SqliteStore::open_in_memory().unwrap());
    let recorder = CallRecorder::new();
    let start_observed = |store: &Arc<dyn StateStore>| {
        AgentSystem::builder()
            .store(Arc::clone(store))
            .llm(Arc::new(llm.clone()))
            .observer(Arc::new(recorder.clone()))
            .agent(AgentSpec::new("dev"))
            .agent(AgentSpec::new("boss"))
            .start()
            .expect("the system starts")
    };
    let system = start_observed(&store);
    supervised_dev_on_the_floor(&system).await;
    let trace = TraceId::new(0x7e57);
    system
        .post_message_in("floor", Sender::Human("h".into()), "q1", "@dev traced", Some(trace))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(turn_traces(&recorder, "dev"), [Some(trace)]);
    let id = the_pending_approval(&system).await;
    assert!(turn_traces(&recorder, "boss").is_empty(), "boss waits for the approval");

    system.shutdown().await;
    let system = start_observed(&store);
    tokio::time::sleep(Duration::from_secs(10)).await;
    system.approve(id).await.unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(containing(&system, "floor", "boss answers").await.len(), 1);
    assert_eq!(turn_traces(&recorder, "boss"), [Some(trace)]);

    // Untraced: dev's turn on it has no trace.
    system
        .post_message("floor", Sender::Human("h".into()), "q2", "@dev untraced")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(turn_traces(&recorder, "dev"), [Some(trace), None]);
    system.shutdown().await;
}

/// Goal: a mention whose post was rolled back after it recorded its approval leaves
/// that approval unlisted (a person never sees an approval that would send nothing),
/// while the post made again lists its own; approving that one delivers the mention
/// once, and approving the orphan by its id sends nothing. Method: `dev` is supervised;
/// the store refuses the first commit of the conversation that records a relay to
/// `boss` (the post of dev's reply mentioning `boss`, after its approval was recorded);
/// dev posts its answer again.
#[tokio::test(start_paused = true)]
async fn a_mention_whose_post_was_rolled_back_leaves_its_approval_unlisted() {
    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("dev").reply("asking @boss"))
        .rule(ScriptRule::agent("boss").reply("boss answers"));
    let store = GateStore::new(Arc::new(MemoryStore::new()), false);
    let system = start(&llm, &["dev", "boss"], Arc::clone(&store) as Arc<dyn StateStore>);
    supervised_dev_on_the_floor(&system).await;
    store.refuse_one_commit(|actor, commit| {
        actor.kind().as_str() == troupe_agent::CONVERSATION_KIND
            && commit
                .writes
                .iter()
                .any(|(key, value)| key.starts_with("relay/") && key.ends_with("/boss") && value.is_some())
    });
    system
        .post_message("floor", Sender::Human("h".into()), "q1", "@dev round one")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(store.refused_the_commit(), "the post of dev's reply was refused once");

    let org = system.organisation().await.unwrap();
    let recorded = org.pending_approvals();
    assert_eq!(
        recorded.len(),
        2,
        "the rolled-back post's and the second post's: {recorded:#?}"
    );
    let (orphan, live) = (&recorded[0], &recorded[1]);
    assert!(!orphan.listed && live.listed, "{recorded:#?}");
    let listed = system.pending_approvals().await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:#?}");
    assert_eq!(listed[0].id, live.id);
    assert_eq!(listed[0].message, "asking @boss");
    assert!(
        llm.requests_of("boss").is_empty(),
        "nothing reached boss before the approval"
    );

    system.approve(live.id).await.unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let messages = all(&system, "floor").await;
    assert_gap_free(&messages);
    assert_eq!(
        messages.len(),
        3,
        "the question, dev's reply once, boss's answer: {messages:#?}"
    );
    assert_eq!(
        (&messages[2].sender, messages[2].text.as_str()),
        (&Sender::Agent("boss".into()), "boss answers")
    );
    // The orphan can still be resolved by its id; nothing waits for it.
    let approved = system.approve(orphan.id).await.unwrap();
    assert_eq!(approved.state, ApprovalState::Approved);
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(llm.requests_of("boss").len(), 1, "boss was asked once");
    assert_eq!(all(&system, "floor").await.len(), 3);
    system.shutdown().await;
}

/// Mentions of `boss` that wait for approval in the multi-thread test.
#[cfg(not(madsim))]
const RACED_MENTIONS: u64 = 12;
/// How long that test waits for every mention to be settled.
#[cfg(not(madsim))]
const RACED_MENTIONS_SETTLE_MS_MAX: u64 = 20_000;

/// Goal: on tokio's multi-thread runtime, mentions waiting for approval while an
/// approve and a deny race for each give one outcome per mention: at most one of the
/// two succeeds (here always one: no deadline is reached); approved, boss answers that
/// mention once and its model saw the job once; denied, one NotPermitted note names the
/// approval and boss's model never saw the job; each mention's approval is listed once;
/// the conversation stays gap-free and the boxes drain. Method: `dev` is supervised; a
/// human posts 12 jobs at once, each asking `dev`, whose reply mentions `boss` about
/// that job; an approver lists the pending approvals every 2 ms and, for each new one,
/// approves and denies it from two tasks after delays spread over 0..20 ms, on 4 worker
/// threads (real time: well under a second; it fails when the delivery does not wait).
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mentions_waiting_for_approval_get_one_outcome_each_on_the_multi_thread_runtime() {
    use std::collections::BTreeMap;
    let mut llm = ScriptedLlm::new();
    for job in 0..RACED_MENTIONS {
        llm = llm
            .rule(
                ScriptRule::agent("dev")
                    .on_user_containing(format!("job{job}."))
                    .reply(format!("asking @boss about job{job}.")),
            )
            .rule(
                ScriptRule::agent("boss")
                    .on_user_containing(format!("job{job}."))
                    .reply(format!("boss did job{job}.")),
            );
    }
    let system = start(&llm, &["dev", "boss"], Arc::new(MemoryStore::new()));
    supervised_dev_on_the_floor(&system).await;

    // The approver: approval id -> (its message, approve won, deny won).
    let decided = Arc::new(std::sync::Mutex::new(BTreeMap::<u64, (String, bool, bool)>::new()));
    let approver = {
        let (client, decided) = (system.client(), Arc::clone(&decided));
        tokio::spawn(async move {
            let mut races = Vec::new();
            for round in 0u64.. {
                for approval in client.pending_approvals().await.unwrap() {
                    {
                        // Listed again while its race runs: its entry (and any result a
                        // racer already wrote in it) stays.
                        let mut decided = decided.lock().unwrap();
                        if decided.contains_key(&approval.id) {
                            continue;
                        }
                        decided.insert(approval.id, (approval.message.clone(), false, false));
                    }
                    let (approve_ms, deny_ms) = ((approval.id * 7 + round) % 20, (approval.id * 13 + 5) % 20);
                    for approve in [true, false] {
                        let (client, decided) = (client.clone(), Arc::clone(&decided));
                        let delay = Duration::from_millis(if approve { approve_ms } else { deny_ms });
                        races.push(tokio::spawn(async move {
                            tokio::time::sleep(delay).await;
                            let won = if approve {
                                client.approve(approval.id).await.is_ok()
                            } else {
                                client.deny(approval.id).await.is_ok()
                            };
                            let mut decided = decided.lock().unwrap();
                            let entry = decided.get_mut(&approval.id).unwrap();
                            if approve {
                                entry.1 = won;
                            } else {
                                entry.2 = won;
                            }
                        }));
                    }
                }
                if decided.lock().unwrap().len() as u64 >= RACED_MENTIONS {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            for race in races {
                race.await.unwrap();
            }
        })
    };
    let mut posts = Vec::new();
    for job in 0..RACED_MENTIONS {
        let client = system.client();
        posts.push(tokio::spawn(async move {
            client
                .post_message(
                    "floor",
                    Sender::Human("h".into()),
                    &format!("q{job}"),
                    &format!("@dev job{job}."),
                )
                .await
                .unwrap();
        }));
    }
    for post in posts {
        post.await.unwrap();
    }
    tokio::time::timeout(Duration::from_millis(RACED_MENTIONS_SETTLE_MS_MAX), approver)
        .await
        .expect("every mention's approval was listed")
        .unwrap();

    // Settled: every mention of boss has a reply for boss, and the boxes are empty.
    let mut settled = false;
    for _ in 0..RACED_MENTIONS_SETTLE_MS_MAX / 10 {
        let messages = all(&system, "floor").await;
        let mentions_answered = messages
            .iter()
            .filter(|m| m.sender == Sender::Agent("dev".into()))
            .all(|m| answers_to(&messages, m.seq, "boss") > 0);
        let dev_replies = messages
            .iter()
            .filter(|m| m.sender == Sender::Agent("dev".into()))
            .count();
        if dev_replies as u64 == RACED_MENTIONS
            && mentions_answered
            && system.pending("dev").await.unwrap() == (0, 0)
            && system.pending("boss").await.unwrap() == (0, 0)
        {
            settled = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let messages = all(&system, "floor").await;
    assert!(settled, "{messages:#?}");
    assert_gap_free(&messages);
    let decided = decided.lock().unwrap().clone();
    assert_eq!(
        decided.len() as u64,
        RACED_MENTIONS,
        "one approval listed per mention: {decided:?}"
    );
    let boss_seen: Vec<String> = llm
        .requests_of("boss")
        .iter()
        .filter_map(|r| r.messages.last().map(|m| m.content.clone()))
        .collect();
    let mut outcomes = [0, 0];
    for job in 0..RACED_MENTIONS {
        let job = format!("job{job}.");
        let approvals: Vec<_> = decided
            .iter()
            .filter(|(_, (message, ..))| message.ends_with(&job))
            .collect();
        let [(id, (_, approved, denied))] = approvals.as_slice() else {
            panic!("{job}: one approval, not {approvals:?}")
        };
        assert!(
            approved ^ denied,
            "{job}: exactly one of approve and deny won: {approvals:?}"
        );
        let mention: Vec<_> = messages
            .iter()
            .filter(|m| m.sender == Sender::Agent("dev".into()) && m.text.ends_with(&job))
            .collect();
        let [mention] = mention.as_slice() else {
            panic!("{job}: one mention by dev: {messages:#?}")
        };
        let replies: Vec<_> = messages
            .iter()
            .filter(|m| m.reply_to == Some(mention.seq))
            .filter(|m| m.sender == Sender::Agent("boss".into()) || m.note.as_ref().is_some_and(|n| n.agent == "boss"))
            .collect();
        let [reply] = replies.as_slice() else {
            panic!("{job}: one reply for boss, not {replies:#?}")
        };
        let seen = boss_seen.iter().filter(|m| m.contains(&job)).count();
        if *approved {
            assert_eq!(reply.text, format!("boss did {job}"), "{job}");
            assert_eq!(seen, 1, "{job}: boss's model saw it once");
            outcomes[0] += 1;
        } else {
            let note = reply.note.clone().unwrap_or_else(|| panic!("{job}: {reply:?}"));
            assert_eq!(note.kind, NoteKind::NotPermitted, "{job}");
            assert!(
                reply.text.contains(&format!("approval {id} was denied")),
                "{job}: {}",
                reply.text
            );
            assert_eq!(seen, 0, "{job}: the denied mention never reached boss");
            outcomes[1] += 1;
        }
    }
    println!("approved {}, denied {}", outcomes[0], outcomes[1]);
    system.shutdown().await;
}

/// Goal: a restart in the middle of a fan-out (one agent answered, the other's model
/// is still thinking) on SQLite: after the restart every mention is answered exactly
/// once. Method: shut the first system down while bob's slow model runs, start a second
/// system on the same store, and let it resume.
#[tokio::test(start_paused = true)]
async fn a_restart_mid_fan_out_in_sqlite_answers_every_mention_once() {
    let store: Arc<dyn StateStore> = Arc::new(SqliteStore::open_in_memory().unwrap());
    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("alice").reply("alice done"))
        .rule(
            ScriptRule::agent("bob")
                .reply("bob done")
                .latency(Duration::from_secs(10)),
        )
        .rule(ScriptRule::agent("carol").reply("carol done"));
    let first = start(&llm, &["alice", "bob", "carol"], Arc::clone(&store));
    let people = vec![agent("alice"), agent("bob"), agent("carol"), human("h")];
    first
        .create_conversation("ops", people, ConversationKind::Group)
        .await
        .unwrap();
    first
        .post_message("ops", Sender::Human("h".into()), "m", "@alice @bob @carol status?")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = all(&first, "ops").await;
    assert_eq!(answers_to(&before, 0, "bob"), 0, "bob's model is still thinking");
    first.shutdown().await;

    let llm = ScriptedLlm::new().rule(ScriptRule::any_agent().reply("{agent} after restart"));
    let second = start(&llm, &["alice", "bob", "carol"], Arc::clone(&store));
    tokio::time::sleep(Duration::from_secs(30)).await;
    let messages = all(&second, "ops").await;
    assert_gap_free(&messages);
    for who in ["alice", "bob", "carol"] {
        assert_eq!(answers_to(&messages, 0, who), 1, "{who}: {messages:#?}");
    }
    assert_eq!(messages.len(), 4);
    second.shutdown().await;
}

/// Goal: on tokio's multi-thread runtime, concurrent posts to one conversation get a
/// gap-free, strictly increasing sequence, each post exactly one seq.
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_posts_keep_a_gap_free_sequence_on_the_multi_thread_runtime() {
    const POSTERS: usize = 8;
    const POSTS: usize = 25;
    let llm = ScriptedLlm::new();
    let system = start(&llm, &["a"], Arc::new(MemoryStore::new()));
    let mut people = vec![agent("a")];
    people.extend((0..POSTERS).map(|p| human(&format!("h{p}"))));
    system
        .create_conversation("busy", people, ConversationKind::Group)
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for poster in 0..POSTERS {
        let client = system.client();
        tasks.push(tokio::spawn(async move {
            let mut seqs = Vec::new();
            for post in 0..POSTS {
                let sender = Sender::Human(format!("h{poster}"));
                let posted = client
                    .post_message("busy", sender, &format!("{poster}.{post}"), "hello")
                    .await
                    .unwrap();
                seqs.push(posted.seq);
            }
            seqs
        }));
    }
    let mut seqs = Vec::new();
    for task in tasks {
        let mine = task.await.unwrap();
        assert!(mine.windows(2).all(|pair| pair[0] < pair[1]), "{mine:?}");
        seqs.extend(mine);
    }
    seqs.sort_unstable();
    assert_eq!(seqs, (0..(POSTERS * POSTS) as u64).collect::<Vec<_>>());
    let messages = system.read_messages("busy", None, 500).await.unwrap();
    assert_gap_free(&messages);
    assert_eq!(messages.len(), POSTERS * POSTS);
    system.shutdown().await;
}

/// The model's time to answer a mention in the retry tests, in milliseconds.
const ANSWER_MODEL_MS: u64 = 200;
/// How long the retry tests wait for something that should happen, in milliseconds.
const RETRY_TEST_WAIT_MS: u64 = 10_000;

/// Polls `done` every 5 ms until it holds; panics after [`RETRY_TEST_WAIT_MS`] naming
/// `what`.
async fn wait_for(what: &str, mut done: impl AsyncFnMut() -> bool) {
    let started = tokio::time::Instant::now();
    while !done().await {
        assert!(
            started.elapsed() < Duration::from_millis(RETRY_TEST_WAIT_MS),
            "{what}: not within {RETRY_TEST_WAIT_MS} ms"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// An agent whose answer to a mention the store refused to commit: the answer is posted
/// again shortly by the agent's process (the model asked again), though nothing else
/// reaches the agent, and it is in the conversation once.
async fn an_answer_the_store_refused_is_posted_again() {
    let llm = ScriptedLlm::new().rule(
        ScriptRule::agent("ann")
            .reply("on it")
            .latency(Duration::from_millis(ANSWER_MODEL_MS)),
    );
    let store = MemoryStore::new();
    let system = start(&llm, &["ann"], Arc::new(store.clone()));
    system
        .create_conversation("desk", vec![agent("ann"), human("hugo")], ConversationKind::Group)
        .await
        .unwrap();
    let posted = system
        .post_message("desk", Sender::Human("hugo".into()), "m1", "@ann status?")
        .await
        .unwrap();
    // ann's model is answering, and the relay's delivery is reported (its commit done):
    // the next commit is the conversation's post of ann's answer.
    let desk = troupe_core::ActorId::new("conversation", "desk").unwrap();
    wait_for("ann's model is asked and the relay reported", async || {
        llm.requests_of("ann").len() == 1 && store.scan(&desk, "relay/", None, 1).await.unwrap().is_empty()
    })
    .await;
    store.faults().fail_next_commits(1);
    wait_for("ann's answer is posted", async || {
        answers_to(&all(&system, "desk").await, posted.seq, "ann") == 1
    })
    .await;
    assert_eq!(
        llm.requests_of("ann").len(),
        2,
        "the model was asked again for the retry"
    );
    tokio::time::sleep(Duration::from_millis(2 * ANSWER_MODEL_MS)).await;
    let messages = all(&system, "desk").await;
    let answers: Vec<_> = messages.iter().filter(|m| m.reply_to == Some(posted.seq)).collect();
    assert_eq!(answers.len(), 1, "{messages:?}");
    assert_eq!(answers[0].text, "on it");
    assert_eq!(answers[0].sender, Sender::Agent("ann".into()));
    assert_gap_free(&messages);
    system.shutdown().await;
}

/// Goal: an answer to a mention whose post the store refused is tried again by the
/// agent's process (`AGENT_MENTION_ANSWER_RETRY_MS`), not left until the agent's next
/// activation: the agent gets no other request here, and without the retry the answer
/// never comes. Paused time (and under madsim, simulated).
#[tokio::test(start_paused = true)]
async fn an_answer_the_store_refused_is_posted_again_without_another_request() {
    an_answer_the_store_refused_is_posted_again().await;
}

/// Goal: as above, on tokio's multi-thread runtime (real time: about 1.4 s).
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_the_store_refused_is_posted_again_on_the_multi_thread_runtime() {
    an_answer_the_store_refused_is_posted_again().await;
}

/// Goal: listing the conversations of something that cannot be an agent id (empty, or
/// longer than `ACTOR_KEY_LENGTH_MAX`) is `InvalidName` naming the agent id, not
/// `Unavailable` (the error to retry) from a store key that does not fit.
#[tokio::test(start_paused = true)]
async fn listing_the_conversations_of_an_invalid_agent_id_is_an_invalid_name() {
    let system = start(&ScriptedLlm::new(), &["alice"], Arc::new(MemoryStore::new()));
    for bad in [
        String::new(),
        "x".repeat(troupe_core::limits::ACTOR_KEY_LENGTH_MAX + 1),
        "x".repeat(600),
    ] {
        let listed = system.conversations_of(&bad).await;
        assert!(
            matches!(&listed, Err(ConversationError::InvalidName { what, value, .. }) if what == "agent id" && *value == bad),
            "{} bytes: {listed:?}",
            bad.len()
        );
    }
    assert_eq!(system.conversations_of("alice").await.unwrap(), Vec::<String>::new());
    system.shutdown().await;
}
