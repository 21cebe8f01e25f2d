//! Apache Spark with Apache Iceberg's runtime runs Iceberg's maintenance on a table while sinks
//! commit to it under load (`scripts/spark_maintenance.py`): `rewrite_data_files`,
//! `rewrite_manifests`, `expire_snapshots` (retain_last 1), `remove_orphan_files`, another
//! writer's row deleted by a merge-on-read DELETE, a tag and a branch. `loadtest send` drives the
//! gateway on the suite's Apache Kafka the whole time; the sinks of the group are replaced one
//! after another, so partitions move and files are read again after each step. Then `loadtest
//! verify --table` finds every record once in the table's current snapshot, Spark counts the
//! same rows and none twice, and the tag and the branch still hold what they held before the
//! sinks' own expiry passed them. Through the JDBC catalog on SQLite and on PostgreSQL, and
//! through Apache Iceberg's REST catalog server.

use crate::common;
use crate::loadtest;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ingest_gateway::GatewayConfig;
use ingest_gateway::config::AuthConfig;
use serde_json::Value;
use sink::SinkConfig;
use sink::config::{RotationConfig, StoreConfig};
use tokio_util::sync::CancellationToken;

/// One Spark at a time: a JVM with Spark takes what two cores have.
static ONE_SPARK_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct Rig {
    gateway: ingest_gateway::Gateway,
    shutdown: CancellationToken,
    prefix: String,
    catalog: String,
    dir: tempfile::TempDir,
}

impl Rig {
    async fn start(catalog: impl FnOnce(&Path) -> String) -> Rig {
        let dir = tempfile::tempdir().unwrap();
        let prefix = format!("spark{}.", common::unique_id());
        let mut config = GatewayConfig {
            listen: ([127, 0, 0, 1], 0).into(),
            admin_listen: None,
            auth: AuthConfig {
                allow_anonymous: true,
                tokens: Vec::new(),
            },
            ..GatewayConfig::default()
        };
        config.kafka.brokers = common::service_env("EDGE_INGEST_KAFKA");
        config.kafka.topic_prefix = prefix.clone();
        config.kafka.dead_letter_topic = format!("{prefix}dead-letters");
        config.kafka.create_topics = true;
        config.kafka.topic_partitions = 4;
        let shutdown = CancellationToken::new();
        let gateway = ingest_gateway::start(config, schemas::example_streams(), shutdown.clone())
            .await
            .unwrap();
        Rig {
            gateway,
            shutdown,
            catalog: catalog(dir.path()),
            prefix,
            dir,
        }
    }

    fn zone(&self) -> PathBuf {
        self.dir.path().join("zone")
    }

    /// A sink of the group, committing to the table every half second; stopped by `stop`.
    async fn start_sink(&self, name: &str, stop: CancellationToken) -> sink::Sink {
        let mut table = sink::table::TableConfig::new(self.catalog.clone());
        // A namespace of the run's own: runs share the PostgreSQL catalog.
        table.namespace = self.namespace();
        table.commit_interval_ms = 500;
        let mut config = SinkConfig {
            store: StoreConfig::Local { path: self.zone() },
            rotation: RotationConfig {
                max_records: 400,
                idle_ms: 500,
                ..RotationConfig::default()
            },
            table: Some(table),
            ..SinkConfig::default()
        };
        config.kafka.brokers = common::service_env("EDGE_INGEST_KAFKA");
        config.kafka.topic_prefix = self.prefix.clone();
        config.kafka.group_id = format!("{}sinks", self.prefix);
        config.kafka.session_timeout_ms = 6_000;
        config.upload.staging_dir = self.dir.path().join(format!("staging-{name}"));
        sink::start(config, schemas::example_streams(), stop)
            .await
            .unwrap()
    }

    fn namespace(&self) -> String {
        self.prefix.trim_end_matches('.').to_owned()
    }

