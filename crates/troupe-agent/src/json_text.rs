//! JSON written by hand where the agent layer writes it per message: the log's chat
//! messages and the conversations' messages. The output is `serde_json`'s, byte for byte (property-tested below), so
//! stored entries read back through `serde_json` as before and nothing on disk changes.
//!
//! Why by hand: `serde_json` escapes a string a byte at a time through a table, and goes
//! through its serializer's state for each field; a `call_agent` round trip writes six
//! log messages (about 8,500 instructions of 148,000, callgrind, 2026-11-29). A string
//! here is checked eight bytes at a time for anything JSON escapes, and copied whole
//! when there is nothing (the usual case); one that needs escapes is left to
//! `serde_json`.

use crate::conversation::{ConversationMessage, Sender};
use crate::llm::{ChatMessage, Role};

/// Bytes of a message's encoding besides its strings and arguments: field names and
/// punctuation (about 60), for the buffer's first allocation.
const CHAT_MESSAGE_JSON_OVERHEAD_BYTES: usize = 96;

/// `message` as `serde_json::to_vec` writes it.
#[cfg(test)]
pub(crate) fn chat_message(message: &ChatMessage) -> Vec<u8> {
    let mut out = Vec::with_capacity(chat_message_capacity(message));
    push_chat_message(&mut out, message);
    out
}

/// Room for `message`'s encoding, for a buffer's allocation: its strings and the field
/// names (a tool call's arguments are not counted).
pub(crate) fn chat_message_capacity(message: &ChatMessage) -> usize {
    let strings = message.content.len()
        + message.tool_call_id.as_ref().map_or(0, String::len)
        + message
            .tool_calls
            .iter()
            .map(|call| call.id.len() + call.name.len() + CHAT_MESSAGE_JSON_OVERHEAD_BYTES)
            .sum::<usize>();
    CHAT_MESSAGE_JSON_OVERHEAD_BYTES + strings
}

/// Appends `message` as `serde_json::to_vec` writes it to `out`.
pub(crate) fn push_chat_message(out: &mut Vec<u8>, message: &ChatMessage) {
    out.extend_from_slice(b"{\"role\":\"");
    out.extend_from_slice(match message.role {
        Role::System => b"System".as_slice(),
        Role::User => b"User",
        Role::Assistant => b"Assistant",
        Role::Tool => b"Tool",
    });
    out.extend_from_slice(b"\",\"content\":");
    push_string(out, &message.content);
    out.extend_from_slice(b",\"tool_calls\":[");
    for (index, call) in message.tool_calls.iter().enumerate() {
        if index > 0 {
            out.push(b',');
        }
        out.extend_from_slice(b"{\"id\":");
        push_string(out, &call.id);
        out.extend_from_slice(b",\"name\":");
        push_string(out, &call.name);
        out.extend_from_slice(b",\"arguments\":");
        // A `Value` always encodes, into a `Vec` nothing can fail.
        serde_json::to_writer(&mut *out, &call.arguments).expect("a JSON value encodes into a Vec");
        out.push(b'}');
    }
    out.extend_from_slice(b"],\"tool_call_id\":");
    match &message.tool_call_id {
        Some(id) => push_string(out, id),
        None => out.extend_from_slice(b"null"),
    }
    out.push(b'}');
}

/// `message` as `serde_json::to_vec` writes it: a conversation's stored message (two per
/// recorded `call_agent` exchange). A system note's subject is left to `serde_json`.
pub(crate) fn conversation_message(message: &ConversationMessage) -> Vec<u8> {
    let mut out = Vec::new();
    push_conversation_message(&mut out, message);
    out
}

/// Room for `message`'s encoding, for a buffer's allocation.
fn conversation_message_capacity(message: &ConversationMessage) -> usize {
    conversation_message_room(&message.sender, &message.text, &message.mentions, &message.chain)
}

/// Room for the encoding of a conversation message with these fields, for a buffer's
/// allocation.
pub(crate) fn conversation_message_room(sender: &Sender, text: &str, mentions: &[String], chain: &[String]) -> usize {
    let strings = text.len()
        + mentions.iter().chain(chain).map(|name| name.len() + 3).sum::<usize>()
        + match sender {
            Sender::Agent(name) | Sender::Human(name) => name.len(),
            Sender::System => 0,
        };
    CONVERSATION_MESSAGE_JSON_OVERHEAD_BYTES + strings
}

