use proptest::prelude::*;
use serde_json::{Value as Json, json};

use crate::arrow::{RowMeta, arrow_schema, record_batch};
use crate::decode::{BodyFormat, decode_body, ndjson_lines, parse_line};
use crate::value::{EPOCH_MS_LIMIT, format_timestamp};
use crate::wire::{decode_value, encode_value};
use crate::*;

mod definitions;
mod landing;

fn sensor() -> std::sync::Arc<StreamDef> {
    example_streams().get("sensor_readings").unwrap().clone()
}

fn reading() -> Json {
    json!({
        "device_id": "dev-1", "sensor": "temp", "ts": "2024-05-01T12:00:00.123456Z",
        "value": 21.5, "unit": "degC", "quality": 192, "tags": {"site": "a", "line": "3"}
    })
}

fn err(json: Json) -> String {
    validate(&sensor(), json).unwrap_err().to_string()
}

#[test]
fn field_type_round_trips() {
    for t in [
        "string",
        "bool",
        "int64",
        "float64",
        "timestamp",
        "list<float64>",
        "map<string>",
    ] {
        assert_eq!(FieldType::parse(t).unwrap().to_string(), t);
    }
}

#[test]
fn validation_errors_name_field_expected_and_got() {
    let mut r = reading();
    r["value"] = json!("hot");
    assert_eq!(
        err(r),
        "field 'value': expected float64, got string \"hot\""
    );
    let mut r = reading();
    r["quality"] = json!(1.5);
    assert!(err(r).starts_with("field 'quality': expected int64"));
    let mut r = reading();
    r.as_object_mut().unwrap().remove("device_id");
    assert_eq!(err(r), "field 'device_id' is required but missing or null");
    let mut r = reading();
    r["device_id"] = Json::Null;
    assert_eq!(err(r), "field 'device_id' is required but missing or null");
    let mut r = reading();
    r["extra"] = json!(1);
    assert_eq!(err(r), "field 'extra' is not part of the stream's schema");
    let mut r = reading();
    r["tags"]["site"] = json!({"nested": true});
    assert_eq!(
        err(r),
        "field 'tags.site': expected string, got object with 1 keys"
    );
    let mut r = reading();
    r["sensor"] = json!(["a"]);
    assert_eq!(
        err(r),
        "field 'sensor': expected string, got array of 1 items"
    );
    assert_eq!(
        err(json!([1])),
        "record must be a JSON object, got array of 1 items"
    );
    let mut r = reading();
    r["ts"] = json!("yesterday");
    assert!(err(r).starts_with("field 'ts': expected timestamp"));
}

#[test]
fn list_errors_carry_the_index() {
    let v = example_streams().get("vehicle_telemetry").unwrap().clone();
    let rec = json!({"vehicle_id": "v", "recorded_at": 0, "lat": 1, "lon": 2,
                     "fault_codes": ["P0001", 7]});
    let e = validate(&v, rec).unwrap_err().to_string();
    assert_eq!(e, "field 'fault_codes[1]': expected string, got number 7");
}

#[test]
fn timestamps_accept_rfc3339_ms_and_us() {
    let micros = 1_714_564_800_123_000_i64;
    for ts in [
        json!("2024-05-01T12:00:00.123Z"),
        json!("2024-05-01T14:00:00.123+02:00"),
        json!(1_714_564_800_123_i64),
        json!(micros),
        json!(1_714_564_800_123.0),
    ] {
        let mut r = reading();
        r["ts"] = ts.clone();
        let rec = validate(&sensor(), r).unwrap();
        assert_eq!(rec.values[2], Value::Timestamp(micros), "{ts}");
    }
    assert_eq!(format_timestamp(micros), "2024-05-01T12:00:00.123000Z");
    // The boundary between milliseconds and microseconds.
    let mut r = reading();
    r["ts"] = json!(EPOCH_MS_LIMIT - 1);
    assert_eq!(
        validate(&sensor(), r).unwrap().values[2],
        Value::Timestamp((EPOCH_MS_LIMIT - 1) * 1000)
    );
    for bad in [
        json!("10000-01-01T00:00:00Z"),
        json!(i64::MAX),
        json!(1.5),
        json!(true),
        json!(1e300),
    ] {
        let mut r = reading();
        r["ts"] = bad.clone();
        assert!(validate(&sensor(), r).is_err(), "{bad}");
    }
}

