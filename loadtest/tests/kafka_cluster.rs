//! The whole path on a three-broker Apache Kafka cluster (KRaft nodes on loopback, each a broker
//! and a controller; the topics have 3 replicas and `min.insync.replicas = 2`) while brokers
//! fail: `loadtest send` drives the gateway, two sinks consume as a group into a landing
//! directory, and `loadtest verify` finds every distinct record sent there once (0 missing, 0
//! duplicated) after
//! - the leader of the stream's partitions is killed (SIGKILL) mid-stream;
//! - two of the three brokers stop: the gateway acknowledges nothing Kafka did not take (503
//!   with Retry-After) and an agent keeps its batches in its spool until they return;
//! - all three brokers restart one after another under load;
//! - the broker of the group's coordinator is killed while the sinks rebalance, with the classic
//!   consumer group protocol and with KIP-848's.
//!
//! One cluster runs at a time (three JVMs take what two cores have).

use crate::common;
use crate::loadtest;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::kafka::{KafkaCluster, KafkaOptions, kafka_tool};
use ingest_gateway::GatewayConfig;
use ingest_gateway::config::AuthConfig;
use loadtest::fleet::{FleetSpec, sensor_readings, to_ndjson};
use serde_json::Value;
use sink::SinkConfig;
use sink::config::{GroupProtocol, RotationConfig, StoreConfig};
use tokio::sync::{Mutex, MutexGuard};
use tokio_util::sync::CancellationToken;

static ONE_CLUSTER_AT_A_TIME: Mutex<()> = Mutex::const_new(());

const STREAM: &str = "sensor_readings";

/// A cluster, a gateway producing to it (topics of 3 partitions and 3 replicas), and what the
/// sinks of the test share: their group, protocol and landing directory.
struct Rig {
    cluster: KafkaCluster,
    gateway: ingest_gateway::Gateway,
    shutdown: CancellationToken,
    prefix: String,
    protocol: GroupProtocol,
    dir: tempfile::TempDir,
    _turn: MutexGuard<'static, ()>,
}

impl Rig {
    async fn start(protocol: GroupProtocol) -> Rig {
        let turn = ONE_CLUSTER_AT_A_TIME.lock().await;
        // The test's own thread waits for the JVMs; the gateway's and the sinks' tasks run on the
        // runtime's workers meanwhile.
        let cluster = KafkaCluster::start(KafkaOptions {
            nodes: 3,
            ..KafkaOptions::default()
        });
        let prefix = format!("cluster{}.", common::unique_id());
        let mut config = GatewayConfig {
            listen: ([127, 0, 0, 1], 0).into(),
            admin_listen: None,
            auth: AuthConfig {
                allow_anonymous: true,
                tokens: Vec::new(),
            },
            ..GatewayConfig::default()
        };
        config.kafka.brokers = cluster.bootstrap();
        config.kafka.topic_prefix = prefix.clone();
        config.kafka.dead_letter_topic = format!("{prefix}dead-letters");
        config.kafka.create_topics = true;
        config.kafka.topic_partitions = 3;
        config.kafka.topic_replication = 3;
        // A request that Kafka cannot take is answered 503 after this long: longer than a
        // leader election after a SIGKILL (the broker's 9 s session timeout, then the
        // election) takes on a busy machine, so that the failover tests see no 503.
        config.kafka.produce_timeout_ms = 20_000;
        let shutdown = CancellationToken::new();
        let gateway = ingest_gateway::start(config, schemas::example_streams(), shutdown.clone())
            .await
            .unwrap();
        let rig = Rig {
            cluster,
            gateway,
            shutdown,
            prefix,
            protocol,
            dir: tempfile::tempdir().unwrap(),
            _turn: turn,
        };
        rig.cluster.wait_in_sync(&rig.topic(), 3);
        rig
    }

    fn topic(&self) -> String {
        format!("{}{STREAM}", self.prefix)
    }

    fn group(&self) -> String {
        format!("{}sinks", self.prefix)
    }

    fn landing(&self) -> PathBuf {
        self.dir.path().join("landing")
    }

