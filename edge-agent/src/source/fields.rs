//! Fields a source fills into its records where they lack them: fixed values (a source's
//! `fields` table, [`StaticFields`]), and, for MQTT, values taken from a message's topic.
//!
//! Topic fields (the MQTT source's `topic_fields`, [`TopicFields`]) are for plants
//! whose devices publish `plant/hall-2/press-07/temperature` with only the reading in the
//! payload. The pattern names the topic's levels: a level in braces fills the field of that
//! name, `+` is any level, `#` (last) any rest, and other levels must be equal. With
//! `plant/+/{device_id}/{sensor}`, that topic gives `device_id = "press-07"` and
//! `sensor = "temperature"`, typed by the stream like CSV cells.
//!
//! A field the payload record already has keeps the payload's value (the device says what it
//! is); a different value there is counted as a conflict. A topic the pattern does not match,
//! and a line that is not a JSON object, are passed on unchanged, for validation to judge.

use std::sync::Arc;

use schemas::{FieldType, StreamDef};
use serde_json::{Map, Value as Json};

#[derive(Debug, Clone, PartialEq)]
enum Level {
    Literal(String),
    Any,
    Field(String),
    Rest,
}

/// A parsed `topic_fields` pattern, with the stream that types its fields.
#[derive(Debug, Clone)]
pub struct TopicFields {
    levels: Vec<Level>,
    def: Arc<StreamDef>,
}

/// A message's payload with the topic's fields filled in.
#[derive(Debug, Default, PartialEq)]
pub struct Filled {
    pub data: Vec<u8>,
    /// Whether the topic matched the pattern (nothing was filled in otherwise).
    pub matched: bool,
    /// Fields the payload set to another value than the topic's (the payload's was kept).
    pub conflicts: usize,
}

impl TopicFields {
    /// Parses `pattern` for stream `def`; every field it names must be one of the stream's.
    pub fn parse(pattern: &str, def: &Arc<StreamDef>) -> anyhow::Result<TopicFields> {
        let what = |problem: &str| format!("topic_fields \"{pattern}\": {problem}");
        let parts: Vec<&str> = pattern.split('/').collect();
        let mut levels = Vec::with_capacity(parts.len());
        for (i, part) in parts.iter().enumerate() {
            let level = match *part {
                "+" => Level::Any,
                "#" if i + 1 == parts.len() => Level::Rest,
                "#" => anyhow::bail!(what("# must be the last level")),
                field if field.starts_with('{') && field.ends_with('}') => {
                    let name = &field[1..field.len() - 1];
                    anyhow::ensure!(
                        def.field_index(name).is_some(),
                        what(&format!("stream {} has no field '{name}'", def.name))
                    );
                    anyhow::ensure!(
                        !levels.contains(&Level::Field(name.to_owned())),
                        what(&format!("'{name}' is named twice"))
                    );
                    Level::Field(name.to_owned())
                }
                literal => {
                    anyhow::ensure!(
                        !literal.contains(['{', '}', '+', '#']),
                        what(&format!(
                            "level '{literal}' is neither +, #, {{field}} nor plain text"
                        ))
                    );
                    Level::Literal(literal.to_owned())
                }
            };
            levels.push(level);
        }
        anyhow::ensure!(
            levels.iter().any(|l| matches!(l, Level::Field(_))),
            what("it names no {field}")
        );
        Ok(TopicFields {
            levels,
            def: def.clone(),
        })
    }

    /// The (field, text) pairs of `topic`, or `None` when the pattern does not match it.
    fn captures<'t>(&self, topic: &'t str) -> Option<Vec<(&str, &'t str)>> {
        let mut parts = topic.split('/');
        let mut captured = Vec::new();
        for level in &self.levels {
            match level {
                Level::Rest => return Some(captured),
                Level::Any => {
                    parts.next()?;
                }
                Level::Literal(text) => {
                    if parts.next()? != text {
                        return None;
                    }
                }
                Level::Field(name) => captured.push((name.as_str(), parts.next()?)),
            }
        }
        parts.next().is_none().then_some(captured)
    }

    /// `payload` (NDJSON lines) with the fields of `topic` filled into every record.
    pub fn fill(&self, topic: &str, payload: &[u8]) -> Filled {
        let Some(captured) = self.captures(topic) else {
            return Filled {
                data: payload.to_vec(),
                ..Filled::default()
            };
        };
        let values: Vec<(&str, Json)> = captured
            .into_iter()
            .map(|(name, text)| (name, typed_text(&self.def, name, text)))
            .collect();
        let (data, conflicts) = fill_lines(payload, &values);
        Filled {
            data,
            matched: true,
            conflicts,
        }
    }
}