    /// Spark's run of `steps` against the table (`scripts/spark_maintenance.py`); it creates
    /// `steps_done` when the steps are over and counts once `done` exists.
    fn spark(&self, steps: &str, expiry_commits: u32) -> tokio::process::Child {
        let warehouse = format!("file://{}", self.zone().display());
        tokio::process::Command::new(common::service_env("EDGE_INGEST_PYTHON"))
            .arg(common::repo_root().join("scripts/spark_maintenance.py"))
            .args(["--catalog", &self.catalog, "--namespace", &self.namespace()])
            .args(["--warehouse", &warehouse, "--steps", steps])
            .args(["--expiry-commits", &expiry_commits.to_string()])
            .arg("--jars")
            .arg(common::service_env("EDGE_INGEST_SPARK_JARS"))
            .arg("--steps-done-file")
            .arg(self.dir.path().join("steps-done"))
            .arg("--done-file")
            .arg(self.dir.path().join("done"))
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("cannot run scripts/spark_maintenance.py")
    }

    /// `loadtest send` of `records` readings at `rate` a second, saved to a file of the rig's.
    async fn send(&self, records: u32, rate: u32, seed: u32) -> PathBuf {
        let saved = self.dir.path().join(format!("sent-{seed}.ndjson"));
        let gateway = format!("http://{}", self.gateway.addr);
        let (records, rate, seed) = (records.to_string(), rate.to_string(), seed.to_string());
        let mut args = vec!["send", "--gateway", &gateway, "--records", &records];
        args.extend(["--rate", &rate, "--seed", &seed, "--devices", "40"]);
        args.extend(["--batch-records", "200", "--timeout", "60"]);
        let mut args: Vec<&OsStr> = args.into_iter().map(OsStr::new).collect();
        args.extend([OsStr::new("--save"), saved.as_os_str()]);
        let (ok, summary) = loadtest(&args).await;
        assert!(ok, "send failed: {summary}");
        assert_eq!(summary["refused_batches"], 0, "{summary}");
        saved
    }

    /// `loadtest verify --table`: every record sent, once, in the table's current snapshot.
    async fn verify(&self, sent: &[PathBuf]) -> Value {
        let zone = self.zone();
        let mut args = vec![OsStr::new("verify"), OsStr::new("--sent")];
        args.extend(sent.iter().map(|p| p.as_os_str()));
        args.extend([OsStr::new("--landing"), zone.as_os_str()]);
        args.extend([OsStr::new("--table"), OsStr::new(&self.catalog)]);
        let namespace = self.namespace();
        args.extend([OsStr::new("--namespace"), OsStr::new(&namespace)]);
        args.extend([OsStr::new("--wait"), OsStr::new("120")]);
        let (ok, report) = loadtest(&args).await;
        assert!(ok, "verify failed: {report}");
        assert_eq!(report["missing"], 0, "{report}");
        assert_eq!(report["duplicated"], 0, "{report}");
        assert_eq!(report["unexpected"], 0, "{report}");
        report
    }
}