#[test]
fn huge_numbers() {
    let mut r = reading();
    r["quality"] = json!(i64::MAX);
    assert_eq!(
        validate(&sensor(), r).unwrap().values[5],
        Value::Int(i64::MAX)
    );
    let mut r = reading();
    r["quality"] = serde_json::from_str("99999999999999999999").unwrap();
    assert!(err(r).starts_with("field 'quality': expected int64"));
    let mut r = reading();
    r["quality"] = json!(1e300);
    assert!(err(r).contains("got number"));
    let body = br#"{"device_id":"d","sensor":"s","ts":0,"value":1e999}"#;
    let out = decode_body(BodyFormat::Ndjson, body).unwrap();
    assert!(matches!(out[0], Err(RecordError::Malformed(_))), "{out:?}");
}

/// A body of `n` readings, numbered by their value, each written as `line` makes it.
fn readings_body(n: usize, line: impl Fn(usize, Json) -> String) -> String {
    (0..n)
        .map(|i| {
            let mut r = reading();
            r["value"] = json!(i);
            line(i, r)
        })
        .collect()
}

/// The lines of a body are read through windows on it (see `scan::Line`) wherever a whole window
/// fits before the body's end, and hash as the same lines read as slices (checked for
/// forwarding, and as rows).
#[test]
fn body_lines_are_read_in_place() {
    let def = sensor();
    let body = readings_body(40, |i, r| match i % 3 {
        0 => format!("{r}\n\r\n"),
        _ => format!("{r}\n"),
    });
    let bytes = body.as_bytes();
    let lines: Vec<_> = crate::decode::ndjson_lines_in(bytes).collect();
    assert_eq!(
        lines.iter().map(|l| l.bytes()).collect::<Vec<_>>(),
        ndjson_lines(bytes).collect::<Vec<_>>()
    );
    assert_eq!(lines.len(), 40);
    let mut windowed = 0;
    for line in &lines {
        let start = line.bytes().as_ptr() as usize - bytes.as_ptr() as usize;
        assert_eq!(
            line.windowed(),
            bytes.len() - start >= 320,
            "line at {start}"
        );
        windowed += usize::from(line.windowed());
        let hash = crate::forwardable_hash_in(&def, *line, &mut crate::AtOnce);
        assert!(hash.is_some());
        assert_eq!(
            hash,
            crate::forwardable_hash_in(&def, line.bytes(), &mut crate::AtOnce)
        );
        // The rows of the agent's Parquet batches, read both ways, hash alike.
        let row_hash =
            |line: Line<'_>| crate::verbatim_row_in(&def, line, &mut crate::AtOnce).map(|r| r.hash);
        assert_eq!(row_hash(*line), hash);
        assert_eq!(row_hash(line.bytes().into()), hash);
    }
    assert!(windowed >= 35, "{windowed} of 40");
}

/// A body's records checked for forwarding as [`Line`]s of the body (the gateway's way) give
/// what they give as slices: the same hashes, partition keys and canonical records for records
/// that pass (through the common shape or the full check), the same errors for those that fail.
#[test]
fn body_records_check_alike_in_place_and_as_slices() {
    let def = sensor();
    let body = readings_body(60, |i, r| {
        match i % 5 {
            // A repeated key, an escape, a wrong type and an unknown key among plain records.
            1 => format!("{}\n", r.to_string().replacen('{', "{\"value\":0,", 1)),
            2 => format!("{}\n", r.to_string().replace("\"temp\"", "\"t\\u0065mp\"")),
            3 if i % 2 == 1 => {
                format!("{}\n", r.to_string().replace(&format!(":{i}}}"), ":\"x\"}"))
            }
            3 => format!("{}\n", r.to_string().replace("\"unit\"", "\"u\"")),
            _ => format!("{r}\n"),
        }
    });
    let bytes = body.as_bytes();
    let lines = crate::decode::split_body_in(BodyFormat::Ndjson, bytes).unwrap();
    assert_eq!(lines.len(), 60);
    let (mut passed, mut failed) = (0, 0);
    for line in &lines {
        let in_place = check_bytes_forward_in(&def, *line, &mut AtOnce);
        assert_eq!(in_place, check_bytes_forward(&def, line.bytes()));
        match in_place {
            Ok(_) => passed += 1,
            Err(_) => failed += 1,
        }
    }
    assert!(
        passed >= 40 && failed >= 5,
        "{passed} passed, {failed} failed"
    );
    let items = crate::decode::split_body_in(BodyFormat::JsonArray, b"[{\"a\":1}, 2]").unwrap();
    let items: Vec<_> = items.iter().map(|l| l.bytes()).collect();
    assert_eq!(items, [&b"{\"a\":1}"[..], b"2"]);
}

