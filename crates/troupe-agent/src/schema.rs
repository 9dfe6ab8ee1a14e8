//! A small JSON-schema validator for tool arguments.
//!
//! Supports the subset tool schemas in Troupe use: `type` (`object`, `string`,
//! `integer`, `number`, `boolean`, `array`, `null`), `properties`, `required`,
//! `additionalProperties: false`, `enum`, `minimum`, `maximum`, `minLength`,
//! `maxLength` (in characters, as JSON schema counts them) and `items`. Other keywords
//! are ignored. Arguments come from a model, so every failure is a [`SchemaError`]
//! telling the model what to fix; nothing here panics on input.

use serde_json::Value;

/// Why arguments do not match a schema: where, and what was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {problem}")]
pub struct SchemaError {
    /// Where in the arguments, as a JSON pointer-like path (`$` is the root).
    pub path: String,
    /// What is wrong there.
    pub problem: String,
}

/// Checks `value` against `schema`.
///
/// # Errors
/// The first [`SchemaError`] found, in document order.
///
/// # Examples
/// ```
/// use serde_json::json;
/// let schema = json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}},
///                     "required": ["n"], "additionalProperties": false});
/// assert!(troupe_agent::validate(&schema, &json!({"n": 2})).is_ok());
/// let error = troupe_agent::validate(&schema, &json!({"n": 0})).unwrap_err();
/// assert_eq!(error.to_string(), "$.n: 0 is less than the minimum 1");
/// ```
pub fn validate(schema: &Value, value: &Value) -> Result<(), SchemaError> {
    validate_at(schema, value, &mut String::from("$"))
}

