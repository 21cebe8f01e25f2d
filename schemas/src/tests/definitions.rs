//! Stream definitions: parsing, names, errors, and which changes of a running stream's
//! definition are taken.

use super::*;

#[test]
fn shipped_streams_parse() {
    let streams = example_streams();
    assert_eq!(streams.len(), 2);
    let s = sensor();
    assert_eq!(s.event_time_field().name, "ts");
    assert_eq!(s.partition_key_field().name, "device_id");
    let hashed: Vec<_> = s
        .hash_fields
        .iter()
        .map(|i| s.fields[*i].name.as_str())
        .collect();
    assert_eq!(
        hashed,
        ["device_id", "quality", "sensor", "ts", "unit", "value"]
    );
    let v = streams.get("vehicle_telemetry").unwrap();
    assert_eq!(v.hash_fields.len(), v.fields.len());
}

#[test]
fn stream_names() {
    for ok in ["a", "sensor_readings", "x9_", &"a".repeat(63)] {
        assert!(validate_stream_name(ok).is_ok(), "{ok}");
    }
    for bad in [
        "",
        "9a",
        "_a",
        "A",
        "a-b",
        "a.b",
        "a/b",
        "../etc",
        "a b",
        "é",
        &"a".repeat(64),
    ] {
        assert!(validate_stream_name(bad).is_err(), "{bad}");
    }
    let e = validate_stream_name("bad\nname\u{1b}[31m")
        .unwrap_err()
        .to_string();
    assert!(!e.contains('\n') && !e.contains('\u{1b}'), "{e}");
}

#[test]
fn definition_errors_are_precise() {
    let base = |extra: &str| {
        format!(
            "name = \"s\"\nversion = 1\nevent_time_field = \"t\"\npartition_key_field = \"k\"\n{extra}\n\
             [[fields]]\nname = \"t\"\ntype = \"timestamp\"\nrequired = true\n\
             [[fields]]\nname = \"k\"\ntype = \"string\"\nrequired = true\n"
        )
    };
    assert!(StreamDef::from_toml(&base("")).is_ok());
    let cases = [
        (base("colour = 1"), "unknown field"),
        (
            base("hash_fields = [\"nope\"]"),
            "hash field 'nope' is not a field",
        ),
        (base("hash_fields = []"), "must not be empty"),
        (base("").replace("timestamp", "list<list<int64>>"), "scalar"),
        (
            base("").replace("timestamp", "float32"),
            "unknown type 'float32'",
        ),
        (
            base("").replace("required = true\n[[", "required = false\n[["),
            "required timestamp",
        ),
        (
            base("").replace("version = 1", "version = 0"),
            "version must be 1",
        ),
        // The partition key must be present in every record, and a string or an int64.
        (
            format!(
                "{}required = false\n",
                base("").trim_end().strip_suffix("required = true").unwrap()
            ),
            "required string or int64",
        ),
        (
            base("").replace("\"string\"", "\"float64\""),
            "required string or int64",
        ),
        (
            base("").replace("name = \"k\"", "name = \"t\""),
            "defined twice",
        ),
        (
            base("").replace("name = \"s\"", "name = \"S\""),
            "invalid stream name",
        ),
    ];
    for (text, want) in cases {
        let e = StreamDef::from_toml(&text).unwrap_err().to_string();
        assert!(e.contains(want), "want {want:?} in {e:?}");
    }
    let e = Streams::from_sources([("other", base("").as_str())]).unwrap_err();
    assert!(
        e[0].to_string().contains("must be named 's.toml'"),
        "{:?}",
        e
    );
}