#[test]
fn ndjson_edge_cases() {
    let body = "\u{feff}{\"a\":1}\r\n\r\n   \n{\"b\":\"ü→😀\"}\n\t\n{\"c\":3}";
    let lines: Vec<_> = ndjson_lines(body.as_bytes()).collect();
    assert_eq!(lines.len(), 3);
    let out = decode_body(BodyFormat::Ndjson, body.as_bytes()).unwrap();
    assert_eq!(out[1].as_ref().unwrap()["b"], json!("ü→😀"));
    assert!(decode_body(BodyFormat::Ndjson, b"").unwrap().is_empty());
    assert!(
        decode_body(BodyFormat::Ndjson, b"\n\r\n")
            .unwrap()
            .is_empty()
    );
    // A bad line rejects only itself, and invalid UTF-8 is malformed, not a panic.
    let out = decode_body(BodyFormat::Ndjson, b"{\"a\":1}\n{oops\n\xff\xfe\n[1]").unwrap();
    assert!(out[0].is_ok());
    assert!(matches!(out[1], Err(RecordError::Malformed(_))));
    assert!(matches!(out[2], Err(RecordError::Malformed(_))));
    assert!(
        out[3].is_ok(),
        "an array line is decoded; validation rejects it"
    );
}

#[test]
fn json_array_bodies() {
    let out = decode_body(BodyFormat::JsonArray, "\u{feff}[{\"a\":1}, 2]".as_bytes()).unwrap();
    assert_eq!(out.len(), 2);
    assert_eq!(
        decode_body(BodyFormat::JsonArray, b"{\"a\":1}").unwrap_err(),
        DecodeError::NotAnArray("an object".into())
    );
    assert!(matches!(
        decode_body(BodyFormat::JsonArray, b"[{\"a\":"),
        Err(DecodeError::Malformed(_))
    ));
    assert_eq!(
        BodyFormat::from_content_type("application/json; charset=utf-8"),
        Some(BodyFormat::JsonArray)
    );
    assert_eq!(
        BodyFormat::from_content_type("Application/X-NDJSON"),
        Some(BodyFormat::Ndjson)
    );
    assert_eq!(BodyFormat::from_content_type("text/plain"), None);
}

#[test]
fn hash_ignores_key_order_number_format_and_timestamp_notation() {
    let def = sensor();
    let a = r#"{"device_id":"d","sensor":"s","ts":"2024-01-01T00:00:00Z","value":1,"quality":5}"#;
    let b = r#"{"quality":5.0,"value":1.0e0,"ts":1704067200000,"sensor":"s","device_id":"d"}"#;
    let c = r#"{"quality":5,"value":1.00,"ts":1704067200000000,"sensor":"s","device_id":"d","unit":null}"#;
    let h = |s: &str| check(&def, serde_json::from_str(s).unwrap()).unwrap().hash;
    assert_eq!(h(a), h(b));
    assert_eq!(h(a), h(c));
    // Tags are not hashed in sensor_readings; value is.
    let d = r#"{"device_id":"d","sensor":"s","ts":"2024-01-01T00:00:00Z","value":1,"quality":5,"tags":{"x":"y"}}"#;
    assert_eq!(h(a), h(d));
    let e = r#"{"device_id":"d","sensor":"s","ts":"2024-01-01T00:00:00Z","value":1.0000001,"quality":5}"#;
    assert_ne!(h(a), h(e));
}

#[test]
fn hash_is_stable_across_releases() {
    // Changing the canonical encoding changes every hash in every landing zone: this value
    // must only change together with the key context.
    let def = sensor();
    let r = check(&def, reading()).unwrap();
    assert_eq!(
        r.hash.to_hex(),
        blake3_reference(),
        "canonical hash of the reference reading changed"
    );
}

#[test]
fn adding_a_nullable_field_keeps_hashes() {
    let def = sensor();
    let text = include_str!("../../streams/sensor_readings.toml");
    let extended = format!(
        "{}\n[[fields]]\nname = \"firmware\"\ntype = \"string\"\n",
        text.replace("hash_fields = [", "hash_fields = [\"firmware\", ")
    );
    let extended = StreamDef::from_toml(&extended).unwrap();
    assert!(extended.hash_fields.len() > def.hash_fields.len());
    let old = check(&def, reading()).unwrap().hash;
    assert_eq!(check(&extended, reading()).unwrap().hash, old);
    let mut set = reading();
    set["firmware"] = json!("1.2");
    assert_ne!(check(&extended, set).unwrap().hash, old);
}

