//! The order dedupes ordered entries: tests that send an agent's actor crafted
//! `Enqueue`s (the places in an order a delivery could bring, in any order).

use std::sync::Arc;
use std::time::Duration;

use troupe_core::{ActorId, CallContext, Deadline};
use troupe_runtime::{MemoryStore, StateStore};

use crate::agent::agent_id;
use crate::inbox::{
    decode_reply, pair_skip_key, AgentCommand, EnqueueReply, InboxBody, InboxEntry, PairSeq, PairSkipped,
};
use crate::limits::{AGENT_DEDUPE_KEYS_KEPT_MAX, AGENT_PAIR_SKIPPED_KEPT_MS, AGENT_PAIR_SKIPPED_RANGES_MAX};
use crate::{AgentSpec, AgentSystem, Budget, ScriptRule, ScriptedLlm};

/// Agents `a` and `b` on `store`, with `llm`, and their ids.
fn agents_a_and_b(store: &Arc<MemoryStore>, llm: ScriptedLlm) -> (AgentSystem, ActorId, ActorId) {
    let system = AgentSystem::builder()
        .store(store.clone())
        .llm(Arc::new(llm))
        .agent(AgentSpec::new("a"))
        .agent(AgentSpec::new("b"))
        .start()
        .expect("the system starts");
    (system, agent_id("a").unwrap(), agent_id("b").unwrap())
}

/// Sends `b` the notification with place `seq` (and watermark `low`) in `a`'s order.
async fn enqueue(system: &AgentSystem, a: &ActorId, b: &ActorId, seq: u64, low: u64) -> EnqueueReply {
    let body = InboxBody::Notify {
        text: format!("note {seq}"),
    };
    send(system, a, b, format!("a.{seq}"), body, Some(PairSeq { seq, low })).await
}

/// Sends `b` an entry from `a`.
async fn send(
    system: &AgentSystem,
    a: &ActorId,
    b: &ActorId,
    msg_id: String,
    body: InboxBody,
    pair: Option<PairSeq>,
) -> EnqueueReply {
    let runtime = system.runtime();
    let entry = InboxEntry {
        msg_id,
        from: Some(a.clone()),
        body,
        context: CallContext::root(runtime.deadline_in(Duration::from_secs(30))),
        budget: Budget::UNLIMITED,
        pair,
    };
    let reply = runtime
        .invoke_within(b, AgentCommand::Enqueue(entry).encode(), Duration::from_secs(5))
        .await
        .expect("b answers");
    decode_reply(&reply).expect("an enqueue reply")
}

fn accepted(seq: u64) -> EnqueueReply {
    EnqueueReply::Accepted {
        msg_id: format!("a.{seq}"),
    }
}

