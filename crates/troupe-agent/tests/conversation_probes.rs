//! Probes of the conversation API an embedder calls: concurrent posts, creations that
//! conflict, and what the index lists afterwards.
//!
//! Runs in both builds: `cargo test -p troupe-agent --test conversation_probes` (tokio
//! with paused time, and the multi-thread runtime) and under madsim
//! (`RUSTFLAGS="--cfg madsim"`), but for the multi-thread tests.

#[path = "support/forwarding_store.rs"]
mod forwarding_store;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use forwarding_store::{forwarding_state_store, ForwardingStore};
use troupe_agent::{
    AgentSpec, AgentSystem, ConversationError, ConversationKind, Participant, ScriptedLlm, CONVERSATION_KIND,
};
use troupe_core::ActorId;
use troupe_runtime::{MemoryStore, StateStore, StoreError};

fn start(agents: &[&str]) -> AgentSystem {
    let mut builder = AgentSystem::builder()
        .store(Arc::new(MemoryStore::new()))
        .llm(Arc::new(ScriptedLlm::new()));
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

/// Posters in the concurrent test.
#[cfg(not(madsim))]
const POSTERS: usize = 8;
/// Posts per poster, each sent twice at once.
#[cfg(not(madsim))]
const POSTS_EACH: usize = 10;

/// Goal: many posters at once, each post sent twice concurrently with the same message
/// id (a retry racing the first attempt): every post lands once, the two sends of one
/// id get the same seq with exactly one not a duplicate, and the seqs are gap-free.
/// Multi-thread runtime.
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_posts_and_their_concurrent_retries_land_once_each() {
    use std::collections::BTreeSet;
    use troupe_agent::{Posted, Sender};
    let system = start(&["bot"]);
    let humans: Vec<Participant> = (0..POSTERS).map(|i| human(&format!("h{i}"))).collect();
    let mut participants = humans.clone();
    participants.push(agent("bot"));
    system
        .create_conversation("room", participants, ConversationKind::Group)
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for poster in 0..POSTERS {
        for copy in 0..2 {
            let client = system.client();
            tasks.push(tokio::spawn(async move {
                let mut posted = Vec::new();
                for post in 0..POSTS_EACH {
                    let sender = Sender::Human(format!("h{poster}"));
                    let id = format!("p{poster}-{post}");
                    let result = client
                        .post_message("room", sender, &id, &format!("post {poster}.{post}"))
                        .await
                        .unwrap();
                    posted.push((id, copy, result));
                }
                posted
            }));
        }
    }
    let mut by_id: std::collections::BTreeMap<String, Vec<Posted>> = Default::default();
    for task in tasks {
        for (id, _, posted) in task.await.unwrap() {
            by_id.entry(id).or_default().push(posted);
        }
    }
    assert_eq!(by_id.len(), POSTERS * POSTS_EACH);
    for (id, results) in &by_id {
        assert_eq!(results.len(), 2, "{id}");
        assert_eq!(results[0].seq, results[1].seq, "{id}: {results:?}");
        let fresh = results.iter().filter(|posted| !posted.duplicate).count();
        assert_eq!(fresh, 1, "{id}: {results:?}");
    }
    let messages = system.read_messages("room", None, 500).await.unwrap();
    let seqs: Vec<u64> = messages.iter().map(|m| m.seq).collect();
    assert_eq!(seqs, (0..(POSTERS * POSTS_EACH) as u64).collect::<Vec<_>>());
    let texts: BTreeSet<&str> = messages.iter().map(|m| m.text.as_str()).collect();
    assert_eq!(texts.len(), POSTERS * POSTS_EACH, "each post once");
    system.shutdown().await;
}

/// Goal: a creation refused `Conflict` (the id is taken by another definition) leaves
/// no trace in the index: its agents that are not participants of the existing
/// conversation do not list it. Before, the index recorded the conversation for the
/// refused creation's agents first, and kept it: `bob` listed `room`, a conversation
/// of `hugo` and `alice` only.
#[tokio::test(start_paused = true)]
async fn a_refused_creation_leaves_its_agents_unlisted() {
    let system = start(&["alice", "bob"]);
    system
        .create_conversation("room", vec![human("hugo"), agent("alice")], ConversationKind::Group)
        .await
        .unwrap();
    let refused = system
        .create_conversation("room", vec![human("hugo"), agent("bob")], ConversationKind::Group)
        .await;
    assert_eq!(refused, Err(ConversationError::Conflict { id: "room".to_string() }));
    assert_eq!(system.conversations_of("alice").await.unwrap(), ["room"]);
    assert!(
        system.conversations_of("bob").await.unwrap().is_empty(),
        "bob lists a conversation he is not in"
    );
    system.shutdown().await;
}

/// Creations of one id, racing with different participants.
const RACING_CREATIONS: usize = 8;

/// A store whose first [`RACING_CREATIONS`] snapshot reads (`load`) of `conversation/room`
/// wait for each other: every racing creation reads "no such conversation" before any
/// creates it, so all but one are refused by the conversation, after the index has
/// recorded them.
///
/// The gate is a counter and a [`tokio::sync::Notify`], not a `tokio::sync::Barrier`: a
/// barrier waits through a watch channel, whose wake order follows tokio's own random
/// generator, and under the simulator that made two runs of one seed diverge
/// (`clippy.toml` forbids `Barrier::wait` for this reason).
struct RacingReads {
    inner: MemoryStore,
    reads: AtomicUsize,
    all_read: tokio::sync::Notify,
}

#[async_trait]
impl ForwardingStore for RacingReads {
    type Inner = MemoryStore;

    fn inner(&self) -> &MemoryStore {
        &self.inner
    }

    async fn forward_load(&self, actor: &ActorId) -> Result<Option<Bytes>, StoreError> {
        let room = actor.kind().as_str() == CONVERSATION_KIND && actor.key() == "room";
        if room {
            // Registered before this read counts, so the last reader's wake-up cannot
            // fall between the count and the wait.
            let all_read = self.all_read.notified();
            tokio::pin!(all_read);
            all_read.as_mut().enable();
            let before = self.reads.fetch_add(1, Ordering::SeqCst);
            if before + 1 == RACING_CREATIONS {
                self.all_read.notify_waiters();
            } else if before + 1 < RACING_CREATIONS {
                all_read.await;
            }
        }
        self.inner.load(actor).await
    }
}

forwarding_state_store!(RacingReads);

/// Goal: creations of one id that race, each with another agent, all past the check
/// of an existing definition: one wins, the others are refused `Conflict`, and only
/// the winner's agent lists the conversation. Before, every loser's agent listed it.
async fn racing_creations_of_one_id_leave_only_the_winners_agent_listed() {
    let agents: Vec<String> = (0..RACING_CREATIONS).map(|i| format!("a{i}")).collect();
    let store = RacingReads {
        inner: MemoryStore::new(),
        reads: AtomicUsize::new(0),
        all_read: tokio::sync::Notify::new(),
    };
    let mut builder = AgentSystem::builder()
        .store(Arc::new(store))
        .llm(Arc::new(ScriptedLlm::new()));
    for name in &agents {
        builder = builder.agent(AgentSpec::new(name.as_str()));
    }
    let system = builder.start().expect("the system starts");
    let mut tasks = Vec::new();
    for name in &agents {
        let client = system.client();
        let name = name.clone();
        tasks.push(tokio::spawn(async move {
            let created = client
                .create_conversation("room", vec![human("hugo"), agent(&name)], ConversationKind::Group)
                .await;
            (name, created)
        }));
    }
    let mut winners = Vec::new();
    for task in tasks {
        let (name, created) = task.await.unwrap();
        match created {
            Ok(_) => winners.push(name),
            Err(ConversationError::Conflict { .. }) => {}
            Err(other) => panic!("{name}: {other}"),
        }
    }
    assert_eq!(winners.len(), 1, "{winners:?}");
    for name in &agents {
        let listed = system.conversations_of(name).await.unwrap();
        let expected: Vec<String> = if *name == winners[0] {
            vec!["room".to_string()]
        } else {
            Vec::new()
        };
        assert_eq!(listed, expected, "{name}");
    }
    system.shutdown().await;
}

/// [`racing_creations_of_one_id_leave_only_the_winners_agent_listed`] on the
/// multi-thread runtime.
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_creations_leave_only_the_winners_agent_listed_on_the_multi_thread_runtime() {
    racing_creations_of_one_id_leave_only_the_winners_agent_listed().await;
}

/// [`racing_creations_of_one_id_leave_only_the_winners_agent_listed`] with paused time,
/// and under the simulator, where `scripts/dst --check-determinism` replays it.
#[tokio::test(start_paused = true)]
async fn racing_creations_leave_only_the_winners_agent_listed() {
    racing_creations_of_one_id_leave_only_the_winners_agent_listed().await;
}

/// Goal: an agent lists only its own conversations when another agent's id starts
/// with its id and a `/` (agents `a` and `a/b`), either way round, and a page is not
/// cut short by the entries it leaves out. The index keys `member/{agent}/{id}`:
/// `member/a/b/x1` is agent `a/b` in `x1`, or agent `a` in `b/x1`. Before, `a` listed
/// `["b/x1", "b/x2", "b/x3", "b/z", "y"]` (`a/b`'s three as its own), and `a/b` listed
/// `z` (`a`'s `b/z`).
#[tokio::test(start_paused = true)]
async fn an_agent_does_not_list_the_conversations_of_an_agent_whose_id_extends_its_own() {
    let system = start(&["a", "a/b"]);
    let create = |id: &'static str, member: &'static str| {
        let system = &system;
        async move {
            system
                .create_conversation(id, vec![human("hugo"), agent(member)], ConversationKind::Group)
                .await
                .unwrap();
        }
    };
    for id in ["x1", "x2", "x3"] {
        create(id, "a/b").await;
    }
    create("y", "a").await;
    create("b/z", "a").await;
    assert_eq!(system.conversations_of("a/b").await.unwrap(), ["x1", "x2", "x3"]);
    assert_eq!(system.conversations_of("a").await.unwrap(), ["b/z", "y"]);
    // In pages of 2: the entries of `a/b` first in the index, left out, do not end
    // `a`'s listing early.
    let mut pages = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let page = system.conversations_of_after("a", after.as_deref(), 2).await.unwrap();
        pages.push(page.clone());
        assert!(pages.len() <= 3, "{pages:?}");
        if page.len() < 2 {
            break;
        }
        after = page.last().cloned();
    }
    assert_eq!(pages.concat(), ["b/z", "y"], "{pages:?}");
    system.shutdown().await;
}

