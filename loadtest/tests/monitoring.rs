//! The monitoring that ships in `deploy/` and `docker-compose.yml`, checked against the real
//! components: a real Prometheus, configured from `deploy/prometheus/prometheus.yml`, scrapes a
//! gateway, a sink and an agent that move records end to end (a duplicate, a rejected record and
//! a dead letter among them). Every query of the Grafana dashboards must parse and return series;
//! every alert rule must load and evaluate; every metric the dashboards and alerts name must be
//! one the components declare. The alert rules have their own unit tests (promtool).

use crate::common;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use edge_agent::AgentConfig;
use ingest_gateway::GatewayConfig;
use loadtest::demo::{FileAgent, distinct_hashes, file_agent};
use loadtest::fleet::{FleetSpec, sensor_readings, to_ndjson};
use rdkafka::ClientConfig;
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::Value;
use sink::SinkConfig;
use sink::config::{RotationConfig, StoreConfig};
use tokio_util::sync::CancellationToken;

/// Metrics that only appear after a fault this test does not cause (a failed delivery attempt,
/// a file another sink wrote): their queries may return nothing, but they must still parse and
/// name declared metrics.
const FAULT_ONLY: &[&str] = &["edge_agent_send_errors_total", "sink_adopted_files_total"];

fn deploy() -> PathBuf {
    common::repo_root().join("deploy")
}

fn dashboards() -> Vec<(String, Value)> {
    let dir = deploy().join("grafana/dashboards");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let json: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()));
        out.push((
            path.file_name().unwrap().to_string_lossy().into_owned(),
            json,
        ));
    }
    assert_eq!(out.len(), 3, "one dashboard per component");
    out
}

/// `(dashboard, panel title, expr)` of every query of every dashboard.
fn dashboard_queries() -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for (file, dashboard) in dashboards() {
        for panel in dashboard["panels"].as_array().unwrap() {
            let title = panel["title"].as_str().unwrap_or_default();
            for target in panel["targets"].as_array().into_iter().flatten() {
                let expr = target["expr"].as_str().unwrap();
                out.push((file.clone(), title.to_owned(), expr.to_owned()));
            }
        }
    }
    out
}

/// Names of this project's metrics in a PromQL text (or a rules file), outside quoted strings.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut quoted = false;
    let mut word = String::new();
    for c in text.chars().chain(std::iter::once(' ')) {
        if c == '"' {
            quoted = !quoted;
        }
        if !quoted && (c.is_ascii_alphanumeric() || c == '_') {
            word.push(c);
            continue;
        }
        if ["gateway_", "sink_", "edge_agent_"]
            .iter()
            .any(|p| word.starts_with(p))
        {
            names.insert(std::mem::take(&mut word));
        }
        word.clear();
    }
    names
}

/// The metric names the components declare ([`declared_kinds`]), with the series names a
/// histogram adds.
fn declared_metrics() -> BTreeSet<String> {
    declared_kinds()
        .into_iter()
        .flat_map(|(name, _)| {
            ["", "_bucket", "_sum", "_count"].map(|suffix| format!("{name}{suffix}"))
        })
        .collect()
}

/// The metrics the components declare, with their kinds (`#[counter]` and the like above
/// each name in `metrics.rs`).
fn declared_kinds() -> Vec<(String, String)> {
    let mut declared = Vec::new();
    for krate in ["ingest-gateway", "sink", "edge-agent"] {
        let path = common::repo_root().join(krate).join("src/metrics.rs");
        let mut kind = None;
        for line in std::fs::read_to_string(path).unwrap().lines() {
            let line = line.trim();
            if let Some(k) = line.strip_prefix("#[").and_then(|k| k.strip_suffix(']')) {
                kind = Some(k.to_owned());
            } else if let Some((_, rest)) = line.split_once(": &str = \"") {
                let name = rest.trim_end_matches("\";").to_owned();
                declared.push((name, kind.take().expect("a kind above each metric")));
            }
        }
    }
    declared
}

