//! The Kafka output against Apache Kafka, also under SIGKILL and with a topic whose message limit
//! is below the producer's, and a spool on a disk that fills up.

use crate::support;

use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use schemas::ContentHash;
use support::{
    Faults, Stub, assert_enough_kills, assert_exactly_once, config, file_source_toml, free_port,
    readings, run_with_kills, service_env, wait_for_port,
};

/// Creates `topic` with `partitions` partitions on the test broker.
async fn create_topic(kafka: &str, topic: &str, partitions: i32) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", kafka)
        .create()
        .unwrap();
    for r in admin
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        )
        .await
        .unwrap()
    {
        r.unwrap();
    }
}

/// Reads `topic` from the start until at least `count` messages came and none for `quiet` (or
/// a minute passed), checking each against the gateway's wire format (value, key, headers);
/// returns how often each content hash came.
fn read_topic(
    kafka: &str,
    topic: &str,
    count: usize,
    quiet: Duration,
) -> HashMap<ContentHash, u32> {
    let def = schemas::example_streams()
        .get("sensor_readings")
        .unwrap()
        .clone();
    read_topic_as(kafka, topic, count, quiet, &def)
}

/// [`read_topic`] with the records checked against `def` (its version or an earlier one in the
/// `schema-version` header).
fn read_topic_as(
    kafka: &str,
    topic: &str,
    count: usize,
    quiet: Duration,
    def: &schemas::StreamDef,
) -> HashMap<ContentHash, u32> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", kafka)
        .set("group.id", format!("check-{topic}"))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    consumer.subscribe(&[topic]).unwrap();
    let mut landed = HashMap::new();
    let mut total = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = Instant::now();
    // At the deadline the caller's checks say what is missing.
    while (total < count || last.elapsed() < quiet) && Instant::now() < deadline {
        let Some(m) = consumer.poll(Duration::from_millis(200)) else {
            continue;
        };
        let m = m.unwrap();
        let valid = schemas::check_bytes(def, m.payload().unwrap()).unwrap();
        assert_eq!(m.key().unwrap(), valid.record.partition_key(def).as_bytes());
        let headers: HashMap<&str, &[u8]> = m
            .headers()
            .unwrap()
            .iter()
            .map(|h| (h.key, h.value.unwrap()))
            .collect();
        assert_eq!(headers["content-hash"], valid.hash.to_hex().as_bytes());
        let version = schemas::wire::parse_decimal_header(headers["schema-version"]).unwrap();
        assert!((1..=i64::from(def.version)).contains(&version), "{version}");
        assert!(schemas::wire::parse_decimal_header(headers["ingest-ts"]).is_some());
        *landed.entry(valid.hash).or_insert(0) += 1;
        total += 1;
        last = Instant::now();
    }
    landed
}

