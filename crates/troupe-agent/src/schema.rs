//! JSON Schema validation of tool arguments, with the `jsonschema` crate.
//!
//! A tool's schema is compiled once, when the tool is built ([`ArgumentSchema::compile`]),
//! as JSON Schema draft 2020-12 (the draft `schemars` derives): `$ref`/`$defs`, `anyOf`,
//! `oneOf`, `allOf`, `enum`, `const`, nested objects, `additionalProperties`, numeric and
//! length bounds and every other keyword of the draft are checked. `format` is not
//! asserted (an annotation, as the draft says).
//!
//! Arguments come from a model, so every failure is a [`SchemaError`] telling the model
//! what to fix: at most [`SCHEMA_ERRORS_REPORTED_MAX`] violations, each a path (`$` is
//! the root, `$.a[0].b` below it) and a reason cut to [`SCHEMA_ERROR_PROBLEM_BYTES_MAX`]
//! bytes, sorted by path then reason so the text does not depend on the order in which
//! the validator visits keywords. Nothing here panics on model input.
//!
//! What it deliberately does not do: fetch anything. A `$ref` that points outside the
//! schema (`http://...`, `file:...`) fails at compile time instead of being retrieved, so
//! validation does no I/O, never blocks, and runs the same under the simulator.
//!
//! Determinism under the simulator (`--cfg madsim`): `jsonschema` hashes with `ahash`,
//! whose process-wide seeds come from one `getrandom` call on first use; madsim serves
//! `getrandom` from the simulation's generator, so the first simulation in a process to
//! compile a schema would draw once more than the next (`MADSIM_TEST_CHECK_DETERMINISM`
//! fails, a seed of a batch does not replay alone). Under the simulator a constructor
//! seeds `ahash` before `main`, outside any simulation. Hash order never reaches a
//! result: the violations are sorted before they are reported.

use std::fmt;

use jsonschema::{Draft, Retrieve, Uri, Validator};
use serde_json::Value;
use troupe_core::truncate_utf8;

/// At most this many violations are reported in one [`SchemaError`]; the rest are counted.
pub const SCHEMA_ERRORS_REPORTED_MAX: usize = 4;

/// Each violation's reason is cut to this many bytes (on a character boundary): reasons
/// quote the offending value, which the model controls.
pub const SCHEMA_ERROR_PROBLEM_BYTES_MAX: usize = 200;

/// One way the arguments do not match the schema: where, and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaViolation {
    /// Where in the arguments: `$` is the root, `$.a[0].b` below it.
    pub path: String,
    /// What is wrong there.
    pub problem: String,
}

impl fmt::Display for SchemaViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.problem)
    }
}

/// Why arguments do not match a schema: the first violations (sorted by path, at most
/// [`SCHEMA_ERRORS_REPORTED_MAX`]) and how many more there were.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaError {
    /// The reported violations; never empty.
    pub violations: Vec<SchemaViolation>,
    /// How many violations were found beyond those reported.
    pub omitted: usize,
}

impl SchemaError {
    /// An error with one violation at `path`.
    pub fn at(path: impl Into<String>, problem: impl Into<String>) -> Self {
        let problem = problem.into();
        Self {
            violations: vec![SchemaViolation {
                path: path.into(),
                problem: truncate_utf8(&problem, SCHEMA_ERROR_PROBLEM_BYTES_MAX).to_string(),
            }],
            omitted: 0,
        }
    }

    /// The first violation (the one at the smallest path); `None` only for an error
    /// built by hand without any.
    pub fn first(&self) -> Option<&SchemaViolation> {
        self.violations.first()
    }
}

impl std::error::Error for SchemaError {}

impl fmt::Display for SchemaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (index, violation) in self.violations.iter().enumerate() {
            if index > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{violation}")?;
        }
        if self.omitted > 0 {
            write!(f, "; and {} more", self.omitted)?;
        }
        Ok(())
    }
}

/// A schema that cannot be compiled: malformed, or with a `$ref` to outside itself.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid JSON schema: {cause}")]
pub struct InvalidSchema {
    /// What the compiler said.
    pub cause: String,
}

/// Refuses every external resource: tool schemas must be self-contained.
struct NoRetrieval;

impl Retrieve for NoRetrieval {
    fn retrieve(&self, uri: &Uri<String>) -> Result<Value, Box<dyn std::error::Error + Send + Sync>> {
        Err(format!("{uri} is not fetched: tool schemas must be self-contained").into())
    }
}

