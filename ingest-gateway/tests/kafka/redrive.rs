//! `ingest-gateway redrive`: dead letters produced again once a definition takes them, once each.

use super::*;

/// Records the gateway rejected because its definition lagged (a field its producers already
/// set) are in the dead-letter topic. Once the definition has the field, `redrive` produces them
/// to the stream's topic in the wire format: a dry run counts and produces nothing, and the run
/// produces exactly the 20 with the new schema version.
/// Garbage stays (counted by reason), a record cut at 64 KiB in the dead-letter topic is counted
/// and left, and another stream's dead letters are not touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_records_are_redriven_once_a_definition_takes_them() {
    use ingest_gateway::redrive::{RedriveOptions, redrive};
    let brokers = env("EDGE_INGEST_KAFKA");
    let (c, prefix, dlq) = config(&brokers, |_| {});
    let shutdown = CancellationToken::new();
    let g = ingest_gateway::start(c.clone(), schemas::example_streams(), shutdown.clone())
        .await
        .unwrap();
    let client = reqwest::Client::new();
    let url = |stream: &str| format!("http://{}/v1/streams/{stream}/records", g.addr);
    let humid: Vec<Value> = (0..20)
        .map(|i| {
            let mut r = reading(i);
            r["humidity"] = json!(40.0 + i as f64);
            r
        })
        .collect();
    let plain: Vec<Value> = (100..110).map(reading).collect();
    let mut big = reading(200);
    big["humidity"] = json!(1.0);
    big["unit"] = json!("x".repeat(70_000));
    let mut body = ndjson(&plain);
    body.extend(ndjson(&humid));
    body.extend_from_slice(b"{\"device_id\": oops\n[]\n");
    body.extend(ndjson(&[big]));
    let res = post(&client, &url("sensor_readings"), body, None).await;
    let answer: Value = res.json().await.unwrap();
    assert_eq!(answer["accepted"], 10, "{answer}");
    assert_eq!(answer["rejected"].as_array().unwrap().len(), 23);
    let res = post(
        &client,
        &url("vehicle_telemetry"),
        b"{oops\n".to_vec(),
        None,
    )
    .await;
    assert_eq!(
        res.json::<Value>().await.unwrap()["rejected"][0]["index"],
        0
    );
    shutdown.cancel();
    g.task.await.unwrap().unwrap();

    let shipped = include_str!("../../../streams/sensor_readings.toml");
    let extended = format!(
        "{}\n[[fields]]\nname = \"humidity\"\ntype = \"float64\"\n",
        shipped.replace("version = 1", "version = 2")
    );
    let streams = schemas::Streams::from_sources([("sensor_readings", extended.as_str())]).unwrap();
    let def = streams.get("sensor_readings").unwrap().clone();
    let options = |since_ms: Option<i64>, dry_run: bool| RedriveOptions {
        stream: "sensor_readings".into(),
        since_ms,
        dry_run,
    };
    let dry = redrive(&c, &streams, &options(None, true)).await.unwrap();
    let t = &dry.tally;
    assert_eq!(
        (
            dry.read,
            dry.truncated,
            t.records,
            t.redriven,
            t.still_invalid
        ),
        (24, 1, 22, 20, 2),
        "{dry:?}"
    );
    assert_eq!(t.reasons.values().sum::<u64>(), 2);
    let report = redrive(&c, &streams, &options(None, false)).await.unwrap();
    assert_eq!(report.tally.redriven, 20, "{report:?}");
    assert!(report.read_through_ms.is_some());
    // A second run, over the same window: the redrive notes of the first leave its 20 out.
    let again = redrive(&c, &streams, &options(None, false)).await.unwrap();
    assert_eq!(
        (
            again.read,
            again.redriven_before,
            again.tally.redriven,
            again.tally.still_invalid,
            again.truncated
        ),
        (24, 20, 0, 2, 1),
        "{again:?}"
    );

    let topic = format!("{prefix}sensor_readings");
    let msgs = consume(&brokers, &topic, 30);
    assert_eq!(
        msgs.len(),
        30,
        "the 10 accepted and the 20 redriven, once each"
    );
    let mut versions: Vec<&str> = msgs
        .iter()
        .map(|(_, h)| h["schema-version"].as_str())
        .collect();
    versions.sort_unstable();
    assert_eq!(versions.iter().filter(|v| **v == "2").count(), 20);
    let mut got: Vec<String> = msgs
        .iter()
        .map(|(_, h)| h["content-hash"].clone())
        .collect();
    let mut want: Vec<String> = plain
        .iter()
        .chain(&humid)
        .map(|r| schemas::check(&def, r.clone()).unwrap().hash.to_hex())
        .collect();
    got.sort();
    want.sort();
    assert_eq!(got, want);
    let dead = consume(&brokers, &dlq, 25);
    let notes = dead
        .iter()
        .filter(|(_, h)| h.contains_key("redriven"))
        .count();
    assert_eq!(
        (dead.len() - notes, notes),
        (24, 1),
        "the dead letters stay, and the first run added one note"
    );

    // The command as an operator runs it: a dry run's JSON report, `--since` as RFC 3339 or
    // epoch milliseconds (after the dead letters: none redriven), and a time it cannot read.
    let dir = tempfile::tempdir().unwrap();
    let streams_dir = dir.path().join("streams");
    std::fs::create_dir(&streams_dir).unwrap();
    std::fs::write(streams_dir.join("sensor_readings.toml"), &extended).unwrap();
    let config = dir.path().join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "streams_dir = {streams_dir:?}\n[kafka]\nbrokers = \"{brokers}\"\n\
             topic_prefix = \"{prefix}\"\ndead_letter_topic = \"{dlq}\"\n"
        ),
    )
    .unwrap();
    let run = |since: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_ingest-gateway"))
            .args([
                "redrive",
                "--stream",
                "sensor_readings",
                "--dry-run",
                "--since",
                since,
            ])
            .arg("--config")
            .arg(&config)
            .output()
            .unwrap();
        let report = serde_json::from_slice::<Value>(&out.stdout).unwrap_or_default();
        (
            out.status.success(),
            report,
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, report, stderr) = run("1970-01-01T00:00:00Z");
    assert!(ok, "{stderr}");
    assert_eq!(
        (
            &report["redriven"],
            &report["redriven_before"],
            &report["dry_run"]
        ),
        (&json!(0), &json!(20), &json!(true)),
        "{report}"
    );
    let later = (report["read_through_ms"].as_i64().unwrap() + 1).to_string();
    let (ok, report, stderr) = run(&later);
    assert!(ok, "{stderr}");
    assert_eq!(
        (&report["redriven"], &report["before_since"]),
        (&json!(0), &json!(24)),
        "{report}"
    );
    let (ok, _, stderr) = run("yesterday");
    assert!(!ok);
    assert!(
        stderr.contains("neither RFC 3339 nor epoch milliseconds"),
        "{stderr}"
    );
}