/// An agent config with the Kafka output, reading `file`.
fn kafka_config(dir: &Path, kafka: &str, prefix: &str, batch: &str, file: &Path) -> String {
    format!(
        "streams_dir = {streams:?}\nstate_dir = {state:?}\n[kafka]\nbrokers = \"{kafka}\"\n\
         topic_prefix = \"{prefix}\"\ndead_letter_topic = \"{prefix}dead-letters\"\n\
         [batch]\n{batch}\n{source}",
        streams = Path::new(env!("CARGO_MANIFEST_DIR")).join("../streams"),
        state = dir.join("state"),
        source = file_source_toml(file, ""),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_output_writes_the_gateway_wire_format() {
    let kafka = service_env("EDGE_INGEST_KAFKA");
    let prefix = format!("agent{}.", rand::random::<u32>());
    let topic = format!("{prefix}sensor_readings");
    create_topic(&kafka, &topic, 3).await;
    let dir = tempfile::tempdir().unwrap();
    let (lines, expected) = readings(3_000, 9, 4, 2);
    let file = dir.path().join("r.ndjson");
    std::fs::write(&file, lines.join("\n")).unwrap();
    let cfg = kafka_config(
        dir.path(),
        &kafka,
        &prefix,
        "max_records = 500\nencoding = \"parquet\"",
        &file,
    );
    let stats = edge_agent::run(
        edge_agent::AgentConfig::parse(&cfg).unwrap(),
        schemas::example_streams(),
        tokio_util::sync::CancellationToken::new(),
    )
    .await
    .unwrap()
    .total();
    assert_eq!(stats.delivery.accepted as usize, expected.len());
    assert!(stats.pipeline.duplicates > 0);
    let landed = read_topic(&kafka, &topic, expected.len(), Duration::ZERO);
    assert_exactly_once(&landed, &expected);
}

/// Runs the agent in this process with the Kafka output (`batch` keys) on `lines`, written to a
/// file in `dir`, until it has read and delivered them (a minute at most); its totals.
async fn run_to_kafka(
    dir: &Path,
    brokers: &str,
    prefix: &str,
    batch: &str,
    lines: &[String],
) -> edge_agent::StreamStats {
    let file = dir.join("r.ndjson");
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    let cfg = kafka_config(dir, brokers, prefix, batch, &file);
    let run = edge_agent::run(
        edge_agent::AgentConfig::parse(&cfg).unwrap(),
        schemas::example_streams(),
        tokio_util::sync::CancellationToken::new(),
    );
    tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("the agent is still retrying after a minute")
        .unwrap()
        .total()
}

/// A reading under the line limit (1 MiB) whose Kafka message is over the producer's
/// `message.max.bytes` (librdkafka's 1,000,000): librdkafka refuses it at once, and the agent
/// retried its batch for ever, so its stream stood still. It is now left out and reported as a
/// rejected record, the rest of the batch is produced, and the record goes to the dead-letter
/// topic, cut at 64 KiB with its reason, as the gateway sends it (before, it was only logged).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_output_rejects_a_record_too_large_for_a_message_and_goes_on() {
    let kafka = service_env("EDGE_INGEST_KAFKA");
    let prefix = format!("agentbig{}.", rand::random::<u32>());
    let topic = format!("{prefix}sensor_readings");
    create_topic(&kafka, &topic, 1).await;
    create_topic(&kafka, &format!("{prefix}dead-letters"), 1).await;
    let dir = tempfile::tempdir().unwrap();
    let (lines, expected) = with_a_record_too_large();
    let stats = run_to_kafka(dir.path(), &kafka, &prefix, "max_records = 10", &lines).await;
    assert_eq!(stats.delivery.accepted, 2);
    assert_eq!(stats.delivery.rejected_records, 1);
    let landed = read_topic(&kafka, &topic, expected.len(), Duration::ZERO);
    assert_exactly_once(&landed, &expected);
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &kafka)
        .set("group.id", format!("check-{prefix}dead-letters"))
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap();
    consumer
        .subscribe(&[&format!("{prefix}dead-letters")])
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let dead = loop {
        assert!(Instant::now() < deadline, "no dead letter");
        if let Some(m) = consumer.poll(Duration::from_millis(200)) {
            break m.unwrap().detach();
        }
    };
    let headers: HashMap<&str, &[u8]> = dead
        .headers()
        .unwrap()
        .iter()
        .map(|h| (h.key, h.value.unwrap()))
        .collect();
    assert_eq!(headers["reason-code"], b"too_large");
    assert_eq!(headers["truncated"], b"true");
    assert_eq!(headers["stream"], b"sensor_readings");
    assert_eq!(headers["record-index"], b"1");
    // The batch id, as the HTTP output's Idempotency-Key: a dead letter produced again after a
    // crash (the batch still in the spool) has the same, and `redrive` leaves it out.
    let batch = std::str::from_utf8(headers["batch-id"]).unwrap();
    assert!(
        batch.len() == 64 && batch.bytes().all(|c| c.is_ascii_hexdigit()),
        "{batch}"
    );
    assert_eq!(dead.key(), Some(&b"sensor_readings"[..]));
    assert_eq!(dead.payload().unwrap().len(), 64 * 1024);
    assert!(dead.payload().unwrap().starts_with(b"{"));
}