/// `payload` (NDJSON lines) with `values` filled into every record ([`fill_record`]), and how
/// many values the records set otherwise themselves. Blank lines are left out.
fn fill_lines<S: AsRef<str>>(payload: &[u8], values: &[(S, Json)]) -> (Vec<u8>, usize) {
    let mut data = Vec::with_capacity(payload.len() + 64);
    let mut conflicts = 0;
    for line in payload.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        conflicts += fill_record(line, values, &mut data);
        data.push(b'\n');
    }
    (data, conflicts)
}

/// Appends `line` (one record) to `out` with `values` filled in where it lacks them, and returns
/// how many of them it set to another value itself (it keeps its own). A line that is not a JSON
/// object is appended as it is, for validation to judge.
fn fill_record<S: AsRef<str>>(line: &[u8], values: &[(S, Json)], out: &mut Vec<u8>) -> usize {
    let Ok(mut record) = serde_json::from_slice::<Map<String, Json>>(line) else {
        out.extend_from_slice(line);
        return 0;
    };
    let mut conflicts = 0;
    for (name, value) in values {
        let name = name.as_ref();
        match record.get(name) {
            None => {
                record.insert(name.to_owned(), value.clone());
            }
            Some(own) if own != value => conflicts += 1,
            Some(_) => {}
        }
    }
    let _ = serde_json::to_writer(&mut *out, &record);
    conflicts
}

/// Fields a source adds to each of its records (the source's `fields` table), for records that
/// lack them: a file of one machine's readings without its device id, or a site's name.
#[derive(Debug, Clone)]
pub struct StaticFields {
    values: Vec<(String, Json)>,
}

impl StaticFields {
    /// Checks `fields` against stream `def`: each must be one of its fields, with a value of its
    /// type.
    pub fn new(
        fields: &std::collections::BTreeMap<String, Json>,
        def: &StreamDef,
    ) -> anyhow::Result<StaticFields> {
        let values: Vec<(String, Json)> = fields.clone().into_iter().collect();
        let object: Map<String, Json> = values.iter().cloned().collect();
        match schemas::validate(def, Json::Object(object)) {
            Ok(_) | Err(schemas::RecordError::Missing { .. }) => Ok(StaticFields { values }),
            Err(e) => anyhow::bail!("fields: {e}"),
        }
    }

    /// `payload` (NDJSON lines) with the fields filled into every record (an MQTT message).
    pub fn fill(&self, payload: &[u8]) -> Vec<u8> {
        fill_lines(payload, &self.values).0
    }

    /// A line transform for [`super::feed_lines`]: `line` with the fields filled in, appended
    /// to `out` after whatever `inner` makes of it.
    pub fn fill_line(
        &self,
        line: &[u8],
        out: &mut Vec<u8>,
        inner: impl FnOnce(&[u8], &mut Vec<u8>),
    ) {
        let mut record = Vec::with_capacity(line.len());
        inner(line, &mut record);
        let record = record.strip_suffix(b"\n").unwrap_or(&record);
        let record = record.strip_suffix(b"\r").unwrap_or(record);
        fill_record(record, &self.values, out);
    }
}