/// Goal: an ordered entry that comes again is `Duplicate` if it was taken and `Stale`
/// if it was skipped (its sender gave it up and a later one went in), with no dedupe
/// mark written or read, also after the receiver was deactivated (the skipped numbers
/// are stored); each taken entry is processed once.
#[tokio::test(start_paused = true)]
async fn ordered_entries_are_deduplicated_by_their_order_without_a_mark() {
    let store = Arc::new(MemoryStore::new());
    let llm = ScriptedLlm::new().rule(ScriptRule::agent("b").on_user_containing("note").reply("noted"));
    let (system, a, b) = agents_a_and_b(&store, llm);
    assert_eq!(enqueue(&system, &a, &b, 0, 0).await, accepted(0));
    assert_eq!(enqueue(&system, &a, &b, 0, 0).await, EnqueueReply::Duplicate);
    // 1 and 2 given up by a: 3 is its lowest pending entry.
    assert_eq!(enqueue(&system, &a, &b, 3, 3).await, accepted(3));
    assert_eq!(
        enqueue(&system, &a, &b, 1, 1).await,
        EnqueueReply::Stale { expected: 4 }
    );
    assert_eq!(
        enqueue(&system, &a, &b, 2, 1).await,
        EnqueueReply::Stale { expected: 4 }
    );
    assert_eq!(enqueue(&system, &a, &b, 3, 3).await, EnqueueReply::Duplicate);
    assert_eq!(
        enqueue(&system, &a, &b, 5, 4).await,
        EnqueueReply::OutOfOrder { expected: 4 }
    );
    assert_eq!(enqueue(&system, &a, &b, 4, 4).await, accepted(4));
    // 5 and 6 given up: their range is stored apart from 1 and 2's.
    assert_eq!(enqueue(&system, &a, &b, 7, 7).await, accepted(7));
    assert!(system.runtime().deactivate(&b).await.unwrap(), "b was active");
    assert_eq!(
        enqueue(&system, &a, &b, 2, 2).await,
        EnqueueReply::Stale { expected: 8 }
    );
    assert_eq!(
        enqueue(&system, &a, &b, 6, 5).await,
        EnqueueReply::Stale { expected: 8 }
    );
    for taken in [0, 3, 4, 7] {
        assert_eq!(enqueue(&system, &a, &b, taken, taken).await, EnqueueReply::Duplicate);
    }
    // Neither kind of mark (`seen/`, `seen_own/`).
    let marks = store.scan(&b, "seen", None, 100).await.unwrap();
    assert!(marks.is_empty(), "no dedupe marks: {marks:?}");
    let skipped = store.get(&b, &pair_skip_key(&a)).await.unwrap().expect("stored");
    let skipped: PairSkipped = serde_json::from_slice(&skipped).unwrap();
    let ranges: Vec<(u64, u64)> = skipped.ranges.iter().map(|range| (range.start, range.end)).collect();
    assert_eq!(ranges, [(1, 3), (5, 7)]);
    tokio::time::sleep(Duration::from_secs(20)).await;
    let log = system.conversation_log("b").await.unwrap();
    for seq in [0, 3, 4, 7] {
        let note = format!("note {seq}");
        let times = log.iter().filter(|message| message.content.contains(&note)).count();
        assert_eq!(times, 1, "{note} processed once: {log:?}");
    }
    for seq in [1, 2, 5, 6] {
        let note = format!("note {seq}");
        assert!(
            !log.iter().any(|message| message.content.contains(&note)),
            "{note} never taken"
        );
    }
    system.shutdown().await;
}

/// Goal: a task deduplicated by its order keeps no mark; a cancellation that arrives
/// after the task was worked leaves it worked once, and the task sent again is a
/// `Duplicate`, not canceled (the tombstone the cancellation leaves, not knowing the
/// task came, is never taken: docs/architecture.md, "The order dedupes").
#[tokio::test(start_paused = true)]
async fn a_cancellation_after_its_task_was_worked_changes_nothing() {
    let store = Arc::new(MemoryStore::new());
    let llm = ScriptedLlm::new()
        .rule(ScriptRule::agent("b").on_user_containing("crunch").reply("crunched"))
        .rule(ScriptRule::agent("a").on_user_containing("task").reply("seen"));
    let (system, a, b) = agents_a_and_b(&store, llm);
    let task = || InboxBody::Task {
        task_id: "a.0".to_string(),
        text: "crunch it".to_string(),
    };
    let first = send(&system, &a, &b, "a.0".into(), task(), Some(PairSeq { seq: 0, low: 0 })).await;
    assert_eq!(first, EnqueueReply::Accepted { msg_id: "a.0".into() });
    tokio::time::sleep(Duration::from_secs(20)).await;
    let cancel = InboxBody::Cancel {
        task_id: "a.0".to_string(),
    };
    let canceled = send(&system, &a, &b, "a.1".into(), cancel, None).await;
    assert_eq!(canceled, EnqueueReply::Accepted { msg_id: "a.1".into() });
    let again = send(&system, &a, &b, "a.0".into(), task(), Some(PairSeq { seq: 0, low: 0 })).await;
    assert_eq!(again, EnqueueReply::Duplicate);
    tokio::time::sleep(Duration::from_secs(20)).await;
    let log = system.conversation_log("b").await.unwrap();
    let worked = log
        .iter()
        .filter(|message| message.content.contains("crunch it"))
        .count();
    assert_eq!(worked, 1, "the task worked once: {log:?}");
    for mark in ["seen/a.0", "seen_own/a.0"] {
        assert!(store.get(&b, mark).await.unwrap().is_none(), "no mark for the task");
    }
    assert_eq!(system.pending("b").await.unwrap(), (0, 0));
    system.shutdown().await;
}