/// Two readings with one too large for a Kafka message between them, and the two's hashes.
fn with_a_record_too_large() -> (Vec<String>, Vec<ContentHash>) {
    let (mut lines, expected) = readings(2, 9, 0, 4);
    let mut big: serde_json::Value = serde_json::from_str(&lines[0]).unwrap();
    big["unit"] = serde_json::Value::String("x".repeat(1_010_000));
    big["ts"] = serde_json::json!(1);
    lines.insert(1, big.to_string());
    (lines, expected)
}

/// Without the dead-letter topic (not created; Kafka does not create it), the record too large
/// is left out and logged, and the batch is not held up for it: the stream goes on. The agent
/// asks for the topic's metadata first: before, librdkafka held the dead letter until the
/// message timeout, and the batch with it (30 s by default; the run here would take 5 minutes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_output_goes_on_without_the_dead_letter_topic() {
    let kafka = service_env("EDGE_INGEST_KAFKA");
    let prefix = format!("agentnodlq{}.", rand::random::<u32>());
    let topic = format!("{prefix}sensor_readings");
    create_topic(&kafka, &topic, 1).await;
    let dir = tempfile::tempdir().unwrap();
    let (lines, expected) = with_a_record_too_large();
    // librdkafka gives up on a message to a missing topic at the message timeout or when the
    // topic has not appeared for `topic.metadata.propagation.max.ms` (30 s by default): both
    // here far past the minute `run_to_kafka` waits.
    let batch = "max_records = 10\n[kafka.properties]\n\"message.timeout.ms\" = \"300000\"\n\"topic.metadata.propagation.max.ms\" = \"300000\"";
    let stats = run_to_kafka(dir.path(), &kafka, &prefix, batch, &lines).await;
    assert_eq!(stats.delivery.accepted, 2);
    assert_eq!(stats.delivery.rejected_records, 1);
    let landed = read_topic(&kafka, &topic, expected.len(), Duration::ZERO);
    assert_exactly_once(&landed, &expected);
}

/// A topic whose `max.message.bytes` is below the producer's refuses a batch's records as too
/// large: no retry gets past that, and the agent retried the batch for ever. The batch is now
/// refused for good (kept under `rejected/` until the limits are fixed and it is resent) and the
/// next batches go on. The topic's limit is 4 KiB, and one reading of the first batch carries
/// 12,800 hex digits that zstd cannot take below 6,400 bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_output_keeps_aside_a_batch_the_broker_refuses_as_too_large() {
    let kafka = service_env("EDGE_INGEST_KAFKA");
    let prefix = format!("agentbig{}.", rand::random::<u32>());
    let topic = format!("{prefix}sensor_readings");
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &kafka)
        .create()
        .unwrap();
    for r in admin
        .create_topics(
            &[NewTopic::new(&topic, 1, TopicReplication::Fixed(1))
                .set("max.message.bytes", "4096")],
            &AdminOptions::new(),
        )
        .await
        .unwrap()
    {
        r.unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let (mut lines, _) = readings(100, 9, 0, 6);
    let mut big: serde_json::Value = serde_json::from_str(&lines[0]).unwrap();
    big["unit"] = serde_json::Value::String(
        (0..200u32)
            .map(|i| blake3::hash(&i.to_le_bytes()).to_hex().to_string())
            .collect(),
    );
    lines[0] = big.to_string();
    let stats = run_to_kafka(dir.path(), &kafka, &prefix, "max_records = 50", &lines).await;
    assert_eq!(stats.delivery.rejected_batches, 1);
    assert_eq!(stats.delivery.accepted, 50);
    let kept = std::fs::read_dir(dir.path().join("state/rejected"))
        .unwrap()
        .count();
    assert!(kept >= 1, "the refused batch is kept under rejected/");
}

