//! Kafka producers that speak the schema registry wire format, with Confluent's own clients:
//! confluent-kafka's Python `AvroSerializer` (with the definition's schema from the gateway's
//! registry, and with a schema of the producer's own that it registers) and `JSONSerializer`,
//! beside plain JSON values, all on one topic of Apache Kafka. The sink fetches the schemas
//! from the gateway's registry (basic authentication with a gateway token) and lands every
//! distinct reading once, whichever format carried it (readings re-sent in another format are
//! dropped as duplicates); pyarrow and DuckDB read the rows back with the stream's types. Values
//! in the wire format that cannot be read become dead letters with their reasons.

use crate::common;

use std::process::Command;
use std::time::{Duration, Instant};

use ingest_gateway::GatewayConfig;
use ingest_gateway::config::{AuthConfig, TokenConfig};
use loadtest::fleet::{FleetSpec, sensor_readings, to_ndjson};
use sink::SinkConfig;
use sink::config::{RotationConfig, StoreConfig};
use sink::registry::RegistryConfig;
use tokio_util::sync::CancellationToken;

const TOKEN: &str = "registry-test-token";

/// Produces the readings of an NDJSON file in four ways, by index: plain JSON; Avro with the
/// subject's latest schema (the definition's, not registered again); Avro with a schema of its
/// own (millisecond timestamps, another name and field order) that the serializer registers;
/// JSON with a JSON Schema it registers. Every seventh reading is sent again in the next way.
/// Then the bad values. Prints the ids it used.
const PRODUCE: &str = r#"
import json, sys, struct
from confluent_kafka import Producer
from confluent_kafka.serialization import SerializationContext, MessageField
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONSerializer

