//! An agent's saved state and conversation log: the counters it commits after each
//! turn ([`SavedAgent`]), the log and the bounded window of recent messages read back
//! from it.
//!
//! **The log.** Message `n` of an agent's log is the `n`th (from 0) of every message its
//! committed turns wrote. A turn writes its messages as one entry (more only past
//! [`AGENT_LOG_ENTRY_CLOSE_BYTES`]): a JSON array of them, or a single message alone as
//! a JSON object (the form of every entry written before 2026-11-29, which read back as
//! before). An entry's key is `log/` and the number of its *last* message as twenty
//! digits (`log/{seq:020}`), so keys sort in log order, and the entry that holds message
//! `n` is the first whose key is at least `log/{n:020}`: a scan after the key of `n - 1`
//! starts at it. One entry per turn rather than per message saves a key, a value and a
//! store row for each message but the first (a `call_agent` round trip wrote six
//! entries, now two).

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use troupe_runtime::{ActorError, StoreError, Turn};

use crate::json_text::{chat_message_capacity, push_chat_message};
use crate::limits::{AGENT_HISTORY_WINDOW_MAX, AGENT_HISTORY_WINDOW_MIN, AGENT_LOG_ENTRY_CLOSE_BYTES};
use crate::{AgentSpec, ChatMessage, Prompt, Role};

/// An agent in memory: its definition, the recent conversation (the window: the last
/// messages of its log) and how long its full log is.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct AgentState {
    pub(crate) spec: AgentSpec,
    /// Shared with the model requests that show it (see [`Prompt`]).
    pub(crate) window: Prompt,
    /// Whether `window` holds the log's last `saved_window` messages yet: after an
    /// activation it is read from the log at the first turn.
    window_loaded: bool,
    /// The window's length when the state was loaded.
    saved_window: u64,
    pub(crate) log_length: u64,
    pub(crate) turns: u64,
    pub(crate) boxes: BoxCounters,
}

/// The counters of an agent's inbox and outbox (see `inbox.rs`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct BoxCounters {
    /// The seq of the next inbox entry.
    #[serde(default)]
    pub(crate) inbox_next: u64,
    /// Entries in the inbox.
    #[serde(default)]
    pub(crate) inbox_len: u64,
    /// The seq of the next outbox entry (also names message and task ids).
    #[serde(default)]
    pub(crate) outbox_next: u64,
    /// Entries in the outbox.
    #[serde(default)]
    pub(crate) outbox_len: u64,
    /// Delegations not yet resolved.
    #[serde(default)]
    pub(crate) tasks_open: u64,
    /// External tasks (`external.rs`) not yet ended.
    #[serde(default)]
    pub(crate) external_open: u64,
    /// Dedupe marks written into the window of kept marks, ever: the next one takes
    /// slot `dedupe_next % AGENT_DEDUPE_KEYS_KEPT_MAX` (`inbox_turns.rs`: `keep_in_window`).
    #[serde(default)]
    pub(crate) dedupe_next: u64,
}

/// What an agent commits after each turn: counters only. The definition comes from
/// the directory, and the window is the tail of the log (each message is already
/// committed there, once), so a turn's snapshot costs a few bytes, not the whole chat.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SavedAgent {
    pub(crate) log_length: u64,
    pub(crate) turns: u64,
    /// How many of the log's last messages make up the window.
    pub(crate) window: u64,
    /// Inbox and outbox counters.
    #[serde(default)]
    pub(crate) boxes: BoxCounters,
}

impl SavedAgent {
    pub(crate) fn decode(bytes: &[u8]) -> Result<Self, String> {
        serde_json::from_slice(bytes).map_err(|error| error.to_string())
    }