/// A tool's argument schema, compiled once.
#[derive(Clone)]
pub struct ArgumentSchema {
    schema: Value,
    validator: std::sync::Arc<Validator>,
}

impl fmt::Debug for ArgumentSchema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ArgumentSchema")
            .field("schema", &self.schema)
            .finish_non_exhaustive()
    }
}

impl ArgumentSchema {
    /// Compiles `schema` as draft 2020-12 (whatever its `$schema` says), without fetching
    /// anything.
    ///
    /// # Errors
    /// [`InvalidSchema`] if `schema` is not a valid schema or refers outside itself.
    pub fn compile(schema: &Value) -> Result<Self, InvalidSchema> {
        let validator = jsonschema::options()
            .with_draft(Draft::Draft202012)
            .with_retriever(NoRetrieval)
            .should_validate_formats(false)
            .build(schema)
            .map_err(|error| InvalidSchema {
                cause: error.to_string(),
            })?;
        Ok(Self {
            schema: schema.clone(),
            validator: std::sync::Arc::new(validator),
        })
    }

    /// The schema as given.
    pub fn schema(&self) -> &Value {
        &self.schema
    }

    /// Checks `value`.
    ///
    /// # Errors
    /// A [`SchemaError`] with every violation found, sorted by path then reason, at most
    /// [`SCHEMA_ERRORS_REPORTED_MAX`] of them reported.
    pub fn validate(&self, value: &Value) -> Result<(), SchemaError> {
        if self.validator.is_valid(value) {
            return Ok(());
        }
        let mut violations: Vec<SchemaViolation> = self
            .validator
            .iter_errors(value)
            .map(|error| SchemaViolation {
                path: readable_path(error.instance_path().as_str()),
                problem: truncate_utf8(&error.to_string(), SCHEMA_ERROR_PROBLEM_BYTES_MAX).to_string(),
            })
            .collect();
        if violations.is_empty() {
            // `is_valid` and `iter_errors` disagree: report the refusal all the same.
            violations.push(SchemaViolation {
                path: "$".to_string(),
                problem: "does not match the schema".to_string(),
            });
        }
        violations.sort_by(|a, b| (&a.path, &a.problem).cmp(&(&b.path, &b.problem)));
        violations.dedup();
        let omitted = violations.len().saturating_sub(SCHEMA_ERRORS_REPORTED_MAX);
        violations.truncate(SCHEMA_ERRORS_REPORTED_MAX);
        Err(SchemaError { violations, omitted })
    }
}

/// Seeds `ahash`'s process-wide keys before `main`, outside any simulation, so no
/// simulation serves that `getrandom` draw (see the module's top comment).
#[cfg(madsim)]
#[ctor::ctor(unsafe)]
fn schema_hasher_seeds_drawn_before_any_simulation() {
    let _ = ahash::RandomState::new();
}

/// A JSON pointer (`/a/0/b`) as `$.a[0].b`.
fn readable_path(pointer: &str) -> String {
    let mut path = String::from("$");
    for segment in pointer.split('/').skip(1) {
        let segment = segment.replace("~1", "/").replace("~0", "~");
        if !segment.is_empty() && segment.bytes().all(|byte| byte.is_ascii_digit()) {
            path.push('[');
            path.push_str(&segment);
            path.push(']');
        } else {
            path.push('.');
            path.push_str(&segment);
        }
    }
    path
}