/// The agent with the Kafka output, SIGKILLed at random points: a batch leaves the spool only
/// once Kafka acknowledged all of its records, so nothing is lost. A batch produced but not yet
/// removed when the agent died is produced again after the restart (a new producer, so Kafka's
/// idempotence cannot tell): its records may come twice, at most one batch per kill, and the
/// sink drops them by content hash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_output_under_sigkill_loses_nothing() {
    const BATCH: usize = 400;
    let kafka = service_env("EDGE_INGEST_KAFKA");
    let prefix = format!("agentkill{}.", rand::random::<u32>());
    let topic = format!("{prefix}sensor_readings");
    create_topic(&kafka, &topic, 3).await;
    let dir = tempfile::tempdir().unwrap();
    // 100,000 distinct readings and 20,000 re-sent ones.
    let (lines, expected) = readings(100_000, 30, 5, 9);
    let file = dir.path().join("r.ndjson");
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    let cfg = dir.path().join("agent.toml");
    std::fs::write(
        &cfg,
        kafka_config(
            dir.path(),
            &kafka,
            &prefix,
            &format!("max_records = {BATCH}\nmax_age_ms = 100"),
            &file,
        ),
    )
    .unwrap();
    let (kills, runs) = run_with_kills(&cfg, dir.path(), (6, 100..800), 1).await;
    assert_enough_kills(kills);
    let landed = read_topic(&kafka, &topic, expected.len(), Duration::from_secs(2));
    let missing = expected.iter().filter(|h| !landed.contains_key(h)).count();
    assert_eq!(missing, 0, "{missing} of {} readings lost", expected.len());
    assert_eq!(
        landed.len(),
        expected.len(),
        "readings that were never sent"
    );
    let again: u32 = landed.values().map(|n| n - 1).sum();
    eprintln!("{kills} kills over {runs} runs; {again} readings produced twice");
    assert!(
        again as usize <= kills * BATCH,
        "{again} readings produced again: more than one batch per kill"
    );
}

