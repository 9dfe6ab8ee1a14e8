//! Typed tools and JSON Schema validation of the arguments a model supplies.
//!
//! - The schema a model sees is derived from the tool's Rust argument type (`schemars`),
//!   with nested types under `$defs` behind `$ref`, unit enums as `enum`, untagged enums
//!   as `anyOf` and tagged enums as `oneOf`.
//! - Arguments are validated with a full JSON Schema implementation. Every refused case
//!   below was accepted by the hand-written validator this replaced (it ignored `$ref`,
//!   `anyOf`, `oneOf`, `allOf`, `const`, `pattern`, `multipleOf` and schema-valued
//!   `additionalProperties`), except the `prefixItems` ones: it read `items: false` as
//!   refusing every item, so it refused them at the wrong item and also refused the
//!   valid `["a", 1]`, which is now accepted.
//! - End to end, a scripted model calls a typed tool through an `AgentSystem`: good
//!   arguments reach the handler as the Rust type, bad ones come back to the model as a
//!   short error it reads, and the handler never sees them.
//!
//! Runs in both builds: `cargo test -p troupe-agent --test typed_tools` (tokio with
//! paused time) and `CARGO_TARGET_DIR=target/madsim RUSTFLAGS="--cfg madsim" cargo test
//! -p troupe-agent --test typed_tools` (the madsim simulator).

use std::sync::{Arc, Mutex};

use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{json, Value};
use troupe_agent::{
    tool_parameters_schema, validate, AgentSpec, AgentSystem, ArgumentSchema, ScriptRule, ScriptedLlm, Tool, ToolError,
    ToolExecutionContext, SCHEMA_ERRORS_REPORTED_MAX,
};

/// Books a table; the model's arguments for the `book` tool.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct BookingArguments {
    /// Who the table is for.
    guest: GuestName,
    /// How many people, 1 to 12.
    #[schemars(range(min = 1, max = 12))]
    party: u8,
    /// Where to sit.
    seating: Seating,
    /// When: minutes after midnight, or a named time.
    when: When,
    /// How to reach the guest, if at all.
    #[serde(default)]
    contact: Option<Contact>,
}

// Only deserialization knows that a name has no digits: a rule the schema does not
// express, so the model's argument passes validation and fails deserialization.
/// A guest's name, without digits.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(try_from = "String")]
struct GuestName(String);

impl TryFrom<String> for GuestName {
    type Error = String;

    fn try_from(name: String) -> Result<Self, Self::Error> {
        if name.chars().any(|c| c.is_ascii_digit()) {
            return Err(format!("a guest name has no digits: {name:?}"));
        }
        Ok(Self(name))
    }
}

// A unit enum: `enum` in the schema, under `$defs` behind a `$ref`.
/// Inside or on the terrace.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
enum Seating {
    Inside,
    Terrace,
}

