//! Kafka as managed clusters run it, on an Apache Kafka node of this test's own: TLS with
//! certificates from a CA of the site's own, SASL logins (SCRAM-SHA-512 and PLAIN) on a
//! `SASL_SSL` listener, client certificates on an `SSL` listener that requires them (mTLS), and
//! ACLs (`StandardAuthorizer`, nothing allowed that no ACL allows). The gateway logs in with
//! SCRAM, creates the topics and produces; the agent's Kafka output logs in with PLAIN; the sink
//! consumes with its client certificate; pyarrow reads what landed. A wrong password, an
//! untrusted certificate or a missing client certificate gets nothing in, and a topic no ACL
//! grants is refused with a clear answer, nothing else lost.

use crate::common;

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::kafka::{KafkaCluster, KafkaOptions, kafka_tool};
use common::pki::{Pki, pki};
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
/// The principal of the client certificate (`common::pki`'s), as Kafka names it.
const CERT_PRINCIPAL: &str = "User:CN=edge-box-7";
/// The prefix of the topics and groups the ACLs grant.
const GRANTED: &str = "sec";

/// An Apache Kafka node with a `SASL_SSL` listener (SCRAM-SHA-512 user `ingest`, PLAIN user
/// `ingest`, the same password) and an `SSL` listener that requires a client certificate, both
/// with a certificate of the test's CA; ACLs grant `ingest` and the client certificate's
/// principal everything on topics and groups named `sec…`, and nothing else. Its `PLAINTEXT`
/// listener (the brokers' own, whose clients are super users) is for the test's checks.
struct SecureKafka {
    cluster: KafkaCluster,
    pki: Pki,
    /// The `SASL_SSL` listener.
    bootstrap: String,
    /// The `SSL` listener that requires a client certificate.
    mtls: String,
    password: String,
    password_file: PathBuf,
}

impl SecureKafka {
    fn start(dir: &Path) -> SecureKafka {
        let pki = pki(dir);
        let password = format!("pw-{}", common::unique_id());
        // Kafka's PEM key store: the private key and the certificate chain in one file.
        let keystore = dir.join("kafka-keystore.pem");
        std::fs::write(
            &keystore,
            std::fs::read_to_string(&pki.server_key).unwrap()
                + &std::fs::read_to_string(&pki.server_cert).unwrap(),
        )
        .unwrap();
        let props = [
            ("ssl.keystore.type", "PEM".to_owned()),
            ("ssl.keystore.location", keystore.display().to_string()),
            ("ssl.truststore.type", "PEM".to_owned()),
            ("ssl.truststore.location", pki.ca.display().to_string()),
            ("listener.name.mtls.ssl.client.auth", "required".to_owned()),
            ("sasl.enabled.mechanisms", "SCRAM-SHA-512,PLAIN".to_owned()),
            (
                "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config",
                "org.apache.kafka.common.security.scram.ScramLoginModule required;".to_owned(),
            ),
            (
                "listener.name.sasl_ssl.plain.sasl.jaas.config",
                format!(
                    "org.apache.kafka.common.security.plain.PlainLoginModule required user_{USER}=\"{password}\";"
                ),
            ),
            (
                "authorizer.class.name",
                "org.apache.kafka.metadata.authorizer.StandardAuthorizer".to_owned(),
            ),
            // The brokers' own listeners (PLAINTEXT, CONTROLLER) have no login.
            ("super.users", "User:ANONYMOUS".to_owned()),
            // Topics exist when someone made them, as on most managed clusters.
            ("auto.create.topics.enable", "false".to_owned()),
        ];
        let cluster = KafkaCluster::start(KafkaOptions {
            nodes: 1,
            props: props.map(|(k, v)| (k.to_owned(), v)).to_vec(),
            listeners: vec![
                ("SASL_SSL".to_owned(), "SASL_SSL".to_owned()),
                ("MTLS".to_owned(), "SSL".to_owned()),
            ],
            format_args: vec![
                "--add-scram".to_owned(),
                format!("SCRAM-SHA-512=[name={USER},password={password}]"),
            ],
            ..KafkaOptions::default()
        });
        grant(&cluster, &["--topic", GRANTED, "--group", GRANTED]);
        let node = &cluster.nodes[0];
        let password_file = dir.join("kafka-password");
        // As a mounted secret often is: with a trailing newline, which is not the password's.
        std::fs::write(&password_file, format!("{password}\n")).unwrap();
        SecureKafka {
            bootstrap: format!("127.0.0.1:{}", node.listener_ports[0]),
            mtls: format!("127.0.0.1:{}", node.listener_ports[1]),
            cluster,
            pki,
            password,
            password_file,
        }
    }

