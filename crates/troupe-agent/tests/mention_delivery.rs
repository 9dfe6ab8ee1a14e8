//! A mention has one delivery task per process (`AgentShared::start_mention_delivery`),
//! however many activations of its conversation resume it: the cluster DST with node
//! kills and slow disks found agents' mailboxes full of the same mention's appends, one
//! per activation that had started a task (`cluster_conversation_partition_dst.rs`).
//!
//!
//! And a wake-up of a mention whose delivery task runs in this process reads nothing
//! from the store: in the same DST, on a slow disk, every round of the resume sweep
//! woke every pending relay of the conversation and each wake-up read its relay key
//! (one store operation, up to 300 ms there, 3.5 s when it stalled), so the
//! conversation's mailbox stayed full of them and the agents' answers waited behind
//! them 5 to 15 s each (seed 74: 385 wake-ups, 68 s of the conversation's turns in the
//! 125 s after the faults); the mentions behind them missed their 120 s deadline.
//!
//! Runs in both builds: `cargo test -p troupe-agent --test mention_delivery` and under
//! madsim (`RUSTFLAGS="--cfg madsim"`).

use std::sync::Arc;
use std::time::Duration;

use troupe_agent::{
    AgentEvent, AgentSpec, AgentSystem, ConversationKind, NoteKind, Participant, ScriptRule, ScriptedLlm, Sender,
    CONVERSATION_KIND,
};
use troupe_runtime::{KindConfig, MemoryStore};

#[path = "support/gate_store.rs"]
mod gate_store;
use gate_store::GateStore;

/// b's mailbox: a holding ask runs and two wait, so a delivery's append is refused busy.
const SMALL_MAILBOX: usize = 2;
/// How long each of b's holding turns takes.
const HOLD: Duration = Duration::from_millis(400);
/// How long the test waits for b's answer to the mention.
const ANSWER_WAIT: Duration = Duration::from_secs(30);

fn human() -> Sender {
    Sender::Human("h".to_string())
}

/// Goal: while a mention's delivery waits for a busy agent, its conversation fails a turn
/// and is rebuilt, and the rebuilt activation resumes the pending relay: the delivery
/// task already running goes on alone, so the agent's inbox takes the mention in once
/// (one `MessageReceived`). Before, the rebuilt activation started a second task, and
/// the mention was appended twice (the second a duplicate). Multi-thread runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuilt_conversation_does_not_start_a_second_delivery_of_a_pending_mention() {
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("b")
                .on_user_containing("hold")
                .reply("held")
                .latency(HOLD),
        )
        .rule(ScriptRule::agent("b").reply("hello back"))
        .without_recording();
    let store = GateStore::new(Arc::new(MemoryStore::new()), false);
    let system = AgentSystem::builder()
        .store(store.clone())
        .llm(Arc::new(llm))
        .kind_config(KindConfig::default().with_mailbox_capacity(SMALL_MAILBOX))
        .agent(AgentSpec::new("b"))
        .start()
        .expect("the system starts");
    let mut events = system.subscribe();
    let participants = vec![Participant::Human("h".to_string()), Participant::Agent("b".to_string())];
    system
        .create_conversation("room", participants, ConversationKind::Group)
        .await
        .unwrap();

    // b busy: one holding turn runs, two wait in its mailbox of 2.
    let mut holds = Vec::new();
    for _ in 0..3 {
        let client = system.client();
        holds.push(tokio::spawn(async move { client.ask("b", "hold").await.unwrap() }));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    system.post_message("room", human(), "m0", "@b hi").await.unwrap();
    // The conversation's next commit is refused: that turn fails and the conversation is
    // rebuilt; the same post sent again is the new activation's first request, which
    // resumes the relay of the mention still on its way.
    store.refuse_one_commit(|actor, _| actor.kind().as_str() == CONVERSATION_KIND);
    assert!(system.post_message("room", human(), "m1", "no mention").await.is_err());
    assert!(store.refused_the_commit());
    system.post_message("room", human(), "m1", "no mention").await.unwrap();
    for hold in holds {
        hold.await.unwrap();
    }

    assert_answered_once(&system).await;
    // Every delivery task has ended by now (b acknowledged the mention); one more
    // backoff's worth lets a second one, if any, reach b.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let mut appends = Vec::new();
    while let Ok(event) = events.try_recv() {
        if let AgentEvent::MessageReceived { msg_id, duplicate, .. } = event {
            if msg_id == "room#0@b" {
                appends.push(duplicate);
            }
        }
    }
    assert_eq!(appends, [false], "the mention is appended once, by one delivery task");
    system.shutdown().await;
}