#[test]
fn long_strings_hash_by_their_whole_length() {
    // Lengths of 128 bytes and more take two LEB128 bytes; a string and its extension, and a
    // string moved between two fields, must not collide.
    let def = sensor();
    let with = |device: &str, sensor: &str| {
        let mut r = reading();
        r["device_id"] = json!(device);
        r["sensor"] = json!(sensor);
        check(&def, r).unwrap().hash
    };
    let long = "d".repeat(300);
    assert_ne!(with(&long, "s"), with(&long[..299], "s"));
    assert_ne!(with(&long, "s"), with(&long[..128], "s"));
    assert_ne!(with("ab", "c"), with("a", "bc"));
    assert_eq!(with(&long, "s"), with(&long, "s"));
}

/// The expected hash of `reading()`, computed by hand from the documented encoding (version 2:
/// keyed BLAKE3, null fields left out, LEB128 lengths).
fn blake3_reference() -> String {
    let key = blake3::derive_key("edge-ingest record content hash v2", b"");
    let mut h = blake3::Hasher::new_keyed(&key);
    let mut field = |name: &str, payload: &[u8]| {
        h.update(&[name.len() as u8]);
        h.update(name.as_bytes());
        h.update(payload);
    };
    let s = |tag: u8, text: &str| {
        let mut v = vec![tag, text.len() as u8];
        v.extend(text.as_bytes());
        v
    };
    let tagged = |tag: u8, bytes: [u8; 8]| {
        let mut v = vec![tag];
        v.extend(bytes);
        v
    };
    field("device_id", &s(4, "dev-1"));
    field("quality", &tagged(2, 192i64.to_le_bytes()));
    field("sensor", &s(4, "temp"));
    field("ts", &tagged(5, 1_714_564_800_123_456i64.to_le_bytes()));
    field("unit", &s(4, "degC"));
    field("value", &tagged(3, 21.5f64.to_bits().to_le_bytes()));
    h.finalize().to_hex().to_string()
}

#[test]
fn wire_value_round_trips() {
    let def = sensor();
    let r = check(&def, reading()).unwrap();
    let bytes = encode_value(&def, &r.record);
    let back = decode_value(&def, &bytes).unwrap();
    assert_eq!(back, r.record);
    assert_eq!(content_hash(&def, &back), r.hash);
    let text = String::from_utf8(bytes).unwrap();
    assert!(
        text.contains("\"ts\":\"2024-05-01T12:00:00.123456Z\""),
        "{text}"
    );
}

#[test]
fn arrow_batch_has_schema_types_and_metadata() {
    use ::arrow::datatypes::{DataType, TimeUnit};
    let v = example_streams().get("vehicle_telemetry").unwrap().clone();
    let rows: Vec<_> = [
        json!({"vehicle_id": "v1", "recorded_at": 1, "lat": 1, "lon": 2, "fault_codes": ["a", null]}),
        json!({"vehicle_id": "v2", "recorded_at": 2, "lat": 3, "lon": 4, "ignition": true}),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, j)| {
        let r = check(&v, j).unwrap();
        (r.record, RowMeta { ingest_ts: 10, partition: 0, offset: i as i64, hash: r.hash })
    })
    .collect();
    let batch = record_batch(&v, crate::arrow::HashColumn::Full, &rows).unwrap();
    assert_eq!(batch.num_rows(), 2);
    assert_eq!(batch.num_columns(), v.fields.len() + 4);
    let schema = arrow_schema(&v, crate::arrow::HashColumn::Full);
    assert_eq!(
        schema.field_with_name("recorded_at").unwrap().data_type(),
        &DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()))
    );
    assert!(!schema.field_with_name("vehicle_id").unwrap().is_nullable());
    assert!(schema.field_with_name("ignition").unwrap().is_nullable());
    assert_eq!(schema.metadata()["stream"], "vehicle_telemetry");
    let faults = batch.column_by_name("fault_codes").unwrap();
    assert_eq!(faults.null_count(), 1);
    let sensor = sensor();
    let r = check(&sensor, reading()).unwrap();
    let meta = RowMeta {
        ingest_ts: 1,
        partition: 3,
        offset: 9,
        hash: r.hash,
    };
    let batch = record_batch(&sensor, crate::arrow::HashColumn::Full, &[(r.record, meta)]).unwrap();
    assert!(matches!(
        batch.column_by_name("tags").unwrap().data_type(),
        DataType::Map(_, false)
    ));
}

