//! The S3 backend against moto: multipart uploads of equal parts created only if absent,
//! aborted on conflict; the sweep of abandoned uploads; and an S3 outage in the middle of a
//! run, after which every record still lands exactly once (read back by pyarrow).

use crate::common;
use crate::support;

use std::io::Write;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rdkafka::ClientConfig;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::FutureProducer;
use sink::SinkConfig;
use sink::config::{RotationConfig, StoreConfig};
use sink::store::{ObjectStore, PutOutcome};
use tokio_util::sync::CancellationToken;

fn unique(name: &str) -> String {
    format!("{name}-{}", common::unique_id())
}

async fn bucket_store(endpoint: &str) -> (ObjectStore, aws_sdk_s3::Client, String) {
    let bucket = unique("mp");
    common::pyarrow(&[
        "--s3-endpoint",
        endpoint,
        "--bucket",
        &bucket,
        "--create-bucket",
    ]);
    let store = ObjectStore::from_config(&support::s3_store(endpoint, &bucket))
        .await
        .unwrap();
    let ObjectStore::S3 { client, .. } = &store else {
        unreachable!()
    };
    let client = client.clone();
    (store, client, bucket)
}

fn staged(data: &[u8]) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(data).unwrap();
    f.flush().unwrap();
    f
}

async fn open_uploads(client: &aws_sdk_s3::Client, bucket: &str) -> usize {
    client
        .list_multipart_uploads()
        .bucket(bucket)
        .send()
        .await
        .unwrap()
        .uploads()
        .len()
}

#[tokio::test]
async fn large_files_go_up_in_equal_parts_only_if_absent() {
    let endpoint = common::service_env("EDGE_INGEST_S3");
    let (store, client, bucket) = bucket_store(&endpoint).await;
    const PART: usize = 5 << 20;
    let mut data = vec![0u8; 2 * PART + 1234];
    SmallRng::seed_from_u64(1).fill(&mut data[..]);
    let key = "landing/s/date=2026-01-01/hour=00/s-p0-o00000000000000000000.parquet";

    let outcome = store
        .put_file_if_absent(key, &staged(&data), PART)
        .await
        .unwrap();
    assert_eq!(outcome, PutOutcome::Created);
    for (part, len) in [(1, PART), (2, PART), (3, 1234)] {
        let head = client
            .head_object()
            .bucket(&bucket)
            .key(key)
            .part_number(part)
            .send()
            .await
            .unwrap();
        assert_eq!(head.parts_count(), Some(3));
        assert_eq!(head.content_length(), Some(len as i64), "part {part}");
    }
    assert_eq!(store.get(key).await.unwrap().unwrap(), data);

    // A second writer of the same key finds it there; its upload is aborted, not left behind.
    let other = vec![7u8; 2 * PART];
    let outcome = store
        .put_file_if_absent(key, &staged(&other), PART)
        .await
        .unwrap();
    assert_eq!(outcome, PutOutcome::AlreadyExists);
    assert_eq!(open_uploads(&client, &bucket).await, 0);
    assert_eq!(store.get(key).await.unwrap().unwrap(), data);

    // Below one part: a single conditional put.
    let small_key = "landing/s/date=2026-01-01/hour=00/s-p0-o00000000000000000099.parquet";
    let outcome = store
        .put_file_if_absent(small_key, &staged(b"small"), PART)
        .await
        .unwrap();
    assert_eq!(outcome, PutOutcome::Created);
    let head = client
        .head_object()
        .bucket(&bucket)
        .key(small_key)
        .send()
        .await
        .unwrap();
    assert_eq!(head.content_length(), Some(5));
}

