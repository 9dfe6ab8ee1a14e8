//! Group conversations with @mention fan-out under process crashes at random moments,
//! duplicated posts, model latency and failing models, in the simulator.
//!
//! Goal: no mention is lost and none is answered twice; a conversation's sequence stays
//! gap-free; an acknowledged post is kept exactly once. Method: per round, a fresh
//! store; a group of four agents and a human; the human posts `POSTS` messages that
//! mention alice and bob, each sent twice at once with the same message id (a duplicated
//! delivery); alice's reply mentions carol and carol's mentions dave (a chain of
//! depth 3), bob's model fails in some rounds. The whole system is dropped (the process
//! dies: running turns are cut, their commits fenced off) at a random virtual moment,
//! then a second system starts on the same data (it resumes by itself) and the stored
//! conversation is checked.
//!
//! Faults: process crash at a random time (seeded), model latency (random per round),
//! a failing model (random per round), duplicated posts. Invariants: every mention of a
//! message is answered exactly once, by a reply or a recorded note (NoMentionLost,
//! NoMentionAnsweredTwice); seqs 0..n without gaps (GapFreeSequence); every
//! acknowledged post stored once, no post twice (NoAckedPostLost); inboxes drained.
#![cfg(madsim)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use troupe::agent::{
    AgentSpec, AgentSystem, ConversationKind, ConversationMessage, NoteKind, Participant, ScriptRule, ScriptedLlm,
    Sender,
};
use troupe::runtime::{MemoryStore, StateStore};
use troupe_sim::SimRng;

const ROUNDS: u64 = 16;
/// Human posts per round, each mentioning two agents.
const POSTS: u64 = 3;
const AGENTS: [&str; 4] = ["alice", "bob", "carol", "dave"];
const CONVERSATION: &str = "standup";

fn script(latency_ms: u64, bob_fails: bool) -> ScriptedLlm {
    let latency = Duration::from_millis(latency_ms);
    let bob = if bob_fails {
        ScriptRule::agent("bob").fail("the model is down").latency(latency)
    } else {
        ScriptRule::agent("bob").reply("bob: done").latency(latency)
    };
    ScriptedLlm::new()
        .rule(
            ScriptRule::agent("alice")
                .reply("alice: @carol please check")
                .latency(latency),
        )
        .rule(bob)
        .rule(
            ScriptRule::agent("carol")
                .reply("carol: @dave fyi")
                .latency(latency * 2),
        )
        .rule(ScriptRule::agent("dave").reply("dave: noted").latency(latency))
}

fn start(llm: &ScriptedLlm, store: Arc<dyn StateStore>) -> AgentSystem {
    let mut builder = AgentSystem::builder().store(store).llm(Arc::new(llm.clone()));
    for agent in AGENTS {
        builder = builder.agent(AgentSpec::new(agent));
    }
    builder.start().expect("the system starts")
}

/// How many stored messages answer `seq` for `agent`: its reply, or a note about it.
fn answers(messages: &[ConversationMessage], seq: u64, agent: &str) -> usize {
    messages
        .iter()
        .filter(|m| m.reply_to == Some(seq))
        .filter(|m| m.sender == Sender::Agent(agent.to_string()) || m.note.as_ref().is_some_and(|n| n.agent == agent))
        .count()
}