/// The JSON value of `text` for field `name` of the stream, typed by the field (a CSV cell, a
/// level of an MQTT topic). Text that does not parse as its type, and text for a field the
/// stream lacks, stays a string, so validation rejects it with its usual message.
pub fn typed_text(def: &StreamDef, name: &str, text: &str) -> Json {
    let ty = def.field_index(name).map(|i| &def.fields[i].ty);
    let value = match ty {
        Some(FieldType::Int64) => text.parse::<i64>().map(Json::from).ok(),
        Some(FieldType::Float64) => text
            .parse::<f64>()
            .ok()
            .and_then(|f| serde_json::Number::from_f64(f).map(Json::Number)),
        Some(FieldType::Bool) => text.parse::<bool>().map(Json::from).ok(),
        Some(FieldType::Timestamp) => text.parse::<i64>().map(Json::from).ok(),
        Some(FieldType::List(_) | FieldType::Map(_)) => serde_json::from_str(text).ok(),
        _ => None,
    };
    value.unwrap_or_else(|| Json::String(text.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn def() -> Arc<StreamDef> {
        schemas::example_streams()
            .get("sensor_readings")
            .unwrap()
            .clone()
    }

    fn records(filled: &Filled) -> Vec<Json> {
        std::str::from_utf8(&filled.data)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or(Json::String(l.to_owned())))
            .collect()
    }

    #[test]
    fn levels_in_braces_fill_their_fields_typed_by_the_stream() {
        let t = TopicFields::parse("plant/+/{device_id}/{sensor}/{quality}/#", &def()).unwrap();
        let payload =
            b"{\"ts\":1,\"value\":2.5}\r\n\n{\"ts\":2,\"value\":3.5,\"sensor\":\"own\"}\n";
        let filled = t.fill("plant/hall-2/press-07/temp/192/raw/x", payload);
        assert!(filled.matched);
        assert_eq!(filled.conflicts, 1);
        let got = records(&filled);
        assert_eq!(got.len(), 2);
        assert_eq!(got[0]["device_id"], "press-07");
        assert_eq!(got[0]["sensor"], "temp");
        assert_eq!(got[0]["quality"], 192, "an int64 field gets a number");
        assert_eq!(got[1]["sensor"], "own", "the payload's own value is kept");
        // '#' matches no level at all too, as in MQTT.
        assert!(t.fill("plant/h/d/s/192", payload).matched);
    }

    #[test]
    fn topics_the_pattern_does_not_match_and_lines_that_are_not_objects_pass_unchanged() {
        let t = TopicFields::parse("plant/{device_id}/readings", &def()).unwrap();
        let payload = b"{\"ts\":1}\n";
        for topic in [
            "plant/d1",
            "plant/d1/readings/more",
            "other/d1/readings",
            "plant/d1/values",
        ] {
            let filled = t.fill(topic, payload);
            assert!(!filled.matched, "{topic}");
            assert_eq!(filled.data, payload, "{topic}");
        }
        let filled = t.fill("plant/d1/readings", b"[1,2]\nnot json\n{\"ts\":1}");
        let text = String::from_utf8(filled.data.clone()).unwrap();
        assert!(text.starts_with("[1,2]\nnot json\n"), "{text}");
        assert_eq!(records(&filled)[2]["device_id"], "d1");
        // A value that does not parse as its type stays text, for validation to refuse.
        let q = TopicFields::parse("q/{quality}", &def()).unwrap();
        assert_eq!(records(&q.fill("q/good", b"{}"))[0]["quality"], "good");
    }

    #[test]
    fn static_fields_fill_messages_and_lines_and_records_keep_their_own() {
        let fields: std::collections::BTreeMap<String, Json> = [
            ("device_id".to_owned(), Json::from("press-07")),
            ("quality".to_owned(), Json::from(192)),
        ]
        .into();
        let fields = StaticFields::new(&fields, &def()).unwrap();
        let message = fields.fill(b"{\"ts\":1}\n{\"ts\":2,\"device_id\":\"own\"}\n");
        let got = records(&Filled {
            data: message,
            ..Filled::default()
        });
        assert_eq!(got[0]["device_id"], "press-07");
        assert_eq!(got[0]["quality"], 192);
        assert_eq!(got[1]["device_id"], "own");
        // As a line transform, after the source's own (here one that upper-cases a key).
        let mut out = Vec::new();
        fields.fill_line(b"{\"x\":1}\r\n", &mut out, |line, out| {
            out.extend_from_slice(&line.to_ascii_uppercase());
        });
        let line: Json = serde_json::from_slice(&out).unwrap();
        assert_eq!(line["X"], 1);
        assert_eq!(line["device_id"], "press-07");
    }

    #[test]
    fn bad_patterns_are_refused_with_the_reason() {
        for (pattern, expected) in [
            ("plant/{nope}/x", "has no field 'nope'"),
            ("plant/#/{device_id}", "# must be the last level"),
            ("{sensor}/{sensor}", "'sensor' is named twice"),
            ("plant/+/readings", "names no {field}"),
            (
                "plant/dev{device_id}",
                "neither +, #, {field} nor plain text",
            ),
        ] {
            let e = TopicFields::parse(pattern, &def()).unwrap_err().to_string();
            assert!(
                e.contains(expected) && e.contains(pattern),
                "{pattern}: {e}"
            );
        }
    }
}
