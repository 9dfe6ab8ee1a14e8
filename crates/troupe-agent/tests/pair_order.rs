//! The order between two agents: the notifications and tasks one agent sends another
//! are processed in the order it sent them (`PairSeq` in `src/inbox.rs`), also when
//! deliveries are refused `Busy` and retried, and past a message the sender gave up.
//!
//! Runs in both builds: `cargo test -p troupe-agent --test pair_order` (tokio: paused
//! time, and the multi-thread runtime in real time) and under madsim
//! (`RUSTFLAGS="--cfg madsim"`).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use troupe_agent::{AgentSpec, AgentSystem, ChatMessage, InboxError, Role, ScriptRule, ScriptedLlm, TaskState};
use troupe_core::InvokeError;
use troupe_runtime::{KindConfig, MemoryStore, StateStore};

#[path = "support/gate_store.rs"]
mod gate_store;
use gate_store::GateStore;

/// Notifications sent in a row by the ordering test.
const NOTES: usize = 30;
/// Each agent's mailbox, in messages: small, so that deliveries are refused `Busy`.
const SMALL_MAILBOX: usize = 2;
/// How long the receiver's model takes per notification.
const NOTE_LATENCY: Duration = Duration::from_millis(50);
/// How long a test waits for every box to drain, at most.
const DRAIN_WAIT: Duration = Duration::from_secs(30);

fn system(llm: ScriptedLlm, mailbox: usize) -> AgentSystem {
    system_on(Arc::new(MemoryStore::new()), llm, mailbox)
}

fn system_on(store: Arc<dyn StateStore>, llm: ScriptedLlm, mailbox: usize) -> AgentSystem {
    AgentSystem::builder()
        .store(store)
        .llm(Arc::new(llm.without_recording()))
        .kind_config(KindConfig::default().with_mailbox_capacity(mailbox))
        .agent(AgentSpec::new("a"))
        .agent(AgentSpec::new("b"))
        .start()
        .expect("the system starts")
}