/// Goal and method: see the module documentation.
#[madsim::test]
async fn every_mention_is_answered_exactly_once_across_random_crashes() {
    let mut rng = SimRng::new();
    let mut interrupted = 0;
    let mut failed_notes = 0;
    let mut replies = 0;
    for round in 0..ROUNDS {
        let latency_ms = rng.range(1, 200);
        let bob_fails = rng.range(0, 3) == 0;
        // The posts and the whole fan-out take about 6 model latencies: most crashes
        // land during it, some after.
        let crash_after_ms = rng.range(0, 8 * latency_ms + 20);
        let llm = script(latency_ms, bob_fails);
        let data = MemoryStore::new();
        let first = start(&llm, Arc::new(data.clone()));
        let mut people: Vec<Participant> = AGENTS.iter().map(|a| Participant::Agent(a.to_string())).collect();
        people.push(Participant::Human("hugo".to_string()));
        first
            .create_conversation(CONVERSATION, people, ConversationKind::Group)
            .await
            .unwrap();
        let client = first.client();
        let acknowledged: Arc<Mutex<Vec<String>>> = Arc::default();
        let acks = Arc::clone(&acknowledged);
        let work = tokio::spawn(async move {
            for i in 0..POSTS {
                let id = format!("h{i}");
                let text = format!("@alice @bob topic {i}");
                let hugo = || Sender::Human("hugo".to_string());
                let (a, b) = tokio::join!(
                    client.post_message(CONVERSATION, hugo(), &id, &text),
                    client.post_message(CONVERSATION, hugo(), &id, &text)
                );
                if let (Ok(a), Ok(b)) = (&a, &b) {
                    // One of the two appended it; the other saw the same seq.
                    assert_eq!(a.seq, b.seq, "a duplicated post lands once");
                    assert_ne!(a.duplicate, b.duplicate, "exactly one of the two appended");
                }
                if a.is_ok() || b.is_ok() {
                    acks.lock().unwrap().push(text);
                }
            }
        });
        tokio::time::sleep(Duration::from_millis(crash_after_ms)).await;
        work.abort();
        let before_crash = first
            .read_messages(CONVERSATION, None, 500)
            .await
            .map(|m| m.len())
            .unwrap_or(0);
        drop(first); // the process dies here
        let acknowledged = acknowledged.lock().unwrap().clone();
        let second = start(&llm, Arc::new(data.clone()));
        tokio::time::sleep(Duration::from_secs(30)).await;

        let messages = second.read_messages(CONVERSATION, None, 500).await.unwrap();
        let seqs: Vec<u64> = messages.iter().map(|m| m.seq).collect();
        assert_eq!(
            seqs,
            (0..messages.len() as u64).collect::<Vec<_>>(),
            "round {round}: gap-free"
        );
        if messages.len() > before_crash {
            interrupted += 1;
        }
        for text in &acknowledged {
            let stored = messages.iter().filter(|m| &m.text == text).count();
            assert_eq!(stored, 1, "round {round}: acknowledged post {text:?} stored once");
        }
        for i in 0..POSTS {
            let text = format!("@alice @bob topic {i}");
            assert!(
                messages.iter().filter(|m| m.text == text).count() <= 1,
                "round {round}: {text:?} never stored twice"
            );
        }
        for message in &messages {
            for agent in &message.mentions {
                let n = answers(&messages, message.seq, agent);
                assert_eq!(
                    n, 1,
                    "round {round}: mention of {agent} in #{} answered {n} times\n{messages:#?}",
                    message.seq
                );
            }
            if let Some(note) = &message.note {
                if note.kind == NoteKind::Failed {
                    assert_eq!(note.agent, "bob", "round {round}: only bob's model fails");
                    assert!(bob_fails, "round {round}: a failure note without a failing model");
                    failed_notes += 1;
                }
            } else if matches!(message.sender, Sender::Agent(_)) {
                replies += 1;
            }
        }
        // Every stored human post fanned out to alice and bob, and alice's reply to
        // carol, carol's to dave: the chain is complete for every post kept.
        let posts = messages
            .iter()
            .filter(|m| m.sender == Sender::Human("hugo".into()))
            .count();
        let from = |who: &str| {
            messages
                .iter()
                .filter(|m| m.sender == Sender::Agent(who.to_string()))
                .count()
        };
        assert_eq!(from("alice"), posts, "round {round}");
        assert_eq!(from("carol"), posts, "round {round}");
        assert_eq!(from("dave"), posts, "round {round}");
        assert_eq!(from("bob"), if bob_fails { 0 } else { posts }, "round {round}");
        for agent in AGENTS {
            assert_eq!(
                second.pending(agent).await.unwrap(),
                (0, 0),
                "round {round}: {agent} drained"
            );
        }
        second.shutdown().await;
    }
    assert!(interrupted > 0, "some crashes must land mid-fan-out");
    assert!(replies > 0 && failed_notes > 0, "both replies and failures must occur");
}