/// Appends `message` as `serde_json::to_vec` writes it to `out`.
pub(crate) fn push_conversation_message(out: &mut Vec<u8>, message: &ConversationMessage) {
    out.reserve(conversation_message_capacity(message));
    let mut digits = itoa::Buffer::new();
    out.extend_from_slice(b"{\"seq\":");
    out.extend_from_slice(digits.format(message.seq).as_bytes());
    out.extend_from_slice(b",\"sender\":");
    match &message.sender {
        Sender::Agent(name) => {
            out.extend_from_slice(b"{\"Agent\":");
            push_string(out, name);
            out.push(b'}');
        }
        Sender::Human(name) => {
            out.extend_from_slice(b"{\"Human\":");
            push_string(out, name);
            out.push(b'}');
        }
        Sender::System => out.extend_from_slice(b"\"System\""),
    }
    out.extend_from_slice(b",\"text\":");
    push_string(out, &message.text);
    out.extend_from_slice(b",\"mentions\":");
    push_strings(out, &message.mentions);
    out.extend_from_slice(b",\"reply_to\":");
    match message.reply_to {
        Some(seq) => out.extend_from_slice(digits.format(seq).as_bytes()),
        None => out.extend_from_slice(b"null"),
    }
    out.extend_from_slice(b",\"chain\":");
    push_strings(out, &message.chain);
    out.extend_from_slice(b",\"note\":");
    match &message.note {
        Some(note) => serde_json::to_writer(&mut *out, note).expect("a note encodes into a Vec"),
        None => out.extend_from_slice(b"null"),
    }
    out.push(b'}');
}

/// Bytes of a conversation message's encoding besides its strings: field names,
/// punctuation and two numbers (about 110), for the buffer's first allocation.
const CONVERSATION_MESSAGE_JSON_OVERHEAD_BYTES: usize = 160;

/// Appends `texts` as a JSON array of strings.
fn push_strings(out: &mut Vec<u8>, texts: &[String]) {
    out.push(b'[');
    for (index, text) in texts.iter().enumerate() {
        if index > 0 {
            out.push(b',');
        }
        push_string(out, text);
    }
    out.push(b']');
}

/// Appends `text` as a JSON string, as `serde_json` writes it.
pub(crate) fn push_string(out: &mut Vec<u8>, text: &str) {
    if needs_escapes(text.as_bytes()) {
        serde_json::to_writer(&mut *out, text).expect("a string encodes into a Vec");
    } else {
        out.reserve(text.len() + 2);
        out.push(b'"');
        out.extend_from_slice(text.as_bytes());
        out.push(b'"');
    }
}