/// `redrive --since` leaves out the dead letters older than that time (their Kafka timestamps),
/// and a time after the last one redrives nothing. On librdkafka's mock cluster, where messages
/// can be produced with any time. (The topic is read from its start, and the times are
/// compared record by record.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redrive_since_leaves_out_older_dead_letters() {
    use ingest_gateway::redrive::{RedriveOptions, redrive};
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let cluster = rdkafka::mocking::MockCluster::new(1).unwrap();
    let (mut c, prefix, dlq) = config(&cluster.bootstrap_servers(), |_| {});
    c.kafka.create_topics = false;
    cluster.create_topic(&dlq, 1, 1).unwrap();
    cluster
        .create_topic(&format!("{prefix}sensor_readings"), 1, 1)
        .unwrap();
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", cluster.bootstrap_servers())
        .create()
        .unwrap();
    let hour = 3_600_000;
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    for (i, at) in [now - 3 * hour, now - 2 * hour, now - hour]
        .into_iter()
        .enumerate()
    {
        let value = reading(i as i64).to_string();
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: "stream",
                value: Some("sensor_readings"),
            })
            .insert(Header {
                key: "truncated",
                value: Some("false"),
            });
        producer
            .send(
                FutureRecord::to(&dlq)
                    .key("sensor_readings")
                    .payload(&value)
                    .timestamp(at)
                    .headers(headers),
                Duration::from_secs(5),
            )
            .await
            .unwrap();
    }
    let streams = schemas::example_streams();
    let options = |since_ms| RedriveOptions {
        stream: "sensor_readings".into(),
        since_ms: Some(since_ms),
        dry_run: true,
    };
    for (since, read) in [
        (now - 4 * hour, 3),
        (now - 2 * hour - 1, 2),
        (now - hour, 1),
        (now, 0),
    ] {
        let report = redrive(&c, &streams, &options(since)).await.unwrap();
        assert_eq!(
            (report.read, report.before_since, report.tally.redriven),
            (3, 3 - read, read),
            "since {} h ago: {report:?}",
            (now - since) as f64 / hour as f64
        );
    }
}

