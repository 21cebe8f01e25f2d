//! The scanner against the serde path: whatever the scanner accepts, the serde path accepts
//! with the same record; and the scanner does accept the common shape (otherwise the first
//! property would hold trivially).

use proptest::prelude::*;
use serde_json::json;

use crate::StreamDef;
use crate::arrow::{BatchBuilder, RowMeta, record_batch};
use crate::typed::decode_record_serde;
use crate::value::Value;

fn sensor() -> std::sync::Arc<StreamDef> {
    crate::example_streams()
        .get("sensor_readings")
        .unwrap()
        .clone()
}

fn vehicle() -> std::sync::Arc<StreamDef> {
    crate::example_streams()
        .get("vehicle_telemetry")
        .unwrap()
        .clone()
}

/// The sensor stream with its `tags` map hashed too, so that forwarding must build a map.
fn sensor_hashing_tags() -> StreamDef {
    let toml = crate::EXAMPLE_STREAMS[0].1.replace(
        r#"hash_fields = ["device_id", "sensor", "ts", "value", "unit", "quality"]"#,
        r#"hash_fields = ["device_id", "sensor", "ts", "value", "unit", "quality", "tags"]"#,
    );
    let def = StreamDef::from_toml(&toml).unwrap();
    assert!(def.hash_fields.len() == 7 && def.hashed.iter().all(|h| *h));
    def
}

/// Decodes `text` both ways; fails if the scanner accepted what the serde path decodes
/// differently or rejects, or if forwarding (no record built) disagrees with decoding. Returns
/// whether the scanner accepted.
fn agree(def: &StreamDef, text: &[u8]) -> Result<bool, TestCaseError> {
    let fast = super::decode_verbatim(def, text);
    let shown = String::from_utf8_lossy(text);
    prop_assert!(read_alike(def, text), "{}", shown);
    match (
        &fast,
        super::forwardable(
            def,
            text.into(),
            &mut crate::AtOnce,
            crate::value::partition_key,
        ),
    ) {
        (Some((record, true)), Some((hash, key))) => {
            prop_assert_eq!(hash, crate::content_hash(def, record), "{}", shown);
            prop_assert_eq!(key, record.partition_key(def), "{}", shown);
        }
        (Some((_, true)), None) => prop_assert!(false, "not forwardable: {}", shown),
        (_, Some(_)) => prop_assert!(false, "forwardable, not verbatim: {}", shown),
        (_, None) => {}
    }
    let forward = crate::check_bytes_forward(def, text);
    let full = crate::check_bytes_verbatim(def, text);
    // Without the key, the same hash and canonical record.
    let hashed = crate::check_bytes_hashed_in(def, text, &mut crate::AtOnce);
    // Its common case alone: the hash exactly when no record is needed.
    prop_assert_eq!(
        crate::forwardable_hash_in(def, text, &mut crate::AtOnce),
        hashed
            .as_ref()
            .ok()
            .filter(|h| h.canonical.is_none())
            .map(|h| h.hash),
        "{}",
        shown
    );
    // The Parquet rows' common case: a row exactly when the text may stand for the record,
    // with its hash, and a body of it the same as one of the record.
    match (crate::verbatim_row_in(def, text, &mut crate::AtOnce), &full) {
        (Some(row), Ok((valid, true))) => {
            prop_assert_eq!(row.hash, valid.hash, "{}", shown);
            let mut from_row = crate::columnar::BodyBuilder::new(def, 1);
            from_row.push_row(&row);
            let mut from_record = crate::columnar::BodyBuilder::new(def, 1);
            from_record.push(&valid.record);
            prop_assert_eq!(
                from_row.finish(def, 3).unwrap(),
                from_record.finish(def, 3).unwrap(),
                "{}",
                shown
            );
        }
        (None, Ok((_, true))) => prop_assert!(false, "no row: {}", shown),
        (Some(_), _) => prop_assert!(false, "a row, not verbatim: {}", shown),
        (None, _) => {}
    }
    prop_assert_eq!(
        hashed.map(|h| (h.hash, h.canonical)),
        forward.clone().map(|f| (f.hash, f.canonical)),
        "{}",
        shown
    );
    prop_assert_eq!(
        forward.map(|f| (f.hash, f.key, f.canonical.is_none())),
        full.map(|(v, verbatim)| (v.hash, v.record.partition_key(def), verbatim)),
        "{}",
        shown
    );
    prop_assert!(rows_agree(def, text)?, "{}", shown);
    if let Some((record, verbatim)) = &fast {
        if *verbatim {
            // Every key once: the object's members (counted outside strings, which carry no
            // escapes here) are as many as the distinct keys serde_json keeps.
            let json: serde_json::Value = serde_json::from_slice(text).unwrap();
            prop_assert_eq!(top_level_members(text), json.as_object().unwrap().len());
        }
        let slow = decode_record_serde(def, text);
        prop_assert_eq!(
            Ok(record.clone()),
            slow,
            "{}",
            String::from_utf8_lossy(text)
        );
    }
    Ok(fast.is_some())
}

