//! Adoption of landing files written before a crash, and topics created again.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sink_adopts_a_file_written_before_a_crash() {
    // The sink's first file ends inside the crashed sink's range: all of it is adopted.
    if common::in_own_process("exactly_once::adoption::sink_adopts_a_file_written_before_a_crash") {
        adoption_case(25).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sink_adopts_a_shorter_file_and_lands_the_rest() {
    // The sink's first file reaches past the crashed sink's range: the rows after it are
    // re-encoded into the next file.
    if common::in_own_process(
        "exactly_once::adoption::sink_adopts_a_shorter_file_and_lands_the_rest",
    ) {
        adoption_case(60).await;
    }
}

async fn adoption_case(max_records: usize) {
    let streams = schemas::example_streams();
    let def = streams.get("sensor_readings").unwrap().clone();
    let (cluster, producer) = mock_cluster(1);

    // 150 distinct readings; offsets 100..110 re-send earlier ones, offset 120 is garbage.
    let readings = distinct_readings(150);
    let mut values: Vec<Vec<u8>> = readings
        .iter()
        .map(|r| r.to_string().into_bytes())
        .collect();
    for i in 100..110 {
        values.insert(i, values[i - 100].clone());
    }
    values.insert(120, b"{not json".to_vec());
    for (i, v) in values.iter().enumerate() {
        send_with_ingest_ts(&producer, "k", v, &(BASE_TS + i as i64).to_string()).await;
    }

    // The crashed sink's file: offsets 0..=39, never committed.
    let landing = tempfile::tempdir().unwrap();
    let store = ObjectStore::Local(landing.path().to_path_buf());
    let data = file_of_offsets_0_to_39(&def, &readings[..40], BASE_TS);
    let key = object_key("landing", "sensor_readings", BASE_TS, 0, 0);
    assert_eq!(
        store.put_if_absent(&key, data).await.unwrap(),
        PutOutcome::Created
    );

    let (sink, shutdown) = start_local_sink(
        &cluster,
        landing.path(),
        "exactly-once",
        RotationConfig {
            idle_ms: 300,
            max_records,
            ..RotationConfig::default()
        },
    )
    .await;
    wait_written(&sink, 110).await;
    // Let an idle period pass so that any wrongly re-written file would show.
    tokio::time::sleep(Duration::from_millis(800)).await;
    shutdown.cancel();
    sink.task.await.unwrap().unwrap();

    assert!(sink.stats.adopted_files.load(Ordering::Relaxed) >= 1);
    assert_eq!(sink.stats.landing_conflicts.load(Ordering::Relaxed), 0);
    // Offsets 0..=39 are in the crashed sink's file: read again and not written again.
    assert_eq!(sink.stats.adopted_records.load(Ordering::Relaxed), 40);
    assert_eq!(
        sink.stats.records_settled(),
        sink.stats.records_received.load(Ordering::Relaxed),
        "{:?}",
        sink.stats
    );
    assert_eq!(sink.stats.records_received.load(Ordering::Relaxed), 161);
    assert_eq!(sink.stats.duplicates_dropped.load(Ordering::Relaxed), 10);
    assert_eq!(sink.stats.dead_letters.load(Ordering::Relaxed), 1);
    // The same counts on /metrics: the test has the process to itself.
    let metrics = service_kit::install_metrics().render();
    for (series, value) in [
        (
            r#"sink_discarded_records_total{stream="sensor_readings",reason="duplicate",intentional="true"}"#,
            10,
        ),
        (
            r#"sink_dead_letter_records_total{stream="sensor_readings"}"#,
            1,
        ),
    ] {
        assert!(
            metrics.lines().any(|l| l == format!("{series} {value}")),
            "{series} {value} not in:\n{metrics}"
        );
    }
    let expected: HashSet<_> = readings
        .iter()
        .map(|r| schemas::check(&def, r.clone()).unwrap().hash)
        .collect();
    let landed = read_landing_dir(landing.path(), &example_defs()).unwrap();
    let verdict = compare(&expected, &landed);
    assert!(verdict.exactly_once(), "{verdict:?}");
    assert_eq!(landed.rows, 150);

    // The undecodable record is in the dead-letter location with its offset and reason.
    let mut dead = Vec::new();
    for entry in walk(&landing.path().join("landing/_dead_letters")) {
        for line in std::fs::read_to_string(entry).unwrap().lines() {
            dead.push(serde_json::from_str::<serde_json::Value>(line).unwrap());
        }
    }
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0]["offset"], 120);
    assert!(
        dead[0]["reason"]
            .as_str()
            .unwrap()
            .starts_with("malformed JSON")
    );
    assert_eq!(dead[0]["payload_hex"], hex_of(b"{not json"));
    drop(cluster);
}