    /// TLS that trusts the test's CA.
    fn tls(&self) -> TlsFiles {
        TlsFiles {
            ca_file: Some(self.pki.ca.clone()),
            ..TlsFiles::default()
        }
    }

    /// TLS with the client certificate, for the mTLS listener.
    fn client_tls(&self) -> TlsFiles {
        TlsFiles {
            ca_file: Some(self.pki.ca.clone()),
            client_cert: Some(self.pki.client_cert.clone()),
            client_key: Some(self.pki.client_key.clone()),
        }
    }

    /// A sink of group `group` on the topics of `prefix`, logging in with the client
    /// certificate on the listener that requires one, landing in `landing`.
    fn sink_config(&self, prefix: &str, group: &str, landing: &Path) -> SinkConfig {
        let mut config = SinkConfig {
            store: StoreConfig::Local {
                path: landing.to_path_buf(),
            },
            rotation: RotationConfig {
                idle_ms: 1_000,
                ..RotationConfig::default()
            },
            ..SinkConfig::default()
        };
        config.kafka.brokers = self.mtls.clone();
        config.kafka.topic_prefix = prefix.to_owned();
        config.kafka.group_id = group.to_owned();
        config.kafka.tls = Some(self.client_tls());
        config
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

/// Grants `ingest` and the client certificate's principal every operation on the resources
/// (`--topic` and `--group` names) named by the prefixes in `resources`, with `kafka-acls` over
/// the brokers' own listener.
fn grant(cluster: &KafkaCluster, resources: &[&str]) {
    let (bootstrap, user) = (cluster.bootstrap(), format!("User:{USER}"));
    let mut args = vec!["--bootstrap-server", &bootstrap, "--add"];
    args.extend([
        "--allow-principal",
        &user,
        "--allow-principal",
        CERT_PRINCIPAL,
    ]);
    args.extend(["--operation", "All", "--resource-pattern-type", "prefixed"]);
    args.extend(resources);
    let (ok, out) = kafka_tool("acls", &args);
    assert!(ok, "kafka-acls failed: {out}");
}

fn gateway_config(kafka: &SecureKafka, prefix: &str) -> GatewayConfig {
    let mut config = GatewayConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        admin_listen: None,
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
async fn gateway_agent_and_sink_reach_kafka_over_tls_with_logins_and_client_certificates() {
    let dir = tempfile::tempdir().unwrap();
    let kafka = SecureKafka::start(dir.path());
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

    // The agent's Kafka output, configured as a file would configure it, logs in with PLAIN;
    // the password comes from the environment-style `password` key this time.
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
        sasl = {{ mechanism = "PLAIN", username = "{USER}", password = "{password}" }}
        [[sources]]
        type = "file"
        path = {file:?}
        stream = "sensor_readings"
        "#,
        state = dir.path().join("agent"),
        brokers = kafka.bootstrap,
        ca = kafka.pki.ca,
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

    // The sink consumes with its client certificate, on the listener that requires one.
    let landing = dir.path().join("landing");
    let config = kafka.sink_config(&prefix, &format!("{prefix}sink"), &landing);
    let sink = sink::start(config, streams.clone(), shutdown.clone())
        .await
        .unwrap();
    land(sink, expected.len(), (gateway, shutdown), &landing, &sent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_an_untrusted_certificate_or_no_client_certificate_gets_nothing_in() {
    let dir = tempfile::tempdir().unwrap();
    let kafka = SecureKafka::start(dir.path());
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
    let mut wrong_plain = gateway_config(&kafka, &prefix);
    wrong_plain.kafka.sasl = Some(Sasl {
        mechanism: SaslMechanism::Plain,
        password: Some("not-the-password".into()),
        password_file: None,
        ..kafka.sasl()
    });
    let mut platform_roots = gateway_config(&kafka, &prefix);
    platform_roots.kafka.tls = Some(TlsFiles::default());
    let mut no_client_cert = gateway_config(&kafka, &prefix);
    no_client_cert.kafka.brokers = kafka.mtls.clone();
    no_client_cert.kafka.sasl = None;
    for (name, mut config) in [
        ("wrong SCRAM password", wrong_password),
        ("wrong PLAIN password", wrong_plain),
        ("platform roots", platform_roots),
        ("no client certificate", no_client_cert),
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

/// A topic that no ACL grants: the gateway answers 503 saying which permission is missing and
/// takes nothing, as it does for a topic that does not exist; the sink counts the consumer's authorization errors and lands nothing. Once
/// an operator grants the topic (`kafka-acls`), the client's retry is taken and the sink lands
/// every record once: nothing was lost meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_no_acl_grants_is_refused_clearly_until_granted_and_nothing_is_lost() {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    let dir = tempfile::tempdir().unwrap();
    let kafka = SecureKafka::start(dir.path());
    let prefix = format!("denied{}.", common::unique_id());
    let streams = schemas::example_streams();
    let topic = format!("{prefix}sensor_readings");
    // A super user (the brokers' PLAINTEXT listener) makes the topics; no ACL grants them.
    let admin: AdminClient<_> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", kafka.cluster.bootstrap())
        .create()
        .unwrap();
    let dead = format!("{prefix}dead-letters");
    for made in admin
        .create_topics(
            &[
                NewTopic::new(&topic, 2, TopicReplication::Fixed(1)),
                NewTopic::new(&dead, 1, TopicReplication::Fixed(1)),
            ],
            &AdminOptions::new(),
        )
        .await
        .unwrap()
    {
        made.unwrap();
    }
    let readings = sensor_readings(&FleetSpec {
        records: 50,
        devices: 5,
        duplicate_ratio: 0.0,
        ..FleetSpec::default()
    });
    let shutdown = CancellationToken::new();
    let mut config = gateway_config(&kafka, &prefix);
    config.kafka.produce_timeout_ms = 5_000;
    let gateway = ingest_gateway::start(config, streams.clone(), shutdown.clone())
        .await
        .unwrap();
    let client = reqwest::Client::new();
    let url = format!("http://{}/v1/streams/sensor_readings/records", gateway.addr);
    let posted = || {
        client
            .post(&url)
            .header("content-type", "application/x-ndjson")
            .body(to_ndjson(&readings))
            .timeout(Duration::from_secs(60))
            .send()
    };
    let refused = posted().await.unwrap();
    assert_eq!(refused.status(), 503);
    assert!(refused.headers().contains_key("retry-after"));
    let body: serde_json::Value = refused.json().await.unwrap();
    let message = body["message"].as_str().unwrap();
    assert!(message.contains("Write on the topic"), "{message}");
    // A granted prefix whose topics nobody made (and the cluster does not create them).
    let mut config = gateway_config(&kafka, &format!("{GRANTED}gone{}.", common::unique_id()));
    config.kafka.produce_timeout_ms = 3_000;
    let missing = ingest_gateway::start(config, streams.clone(), shutdown.clone())
        .await
        .unwrap();
    let answer = client
        .post(format!(
            "http://{}/v1/streams/sensor_readings/records",
            missing.addr
        ))
        .header("content-type", "application/x-ndjson")
        .body(to_ndjson(&readings))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 503);
    let body: serde_json::Value = answer.json().await.unwrap();
    let message = body["message"].as_str().unwrap();
    assert!(message.contains("does not exist"), "{message}");

    let landing = dir.path().join("landing");
    // The group is granted; the topic is not (the only one it reads: the other stream's topic
    // does not exist).
    let group = format!("{GRANTED}{}sink", common::unique_id());
    let mut config = kafka.sink_config(&prefix, &group, &landing);
    config.streams = vec!["sensor_readings".into()];
    // The consumer looks at a topic it was refused again at the next metadata refresh.
    config
        .kafka
        .consumer
        .insert("topic.metadata.refresh.interval.ms".into(), "2000".into());
    let sink = sink::start(config, streams.clone(), shutdown.clone())
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while sink.stats.consumer_errors.load(Ordering::Relaxed) == 0 {
        assert!(Instant::now() < deadline, "no consumer error was counted");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(sink.stats.records_written.load(Ordering::Relaxed), 0);

    grant(&kafka.cluster, &["--topic", &prefix]);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let status = posted().await.unwrap().status();
        if status == 200 {
            break;
        }
        assert_eq!(status, 503);
        assert!(Instant::now() < deadline, "the granted topic still refuses");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    land(
        sink,
        readings.len(),
        (gateway, shutdown),
        &landing,
        &readings,
    )
    .await;
}

/// Waits until `sink` wrote `records` records (two minutes at most), stops it and the gateway,
/// and checks with pyarrow that every distinct record of `sent` landed once in `landing`.
async fn land(
    sink: sink::Sink,
    records: usize,
    (gateway, shutdown): (ingest_gateway::Gateway, CancellationToken),
    landing: &Path,
    sent: &[serde_json::Value],
) {
    let deadline = Instant::now() + Duration::from_secs(120);
    let written = || sink.stats.records_written.load(Ordering::Relaxed);
    while written() < records as u64 {
        assert!(
            Instant::now() < deadline,
            "{} of {records} records landed",
            written()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    shutdown.cancel();
    gateway.task.await.unwrap().unwrap();
    sink.task.await.unwrap().unwrap();
    let landed = common::pyarrow(&["--dir", &landing.to_string_lossy()]);
    common::assert_landed_exactly(sent, &landed);
}