fn arb_reading() -> impl Strategy<Value = Json> {
    (
        "[a-z0-9-]{1,12}",
        prop::sample::select(vec!["temp", "pressure", "rpm"]),
        0i64..4_000_000_000_000,
        any::<i32>(),
        prop::option::of("[a-zA-Z°]{0,4}"),
        prop::option::of(0i64..256),
        prop::collection::btree_map("[a-z]{1,5}", "\\PC{0,6}", 0..4),
    )
        .prop_map(|(device, sensor, ts, v, unit, q, tags)| {
            json!({"device_id": device, "sensor": sensor, "ts": ts, "value": f64::from(v) / 8.0,
                   "unit": unit, "quality": q, "tags": tags})
        })
}

/// Rewrites a record with the same meaning: keys reversed, numbers as floats or with exponent,
/// timestamps as RFC 3339 or microseconds, nulls dropped.
fn reformat(json: &Json, variant: u8) -> String {
    let obj = json.as_object().unwrap();
    let mut parts = Vec::new();
    for (k, v) in obj.iter().rev() {
        let text = match (k.as_str(), v) {
            (_, Json::Null) if variant.is_multiple_of(2) => continue,
            ("ts", Json::Number(n)) => {
                let ms = n.as_i64().unwrap();
                match variant % 3 {
                    0 => format!("{}", ms * 1000),
                    1 => format!("\"{}\"", format_timestamp(ms * 1000)),
                    _ => format!("{ms}.0"),
                }
            }
            ("value", Json::Number(n)) => format!("{:e}", n.as_f64().unwrap()),
            ("quality", Json::Number(n)) => format!("{}.0", n.as_i64().unwrap()),
            (_, other) => other.to_string(),
        };
        parts.push(format!("{}:{}", Json::String(k.clone()), text));
    }
    format!("{{{}}}", parts.join(" , "))
}

proptest! {
    #[test]
    fn hash_is_independent_of_formatting(r in arb_reading(), variant in 0u8..6) {
        let def = sensor();
        let original = check(&def, r.clone()).unwrap();
        let text = reformat(&r, variant);
        let again: Json = serde_json::from_str(&text).unwrap();
        // Epoch values below the ms/us boundary stay in ms; only compare when unambiguous.
        let ms = r["ts"].as_i64().unwrap();
        prop_assume!(variant % 3 != 0 || ms * 1000 >= EPOCH_MS_LIMIT);
        let other = check(&def, again).unwrap();
        prop_assert_eq!(original.hash, other.hash, "{}", text);
        prop_assert_eq!(original.record, other.record);
    }

    #[test]
    fn different_values_hash_differently(r in arb_reading(), delta in 1i32..1000) {
        let def = sensor();
        let mut changed = r.clone();
        changed["value"] = json!(r["value"].as_f64().unwrap() + f64::from(delta));
        prop_assert_ne!(check(&def, r).unwrap().hash, check(&def, changed).unwrap().hash);
    }

    #[test]
    fn wire_round_trip_keeps_hash(r in arb_reading()) {
        let def = sensor();
        let v = check(&def, r).unwrap();
        let back = decode_value(&def, &encode_value(&def, &v.record)).unwrap();
        prop_assert_eq!(content_hash(&def, &back), v.hash);
    }

    #[test]
    fn decoders_never_panic(body in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_body(BodyFormat::Ndjson, &body);
        let _ = decode_body(BodyFormat::JsonArray, &body);
    }

    #[test]
    fn ndjson_line_count_ignores_blank_lines_and_crlf(n in 0usize..20, crlf: bool, blanks in 0usize..3) {
        let nl = if crlf { "\r\n" } else { "\n" };
        let mut body = String::new();
        for i in 0..n {
            body.push_str(&format!("{{\"i\":{i}}}{nl}"));
            body.push_str(&nl.repeat(blanks));
        }
        let out = decode_body(BodyFormat::Ndjson, body.as_bytes()).unwrap();
        prop_assert_eq!(out.len(), n);
        for (i, r) in out.iter().enumerate() {
            prop_assert_eq!(&r.as_ref().unwrap()["i"], &json!(i));
        }
    }
}