/// Whether `bytes` hold anything a JSON string escapes: a control byte (below 0x20), a
/// quote or a backslash (what `serde_json` escapes; it writes DEL and non-ASCII as they
/// are). Eight bytes at a time: a word has a byte below `n` (`n` at most 0x80) exactly
/// when `(x - n·0x01…01) & !x & 0x80…80` is non-zero, and a byte equal to `c` when
/// `x ^ c·0x01…01` has a zero byte (a byte below 1).
fn needs_escapes(bytes: &[u8]) -> bool {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGHS: u64 = u64::from_ne_bytes([0x80; 8]);
    let below = |word: u64, n: u64| word.wrapping_sub(ONES * n) & !word & HIGHS != 0;
    let mut words = bytes.chunks_exact(8);
    for chunk in &mut words {
        let word = u64::from_ne_bytes(chunk.try_into().expect("eight bytes"));
        if below(word, 0x20) || below(word ^ (ONES * u64::from(b'"')), 1) || below(word ^ (ONES * u64::from(b'\\')), 1)
        {
            return true;
        }
    }
    words
        .remainder()
        .iter()
        .any(|&byte| byte < 0x20 || byte == b'"' || byte == b'\\')
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::conversation::{Note, NoteKind};
    use crate::llm::ToolCall;

    /// Text drawn to hit every case of the escape check: plain ASCII, each escaped byte,
    /// DEL, bytes just around the limits (0x1F, 0x20, 0x21, 0x5B, 0x5D), non-ASCII, at
    /// every position of an eight-byte word.
    fn text() -> impl Strategy<Value = String> {
        proptest::collection::vec(
            prop_oneof![
                6 => proptest::char::range('a', 'z'),
                1 => proptest::char::range('\u{0}', '\u{21}'),
                1 => prop_oneof![Just('"'), Just('\\'), Just('['), Just(']'), Just('\u{7f}'), Just('é'), Just('\u{2028}'), Just('🦀')],
            ],
            0..40,
        )
        .prop_map(|chars| chars.into_iter().collect())
    }

    fn role() -> impl Strategy<Value = Role> {
        prop_oneof![
            Just(Role::System),
            Just(Role::User),
            Just(Role::Assistant),
            Just(Role::Tool)
        ]
    }

    fn tool_call() -> impl Strategy<Value = ToolCall> {
        (text(), text(), text(), proptest::option::of(0_u64..1_000)).prop_map(|(id, name, value, number)| ToolCall {
            id,
            name,
            arguments: match number {
                Some(number) => serde_json::json!({"message": value, "n": number, "list": [value, null]}),
                None => serde_json::Value::String(value),
            },
        })
    }

    proptest! {
        #[test]
        fn a_string_is_written_as_serde_json_writes_it(text in text()) {
            let mut out = b"x".to_vec();
            push_string(&mut out, &text);
            prop_assert_eq!(&out[1..], &serde_json::to_vec(&text).unwrap()[..]);
        }

        #[test]
        fn a_chat_message_is_written_as_serde_json_writes_it(
            role in role(),
            content in text(),
            tool_calls in proptest::collection::vec(tool_call(), 0..3),
            tool_call_id in proptest::option::of(text()),
        ) {
            let message = ChatMessage { role, content, tool_calls, tool_call_id };
            let written = chat_message(&message);
            prop_assert_eq!(&written, &serde_json::to_vec(&message).unwrap());
            prop_assert_eq!(serde_json::from_slice::<ChatMessage>(&written).unwrap(), message);
        }
    }

    fn sender() -> impl Strategy<Value = Sender> {
        prop_oneof![
            text().prop_map(Sender::Agent),
            text().prop_map(Sender::Human),
            Just(Sender::System)
        ]
    }

    fn note() -> impl Strategy<Value = Note> {
        (
            text(),
            prop_oneof![
                Just(NoteKind::Cycle),
                Just(NoteKind::Failed),
                Just(NoteKind::NotPermitted)
            ],
        )
            .prop_map(|(agent, kind)| Note { agent, kind })
    }

    proptest! {
        #[test]
        fn a_conversation_message_is_written_as_serde_json_writes_it(
            seq in proptest::prelude::any::<u64>(),
            sender in sender(),
            text in text(),
            mentions in proptest::collection::vec(text(), 0..3),
            reply_to in proptest::option::of(proptest::prelude::any::<u64>()),
            chain in proptest::collection::vec(text(), 0..3),
            note in proptest::option::of(note()),
        ) {
            let message = ConversationMessage { seq, sender, text, mentions, reply_to, chain, note };
            let written = conversation_message(&message);
            prop_assert_eq!(&written, &serde_json::to_vec(&message).unwrap());
            prop_assert_eq!(serde_json::from_slice::<ConversationMessage>(&written).unwrap(), message);
        }
    }

    #[test]
    fn each_escaped_byte_is_found_at_each_position_of_a_word() {
        for escaped in (0_u8..0x20).chain([b'"', b'\\']) {
            for at in 0..17 {
                let mut bytes = vec![b'a'; 17];
                bytes[at] = escaped;
                assert!(needs_escapes(&bytes), "{escaped:#x} at {at}");
            }
        }
        for plain in (0x20_u8..=0x7f).filter(|byte| *byte != b'"' && *byte != b'\\') {
            assert!(!needs_escapes(&[plain; 17]), "{plain:#x}");
        }
        assert!(!needs_escapes("héllo wörld, 🦀 and more words".as_bytes()));
    }
}