/// Goal: a message id names one post: the same sender's retry with the same text is a
/// duplicate (the first seq), but another sender's post, or another text, under an id
/// already used is refused (`InvalidName`, naming the id) rather than answered as a
/// duplicate of a message its sender never wrote. Before, `h2`'s "mine" under `h1`'s
/// id "m-1" was answered `Posted { seq: 0, duplicate: true }` and never appended.
#[tokio::test(start_paused = true)]
async fn a_message_id_used_by_another_post_is_refused_not_taken_for_a_retry() {
    use troupe_agent::{Posted, Sender};
    let system = start(&["bot"]);
    system
        .create_conversation("room", vec![human("h1"), human("h2")], ConversationKind::Group)
        .await
        .unwrap();
    let post = |sender: &'static str, text: &'static str| {
        system.post_message("room", Sender::Human(sender.into()), "m-1", text)
    };
    assert_eq!(
        post("h1", "hello").await,
        Ok(Posted {
            seq: 0,
            duplicate: false
        })
    );
    assert_eq!(
        post("h1", "hello").await,
        Ok(Posted {
            seq: 0,
            duplicate: true
        }),
        "a retry"
    );
    for (sender, text) in [("h2", "mine"), ("h2", "hello"), ("h1", "edited")] {
        match post(sender, text).await {
            Err(ConversationError::InvalidName { what, value, .. }) => {
                assert_eq!((what.as_str(), value.as_str()), ("message id", "m-1"));
            }
            other => panic!("{sender} {text:?}: {other:?}"),
        }
    }
    let messages = system.read_messages("room", None, 10).await.unwrap();
    assert_eq!(messages.len(), 1, "{messages:?}");
    system.shutdown().await;
}