/// Runs `script` as root of a private mount namespace (an unprivileged user namespace where the
/// kernel allows it), so a small tmpfs can stand in for a full disk.
fn in_mount_namespace(script: &str) -> Command {
    let mut c = Command::new("unshare");
    c.args(["--user", "--map-root-user", "--mount", "sh", "-c", script]);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_blocks_the_agent_without_losing_anything() {
    let probe = in_mount_namespace("mount -t tmpfs -o size=64k tmpfs /mnt").status();
    assert!(
        probe.is_ok_and(|s| s.success()),
        "this test needs `unshare` and user namespaces (or root) to mount a small tmpfs"
    );
    // The gateway is down while the agent fills its 1 MiB disk, then comes back.
    let stub = Stub::start(Faults {
        unavailable: 100,
        ..Faults::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    // Random values: batches that do not compress to nothing.
    let (lines, expected) = readings(100_000, 1000, 0, 11);
    let file = dir.path().join("r.ndjson");
    std::fs::write(&file, lines.join("\n")).unwrap();
    let cfg = dir.path().join("agent.toml");
    std::fs::write(
        &cfg,
        config(
            &state,
            &stub.url(),
            "[batch]\nmax_records = 1000\nzstd_level = 1\n[spool]\nmax_mb = 64\nsegment_mb = 1\n",
            &format!(
                "[[sources]]\ntype = \"file\"\npath = {file:?}\nstream = \"sensor_readings\"\n"
            ),
        ),
    )
    .unwrap();
    let log = dir.path().join("agent.log");
    let mut agent = in_mount_namespace(&format!(
        "mount -t tmpfs -o size=1m tmpfs {state:?} && exec {bin:?} run --config {cfg:?}",
        bin = env!("CARGO_BIN_EXE_edge-agent"),
    ))
    .env("RUST_LOG", "edge_agent=info")
    .stdout(Stdio::null())
    .stderr(std::fs::File::create(&log).unwrap())
    .spawn()
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !std::fs::read_to_string(&log).unwrap().contains("disk full") {
        assert!(
            Instant::now() < deadline,
            "the disk never filled up:\n{}",
            std::fs::read_to_string(&log).unwrap()
        );
        assert!(
            agent.try_wait().unwrap().is_none(),
            "the agent stopped:\n{}",
            std::fs::read_to_string(&log).unwrap()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        agent.try_wait().unwrap().is_none(),
        "a full disk must not stop the agent"
    );
    stub.set_faults(Faults::default());
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = agent.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "the agent never finished");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(status.success(), "{log}");
    assert_exactly_once(&stub.landed(), &expected);
}

/// A broker that is down for long: librdkafka reports every failed connect and every failed
/// produce (78 lines in 8 s before this was fixed). Each kind of report is now logged once a
/// minute: over 8 s, the first ones only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_is_logged_once_not_per_connect() {
    let dir = tempfile::tempdir().unwrap();
    let (lines, _) = readings(100, 9, 0, 3);
    let file = dir.path().join("r.ndjson");
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    let cfg = dir.path().join("agent.toml");
    let down = format!("127.0.0.1:{}", support::free_port());
    let agent = kafka_config(dir.path(), &down, "ingest.", "max_age_ms = 100", &file);
    std::fs::write(
        &cfg,
        agent.replace(
            "\"sensor_readings\"\n",
            "\"sensor_readings\"\nfollow = true\n",
        ),
    )
    .unwrap();
    let mut child = support::spawn_agent_with(&cfg, dir.path(), 1, Stdio::null(), "info");
    tokio::time::sleep(Duration::from_secs(8)).await;
    let why = "with the broker down";
    support::sigterm_and_wait(&mut child, Duration::from_secs(10), why, (dir.path(), 1)).await;
    let log = std::fs::read_to_string(dir.path().join("agent-1.log")).unwrap();
    let reports: Vec<&str> = log.lines().filter(|l| l.contains("librdkafka")).collect();
    assert!(
        !reports.is_empty() && reports.iter().any(|l| l.contains("Connection refused")),
        "the outage was not logged at all:\n{log}"
    );
    assert!(
        reports.len() <= 6,
        "{} librdkafka lines in 8 s of outage:\n{}",
        reports.len(),
        reports.join("\n")
    );
}

/// What a test of definition changes works on: the broker, a topic prefix and its sensor topic
/// (created), a directory, and in it `streams/` holding the shipped sensor definition.
async fn definition_rig() -> (
    String,
    String,
    String,
    tempfile::TempDir,
    std::path::PathBuf,
) {
    let kafka = service_env("EDGE_INGEST_KAFKA");
    let prefix = format!("agent{}.", rand::random::<u32>());
    let topic = format!("{prefix}sensor_readings");
    create_topic(&kafka, &topic, 1).await;
    let dir = tempfile::tempdir().unwrap();
    let streams = dir.path().join("streams");
    std::fs::create_dir(&streams).unwrap();
    std::fs::write(streams.join("sensor_readings.toml"), SHIPPED_SENSOR).unwrap();
    (kafka, prefix, topic, dir, streams)
}

const SHIPPED_SENSOR: &str = include_str!("../../streams/sensor_readings.toml");

/// [`kafka_config`] on the definitions of `streams` (the rig's).
fn rig_config(
    dir: &Path,
    kafka: &str,
    prefix: &str,
    batch: &str,
    file: &Path,
    streams: &Path,
) -> String {
    kafka_config(dir, kafka, prefix, batch, file).replace(
        &format!(
            "streams_dir = {:?}",
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../streams")
        ),
        &format!("streams_dir = {streams:?}"),
    )
}

/// Lines of readings that set `humidity` (30.0, 31.0, ...), which the shipped definition lacks.
fn with_humidity_set(lines: &[String]) -> Vec<String> {
    lines
        .iter()
        .enumerate()
        .map(|(i, line)| {
            let mut r: serde_json::Value = serde_json::from_str(line).unwrap();
            r["humidity"] = serde_json::json!(30.0 + i as f64);
            r.to_string()
        })
        .collect()
}

/// The shipped sensor definition with a nullable `humidity` in its content hash, as version 2.
fn with_humidity() -> String {
    format!(
        "{}\n[[fields]]\nname = \"humidity\"\ntype = \"float64\"\n",
        SHIPPED_SENSOR
            .replace("version = 1", "version = 2")
            .replace("hash_fields = [", "hash_fields = [\"humidity\", ")
    )
}

/// A stream's definition gains a field while the agent runs (Parquet batches, a file followed).
/// The first line that sets it makes the agent read the definition's file again: the change is
/// compatible, so the open batch closes and the line and those after it are batched under the
/// new definition, none skipped. Before, the agent skipped them as invalid until it restarted.
/// `humidity` is hashed, so a record whose value was lost would hash otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compatible_definition_change_is_taken_without_a_restart() {
    let (kafka, prefix, topic, dir, streams) = definition_rig().await;
    let (lines, _) = readings(200, 5, 0, 7);
    let file = dir.path().join("r.ndjson");
    std::fs::write(&file, lines[..100].join("\n") + "\n").unwrap();
    let cfg = rig_config(
        dir.path(),
        &kafka,
        &prefix,
        "max_records = 40\nmax_age_ms = 200\nencoding = \"parquet\"",
        &file,
        &streams,
    )
    .replace(
        "stream = \"sensor_readings\"",
        "stream = \"sensor_readings\"\nfollow = true\npoll_ms = 50",
    );
    let config = edge_agent::AgentConfig::parse(&cfg).unwrap();
    let loaded = service_kit::load_streams_dir(&streams).unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let agent = tokio::spawn(edge_agent::run(config, loaded.clone(), shutdown.clone()));
    let old = loaded.get("sensor_readings").unwrap().clone();
    assert_eq!(
        read_topic_as(&kafka, &topic, 100, Duration::ZERO, &old).len(),
        100
    );

    let extended = with_humidity();
    std::fs::write(streams.join("sensor_readings.toml"), &extended).unwrap();
    let humid = with_humidity_set(&lines[100..]);
    let mut appended = std::fs::OpenOptions::new()
        .append(true)
        .open(&file)
        .unwrap();
    std::io::Write::write_all(&mut appended, (humid.join("\n") + "\n").as_bytes()).unwrap();
    let new = schemas::StreamDef::from_toml(&extended).unwrap();
    let expected: Vec<ContentHash> = lines[..100]
        .iter()
        .chain(&humid)
        .map(|l| schemas::check_bytes(&new, l.as_bytes()).unwrap().hash)
        .collect();
    let landed = read_topic_as(&kafka, &topic, 200, Duration::from_millis(500), &new);
    shutdown.cancel();
    let stats = agent.await.unwrap().unwrap().total();
    assert_eq!(stats.pipeline.invalid, 0);
    assert_exactly_once(&landed, &expected);
}

/// Lines the agent skipped as invalid (a field its definition lacks, garbage) are kept under
/// `invalid/`; the agent started again after the definition gained the field tries them at
/// start, and the 30 land once, before no other line came. The garbage stays kept. Before, the
/// 30 were counted and lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lines_skipped_as_invalid_land_once_the_definition_takes_them() {
    let (kafka, prefix, topic, dir, streams) = definition_rig().await;
    let (lines, _) = readings(40, 5, 0, 11);
    let humid = with_humidity_set(&lines[10..]);
    let mut all: Vec<String> = lines[..10].to_vec();
    all.extend(humid.iter().cloned());
    all.push("{oops".into());
    all.push("[1]".into());
    let file = dir.path().join("r.ndjson");
    std::fs::write(&file, all.join("\n") + "\n").unwrap();
    let cfg = rig_config(
        dir.path(),
        &kafka,
        &prefix,
        "max_age_ms = 100",
        &file,
        &streams,
    );
    let run = || {
        let config = edge_agent::AgentConfig::parse(&cfg).unwrap();
        let loaded = service_kit::load_streams_dir(&streams).unwrap();
        edge_agent::run(config, loaded, tokio_util::sync::CancellationToken::new())
    };
    let first = run().await.unwrap().total();
    assert_eq!((first.pipeline.invalid, first.pipeline.batched), (32, 10));
    let kept = dir.path().join("state/invalid/sensor_readings.ndjson");
    assert_eq!(std::fs::read_to_string(&kept).unwrap().lines().count(), 32);
    let kept_bytes = || {
        let status =
            edge_agent::status::status(&edge_agent::AgentConfig::parse(&cfg).unwrap(), None)
                .unwrap();
        status.streams[0].invalid_kept_bytes
    };
    assert_eq!(kept_bytes(), std::fs::metadata(&kept).unwrap().len());

    std::fs::write(streams.join("sensor_readings.toml"), with_humidity()).unwrap();
    let second = run().await.unwrap().total();
    assert_eq!((second.pipeline.retried, second.pipeline.batched), (30, 30));
    let new = schemas::StreamDef::from_toml(&with_humidity()).unwrap();
    let expected: Vec<ContentHash> = lines[..10]
        .iter()
        .chain(&humid)
        .map(|l| schemas::check_bytes(&new, l.as_bytes()).unwrap().hash)
        .collect();
    let landed = read_topic_as(&kafka, &topic, 40, Duration::from_millis(500), &new);
    assert_exactly_once(&landed, &expected);
    let left = std::fs::read_to_string(&kept).unwrap();
    assert_eq!(left.lines().count(), 2, "{left}");
    assert_eq!(kept_bytes(), left.len() as u64);

    // `invalid_max_mb = 0` keeps none: a garbage line is counted, and the file stays as it was.
    let mut appended = std::fs::OpenOptions::new()
        .append(true)
        .open(&file)
        .unwrap();
    std::io::Write::write_all(&mut appended, b"{bad\n").unwrap();
    let none = cfg.replace("[batch]\n", "[spool]\ninvalid_max_mb = 0\n[batch]\n");
    let config = edge_agent::AgentConfig::parse(&none).unwrap();
    let loaded = service_kit::load_streams_dir(&streams).unwrap();
    let third = edge_agent::run(config, loaded, tokio_util::sync::CancellationToken::new())
        .await
        .unwrap()
        .total();
    assert_eq!((third.pipeline.invalid, third.pipeline.retried), (1, 0));
    assert_eq!(std::fs::read_to_string(&kept).unwrap(), left);
}