    /// The snapshot's bytes: exactly the JSON `serde_json::to_vec` writes (tested),
    /// written directly, as every turn commits one.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let boxes = &self.boxes;
        let mut out = Vec::with_capacity(SAVED_AGENT_JSON_CAPACITY_BYTES);
        let mut digits = itoa::Buffer::new();
        // Written out field by field, not in a loop over (prefix, value) pairs: each
        // prefix's length is then a constant, copied inline rather than by a call to
        // `memcpy` (eighteen per snapshot).
        let mut field = |out: &mut Vec<u8>, prefix: &[u8], value: u64| {
            out.extend_from_slice(prefix);
            out.extend_from_slice(digits.format(value).as_bytes());
        };
        field(&mut out, b"{\"log_length\":", self.log_length);
        field(&mut out, b",\"turns\":", self.turns);
        field(&mut out, b",\"window\":", self.window);
        field(&mut out, b",\"boxes\":{\"inbox_next\":", boxes.inbox_next);
        field(&mut out, b",\"inbox_len\":", boxes.inbox_len);
        field(&mut out, b",\"outbox_next\":", boxes.outbox_next);
        field(&mut out, b",\"outbox_len\":", boxes.outbox_len);
        field(&mut out, b",\"tasks_open\":", boxes.tasks_open);
        field(&mut out, b",\"external_open\":", boxes.external_open);
        field(&mut out, b",\"dedupe_next\":", boxes.dedupe_next);
        out.extend_from_slice(b"}}");
        out
    }

    /// The number of the window's first message in the log.
    pub(crate) fn window_start(&self) -> u64 {
        self.log_length - self.window.min(self.log_length)
    }

    /// The log key after which the window's entries start (`None`: at the log's start).
    pub(crate) fn window_after(&self) -> Option<String> {
        self.window_start().checked_sub(1).map(log_key)
    }
}

impl AgentState {
    pub(crate) fn new(spec: AgentSpec, saved: Option<SavedAgent>) -> Self {
        let saved = saved.unwrap_or(SavedAgent {
            log_length: 0,
            turns: 0,
            window: 0,
            boxes: BoxCounters::default(),
        });
        Self {
            spec,
            window: Prompt::new(),
            window_loaded: saved.window == 0,
            saved_window: saved.window,
            log_length: saved.log_length,
            turns: saved.turns,
            boxes: saved.boxes,
        }
    }

    pub(crate) fn saved(&self) -> SavedAgent {
        SavedAgent {
            log_length: self.log_length,
            turns: self.turns,
            window: self.window.len() as u64,
            boxes: self.boxes,
        }
    }

    /// Reads the window from the log, once per activation.
    pub(crate) async fn load_window(&mut self, turn: &Turn) -> Result<(), ActorError> {
        if self.window_loaded {
            return Ok(());
        }
        let saved = SavedAgent {
            log_length: self.log_length,
            turns: self.turns,
            window: self.saved_window,
            boxes: self.boxes,
        };
        let after = saved.window_after();
        // An entry holds at least one message: as many entries as messages is enough.
        let limit = usize::try_from(saved.window).unwrap_or(usize::MAX);
        let page = turn.scan("log/", after.as_deref(), limit).await?;
        let window = window_messages(page, saved.window_start()).map_err(ActorError::failed)?;
        self.window = Prompt::from(window);
        self.window_loaded = true;
        Ok(())
    }

    /// Buffers `messages` in `turn` as the log's next entries (see the module doc) and
    /// counts them in `log_length`.
    ///
    /// # Errors
    /// As [`Turn::put`].
    pub(crate) fn append_log(&mut self, turn: &mut Turn, messages: &Prompt) -> Result<(), StoreError> {
        let mut entry = Vec::new();
        let mut in_entry = 0_usize;
        let mut rest = messages
            .iter()
            .map(|message| 1 + chat_message_capacity(message))
            .sum::<usize>();
        for message in messages.iter() {
            if in_entry > 0 && entry.len() >= AGENT_LOG_ENTRY_CLOSE_BYTES {
                turn.put(
                    log_key(self.log_length - 1),
                    close_log_entry(std::mem::take(&mut entry), in_entry),
                )?;
                in_entry = 0;
            }
            if in_entry == 0 {
                entry.reserve(2 + rest.min(AGENT_LOG_ENTRY_CLOSE_BYTES));
                entry.push(b'[');
            } else {
                entry.push(b',');
            }
            rest = rest.saturating_sub(1 + chat_message_capacity(message));
            // serde_json's encoding, written directly (see `json_text`).
            push_chat_message(&mut entry, message);
            in_entry += 1;
            self.log_length += 1;
        }
        if in_entry > 0 {
            turn.put(log_key(self.log_length - 1), close_log_entry(entry, in_entry))?;
        }
        Ok(())
    }