/// Whether the scanner gives the same answer and fields for `text` in a window (see
/// [`super::Bytes`]) as in place, with what follows it in the window either blank or more of the
/// same text.
fn read_alike(def: &StreamDef, text: &[u8]) -> bool {
    let scan = |line: super::Line<'_>| {
        let mut fields = vec![Value::Null; def.fields.len()];
        let once = super::scan(def, line, super::Build::All, &mut fields);
        (once, fields)
    };
    let in_place = scan(text.into());
    [
        b"\n".repeat(super::WINDOW),
        [b"\r", text].concat().repeat(super::WINDOW),
    ]
    .iter()
    .all(|after| {
        let buffer = [text, after].concat();
        let line = super::Line::within(&buffer, 0, text.len());
        line.window.is_some() == (text.len() <= super::WINDOW_LINE) && scan(line) == in_place
    })
}

/// Whether a row checked for landing (no record built) has the hash and error of
/// [`crate::check_bytes`] and lands as the same Arrow row as its record.
fn rows_agree(def: &StreamDef, text: &[u8]) -> Result<bool, TestCaseError> {
    let meta = |hash| RowMeta {
        ingest_ts: 1,
        partition: 2,
        offset: 3,
        hash,
    };
    Ok(
        match (
            crate::check_bytes_row(def, text),
            crate::check_bytes(def, text),
        ) {
            (Ok(row), Ok(valid)) => {
                prop_assert_eq!(row.hash, valid.hash);
                // Checked in a group, as the sink's worker checks ready messages: eight copies
                // fill the lanes.
                let mut group = crate::HashGroup::new();
                let grouped: Vec<_> = (0..8)
                    .map(|_| crate::check_bytes_row_in(def, text, &mut group))
                    .collect::<Result<_, _>>()
                    .unwrap();
                group.finish();
                for row in grouped {
                    prop_assert_eq!(group.get(row.hash), valid.hash);
                }
                let mut built = BatchBuilder::new(def, crate::arrow::HashColumn::Full, 1);
                built.push(&row, meta(valid.hash));
                let expected = record_batch(
                    def,
                    crate::arrow::HashColumn::Full,
                    &[(valid.record, meta(valid.hash))],
                )
                .unwrap();
                built.finish().unwrap() == expected
            }
            (Err(a), Err(b)) => {
                let mut group = crate::HashGroup::new();
                let grouped = crate::check_bytes_row_in(def, text, &mut group);
                a == b && grouped.err() == Some(b) && group.is_empty()
            }
            _ => false,
        },
    )
}

/// The members of the outer object of `text`, a JSON text whose strings carry no escapes.
fn top_level_members(text: &[u8]) -> usize {
    let (mut depth, mut in_string, mut members) = (0, false, 0);
    for &c in text {
        match c {
            b'"' => in_string = !in_string,
            _ if in_string => {}
            b'{' | b'[' => depth += 1,
            b'}' | b']' => depth -= 1,
            b':' if depth == 1 => members += 1,
            _ => {}
        }
    }
    members
}

