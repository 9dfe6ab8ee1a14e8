//! Actor identifiers: a kind (which factory builds the actor) and a key (which one).

use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::limits::{ACTOR_KEY_LENGTH_MAX, ACTOR_KIND_LENGTH_MAX};

/// Why a kind or key was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    /// The kind or key is empty.
    #[error("{what} is empty")]
    Empty {
        /// `"kind"` or `"key"`.
        what: &'static str,
    },
    /// The kind or key is longer than its limit.
    #[error("{what} is {length} bytes, more than the limit of {limit}")]
    TooLong {
        /// `"kind"` or `"key"`.
        what: &'static str,
        /// Its length in bytes.
        length: usize,
        /// The limit in bytes.
        limit: usize,
    },
    /// The kind holds a character other than `[a-z0-9_-]`, or the key a control character or `/`
    /// in the kind.
    #[error("{what} holds the character {character:?}, which is not allowed")]
    BadCharacter {
        /// `"kind"` or `"key"`.
        what: &'static str,
        /// The first character refused.
        character: char,
    },
}

/// The kind of an actor: names the factory that builds it and its configuration.
///
/// Lowercase ASCII letters, digits, `_` and `-`, 1 to
/// [`ACTOR_KIND_LENGTH_MAX`] bytes.
#[derive(Clone, Eq, PartialOrd, Ord, Deserialize)]
#[serde(try_from = "String")]
pub struct ActorKind(Arc<str>);

/// Serialized as its text, borrowed (a string, as it is read back).
impl Serialize for ActorKind {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl PartialEq for ActorKind {
    fn eq(&self, other: &Self) -> bool {
        // Clones share their text: comparing the pointers first saves a cache miss per
        // lookup in large tables.
        Arc::ptr_eq(&self.0, &other.0) || self.0 == other.0
    }
}

impl Hash for ActorKind {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // Consistent with `eq`, which is equality of the text.
        self.0.hash(state);
    }
}

impl ActorKind {
    /// Validates and builds a kind.
    ///
    /// # Errors
    /// [`IdError`] if the name is empty, too long or holds a character outside `[a-z0-9_-]`.
    pub fn new(name: impl AsRef<str>) -> Result<Self, IdError> {
        let name = name.as_ref();
        check_length("kind", name, ACTOR_KIND_LENGTH_MAX)?;
        if let Some(character) = name
            .chars()
            .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_' || *c == '-'))
        {
            return Err(IdError::BadCharacter {
                what: "kind",
                character,
            });
        }
        Ok(Self(Arc::from(name)))
    }

    /// The kind's name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for ActorKind {
    type Error = IdError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::new(value)
    }
}

impl From<ActorKind> for String {
    fn from(value: ActorKind) -> Self {
        value.0.to_string()
    }
}

impl fmt::Display for ActorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for ActorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", &*self.0)
    }
}

/// The address of a virtual actor: it exists by this id, whether or not it is active.
///
/// Displayed as `kind/key`. Cheap to clone (both parts are reference-counted).
#[derive(Clone, Eq, PartialOrd, Ord, Deserialize)]
#[serde(try_from = "ActorIdWire")]
pub struct ActorId {
    kind: ActorKind,
    key: Arc<str>,
}

impl PartialEq for ActorId {
    fn eq(&self, other: &Self) -> bool {
        (Arc::ptr_eq(&self.key, &other.key) || self.key == other.key) && self.kind == other.kind
    }
}

impl Hash for ActorId {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // Consistent with `eq`, which is equality of kind and key text.
        self.kind.hash(state);
        self.key.hash(state);
    }
}

impl ActorId {
    /// Validates and builds an id.
    ///
    /// # Errors
    /// [`IdError`] if the kind is invalid, or the key is empty, longer than
    /// [`ACTOR_KEY_LENGTH_MAX`] bytes or holds a control character.
    pub fn new(kind: impl AsRef<str>, key: impl AsRef<str>) -> Result<Self, IdError> {
        let kind = ActorKind::new(kind)?;
        Self::of_kind(kind, key)
    }

    /// Builds an id of an already validated kind.
    ///
    /// # Errors
    /// [`IdError`] if the key is empty, too long or holds a control character.
    pub fn of_kind(kind: ActorKind, key: impl AsRef<str>) -> Result<Self, IdError> {
        let key = key.as_ref();
        check_length("key", key, ACTOR_KEY_LENGTH_MAX)?;
        if let Some(character) = key.chars().find(|c| c.is_control()) {
            return Err(IdError::BadCharacter { what: "key", character });
        }
        Ok(Self {
            kind,
            key: Arc::from(key),
        })
    }