// An untagged enum: `anyOf`.
/// Minutes after midnight, or a named time.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(untagged)]
enum When {
    Minutes(#[schemars(range(max = 1439))] u16),
    Named(NamedTime),
}

/// A named time of day.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
enum NamedTime {
    Lunch,
    Dinner,
}

// An externally tagged enum with data: `oneOf`, each a nested object.
/// A phone number or an email address.
#[derive(Debug, Clone, PartialEq, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
enum Contact {
    Phone { number: String },
    Email { address: String },
}

fn booking_schema() -> Value {
    tool_parameters_schema::<BookingArguments>()
}

fn good_booking() -> Value {
    json!({"guest": "Ada", "party": 2, "seating": "terrace", "when": "dinner",
           "contact": {"email": {"address": "ada@example.invalid"}}})
}

/// Goal: the schema the model sees is the one derived from the Rust type, with
/// descriptions from the doc comments and the combinators the tests below rely on.
#[test]
fn the_schema_the_model_sees_is_derived_from_the_argument_type() {
    let schema = booking_schema();
    assert_eq!(schema["type"], "object");
    assert!(
        schema.get("$schema").is_none(),
        "the draft marker is not sent to the model"
    );
    assert_eq!(schema["additionalProperties"], false);
    assert_eq!(schema["required"], json!(["guest", "party", "seating", "when"]));
    assert_eq!(
        schema["properties"]["party"]["description"],
        "How many people, 1 to 12."
    );
    assert_eq!(schema["properties"]["party"]["maximum"], 12);
    assert_eq!(schema["properties"]["seating"]["$ref"], "#/$defs/Seating");
    assert_eq!(schema["$defs"]["Seating"]["enum"], json!(["inside", "terrace"]));
    assert!(schema["$defs"]["When"]["anyOf"].is_array(), "{schema:#}");
    assert!(schema["$defs"]["Contact"]["oneOf"].is_array(), "{schema:#}");
    let tool = Tool::typed::<BookingArguments, _, _>("book", "Books a table.", book_nothing);
    assert_eq!(tool.spec().parameters, schema);
    assert_eq!(tool.spec().description, "Books a table.");
    assert!(ArgumentSchema::compile(&schema)
        .unwrap()
        .validate(&good_booking())
        .is_ok());
}

async fn book_nothing(_context: ToolExecutionContext, _arguments: BookingArguments) -> Result<String, ToolError> {
    Ok(String::new())
}

/// Goal: what the hand-written validator let through is now refused, with the path and
/// the reason. Method: one case per keyword the old validator ignored, each checked to
/// be refused at the path named; every case was accepted by the old `validate`.
#[test]
fn ref_any_of_one_of_nested_objects_and_enums_are_enforced() {
    let schema = booking_schema();
    let with = |field: &str, value: Value| {
        let mut arguments = good_booking();
        arguments[field] = value;
        arguments
    };
    let cases = [
        // `$ref` to a unit enum under `$defs`.
        (with("seating", json!("roof")), "$.seating", "is not one of"),
        // `$ref` to an `anyOf`: neither a minute (range) nor a named time (enum).
        (with("when", json!(1440)), "$.when", ""),
        (with("when", json!("breakfast")), "$.when", ""),
        // `oneOf`: no variant matches, or two variants at once.
        (with("contact", json!({"fax": {"number": "1"}})), "$.contact", ""),
        (
            with(
                "contact",
                json!({"phone": {"number": "1"}, "email": {"address": "a@b"}}),
            ),
            "$.contact",
            "",
        ),
        // A nested object inside a `oneOf` variant: wrong type, unknown field.
        (with("contact", json!({"phone": {"number": 5}})), "$.contact", ""),
        (
            with("contact", json!({"phone": {"number": "1", "ext": "2"}})),
            "$.contact",
            "",
        ),
    ];
    for (arguments, path, reason) in cases {
        let error = validate(&schema, &arguments).expect_err(&format!("{arguments} must be refused"));
        assert!(
            error
                .violations
                .iter()
                .any(|v| v.path == path && v.problem.contains(reason)),
            "{arguments}: {error}"
        );
        assert!(error.violations.len() <= SCHEMA_ERRORS_REPORTED_MAX, "{error}");
    }
    // Nullable `Option` through `anyOf` with `null`, and a plain null.
    assert!(validate(&schema, &with("contact", Value::Null)).is_ok());
    assert!(validate(&schema, &good_booking()).is_ok());
}

/// Goal: keywords of hand-written schemas the old validator skipped are enforced too,
/// and `prefixItems` with `items: false` is read as draft 2020-12 says.
#[test]
fn hand_written_schemas_get_the_whole_draft() {
    let schema = json!({
        "type": "object",
        "$defs": {"id": {"type": "string", "pattern": "^[a-z]+$"}},
        "properties": {
            "target": {"$ref": "#/$defs/id"},
            "level": {"allOf": [{"type": "integer"}, {"multipleOf": 5}]},
            "kind": {"const": "probe"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "pair": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": false}
        }
    });
    for (arguments, path) in [
        (json!({"target": "Not-An-Id"}), "$.target"),
        (json!({"level": 7}), "$.level"),
        (json!({"kind": "other"}), "$.kind"),
        (json!({"labels": {"a": 1}}), "$.labels.a"),
        (json!({"pair": ["a", "b"]}), "$.pair[1]"),
        (json!({"pair": ["a", 1, 2]}), "$.pair[2]"),
    ] {
        let error = validate(&schema, &arguments).expect_err(&format!("{arguments} must be refused"));
        assert_eq!(error.first().unwrap().path, path, "{arguments}: {error}");
    }
    assert!(validate(
        &schema,
        &json!({"target": "ok", "level": 10, "kind": "probe", "pair": ["a", 1]})
    )
    .is_ok());
}

/// Goal: a tool whose schema refers outside itself is a programmer error caught when the
/// tool is built, never a fetch at call time.
#[test]
#[should_panic(expected = "does not compile")]
fn a_tool_with_a_remote_ref_is_refused_when_built() {
    let _ = Tool::from_fn(
        "remote",
        "refers to a remote schema",
        json!({"type": "object", "properties": {"a": {"$ref": "https://example.invalid/a.json"}}}),
        |_context, _arguments| async move { Ok(String::new()) },
    );
}

/// Goal: a scripted model calls a typed tool end to end through an `AgentSystem`; good
/// arguments reach the handler as the Rust type, and each kind of bad argument comes back
/// to the model as a short error naming the tool, the path and the reason, without the
/// handler running. Method: the model's first step calls `book` four times (good, a
/// schema violation behind `$ref`, a `oneOf` violation, and a name only deserialization
/// refuses); its second step replies with the results it read.
#[tokio::test(start_paused = true)]
async fn a_scripted_model_calls_a_typed_tool_and_reads_its_argument_errors() {
    let booked: Arc<Mutex<Vec<BookingArguments>>> = Arc::default();
    let kept = Arc::clone(&booked);
    let book = Tool::typed::<BookingArguments, _, _>(
        "book",
        "Books a table.",
        move |context: ToolExecutionContext, arguments: BookingArguments| {
            let kept = Arc::clone(&kept);
            async move {
                let reply = format!(
                    "booked {} for {} ({})",
                    arguments.guest.0,
                    arguments.party,
                    context.agent_id()
                );
                kept.lock().unwrap().push(arguments);
                Ok(reply)
            }
        },
    );
    let llm = ScriptedLlm::new()
        .rule(
            ScriptRule::agent("host")
                .on_user_containing("")
                .call("book", good_booking())
                .call(
                    "book",
                    json!({"guest": "Bob", "party": 2, "seating": "roof", "when": 600}),
                )
                .call(
                    "book",
                    json!({"guest": "Cy", "party": 2, "seating": "inside", "when": "lunch",
                           "contact": {"fax": {"number": "1"}}}),
                )
                .call(
                    "book",
                    json!({"guest": "R2D2", "party": 2, "seating": "inside", "when": "lunch"}),
                ),
        )
        .rule(ScriptRule::agent("host").on_tool_result().reply("done"));
    let system = AgentSystem::builder()
        .llm(Arc::new(llm.clone()))
        .agent(AgentSpec::new("host"))
        .tool(book)
        .start()
        .unwrap();
    assert_eq!(system.ask("host", "book tables").await.unwrap().text, "done");

    // The model was offered the derived schema.
    let offered = llm.requests_of("host")[0].tools.clone();
    let spec = offered
        .iter()
        .find(|spec| spec.name == "book")
        .expect("book is offered");
    assert_eq!(spec.parameters, booking_schema());

    // Only the good call reached the handler, as the Rust type.
    assert_eq!(
        booked.lock().unwrap().clone(),
        vec![BookingArguments {
            guest: GuestName("Ada".to_string()),
            party: 2,
            seating: Seating::Terrace,
            when: When::Named(NamedTime::Dinner),
            contact: Some(Contact::Email {
                address: "ada@example.invalid".to_string()
            }),
        }]
    );

    let results = llm.tool_results_seen_by("host");
    assert_eq!(results.len(), 4, "{results:#?}");
    assert_eq!(results[0], "booked Ada for 2 (agent/host)");
    assert_eq!(
        results[1],
        "error: invalid arguments for book: $.seating: \"roof\" is not one of \"inside\" or \"terrace\""
    );
    assert!(
        results[2].starts_with("error: invalid arguments for book: $.contact: "),
        "{}",
        results[2]
    );
    assert_eq!(
        results[3],
        "error: invalid arguments for book: $: a guest name has no digits: \"R2D2\""
    );
    for result in &results {
        assert!(result.len() < 400, "a short tool result: {result}");
    }
    system.shutdown().await;
}

/// Goal: `call_agent`'s argument schema is derived from `CallAgentArguments` and keeps
/// the bounds the hand-written one had.
#[test]
fn call_agent_arguments_are_a_derived_typed_schema() {
    let schema = troupe_agent::call_agent_schema();
    assert_eq!(schema, tool_parameters_schema::<troupe_agent::CallAgentArguments>());
    assert_eq!(schema["required"], json!(["agent_id", "message"]));
    assert_eq!(schema["additionalProperties"], false);
    let agent_id = &schema["properties"]["agent_id"];
    assert_eq!(agent_id["minLength"], 1);
    assert_eq!(agent_id["maxLength"], troupe_core::limits::ACTOR_KEY_LENGTH_MAX);
    assert_eq!(
        schema["properties"]["message"]["maxLength"],
        troupe_agent::limits::AGENT_MESSAGE_SIZE_MAX_BYTES
    );
    let timeout = &schema["properties"]["timeout_ms"];
    assert_eq!(timeout["minimum"], 1);
    assert!(
        timeout["description"].as_str().unwrap().contains("default"),
        "{timeout}"
    );
    for refused in [
        json!({"agent_id": "", "message": "m"}),
        json!({"agent_id": "b", "message": "m", "timeout_ms": 0}),
        json!({"agent_id": "b", "message": "m", "extra": true}),
    ] {
        assert!(validate(&schema, &refused).is_err(), "{refused}");
    }
    assert!(validate(&schema, &json!({"agent_id": "b", "message": "m", "timeout_ms": 5})).is_ok());
}

/// Goal: `timeout_ms` reads as JSON Schema's `integer` does, as the hand-written
/// handler did: `5000.0` is 5000 ms; absent or null is the default.
#[test]
fn call_agent_timeout_accepts_integral_floats() {
    let parse = |value: Value| serde_json::from_value::<troupe_agent::CallAgentArguments>(value).map(|a| a.timeout_ms);
    assert_eq!(
        parse(json!({"agent_id": "b", "message": "m", "timeout_ms": 5000.0})).unwrap(),
        Some(5000)
    );
    assert_eq!(
        parse(json!({"agent_id": "b", "message": "m", "timeout_ms": 7})).unwrap(),
        Some(7)
    );
    assert_eq!(
        parse(json!({"agent_id": "b", "message": "m", "timeout_ms": null})).unwrap(),
        None
    );
    assert_eq!(parse(json!({"agent_id": "b", "message": "m"})).unwrap(), None);
    assert!(parse(json!({"agent_id": "b", "message": "m", "timeout_ms": 1.5})).is_err());
}

/// Goal: `delegate_to_agent`'s and `notify_agent`'s `timeout_ms` reads as JSON
/// Schema's `integer` does, as `call_agent`'s: the schema (`send_schema`) accepts
/// `5000.0`, so the arguments must too (5000 ms), not refuse what the schema let
/// through; a fraction is still refused, naming the field's rule.
#[test]
fn send_timeout_accepts_integral_floats_as_its_schema_does() {
    let schema = troupe_agent::send_schema();
    let whole_float = json!({"agent_id": "b", "message": "m", "timeout_ms": 5000.0});
    assert!(validate(&schema, &whole_float).is_ok());
    let parse = |value: Value| serde_json::from_value::<troupe_agent::SendArguments>(value).map(|a| a.timeout_ms);
    assert_eq!(parse(whole_float).unwrap(), Some(5000));
    assert_eq!(
        parse(json!({"agent_id": "b", "message": "m", "timeout_ms": 7})).unwrap(),
        Some(7)
    );
    assert_eq!(parse(json!({"agent_id": "b", "message": "m"})).unwrap(), None);
    let fraction = parse(json!({"agent_id": "b", "message": "m", "timeout_ms": 1.5})).unwrap_err();
    assert!(
        fraction.to_string().contains("whole number of milliseconds"),
        "{fraction}"
    );
}