/// Posts `body` to the agent's local port for `stream`.
fn post_local(
    port: u16,
    stream: &str,
    content_type: &'static str,
    body: Vec<u8>,
) -> impl Future<Output = reqwest::Result<reqwest::Response>> + use<> {
    reqwest::Client::new()
        .post(format!(
            "http://127.0.0.1:{port}/v1/streams/{stream}/records"
        ))
        .header("content-type", content_type)
        .body(body)
        .send()
}

/// An agent with the Kafka output and a local HTTP port, on the definitions of `streams`; its
/// port, its shutdown token and its run.
async fn local_port_agent(
    kafka: &str,
    prefix: &str,
    dir: &tempfile::TempDir,
    streams: &Path,
) -> (
    u16,
    tokio_util::sync::CancellationToken,
    tokio::task::JoinHandle<anyhow::Result<edge_agent::AgentStats>>,
) {
    let port = free_port();
    let cfg = format!(
        "streams_dir = {streams:?}\nstate_dir = {state:?}\n[kafka]\nbrokers = \"{kafka}\"\n\
         topic_prefix = \"{prefix}\"\ndead_letter_topic = \"{prefix}dead-letters\"\n\
         [batch]\nmax_age_ms = 100\n\
         [[sources]]\ntype = \"http\"\nlisten = \"127.0.0.1:{port}\"\n",
        state = dir.path().join("state"),
    );
    let loaded = service_kit::load_streams_dir(streams).unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let agent = tokio::spawn(edge_agent::run(
        edge_agent::AgentConfig::parse(&cfg).unwrap(),
        loaded,
        shutdown.clone(),
    ));
    wait_for_port(port).await;
    (port, shutdown, agent)
}