/// The object at a file's key cannot be read for a while (here: a folder stands where it
/// goes; on S3, a GET failing after the conflicting PUT): the sink retries the read as it
/// retries writes, instead of failing, and adopts the object once it can read it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_object_to_adopt_that_cannot_be_read_yet_is_read_again() {
    let streams = schemas::example_streams();
    let def = streams.get("sensor_readings").unwrap().clone();
    let (cluster, producer) = mock_cluster(1);
    let readings = distinct_readings(60);
    for (i, r) in readings.iter().enumerate() {
        let ts = (BASE_TS + i as i64).to_string();
        send_with_ingest_ts(&producer, "k", r.to_string().as_bytes(), &ts).await;
    }
    // The crashed sink's file of offsets 0..=39, not readable at first.
    let data = file_of_offsets_0_to_39(&def, &readings[..40], BASE_TS);
    let key = object_key("landing", "sensor_readings", BASE_TS, 0, 0);
    let landing = tempfile::tempdir().unwrap();
    let path = landing.path().join(&key);
    std::fs::create_dir_all(&path).unwrap();
    let rotation = RotationConfig {
        idle_ms: 300,
        max_records: 25,
        ..RotationConfig::default()
    };
    let (sink, shutdown) = start_local_sink(&cluster, landing.path(), "unreadable", rotation).await;
    wait_for("a failing read", 30, || {
        sink.stats.store_failing.load(Ordering::Relaxed)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert!(!sink.task.is_finished(), "the sink gave up");
    std::fs::remove_dir(&path).unwrap();
    let store = ObjectStore::Local(landing.path().to_path_buf());
    assert_eq!(
        store.put_if_absent(&key, data).await.unwrap(),
        PutOutcome::Created
    );
    wait_written(&sink, 20).await;
    shutdown.cancel();
    sink.task.await.unwrap().unwrap();
    assert_eq!(sink.stats.adopted_files.load(Ordering::Relaxed), 1);
    assert_exactly_once(&readings, landing.path());
    drop(cluster);
}

/// The topic was deleted and created again under the same name while the landing zone kept
/// the old topic's files: the new messages meet an old file at the key of their offsets. Its
/// rows are other messages (other content hashes and ingest times at the same offsets), so the
/// sink does not adopt it, which would skip the new messages as already landed and commit past
/// them; it stops the partition, commits nothing and counts the conflict.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_landing_file_of_a_topic_created_again_is_not_adopted() {
    topic_created_again(false, false).await;
}

/// The same with the old topic's dead letters: adopted, the object would make the sink drop
/// the new topic's dead letters at those offsets as written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_of_a_topic_created_again_are_not_adopted() {
    topic_created_again(true, false).await;
}

/// An object at a landing file's key, or at a dead-letter object's, that is not what the sink
/// writes there (a truncated copy, another program's file): its partition stops as at a
/// conflict, and the sink goes on. Before, the sink exited with the parse error, and every
/// restart again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_object_at_a_key_stops_its_partition_not_the_sink() {
    topic_created_again(false, true).await;
    topic_created_again(true, true).await;
}