/// Goal: an agent keeps its newest [`AGENT_DEDUPE_KEYS_KEPT_MAX`] dedupe keys (marks
/// of the messages that need one, tombstones of cancellations that found no task), no
/// more: a copy of a message whose mark is kept is `Duplicate`, a copy of an older one
/// is taken again. Method: cancellations of tasks that never came (each writes a mark
/// and a tombstone, and none runs a model turn).
#[tokio::test(start_paused = true)]
async fn an_agent_keeps_its_newest_dedupe_keys_only() {
    let store = Arc::new(MemoryStore::new());
    let (system, a, b) = agents_a_and_b(&store, ScriptedLlm::new());
    let (running, a, b) = (&system, &a, &b);
    let cancel = |n: u64| async move {
        let body = InboxBody::Cancel {
            task_id: format!("gone.{n}"),
        };
        send(running, a, b, format!("c-{n}"), body, None).await
    };
    let over = 10;
    let kept_cancellations = AGENT_DEDUPE_KEYS_KEPT_MAX / 2; // two keys each
    for n in 0..kept_cancellations + over {
        assert_eq!(
            cancel(n).await,
            EnqueueReply::Accepted {
                msg_id: format!("c-{n}")
            }
        );
    }
    let limit = usize::try_from(AGENT_DEDUPE_KEYS_KEPT_MAX).unwrap() + 10;
    let marks = store.scan(b, "seen_own/", None, limit).await.unwrap();
    let tombstones = store.scan(b, "canceled/", None, limit).await.unwrap();
    let kept = usize::try_from(kept_cancellations).unwrap();
    assert_eq!((marks.len(), tombstones.len()), (kept, kept));
    let newest = kept_cancellations + over - 1;
    assert_eq!(cancel(newest).await, EnqueueReply::Duplicate);
    assert_eq!(cancel(over).await, EnqueueReply::Duplicate, "the oldest kept");
    assert_eq!(
        cancel(over - 1).await,
        EnqueueReply::Accepted {
            msg_id: format!("c-{}", over - 1)
        },
        "the newest one let go is taken again"
    );
    system.shutdown().await;
}

/// Goal: skipped ranges merge when they touch (the merged range dated by its newest
/// part), and a number is skipped only inside one.
#[test]
fn skipped_ranges_merge_when_they_touch() {
    let at = Deadline::from_micros;
    let mut skipped = PairSkipped::default();
    skipped.add(2..4, at(1));
    skipped.add(4..6, at(2));
    skipped.add(7..7, at(3));
    skipped.add(9..10, at(4));
    let ranges: Vec<(u64, u64, u64)> = skipped
        .ranges
        .iter()
        .map(|range| (range.start, range.end, range.recorded_us))
        .collect();
    assert_eq!(ranges, [(2, 6, 2), (9, 10, 4)]);
    let inside: Vec<u64> = (0..12).filter(|seq| skipped.contains(*seq)).collect();
    assert_eq!(inside, [2, 3, 4, 5, 9]);
}

/// Goal: a sender that gives up entries faster than their ranges age out leaves at most
/// [`AGENT_PAIR_SKIPPED_RANGES_MAX`] ranges, the newest; a range is dropped once it is
/// [`AGENT_PAIR_SKIPPED_KEPT_MS`] old, not a microsecond before.
#[test]
fn skipped_ranges_are_bounded_in_number_and_in_age() {
    let mut skipped = PairSkipped::default();
    let count = AGENT_PAIR_SKIPPED_RANGES_MAX as u64 + 5;
    for gap in 0..count {
        skipped.add(2 * gap..2 * gap + 1, Deadline::from_micros(gap));
    }
    assert_eq!(skipped.ranges.len(), AGENT_PAIR_SKIPPED_RANGES_MAX);
    assert_eq!(skipped.ranges[0].start, 10, "the five oldest dropped");
    assert!(skipped.contains(2 * (count - 1)));
    let kept_us = AGENT_PAIR_SKIPPED_KEPT_MS * 1_000;
    let newest = count - 1;
    skipped.add(2 * count..2 * count + 1, Deadline::from_micros(newest + kept_us - 1));
    assert!(skipped.contains(2 * newest), "not yet as old as the retention");
    assert_eq!(skipped.ranges.len(), 2);
    skipped.add(2 * count + 2..2 * count + 3, Deadline::from_micros(newest + kept_us));
    assert!(!skipped.contains(2 * newest), "as old as the retention: dropped");
    assert_eq!(skipped.ranges.len(), 2);
}