/// How long b's holding turn takes in the resume test: every resume and post of the
/// test happens while the mention's append waits behind it.
const LONG_HOLD: Duration = Duration::from_secs(3);
/// Resumes of the conversation while the mention's delivery waits.
const RESUMES: usize = 10;

/// Goal: while a mention's delivery waits for a busy agent, resumes of its conversation
/// (a cluster node's resume sweep runs one every period) read nothing from the store
/// for it: the task already running goes on, and its relay is neither woken nor read
/// (`relay/` gets of the conversation, counted). Before, each resume woke the relay and
/// the wake-up read its key before it found the task: one store read per mention per
/// sweep round, in the conversation's mailbox ahead of its posts. Multi-thread runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_reads_nothing_for_a_mention_whose_delivery_runs() {
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("b")
                .on_user_containing("hold")
                .reply("held")
                .latency(LONG_HOLD),
        )
        .rule(ScriptRule::agent("b").reply("hello back"))
        .without_recording();
    let store = GateStore::new(Arc::new(MemoryStore::new()), false);
    let system = AgentSystem::builder()
        .store(store.clone())
        .llm(Arc::new(llm))
        .agent(AgentSpec::new("b"))
        .start()
        .expect("the system starts");
    let participants = vec![Participant::Human("h".to_string()), Participant::Agent("b".to_string())];
    system
        .create_conversation("room", participants, ConversationKind::Group)
        .await
        .unwrap();

    // b busy: the mention's append waits in its mailbox behind the holding turn.
    let client = system.client();
    let hold = tokio::spawn(async move { client.ask("b", "hold").await.unwrap() });
    tokio::time::sleep(Duration::from_millis(100)).await;
    system.post_message("room", human(), "m0", "@b hi").await.unwrap();
    // A post behind the relay's first wake-up: by its answer the delivery task runs.
    system.post_message("room", human(), "m1", "no mention").await.unwrap();
    store.count_gets(|actor, key| actor.kind().as_str() == CONVERSATION_KIND && key.starts_with("relay/"));
    for _ in 0..RESUMES {
        assert_eq!(system.client().resume_conversations().await.unwrap(), 1);
    }
    // Two posts: the first is queued behind the resumes, the second behind whatever
    // wake-ups they sent; by its answer every one has run.
    system.post_message("room", human(), "m2", "no mention").await.unwrap();
    system.post_message("room", human(), "m3", "no mention").await.unwrap();
    assert!(!hold.is_finished(), "b still holds: the delivery still waits");
    assert_eq!(
        store.counted_gets(),
        0,
        "no resume read the relay of the mention on its way"
    );

    hold.await.unwrap();
    assert_answered_once(&system).await;
    system.shutdown().await;
}