/// A stream defined after the agent started: a device posting to the local port for it got 404
/// until the agent restarted. Now the port finds the stream's file and starts its spool,
/// pipeline and delivery; the records land once, a re-post is dropped as duplicates, and the
/// stream is joined at the stop like the others. A name that is not a stream name is 404, also
/// when it leads to a definition outside `streams_dir`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_defined_after_the_start_is_served_by_the_local_port() {
    let (kafka, prefix, _, dir, streams) = definition_rig().await;
    let topic = format!("{prefix}vehicle_telemetry");
    create_topic(&kafka, &topic, 1).await;
    let (port, shutdown, agent) = local_port_agent(&kafka, &prefix, &dir, &streams).await;
    let shipped = include_str!("../../streams/vehicle_telemetry.toml");
    let def = schemas::StreamDef::from_toml(shipped).unwrap();
    let mut body = String::new();
    let mut hashes = Vec::new();
    for i in 0..50 {
        let line = format!(
            r#"{{"vehicle_id":"truck-{}","recorded_at":{},"lat":52.{i},"lon":13.{i},"ignition":true}}"#,
            i % 4,
            1_767_225_600_000_i64 + i * 1000,
        );
        hashes.push(schemas::check_bytes(&def, line.as_bytes()).unwrap().hash);
        body.push_str(&line);
        body.push('\n');
    }
    let post = |stream: &str| {
        post_local(
            port,
            stream,
            "application/x-ndjson",
            body.clone().into_bytes(),
        )
    };
    assert_eq!(post("vehicle_telemetry").await.unwrap().status(), 404);
    std::fs::write(dir.path().join("escape.toml"), shipped).unwrap();
    assert_eq!(post("..%2Fescape").await.unwrap().status(), 404);
    std::fs::write(streams.join("vehicle_telemetry.toml"), shipped).unwrap();
    for expected in ["accepted", "duplicates"] {
        let answer = post("vehicle_telemetry").await.unwrap();
        assert_eq!(answer.status(), 200);
        let answer: serde_json::Value =
            serde_json::from_slice(&answer.bytes().await.unwrap()).unwrap();
        assert_eq!(answer[expected], 50, "{answer}");
    }
    let landed = read_topic_as(&kafka, &topic, 50, Duration::from_secs(1), &def);
    assert_exactly_once(&landed, &hashes);
    shutdown.cancel();
    let stats = agent.await.unwrap().unwrap();
    let vehicles = &stats.streams["vehicle_telemetry"];
    assert_eq!(
        (vehicles.pipeline.batched, vehicles.pipeline.duplicates),
        (50, 50)
    );
}