/// A producer that crashed after producing a batch's dead letters, and then produced the batch
/// again, left two copies of each: the same `batch-id` (the request's Idempotency-Key, the
/// agent's batch id) and `record-index`. `redrive` produces one of them and counts the other as
/// `repeated`; dead letters without a batch id cannot be told apart and go as they are; the same
/// index in another batch is another record. A second run finds the first copies noted and the
/// repeats repeated. On librdkafka's mock cluster, where the dead letters are produced as a
/// test wants them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_dead_letters_are_redriven_once() {
    use ingest_gateway::redrive::{RedriveOptions, redrive};
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let cluster = rdkafka::mocking::MockCluster::new(1).unwrap();
    let (mut c, prefix, dlq) = config(&cluster.bootstrap_servers(), |_| {});
    c.kafka.create_topics = false;
    cluster.create_topic(&dlq, 1, 1).unwrap();
    let topic = format!("{prefix}sensor_readings");
    cluster.create_topic(&topic, 1, 1).unwrap();
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", cluster.bootstrap_servers())
        .create()
        .unwrap();
    // (reading, batch id, index): b1's two dead letters twice, one without a batch id twice,
    // and b2's first.
    let dead = [
        (0, Some("b1"), "0"),
        (1, Some("b1"), "1"),
        (2, None, "0"),
        (0, Some("b1"), "0"),
        (1, Some("b1"), "1"),
        (2, None, "0"),
        (3, Some("b2"), "0"),
    ];
    for (reading_no, batch, index) in dead {
        let value = reading(reading_no).to_string();
        let mut headers = OwnedHeaders::new()
            .insert(Header {
                key: "stream",
                value: Some("sensor_readings"),
            })
            .insert(Header {
                key: "record-index",
                value: Some(index),
            })
            .insert(Header {
                key: "truncated",
                value: Some("false"),
            });
        if let Some(batch) = batch {
            headers = headers.insert(Header {
                key: "batch-id",
                value: Some(batch),
            });
        }
        producer
            .send(
                FutureRecord::to(&dlq)
                    .key("sensor_readings")
                    .payload(&value)
                    .headers(headers),
                Duration::from_secs(5),
            )
            .await
            .unwrap();
    }
    let streams = schemas::example_streams();
    let options = RedriveOptions {
        stream: "sensor_readings".into(),
        since_ms: None,
        dry_run: false,
    };
    let first = redrive(&c, &streams, &options).await.unwrap();
    assert_eq!(
        (first.read, first.repeated, first.tally.redriven),
        (7, 2, 5),
        "{first:?}"
    );
    let second = redrive(&c, &streams, &options).await.unwrap();
    assert_eq!(
        (
            second.read,
            second.repeated,
            second.redriven_before,
            second.tally.redriven
        ),
        (7, 2, 5, 0),
        "{second:?}"
    );
    use rdkafka::producer::Producer as _;
    let (low, high) = producer
        .client()
        .fetch_watermarks(&topic, 0, Duration::from_secs(5))
        .unwrap();
    assert_eq!(high - low, 5, "readings 0, 1 and 3 once, 2 twice");
}