/// New messages (readings, each fourth followed by garbage) meet an object the old topic left
/// at the key of their first offsets: a landing file of offsets 0 to 39, or (`dead_letters`) a
/// dead-letter object of offsets 4 to 44; with `unreadable`, bytes that are neither.
async fn topic_created_again(dead_letters: bool, unreadable: bool) {
    // The old object sits in this hour's folder, where the new messages' files go.
    clear_of_an_hour_boundary(Duration::from_secs(60)).await;
    let streams = schemas::example_streams();
    let def = streams.get("sensor_readings").unwrap().clone();
    let (cluster, producer) = mock_cluster(1);
    let readings = distinct_readings(100);
    // The old topic's object: other readings or other garbage, ingested a day before.
    let landing = tempfile::tempdir().unwrap();
    let store = ObjectStore::Local(landing.path().to_path_buf());
    let old_ts = BASE_TS - 86_400_000_000;
    let (key, data) = if dead_letters {
        let mut old = sink::partition::PartitionState::new(def, TOPIC.into(), 0, 10);
        for offset in (4..=44).step_by(5) {
            let payload = format!("old garbage at {offset}");
            old.dead_letter(
                offset,
                old_ts + offset,
                "malformed JSON",
                payload.as_bytes(),
            );
        }
        let key =
            sink::parquet_file::dead_letter_key("landing", "sensor_readings", now_micros(), 0, 4);
        (key, bytes::Bytes::copy_from_slice(old.dead.text()))
    } else {
        let data = file_of_offsets_0_to_39(&def, &readings[50..90], old_ts);
        (
            object_key("landing", "sensor_readings", now_micros(), 0, 0),
            data,
        )
    };
    let data = match unreadable {
        true => bytes::Bytes::from_static(b"PAR1 not a landing file, nor JSON lines\n"),
        false => data,
    };
    assert_eq!(
        store.put_if_absent(&key, data.clone()).await.unwrap(),
        PutOutcome::Created
    );
    // The new topic's messages, ingested now.
    let mut garbage = Vec::new();
    send_with_garbage(&producer, &readings[..40], 0, &mut garbage).await;
    let (sink, shutdown) = start_local_sink(
        &cluster,
        landing.path(),
        "recreated",
        RotationConfig {
            idle_ms: 300,
            max_records: 25,
            ..RotationConfig::default()
        },
    )
    .await;
    wait_for("a conflict", 30, || {
        sink.stats.landing_conflicts.load(Ordering::Relaxed) > 0
    })
    .await;
    // Idle periods pass: nothing more is written or committed for the partition.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    shutdown.cancel();
    sink.task.await.unwrap().unwrap();
    assert_eq!(sink.stats.adopted_files.load(Ordering::Relaxed), 0);
    assert_eq!(
        sink.stats
            .adopted_dead_letter_objects
            .load(Ordering::Relaxed),
        0
    );
    assert_eq!(sink.stats.files_written.load(Ordering::Relaxed), 0);
    assert_eq!(committed(&cluster, "recreated", 0), None);
    // No landing file but the old one, as it was. (The new dead letters before the conflicting
    // file are written: they are the new topic's, at a key of their own.)
    let objects = walk(&landing.path().join("landing"));
    let files: Vec<_> = objects
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
        .collect();
    if dead_letters {
        assert_eq!(objects, [landing.path().join(&key)]);
    } else {
        assert_eq!(files, [&landing.path().join(&key)]);
    }
    assert_eq!(
        std::fs::read(landing.path().join(&key)).unwrap(),
        data.to_vec()
    );
    drop(cluster);
}

/// A landing file of partition 0 as a sink writes it: `readings` (40) at offsets 0 to 39,
/// ingested from `ingest_ts` on, a microsecond apart.
fn file_of_offsets_0_to_39(
    def: &schemas::StreamDef,
    readings: &[serde_json::Value],
    ingest_ts: i64,
) -> bytes::Bytes {
    assert_eq!(readings.len(), 40);
    let rows: Vec<_> = readings
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let v = schemas::check(def, r.clone()).unwrap();
            let meta = RowMeta {
                ingest_ts: ingest_ts + i as i64,
                partition: 0,
                offset: i as i64,
                hash: v.hash,
            };
            (v.record, meta)
        })
        .collect();
    encode(
        def,
        schemas::arrow::HashColumn::None,
        TOPIC,
        0,
        OffsetRange { first: 0, last: 39 },
        &rows,
    )
    .unwrap()
}

fn hex_of(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
