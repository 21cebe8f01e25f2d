//! Kafka as managed clusters run it: TLS with a certificate from a CA of the site's own, and SASL
//! SCRAM-SHA-512 logins. tansu requires the logins; a TLS endpoint of this test's own sits in
//! front of it (tansu 0.6 cannot serve TLS itself: its `--cert` and `--key` flags exclude each
//! other) and tansu advertises that endpoint, so every connection goes through TLS. The gateway
//! creates the topics and produces, the agent's Kafka output produces, the sink consumes, and
//! pyarrow reads what landed. A wrong password or an untrusted certificate gets nothing in.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::KillOnDrop;
use edge_agent::AgentConfig;
use ingest_gateway::GatewayConfig;
use ingest_gateway::config::AuthConfig;
use loadtest::demo::distinct_hashes;
use loadtest::fleet::{FleetSpec, sensor_readings, to_ndjson};
use service_kit::kafka::security::{Sasl, SaslMechanism};
use service_kit::tls::TlsFiles;
use sink::SinkConfig;
use sink::config::{RotationConfig, StoreConfig};
use tokio_util::sync::CancellationToken;

const USER: &str = "ingest";

/// tansu requiring SCRAM logins of user `ingest`, reachable only through a TLS endpoint.
struct SecureKafka {
    _tansu: KillOnDrop,
    _tls: CancellationToken,
    /// The TLS endpoint.
    bootstrap: String,
    /// The CA (here the endpoint's own self-signed certificate).
    ca: PathBuf,
    password: String,
    password_file: PathBuf,
}

impl SecureKafka {
    async fn start(dir: &Path) -> SecureKafka {
        let (plain, tls) = (common::free_port(), common::free_port());
        let password = format!("pw-{}", common::unique_id());
        // tansu keeps users in its storage; one can be created only while logins are not yet
        // required, so the broker runs once without them.
        let setup = spawn_tansu(plain, plain, dir, false);
        let tansu = common::service_env("EDGE_INGEST_TANSU");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let created = Command::new(&tansu)
                .args(["user", "create", "--mechanism", "scram512"])
                .args(["--broker", &format!("tcp://127.0.0.1:{plain}")])
                .args([USER, &password])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .unwrap();
            if created.success() {
                break;
            }
            assert!(Instant::now() < deadline, "tansu user create failed");
            std::thread::sleep(Duration::from_millis(200));
        }
        drop(setup);
        let broker = spawn_tansu(plain, tls, dir, true);

        let made = rcgen::generate_simple_self_signed(vec!["127.0.0.1".into()]).unwrap();
        let (ca, key) = (dir.join("kafka-ca.pem"), dir.join("kafka-key.pem"));
        std::fs::write(&ca, made.cert.pem()).unwrap();
        std::fs::write(&key, made.signing_key.serialize_pem()).unwrap();
        let server = service_kit::http::server::TlsConfig {
            cert: ca.clone(),
            key,
            client_ca_file: None,
        };
        let acceptor = tokio_rustls::TlsAcceptor::from(server.load().await.unwrap().get_inner());
        let stop = common::tls_proxy(tls, plain, acceptor).await;
        let password_file = dir.join("kafka-password");
        // As a mounted secret often is: with a trailing newline, which is not the password's.
        std::fs::write(&password_file, format!("{password}\n")).unwrap();
        SecureKafka {
            _tansu: broker,
            _tls: stop,
            bootstrap: format!("127.0.0.1:{tls}"),
            ca,
            password,
            password_file,
        }
    }

    fn tls(&self) -> TlsFiles {
        TlsFiles {
            ca_file: Some(self.ca.clone()),
            ..TlsFiles::default()
        }
    }

    fn sasl(&self) -> Sasl {
        Sasl {
            mechanism: SaslMechanism::ScramSha512,
            username: USER.into(),
            password: None,
            password_file: Some(self.password_file.clone()),
        }
    }
}