/// Which edits of a running stream's definition components take without a restart.
#[test]
fn definition_changes_are_compatible_only_when_old_records_still_fit() {
    let text = include_str!("../../../streams/sensor_readings.toml");
    let def = sensor();
    let edit = |t: String| StreamDef::from_toml(&t).unwrap();
    let with_humidity = format!("{text}\n[[fields]]\nname = \"humidity\"\ntype = \"float64\"\n");
    let same = [
        text.to_owned(),
        text.replace("Measured value", "The measured value"),
        text.replace("description = \"Readings", "description = \"All readings"),
    ];
    for t in same {
        assert_eq!(def.change_to(&edit(t)), Change::Same);
    }
    let compatible = [
        with_humidity.clone(),
        with_humidity.replace("version = 1", "version = 2"),
        text.replace("version = 1", "version = 2"),
        // `value` made optional.
        text.replace(
            "type = \"float64\"\nrequired = true",
            "type = \"float64\"\nrequired = false",
        ),
        // A new hashed field: records without it keep their hashes.
        format!(
            "{}\n[[fields]]\nname = \"firmware\"\ntype = \"string\"\n",
            text.replace("hash_fields = [", "hash_fields = [\"firmware\", ")
        ),
    ];
    for t in compatible {
        assert_eq!(def.change_to(&edit(t)), Change::Compatible);
    }
    let incompatible = [
        (
            text.replace(
                "name = \"tags\"\ntype = \"map<string>\"",
                "name = \"labels\"\ntype = \"map<string>\"",
            ),
            "field 'tags' is removed",
        ),
        (
            text.replace(
                "name = \"quality\"\ntype = \"int64\"",
                "name = \"quality\"\ntype = \"string\"",
            ),
            "field 'quality' changes type from int64 to string",
        ),
        (
            text.replace("type = \"int64\"\n", "type = \"int64\"\nrequired = true\n"),
            "field 'quality' becomes required",
        ),
        (
            format!("{text}\n[[fields]]\nname = \"site\"\ntype = \"string\"\nrequired = true\n"),
            "new field 'site' is required",
        ),
        (
            text.replace("\"unit\", \"quality\"]", "\"unit\"]"),
            "field 'quality' leaves the content hash",
        ),
        (
            text.replace("\"unit\", \"quality\"]", "\"unit\", \"quality\", \"tags\"]"),
            "field 'tags' joins the content hash",
        ),
    ];
    for (t, why) in incompatible {
        match def.change_to(&edit(t)) {
            Change::Incompatible(reason) => assert!(reason.contains(why), "{reason} / {why}"),
            other => panic!("{other:?}, expected: {why}"),
        }
    }
    let newer = edit(with_humidity.replace("version = 1", "version = 3"));
    match newer.change_to(&def) {
        Change::Incompatible(reason) => {
            assert!(reason.contains("version goes back from 3 to 1"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}

/// A stream directory read again: new streams are added, compatible changes taken, streams
/// gone kept, and one incompatible change fails the whole update.
#[test]
fn streams_updated_by_a_directory_read_again() {
    let sensor_text = include_str!("../../../streams/sensor_readings.toml");
    let vehicle_text = include_str!("../../../streams/vehicle_telemetry.toml");
    let humid = format!("{sensor_text}\n[[fields]]\nname = \"humidity\"\ntype = \"float64\"\n");
    let running = Streams::from_sources([("sensor_readings", sensor_text)]).unwrap();
    let loaded = Streams::from_sources([
        ("sensor_readings", humid.as_str()),
        ("vehicle_telemetry", vehicle_text),
    ])
    .unwrap();
    let update = running.updated_by(loaded).unwrap();
    assert_eq!(update.added, ["vehicle_telemetry"]);
    assert_eq!(update.changed, ["sensor_readings"]);
    let sensor = update.streams.get("sensor_readings").unwrap();
    assert!(sensor.field_index("humidity").is_some());
    assert_eq!(update.streams.len(), 2);

    let only_vehicles = Streams::from_sources([("vehicle_telemetry", vehicle_text)]).unwrap();
    let update = running.updated_by(only_vehicles).unwrap();
    assert!(update.changed.is_empty());
    assert_eq!(
        update.streams.len(),
        2,
        "a stream no longer defined is kept"
    );

    let retyped = sensor_text.replace(
        "name = \"quality\"\ntype = \"int64\"",
        "name = \"quality\"\ntype = \"string\"",
    );
    let loaded = Streams::from_sources([
        ("sensor_readings", retyped.as_str()),
        ("vehicle_telemetry", vehicle_text),
    ])
    .unwrap();
    let e = running.updated_by(loaded).unwrap_err();
    assert!(
        e.contains("stream 'sensor_readings': field 'quality' changes type"),
        "{e}"
    );
}
