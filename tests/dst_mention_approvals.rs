//! Mentions waiting for approval across process crashes, in the simulator.
//!
//! Goal: a mention whose contact needs approval waits durably (its relay in the
//! conversation, its approval in the organisation's store) until it is approved, denied
//! or its deadline passes, whatever happens to the process meanwhile; the mentioned
//! agent answers it at most once and only if approved, and every committed mention ends
//! with exactly one reply to it: the agent's answer or a `NotPermitted` note.
//! Method: per round, a fresh store; a supervised agent `dev` (every contact needs
//! approval) in a group conversation with `boss` and a human; the human posts a job per
//! message mentioning `dev`, whose scripted reply mentions `boss`; a resolver approves or
//! denies each pending approval at a random moment (seeded; the first two of a round one
//! of each, then drawn), and in some rounds leaves the last job's to its deadline; the
//! whole system is dropped (the process dies: running turns and delivery tasks are cut,
//! their commits fenced off) at a random moment, then a second system starts on the same
//! data (it resumes by itself), the approvals still pending are resolved there, and the
//! conversation is checked.
//!
//! Faults: process crash at a random time, one failed store commit at a random moment
//! before it in half the rounds (whichever turn or organisation write it lands on),
//! model latency (random per round), approvals resolved before, during and after the
//! crash, deadlines passing.
//! Invariants, per job whose mention of `boss` (dev's reply) committed:
//! - OneReply: exactly one message replies to dev's mention for `boss`: boss's answer
//!   to that job, or a system `NotPermitted` note;
//! - ApprovedOnly: an answer only if one of the job's approvals was approved;
//! - NoteNamesItsApproval: a note names one of the job's approvals, denied ("was
//!   denied") or never approved in time ("still pending at the deadline"), and boss's
//!   model never saw the job; or, in a round whose failed commit was the organisation's
//!   record of the approval, says the organisation could not be read;
//! - NoOrphanDelivery: a job whose mention never committed reaches nothing;
//! - NoOrphanListed: an approval whose mention never committed is never listed for a
//!   person (the approver resolves only what `pending_approvals` lists): at most one
//!   approval of a job is listed, none of a job whose mention never committed;
//! - Drained: no inbox or outbox entries left.
#![cfg(madsim)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use troupe::agent::limits::AGENT_TASK_TIMEOUT_MS_DEFAULT;
use troupe::agent::{
    AgentSpec, AgentSystem, ApprovalState, BehaviourMode, ConversationKind, ConversationMessage, Membership, NoteKind,
    Participant, ScriptRule, ScriptedLlm, Sender,
};
use troupe::runtime::{MemoryStore, StateStore};
use troupe_sim::SimRng;

#[path = "support/approvals.rs"]
mod approvals;
use approvals::Approver;

const ROUNDS: u64 = 10;
/// Jobs (human posts) per round.
const JOBS: u64 = 3;
const FLOOR: &str = "floor";
/// At most this many rounds leave an approval to its deadline (each such round lasts the
/// mention's 120 s deadline; the others end when every mention has its reply).
const ROUNDS_LEFT_TO_THE_DEADLINE_MAX: u64 = 2;

/// `dev` mentions `boss` about the job it was asked; `boss` answers the job.
fn script(latency_ms: u64) -> ScriptedLlm {
    let latency = Duration::from_millis(latency_ms);
    let mut llm = ScriptedLlm::new();
    for job in 0..JOBS {
        llm = llm
            .rule(
                ScriptRule::agent("dev")
                    .on_user_containing(format!("job{job}"))
                    .reply(format!("asking @boss about job{job}"))
                    .latency(latency),
            )
            .rule(
                ScriptRule::agent("boss")
                    .on_user_containing(format!("job{job}"))
                    .reply(format!("boss did job{job}"))
                    .latency(latency),
            );
    }
    llm
}

fn start(llm: &ScriptedLlm, store: Arc<dyn StateStore>) -> AgentSystem {
    AgentSystem::builder()
        .store(store)
        .llm(Arc::new(llm.clone()))
        .agent(AgentSpec::new("dev"))
        .agent(AgentSpec::new("boss"))
        .start()
        .expect("the system starts")
}

/// The replies to message `seq` that are boss's answer or a note about boss.
fn replies_for_boss(messages: &[ConversationMessage], seq: u64) -> Vec<&ConversationMessage> {
    messages
        .iter()
        .filter(|m| m.reply_to == Some(seq))
        .filter(|m| m.sender == Sender::Agent("boss".into()) || m.note.as_ref().is_some_and(|n| n.agent == "boss"))
        .collect()
}