/// The local HTTP port takes a Parquet body with a column its stream's definition gained while
/// the agent runs: refused (400) before the file changed, read with the new definition after,
/// and delivered with the column's value. Before, such bodies were refused until the agent
/// restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_local_port_reads_a_parquet_column_a_changed_definition_added() {
    let (kafka, prefix, topic, dir, streams) = definition_rig().await;
    let (port, shutdown, agent) = local_port_agent(&kafka, &prefix, &dir, &streams).await;
    let extended = with_humidity();
    let new = schemas::StreamDef::from_toml(&extended).unwrap();
    let (lines, _) = readings(1, 1, 0, 3);
    let mut record: serde_json::Value = serde_json::from_str(&lines[0]).unwrap();
    record["humidity"] = serde_json::json!(55.5);
    let valid = schemas::check(&new, record).unwrap();
    let mut columns = schemas::columnar::BodyBuilder::new(&new, 1);
    columns.push(&valid.record);
    let body = columns.finish(&new, 3).unwrap();
    let post = || {
        post_local(
            port,
            "sensor_readings",
            "application/vnd.apache.parquet",
            body.clone(),
        )
    };
    assert_eq!(post().await.unwrap().status(), 400);
    std::fs::write(streams.join("sensor_readings.toml"), &extended).unwrap();
    let answer = post().await.unwrap();
    assert_eq!(answer.status(), 200);
    let answer: serde_json::Value = serde_json::from_slice(&answer.bytes().await.unwrap()).unwrap();
    assert_eq!(answer["accepted"], 1, "{answer}");
    let landed = read_topic_as(&kafka, &topic, 1, Duration::ZERO, &new);
    assert_exactly_once(&landed, &[valid.hash]);
    shutdown.cancel();
    let stats = agent.await.unwrap().unwrap().total();
    assert_eq!(stats.pipeline.invalid, 0);
}