/// JSON texts and near-JSON texts for one value, of every kind the fields meet.
fn arb_value_text() -> impl Strategy<Value = String> {
    let pool = [
        "\"dev-1\"",
        "\"\"",
        "\"a\\\"b\"",
        "\"\\u00e9\"",
        "\"é°\"",
        "\"\u{1}\"",
        "\"tab\there\"",
        "\"2024-05-01T12:00:00Z\"",
        "\"2024-05-01T12:00:00.123456789Z\"",
        "\"2024-02-30T00:00:00Z\"",
        "\"2024-05-01t12:00:00z\"",
        "\"2016-12-31T23:59:60Z\"",
        "\"2024-05-01T12:00:00+02:00\"",
        "0",
        "-0",
        "01",
        "-01",
        "1.",
        "1.5",
        "-1e3",
        "1E+2",
        "2e-1",
        ".5",
        "+1",
        "1.7e12",
        "-",
        "1e",
        "9223372036854775807",
        "9223372036854775808",
        "-9223372036854775808",
        "-9223372036854775809",
        "18446744073709551616",
        "1e400",
        "-1e400",
        "4.9e-324",
        "123456789012345678901234567890",
        "0.1e-5",
        "1767225600000",
        "1767225600000000",
        "99999999999999",
        "100000000000000",
        "253402300799999999",
        "253402300800000000",
        "9007199254740993",
        "9007199254740993.0",
        "true",
        "false",
        "null",
        "nul",
        "nulll",
        "tru",
        "[]",
        "[1, \"a\", null]",
        "[1,]",
        "[\"x\",\"y\"]",
        "[[1]]",
        "{}",
        "{\"a\":\"b\"}",
        "{\"a\":\"b\",\"a\":\"c\"}",
        "{\"b\":\"1\", \"a\":\"2\"}",
        "{\"a\":1}",
        "{\"a\":{\"b\":1}}",
        "{\"a\":null}",
        "{\"a\":\"b\",}",
        "{\"a\" \"b\"}",
    ];
    prop_oneof![
        prop::sample::select(pool.to_vec()).prop_map(str::to_owned),
        // Numbers by a looser grammar than JSON's: leading zeros, bare dots and exponents.
        "-?[0-9]{1,3}(\\.[0-9]{0,2})?([eE][+-]?[0-9]{0,3})?",
        // Strings with escapes, quotes, control characters and multi-byte characters.
        "\"[a-z\\\\\"\u{1}\u{7f}é]{0,4}\"",
    ]
}

fn arb_ws() -> impl Strategy<Value = &'static str> {
    prop::sample::select(vec!["", "", "", " ", "\n\t", "\r\n", "\u{a0}"])
}