    /// The actor's kind.
    pub fn kind(&self) -> &ActorKind {
        &self.kind
    }

    /// The actor's key within its kind.
    pub fn key(&self) -> &str {
        &self.key
    }
}

impl fmt::Display for ActorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.kind, self.key)
    }
}

impl fmt::Debug for ActorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ActorId({self})")
    }
}

/// The wire form of an [`ActorId`]; validated on the way in.
#[derive(Deserialize)]
struct ActorIdWire {
    kind: ActorKind,
    key: String,
}

/// Serialized as [`ActorIdWire`] is read (a struct of `kind` and `key`), from borrowed
/// text: ids are in every agent request and reply, and copying both strings into an
/// owned wire struct first cost two allocations per id.
impl Serialize for ActorId {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut wire = serializer.serialize_struct("ActorIdWire", 2)?;
        wire.serialize_field("kind", &self.kind)?;
        wire.serialize_field("key", &*self.key)?;
        wire.end()
    }
}

impl TryFrom<ActorIdWire> for ActorId {
    type Error = IdError;
    fn try_from(wire: ActorIdWire) -> Result<Self, Self::Error> {
        Self::of_kind(wire.kind, wire.key)
    }
}

fn check_length(what: &'static str, value: &str, limit: usize) -> Result<(), IdError> {
    if value.is_empty() {
        return Err(IdError::Empty { what });
    }
    if value.len() > limit {
        return Err(IdError::TooLong {
            what,
            length: value.len(),
            limit,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_displays_as_kind_slash_key_and_round_trips_through_bincode() {
        let id = ActorId::new("agent", "researcher-1").unwrap();
        assert_eq!(id.to_string(), "agent/researcher-1");
        let bytes = bincode::serialize(&id).unwrap();
        let back: ActorId = bincode::deserialize(&bytes).unwrap();
        assert_eq!(back, id);
    }

    #[test]
    fn bad_kinds_and_keys_are_refused_with_the_reason() {
        assert_eq!(ActorKind::new(""), Err(IdError::Empty { what: "kind" }));
        assert_eq!(
            ActorKind::new("Agent"),
            Err(IdError::BadCharacter {
                what: "kind",
                character: 'A'
            })
        );
        let long = "k".repeat(ACTOR_KEY_LENGTH_MAX + 1);
        assert!(matches!(
            ActorId::new("agent", &long),
            Err(IdError::TooLong { what: "key", .. })
        ));
        assert!(matches!(
            ActorId::new("agent", "a\nb"),
            Err(IdError::BadCharacter {
                what: "key",
                character: '\n'
            })
        ));
    }

    /// The borrowed serialization writes what an owned `{kind, key}` struct of strings
    /// writes (the form stored and sent before it), in JSON and bincode, and reads back.
    #[test]
    fn ids_serialize_as_the_owned_wire_struct_did() {
        #[derive(Serialize)]
        struct OwnedWire {
            kind: String,
            key: String,
        }
        let id = ActorId::new("agent", "r\u{e9}searcher \"1\"").unwrap();
        let owned = OwnedWire {
            kind: "agent".to_string(),
            key: id.key().to_string(),
        };
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(json, serde_json::to_string(&owned).unwrap());
        assert_eq!(json, "{\"kind\":\"agent\",\"key\":\"r\u{e9}searcher \\\"1\\\"\"}");
        assert_eq!(serde_json::from_str::<ActorId>(&json).unwrap(), id);
        assert_eq!(bincode::serialize(&id).unwrap(), bincode::serialize(&owned).unwrap());
        assert_eq!(
            serde_json::to_string(id.kind()).unwrap(),
            serde_json::to_string("agent").unwrap()
        );
        let bad = serde_json::to_string(&OwnedWire {
            kind: "agent".to_string(),
            key: String::new(),
        })
        .unwrap();
        assert!(
            serde_json::from_str::<ActorId>(&bad).is_err(),
            "an empty key is refused on the way in"
        );
    }

    #[test]
    fn a_serialized_kind_is_validated_on_the_way_in() {
        let bytes = bincode::serialize(&"Not Valid".to_string()).unwrap();
        assert!(bincode::deserialize::<ActorKind>(&bytes).is_err());
    }
}
