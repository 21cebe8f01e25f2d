use super::*;

fn decompress(encoding: Encoding, body: Vec<u8>, limit: usize) -> Result<Vec<u8>, ApiError> {
    let streams = schemas::example_streams();
    decompress_for(
        streams.get("sensor_readings").unwrap(),
        encoding,
        body,
        limit,
    )
}

fn decompress_for(
    def: &StreamDef,
    encoding: Encoding,
    body: Vec<u8>,
    limit: usize,
) -> Result<Vec<u8>, ApiError> {
    let mut scratch = Scratch {
        zstd: None,
        plain: Vec::new(),
    };
    decompress_into(
        def,
        encoding,
        &body,
        limit,
        &mut scratch,
        &mut schemas::budget::unlimited,
    )
    .map(|()| scratch.plain)
}

#[test]
fn bodies_compressed_with_the_streams_dictionary_decode_and_others_are_refused() {
    let readings: Vec<String> = (0..1_200)
        .map(|i| {
            format!(
                r#"{{"device_id":"dev-{}","sensor":"temperature","ts":{},"value":{}.5}}"#,
                i % 40,
                1_767_225_600_000u64 + i,
                i % 70
            )
        })
        .collect();
    let samples: Vec<&[u8]> = readings.iter().map(String::as_bytes).collect();
    let dictionary = schemas::dictionary::train(&samples, 4096).unwrap();
    let bytes = dictionary.bytes().to_vec();
    let mut streams = schemas::example_streams();
    streams
        .add_dictionary("sensor_readings", dictionary, true)
        .unwrap();
    let with = streams.get("sensor_readings").unwrap();
    let plain = readings[1_100..].join("\n").into_bytes();
    let mut compressor = zstd::bulk::Compressor::with_dictionary(3, &bytes).unwrap();
    let body = compressor.compress(&plain).unwrap();
    assert_eq!(
        decompress_for(with, Encoding::Zstd, body.clone(), 1 << 20).unwrap(),
        plain
    );

    // A gateway without that dictionary names the problem with its own code.
    let e = decompress(Encoding::Zstd, body, 1 << 20).unwrap_err();
    assert_eq!(e.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(e.code, UNKNOWN_DICTIONARY);

    // A bomb compressed with the dictionary stops at the limit too.
    let bomb = compressor.compress(&vec![b'a'; 10 << 20]).unwrap();
    assert!(bomb.len() < 4096);
    let e = decompress_for(with, Encoding::Zstd, bomb, 1 << 20).unwrap_err();
    assert_eq!(e.status, StatusCode::PAYLOAD_TOO_LARGE);
}

#[test]
fn bombs_stop_at_the_limit() {
    let plain = vec![b'a'; 10 << 20];
    // Streamed frames do not state their size; bulk frames do. Both stop at the limit.
    for bomb in [
        zstd::encode_all(&plain[..], 19).unwrap(),
        zstd::bulk::compress(&plain, 19).unwrap(),
    ] {
        assert!(bomb.len() < 4096);
        let e = decompress(Encoding::Zstd, bomb.clone(), 1 << 20).unwrap_err();
        assert_eq!(e.status, StatusCode::PAYLOAD_TOO_LARGE);
        let ok = decompress(Encoding::Zstd, bomb, 10 << 20).unwrap();
        assert_eq!(ok, plain);
    }
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    std::io::Write::write_all(&mut gz, &plain).unwrap();
    let gz = gz.finish().unwrap();
    let e = decompress(Encoding::Gzip, gz, 1 << 20).unwrap_err();
    assert_eq!(e.status, StatusCode::PAYLOAD_TOO_LARGE);
    let e = decompress(Encoding::Zstd, b"not zstd".to_vec(), 1 << 20).unwrap_err();
    assert_eq!(e.status, StatusCode::BAD_REQUEST);
}

#[test]
fn concatenated_zstd_frames_decode_whole() {
    let (a, b) = (vec![b'a'; 5000], vec![b'b'; 7000]);
    let mut body = zstd::bulk::compress(&a, 3).unwrap();
    body.extend(zstd::bulk::compress(&b, 3).unwrap());
    let out = decompress(Encoding::Zstd, body.clone(), 1 << 20).unwrap();
    assert_eq!(out, [a, b].concat());
    let e = decompress(Encoding::Zstd, body, 10_000).unwrap_err();
    assert_eq!(e.status, StatusCode::PAYLOAD_TOO_LARGE);
}

#[test]
fn values_are_the_clients_text_when_it_is_a_plain_object() {
    let def = schemas::example_streams()
        .get("sensor_readings")
        .unwrap()
        .clone();
    let body = concat!(
        " {\"value\":2.50, \"ts\":1, \"sensor\":\"s\",\"device_id\":\"d1\"} \r\n",
        "{\"device_id\":\"d\\u0032\",\"sensor\":\"s\",\"ts\":1,\"value\":1}\n",
        "{\"device_id\":\"d3\",\"sensor\":\"s\",\"ts\":1,\"value\":1,\"value\":2}\n",
    );
    let checked = check_plain(
        &def,
        BodyFormat::Ndjson,
        body.as_bytes(),
        &LimitsConfig::default(),
        &mut schemas::budget::unlimited,
    )
    .unwrap();
    let values: Vec<(&str, &[u8])> = checked.prepared.iter().collect();
    let canonical = |line: &str| {
        let valid = schemas::check_bytes(&def, line.as_bytes()).unwrap();
        schemas::wire::encode_value(&def, &valid.record)
    };
    let lines: Vec<&str> = body.lines().collect();
    // Key order, spacing and number spelling are the client's; only the ends are trimmed.
    assert_eq!(values[0], ("d1", lines[0].trim().as_bytes()));
    // An escape or a repeated key: encoded canonically, so every reader agrees.
    assert_eq!(values[1].0, "d2");
    assert_eq!(values[1].1, canonical(lines[1]));
    assert_eq!(values[2].1, canonical(lines[2]));
    assert!(
        std::str::from_utf8(values[2].1)
            .unwrap()
            .contains("\"value\":2")
    );
    assert_eq!(checked.prepared.len(), 3);
}