/// A tansu of this test's own with its storage in `dir` (sqlite), advertising `advertised`,
/// with or without required logins; waits until it listens.
fn spawn_tansu(port: u16, advertised: u16, dir: &Path, logins: bool) -> KillOnDrop {
    let mut command = Command::new(common::service_env("EDGE_INGEST_TANSU"));
    command
        .args(["broker", "--listener-url"])
        .arg(format!("tcp://127.0.0.1:{port}"))
        .arg("--advertised-listener-url")
        .arg(format!("tcp://127.0.0.1:{advertised}"))
        // tansu reads the file of a sqlite:// url relative to its working directory.
        .args(["--storage-engine", "sqlite://tansu.db"])
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if logins {
        command.arg("--authentication");
    }
    let child = KillOnDrop(command.spawn().unwrap());
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "tansu did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    child
}

fn gateway_config(kafka: &SecureKafka, prefix: &str) -> GatewayConfig {
    let mut config = GatewayConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        auth: AuthConfig {
            allow_anonymous: true,
            tokens: Vec::new(),
        },
        ..GatewayConfig::default()
    };
    config.kafka.brokers = kafka.bootstrap.clone();
    config.kafka.topic_prefix = prefix.to_owned();
    config.kafka.dead_letter_topic = format!("{prefix}dead-letters");
    config.kafka.tls = Some(kafka.tls());
    config.kafka.sasl = Some(kafka.sasl());
    config.kafka.produce_timeout_ms = 20_000;
    config
}