/// Objects of the stream's required members (most of the time) followed by members of the
/// stream's keys and a few others with values of any kind (a repeated key overrides), joined by
/// any whitespace, sometimes with a trailing byte.
fn arb_object_text() -> impl Strategy<Value = String> {
    let key = prop::sample::select(vec![
        "device_id",
        "sensor",
        "ts",
        "value",
        "unit",
        "quality",
        "tags",
        "extra",
        "Ts",
        "device\\u005fid",
    ]);
    let member = (
        arb_ws(),
        key,
        arb_ws(),
        arb_ws(),
        arb_value_text(),
        arb_ws(),
    );
    (
        prop::bool::weighted(0.8),
        prop::collection::vec(member, 0..3),
        arb_ws(),
        prop::sample::select(vec!["", "", "", "x", ",", "}", "{}"]),
    )
        .prop_map(|(required, members, ws, tail)| {
            let mut parts: Vec<String> = Vec::new();
            if required {
                parts.push(r#""device_id":"d","sensor":"s","ts":0,"value":1"#.into());
            }
            parts.extend(
                members
                    .into_iter()
                    .map(|(a, k, b, c, v, d)| format!("{a}\"{k}\"{b}:{c}{v}{d}")),
            );
            format!("{ws}{{{}}}{ws}{tail}", parts.join(","))
        })
}

/// A valid reading in the common shape (no escapes needed), written by serde_json.
fn arb_plain_reading() -> impl Strategy<Value = String> {
    (
        "[a-z0-9-]{1,12}",
        "[a-zé]{1,8}",
        0i64..4_000_000_000_000_000,
        any::<f64>().prop_filter("finite", |v| v.is_finite()),
        prop::option::of("[a-zA-Z°/]{0,4}"),
        prop::option::of(any::<i64>()),
        prop::collection::btree_map("[a-z]{1,5}", "[ -!#-\\[\\]-~]{0,6}", 0..4),
        any::<bool>(),
    )
        .prop_map(
            |(device, sensor, ts, value, unit, quality, tags, rfc3339)| {
                let ts = if rfc3339 {
                    json!(crate::value::format_timestamp(ts))
                } else {
                    json!(ts)
                };
                json!({"device_id": device, "sensor": sensor, "ts": ts, "value": value,
                   "unit": unit, "quality": quality, "tags": tags})
                .to_string()
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn scanner_agrees_with_serde_on_any_object(text in arb_object_text()) {
        agree(&sensor(), text.as_bytes())?;
        agree(&sensor_hashing_tags(), text.as_bytes())?;
    }

    /// A group of records, checked into a [`crate::HashGroup`] (both paths, the scanner's and
    /// the record's; encodings written into room and pushed, when a hashed map makes the
    /// scanner push), gets the hashes each record gets alone; and so does the next group, in
    /// the same group's buffers, which still hold the bytes of the first.
    #[test]
    fn a_hash_group_hashes_as_each_record_alone(
        texts in prop::collection::vec(prop_oneof![arb_plain_reading(), arb_object_text()], 0..40),
    ) {
        let (plain, tags) = (sensor(), sensor_hashing_tags());
        let mut group = crate::HashGroup::new();
        for round in 0..2 {
            let mut pending = Vec::new();
            for (i, text) in texts.iter().enumerate() {
                let text = text.as_bytes();
                let def = if (i + round) % 3 == 2 { &tags } else { &plain };
                let p = if (i + round) % 2 == 0 {
                    crate::check_bytes_forward_in(def, text, &mut group).map(|f| f.hash)
                } else {
                    crate::check_bytes_verbatim_in(def, text, &mut group).map(|(v, _)| v.hash)
                };
                let alone = crate::check_bytes_forward(def, text).map(|f| f.hash);
                prop_assert_eq!(p.is_ok(), alone.is_ok());
                if let (Ok(p), Ok(alone)) = (p, alone) {
                    pending.push((p, alone));
                }
            }
            prop_assert_eq!(group.len(), pending.len());
            group.finish();
            for (p, alone) in pending {
                prop_assert_eq!(group.get(p), alone);
            }
            group.clear();
            prop_assert!(group.is_empty());
        }
    }

    #[test]
    fn scanner_takes_the_common_shape(text in arb_plain_reading()) {
        prop_assert!(agree(&sensor(), text.as_bytes())?, "scanner declined {}", text);
        prop_assert!(agree(&sensor_hashing_tags(), text.as_bytes())?, "declined {}", text);
    }

    #[test]
    fn scanner_agrees_with_serde_on_damaged_records(
        text in arb_plain_reading(),
        at in any::<prop::sample::Index>(),
        byte in any::<u8>(),
        how in 0u8..3,
    ) {
        let mut bytes = text.into_bytes();
        let i = at.index(bytes.len());
        match how {
            0 => bytes[i] = byte,
            1 => { bytes.remove(i); }
            _ => bytes.insert(i, byte),
        }
        agree(&sensor(), &bytes)?;
        agree(&sensor_hashing_tags(), &bytes)?;
    }

    /// Keys in any order: those the scanner does not find where it looks first
    /// ([`StreamDef::next_keys`]) are read as strings, with the same result.
    #[test]
    fn scanner_takes_keys_in_any_order(
        text in arb_plain_reading(),
        order in Just((0..7).collect::<Vec<usize>>()).prop_shuffle(),
        space in prop::sample::select(vec!["", " ", "\r\n\t"]),
    ) {
        let value: serde_json::Value = serde_json::from_str(&text).unwrap();
        let members: Vec<String> = value
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| format!("{}{space}:{v}", json!(k)))
            .collect();
        prop_assert_eq!(members.len(), order.len());
        let shuffled = order.iter().map(|&i| members[i].as_str()).collect::<Vec<_>>().join(",");
        let shuffled = format!("{{{shuffled}}}");
        prop_assert!(agree(&sensor(), shuffled.as_bytes())?, "scanner declined {}", shuffled);
        prop_assert!(agree(&vehicle(), shuffled.as_bytes()).is_ok());
    }

    #[test]
    fn short_slices_compare_as_slices(
        a in prop::collection::vec(0u8..3, 0..40),
        flip in any::<prop::sample::Index>(),
    ) {
        let mut b = a.clone();
        prop_assert!(super::same_short(&a, &b));
        if !b.is_empty() {
            b[flip.index(a.len())] ^= 1;
            prop_assert!(!super::same_short(&a, &b), "{:?} {:?}", a, b);
        }
    }

    #[test]
    fn numbers_read_as_the_standard_parser_reads_them(
        text in "-?(0|[1-9][0-9]{0,19})(\\.[0-9]{1,20})?([eE][+-]?[0-9]{1,3})?",
    ) {
        let buffer = [text.as_bytes(), &[b'\n'; super::WINDOW]].concat();
        let window = super::Window(buffer.first_chunk().unwrap());
        let mut p = super::Scanner { text: &text, b: window, i: 0 };
        let n = p.number().unwrap();
        prop_assert_eq!(p.i, text.len());
        let mut s = super::Scanner { text: &text, b: text.as_bytes(), i: 0 };
        let in_place = s.number().unwrap();
        prop_assert_eq!(s.i, text.len());
        prop_assert_eq!(
            (in_place.mantissa, in_place.exp10, in_place.integer, in_place.negative),
            (n.mantissa, n.exp10, n.integer, n.negative)
        );
        let expected: f64 = text.parse().unwrap();
        prop_assert_eq!(n.float().map(f64::to_bits), Some(expected.to_bits()), "{}", text);
        if n.integer {
            prop_assert_eq!(n.int(), text.parse::<i64>().ok(), "{}", text);
        }
    }

    #[test]
    fn string_ends_are_found_block_by_block(
        // Runs of plain text, so that ends lie past whole blocks of 16 bytes too.
        text in "[a-z é°\u{7f}]{0,40}[a-z\"\\\\\u{1}\u{1f} é°\u{7f}]{0,20}",
        from in 0usize..20,
    ) {
        let b = text.as_bytes();
        let from = from.min(b.len());
        // The end of the line, where the zeros past it begin, when nothing comes before.
        let expected = b[from..]
            .iter()
            .position(|&c| c == b'"' || c == b'\\' || c < 0x20)
            .map_or(b.len(), |n| from + n);
        let buffer = [b, &[b'\n'; super::WINDOW]].concat();
        let window = super::Window(buffer.first_chunk().unwrap());
        prop_assert_eq!(super::string_end(b, from), expected);
        prop_assert_eq!(super::string_end_words(b, from), expected);
        prop_assert_eq!(super::string_end(window, from), expected);
        prop_assert_eq!(super::string_end_words(window, from), expected);
    }

    #[test]
    fn scanner_never_panics(body in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = super::decode(&sensor(), &body);
    }
}

#[test]
fn scanner_declines_what_only_serde_can_word() {
    let def = sensor();
    for text in [
        r#"{"device_id":"d","sensor":"s","ts":0,"value":1,"extra":1}"#,
        r#"{"device_id":"d","sensor":"s","ts":0}"#,
        r#"{"device_id":"d","sensor":"s","ts":0,"value":"1"}"#,
        r#"{"device_id":"d\n","sensor":"s","ts":0,"value":1}"#,
        r#"{"device_id":"d","sensor":"s","ts":0,"value":1} x"#,
        r#"{"device_id":"d","sensor":"s","ts":0,"value":01}"#,
        r#"{"device_id":"d","sensor":"s","ts":0,"value":1,"quality":1.5}"#,
    ] {
        assert!(super::decode(&def, text.as_bytes()).is_none(), "{text}");
    }
    // What it takes, and its numbers.
    let text = r#" { "device_id" : "d", "sensor":"s","ts":1767225600000, "value":-0,
                    "quality":1e2, "tags":{"b":"1","a":"2","b":"3"} } "#;
    let record = super::decode(&def, text.as_bytes()).unwrap();
    assert_eq!(Ok(record), decode_record_serde(&def, text.as_bytes()));
}

#[test]
fn verbatim_means_each_key_once_and_no_escapes() {
    let def = sensor();
    let plain = br#" {"device_id":"d","sensor":"s","ts":0,"value":1.5,"tags":{"a":"1","a":"2"}}"#;
    let (_, verbatim) = crate::check_bytes_verbatim(&def, plain).unwrap();
    assert!(
        verbatim,
        "repeated keys inside a map are the value's business"
    );
    for text in [
        r#"{"device_id":"d","sensor":"s","ts":0,"value":1,"value":2}"#,
        r#"{"device_id":"d\u0041","sensor":"s","ts":0,"value":1}"#,
    ] {
        let (valid, verbatim) = crate::check_bytes_verbatim(&def, text.as_bytes()).unwrap();
        assert!(!verbatim, "{text}");
        assert_eq!(Ok(valid), crate::check_bytes(&def, text.as_bytes()));
    }
    assert!(crate::check_bytes_verbatim(&def, b"{}").is_err());
}

/// A vehicle record with a list that holds a null.
const VEHICLE_WITH_LIST: &str = r#"{"vehicle_id":"v-1","recorded_at":"2026-01-01T00:00:00Z",
    "lat":1.5,"lon":-2,"ignition":true,"fault_codes":["P0001",null,"P0420"]}"#;