/// One fault put into a valid reading: a field's value replaced, a field removed or an
/// unknown field added.
fn arb_fault() -> impl Strategy<Value = (usize, Json)> {
    let any_json = prop_oneof![
        Just(Json::Null),
        any::<bool>().prop_map(Json::Bool),
        any::<i64>().prop_map(|i| json!(i)),
        any::<u64>().prop_map(|u| json!(u)),
        (-1e300f64..1e300).prop_map(|f| json!(f)),
        "\\PC{0,8}".prop_map(Json::String),
        Just(json!("2024-05-01T12:00:00Z")),
        Just(json!([1, "a", null])),
        Just(json!({"k": "v", "n": 1})),
        Just(json!({"k": {"deep": true}})),
    ];
    (0usize..9, any_json)
}

proptest! {
    #[test]
    fn typed_decoding_equals_the_value_path(r in arb_reading(), fault in prop::option::of(arb_fault())) {
        let def = sensor();
        let mut r = r;
        let names = ["device_id", "sensor", "ts", "value", "unit", "quality", "tags"];
        match fault {
            Some((i, v)) if i < names.len() => { r[names[i]] = v; }
            Some((7, _)) => { r.as_object_mut().unwrap().remove("value"); }
            Some((_, v)) => { r["extra"] = v; }
            None => {}
        }
        let raw = r.to_string();
        let slow = parse_line(raw.as_bytes()).and_then(|j| check(&def, j));
        let fast = check_bytes(&def, raw.as_bytes());
        prop_assert_eq!(fast, slow, "{}", raw);
    }

    #[test]
    fn typed_decoder_never_panics(body in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = check_bytes(&sensor(), &body);
    }
}

#[test]
fn typed_decoding_rejects_what_the_value_path_rejects() {
    let def = sensor();
    for raw in [
        "",
        "[1,2]",
        "\"x\"",
        "7",
        "null",
        "{",
        "{} x",
        "{\"device_id\":\"d\"}{}",
    ] {
        let slow = parse_line(raw.as_bytes()).and_then(|j| check(&def, j));
        assert!(slow.is_err(), "{raw}");
        let fast = check_bytes(&def, raw.as_bytes());
        match (&slow, &fast) {
            (Err(RecordError::Malformed(_)), Err(RecordError::Malformed(_))) => {}
            _ => assert_eq!(fast, slow, "{raw}"),
        }
    }
}

fn chrono_format(micros: i64) -> String {
    chrono::DateTime::<chrono::Utc>::from_timestamp_micros(micros)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true))
        .unwrap_or_default()
}

#[test]
fn timestamp_fast_paths_match_chrono_at_the_edges() {
    use crate::value::{chrono_timestamp_from_str, timestamp_from_str};
    for micros in [
        -62_135_596_800_000_000, // 0001-01-01
        253_402_300_799_999_999, // 9999-12-31T23:59:59.999999
        -1,
        0,
        951_782_400_000_000, // 2000-02-29
        4_107_542_399_999_999,
    ] {
        assert_eq!(format_timestamp(micros), chrono_format(micros));
    }
    for text in [
        "2024-02-29T00:00:00Z",
        "2023-02-29T00:00:00Z",
        "1900-02-29T00:00:00Z",
        "2000-02-29T12:00:00.5Z",
        "2024-04-31T00:00:00Z",
        "2024-13-01T00:00:00Z",
        "2024-00-10T00:00:00Z",
        "2024-01-01T24:00:00Z",
        "2024-01-01T23:60:00Z",
        "2016-12-31T23:59:60Z",
        "2024-01-01T00:00:00.Z",
        "2024-01-01T00:00:00.1234567891Z",
        "2024-01-01T00:00:00.123456789Z",
        "2024-01-01t00:00:00z",
        "2024-01-01T00:00:00+02:00",
        "0000-12-31T23:59:59Z",
        "0001-01-01T00:00:00Z",
        "9999-12-31T23:59:59.999999999Z",
        "2024-01-01T00:00:0xZ",
        "2024-01-01T00:00:00.12a4Z",
    ] {
        assert_eq!(
            timestamp_from_str(text),
            chrono_timestamp_from_str(text),
            "{text}"
        );
    }
}

proptest! {
    #[test]
    fn timestamp_format_equals_chrono(micros in -62_135_596_800_000_000i64..=253_402_300_799_999_999) {
        let text = format_timestamp(micros);
        prop_assert_eq!(&text, &chrono_format(micros));
        prop_assert_eq!(crate::value::timestamp_from_str(&text), Some(micros));
    }

    #[test]
    fn timestamp_parse_equals_chrono(
        y in 0u32..10000, mo in 0u32..14, d in 0u32..33, h in 0u32..26, mi in 0u32..62,
        s in 0u32..62, frac in prop::option::of("[0-9]{1,10}"),
    ) {
        let frac = frac.map(|f| format!(".{f}")).unwrap_or_default();
        let text = format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}{frac}Z");
        prop_assert_eq!(
            crate::value::timestamp_from_str(&text),
            crate::value::chrono_timestamp_from_str(&text),
            "{}", text
        );
    }
}