fn fail(path: &str, problem: impl Into<String>) -> Result<(), SchemaError> {
    Err(SchemaError {
        path: path.to_string(),
        problem: problem.into(),
    })
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(number) if number.is_i64() || number.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn has_type(value: &Value, expected: &str) -> bool {
    match expected {
        "integer" => match value {
            Value::Number(number) => {
                number.is_i64() || number.is_u64() || number.as_f64().is_some_and(|f| f.fract() == 0.0)
            }
            _ => false,
        },
        "number" => value.is_number(),
        other => type_name(value) == other,
    }
}

fn validate_at(schema: &Value, value: &Value, path: &mut String) -> Result<(), SchemaError> {
    let Some(schema) = schema.as_object() else {
        // `true` or an empty schema accepts anything; `false` accepts nothing.
        if schema == &Value::Bool(false) {
            return fail(path, "no value is allowed here");
        }
        return Ok(());
    };
    if let Some(expected) = schema.get("type") {
        let allowed: Vec<&str> = match expected {
            Value::String(one) => vec![one.as_str()],
            Value::Array(many) => many.iter().filter_map(Value::as_str).collect(),
            _ => Vec::new(),
        };
        if !allowed.is_empty() && !allowed.iter().any(|t| has_type(value, t)) {
            return fail(
                path,
                format!("expected {}, got {}", allowed.join(" or "), type_name(value)),
            );
        }
    }
    if let Some(Value::Array(options)) = schema.get("enum") {
        if !options.contains(value) {
            let listed: Vec<String> = options.iter().map(Value::to_string).collect();
            return fail(path, format!("{value} is not one of {}", listed.join(", ")));
        }
    }
    if let Some(number) = value.as_f64().filter(|_| value.is_number()) {
        if let Some(minimum) = schema.get("minimum").and_then(Value::as_f64) {
            if number < minimum {
                return fail(path, format!("{value} is less than the minimum {}", schema["minimum"]));
            }
        }
        if let Some(maximum) = schema.get("maximum").and_then(Value::as_f64) {
            if number > maximum {
                return fail(path, format!("{value} is more than the maximum {}", schema["maximum"]));
            }
        }
    }
    if let Value::String(text) = value {
        let length = text.chars().count();
        if let Some(min) = schema.get("minLength").and_then(Value::as_u64) {
            if (length as u64) < min {
                return fail(
                    path,
                    format!("string of {length} characters is shorter than minLength {min}"),
                );
            }
        }
        if let Some(max) = schema.get("maxLength").and_then(Value::as_u64) {
            if length as u64 > max {
                return fail(
                    path,
                    format!("string of {length} characters is longer than maxLength {max}"),
                );
            }
        }
    }
    if let (Value::Array(items), Some(item_schema)) = (value, schema.get("items")) {
        for (index, item) in items.iter().enumerate() {
            let saved = path.len();
            path.push_str(&format!("[{index}]"));
            validate_at(item_schema, item, path)?;
            path.truncate(saved);
        }
    }
    if let Value::Object(fields) = value {
        let properties = schema.get("properties").and_then(Value::as_object);
        if let Some(Value::Array(required)) = schema.get("required") {
            for name in required.iter().filter_map(Value::as_str) {
                if !fields.contains_key(name) {
                    return fail(path, format!("missing required property \"{name}\""));
                }
            }
        }
        let closed = schema.get("additionalProperties") == Some(&Value::Bool(false));
        for (name, field) in fields {
            match properties.and_then(|properties| properties.get(name)) {
                Some(field_schema) => {
                    let saved = path.len();
                    path.push('.');
                    path.push_str(name);
                    validate_at(field_schema, field, path)?;
                    path.truncate(saved);
                }
                None if closed => {
                    let known: Vec<&str> = properties
                        .map(|p| p.keys().map(String::as_str).collect())
                        .unwrap_or_default();
                    return fail(
                        path,
                        format!("unknown property \"{name}\" (allowed: {})", known.join(", ")),
                    );
                }
                None => {}
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn call_agent_schema() -> Value {
        json!({
            "type": "object",
            "properties": {
                "agent_id": {"type": "string", "minLength": 1, "maxLength": 8},
                "message": {"type": "string"},
                "timeout_ms": {"type": "integer", "minimum": 1, "maximum": 300000},
                "mode": {"type": "string", "enum": ["ask", "tell"]},
                "tags": {"type": "array", "items": {"type": "string"}},
                "urgent": {"type": "boolean"},
                "weight": {"type": "number"}
            },
            "required": ["agent_id", "message"],
            "additionalProperties": false
        })
    }

    fn error_of(value: Value) -> String {
        validate(&call_agent_schema(), &value).unwrap_err().to_string()
    }

    #[test]
    fn valid_arguments_pass() {
        let ok = json!({"agent_id": "b", "message": "hi", "timeout_ms": 5, "mode": "ask",
                        "tags": ["x"], "urgent": true, "weight": 0.5});
        assert_eq!(validate(&call_agent_schema(), &ok), Ok(()));
    }

    #[test]
    fn each_violation_is_reported_with_its_path_and_reason() {
        assert_eq!(error_of(json!("text")), "$: expected object, got string");
        assert_eq!(
            error_of(json!({"message": "m"})),
            "$: missing required property \"agent_id\""
        );
        assert_eq!(
            error_of(json!({"agent_id": 3, "message": "m"})),
            "$.agent_id: expected string, got integer"
        );
        assert_eq!(
            error_of(json!({"agent_id": "b", "message": "m", "timeout_ms": 0})),
            "$.timeout_ms: 0 is less than the minimum 1"
        );
        assert_eq!(
            error_of(json!({"agent_id": "b", "message": "m", "timeout_ms": 300001})),
            "$.timeout_ms: 300001 is more than the maximum 300000"
        );
        assert_eq!(
            error_of(json!({"agent_id": "b", "message": "m", "timeout_ms": 1.5})),
            "$.timeout_ms: expected integer, got number"
        );
        assert_eq!(
            error_of(json!({"agent_id": "b", "message": "m", "mode": "shout"})),
            "$.mode: \"shout\" is not one of \"ask\", \"tell\""
        );
        assert_eq!(
            error_of(json!({"agent_id": "ééééééééé", "message": "m"})),
            "$.agent_id: string of 9 characters is longer than maxLength 8"
        );
        assert_eq!(
            error_of(json!({"agent_id": "", "message": "m"})),
            "$.agent_id: string of 0 characters is shorter than minLength 1"
        );
        assert_eq!(
            error_of(json!({"agent_id": "b", "message": "m", "tags": ["a", 1]})),
            "$.tags[1]: expected string, got integer"
        );
        assert!(error_of(json!({"agent_id": "b", "message": "m", "extra": 1}))
            .starts_with("$: unknown property \"extra\" (allowed: "));
        assert_eq!(
            error_of(json!({"agent_id": "b", "message": "m", "urgent": "yes"})),
            "$.urgent: expected boolean, got string"
        );
    }

    #[test]
    fn integral_floats_count_as_integers_and_integers_as_numbers() {
        let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"}}});
        assert_eq!(validate(&schema, &json!({"n": 3.0, "x": 2})), Ok(()));
    }

    fn arbitrary_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            (-1e9f64..1e9).prop_map(|f| json!(f)),
            ".{0,12}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::btree_map("[a-z_]{1,10}", inner, 0..4)
                    .prop_map(|map| Value::Object(map.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Any JSON a model could send is either accepted or refused with an error; the
        /// validator never panics, and what it accepts has the required fields with the
        /// right types.
        #[test]
        fn arbitrary_arguments_never_panic_and_accepted_ones_conform(value in arbitrary_json()) {
            if validate(&call_agent_schema(), &value).is_ok() {
                prop_assert!(value["agent_id"].as_str().is_some_and(|s| !s.is_empty() && s.chars().count() <= 8));
                prop_assert!(value["message"].is_string());
            }
        }

        /// Objects built to match the schema are accepted.
        #[test]
        fn conforming_arguments_are_accepted(
            agent_id in "[a-z]{1,8}",
            message in ".{0,40}",
            timeout_ms in proptest::option::of(1u64..=300_000),
        ) {
            let mut value = json!({"agent_id": agent_id, "message": message});
            if let Some(timeout_ms) = timeout_ms {
                value["timeout_ms"] = json!(timeout_ms);
            }
            prop_assert_eq!(validate(&call_agent_schema(), &value), Ok(()));
        }
    }
}