/// Checks `value` against `schema`, compiling the schema for this one check (a tool
/// compiles its schema once instead: [`ArgumentSchema`]).
///
/// # Errors
/// A [`SchemaError`]; an invalid schema is reported at `$` as such.
///
/// # Examples
/// ```
/// use serde_json::json;
/// let schema = json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}},
///                     "required": ["n"], "additionalProperties": false});
/// assert!(troupe_agent::validate(&schema, &json!({"n": 2})).is_ok());
/// let error = troupe_agent::validate(&schema, &json!({"n": 0})).unwrap_err();
/// assert_eq!(error.to_string(), "$.n: 0 is less than the minimum of 1");
/// ```
pub fn validate(schema: &Value, value: &Value) -> Result<(), SchemaError> {
    match ArgumentSchema::compile(schema) {
        Ok(compiled) => compiled.validate(value),
        Err(invalid) => Err(SchemaError::at("$", invalid.to_string())),
    }
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
        let cases = [
            (json!("text"), "$: \"text\" is not of type \"object\""),
            (json!({"message": "m"}), "$: \"agent_id\" is a required property"),
            (
                json!({"agent_id": 3, "message": "m"}),
                "$.agent_id: 3 is not of type \"string\"",
            ),
            (
                json!({"agent_id": "b", "message": "m", "timeout_ms": 0}),
                "$.timeout_ms: 0 is less than the minimum of 1",
            ),
            (
                json!({"agent_id": "b", "message": "m", "timeout_ms": 300001}),
                "$.timeout_ms: 300001 is greater than the maximum of 300000",
            ),
            (
                json!({"agent_id": "b", "message": "m", "timeout_ms": 1.5}),
                "$.timeout_ms: 1.5 is not of type \"integer\"",
            ),
            (
                json!({"agent_id": "b", "message": "m", "mode": "shout"}),
                "$.mode: \"shout\" is not one of \"ask\" or \"tell\"",
            ),
            (
                json!({"agent_id": "ééééééééé", "message": "m"}),
                "$.agent_id: \"ééééééééé\" is longer than 8 characters",
            ),
            (
                json!({"agent_id": "", "message": "m"}),
                "$.agent_id: \"\" is shorter than 1 character",
            ),
            (
                json!({"agent_id": "b", "message": "m", "tags": ["a", 1]}),
                "$.tags[1]: 1 is not of type \"string\"",
            ),
            (
                json!({"agent_id": "b", "message": "m", "urgent": "yes"}),
                "$.urgent: \"yes\" is not of type \"boolean\"",
            ),
        ];
        for (value, expected) in cases {
            assert_eq!(error_of(value), expected);
        }
        assert!(error_of(json!({"agent_id": "b", "message": "m", "extra": 1})).contains("'extra' was unexpected"));
    }

    #[test]
    fn integral_floats_count_as_integers_and_integers_as_numbers() {
        let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"}}});
        assert_eq!(validate(&schema, &json!({"n": 3.0, "x": 2})), Ok(()));
    }

    /// Many violations are reported sorted by path, capped, with the rest counted.
    #[test]
    fn many_violations_are_capped_sorted_and_counted() {
        let schema = json!({"type": "array", "items": {"type": "string"}});
        let error = validate(&schema, &json!([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])).unwrap_err();
        assert_eq!(error.violations.len(), SCHEMA_ERRORS_REPORTED_MAX);
        assert_eq!(error.omitted, 12 - SCHEMA_ERRORS_REPORTED_MAX);
        assert_eq!(error.first().unwrap().path, "$[0]");
        assert!(error.to_string().ends_with("; and 8 more"), "{error}");
    }

    /// A reason quoting a huge value is cut, so a model cannot blow up its own context
    /// through an error message.
    #[test]
    fn a_reason_quoting_a_huge_value_is_cut() {
        let error = error_of(json!({"agent_id": "x".repeat(100_000), "message": "m"}));
        assert!(
            error.len() <= SCHEMA_ERROR_PROBLEM_BYTES_MAX + 16,
            "{} bytes",
            error.len()
        );
    }

    /// A `$ref` to outside the schema is refused when compiling; nothing is fetched.
    #[test]
    fn remote_references_are_refused_not_fetched() {
        for reference in ["http://127.0.0.1:9/schema.json", "file:///etc/passwd"] {
            let schema = json!({"type": "object", "properties": {"a": {"$ref": reference}}});
            let invalid = ArgumentSchema::compile(&schema).unwrap_err();
            assert!(invalid.cause.contains("is not fetched"), "{invalid}");
        }
    }

    #[test]
    fn json_pointers_read_as_dotted_paths() {
        assert_eq!(readable_path(""), "$");
        assert_eq!(readable_path("/a/0/b~1c~0d"), "$.a[0].b/c~d");
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
        /// Any JSON a model could send is either accepted or refused with a bounded,
        /// non-empty error; the validator never panics, and what it accepts has the
        /// required fields with the right types.
        #[test]
        fn arbitrary_arguments_never_panic_and_accepted_ones_conform(value in arbitrary_json()) {
            match validate(&call_agent_schema(), &value) {
                Ok(()) => {
                    prop_assert!(value["agent_id"].as_str().is_some_and(|s| !s.is_empty() && s.chars().count() <= 8));
                    prop_assert!(value["message"].is_string());
                }
                Err(error) => {
                    prop_assert!(!error.violations.is_empty());
                    prop_assert!(error.violations.len() <= SCHEMA_ERRORS_REPORTED_MAX);
                }
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