    /// A sink of the group, landing in the rig's directory, staging in a folder of its own.
    async fn start_sink(&self, name: &str) -> sink::Sink {
        let mut config = SinkConfig {
            store: StoreConfig::Local {
                path: self.landing(),
            },
            rotation: RotationConfig {
                idle_ms: 1_000,
                ..RotationConfig::default()
            },
            ..SinkConfig::default()
        };
        config.kafka.brokers = self.cluster.bootstrap();
        config.kafka.topic_prefix = self.prefix.clone();
        config.kafka.group_id = self.group();
        config.kafka.group_protocol = self.protocol;
        config.kafka.session_timeout_ms = 6_000;
        config.upload.staging_dir = self.dir.path().join(format!("staging-{name}"));
        sink::start(
            config,
            schemas::example_streams(),
            self.shutdown.child_token(),
        )
        .await
        .unwrap()
    }

    /// `loadtest send` of `records` readings at `rate` a second (seed `seed`), saved to a file
    /// of the rig's; runs until the gateway acknowledged every batch.
    fn send(&self, records: u32, rate: u32, seed: u32) -> tokio::task::JoinHandle<PathBuf> {
        let saved = self.dir.path().join(format!("sent-{seed}.ndjson"));
        let gateway = format!("http://{}", self.gateway.addr);
        tokio::spawn(async move {
            let (records, rate, seed) = (records.to_string(), rate.to_string(), seed.to_string());
            let mut args = vec!["send", "--gateway", &gateway, "--records", &records];
            args.extend(["--rate", &rate, "--seed", &seed, "--devices", "40"]);
            args.extend([
                "--batch-records",
                "250",
                "--concurrency",
                "3",
                "--timeout",
                "60",
            ]);
            let mut args: Vec<&OsStr> = args.into_iter().map(OsStr::new).collect();
            args.extend([OsStr::new("--save"), saved.as_os_str()]);
            let (ok, summary) = loadtest(&args).await;
            assert!(ok, "send failed: {summary}");
            assert_eq!(summary["refused_batches"], 0, "{summary}");
            saved
        })
    }

    /// `loadtest verify` of the saved files against the landing directory: every distinct
    /// record once.
    async fn verify(&self, sent: &[&Path]) -> Value {
        let landing = self.landing();
        let mut args = vec![OsStr::new("verify"), OsStr::new("--sent")];
        args.extend(sent.iter().map(|p| p.as_os_str()));
        args.extend([OsStr::new("--landing"), landing.as_os_str()]);
        args.extend([OsStr::new("--wait"), OsStr::new("300")]);
        let (ok, report) = loadtest(&args).await;
        assert!(ok, "verify failed: {report}");
        assert_eq!(report["missing"], 0, "{report}");
        assert_eq!(report["duplicated"], 0, "{report}");
        assert!(report["expected"].as_u64().unwrap() > 0, "{report}");
        report
    }