/// Whether every human post has dev's reply and every mention of boss by dev a reply
/// for boss, with nothing left in the agents' boxes.
async fn settled(system: &AgentSystem) -> bool {
    let Ok(messages) = system.read_messages(FLOOR, None, 1_000).await else {
        return false;
    };
    let answered_by_dev = |seq| {
        messages
            .iter()
            .any(|m| m.reply_to == Some(seq) && m.sender == Sender::Agent("dev".into()))
    };
    let posts_answered = messages
        .iter()
        .filter(|m| matches!(m.sender, Sender::Human(_)))
        .all(|m| answered_by_dev(m.seq));
    let mentions_answered = messages
        .iter()
        .filter(|m| m.sender == Sender::Agent("dev".into()))
        .all(|m| !replies_for_boss(&messages, m.seq).is_empty());
    posts_answered
        && mentions_answered
        && matches!(system.pending("dev").await, Ok((0, 0)))
        && matches!(system.pending("boss").await, Ok((0, 0)))
}

/// Goal and method: see the module documentation.
#[madsim::test]
async fn a_mention_waiting_for_approval_is_answered_at_most_once_across_crashes() {
    let rng = Arc::new(Mutex::new(SimRng::new()));
    let mut outcomes: BTreeMap<&str, usize> = BTreeMap::new();
    let mut crossed_the_crash = 0;
    let mut rounds_left_to_the_deadline = 0;
    let mut orphan_approvals = 0;
    let mut orphans_listed = 0;
    let mut commits_failed = 0;
    for round in 0..ROUNDS {
        let draw = |low, high| rng.lock().unwrap().range(low, high);
        let latency_ms = draw(1, 120);
        let leave = (draw(0, 4) == 0 && rounds_left_to_the_deadline < ROUNDS_LEFT_TO_THE_DEADLINE_MAX)
            .then(|| format!("job{}", JOBS - 1));
        rounds_left_to_the_deadline += u64::from(leave.is_some());
        let approver_away = draw(0, 2) == 0;
        let resolver_starts_ms = (!approver_away).then(|| draw(0, 4 * latency_ms + 100));
        let crash_after_ms = draw(0, 6 * latency_ms + 200);
        // In half the rounds one commit fails, at a random moment before the crash:
        // whichever turn it lands on is rolled back (the post of dev's reply after its
        // approval was recorded leaves that approval an orphan; a failed write of the
        // organisation refuses the mention with a note that says so).
        let commit_fails_after_ms = (draw(0, 2) == 0).then(|| draw(0, 6 * latency_ms + 200));
        let llm = script(latency_ms);
        let data = MemoryStore::new();
        let first = start(&llm, Arc::new(data.clone()));
        let supervised = Membership {
            manager: None,
            mode: BehaviourMode::Supervised,
        };
        first.set_membership("dev", supervised).await.unwrap();
        let people = vec![
            Participant::Agent("dev".into()),
            Participant::Agent("boss".into()),
            Participant::Human("h".into()),
        ];
        first
            .create_conversation(FLOOR, people, ConversationKind::Group)
            .await
            .unwrap();
        let approver = Approver::new(Arc::clone(&rng), leave);

        let client = first.client();
        let posts = tokio::spawn(async move {
            for job in 0..JOBS {
                let text = format!("@dev job{job}");
                let _ = client
                    .post_message(FLOOR, Sender::Human("h".into()), &format!("q{job}"), &text)
                    .await;
            }
        });
        let resolver = approver.spawn(first.client(), resolver_starts_ms);
        let fault = commit_fails_after_ms.map(|after_ms| {
            let faults = data.faults().clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(after_ms)).await;
                faults.fail_next_commits(1);
            })
        });
        tokio::time::sleep(Duration::from_millis(crash_after_ms)).await;
        posts.abort();
        resolver.abort();
        if let Some(fault) = fault {
            fault.abort();
        }
        drop(first); // the process dies here
                     // A restart takes a moment: by then the dead runtime has aborted its turns.
        tokio::time::sleep(Duration::from_secs(1)).await;

        // The failure, if it was not used, does not outlive the first process.
        data.faults().heal();
        let commit_failed = data.faults().injected_count() > 0;
        commits_failed += u64::from(commit_failed);
        let second = start(&llm, Arc::new(data.clone()));
        let client = second.client();
        // The resumed mention turns of dev ask for approvals again; resolve them as they come.
        let before = approver.decided();
        for _ in 0..5 {
            tokio::time::sleep(Duration::from_millis(500)).await;
            approver.resolve_pending(&client).await;
        }
        if approver.decided() > before {
            crossed_the_crash += 1;
        }
        // Until every mention has its reply, at the latest past every deadline (the
        // approvals left unresolved expire).
        let give_up = Duration::from_millis(AGENT_TASK_TIMEOUT_MS_DEFAULT + 10_000);
        let waited = tokio::time::Instant::now();
        while !settled(&second).await && waited.elapsed() < give_up {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }

        let org = second.organisation().await.unwrap();
        let messages = second.read_messages(FLOOR, None, 1_000).await.unwrap();
        let seqs: Vec<u64> = messages.iter().map(|m| m.seq).collect();
        assert_eq!(
            seqs,
            (0..messages.len() as u64).collect::<Vec<_>>(),
            "round {round}: gap-free"
        );
        let boss_seen: Vec<String> = llm
            .requests_of("boss")
            .iter()
            .filter_map(|r| r.messages.last().map(|m| m.content.clone()))
            .collect();
        // Every approval ever recorded, by job (a job's mention turn cut by the crash and
        // run again records another).
        let mut approvals_of: BTreeMap<String, Vec<(u64, ApprovalState)>> = BTreeMap::new();
        let mut id = 0;
        while let Some(approval) = org.approval(id) {
            let job = approval.message.rsplit(' ').next().unwrap_or_default().to_string();
            approvals_of.entry(job).or_default().push((id, approval.state));
            id += 1;
        }
        for job in (0..JOBS).map(|job| format!("job{job}")) {
            let job = job.as_str();
            let approvals = approvals_of.get(job).cloned().unwrap_or_default();
            // dev's mention turn cut by the crash and run again: its first approval has
            // no relay (an orphan), and must send nothing whatever its decision.
            orphan_approvals += approvals.len().saturating_sub(1);
            let listed = {
                let seen = approver.messages.lock().unwrap();
                approvals.iter().filter(|(id, _)| seen.contains_key(id)).count()
            };
            for (id, state) in &approvals {
                if let Some(approved) = approver.decisions.lock().unwrap().get(id) {
                    let expected = if *approved {
                        ApprovalState::Approved
                    } else {
                        ApprovalState::Denied
                    };
                    assert_eq!(*state, expected, "round {round}: approval {id} kept as decided");
                }
            }
            let mention = messages
                .iter()
                .filter(|m| m.sender == Sender::Agent("dev".into()) && m.text == format!("asking @boss about {job}"))
                .collect::<Vec<_>>();
            let boss_saw = boss_seen.iter().any(|m| m.contains(job));
            let [mention] = mention.as_slice() else {
                // NoOrphanDelivery: the mention never committed (its post or dev's turn cut).
                assert!(
                    mention.is_empty(),
                    "round {round}: dev answered {job} once: {messages:#?}"
                );
                assert!(!boss_saw, "round {round}: orphan {job} reached boss");
                assert!(
                    !messages.iter().any(|m| m.text.contains(&format!("boss did {job}"))),
                    "round {round}: orphan {job} answered"
                );
                *outcomes.entry("orphan").or_default() += 1;
                orphans_listed += listed;
                continue;
            };
            orphans_listed += listed.saturating_sub(1);
            let replies = replies_for_boss(&messages, mention.seq);
            let [reply] = replies.as_slice() else {
                panic!("round {round}: {job}: one reply for boss, not {replies:#?}\n{messages:#?}");
            };
            if reply.sender == Sender::Agent("boss".into()) {
                // ApprovedOnly.
                assert_eq!(reply.text, format!("boss did {job}"), "round {round}");
                assert!(
                    approvals.iter().any(|(_, state)| *state == ApprovalState::Approved),
                    "round {round}: {job} answered without an approval: {approvals:?}"
                );
                *outcomes.entry("approved").or_default() += 1;
                continue;
            }
            // NoteNamesItsApproval.
            let note = reply.note.clone().expect("a system note");
            assert_eq!(note.kind, NoteKind::NotPermitted, "round {round}: {reply:#?}");
            assert!(!boss_saw, "round {round}: refused {job} reached boss");
            let named = approvals
                .iter()
                .find(|(id, _)| reply.text.contains(&format!("approval {id} ")));
            let Some(named) = named else {
                // The failed commit was the organisation's, recording the approval: the
                // mention is refused with a note that says why, and nothing was listed.
                assert!(
                    commit_failed && reply.text.contains("the organisation could not be read"),
                    "round {round}: {} names none of {approvals:?}",
                    reply.text
                );
                *outcomes.entry("organisation unavailable").or_default() += 1;
                continue;
            };
            match named.1 {
                ApprovalState::Denied => {
                    assert!(reply.text.contains("was denied"), "round {round}: {}", reply.text);
                    *outcomes.entry("denied").or_default() += 1;
                }
                ApprovalState::Pending | ApprovalState::Expired => {
                    assert!(
                        reply.text.contains("still pending at the deadline"),
                        "round {round}: {}",
                        reply.text
                    );
                    *outcomes.entry("timed out").or_default() += 1;
                }
                ApprovalState::Approved => panic!("round {round}: an approved mention noted: {}", reply.text),
            }
        }
        for agent in ["dev", "boss"] {
            assert_eq!(
                second.pending(agent).await.unwrap(),
                (0, 0),
                "round {round}: {agent} drained"
            );
        }
        second.shutdown().await;
    }
    assert!(
        outcomes.contains_key("approved") && outcomes.contains_key("denied"),
        "both outcomes must occur: {outcomes:?}"
    );
    assert!(crossed_the_crash > 0, "some approvals must be resolved after the crash");
    eprintln!(
        "outcomes {outcomes:?}, orphan approvals {orphan_approvals} ({orphans_listed} listed), rounds \
         resolving after the crash {crossed_the_crash}, rounds with a failed commit {commits_failed}"
    );
    // NoOrphanListed.
    assert_eq!(orphans_listed, 0, "orphan approvals were listed for a person");
}