    /// Appends `messages`, keeps the last [`AgentSpec::history`] (at most
    /// [`AGENT_HISTORY_WINDOW_MAX`]), and never starts the window in the middle of an
    /// exchange (a tool result without its call). The messages are shared with
    /// `messages`, not copied (but for a part the window's start cuts in two).
    pub(crate) fn remember(&mut self, messages: &Prompt) {
        self.window.extend_listed(messages);
        self.fit_window();
    }

    /// Cuts the window to the last [`AgentSpec::history`] messages (at most
    /// [`AGENT_HISTORY_WINDOW_MAX`]), starting at a user message: after each turn, and
    /// when a turn takes the directory's definition (always the first turn of an
    /// activation, after the window was read back), so that a smaller window is what
    /// the model sees from that turn on.
    pub(crate) fn fit_window(&mut self) {
        let kept = self
            .spec
            .history
            .clamp(AGENT_HISTORY_WINDOW_MIN, AGENT_HISTORY_WINDOW_MAX);
        if self.window.len() > kept {
            let excess = self.window.len() - kept;
            self.window.remove_first(excess);
        }
        let first_user = self
            .window
            .iter()
            .position(|m| m.role == Role::User)
            .unwrap_or(self.window.len());
        self.window.remove_first(first_user);
        assert!(self.window.len() <= kept);
    }
}

/// Room for an encoded [`SavedAgent`] with ten 20-digit counters, in bytes (the
/// field names and punctuation take 144).
const SAVED_AGENT_JSON_CAPACITY_BYTES: usize = 352;

/// The key of entry `seq` of the conversation log.
pub(crate) fn log_key(seq: u64) -> String {
    seq_key("log/", seq)
}

/// An entry of `in_entry` messages written after its `[`: the array closed, or a single
/// message alone. (A conversation's recorded exchange is written the same way.)
pub(crate) fn close_log_entry(mut entry: Vec<u8>, in_entry: usize) -> Bytes {
    if in_entry == 1 {
        Bytes::from(entry).slice(1..)
    } else {
        entry.push(b']');
        Bytes::from(entry)
    }
}

/// The messages of one log entry: a JSON array of them, or one message alone. (A
/// conversation's entries are read the same way.)
///
/// # Errors
/// `serde_json`'s, when the entry is neither.
pub(crate) fn decode_log_entry<M: serde::de::DeserializeOwned>(entry: &[u8]) -> Result<Vec<M>, serde_json::Error> {
    if entry.first() == Some(&b'[') {
        serde_json::from_slice(entry)
    } else {
        serde_json::from_slice(entry).map(|message| vec![message])
    }
}

/// The number of the last message of the entry at `key`.
fn log_key_seq(key: &str) -> Option<u64> {
    key.strip_prefix("log/")?.parse().ok()
}

/// The messages from number `start` on, of log entries read in key order from the
/// first that holds message `start` (a scan after the key of `start - 1`).
///
/// # Errors
/// What is wrong with an entry that cannot be decoded, or whose key is not a message
/// number at least its message count minus one.
pub(crate) fn window_messages(entries: Vec<(String, Bytes)>, start: u64) -> Result<Vec<ChatMessage>, String> {
    let mut window = Vec::new();
    for (key, value) in entries {
        let messages: Vec<ChatMessage> =
            decode_log_entry(&value).map_err(|error| format!("log entry {key} cannot be decoded: {error}"))?;
        // The entry holds messages `first..=last` (`last - (len - 1)`, so that an entry
        // ending at `u64::MAX` does not overflow; an empty entry adds nothing).
        let first = log_key_seq(&key)
            .and_then(|last| last.checked_sub((messages.len() as u64).saturating_sub(1)))
            .ok_or_else(|| {
                format!(
                    "log entry {key} does not end at a message number its {} messages fit",
                    messages.len()
                )
            })?;
        let skip = usize::try_from(start.saturating_sub(first)).unwrap_or(usize::MAX);
        window.extend(messages.into_iter().skip(skip));
    }
    Ok(window)
}

