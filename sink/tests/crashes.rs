//! Sink processes killed with SIGKILL at random points while two of them share the partitions,
//! writing into moto's S3; pyarrow reads the objects back and every distinct record is there
//! exactly once. The kills and the rebalance of a joining sink run on an Apache Kafka node of
//! the test's own, with the classic consumer group protocol and with KIP-848's; the tests of S3
//! outages, a full disk and reloads on librdkafka's mock cluster in this process.

use crate::common;
use crate::support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::kafka::{KafkaCluster, KafkaOptions, kafka_tool};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rdkafka::ClientConfig;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::FutureProducer;

const TOPIC: &str = "ingest.sensor_readings";
const PARTITIONS: i32 = 4;
const GROUP: &str = "crash-sinks";

fn start_sink(config: &Path, log: &Path) -> Child {
    spawn_sink(Command::new(env!("CARGO_BIN_EXE_sink")), config, log)
}

/// Runs `command` (the sink, or a wrapper that ends in it) with the sink's arguments for
/// `config`, logging to `log`.
fn spawn_sink(mut command: Command, config: &Path, log: &Path) -> Child {
    let log = std::fs::File::create(log).unwrap();
    command
        .arg("--config")
        .arg(config)
        .env("RUST_LOG", "sink=info")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("cannot start the sink binary")
}