/// Posts `records` as one NDJSON body; returns the status.
async fn post(addr: std::net::SocketAddr, records: &[serde_json::Value]) -> u16 {
    reqwest::Client::new()
        .post(format!("http://{addr}/v1/streams/sensor_readings/records"))
        .header("content-type", "application/x-ndjson")
        .body(to_ndjson(records))
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_agent_and_sink_reach_kafka_over_tls_with_scram_logins() {
    let dir = tempfile::tempdir().unwrap();
    let kafka = SecureKafka::start(dir.path()).await;
    let prefix = format!("sec{}.", common::unique_id());
    let streams = schemas::example_streams();
    let shutdown = CancellationToken::new();

    // The gateway creates the topics (its admin client logs in too) and produces.
    let mut config = gateway_config(&kafka, &prefix);
    config.kafka.create_topics = true;
    let gateway = ingest_gateway::start(config, streams.clone(), shutdown.clone())
        .await
        .unwrap();
    let by_gateway = sensor_readings(&FleetSpec {
        records: 400,
        devices: 4,
        seed: 11,
        ..FleetSpec::default()
    });
    assert_eq!(post(gateway.addr, &by_gateway).await, 200);

    // The agent's Kafka output, configured as a file would configure it; the password comes
    // from the environment-style `password` key this time.
    let by_agent = sensor_readings(&FleetSpec {
        records: 300,
        devices: 3,
        seed: 12,
        ..FleetSpec::default()
    });
    let file = dir.path().join("readings.ndjson");
    std::fs::write(&file, to_ndjson(&by_agent)).unwrap();
    let agent = AgentConfig::parse(&format!(
        r#"
        state_dir = {state:?}
        [kafka]
        brokers = "{brokers}"
        topic_prefix = "{prefix}"
        tls = {{ ca_file = {ca:?} }}
        sasl = {{ mechanism = "SCRAM-SHA-512", username = "{USER}", password = "{password}" }}
        [[sources]]
        type = "file"
        path = {file:?}
        stream = "sensor_readings"
        "#,
        state = dir.path().join("agent"),
        brokers = kafka.bootstrap,
        ca = kafka.ca,
        password = kafka.password,
    ))
    .unwrap();
    let agent_stats = edge_agent::run(agent, streams.clone(), shutdown.clone())
        .await
        .unwrap()
        .total();
    let mut sent = by_gateway.clone();
    sent.extend(by_agent.iter().cloned());
    let expected = distinct_hashes(&streams, &sent).unwrap();
    assert_eq!(
        agent_stats.delivery.accepted as usize,
        distinct_hashes(&streams, &by_agent).unwrap().len()
    );

    // The sink consumes over the same TLS and logins.
    let landing = dir.path().join("landing");
    let mut config = SinkConfig {
        store: StoreConfig::Local {
            path: landing.clone(),
        },
        rotation: RotationConfig {
            idle_ms: 1_000,
            ..RotationConfig::default()
        },
        ..SinkConfig::default()
    };
    config.kafka.brokers = kafka.bootstrap.clone();
    config.kafka.topic_prefix = prefix.clone();
    config.kafka.group_id = format!("{prefix}sink");
    config.kafka.tls = Some(kafka.tls());
    config.kafka.sasl = Some(kafka.sasl());
    let sink = sink::start(config, streams.clone(), shutdown.clone())
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let written = || sink.stats.records_written.load(Ordering::Relaxed);
    while written() < expected.len() as u64 {
        assert!(
            Instant::now() < deadline,
            "{} of {} records landed",
            written(),
            expected.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    shutdown.cancel();
    gateway.task.await.unwrap().unwrap();
    sink.task.await.unwrap().unwrap();
    let landed = common::pyarrow(&["--dir", &landing.to_string_lossy()]);
    common::assert_landed_exactly(&sent, &landed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_or_an_untrusted_certificate_gets_nothing_in() {
    let dir = tempfile::tempdir().unwrap();
    let kafka = SecureKafka::start(dir.path()).await;
    let prefix = format!("sec{}.", common::unique_id());
    let streams = schemas::example_streams();
    let readings = sensor_readings(&FleetSpec {
        records: 20,
        devices: 2,
        duplicate_ratio: 0.0,
        ..FleetSpec::default()
    });
    // The topics exist (created with the right login), so only the login or the handshake can
    // be what fails below.
    let shutdown = CancellationToken::new();
    let mut config = gateway_config(&kafka, &prefix);
    config.kafka.create_topics = true;
    let good = ingest_gateway::start(config, streams.clone(), shutdown.clone())
        .await
        .unwrap();

    let wrong_file = dir.path().join("wrong-password");
    std::fs::write(&wrong_file, "not-the-password").unwrap();
    let mut wrong_password = gateway_config(&kafka, &prefix);
    wrong_password.kafka.sasl = Some(Sasl {
        password_file: Some(wrong_file),
        ..kafka.sasl()
    });
    let mut platform_roots = gateway_config(&kafka, &prefix);
    platform_roots.kafka.tls = Some(TlsFiles::default());
    for (name, mut config) in [
        ("wrong password", wrong_password),
        ("platform roots", platform_roots),
    ] {
        config.kafka.produce_timeout_ms = 3_000;
        let gateway = ingest_gateway::start(config, streams.clone(), shutdown.clone())
            .await
            .unwrap();
        assert_eq!(post(gateway.addr, &readings).await, 503, "{name}");
    }
    // The right login still gets through: the failures were the clients', not the broker's.
    assert_eq!(post(good.addr, &readings).await, 200);
    let offsets = topic_records(&kafka, &format!("{prefix}sensor_readings"));
    assert_eq!(
        offsets,
        readings.len() as i64,
        "only the good gateway's records are in the topic"
    );
    shutdown.cancel();
}

/// How many records the topic holds (the sum of its partitions' high watermarks), read over
/// TLS with the right login.
fn topic_records(kafka: &SecureKafka, topic: &str) -> i64 {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let mut config = rdkafka::ClientConfig::new();
    config
        .set("bootstrap.servers", &kafka.bootstrap)
        .set("group.id", "watermarks");
    service_kit::kafka::security::apply(&mut config, Some(&kafka.tls()), Some(&kafka.sasl()))
        .unwrap();
    let consumer: BaseConsumer = config.create().unwrap();
    let metadata = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .unwrap();
    metadata.topics()[0]
        .partitions()
        .iter()
        .map(|p| {
            consumer
                .fetch_watermarks(topic, p.id(), Duration::from_secs(10))
                .unwrap()
                .1
        })
        .sum()
}