#[test]
fn forwarding_hashes_the_lists_and_maps_it_builds() {
    let vehicle = vehicle();
    let tags = sensor_hashing_tags();
    for (def, text, other) in [
        (
            &*vehicle,
            VEHICLE_WITH_LIST,
            r#"{"vehicle_id":"v-1","recorded_at":"2026-01-01T00:00:00Z","lat":1.5,"lon":-2,
                "ignition":true,"fault_codes":["P0001",null]}"#,
        ),
        (
            &tags,
            r#"{"device_id":"d","sensor":"s","ts":0,"value":1,"tags":{"b":"2","a":"1"}}"#,
            r#"{"device_id":"d","sensor":"s","ts":0,"value":1,"tags":{"a":"1"}}"#,
        ),
    ] {
        let forward = crate::check_bytes_forward(def, text.as_bytes()).unwrap();
        let full = crate::check_bytes(def, text.as_bytes()).unwrap();
        assert_eq!(forward.canonical, None, "{text}");
        assert_eq!(forward.hash, full.hash, "{text}");
        let changed = crate::check_bytes_forward(def, other.as_bytes()).unwrap();
        assert_ne!(
            changed.hash, forward.hash,
            "the list or map is hashed: {other}"
        );
    }
    // An unhashed map is checked even when it is not built.
    let bad = r#"{"device_id":"d","sensor":"s","ts":0,"value":1,"tags":{"a":1}}"#;
    assert!(
        super::forwardable(&sensor(), bad.as_bytes().into(), &mut crate::AtOnce, |_| ()).is_none()
    );
    assert!(crate::check_bytes_forward(&sensor(), bad.as_bytes()).is_err());
}