/// Runs `send` until it is not refused `Busy` (a refused request kept nothing).
async fn unless_busy<T, F, Fut>(mut send: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, InboxError>>,
{
    loop {
        match send().await {
            Ok(value) => return value,
            Err(InboxError::Invoke(InvokeError::Busy { .. })) => tokio::time::sleep(Duration::from_millis(5)).await,
            Err(error) => panic!("the send failed: {error}"),
        }
    }
}

/// Waits until both agents' inboxes and outboxes are empty; panics after `DRAIN_WAIT`.
async fn drained(system: &AgentSystem) {
    let step = Duration::from_millis(50);
    for _ in 0..DRAIN_WAIT.as_millis() / step.as_millis() {
        let a = system.pending("a").await.unwrap();
        let b = system.pending("b").await.unwrap();
        if a == (0, 0) && b == (0, 0) {
            return;
        }
        tokio::time::sleep(step).await;
    }
    panic!(
        "the boxes did not drain within {DRAIN_WAIT:?}: a {:?}, b {:?}",
        system.pending("a").await.unwrap(),
        system.pending("b").await.unwrap()
    );
}

/// The numbers of the user messages in `log` that contain `word` followed by a number,
/// in log order.
fn numbers_after(log: &[ChatMessage], word: &str) -> Vec<usize> {
    log.iter()
        .filter(|message| message.role == Role::User)
        .filter_map(|message| {
            let rest = &message.content[message.content.find(word)? + word.len()..];
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        })
        .collect()
}

/// A model under which b takes `hold` to answer "hold", and answers notifications at
/// once.
fn b_holds_for(hold: Duration) -> ScriptedLlm {
    ScriptedLlm::new()
        .rule(
            ScriptRule::agent("b")
                .on_user_containing("hold")
                .reply("held")
                .latency(hold),
        )
        .rule(
            ScriptRule::agent("b")
                .on_user_containing("[notification")
                .reply("noted"),
        )
}

/// Keeps b busy: `count` asks "hold", 10 ms apart (the first one's turn runs, the
/// others wait in its mailbox); `until_answered` waits for their answers.
async fn hold_b(system: &AgentSystem, count: usize) -> Vec<tokio::task::JoinHandle<()>> {
    let mut holds = Vec::new();
    for _ in 0..count {
        let client = system.client();
        holds.push(tokio::spawn(async move {
            client.ask("b", "hold").await.expect("the holding asks are answered");
        }));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    holds
}

async fn until_answered(holds: Vec<tokio::task::JoinHandle<()>>) {
    for hold in holds {
        hold.await.unwrap();
    }
}

/// 30 notifications from a to b, sent one after the other, into a mailbox of 2 whose
/// turns take 50 ms: most deliveries are refused `Busy` and retried.
async fn thirty_notifications_in_order() {
    let llm = ScriptedLlm::new().rule(
        ScriptRule::any_agent()
            .on_user_containing("[notification")
            .reply("noted")
            .latency(NOTE_LATENCY),
    );
    let system = system(llm, SMALL_MAILBOX);
    let client = system.client();
    for note in 0..NOTES {
        let text = format!("note {note}");
        unless_busy(|| client.notify_as("a", "b", &text)).await;
    }
    drained(&system).await;
    let log = system.conversation_log("b").await.unwrap();
    assert_eq!(
        numbers_after(&log, "note "),
        (0..NOTES).collect::<Vec<_>>(),
        "b processed a's notifications in the order a sent them"
    );
    system.shutdown().await;
}

/// Goal: the notifications one agent sends another are processed in the order sent,
/// although their deliveries are refused `Busy` and retried. Before the order was kept
/// (2026-11-30) this ran on the multi-thread runtime as 0, 1, 2, 3, 5, 4, 11, 6, 16, ...
/// (and on paused time in order).
#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn notifications_to_a_busy_agent_are_processed_in_the_order_sent_on_the_multi_thread_runtime() {
    thirty_notifications_in_order().await;
}

/// The same, on paused time, and under the simulator (whose task order is the seed's).
#[tokio::test(start_paused = true)]
async fn notifications_to_a_busy_agent_are_processed_in_the_order_sent() {
    thirty_notifications_in_order().await;
}

/// Goal: a message the sender gave up (its deadline passed while the target refused it
/// `Busy`) leaves no gap that holds the later ones: they are delivered and worked, in
/// order, and the given-up one never is. Method: b's mailbox (1) is kept full by two
/// 3 s asks; a delegates t0 (deadline 300 ms), then t1 and t2 (60 s). t0's deliveries
/// are refused until its deadline, so a gives it up (t0 resolves `failed` at a); t1
/// must get past the gap (its attempts carry a's lowest pending entry, which is t1
/// itself) without waiting for its own deadline.
#[tokio::test(start_paused = true)]
async fn a_message_given_up_leaves_no_gap_that_holds_the_later_ones() {
    let llm = b_holds_for(Duration::from_secs(3))
        .rule(ScriptRule::agent("b").on_user_containing("[task").reply("done"))
        .rule(
            ScriptRule::agent("a")
                .on_user_containing("you delegated is")
                .reply("seen"),
        );
    let system = system(llm, 1);
    let client = system.client();
    // The first hold's turn runs, the second waits in the mailbox: full.
    let holds = hold_b(&system, 2).await;
    let started = tokio::time::Instant::now();
    let mut tasks = Vec::new();
    for (job, timeout_ms) in [(0, 300), (1, 60_000), (2, 60_000)] {
        let text = format!("job {job}");
        tasks.push(unless_busy(|| client.delegate("a", "b", &text, Some(timeout_ms))).await);
    }
    until_answered(holds).await;
    drained(&system).await;
    let states: Vec<TaskState> = {
        let mut states = Vec::new();
        for task in &tasks {
            states.push(system.task("a", task).await.unwrap().expect("a keeps its task").state);
        }
        states
    };
    assert_eq!(
        states,
        [TaskState::Failed, TaskState::Completed, TaskState::Completed],
        "t0 given up, t1 and t2 worked"
    );
    let log = system.conversation_log("b").await.unwrap();
    let worked: Vec<usize> = numbers_after(&log, "] job ");
    assert_eq!(worked, [1, 2], "b worked t1 then t2, never t0");
    // Past the gap well before t1's own deadline (60 s): the two holds take 6 s.
    let took = started.elapsed();
    assert!(took < Duration::from_secs(20), "drained {took:?} after the sends");
    system.shutdown().await;
}

/// Goal: a processing turn that fails does not let the sender's later messages overtake
/// its entry. Method: b is held in a 1 s turn while a's notifications 0, 1 and 2 are
/// delivered, so their processing turns queue back to back; the commit of note 0's
/// turn is refused once (the turn rolls back, the actor is rebuilt and resumes its
/// inbox). b must still process 0, 1, 2 in that order, each once.
#[tokio::test(start_paused = true)]
async fn a_failed_processing_turn_is_not_overtaken_by_the_senders_later_messages() {
    let llm = b_holds_for(Duration::from_secs(1));
    // The commit of b's turn that processed inbox entry 0 (it deletes the entry) is
    // refused once: that turn is rolled back, its entry stays.
    let store = GateStore::new(Arc::new(MemoryStore::new()), false);
    store.refuse_one_commit(|actor, commit| {
        let first = format!("inbox/{:020}", 0);
        actor.key() == "b"
            && commit
                .writes
                .iter()
                .any(|(key, value)| value.is_none() && *key == first)
    });
    let system = system_on(Arc::clone(&store) as Arc<dyn StateStore>, llm, 64);
    let client = system.client();
    let hold = hold_b(&system, 1).await;
    for note in 0..3 {
        client.notify_as("a", "b", &format!("note {note}")).await.unwrap();
    }
    until_answered(hold).await;
    drained(&system).await;
    assert!(
        store.refused_the_commit(),
        "note 0's processing commit was refused once"
    );
    let log = system.conversation_log("b").await.unwrap();
    assert_eq!(
        numbers_after(&log, "note "),
        [0, 1, 2],
        "b processed a's notifications in order, each once"
    );
    system.shutdown().await;
}

/// Goal: a resume whose wake-ups do not fit in the agent's own mailbox neither fails nor
/// loops. Method: every mailbox holds 2 messages; b is held by a 2 s ask with a second
/// one queued (full), so a's three notifications to b stay in a's outbox; then
/// `resume_pending` tells a to resume, which needs three wake-ups. Before 2026-11-30 the
/// third was refused `Busy`, the resume's turn failed, the rebuilt actor resumed again
/// at its next request into the same full mailbox, and so on at one instant (the
/// simulator's sweep ran out of memory on it). Now the resume goes on later, and every
/// notification is processed once, in order.
#[tokio::test(start_paused = true)]
async fn a_resume_into_a_full_mailbox_goes_on_later_instead_of_looping() {
    let llm = b_holds_for(Duration::from_secs(2));
    let system = system(llm, SMALL_MAILBOX);
    let client = system.client();
    let holds = hold_b(&system, 2).await;
    for note in 0..3 {
        let text = format!("note {note}");
        unless_busy(|| client.notify_as("a", "b", &text)).await;
    }
    assert_eq!(
        system.pending("a").await.unwrap(),
        (0, 3),
        "a's three notifications wait"
    );
    let woken = tokio::time::timeout(Duration::from_secs(5), client.resume_pending())
        .await
        .expect("resume_pending returns")
        .unwrap();
    assert!(woken >= 1, "a was told to resume");
    until_answered(holds).await;
    drained(&system).await;
    let log = system.conversation_log("b").await.unwrap();
    assert_eq!(numbers_after(&log, "note "), [0, 1, 2], "each processed once, in order");
    system.shutdown().await;
}

/// Goal: a turn whose own mailbox is full when it ends does not fail for it: the send it
/// queued is committed with it and delivered a moment later (the wake-up that starts the
/// delivery is told again from a task of its own). Before 2026-12-02 the turn failed
/// with "could not schedule inbox work: ... busy" and the send was lost with it (CI met
/// it in `notifications_to_a_busy_agent_are_processed_in_the_order_sent_on_the_multi_thread_runtime`).
/// Method: a mailbox of one message; `a`'s model notifies `b`, then takes a second for
/// its next step, during which a second ask to `a` fills its mailbox.
#[tokio::test(start_paused = true)]
async fn a_turn_whose_mailbox_is_full_at_its_end_still_sends_what_it_queued() {
    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("a").on_user_containing("first").call(
            "notify_agent",
            serde_json::json!({"agent_id": "b", "message": "hello b"}),
        ))
        .rule(
            ScriptRule::agent("a")
                .on_tool_result()
                .reply("sent")
                .latency(Duration::from_secs(1)),
        )
        .rule(ScriptRule::agent("a").reply("second answered"))
        .rule(ScriptRule::agent("b").reply("noted"));
    let system = system(llm, 1);
    let client = system.client();
    let first = tokio::spawn(async move { client.ask("a", "first").await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let client = system.client();
    let second = tokio::spawn(async move { client.ask("a", "second").await });
    let first = first.await.unwrap();
    assert_eq!(first.map(|reply| reply.text).unwrap(), "sent");
    let second = second.await.unwrap();
    assert_eq!(second.map(|reply| reply.text).unwrap(), "second answered");
    drained(&system).await;
    let log = system.conversation_log("b").await.unwrap();
    let received = log.iter().filter(|m| m.content.contains("hello b")).count();
    assert_eq!(received, 1, "b got the notification once: {log:#?}");
    system.shutdown().await;
}

/// Goal: an append during which the agent's own mailbox fills does not fail for it: the
/// entry is accepted, committed with the append, and processed once, scheduled by a
/// resume from a task of its own. Before 2026-12-02 the append failed and its sender was
/// answered `ActorFailed` ("could not schedule inbox work: ... busy") for a message the
/// inbox had room for; an agent's delivery retried it, an outside sender got the error.
/// Method: a mailbox of one message; the append of a notification from outside is held
/// at its dedupe read (`GateStore::hold_gets`) while an ask to `b` takes the mailbox's
/// one place; then the read goes on, and the append's wake-up is refused `Busy`.
async fn an_append_whose_mailbox_fills_while_it_runs_is_accepted_and_processed_once() {
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("b")
                .on_user_containing("[notification")
                .reply("noted"),
        )
        .rule(ScriptRule::agent("b").reply("answered"));
    let store = GateStore::new(Arc::new(MemoryStore::new()), false);
    let system = system_on(store.clone(), llm, 1);
    store.hold_gets(|actor, key| actor.key() == "b" && key.starts_with("seen/"));
    let client = system.client();
    let notify = tokio::spawn(async move { client.notify_with_id("b", "n1", "hello b", None).await });
    for _ in 0..HELD_WAIT.as_millis() {
        if store.held_gets() > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(store.held_gets(), 1, "the append reached its dedupe read");
    let client = system.client();
    let ask = tokio::spawn(async move { client.ask("b", "a question").await });
    // The ask waits in b's mailbox, whose one place it takes, behind the held append.
    tokio::time::sleep(Duration::from_millis(100)).await;
    store.release_gets();
    let notified = notify.await.unwrap();
    notified.expect("the notification is accepted");
    assert_eq!(ask.await.unwrap().map(|reply| reply.text).unwrap(), "answered");
    drained(&system).await;
    let log = system.conversation_log("b").await.unwrap();
    let received = log.iter().filter(|m| m.content.contains("hello b")).count();
    assert_eq!(received, 1, "b processed the notification once: {log:#?}");
    system.shutdown().await;
}

/// How long the append test waits for the append to reach its held read, at most.
const HELD_WAIT: Duration = Duration::from_secs(10);

#[tokio::test(start_paused = true)]
async fn an_append_whose_mailbox_fills_while_it_runs_is_accepted_and_processed_once_paused() {
    an_append_whose_mailbox_fills_while_it_runs_is_accepted_and_processed_once().await;
}

#[cfg(not(madsim))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_append_whose_mailbox_fills_while_it_runs_is_accepted_and_processed_once_on_the_multi_thread_runtime() {
    an_append_whose_mailbox_fills_while_it_runs_is_accepted_and_processed_once().await;
}