/// Ranges of an object, as warming a dedupe window reads a landing file (its footer, then a
/// column's chunks), from moto and from a local directory.
#[tokio::test]
async fn ranges_of_an_object_are_read_from_s3_and_a_directory() {
    let endpoint = common::service_env("EDGE_INGEST_S3");
    let (store, _, _) = bucket_store(&endpoint).await;
    support::check_ranges(&store).await;
    let dir = tempfile::tempdir().unwrap();
    support::check_ranges(&ObjectStore::Local(dir.path().to_path_buf())).await;
}

#[tokio::test]
async fn objects_are_written_with_the_configured_encryption_and_storage_class() {
    let endpoint = common::service_env("EDGE_INGEST_S3");
    let (_, client, bucket) = bucket_store(&endpoint).await;
    let kms_key = "arn:aws:kms:us-east-1:123456789012:key/landing-zone";
    let configured = |sse: &str, kms: Option<&str>, class: &str| {
        let mut config = support::s3_store(&endpoint, &bucket);
        if let StoreConfig::S3 {
            server_side_encryption,
            kms_key_id,
            storage_class,
            ..
        } = &mut config
        {
            *server_side_encryption = Some(sse.into());
            *kms_key_id = kms.map(Into::into);
            *storage_class = Some(class.into());
        }
        config
    };
    const PART: usize = 5 << 20;
    let cases = [
        ("aws:kms", Some(kms_key), "STANDARD_IA", 2 * PART + 10),
        ("AES256", None, "INTELLIGENT_TIERING", 100),
    ];
    for (i, (sse, kms, class, size)) in cases.into_iter().enumerate() {
        let store = ObjectStore::from_config(&configured(sse, kms, class))
            .await
            .unwrap();
        // A multipart upload, then a single put: both carry the settings.
        let key = format!("landing/s/date=2026-01-01/hour=00/s-p0-o{i:020}.parquet");
        let outcome = store
            .put_file_if_absent(&key, &staged(&vec![i as u8; size]), PART)
            .await
            .unwrap();
        assert_eq!(outcome, PutOutcome::Created);
        let head = client
            .head_object()
            .bucket(&bucket)
            .key(&key)
            .send()
            .await
            .unwrap();
        assert_eq!(head.server_side_encryption().map(|s| s.as_str()), Some(sse));
        assert_eq!(head.ssekms_key_id(), kms, "{sse}");
        assert_eq!(head.storage_class().map(|c| c.as_str()), Some(class));
    }

    for (config, expected) in [
        (
            configured("aws:kmz", None, "STANDARD"),
            "store.server_side_encryption = \"aws:kmz\" is not one of",
        ),
        (
            configured("AES256", None, "COLD"),
            "store.storage_class = \"COLD\" is not one of",
        ),
        (
            configured("AES256", Some(kms_key), "STANDARD"),
            "store.kms_key_id needs server_side_encryption",
        ),
    ] {
        let e = ObjectStore::from_config(&config).await.unwrap_err();
        assert!(!e.retryable && e.message.contains(expected), "{e}");
    }
}