/// The broker of a test: librdkafka's mock cluster in this process, or an Apache Kafka node of
/// the test's own (the mock cluster serves only the classic consumer group protocol). Held, not
/// read: the broker runs until the test drops it.
#[allow(dead_code)]
enum Broker {
    Mock(MockCluster<'static, rdkafka::producer::DefaultProducerContext>),
    Kafka(KafkaCluster),
}

/// What a test of sink processes works on: moto's address, a bucket of the test's own there
/// (named after `name`), a mock cluster whose topic has `partitions`, its bootstrap address,
/// and a directory for configs, logs and staging.
fn rig(name: &str, partitions: i32) -> (String, String, Broker, String, tempfile::TempDir) {
    let cluster = MockCluster::new(1).unwrap();
    cluster.create_topic(TOPIC, partitions, 1).unwrap();
    let bootstrap = cluster.bootstrap_servers();
    rig_on(name, Broker::Mock(cluster), bootstrap)
}

/// [`rig`] on an Apache Kafka node of the test's own.
fn kafka_rig(name: &str, partitions: i32) -> (String, String, Broker, String, tempfile::TempDir) {
    let cluster = KafkaCluster::start(KafkaOptions {
        nodes: 1,
        ..KafkaOptions::default()
    });
    let bootstrap = cluster.bootstrap();
    let (ok, out) = kafka_tool(
        "topics",
        &[
            "--bootstrap-server",
            &bootstrap,
            "--create",
            "--topic",
            TOPIC,
            "--partitions",
            &partitions.to_string(),
        ],
    );
    assert!(ok, "kafka-topics failed: {out}");
    rig_on(name, Broker::Kafka(cluster), bootstrap)
}

fn rig_on(
    name: &str,
    broker: Broker,
    bootstrap: String,
) -> (String, String, Broker, String, tempfile::TempDir) {
    let s3 = common::service_env("EDGE_INGEST_S3");
    let bucket = format!("{name}-{}", common::unique_id());
    common::pyarrow(&["--s3-endpoint", &s3, "--bucket", &bucket, "--create-bucket"]);
    (s3, bucket, broker, bootstrap, tempfile::tempdir().unwrap())
}

/// Sets the consumer group protocol (`classic` or `consumer`) in the sink config at `config`.
fn with_group_protocol(config: &Path, protocol: &str) {
    let text = std::fs::read_to_string(config).unwrap();
    let text = text.replace(
        "[kafka]\n",
        &format!("[kafka]\ngroup_protocol = \"{protocol}\"\n"),
    );
    std::fs::write(config, text).unwrap();
}

/// Waits until `sinks` committed every partition, stops them gracefully, and checks with
/// pyarrow that each of `sent` is in `bucket` exactly once.
async fn land_exactly_once(
    bootstrap: &str,
    mut sinks: Vec<Child>,
    dir: &Path,
    (s3, bucket): (&str, &str),
    sent: &[serde_json::Value],
) {
    wait_caught_up(bootstrap, &mut sinks, dir).await;
    support::stop_gracefully(sinks);
    let landed = common::pyarrow_s3(s3, bucket, "landing/");
    common::assert_landed_exactly(sent, &landed);
}

fn caught_up(bootstrap: &str) -> bool {
    support::caught_up(bootstrap, GROUP, TOPIC)
}

/// A sink config on `dir` (staging under it) for the broker at `bootstrap` and the bucket.
fn write_config(dir: &Path, bootstrap: &str, s3: &str, bucket: &str) -> PathBuf {
    write_config_rotating(
        dir,
        bootstrap,
        s3,
        bucket,
        "max_records = 150\nidle_ms = 400",
    )
}

/// [`write_config`] with the `[rotation]` settings `rotation`.
fn write_config_rotating(
    dir: &Path,
    bootstrap: &str,
    s3: &str,
    bucket: &str,
    rotation: &str,
) -> PathBuf {
    let config = dir.join("sink.toml");
    std::fs::write(
        &config,
        format!(
            r#"
streams_dir = "{streams}"
admin_listen = "127.0.0.1:0"
key_prefix = "landing"
memory_budget_bytes = 200000
[kafka]
brokers = "{bootstrap}"
group_id = "{GROUP}"
session_timeout_ms = 3000
consumer = {{ "fetch.wait.max.ms" = "50" }}
[store]
type = "s3"
bucket = "{bucket}"
endpoint = "{s3}"
region = "us-east-1"
force_path_style = true
[rotation]
{rotation}
[upload]
staging_dir = "{staging}"
"#,
            streams = common::repo_root().join("streams").display(),
            staging = dir.join("staging").display(),
        ),
    )
    .unwrap();
    config
}

/// Waits until the group committed every partition to its end (two minutes at most), checking
/// that no sink exited meanwhile.
async fn wait_caught_up(bootstrap: &str, sinks: &mut [Child], dir: &Path) {
    support::wait_caught_up(bootstrap, (GROUP, TOPIC), sinks, dir).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sinks_killed_at_random_points_land_every_record_exactly_once_classic_protocol() {
    sinks_killed_at_random_points("classic").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sinks_killed_at_random_points_land_every_record_exactly_once_consumer_protocol() {
    sinks_killed_at_random_points("consumer").await;
}

async fn sinks_killed_at_random_points(protocol: &str) {
    let (s3, bucket, cluster, bootstrap, dir) = kafka_rig(&format!("crash-{protocol}"), PARTITIONS);
    let config = write_config(dir.path(), &bootstrap, &s3, &bucket);
    with_group_protocol(&config, protocol);

    let sent = support::readings(6_000, 11);
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .create()
        .unwrap();
    let mut rng = SmallRng::seed_from_u64(5);
    let mut sinks: Vec<Child> = (0..2)
        .map(|i| start_sink(&config, &dir.path().join(format!("sink-{i}.log"))))
        .collect();
    let mut kills = 0;
    let mut started = 2;
    // Undecodable values among the readings, on every partition: their dead letters are
    // written once too, whatever range each sink read them in.
    let mut garbage = 0;
    // Produce in chunks; between chunks, SIGKILL one of the two sinks at a random moment and
    // start a replacement.
    for chunk in sent.chunks(500) {
        for part in chunk.chunks(50) {
            support::produce(&producer, TOPIC, part).await;
            let key = part[0]["device_id"].as_str().unwrap();
            support::produce_raw(&producer, TOPIC, key, &format!("garbage {garbage}")).await;
            garbage += 1;
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(200..1_500))).await;
        if rng.random_bool(0.5) {
            let victim = rng.random_range(0..sinks.len());
            let mut child = sinks.swap_remove(victim);
            child.kill().unwrap(); // SIGKILL
            child.wait().unwrap();
            kills += 1;
            sinks.push(start_sink(
                &config,
                &dir.path().join(format!("sink-{started}.log")),
            ));
            started += 1;
        }
    }
    assert!(kills >= 3, "only {kills} kills");

    wait_caught_up(&bootstrap, &mut sinks, dir.path()).await;
    support::stop_gracefully(sinks);
    // The killed sinks' staged files were removed by the sinks started after them (their
    // folders' locks were free), the others' by their graceful stops.
    let left: Vec<_> = std::fs::read_dir(dir.path().join("staging"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert!(left.is_empty(), "left in the staging directory: {left:?}");
    let landed = common::pyarrow_s3(&s3, &bucket, "landing/");
    common::assert_landed_exactly(&sent, &landed);
    let dead = support::dead_letters(&s3, &bucket).await;
    let distinct: std::collections::HashSet<_> = dead.iter().collect();
    assert_eq!(distinct.len(), garbage, "every dead letter: {dead:?}");
    assert_eq!(dead.len(), garbage, "each dead letter once: {dead:?}");
    drop(cluster);
}

/// A sink killed while S3 is unreachable, with files finished and their uploads failing and
/// retried: it committed none of their offsets, so the sink started after it (S3 back) reads
/// those records again and lands every one exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_killed_during_an_s3_outage_loses_nothing() {
    stopped_during_an_s3_outage("kill").await;
}

/// The same with SIGTERM: the sink gives up the uploads and exits, and commits nothing after
/// them. Before, its stop took the range of a given-up file for one of skipped records only,
/// committed past it, and those records were lost. Once one upload is given up, the other
/// partitions' are not tried, so the stop does not take every partition's retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_stopped_during_an_s3_outage_loses_nothing() {
    stopped_during_an_s3_outage("term").await;
}

/// Records through a sink that is stopped with `signal` ("kill" or "term") while S3 is
/// unreachable, then through a sink started when S3 is back.
async fn stopped_during_an_s3_outage(signal: &str) {
    let (s3, bucket, cluster, bootstrap, dir) = rig(&format!("outage-{signal}"), PARTITIONS);
    let moto_port: u16 = s3.rsplit(':').next().unwrap().parse().unwrap();
    let front = common::free_port();
    let link = common::proxy(front, moto_port).await;
    let config = write_config(
        dir.path(),
        &bootstrap,
        &format!("http://127.0.0.1:{front}"),
        &bucket,
    );
    let sent = support::readings(3_000, 17);
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .create()
        .unwrap();
    let sink = start_sink(&config, &dir.path().join("sink-0.log"));
    support::produce(&producer, TOPIC, &sent[..1_000]).await;
    let mut sinks = vec![sink];
    wait_caught_up(&bootstrap, &mut sinks, dir.path()).await;
    // S3 goes away; the next records make files whose uploads fail and are retried (files of
    // 150 records, and the 400 ms idle rotation for the rest).
    link.cancel();
    support::produce(&producer, TOPIC, &sent[1_000..2_000]).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    let log = std::fs::read_to_string(dir.path().join("sink-0.log")).unwrap();
    assert!(
        !tokio::task::block_in_place(|| caught_up(&bootstrap)),
        "nothing is committed while S3 is unreachable; log:\n{log}"
    );
    let mut sink = sinks.pop().unwrap();
    if signal == "kill" {
        sink.kill().unwrap(); // SIGKILL
        sink.wait().unwrap();
    } else {
        // Once one write is given up, the other partitions' are not tried: the stop took
        // every partition's retries before (26 s here, against 2 s).
        let asked = Instant::now();
        support::stop_gracefully(vec![sink]);
        let took = asked.elapsed();
        assert!(took < Duration::from_secs(12), "the stop took {took:?}");
    }
    let _back = common::proxy(front, moto_port).await;
    let sinks = vec![start_sink(&config, &dir.path().join("sink-1.log"))];
    support::produce(&producer, TOPIC, &sent[2_000..]).await;
    land_exactly_once(&bootstrap, sinks, dir.path(), (&s3, &bucket), &sent).await;
    drop(cluster);
}

/// The staging disk fills up while the sink runs (another program took the space): each
/// partition whose staged write fails drops its open file and is read again from Kafka after a
/// backoff, the sink keeps running, and once the disk has room every record lands exactly once.
/// Before, the first failed write made the sink exit. The staging directory is a 1 MiB tmpfs
/// that only the sink sees (a mount namespace of its own, through `unshare`); the test fills it
/// through `/proc/<pid>/root`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_staging_disk_rewinds_the_partitions_and_loses_nothing() {
    let (s3, bucket, cluster, bootstrap, dir) = rig("full", PARTITIONS);
    let config = write_config(dir.path(), &bootstrap, &s3, &bucket);
    let staging = dir.path().join("staging");
    std::fs::create_dir(&staging).unwrap();
    let log = dir.path().join("sink.log");
    let mut unshare = Command::new("unshare");
    unshare
        .args(["--user", "--map-root-user", "--mount", "sh", "-c"])
        .arg(r#"mount -t tmpfs -o size=1m tmpfs "$0" && exec "$@""#)
        .arg(&staging)
        .arg(env!("CARGO_BIN_EXE_sink"));
    let mut sinks = vec![spawn_sink(unshare, &config, &log)];
    let logged = |what: &str| {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .matches(what)
            .count()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while logged("staging dir=") == 0 {
        assert!(
            sinks[0].try_wait().unwrap().is_none() && Instant::now() < deadline,
            "the sink did not start on its tmpfs (are user namespaces allowed?):\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let sent = support::readings(3_000, 23);
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .create()
        .unwrap();
    support::produce(&producer, TOPIC, &sent[..1_000]).await;
    wait_caught_up(&bootstrap, &mut sinks, dir.path()).await;

    // Another program takes the rest of the disk.
    let filler = PathBuf::from(format!(
        "/proc/{}/root{}/filler",
        sinks[0].id(),
        staging.display()
    ));
    let mut file = std::fs::File::create(&filler).unwrap();
    let full = loop {
        if let Err(e) = std::io::Write::write_all(&mut file, &[0; 65_536]) {
            break e;
        }
    };
    assert_eq!(full.kind(), std::io::ErrorKind::StorageFull, "{full}");
    drop(file);
    support::produce(&producer, TOPIC, &sent[1_000..2_000]).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    // Written again and again, and failing each time.
    while logged("cannot write a staged file") < 3 {
        assert!(
            sinks[0].try_wait().unwrap().is_none(),
            "the sink exited when its disk was full:\n{}",
            std::fs::read_to_string(&log).unwrap()
        );
        assert!(
            Instant::now() < deadline,
            "no staged write failed; log in {}",
            dir.path().display()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        !tokio::task::block_in_place(|| caught_up(&bootstrap)),
        "nothing is committed past what could not be written"
    );

    // The space comes back: the partitions are read again from their open ranges.
    std::fs::remove_file(&filler).unwrap();
    support::produce(&producer, TOPIC, &sent[2_000..]).await;
    land_exactly_once(&bootstrap, sinks, dir.path(), (&s3, &bucket), &sent).await;
    drop(cluster);
}

/// The partitions a sink's log names in lines with `event` ("partition assigned", "partition
/// revoked"), in order.
fn logged_partitions(log: &Path, event: &str) -> Vec<i32> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(event))
        .map(|l| {
            let (_, rest) = l.split_once(" partition=").expect("a partition field");
            rest.split(|c: char| !c.is_ascii_digit())
                .next()
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect()
}

/// A second sink joins the group, and later the first stops. With the cooperative protocol
/// (the classic protocol's cooperative-sticky assignor, or KIP-848's, incremental of itself)
/// only the partitions that move change hands: the first sink keeps the others, with their open
/// files. An eager rebalance (librdkafka's default protocol) revoked every partition of every
/// sink, so each sink that joined or left (a deploy, a scale-up) dropped every open file of the
/// group, and all of it was read again, up to a file target per partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joining_sink_takes_only_the_partitions_that_move_classic_protocol() {
    a_joining_sink_takes_only_the_partitions_that_move("classic").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joining_sink_takes_only_the_partitions_that_move_consumer_protocol() {
    a_joining_sink_takes_only_the_partitions_that_move("consumer").await;
}

async fn a_joining_sink_takes_only_the_partitions_that_move(protocol: &str) {
    let (s3, bucket, cluster, bootstrap, dir) = kafka_rig(&format!("join-{protocol}"), PARTITIONS);
    // Files stay open across the rebalance (nothing is idle for 5 s).
    let rotation = "max_records = 100000\nidle_ms = 5000";
    let config = write_config_rotating(dir.path(), &bootstrap, &s3, &bucket, rotation);
    with_group_protocol(&config, protocol);
    let sent = support::readings(1_500, 29);
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .create()
        .unwrap();
    let (log_a, log_b) = (dir.path().join("sink-a.log"), dir.path().join("sink-b.log"));
    let mut sinks = vec![start_sink(&config, &log_a)];
    let wait_for = |log: &Path, event: &str, count: usize| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while logged_partitions(log, event).len() < count {
            assert!(
                Instant::now() < deadline,
                "no {count} lines '{event}' in {}",
                log.display()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    tokio::task::block_in_place(|| wait_for(&log_a, "partition assigned", 4));
    support::produce(&producer, TOPIC, &sent[..500]).await;

    sinks.push(start_sink(&config, &log_b));
    support::produce(&producer, TOPIC, &sent[500..1_000]).await;
    tokio::task::block_in_place(|| wait_for(&log_b, "partition assigned", 2));
    let mut moved = logged_partitions(&log_b, "partition assigned");
    moved.sort_unstable();
    let mut revoked = logged_partitions(&log_a, "partition revoked");
    revoked.sort_unstable();
    assert_eq!(
        revoked, moved,
        "the first sink gives up only the partitions the second takes"
    );
    assert_eq!(logged_partitions(&log_a, "partition assigned").len(), 4);
    // Kafka's own tool names the group's assignor: the classic protocol's cooperative sticky
    // one, which the sinks chose, or the brokers' (`uniform`).
    let (ok, out) = kafka_tool(
        "consumer-groups",
        &[
            "--bootstrap-server",
            &bootstrap,
            "--describe",
            "--group",
            GROUP,
            "--state",
        ],
    );
    assert!(ok, "kafka-consumer-groups failed: {out}");
    let assignor = if protocol == "consumer" {
        "uniform"
    } else {
        "cooperative-sticky"
    };
    let line = out
        .lines()
        .find(|l| l.starts_with(GROUP))
        .unwrap_or_default();
    assert!(line.contains(assignor) && line.contains(" 2"), "{out}");

    // The first sink stops: the second takes its partitions and keeps its own.
    support::produce(&producer, TOPIC, &sent[1_000..]).await;
    support::stop_gracefully(vec![sinks.remove(0)]);
    tokio::task::block_in_place(|| wait_for(&log_b, "partition assigned", 4));
    assert!(
        logged_partitions(&log_b, "partition revoked").is_empty(),
        "the second sink kept its partitions"
    );
    land_exactly_once(&bootstrap, sinks, dir.path(), (&s3, &bucket), &sent).await;
    drop(cluster);
}

/// A sink whose soft limit on open files is below what it needs (a staged file per partition
/// with records; systemd starts services with a soft limit of 1,024): it raises the limit to the
/// hard one at start, and every record lands. Before, each staged file past the limit failed
/// with "Too many open files".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_low_open_files_limit_is_raised_at_start() {
    let (s3, bucket, cluster, bootstrap, dir) = rig("nofile", 100);
    // Files stay open until their partition is idle for 3 s: up to 100 at once.
    let rotation = "max_records = 100000\nidle_ms = 3000";
    let config = write_config_rotating(dir.path(), &bootstrap, &s3, &bucket, rotation);
    let mut limited = Command::new("sh");
    limited
        .args(["-c", r#"ulimit -Sn 40 && exec "$0" "$@""#])
        .arg(env!("CARGO_BIN_EXE_sink"));
    let log = dir.path().join("sink.log");
    let sinks = vec![spawn_sink(limited, &config, &log)];
    // Distinct readings, each keyed by itself: they spread over all 100 partitions.
    let mut sent = support::readings(1_000, 31);
    let mut seen = std::collections::HashSet::new();
    sent.retain(|r| seen.insert(r.to_string()));
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .create()
        .unwrap();
    for (i, r) in sent.iter().enumerate() {
        support::produce_raw(&producer, TOPIC, &format!("k{i}"), &r.to_string()).await;
    }
    land_exactly_once(&bootstrap, sinks, dir.path(), (&s3, &bucket), &sent).await;
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(!text.contains("Too many open files"), "{text}");
    drop(cluster);
}

/// SIGHUP reloads the config into the running sink. A config that does not load changes
/// nothing (`sink_config_last_reload_successful` 0). One that loads puts its rotation settings
/// in force: files that would have stayed open for an hour close at 10 records and when idle,
/// and the records land exactly once. A changed setting that takes a restart (`key_prefix`)
/// is named in the log and not applied. Before, SIGHUP was only logged and a rotation change
/// took a restart, which uploads every open file at whatever size it had reached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_puts_new_rotation_settings_in_force_and_keeps_them_through_a_bad_config() {
    let (s3, bucket, cluster, bootstrap, dir) = rig("hup", 2);
    let admin = common::free_port();
    let write = |rotation: &str, key_prefix: &str, dedupe_window: usize| {
        let config = write_config_rotating(dir.path(), &bootstrap, &s3, &bucket, rotation);
        let text = std::fs::read_to_string(&config).unwrap();
        let text = text
            .replace("127.0.0.1:0", &format!("127.0.0.1:{admin}"))
            .replace(
                "key_prefix = \"landing\"",
                &format!("key_prefix = \"{key_prefix}\"\ndedupe_window = {dedupe_window}"),
            );
        std::fs::write(&config, text).unwrap();
        config
    };
    // Nothing closes on its own during the test: a million records, an idle hour.
    let config = write(
        "max_records = 1000000\nidle_ms = 3600000",
        "landing",
        100_000,
    );
    let log = dir.path().join("sink.log");
    let sink = start_sink(&config, &log);
    let sent = support::readings(200, 37);
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .create()
        .unwrap();
    // Keyed by device, as the gateway keys them: a repeated reading meets its first copy.
    let key = |r: &serde_json::Value| r["device_id"].as_str().unwrap().to_owned();
    for r in &sent[..100] {
        support::produce_raw(&producer, TOPIC, &key(r), &r.to_string()).await;
    }
    let logged = |text: &str| std::fs::read_to_string(&log).unwrap().contains(text);
    // Each wait up to a minute (the suite shares two cores).
    let wait_for = |what: &'static str, done: &dyn Fn() -> bool| {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !done() {
            assert!(
                Instant::now() < deadline,
                "{what}; log in {}",
                log.display()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    wait_for("the sink did not read the first 100 records", &|| {
        metric(admin, "sink_records_received_total") >= 100.0
    });
    let hup = || {
        let status = Command::new("kill")
            .args(["-HUP", &sink.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    };
    // A config that does not load: the running settings stay.
    write("max_records = \"ten\"", "landing", 100_000);
    hup();
    wait_for("the bad config was not reported", &|| {
        logged("SIGHUP: the config does not load or check")
    });
    assert_eq!(metric(admin, "sink_config_last_reload_successful"), 0.0);
    // One that loads: files of 10 records, closed after 300 ms idle, dedupe windows of 1,000
    // entries; and a key prefix that takes a restart.
    let windows = metric(admin, "sink_dedupe_window_bytes");
    assert!(
        windows > 2.0 * 100_000.0 * 20.0,
        "{windows} bytes of windows"
    );
    write("max_records = 10\nidle_ms = 300", "elsewhere", 1_000);
    hup();
    wait_for("the reload was not logged", &|| {
        logged("SIGHUP: reloaded the config")
    });
    assert_eq!(metric(admin, "sink_config_last_reload_successful"), 1.0);
    let text = std::fs::read_to_string(&log).unwrap();
    let line = text
        .lines()
        .find(|l| l.contains("SIGHUP: reloaded the config"))
        .unwrap();
    assert!(
        line.contains(r#"in_force=["rotation.max_records", "rotation.idle_ms", "dedupe_window"]"#)
            && line.contains(r#"at_restart=["key_prefix"]"#),
        "{line}"
    );
    // The windows shrink to their new size (at the worker's next tick, after the log line).
    wait_for("the dedupe windows were not resized", &|| {
        metric(admin, "sink_dedupe_window_bytes")
            <= 2.0 * 1_000.0 * schemas::window::MAX_UNTIMED_ENTRY_BYTES as f64
    });
    for r in &sent[100..] {
        support::produce_raw(&producer, TOPIC, &key(r), &r.to_string()).await;
    }
    // Committed to the end only if the files closed by the new settings (with the old ones
    // they would stay open for an hour).
    land_exactly_once(&bootstrap, vec![sink], dir.path(), (&s3, &bucket), &sent).await;
    let landed = common::pyarrow_s3(&s3, &bucket, "landing/");
    let rows: Vec<u64> = landed["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["rows"].as_u64().unwrap())
        .collect();
    // At most one file per partition holds more: the records read before the reload.
    let small = rows.iter().filter(|&&n| n <= 10).count();
    assert!(
        rows.len() - small <= 2 && small >= 8,
        "files of {rows:?} rows"
    );
    drop(cluster);
}

/// The sum of a metric's series on a sink's admin port (0 when absent, or before the port
/// listens).
fn metric(admin: u16, name: &str) -> f64 {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", admin)) else {
        return 0.0;
    };
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with([' ', '{']))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