/// `format!("{prefix}{seq:020}")` without the formatting machinery (a key per message
/// written: about 500 instructions each through `format!`, and still about 500 with a
/// division per digit): `itoa`'s digits after the zeros that pad them.
pub(crate) fn seq_key(prefix: &str, seq: u64) -> String {
    const ZEROS: &str = "00000000000000000000";
    let mut digits = itoa::Buffer::new();
    let digits = digits.format(seq);
    let mut key = String::with_capacity(prefix.len() + LOG_SEQ_DIGITS);
    key.push_str(prefix);
    key.push_str(&ZEROS[..LOG_SEQ_DIGITS - digits.len()]);
    key.push_str(digits);
    key
}

/// The digits of a log key's seq: every `u64` fits, so keys sort in seq order.
const LOG_SEQ_DIGITS: usize = 20;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::AGENT_HISTORY_WINDOW_DEFAULT;
    use crate::ToolCall;

    fn numbered(numbers: std::ops::RangeInclusive<u64>) -> Vec<ChatMessage> {
        numbers
            .map(|number| ChatMessage::new(Role::User, number.to_string()))
            .collect()
    }

    fn array_entry(last: u64, messages: &[ChatMessage]) -> (String, Bytes) {
        (log_key(last), Bytes::from(serde_json::to_vec(messages).unwrap()))
    }

    fn object_entry(number: u64) -> (String, Bytes) {
        let message = ChatMessage::new(Role::User, number.to_string());
        (log_key(number), Bytes::from(serde_json::to_vec(&message).unwrap()))
    }

    /// A window that starts inside an entry (a turn split at the entry size, or an
    /// entry of any later form) takes only the messages from its start; entries of
    /// either form mix.
    #[test]
    fn the_window_takes_messages_from_its_start_within_an_entry() {
        // Messages 0..=4 in one entry, 5 alone (the old form), 6..=8 in one entry.
        let entries = || {
            vec![
                array_entry(4, &numbered(0..=4)),
                object_entry(5),
                array_entry(8, &numbered(6..=8)),
            ]
        };
        for start in 0..=8_u64 {
            // What a scan after the key of `start - 1` returns.
            let scanned: Vec<_> = entries()
                .into_iter()
                .filter(|(key, _)| *key >= log_key(start))
                .collect();
            let window = window_messages(scanned, start).unwrap();
            let expected: Vec<String> = (start..=8).map(|number| number.to_string()).collect();
            let got: Vec<String> = window.into_iter().map(|message| message.content).collect();
            assert_eq!(got, expected, "window from {start}");
        }
    }

    #[test]
    fn an_entry_that_ends_at_the_last_message_number_is_read_without_overflow() {
        let last = u64::MAX;
        let entries = || vec![array_entry(last, &numbered(0..=1))];
        let got = |start| -> Vec<String> {
            let window = window_messages(entries(), start).unwrap();
            window.into_iter().map(|message| message.content).collect()
        };
        assert_eq!(got(last - 1), ["0", "1"]);
        assert_eq!(got(last), ["1"]);
        assert!(window_messages(vec![array_entry(last, &[])], 0).unwrap().is_empty());
    }

    #[test]
    fn an_entry_that_does_not_fit_its_key_is_an_error_naming_it() {
        // Three messages cannot end at message 1.
        let error = window_messages(vec![array_entry(1, &numbered(0..=2))], 0).unwrap_err();
        assert!(error.contains(&log_key(1)) && error.contains("3 messages"), "{error}");
        let error = window_messages(vec![("log/x".to_string(), Bytes::from_static(b"[]"))], 0).unwrap_err();
        assert!(error.contains("log/x"), "{error}");
        let error = window_messages(vec![(log_key(0), Bytes::from_static(b"{"))], 0).unwrap_err();
        assert!(error.contains("cannot be decoded"), "{error}");
    }

    proptest::proptest! {
        /// The snapshot written directly is byte for byte serde_json's, and decodes back.
        #[test]
        fn a_snapshot_is_encoded_as_serde_json_writes_it(
            counters in proptest::array::uniform10(proptest::prop_oneof![proptest::num::u64::ANY, 0u64..1_000]),
        ) {
            let [log_length, turns, window, inbox_next, inbox_len, outbox_next, outbox_len, tasks_open, external_open, dedupe_next] = counters;
            let saved = SavedAgent {
                log_length,
                turns,
                window,
                boxes: BoxCounters { inbox_next, inbox_len, outbox_next, outbox_len, tasks_open, external_open, dedupe_next },
            };
            let encoded = saved.encode();
            proptest::prop_assert_eq!(&encoded, &serde_json::to_vec(&saved).unwrap());
            proptest::prop_assert!(encoded.len() <= SAVED_AGENT_JSON_CAPACITY_BYTES);
            proptest::prop_assert_eq!(SavedAgent::decode(&encoded).unwrap(), saved);
        }
    }

    #[test]
    fn log_keys_are_zero_padded_to_twenty_digits() {
        let powers = (0..20).flat_map(|power| [10_u64.pow(power), 10_u64.pow(power) - 1]);
        for seq in [0, 7, 10, 12_345, u64::MAX / 3, u64::MAX].into_iter().chain(powers) {
            assert_eq!(log_key(seq), format!("log/{seq:020}"));
            assert_eq!(seq_key("relay/", seq), format!("relay/{seq:020}"));
        }
        assert!(log_key(9) < log_key(10));
    }

    #[test]
    fn the_window_stays_bounded_and_starts_at_a_user_message() {
        let mut state = AgentState::new(AgentSpec::new("a"), None);
        for turn in 0..100 {
            let mut assistant = ChatMessage::new(Role::Assistant, "");
            assistant.tool_calls.push(ToolCall {
                id: format!("c{turn}"),
                name: "t".into(),
                arguments: serde_json::json!({}),
            });
            state.remember(&Prompt::from(vec![
                ChatMessage::new(Role::User, format!("q{turn}")),
                assistant,
                ChatMessage::tool_result(format!("c{turn}"), "r"),
                ChatMessage::new(Role::Assistant, format!("a{turn}")),
            ]));
            assert!(state.window.len() <= AGENT_HISTORY_WINDOW_DEFAULT);
            assert_eq!(state.window[0].role, Role::User);
        }
        assert_eq!(state.window.last().unwrap().content, "a99");
    }

    /// The window as it was kept before it was shared: a `Vec`, extended with copies.
    fn remember_copied(window: &mut Vec<ChatMessage>, messages: &[ChatMessage]) {
        window.extend_from_slice(messages);
        if window.len() > AGENT_HISTORY_WINDOW_DEFAULT {
            let excess = window.len() - AGENT_HISTORY_WINDOW_DEFAULT;
            window.drain(..excess);
        }
        let first_user = window.iter().position(|m| m.role == Role::User).unwrap_or(window.len());
        window.drain(..first_user);
    }

    proptest::proptest! {
        /// Over random turns (any roles, split into parts of any sizes, some longer than
        /// the window), the shared window holds exactly the messages the copied one did.
        #[test]
        fn the_shared_window_keeps_what_the_copied_window_kept(
            turns in proptest::collection::vec(
                proptest::collection::vec((0u8..4, 1usize..4), 1..12),
                1..40,
            ),
        ) {
            let mut state = AgentState::new(AgentSpec::new("a"), None);
            let mut copied = Vec::new();
            let mut seq = 0;
            for turn in turns {
                let mut fresh = Prompt::new();
                let mut all = Vec::new();
                for (role, size) in turn {
                    let role = [Role::System, Role::User, Role::Assistant, Role::Tool][usize::from(role)];
                    let part: Vec<ChatMessage> = (0..size)
                        .map(|_| {
                            seq += 1;
                            ChatMessage::new(role, format!("m{seq}"))
                        })
                        .collect();
                    all.extend(part.iter().cloned());
                    fresh.push_part(part.into());
                }
                state.remember(&fresh);
                remember_copied(&mut copied, &all);
                proptest::prop_assert_eq!(&state.window, &copied);
                proptest::prop_assert_eq!(state.window.parts().map(|part| part.len()).sum::<usize>(), copied.len());
                proptest::prop_assert!(state.window.parts().all(|part| !part.is_empty()));
            }
        }
    }
}