brokers, topic, registry, credentials, path = sys.argv[1:6]
client = SchemaRegistryClient({"url": registry, "basic.auth.user.info": credentials})
latest = AvroSerializer(client, None, conf={"auto.register.schemas": False, "use.latest.version": True})
own_schema = json.dumps({"type": "record", "name": "Reading", "namespace": "plant", "fields": [
    {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    {"name": "device_id", "type": "string"},
    {"name": "sensor", "type": "string"},
    {"name": "value", "type": "double"},
    {"name": "unit", "type": ["null", "string"], "default": None},
    {"name": "quality", "type": ["null", "long"], "default": None},
    {"name": "tags", "type": ["null", {"type": "map", "values": "string"}], "default": None}]})
own = AvroSerializer(client, own_schema)
json_schema = json.dumps({"$schema": "http://json-schema.org/draft-07/schema#", "title": "reading",
    "type": "object", "required": ["device_id", "sensor", "ts", "value"], "properties": {
    "device_id": {"type": "string"}, "sensor": {"type": "string"}, "ts": {"type": "integer"},
    "value": {"type": "number"}, "unit": {"type": "string"}, "quality": {"type": "integer"},
    "tags": {"type": "object", "additionalProperties": {"type": "string"}}}})
as_json_schema = JSONSerializer(json_schema, client)
ctx = SerializationContext(topic, MessageField.VALUE)

def encode(way, r):
    if way == 0:
        return json.dumps(r).encode()
    if way == 1:
        return latest(dict(r, ts=r["ts"] * 1000), ctx)
    if way == 2:
        return own(r, ctx)
    return as_json_schema(r, ctx)

p = Producer({"bootstrap.servers": brokers, "enable.idempotence": True})
with open(path) as f:
    readings = [json.loads(line) for line in f]
for i, r in enumerate(readings):
    p.produce(topic, key=r["device_id"], value=encode(i % 4, r))
    if i % 7 == 0:
        p.produce(topic, key=r["device_id"], value=encode((i + 1) % 4, r))
    p.poll(0)
good = own(readings[0], ctx)
own_id = struct.unpack(">I", good[1:5])[0]
bad = [
    b"\x00\x00\x01",                                   # a truncated schema id
    b"\x00" + struct.pack(">I", 2147483000) + good[5:],  # an id the registry does not know
    good[:5] + b"\x02\x41",                             # bytes that do not match the schema
]
for value in bad:
    p.produce(topic, key="dev-bad", value=value)
left = p.flush(30)
print(json.dumps({"own_id": own_id, "bad": len(bad)}))
sys.exit(1 if left else 0)
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confluent_serializers_avro_and_json_schema_land_once_through_the_gateways_registry() {
    let kafka = common::service_env("EDGE_INGEST_KAFKA");
    let python = common::service_env("EDGE_INGEST_PYTHON");
    let id = common::unique_id();
    let prefix = format!("registry{id}.");
    let shutdown = CancellationToken::new();
    let mut gateway = GatewayConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        admin_listen: None,
        auth: AuthConfig {
            allow_anonymous: false,
            tokens: vec![TokenConfig {
                name: "producers".into(),
                blake3: blake3::hash(TOKEN.as_bytes()).to_hex().to_string(),
                streams: vec!["*".into()],
                max_bytes_per_sec: None,
            }],
        },
        ..GatewayConfig::default()
    };
    gateway.kafka.brokers = kafka.clone();
    gateway.kafka.topic_prefix = prefix.clone();
    gateway.kafka.create_topics = true;
    let dir = tempfile::tempdir().unwrap();
    gateway.registry.dir = Some(dir.path().join("registry"));
    let gateway = ingest_gateway::start(gateway, schemas::example_streams(), shutdown.clone())
        .await
        .unwrap();
    let registry = format!("http://{}/registry", gateway.addr);

    let sent = sensor_readings(&FleetSpec {
        records: 800,
        seed: 72,
        duplicate_ratio: 0.0,
        ..FleetSpec::default()
    });
    let file = dir.path().join("readings.ndjson");
    std::fs::write(&file, to_ndjson(&sent)).unwrap();
    let topic = format!("{prefix}sensor_readings");
    let out = Command::new(&python)
        .args(["-c", PRODUCE, &kafka, &topic, &registry])
        .arg(format!("producers:{TOKEN}"))
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the confluent-kafka producer failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let produced: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // The producer's own schema was registered (kept in registry.dir) as the subject's second
    // version; the JSON Schema as its third.
    let kept = std::fs::read_dir(dir.path().join("registry"))
        .unwrap()
        .count();
    assert_eq!(kept, 2, "registered schemas kept");

    let landing = dir.path().join("store");
    let mut config = SinkConfig {
        store: StoreConfig::Local {
            path: landing.clone(),
        },
        rotation: RotationConfig {
            idle_ms: 500,
            ..RotationConfig::default()
        },
        registry: Some(RegistryConfig {
            url: registry.clone(),
            username: Some("producers".into()),
            password: Some(TOKEN.to_owned().into()),
            password_file: None,
            token: None,
            token_file: None,
            ca_file: None,
            timeout_ms: 10_000,
        }),
        ..SinkConfig::default()
    };
    config.kafka.brokers = kafka;
    config.kafka.topic_prefix = prefix;
    config.kafka.group_id = format!("registry-{id}");
    config.upload.staging_dir = dir.path().join("staging");
    let sink = sink::start(config, schemas::example_streams(), shutdown.clone())
        .await
        .unwrap();
    let resent = sent.len().div_ceil(7);
    let bad = produced["bad"].as_u64().unwrap();
    let total = (sent.len() + resent) as u64 + bad;
    let deadline = Instant::now() + Duration::from_secs(120);
    let stats = sink.stats.clone();
    let received = || {
        stats
            .records_received
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    while received() < total {
        assert!(
            Instant::now() < deadline,
            "the sink read {} of {total} records",
            received()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    shutdown.cancel();
    sink.task.await.unwrap().unwrap();
    gateway.task.await.unwrap().unwrap();
    let duplicates = sink
        .stats
        .duplicates_dropped
        .load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(
        duplicates, resent as u64,
        "each re-sent reading dropped once"
    );

    let landed = common::pyarrow(&["--dir", landing.to_str().unwrap()]);
    common::assert_landed_exactly(&sent, &landed);

    let mut reasons = Vec::new();
    for entry in walk(&landing.join("landing/_dead_letters")) {
        for line in std::fs::read_to_string(entry).unwrap().lines() {
            let d: serde_json::Value = serde_json::from_str(line).unwrap();
            reasons.push(d["reason"].as_str().unwrap().to_owned());
        }
    }
    reasons.sort();
    assert_eq!(reasons.len() as u64, bad, "{reasons:?}");
    assert!(
        reasons[0].starts_with("a registry-framed value holds a 4-byte schema id"),
        "{reasons:?}"
    );
    let own_id = produced["own_id"].as_u64().unwrap();
    assert!(
        reasons
            .iter()
            .any(|r| r.starts_with("schema id 2147483000: the registry does not know it")),
        "{reasons:?}"
    );
    assert!(
        reasons.iter().any(|r| r.starts_with(&format!(
            "schema id {own_id}: the value does not match its Avro schema"
        ))),
        "{reasons:?}"
    );
}

/// The files under `dir`, at any depth.
fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return files;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else {
            files.push(path);
        }
    }
    files
}