#[tokio::test]
async fn abandoned_multipart_uploads_are_aborted() {
    let endpoint = common::service_env("EDGE_INGEST_S3");
    let (store, client, bucket) = bucket_store(&endpoint).await;
    for key in ["landing/s/a.parquet", "other/b.parquet"] {
        let upload = client
            .create_multipart_upload()
            .bucket(&bucket)
            .key(key)
            .send()
            .await
            .unwrap();
        client
            .upload_part()
            .bucket(&bucket)
            .key(key)
            .upload_id(upload.upload_id().unwrap())
            .part_number(1)
            .body(vec![1u8; 1024].into())
            .send()
            .await
            .unwrap();
    }
    // moto reports every upload as started in 2010, so both are past the age limit here; the
    // sweep aborts the one under the sink's prefix and leaves the other alone.
    let removed = store
        .sweep_abandoned("landing/", Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!(removed, 1, "only uploads under the sink's prefix");
    assert_eq!(open_uploads(&client, &bucket).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_outage_delays_files_but_loses_and_repeats_nothing() {
    s3_outage(None).await;
}

/// An outage longer than librdkafka's `max.poll.interval.ms`: the worker, retrying an upload,
/// takes no message for that long, so librdkafka takes its partitions away and the group
/// rebalances. The flush that retried all along finishes once S3 is back; its commit is
/// refused, the partitions come back, and the records re-read from the committed offsets
/// find their objects and adopt them instead of landing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_past_the_poll_interval_rebalances_and_still_lands_once() {
    // librdkafka's least: the session timeout (10 s, the default).
    s3_outage(Some(Duration::from_secs(10))).await;
}

/// S3 unreachable for a while (longer than `poll_interval`, which it then sets as
/// `max.poll.interval.ms`) as records keep arriving.
async fn s3_outage(poll_interval: Option<Duration>) {
    let OutageRig {
        endpoint,
        bucket,
        moto_port,
        front,
        link,
        cluster,
        producer,
    } = OutageRig::new("outage").await;
    let sent = support::readings(3_000, 3);

    let mut config = sink_config(front, &bucket, &cluster, "outage", 200);
    if let Some(interval) = poll_interval {
        config.kafka.consumer.insert(
            "max.poll.interval.ms".into(),
            interval.as_millis().to_string(),
        );
    }
    let outage = poll_interval.map_or(Duration::from_secs(3), |i| i * 3 / 2);
    let shutdown = CancellationToken::new();
    let streams = schemas::example_streams();
    let sink = sink::start(config, streams, shutdown.clone())
        .await
        .unwrap();
    support::produce(&producer, TOPIC, &sent[..1_000]).await;
    wait_until("the first files", || {
        sink.stats.records_written.load(Ordering::Relaxed) > 0
    })
    .await;
    assert!(sink.readiness.check().await, "ready while S3 takes files");

    // S3 goes away while records keep arriving: uploads fail and are retried. An upload
    // answered just before the cut is counted a moment later: let that settle first (the
    // count was once taken in between, and the check below failed on that file).
    link.cancel();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let written_before = sink.stats.records_written.load(Ordering::Relaxed);
    support::produce(&producer, TOPIC, &sent[1_000..2_000]).await;
    tokio::time::sleep(outage).await;
    let written_during = sink.stats.records_written.load(Ordering::Relaxed);
    assert_eq!(
        written_during, written_before,
        "nothing lands while S3 is unreachable"
    );
    assert!(
        !sink.readiness.check().await,
        "not ready while uploads fail"
    );

    let _back = common::proxy(front, moto_port).await;
    support::produce(&producer, TOPIC, &sent[2_000..]).await;
    let distinct = {
        let mut d: Vec<String> = sent.iter().map(|r| r.to_string()).collect();
        d.sort();
        d.dedup();
        d.len() as u64
    };
    wait_until("every record read", || {
        sink.stats.records_received.load(Ordering::Relaxed) >= sent.len() as u64
    })
    .await;
    // What landed is what counts, not `records_written`: an upload that S3 took but whose
    // answer was lost in the cut is adopted when S3 is back, and its rows count as adopted,
    // not as written by this sink (a CI run once waited for them in vain).
    let deadline = Instant::now() + Duration::from_secs(90);
    let rows = || {
        let landed =
            tokio::task::block_in_place(|| common::pyarrow_s3(&endpoint, &bucket, "landing/"));
        landed["rows"].as_array().map_or(0, Vec::len) as u64
    };
    while rows() < distinct {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for every record to land"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    assert!(
        sink.readiness.check().await,
        "ready again once S3 takes files"
    );
    shutdown.cancel();
    sink.task.await.unwrap().unwrap();
    if poll_interval.is_some() {
        // The group did rebalance (a second round of landing listings, 24 hour folders each),
        // and records read again after it found their objects.
        let stats = &sink.stats;
        assert!(
            stats.landing_listings.load(Ordering::Relaxed) >= 48,
            "no rebalance: {stats:?}"
        );
        assert!(
            stats.adopted_files.load(Ordering::Relaxed) >= 1,
            "{stats:?}"
        );
    }
    let landed = common::pyarrow_s3(&endpoint, &bucket, "landing/");
    common::assert_landed_exactly(&sent, &landed);
    // Every record read is accounted for: written, held by an adopted object (an upload whose
    // answer was lost in the cut), or dropped as a duplicate.
    assert_eq!(
        sink.stats.records_settled(),
        sink.stats.records_received.load(Ordering::Relaxed),
        "{:?}",
        sink.stats
    );
    drop(cluster);
}

/// Duplicates that straddle a restart while S3 is down: the restarted sink cannot warm its
/// dedupe windows from the landing files at first. It retries before it reads the partitions
/// (not ready meanwhile), instead of reading them with cold windows, so readings re-sent after
/// the restart do not land again once S3 is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_are_warmed_once_s3_is_back_before_the_partitions_are_read() {
    let OutageRig {
        endpoint,
        bucket,
        moto_port,
        front,
        link,
        cluster,
        producer,
    } = OutageRig::new("warm-outage").await;
    let sent = support::readings(400, 9);
    let run = || {
        let config = sink_config(front, &bucket, &cluster, "warm-outage", 100);
        let shutdown = CancellationToken::new();
        let streams = schemas::example_streams();
        async move {
            let sink = sink::start(config, streams, shutdown.clone())
                .await
                .unwrap();
            (sink, shutdown)
        }
    };
    let (first, shutdown) = run().await;
    support::produce(&producer, TOPIC, &sent).await;
    wait_until("the first run's records", || {
        first.stats.records_settled() >= sent.len() as u64
    })
    .await;
    shutdown.cancel();
    first.task.await.unwrap().unwrap();

    // S3 goes away; a client re-sends every reading; a sink starts.
    link.cancel();
    support::produce(&producer, TOPIC, &sent).await;
    let (second, shutdown) = run().await;
    wait_until("a failed warming", || {
        second.stats.store_failing.load(Ordering::Relaxed)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(second.stats.records_written.load(Ordering::Relaxed), 0);
    assert!(
        !second.readiness.check().await,
        "ready while the windows cannot be warmed"
    );
    let _back = common::proxy(front, moto_port).await;
    wait_until("the re-sent records", || {
        second.stats.records_settled() >= sent.len() as u64
    })
    .await;
    shutdown.cancel();
    second.task.await.unwrap().unwrap();
    assert_eq!(
        second.stats.duplicates_dropped.load(Ordering::Relaxed),
        sent.len() as u64,
        "{:?}",
        second.stats
    );
    let landed = common::pyarrow_s3(&endpoint, &bucket, "landing/");
    common::assert_landed_exactly(&sent, &landed);
    drop(cluster);
}

const TOPIC: &str = "ingest.sensor_readings";

/// A sink on the rig's bucket through its proxy on `front` and its cluster, in `group`, with
/// files of `max_records` rows and a 300 ms idle rotation.
fn sink_config(
    front: u16,
    bucket: &str,
    cluster: &MockCluster<'static, rdkafka::producer::DefaultProducerContext>,
    group: &str,
    max_records: usize,
) -> SinkConfig {
    let mut config = SinkConfig {
        store: support::s3_store(&format!("http://127.0.0.1:{front}"), bucket),
        rotation: RotationConfig {
            max_records,
            idle_ms: 300,
            ..RotationConfig::default()
        },
        ..SinkConfig::default()
    };
    config.kafka.brokers = cluster.bootstrap_servers();
    config.kafka.group_id = group.into();
    config
}

/// A bucket on moto reached through a proxy (cancel `link` for an outage; a new proxy on
/// `front` ends it), and a mock cluster with a two-partition sensor topic and a producer.
struct OutageRig {
    endpoint: String,
    bucket: String,
    moto_port: u16,
    front: u16,
    link: CancellationToken,
    cluster: MockCluster<'static, rdkafka::producer::DefaultProducerContext>,
    producer: FutureProducer,
}

impl OutageRig {
    async fn new(name: &str) -> OutageRig {
        let endpoint = common::service_env("EDGE_INGEST_S3");
        let bucket = unique(name);
        common::pyarrow(&[
            "--s3-endpoint",
            &endpoint,
            "--bucket",
            &bucket,
            "--create-bucket",
        ]);
        let moto_port: u16 = endpoint.rsplit(':').next().unwrap().parse().unwrap();
        let front = common::free_port();
        let link = common::proxy(front, moto_port).await;
        let cluster = MockCluster::new(1).unwrap();
        cluster.create_topic(TOPIC, 2, 1).unwrap();
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", cluster.bootstrap_servers())
            .create()
            .unwrap();
        OutageRig {
            endpoint,
            bucket,
            moto_port,
            front,
            link,
            cluster,
            producer,
        }
    }
}

async fn wait_until(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(90);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// An S3-compatible store on HTTPS with a certificate the platform does not know (moto with a
/// certificate made for the test): with `ca_file` naming it, objects go up and come back;
/// without, the handshake fails (retryable, as a store out of reach); a `ca_file` without a
/// certificate is a configuration error.
#[tokio::test]
async fn an_https_store_is_trusted_through_its_ca_file() {
    let dir = tempfile::tempdir().unwrap();
    let cert = rcgen::generate_simple_self_signed(vec!["127.0.0.1".into()]).unwrap();
    let (cert_path, key_path) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert_path, cert.cert.pem()).unwrap();
    std::fs::write(&key_path, cert.signing_key.serialize_pem()).unwrap();
    let port = common::free_port();
    let moto = std::path::Path::new(&common::service_env("EDGE_INGEST_PYTHON"))
        .with_file_name("moto_server");
    let _moto = common::KillOnDrop(
        std::process::Command::new(moto)
            .args(["-H", "127.0.0.1", "-p", &port.to_string(), "-c"])
            .arg(&cert_path)
            .arg("-k")
            .arg(&key_path)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("moto.log")).unwrap())
            .spawn()
            .unwrap(),
    );
    wait_until("moto on HTTPS", || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    })
    .await;
    let endpoint = format!("https://127.0.0.1:{port}");
    let bucket = unique("tls");
    let with_ca = |ca: Option<std::path::PathBuf>| {
        let mut config = support::s3_store(&endpoint, &bucket);
        if let StoreConfig::S3 { ca_file, .. } = &mut config {
            *ca_file = ca;
        }
        config
    };
    let store = ObjectStore::from_config(&with_ca(Some(cert_path)))
        .await
        .unwrap();
    let ObjectStore::S3 { client, .. } = &store else {
        panic!("an S3 store")
    };
    client.create_bucket().bucket(&bucket).send().await.unwrap();
    let key = "landing/s/date=2026-01-01/hour=00/s-p0-o00000000000000000000.parquet";
    let data = bytes::Bytes::from_static(b"over TLS");
    assert_eq!(
        store.put_if_absent(key, data.clone()).await.unwrap(),
        PutOutcome::Created
    );
    assert_eq!(store.get(key).await.unwrap().unwrap(), data);
    // The platform's roots do not know the certificate.
    let untrusted = ObjectStore::from_config(&with_ca(None)).await.unwrap();
    let e = untrusted.get(key).await.unwrap_err();
    assert!(e.retryable, "{}", e.message);
    let junk = dir.path().join("junk.pem");
    std::fs::write(&junk, "not a certificate").unwrap();
    let e = ObjectStore::from_config(&with_ca(Some(junk)))
        .await
        .unwrap_err();
    assert!(
        !e.retryable && e.message.contains("holds no PEM certificate"),
        "{}",
        e.message
    );
}