/// Goal: a record stored before the ranges were dated (`[start, end]`) still reads, its
/// ranges as recorded at 0; it is stored dated.
#[test]
fn skipped_ranges_stored_undated_still_load() {
    let skipped: PairSkipped = serde_json::from_str(r#"{"ranges":[[1,3],[5,7]]}"#).unwrap();
    assert!(skipped.contains(2) && skipped.contains(6) && !skipped.contains(4));
    assert!(skipped.ranges.iter().all(|range| range.recorded_us == 0));
    let stored = serde_json::to_string(&skipped).unwrap();
    assert_eq!(stored, r#"{"ranges":[[1,3,0],[5,7,0]]}"#);
    assert_eq!(serde_json::from_str::<PairSkipped>(&stored).unwrap(), skipped);
}

/// Goal: a receiver's record of the numbers it skipped from one sender stays bounded
/// however many entries that sender gives up: a skipped range is kept only while an
/// attempt of a number in it can still come
/// ([`crate::limits::AGENT_PAIR_SKIPPED_KEPT_MS`]), and the order is kept all the while
/// (an entry taken is `Duplicate` when it comes again, one skipped lately `Stale`).
/// Method: crafted `Enqueue`s in which every other number of `a`'s order was given up
/// (each taken entry jumps a gap), a round of them, then virtual time past the
/// retention, then another round, and so once more: the stored record holds the
/// newest round's ranges only, and does not grow from one round to the next.
///
/// Normal build only (tokio's paused clock): its three retentions are about 1,000
/// virtual seconds, and the simulator's sweep (`scripts/dst`) stops any seed at 600 as a
/// hang. The order's dedupe is checked in both builds by the other tests here.
#[cfg(not(madsim))]
#[tokio::test(start_paused = true)]
async fn skipped_numbers_are_kept_only_while_an_attempt_of_them_can_still_come() {
    let store = Arc::new(MemoryStore::new());
    let llm = ScriptedLlm::new().rule(ScriptRule::agent("b").on_user_containing("note").reply("noted"));
    let (system, a, b) = agents_a_and_b(&store, llm);
    let gaps_per_round: u64 = 40;
    let stored = || async {
        let bytes = store.get(&b, &pair_skip_key(&a)).await.unwrap().expect("stored");
        let value: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        (bytes.len(), value["ranges"].as_array().expect("ranges").len())
    };
    let mut next = 0;
    let mut sizes = Vec::new();
    for round in 0..3 {
        for _ in 0..gaps_per_round {
            // `next` was given up: `next + 1` is taken past it.
            let taken = next + 1;
            assert_eq!(enqueue(&system, &a, &b, taken, taken).await, accepted(taken));
            next = taken + 1;
        }
        let (bytes, ranges) = stored().await;
        assert_eq!(
            ranges,
            usize::try_from(gaps_per_round).unwrap(),
            "round {round}: the ranges of this round only"
        );
        sizes.push(bytes);
        // The order still dedupes: the newest taken entry is a duplicate, the newest
        // skipped one stale.
        assert_eq!(
            enqueue(&system, &a, &b, next - 1, next - 1).await,
            EnqueueReply::Duplicate
        );
        assert_eq!(
            enqueue(&system, &a, &b, next - 2, next - 2).await,
            EnqueueReply::Stale { expected: next }
        );
        tokio::time::sleep(Duration::from_millis(AGENT_PAIR_SKIPPED_KEPT_MS + 1_000)).await;
    }
    // Rounds 1 and 2 store times of as many digits; their numbers may take a digit more.
    let slack = 2 * usize::try_from(gaps_per_round).unwrap();
    assert!(
        sizes[2] <= sizes[1] + slack,
        "the stored record does not grow from one round to the next: {sizes:?}"
    );
    system.shutdown().await;
}