proptest! {
    /// Every finite float64 survives decoding exactly (serde_json's default float parser can be
    /// off in the last bit; the workspace enables its `float_roundtrip` feature).
    #[test]
    fn floats_decode_to_the_same_bits(v in any::<f64>().prop_filter("finite", |v| v.is_finite())) {
        let def = sensor();
        let line = format!(
            r#"{{"device_id":"d","sensor":"s","ts":0,"value":{}}}"#,
            serde_json::to_string(&v).unwrap()
        );
        let record = crate::typed::decode_record(&def, line.as_bytes()).unwrap();
        let i = def.field_index("value").unwrap();
        // Validation maps -0.0 to 0.0.
        let want = if v == 0.0 { 0.0 } else { v };
        prop_assert_eq!(&record.values[i], &Value::Float(want));
        if let Value::Float(got) = record.values[i] {
            prop_assert_eq!(got.to_bits(), want.to_bits());
        }
    }
}

fn parquet_round_trip(def: &StreamDef, records: &[Record]) -> Vec<Record> {
    let body = crate::columnar::encode_parquet(def, records, 3).unwrap();
    let ndjson = crate::columnar::parquet_to_ndjson(def, body.into(), usize::MAX).unwrap();
    ndjson_lines(&ndjson)
        .map(|line| check_bytes(def, line).unwrap().record)
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// A Parquet body decodes to the same records (as a multiset: rows are sorted by series).
    #[test]
    fn parquet_bodies_decode_to_the_same_records(rs in prop::collection::vec(arb_reading(), 0..40)) {
        let def = sensor();
        let records: Vec<Record> = rs.into_iter().map(|r| validate(&def, r).unwrap()).collect();
        let key = |r: &Record| encode_value(&def, r);
        let mut expected: Vec<Vec<u8>> = records.iter().map(key).collect();
        let mut got: Vec<Vec<u8>> = parquet_round_trip(&def, &records).iter().map(key).collect();
        expected.sort();
        got.sort();
        prop_assert_eq!(got, expected);
    }
}

#[test]
fn parquet_bodies_with_lists_and_maps_round_trip() {
    let def = example_streams().get("vehicle_telemetry").unwrap().clone();
    let mut records = Vec::new();
    for i in 0..50 {
        let line = json!({
            "vehicle_id": format!("v{}", i % 3), "recorded_at": 1_700_000_000_000i64 + i * 1000,
            "lat": 52.0 + i as f64 / 1e4, "lon": 13.0, "speed_kmh": if i % 4 == 0 { Json::Null } else { json!(i) },
            "odometer_m": i * 10, "ignition": i % 2 == 0,
            "fault_codes": if i % 5 == 0 { json!([]) } else if i % 5 == 1 { Json::Null } else { json!(["P0300", format!("U{i}")]) }
        });
        records.push(check(&def, line).unwrap().record);
    }
    assert!(!records.is_empty());
    let mut got = parquet_round_trip(&def, &records);
    let mut expected = records.clone();
    let key = |r: &Record| encode_value(&def, r);
    got.sort_by_key(key);
    expected.sort_by_key(key);
    assert_eq!(got, expected);
}

#[test]
fn parquet_bodies_fail_clearly() {
    let def = sensor();
    let records = vec![validate(&def, reading()).unwrap(); 100];
    let body = crate::columnar::encode_parquet(&def, &records, 3).unwrap();
    let limit = crate::columnar::parquet_to_ndjson(&def, body.clone().into(), 500).unwrap_err();
    assert_eq!(limit, DecodeError::TooLarge(500));
    let garbage =
        crate::columnar::parquet_to_ndjson(&def, b"PAR1 not parquet".to_vec().into(), 1 << 20)
            .unwrap_err()
            .to_string();
    assert!(
        garbage.starts_with("malformed JSON body: Parquet body:"),
        "{garbage}"
    );
    let other = example_streams().get("vehicle_telemetry").unwrap().clone();
    let wrong = crate::columnar::parquet_to_ndjson(&other, body.into(), 1 << 20)
        .unwrap_err()
        .to_string();
    assert!(wrong.contains("is not a field of the stream"), "{wrong}");
}