#[test]
fn dashboards_and_alerts_name_only_declared_metrics() {
    let declared = declared_metrics();
    assert!(declared.contains("gateway_records_total"));
    assert!(declared.contains("sink_consumer_lag_records"));
    assert!(declared.contains("edge_agent_spool_limit_bytes"));
    let mut used = BTreeSet::new();
    for (file, title, expr) in dashboard_queries() {
        let names = metric_names(&expr);
        assert!(!names.is_empty(), "{file} / {title}: no metric in {expr}");
        used.extend(names);
    }
    let alerts = std::fs::read_to_string(deploy().join("prometheus/alerts.yml")).unwrap();
    used.extend(metric_names(&alerts));
    let unknown: Vec<_> = used.difference(&declared).collect();
    assert!(unknown.is_empty(), "undeclared metrics: {unknown:?}");
    // Every component is on the dashboards.
    for prefix in ["gateway_", "sink_", "edge_agent_"] {
        let n = used.iter().filter(|n| n.starts_with(prefix)).count();
        assert!(
            n >= 8,
            "only {n} {prefix} metrics on the dashboards and alerts"
        );
    }
}

#[test]
fn alert_rules_pass_their_unit_tests() {
    let promtool = common::service_env("EDGE_INGEST_PROMTOOL");
    let dir = deploy().join("prometheus");
    for args in [
        vec!["check", "config", "prometheus.yml"],
        vec!["test", "rules", "alerts.test.yml"],
    ] {
        let out = Command::new(&promtool)
            .args(&args)
            .current_dir(&dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "promtool {args:?} failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn the_compose_file_is_valid_and_has_every_component() {
    let compose = common::service_env("EDGE_INGEST_DOCKER_COMPOSE");
    let out = Command::new(compose)
        .args(["config"])
        .current_dir(common::repo_root())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "docker-compose config failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let config = String::from_utf8_lossy(&out.stdout);
    for service in [
        "kafka:",
        "minio:",
        "ingest-gateway:",
        "sink:",
        "edge-agent:",
        "prometheus:",
        "grafana:",
    ] {
        assert!(
            config.contains(&format!("\n  {service}")),
            "no {service} service"
        );
    }
    // The files the services mount exist.
    for path in [
        "deploy/config/ingest-gateway.toml",
        "deploy/config/sink.toml",
        "deploy/config/edge-agent.toml",
        "deploy/grafana/provisioning/datasources/prometheus.yml",
        "deploy/grafana/provisioning/dashboards/edge-ingest.yml",
    ] {
        assert!(common::repo_root().join(path).is_file(), "{path} missing");
    }
}

#[test]
fn the_compose_configs_load() {
    let root = common::repo_root().join("deploy/config");
    let load = |name: &str| root.join(name);
    let gateway: GatewayConfig =
        service_kit::load_config(Some(&load("ingest-gateway.toml")), "NO_SUCH_PREFIX_").unwrap();
    assert!(!gateway.auth.tokens.is_empty());
    let sink: SinkConfig =
        service_kit::load_config(Some(&load("sink.toml")), "NO_SUCH_PREFIX_").unwrap();
    assert!(matches!(sink.store, StoreConfig::S3 { .. }));
    let agent: AgentConfig =
        service_kit::load_config(Some(&load("edge-agent.toml")), "NO_SUCH_PREFIX_").unwrap();
    assert_eq!(agent.sources.len(), 2);
}

/// A Prometheus server, stopped when dropped.
struct Prometheus {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Starts Prometheus with the shipped config and rules, its targets pointed at `targets`
    /// (compose address → address here) and a one-second scrape interval.
    async fn start(targets: &[(&str, String)]) -> Prometheus {
        let dir = tempfile::tempdir().unwrap();
        let shipped = deploy().join("prometheus");
        let mut config = std::fs::read_to_string(shipped.join("prometheus.yml")).unwrap();
        for (compose, here) in targets {
            assert!(config.contains(compose), "{compose} not in prometheus.yml");
            config = config.replace(compose, here);
        }
        config = config.replace("scrape_interval: 15s", "scrape_interval: 1s");
        config = config.replace("evaluation_interval: 15s", "evaluation_interval: 1s");
        std::fs::write(dir.path().join("prometheus.yml"), config).unwrap();
        std::fs::copy(shipped.join("alerts.yml"), dir.path().join("alerts.yml")).unwrap();
        let port = common::free_port();
        let child = Command::new(common::service_env("EDGE_INGEST_PROMETHEUS"))
            .arg(format!(
                "--config.file={}",
                dir.path().join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(std::fs::File::create(dir.path().join("log")).unwrap())
            .stderr(std::fs::File::create(dir.path().join("err")).unwrap())
            .spawn()
            .expect("cannot start prometheus");
        let prometheus = Prometheus {
            child,
            url: format!("http://127.0.0.1:{port}"),
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let ready = reqwest::get(format!("{}/-/ready", prometheus.url)).await;
            if ready.is_ok_and(|r| r.status().is_success()) {
                return prometheus;
            }
            assert!(Instant::now() < deadline, "prometheus did not get ready");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn api(&self, path: &str, params: &[(&str, &str)]) -> Value {
        let url = reqwest::Url::parse_with_params(&format!("{}{path}", self.url), params).unwrap();
        let body = reqwest::get(url).await.unwrap().bytes().await.unwrap();
        serde_json::from_slice(&body).unwrap()
    }

    /// The result of an instant query; panics when Prometheus refuses the query.
    async fn query(&self, expr: &str) -> Vec<Value> {
        let answer = self.api("/api/v1/query", &[("query", expr)]).await;
        assert_eq!(answer["status"], "success", "{expr}: {answer}");
        answer["data"]["result"].as_array().unwrap().clone()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboards_and_alerts_read_the_components_metrics() {
    // The metrics recorder is the process's: counters that other tests of this binary move
    // would show here.
    if !common::in_own_process("monitoring::the_dashboards_and_alerts_read_the_components_metrics")
    {
        return;
    }
    let kafka = common::service_env("EDGE_INGEST_KAFKA");
    let id = common::unique_id();
    let topic_prefix = format!("mon{id}.");
    let streams = schemas::example_streams();
    let shutdown = CancellationToken::new();
    let dir = tempfile::tempdir().unwrap();

    let mut gateway = GatewayConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        admin_listen: None,
        ..GatewayConfig::default()
    };
    gateway.auth.allow_anonymous = true;
    // A token with a rate limit, so that the limit's series exists (at zero) for its panel.
    gateway
        .auth
        .tokens
        .push(ingest_gateway::config::TokenConfig {
            name: "limited".into(),
            blake3: loadtest::demo::blake3_hex("limited-token"),
            streams: vec!["*".into()],
            max_bytes_per_sec: Some(1 << 20),
        });
    gateway.kafka.brokers = kafka.clone();
    gateway.kafka.topic_prefix = topic_prefix.clone();
    gateway.kafka.create_topics = true;
    let gateway = ingest_gateway::start(gateway, streams.clone(), shutdown.clone())
        .await
        .unwrap();

    let sink_admin = format!("127.0.0.1:{}", common::free_port());
    let mut sink = SinkConfig {
        admin_listen: sink_admin.parse().unwrap(),
        store: StoreConfig::Local {
            path: dir.path().join("landing"),
        },
        rotation: RotationConfig {
            idle_ms: 1_000,
            ..RotationConfig::default()
        },
        ..SinkConfig::default()
    };
    sink.kafka.brokers = kafka.clone();
    sink.kafka.topic_prefix = topic_prefix.clone();
    sink.kafka.group_id = format!("mon-sink-{id}");
    let sink_health = service_kit::Health::default();
    service_kit::serve_admin(sink.admin_listen, sink_health.clone(), shutdown.clone())
        .await
        .unwrap();
    let sink = sink::start(sink, streams.clone(), shutdown.clone())
        .await
        .unwrap();
    let readiness = sink.readiness.clone();
    service_kit::spawn_readiness_probe(sink_health, shutdown.clone(), move || {
        let readiness = readiness.clone();
        async move { readiness.check().await }
    });

    // The agent: a file of readings with re-sent duplicates, delivered through the gateway.
    let records = sensor_readings(&FleetSpec {
        records: 2_000,
        devices: 10,
        seed: 11,
        ..FleetSpec::default()
    });
    let expected = distinct_hashes(&streams, &records).unwrap();
    assert!(
        expected.len() < records.len(),
        "the fleet re-sends readings"
    );
    let agent_admin = format!("127.0.0.1:{}", common::free_port());
    let agent = file_agent(&FileAgent {
        dir: dir.path(),
        ndjson: &to_ndjson(&records),
        gateway: gateway.addr,
        token: None,
        max_records: 500,
        admin_listen: Some(&agent_admin),
        follow: false,
        more: "",
    })
    .unwrap();
    let stats = edge_agent::run(agent, streams.clone(), shutdown.child_token())
        .await
        .unwrap()
        .total();
    assert_eq!(stats.delivery.accepted as usize, expected.len());

    // A second agent, with a swinging-door filter, for the filters' panels: a ramp of one
    // device of its own.
    let filtered_dir = dir.path().join("filtered");
    std::fs::create_dir_all(&filtered_dir).unwrap();
    let ramp = loadtest::process::series(loadtest::process::Shape::Ramp, 600, 1_767_225_600_000, 1);
    let filtered = file_agent(&FileAgent {
        dir: &filtered_dir,
        ndjson: &to_ndjson(&loadtest::process::readings("ramp-1", &ramp)),
        gateway: gateway.addr,
        token: None,
        max_records: 500,
        admin_listen: None,
        follow: false,
        more: "[[streams.sensor_readings.filters]]\ntype = \"swinging_door\"\nfield = \"value\"\nabsolute = 0.5\n",
    })
    .unwrap();
    let kept = edge_agent::run(filtered, streams.clone(), shutdown.child_token())
        .await
        .unwrap()
        .total()
        .delivery
        .accepted;
    assert!(kept > 0 && kept < 600, "the filter kept {kept} of 600");

    // A record of the wrong type through the gateway, and an undecodable value produced
    // straight to Kafka for the sink.
    let client = reqwest::Client::new();
    let answer = client
        .post(format!(
            "http://{}/v1/streams/sensor_readings/records",
            gateway.addr
        ))
        .header("content-type", "application/x-ndjson")
        .body(r#"{"device_id": 5, "sensor": "t", "ts": 1, "value": 1.0}"#)
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let answer: Value = serde_json::from_slice(&answer).unwrap();
    assert_eq!(
        answer["rejected"].as_array().map(Vec::len),
        Some(1),
        "{answer}"
    );
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &kafka)
        .create()
        .unwrap();
    producer
        .send(
            FutureRecord::<str, [u8]>::to(&format!("{topic_prefix}sensor_readings"))
                .payload(b"{not json"),
            Duration::from_secs(20),
        )
        .await
        .unwrap();

    let deadline = Instant::now() + Duration::from_secs(120);
    while sink.stats.records_written.load(Ordering::Relaxed) < expected.len() as u64
        || sink.stats.dead_letters.load(Ordering::Relaxed) < 1
    {
        assert!(Instant::now() < deadline, "the sink did not catch up");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let prometheus = Prometheus::start(&[
        ("ingest-gateway:9101", gateway.addr.to_string()),
        ("sink:9102", sink_admin),
        ("edge-agent:9102", agent_admin),
    ])
    .await;

    // Every target is up under the job name the alerts use.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let up = prometheus.query("up == 1").await;
        let jobs: BTreeSet<&str> = up
            .iter()
            .filter_map(|s| s["metric"]["job"].as_str())
            .collect();
        if jobs == BTreeSet::from(["edge-agent", "ingest-gateway", "sink"]) {
            break;
        }
        assert!(Instant::now() < deadline, "targets not up: {up:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // Each query returns series once a few scrapes are in (rates need two samples; the sink
    // reports lag every five seconds).
    let queries = dashboard_queries();
    let mut empty = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        empty.clear();
        for (file, title, expr) in &queries {
            let expr = expr.replace("$__rate_interval", "1m");
            let result = prometheus.query(&expr).await;
            let fault_only = metric_names(&expr)
                .iter()
                .all(|n| FAULT_ONLY.contains(&n.as_str()));
            if result.is_empty() && !fault_only {
                empty.push(format!("{file} / {title}: {expr}"));
            }
        }
        if empty.is_empty() || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    assert!(
        empty.is_empty(),
        "queries without data:\n{}",
        empty.join("\n")
    );

    // The counters alerts watch exist at zero before anything goes wrong.
    for expr in [
        r#"edge_agent_spool_dropped_records_total{stream="sensor_readings", policy="block"}"#,
        r#"sink_store_errors_total{retryable="true"}"#,
        "sink_staging_errors_total",
        r#"gateway_records_total{stream="vehicle_telemetry", outcome="rejected"}"#,
        r#"sink_dead_letter_records_total{stream="vehicle_telemetry"}"#,
        r#"sink_offsets_skipped_total{stream="vehicle_telemetry"}"#,
        r#"sink_partitions_stopped_at_gap{stream="sensor_readings"}"#,
    ] {
        let result = prometheus.query(expr).await;
        assert_eq!(
            result.len(),
            3,
            "{expr}: one series per scraped job: {result:?}"
        );
        assert_eq!(result[0]["value"][1], "0", "{expr}");
    }

    // Every metric scraped has the type it is declared with and a `# HELP` line: its doc comment.
    let metadata = prometheus.api("/api/v1/metadata", &[]).await;
    let metadata = metadata["data"].as_object().unwrap();
    let declared = declared_kinds();
    let mut described = 0;
    for (name, kind) in &declared {
        let Some(entry) = metadata.get(name) else {
            continue;
        };
        let entry = &entry[0];
        assert_eq!(entry["type"], kind.as_str(), "{name}: {entry}");
        let help = entry["help"].as_str().unwrap_or_default();
        assert!(help.len() > 20, "{name} has no help: {entry}");
        described += 1;
    }
    assert!(
        described * 2 >= declared.len(),
        "only {described} of {} declared metrics were scraped",
        declared.len()
    );

    // The alert rules loaded and evaluate without error; none fires on this healthy run
    // except the two that report the rejected record and the dead letter.
    let rules = prometheus.api("/api/v1/rules", &[]).await;
    let groups = rules["data"]["groups"].as_array().unwrap();
    let mut firing = BTreeSet::new();
    let mut count = 0;
    for rule in groups.iter().flat_map(|g| g["rules"].as_array().unwrap()) {
        count += 1;
        let name = rule["name"].as_str().unwrap();
        assert_eq!(rule["health"], "ok", "{name}: {rule}");
        if rule["state"] != "inactive" {
            firing.insert(name.to_owned());
        }
    }
    // Every rule of the shipped file was loaded.
    let shipped = std::fs::read_to_string(deploy().join("prometheus/alerts.yml")).unwrap();
    let expected = shipped.matches("- alert:").count();
    assert!(expected >= 13, "{expected} rules in alerts.yml");
    assert_eq!(count, expected, "{rules}");
    assert!(
        firing.is_subset(&BTreeSet::from([
            "GatewayRejectingRecords".to_owned(),
            "SinkDeadLetters".to_owned()
        ])),
        "unexpected alerts: {firing:?}"
    );

    shutdown.cancel();
    gateway.task.await.unwrap().unwrap();
    sink.task.await.unwrap().unwrap();
}