/// Waits (at most [`ANSWER_WAIT`]) until b's answer is in the room, and checks that it
/// is there once.
async fn assert_answered_once(system: &AgentSystem) {
    let answered = tokio::time::timeout(ANSWER_WAIT, async {
        loop {
            let messages = system.read_messages("room", None, 100).await.unwrap();
            if messages.iter().any(|m| m.text == "hello back") {
                return messages;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("b answers the mention");
    assert_eq!(answered.iter().filter(|m| m.text == "hello back").count(), 1);
}

/// How long b's holding turn takes in the deadline test: until 2 s before the mention's
/// deadline, after the delivery's last attempt that b refuses (its pauses double from
/// 100 ms to 5 s: attempts about 6.3 s + 5 s·k after the post, the last before the
/// deadline at 116.3 s, then a pause cut to the 3.7 s left).
const HOLD_TO_DEADLINE: Duration = Duration::from_secs(118);
/// The holding asks' timeout (more than the hold).
const HOLD_TIMEOUT: Duration = Duration::from_secs(200);

/// Goal: a mention's delivery makes no attempt at or after the mention's deadline, as
/// the inbox's delivery does not: the mention is recorded undeliverable
/// (`NoteKind::Undeliverable`, "the deadline passed") and b's inbox never takes it.
/// Method: b's mailbox of 1 holds a waiting ask behind a turn that runs until 2 s
/// before the mention's deadline, so every attempt until then is refused busy; b is
/// free at the deadline. Before, the pause after the last refused attempt was cut to
/// the deadline and one more attempt was made there: b took the mention
/// (`MessageReceived`) and ran a turn past its deadline, which posted "the deadline
/// passed before it could answer" (`NoteKind::Failed`; paused time); under the
/// simulator, whose clock moves a little at every poll, the pause (cut to whole
/// milliseconds) ended 0.998 ms before the deadline, and b answered in that last
/// millisecond. Paused time (normal build) and the simulator: the times are exact.
#[tokio::test(start_paused = true)]
async fn a_mention_is_not_delivered_at_or_after_its_deadline() {
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("b")
                .on_user_containing("hold")
                .reply("held")
                .latency(HOLD_TO_DEADLINE),
        )
        .rule(ScriptRule::agent("b").reply("hello back"))
        .without_recording();
    let system = AgentSystem::builder()
        .store(Arc::new(MemoryStore::new()))
        .llm(Arc::new(llm))
        .kind_config(KindConfig::default().with_mailbox_capacity(1))
        .agent(AgentSpec::new("b"))
        .start()
        .expect("the system starts");
    let mut events = system.subscribe();
    let participants = vec![Participant::Human("h".to_string()), Participant::Agent("b".to_string())];
    system
        .create_conversation("room", participants, ConversationKind::Group)
        .await
        .unwrap();

    // b busy: the holding turn runs, a quick ask fills its mailbox of 1.
    let client = system.client();
    let hold = tokio::spawn(async move { client.ask_with_timeout("b", "hold", HOLD_TIMEOUT).await });
    tokio::time::sleep(Duration::from_millis(10)).await;
    let client = system.client();
    let quick = tokio::spawn(async move { client.ask_with_timeout("b", "quick", HOLD_TIMEOUT).await });
    tokio::time::sleep(Duration::from_millis(10)).await;
    system.post_message("room", human(), "m0", "@b hi").await.unwrap();
    assert_eq!(hold.await.unwrap().unwrap().text, "held");
    assert_eq!(quick.await.unwrap().unwrap().text, "hello back");

    let note = tokio::time::timeout(ANSWER_WAIT, async {
        loop {
            let messages = system.read_messages("room", None, 100).await.unwrap();
            if let Some(note) = messages.into_iter().find(|m| m.reply_to == Some(0)) {
                return note;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the mention is resolved");
    assert_eq!(
        note.note.as_ref().map(|note| note.kind),
        Some(NoteKind::Undeliverable),
        "{}",
        note.text
    );
    assert!(note.text.contains("the deadline passed"), "{}", note.text);
    let mut received = 0;
    while let Ok(event) = events.try_recv() {
        if let AgentEvent::MessageReceived { msg_id, .. } = event {
            received += usize::from(msg_id == "room#0@b");
        }
    }
    assert_eq!(received, 0, "b's inbox took the mention");
    system.shutdown().await;
}