    /// The node id of the group's coordinator, from Kafka's own `kafka-consumer-groups`.
    fn coordinator(&self) -> i32 {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let (ok, out) = kafka_tool(
                "consumer-groups",
                &[
                    "--bootstrap-server",
                    &self.cluster.bootstrap(),
                    "--describe",
                    "--group",
                    &self.group(),
                    "--state",
                ],
            );
            // GROUP  COORDINATOR (ID)  ASSIGNMENT-STRATEGY  STATE  #MEMBERS
            let id = out
                .lines()
                .find(|l| l.starts_with(&self.group()))
                .and_then(|l| l.split_once('(')?.1.split_once(')')?.0.parse().ok());
            if let (true, Some(id)) = (ok, id) {
                return id;
            }
            assert!(Instant::now() < deadline, "no coordinator found: {out}");
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    async fn stop(self, sinks: Vec<sink::Sink>) {
        self.shutdown.cancel();
        self.gateway.task.await.unwrap().unwrap();
        for sink in sinks {
            sink.task.await.unwrap().unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_killed_mid_stream_loses_and_duplicates_nothing() {
    let mut rig = Rig::start(GroupProtocol::Classic).await;
    let sinks = vec![rig.start_sink("a").await, rig.start_sink("b").await];
    let sending = rig.send(12_000, 1_500, 1);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let leader = rig.cluster.leader(&rig.topic(), 0).expect("a leader");
    rig.cluster.node(leader).kill();
    let sent = sending.await.unwrap();
    // The controller fences the killed broker after its session timeout and elects another
    // replica; on a busy machine that can come after the last batch was taken.
    let deadline = Instant::now() + Duration::from_secs(120);
    while rig
        .cluster
        .leader(&rig.topic(), 0)
        .is_none_or(|l| l == leader)
    {
        assert!(
            Instant::now() < deadline,
            "no new leader after node {leader} was killed"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    rig.cluster.node(leader).restart();
    rig.verify(&[&sent]).await;
    rig.stop(sinks).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_brokers_down_take_nothing_and_lose_nothing_once_back() {
    let mut rig = Rig::start(GroupProtocol::Classic).await;
    let sinks = vec![rig.start_sink("a").await, rig.start_sink("b").await];
    let before = rig.send(2_000, 0, 2).await.unwrap();
    rig.cluster.node(2).stop();
    rig.cluster.node(3).stop();
    // What comes now is refused: 503 with Retry-After, never 200.
    let readings = sensor_readings(&FleetSpec {
        records: 20,
        devices: 2,
        seed: 3,
        ..FleetSpec::default()
    });
    let answer = reqwest::Client::new()
        .post(format!(
            "http://{}/v1/streams/{STREAM}/records",
            rig.gateway.addr
        ))
        .header("content-type", "application/x-ndjson")
        .body(to_ndjson(&readings))
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 503);
    assert!(answer.headers().contains_key("retry-after"));
    // An agent reads a file meanwhile: its batches wait in its spool.
    let file = rig.dir.path().join("agent.ndjson");
    let by_agent = sensor_readings(&FleetSpec {
        records: 3_000,
        devices: 12,
        seed: 4,
        ..FleetSpec::default()
    });
    std::fs::write(&file, to_ndjson(&by_agent)).unwrap();
    let state = rig.dir.path().join("agent");
    let agent = edge_agent::AgentConfig::parse(&format!(
        r#"
        state_dir = {state:?}
        [gateway]
        url = "http://{addr}"
        [batch]
        max_records = 500
        [[sources]]
        type = "file"
        path = {file:?}
        stream = "{STREAM}"
        "#,
        addr = rig.gateway.addr,
    ))
    .unwrap();
    let agent = tokio::spawn(edge_agent::run(
        agent,
        schemas::example_streams(),
        CancellationToken::new(),
    ));
    let sending = rig.send(2_000, 0, 5);
    let spool = state.join("spool");
    let deadline = Instant::now() + Duration::from_secs(60);
    while spooled(&spool) == 0 {
        assert!(Instant::now() < deadline, "the agent spooled nothing");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(!agent.is_finished() && !sending.is_finished());
    rig.cluster.node(2).restart();
    rig.cluster.node(3).restart();
    let during = sending.await.unwrap();
    let stats = agent.await.unwrap().unwrap().total();
    assert!(stats.delivery.accepted > 0, "{stats:?}");
    assert_eq!(spooled(&spool), 0, "the spool is delivered");
    rig.verify(&[&before, &during, &file]).await;
    rig.stop(sinks).await;
}

/// Batches an agent's spool holds (its files under `spool`).
fn spooled(spool: &Path) -> usize {
    let mut n = 0;
    let mut dirs = vec![spool.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "spool") {
                n += 1;
            }
        }
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_under_load_loses_and_duplicates_nothing() {
    let mut rig = Rig::start(GroupProtocol::Classic).await;
    let sinks = vec![rig.start_sink("a").await, rig.start_sink("b").await];
    let sending = rig.send(20_000, 1_000, 6);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let topic = rig.topic();
    for id in 1..=3 {
        rig.cluster.node(id).stop();
        rig.cluster.node(id).restart();
        rig.cluster.wait_in_sync(&topic, 3);
    }
    let sent = sending.await.unwrap();
    rig.verify(&[&sent]).await;
    rig.stop(sinks).await;
}

async fn coordinator_killed_during_a_rebalance(protocol: GroupProtocol) {
    let mut rig = Rig::start(protocol).await;
    let mut sinks = vec![rig.start_sink("a").await];
    let sending = rig.send(12_000, 1_500, 7);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let coordinator = rig.coordinator();
    // A second sink joins, and the coordinator goes while the group hands partitions over.
    sinks.push(rig.start_sink("b").await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    rig.cluster.node(coordinator).kill();
    let sent = sending.await.unwrap();
    assert_ne!(rig.coordinator(), coordinator);
    rig.cluster.node(coordinator).restart();
    rig.verify(&[&sent]).await;
    rig.stop(sinks).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinator_killed_during_a_rebalance_loses_nothing_classic_protocol() {
    coordinator_killed_during_a_rebalance(GroupProtocol::Classic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinator_killed_during_a_rebalance_loses_nothing_consumer_protocol() {
    coordinator_killed_during_a_rebalance(GroupProtocol::Consumer).await;
}