/// Spark runs `steps` while two sinks commit under load (one of them replaced every 20 s);
/// then the table holds every record once, by `loadtest verify` and by Spark.
async fn maintenance_beside_live_sinks(catalog: impl FnOnce(&Path) -> String, steps: &str) {
    let _turn = ONE_SPARK_AT_A_TIME.lock().await;
    let rig = Rig::start(catalog).await;
    let expiry_commits = 70;
    let mut spark = rig.spark(steps, expiry_commits);
    let mut sinks = Vec::new();
    for name in ["a", "b"] {
        let stop = rig.shutdown.child_token();
        sinks.push((rig.start_sink(name, stop.clone()).await, stop));
    }
    let mut sent = Vec::new();
    let mut replaced = tokio::time::Instant::now();
    for seed in 1.. {
        assert!(seed < 400, "Spark's steps did not finish");
        sent.push(rig.send(1_000, 500, seed).await);
        if rig.dir.path().join("steps-done").exists() {
            break;
        }
        if let Ok(Some(status)) = spark.try_wait() {
            panic!("Spark exited early: {status}");
        }
        if replaced.elapsed() > Duration::from_secs(20) {
            // The older sink leaves the group and a new one joins: partitions move.
            let (old, stop) = sinks.remove(0);
            stop.cancel();
            old.task.await.unwrap().unwrap();
            let stop = rig.shutdown.child_token();
            let name = format!("s{seed}");
            sinks.push((rig.start_sink(&name, stop.clone()).await, stop));
            replaced = tokio::time::Instant::now();
        }
    }
    let report = rig.verify(&sent).await;
    std::fs::write(rig.dir.path().join("done"), "").unwrap();
    let out = tokio::time::timeout(Duration::from_secs(300), async {
        let mut stdout = String::new();
        use tokio::io::AsyncReadExt;
        spark
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut stdout)
            .await
            .unwrap();
        (spark.wait().await.unwrap(), stdout)
    })
    .await
    .expect("Spark did not finish");
    assert!(out.0.success(), "Spark failed: {}", out.1);
    let spark: Value = serde_json::from_str(&out.1).expect("Spark printed no JSON");
    eprintln!("spark: {spark}");
    let expected = report["expected"].as_u64().unwrap();
    assert_eq!(spark["final"]["rows"], expected, "{spark}");
    assert_eq!(spark["final"]["distinct_offsets"], expected, "{spark}");
    assert_eq!(spark["foreign_rows"], 0, "{spark}");
    for step in spark["steps"].as_array().unwrap() {
        match step["step"].as_str().unwrap() {
            "rewrite_data_files" => {
                assert!(step["rewritten_files"].as_u64().unwrap() > 1, "{step}")
            }
            "expire_snapshots" => {
                assert!(
                    step["deleted_manifest_lists"].as_u64().unwrap() > 0,
                    "{step}"
                )
            }
            "delete" => {
                assert_eq!(step["foreign_rows_left"], 0, "{step}");
                assert!(step["delete_files"].as_u64().unwrap() > 0, "{step}");
            }
            "tag_and_branch" => {
                // Past the sinks' expiry of 64 snapshots, the tag and the branch hold what they
                // held: the branch one row more, the row written to it.
                assert_eq!(spark["refs"]["audit"], "TAG", "{spark}");
                assert_eq!(spark["refs"]["wap"], "BRANCH", "{spark}");
                assert_eq!(spark["tag"], step["tag"], "{spark}");
                assert_eq!(spark["branch"], step["branch"], "{spark}");
                let tagged = step["tag"]["rows"].as_u64().unwrap();
                assert_eq!(step["branch"]["rows"], tagged + 1, "{step}");
                assert!(tagged < expected, "{step}");
            }
            _ => {}
        }
    }
    if steps.contains("delete") {
        assert!(spark["delete_files"].as_u64().unwrap() > 0, "{spark}");
    }
    rig.shutdown.cancel();
    rig.gateway.task.await.unwrap().unwrap();
    for (sink, _) in sinks {
        sink.task.await.unwrap().unwrap();
    }
}

const ALL_STEPS: &str = "rewrite_data_files,rewrite_manifests,expire_snapshots,remove_orphan_files,delete,tag_and_branch";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spark_maintenance_beside_live_sinks_sqlite_catalog() {
    maintenance_beside_live_sinks(
        |dir| dir.join("catalog.db").display().to_string(),
        ALL_STEPS,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spark_maintenance_beside_live_sinks_postgres_catalog() {
    maintenance_beside_live_sinks(
        |_| common::service_env("EDGE_INGEST_POSTGRES"),
        "rewrite_data_files,expire_snapshots,delete",
    )
    .await;
}

/// Through Apache Iceberg's REST catalog server (the suite's): Spark's commits and the sinks'
/// meet in Iceberg's own REST code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spark_maintenance_beside_live_sinks_rest_catalog() {
    maintenance_beside_live_sinks(
        |_| common::service_env("EDGE_INGEST_ICEBERG_REST"),
        "rewrite_data_files,rewrite_manifests,expire_snapshots,delete",
    )
    .await;
}
