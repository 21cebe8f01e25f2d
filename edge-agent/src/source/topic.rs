//! Record fields taken from an MQTT message's topic (the source's `topic_fields`), for plants
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

use schemas::StreamDef;
use serde_json::{Map, Value as Json};

use super::file::typed_text;

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
        let mut filled = Filled {
            data: Vec::with_capacity(payload.len() + 64),
            matched: true,
            conflicts: 0,
        };
        for line in payload.split(|&b| b == b'\n') {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            match serde_json::from_slice::<Map<String, Json>>(line) {
                Ok(mut record) => {
                    for (name, value) in &values {
                        match record.get(*name) {
                            None => {
                                record.insert((*name).to_owned(), value.clone());
                            }
                            Some(own) if own != value => filled.conflicts += 1,
                            Some(_) => {}
                        }
                    }
                    let _ = serde_json::to_writer(&mut filled.data, &record);
                }
                Err(_) => filled.data.extend_from_slice(line),
            }
            filled.data.push(b'\n');
        }
        filled
    }
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