/// Bodies the fuzzer (`schemas/fuzz`, target `parquet_body`) found to panic the parquet crate
/// are malformed bodies like any other.
#[test]
fn parquet_bodies_that_panic_the_reader_are_malformed() {
    let bodies: [&[u8]; 2] = [
        // An assertion on the footer's metadata.
        include_bytes!("testdata/parquet-negative-column-start.bin"),
        // A division by zero in the byte-array column reader.
        include_bytes!("testdata/parquet-divide-by-zero.bin"),
    ];
    for body in bodies {
        for def in example_streams().iter() {
            let e =
                crate::columnar::parquet_to_ndjson(def, body.to_vec().into(), 1 << 20).unwrap_err();
            // Another stream's body is refused by its first column before it is read.
            assert!(
                matches!(e, DecodeError::Malformed(_) | DecodeError::UnknownColumn(_)),
                "{e:?}"
            );
        }
    }
}

/// `n` valid NDJSON lines of `def` (sensor readings or vehicle telemetry): few series, so rows
/// share keys and times, with nulls, empty and missing lists and maps among them.
pub(crate) fn sample_lines(def: &StreamDef, n: usize) -> Vec<Vec<u8>> {
    (0..n as i64)
        .map(|i| {
            let r = i.wrapping_mul(2_654_435_761) % 1_000;
            let sensor = ["temp", "rpm", "flow"][(r % 3) as usize];
            let unit = ["degC", "bar"][(r % 2) as usize];
            let line = if def.name == "sensor_readings" {
                json!({
                    "device_id": format!("dev-{}", r % 37), "sensor": sensor,
                    "ts": 1_700_000_000_000i64 + r % 50, "value": r as f64 / 8.0,
                    "unit": if r % 7 == 0 { Json::Null } else { json!(unit) },
                    "quality": if r % 5 == 0 { Json::Null } else { json!(r % 256) },
                    "tags": match r % 4 { 0 => Json::Null, 1 => json!({}), _ => json!({"site": format!("s{}", r % 3), "line": "1"}) }
                })
            } else {
                json!({
                    "vehicle_id": format!("v{}", r % 11), "recorded_at": 1_700_000_000_000i64 + r % 40,
                    "lat": 52.0 + r as f64 / 1e4, "lon": 13.0, "speed_kmh": if r % 4 == 0 { Json::Null } else { json!(r) },
                    "odometer_m": r * 10, "ignition": r % 2 == 0,
                    "fault_codes": match r % 5 { 0 => json!([]), 1 => Json::Null, _ => json!(["P0300", format!("U{r}"), Json::Null]) }
                })
            };
            line.to_string().into_bytes()
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]
    /// A Parquet body's rows come back ordered by series (the partition key, then the other
    /// string fields, nulls first), then event time, records that tie in arrival order.
    #[test]
    fn parquet_body_rows_are_in_series_then_time_order(
        picks in prop::collection::vec(0usize..400, 0..200),
        vehicles in any::<bool>(),
    ) {
        let name = if vehicles { "vehicle_telemetry" } else { "sensor_readings" };
        let def = example_streams().get(name).unwrap().clone();
        let lines = sample_lines(&def, 400);
        let records: Vec<Record> = picks
            .iter()
            .map(|&i| check_bytes(&def, &lines[i]).unwrap().record)
            .collect();
        let series: Vec<usize> = std::iter::once(def.partition_key)
            .chain((0..def.fields.len()).filter(|&i| {
                i != def.partition_key && def.fields[i].ty == FieldType::String
            }))
            .collect();
        let mut expected = records.clone();
        expected.sort_by(|a, b| {
            series
                .iter()
                .map(|&i| {
                    let key = |v: &Value| match v {
                        Value::Str(s) => Some(s.to_string()),
                        _ => None,
                    };
                    key(&a.values[i]).cmp(&key(&b.values[i]))
                })
                .find(|o| o.is_ne())
                .unwrap_or(std::cmp::Ordering::Equal)
                .then_with(|| a.event_time(&def).cmp(&b.event_time(&def)))
        });
        let body = crate::columnar::encode_parquet(&def, &records, 3).unwrap();
        let ndjson = crate::columnar::parquet_to_ndjson(&def, body.into(), usize::MAX).unwrap();
        let got: Vec<&[u8]> = ndjson_lines(&ndjson).collect();
        let expected: Vec<Vec<u8>> = expected.iter().map(|r| encode_value(&def, r)).collect();
        prop_assert_eq!(got, expected.iter().map(Vec::as_slice).collect::<Vec<_>>());
    }
}
