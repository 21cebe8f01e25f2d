//! Stream definitions added or changed while sinks run.

use super::*;

/// A stream defined after the sink started: a sink whose selection has a glob subscribes by a
/// pattern, finds the new stream's topic at a metadata refresh, reads `streams_dir` again and
/// lands the stream. Its records that came before the definition wait for it (the partition is
/// held and read again from them), none skipped. Before, a new stream took a restart of every
/// sink.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_defined_after_the_start_is_landed_without_a_restart() {
    let (cluster, producer) = mock_cluster(2);
    let (landing, streams) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let shipped = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../streams");
    std::fs::copy(
        shipped.join("sensor_readings.toml"),
        streams.path().join("sensor_readings.toml"),
    )
    .unwrap();
    let mut config = local_sink(&cluster, landing.path(), "later", quick_rotation());
    config.streams_dir = streams.path().to_path_buf();
    config
        .kafka
        .consumer
        .insert("topic.metadata.refresh.interval.ms".into(), "500".into());
    let shutdown = CancellationToken::new();
    let defined = service_kit::load_streams_dir(streams.path()).unwrap();
    let sink = sink::start(config, defined, shutdown.clone())
        .await
        .unwrap();
    let readings = distinct_readings(200);
    for r in &readings {
        let (key, value) = (r["device_id"].as_str().unwrap(), r.to_string());
        let record = FutureRecord::to(TOPIC).key(key).payload(&value);
        producer.send(record, Duration::from_secs(5)).await.unwrap();
    }
    // The vehicle stream's topic and records, then (a few seconds later) its definition.
    cluster
        .create_topic("ingest.vehicle_telemetry", 1, 1)
        .unwrap();
    for i in 0..30 {
        let value = serde_json::json!({"vehicle_id": format!("v{}", i % 3), "recorded_at": 1_767_225_600_000i64 + i, "lat": 1.0, "lon": 2.0}).to_string();
        let record = FutureRecord::to("ingest.vehicle_telemetry")
            .key("v")
            .payload(&value);
        producer.send(record, Duration::from_secs(5)).await.unwrap();
    }
    wait_for("the readings", 60, || {
        sink.stats.records_written.load(Ordering::Relaxed) >= 200
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(sink.stats.records_written.load(Ordering::Relaxed), 200);
    std::fs::copy(
        shipped.join("vehicle_telemetry.toml"),
        streams.path().join("vehicle_telemetry.toml"),
    )
    .unwrap();
    wait_for("the vehicle records", 60, || {
        sink.stats.records_written.load(Ordering::Relaxed) >= 230
    })
    .await;
    shutdown.cancel();
    sink.task.await.unwrap().unwrap();
    assert_eq!(sink.stats.records_written.load(Ordering::Relaxed), 230);
    assert_eq!(sink.stats.dead_letters.load(Ordering::Relaxed), 0);
    let vehicles = read_landing_dir(
        &landing.path().join("landing/vehicle_telemetry"),
        &example_defs(),
    )
    .unwrap();
    assert_eq!(vehicles.rows, 30);
    assert_exactly_once(&readings, &landing.path().join("landing/sensor_readings"));
    drop(cluster);
}

/// A stream's definition changed while the sink runs. A nullable field added (`humidity`,
/// version 2) is taken when the first record that sets it arrives: the partition's open file of
/// the old columns closes, and the record lands in a file with the new column, none of them a
/// dead letter. Before, such records went to the dead letters until every sink restarted. An
/// incompatible edit after it (`quality` retyped, `site` added) is refused at the first record
/// that sets `site`: the running definition stays, so records of the old shape still land and
/// those of the new shape are dead letters; the refusal ends once the file is mended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compatible_definition_change_is_taken_without_a_restart() {
    let (cluster, producer) = mock_cluster(2);
    let (landing, streams) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let file = streams.path().join("sensor_readings.toml");
    let shipped = include_str!("../../../streams/sensor_readings.toml");
    std::fs::write(&file, shipped).unwrap();
    // Files stay open 2 s after their last record, so that the change meets open files.
    let rotation = RotationConfig {
        idle_ms: 2000,
        ..RotationConfig::default()
    };
    let mut config = local_sink(&cluster, landing.path(), "redefined", rotation);
    config.streams_dir = streams.path().to_path_buf();
    let shutdown = CancellationToken::new();
    let defined = service_kit::load_streams_dir(streams.path()).unwrap();
    let sink = sink::start(config, defined, shutdown.clone())
        .await
        .unwrap();
    let readings = distinct_readings(300);
    let (old, new) = readings.split_at(150);
    let send = |r: &serde_json::Value| {
        let (key, value) = (r["device_id"].as_str().unwrap().to_owned(), r.to_string());
        let producer = producer.clone();
        async move { send_plain(&producer, &key, &value).await }
    };
    for r in old {
        send(r).await;
    }
    wait_received(&sink, 150).await;
    let extended = format!(
        "{}\n[[fields]]\nname = \"humidity\"\ntype = \"float64\"\ndoc = \"Relative humidity, %\"\n",
        shipped.replace("version = 1", "version = 2")
    );
    std::fs::write(&file, &extended).unwrap();
    let mut with_humidity = Vec::new();
    for (i, r) in new.iter().enumerate() {
        let mut r = r.clone();
        r["humidity"] = serde_json::json!(40.0 + i as f64);
        send(&r).await;
        with_humidity.push(r);
    }
    wait_for("the records with the new field", 60, || {
        sink.stats.records_written.load(Ordering::Relaxed) >= 300
    })
    .await;
    assert_eq!(sink.stats.dead_letters.load(Ordering::Relaxed), 0);

    // An incompatible edit (`quality` retyped, `site` added): refused when records with `site`
    // come, and the definition with `humidity` stays.
    std::fs::write(
        &file,
        format!("{extended}\n[[fields]]\nname = \"site\"\ntype = \"string\"\n").replace(
            "name = \"quality\"\ntype = \"int64\"",
            "name = \"quality\"\ntype = \"string\"",
        ),
    )
    .unwrap();
    let more = distinct_readings(320);
    let mut sited = more[300..310].to_vec();
    for r in &mut sited {
        r["site"] = serde_json::json!("plant-7");
        send(r).await;
    }
    let kept: Vec<serde_json::Value> = more[310..]
        .iter()
        .map(|r| {
            let mut r = r.clone();
            r["humidity"] = serde_json::json!(1.5);
            r
        })
        .collect();
    for r in &kept {
        send(r).await;
    }
    wait_for("the records after the refused edit", 60, || {
        sink.stats.records_written.load(Ordering::Relaxed) >= 310
            && sink.stats.dead_letters.load(Ordering::Relaxed) >= 10
    })
    .await;
    assert_eq!(sink.stats.definitions_refused.load(Ordering::Relaxed), 1);
    // The file mended: the refusal ends without another record.
    std::fs::write(&file, &extended).unwrap();
    wait_for("the refusal to end", 10, || {
        sink.stats.definitions_refused.load(Ordering::Relaxed) == 0
    })
    .await;
    shutdown.cancel();
    sink.task.await.unwrap().unwrap();
    assert_eq!(sink.stats.records_written.load(Ordering::Relaxed), 310);
    assert_eq!(sink.stats.dead_letters.load(Ordering::Relaxed), 10);

    // Every record once, by the new definition's hashes (`humidity` is not hashed).
    let def = schemas::StreamDef::from_toml(&extended).unwrap();
    let expected: HashSet<_> = old
        .iter()
        .chain(&with_humidity)
        .chain(&kept)
        .map(|r| schemas::check(&def, r.clone()).unwrap().hash)
        .collect();
    let dir = landing.path().join("landing/sensor_readings");
    let verdict = compare(
        &expected,
        &read_landing_dir(&dir, &[std::sync::Arc::new(def)]).unwrap(),
    );
    assert!(verdict.exactly_once(), "{verdict:?}");
    // pyarrow: files of version 1 without the column, files of version 2 with it, and every
    // reading that set it has its value there.
    let read = common::pyarrow(&["--dir", dir.to_str().unwrap()]);
    let (versions, humid) = common::column_added_in(&read, "humidity", "2");
    assert_eq!(versions.len(), 2, "{versions:?}");
    assert_eq!(humid.len(), 160);
    let sum: f64 = humid.iter().sum();
    let want: f64 = (0..150).map(|i| 40.0 + i as f64).sum::<f64>() + 10.0 * 1.5;
    assert_eq!(sum, want);
    drop(cluster);
}