/// A stream of `n` fields, every one hashed: strings, integers, floats and, last, a map (so
/// that forwarding builds one); the first field is the partition key, the second the event
/// time.
fn wide_stream(n: usize) -> StreamDef {
    let names: Vec<String> = (0..n).map(|i| format!("f{i}")).collect();
    let mut toml = format!(
        "name = \"wide\"\nversion = 1\npartition_key_field = \"f0\"\nevent_time_field = \"f1\"\nhash_fields = {names:?}\n"
    );
    for (i, name) in names.iter().enumerate() {
        let ty = match i {
            _ if i == n - 1 => "map<string>",
            1 => "timestamp",
            _ => ["string", "int64", "float64"][i % 3],
        };
        toml += &format!(
            "[[fields]]\nname = \"{name}\"\ntype = \"{ty}\"\nrequired = {}\n",
            i < 2
        );
    }
    StreamDef::from_toml(&toml).unwrap()
}

/// Streams of up to 8, up to 16 and more fields keep the scanner's slots in different places
/// (two arrays on the stack and a vector): each agrees with the serde path, is forwarded
/// without a record, and hashes every field.
#[test]
fn streams_of_any_width_are_forwarded() {
    for n in [3, 8, 9, 16, 17, 40] {
        let def = wide_stream(n);
        let values = |changed: Option<usize>| -> String {
            let members: Vec<String> = (0..n)
                .map(|i| {
                    let k = usize::from(changed == Some(i));
                    let value = match i {
                        _ if i == n - 1 => format!(r#"{{"k":"{k}"}}"#),
                        _ => {
                            [format!(r#""s{k}""#), format!("{k}"), format!("{k}.5")][i % 3].clone()
                        }
                    };
                    format!(r#""f{i}":{value}"#)
                })
                .collect();
            format!("{{{}}}", members.join(","))
        };
        let text = values(None);
        assert!(agree(&def, text.as_bytes()).unwrap(), "{n} fields: {text}");
        let hash = crate::forwardable_hash_in(&def, text.as_bytes(), &mut crate::AtOnce);
        assert_eq!(
            hash,
            Some(crate::check_bytes(&def, text.as_bytes()).unwrap().hash)
        );
        for i in [0, n / 2, n - 1] {
            let other = values(Some(i));
            assert_ne!(
                crate::forwardable_hash_in(&def, other.as_bytes(), &mut crate::AtOnce),
                hash,
                "{n} fields, field {i} changed: {other}"
            );
        }
    }
}

#[test]
fn rows_land_as_their_records() {
    let vehicle = vehicle();
    let sensor = sensor();
    for (def, text, scanned) in [
        (&*vehicle, VEHICLE_WITH_LIST, true),
        (
            &*vehicle,
            r#"{"vehicle_id":"v-2","recorded_at":"2026-01-01T00:00:00Z","lat":1.5,"lon":-2}"#,
            true,
        ),
        (
            &*sensor,
            r#"{"device_id":"d","sensor":"s","ts":0,"value":1,"tags":{"b":"2","a":"1"}}"#,
            true,
        ),
        // A repeated key: the last value counts, on both paths.
        (
            &*sensor,
            r#"{"device_id":"d","sensor":"s","ts":0,"value":1,"value":2.5,"quality":null}"#,
            true,
        ),
        // An escape: the serde path builds the record.
        (
            &*sensor,
            r#"{"device_id":"d\u00e9","sensor":"s","ts":0,"value":1,"unit":"\"C\""}"#,
            false,
        ),
        // Invalid: the same error.
        (&*sensor, r#"{"device_id":"d","sensor":"s","ts":0}"#, false),
        (
            &*sensor,
            r#"{"device_id":"d","sensor":"s","ts":0,"value":"x"}"#,
            false,
        ),
    ] {
        assert!(rows_agree(def, text.as_bytes()).unwrap(), "{text}");
        let row = crate::check_bytes_row(def, text.as_bytes());
        let was_scanned = matches!(
            row,
            Ok(crate::Row {
                fields: crate::RowFields::Scanned(_),
                ..
            })
        );
        assert_eq!(was_scanned, scanned, "{text}");
    }
}

#[test]
fn a_builder_makes_one_batch_per_finish() {
    let def = sensor();
    let mut builder = BatchBuilder::new(&def, crate::arrow::HashColumn::Full, 2);
    let lines = [
        r#"{"device_id":"a","sensor":"s","ts":1,"value":1,"tags":{"x":"1"}}"#,
        r#"{"device_id":"b\n","sensor":"s","ts":2,"value":2}"#,
        r#"{"device_id":"c","sensor":"s","ts":3,"value":3,"unit":"u"}"#,
    ];
    let mut records = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let row = crate::check_bytes_row(&def, line.as_bytes()).unwrap();
        let meta = RowMeta {
            ingest_ts: 10,
            partition: 0,
            offset: i as i64,
            hash: row.hash,
        };
        records.push((
            crate::check_bytes(&def, line.as_bytes()).unwrap().record,
            meta,
        ));
        builder.push(&row, meta);
        if i == 0 {
            assert_eq!(
                builder.finish().unwrap(),
                record_batch(&def, crate::arrow::HashColumn::Full, &records).unwrap()
            );
            records.clear();
        }
    }
    assert_eq!(builder.len(), 2);
    assert_eq!(
        builder.finish().unwrap(),
        record_batch(&def, crate::arrow::HashColumn::Full, &records).unwrap()
    );
    assert!(builder.is_empty());
}

/// Lists and maps land with their items, in streams that hash them and in streams that do not
/// (the forwarding path only checks those): read back from the Arrow arrays, not compared with
/// the record path, which shares the column code.
#[test]
fn nested_columns_hold_each_rows_items() {
    use arrow::array::{Array, AsArray};
    type Strings = Vec<Option<String>>;

    fn strings(array: &dyn Array) -> Strings {
        array
            .as_string::<i32>()
            .iter()
            .map(|s| s.map(str::to_owned))
            .collect()
    }
    let s = |v: &str| Some(v.to_owned());

    let vehicle = vehicle();
    let vehicle_toml = crate::EXAMPLE_STREAMS[1].1.replace(
        "partition_key_field = \"vehicle_id\"",
        "partition_key_field = \"vehicle_id\"\nhash_fields = [\"vehicle_id\", \"recorded_at\"]",
    );
    let vehicle_unhashed = StreamDef::from_toml(&vehicle_toml).unwrap();
    let head = r#"{"vehicle_id":"v","recorded_at":"2026-01-01T00:00:00Z","lat":1,"lon":2"#;
    for (def, hashed) in [(&*vehicle, true), (&vehicle_unhashed, false)] {
        let codes = def.field_index("fault_codes").unwrap();
        assert_eq!(def.hashed[codes], hashed);
        let batch = batch_of(
            def,
            &[
                format!(r#"{head},"fault_codes":["P0001",null,"P0420"]}}"#),
                format!(r#"{head},"fault_codes":null}}"#),
                format!(r#"{head},"fault_codes":[ ]}}"#),
                format!("{head}}}"),
                format!(r#"{head},"fault_codes":["P1"]}}"#),
            ],
        );
        let list = batch.column(codes).as_list::<i32>();
        let rows: Vec<Option<Strings>> = (0..list.len())
            .map(|i| list.is_valid(i).then(|| strings(&list.value(i))))
            .collect();
        assert_eq!(
            rows,
            [
                Some(vec![s("P0001"), None, s("P0420")]),
                None,
                Some(vec![]),
                None,
                Some(vec![s("P1")]),
            ],
            "hashed: {hashed}"
        );
    }

    let head = r#"{"device_id":"d","sensor":"s","ts":0,"value":1"#;
    for (def, hashed) in [
        (sensor().as_ref().clone(), false),
        (sensor_hashing_tags(), true),
    ] {
        let tags = def.field_index("tags").unwrap();
        assert_eq!(def.hashed[tags], hashed);
        let batch = batch_of(
            &def,
            &[
                // Keys come out sorted; a repeated key keeps its last value.
                format!(r#"{head},"tags":{{"site":"b","line":"2","site":"c"}}}}"#),
                format!(r#"{head},"tags":null}}"#),
                format!(r#"{head},"tags":{{}}}}"#),
                format!(r#"{head},"tags":{{"k":null}}}}"#),
            ],
        );
        let map = batch.column(tags).as_map();
        let rows: Vec<Option<(Strings, Strings)>> = (0..map.len())
            .map(|i| {
                map.is_valid(i).then(|| {
                    let entries = map.value(i);
                    (strings(entries.column(0)), strings(entries.column(1)))
                })
            })
            .collect();
        assert_eq!(
            rows,
            [
                Some((vec![s("line"), s("site")], vec![s("2"), s("c")])),
                None,
                Some((vec![], vec![])),
                Some((vec![s("k")], vec![None])),
            ],
            "hashed: {hashed}"
        );
    }
}

/// One batch of `lines`, each pushed as a checked row.
fn batch_of(def: &StreamDef, lines: &[String]) -> arrow::record_batch::RecordBatch {
    let mut builder = BatchBuilder::new(def, crate::arrow::HashColumn::Full, lines.len());
    for (i, line) in lines.iter().enumerate() {
        let row = crate::check_bytes_row(def, line.as_bytes()).unwrap();
        assert!(matches!(row.fields, crate::RowFields::Scanned(_)), "{line}");
        let meta = RowMeta {
            ingest_ts: 0,
            partition: 0,
            offset: i as i64,
            hash: row.hash,
        };
        builder.push(&row, meta);
    }
    builder.finish().unwrap()
}
