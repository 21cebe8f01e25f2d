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
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ingest_gateway::GatewayConfig;
use ingest_gateway::config::{AuthConfig, TokenConfig};
use loadtest::fleet::{FleetSpec, sensor_readings, to_ndjson};
use serde_json::Value;
use sink::SinkConfig;
use sink::config::{RotationConfig, StoreConfig};
use sink::registry::RegistryConfig;
use tokio_util::sync::CancellationToken;

const TOKEN: &str = "registry-test-token";

/// Produces the readings of an NDJSON file in four ways, by index: plain JSON; Avro with the
/// subject's latest schema (the definition's, not registered again); Avro with a schema of its
/// own (millisecond timestamps, another name and field order) that the serializer registers;
/// JSON with a JSON Schema it registers. Every seventh reading is sent again in the next way.
/// Then the bad values. Writes the readings of a second file as an Avro container file. Prints
/// the id of its own schema and the number of bad values.
const PRODUCE: &str = r#"
import json, sys, struct
from confluent_kafka import Producer
from confluent_kafka.serialization import SerializationContext, MessageField
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONSerializer

brokers, topic, registry, credentials, path, file_readings, file_out = sys.argv[1:8]
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
    b"\x01" + good[1:],                                 # a wrong magic byte (not JSON either)
    b"\x00\x00\x01",                                   # a truncated schema id
    b"\x00" + struct.pack(">I", 2147483000) + good[5:],  # an id the registry does not know
    good[:5] + b"\x02\x41",                             # bytes that do not match the schema
]
for value in bad:
    p.produce(topic, key="dev-bad", value=value)
left = p.flush(30)
# An Avro object container file of other readings, for the gateway's HTTP API.
import fastavro
schema = fastavro.parse_schema(json.loads(client.get_latest_version(ctx.topic + "-value").schema.schema_str))
with open(file_readings) as f, open(file_out, "wb") as out:
    fastavro.writer(out, schema, [dict(json.loads(line), ts=json.loads(line)["ts"] * 1000) for line in f], codec="deflate")
print(json.dumps({"own_id": own_id, "bad": len(bad)}))
sys.exit(1 if left else 0)
"#;

/// A gateway with its registry (a token for every stream, registered schemas kept in a
/// directory) on Apache Kafka, and the topics of a test of its own.
struct Rig {
    kafka: String,
    python: String,
    prefix: String,
    dir: tempfile::TempDir,
    shutdown: CancellationToken,
    gateway: ingest_gateway::Gateway,
}

impl Rig {
    /// `add_fields`: the registry may add fields to the definitions (in a directory of the
    /// rig's, which the sinks read too).
    async fn start(add_fields: bool) -> Rig {
        let kafka = common::service_env("EDGE_INGEST_KAFKA");
        let prefix = format!("registry{}.", common::unique_id());
        let dir = tempfile::tempdir().unwrap();
        let streams_dir = dir.path().join("streams");
        std::fs::create_dir(&streams_dir).unwrap();
        for (name, text) in schemas::EXAMPLE_STREAMS {
            std::fs::write(streams_dir.join(format!("{name}.toml")), text).unwrap();
        }
        let shutdown = CancellationToken::new();
        let mut config = GatewayConfig {
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
        config.kafka.brokers = kafka.clone();
        config.kafka.topic_prefix = prefix.clone();
        config.kafka.create_topics = true;
        config.registry.dir = Some(dir.path().join("registry"));
        config.registry.add_fields = add_fields;
        config.streams_dir = streams_dir.clone();
        let streams = service_kit::load_streams_dir(&streams_dir).unwrap();
        let gateway = ingest_gateway::start(config, streams, shutdown.clone())
            .await
            .unwrap();
        Rig {
            kafka,
            python: common::service_env("EDGE_INGEST_PYTHON"),
            prefix,
            dir,
            shutdown,
            gateway,
        }
    }

    fn registry(&self) -> String {
        format!("http://{}/registry", self.gateway.addr)
    }

    /// A Python `script` of the venv with the broker, the stream's topic, the registry and the
    /// credentials as its first arguments.
    fn producer(&self, script: &str) -> Command {
        let mut command = Command::new(&self.python);
        command
            .args(["-c", script, &self.kafka])
            .arg(format!("{}sensor_readings", self.prefix))
            .arg(self.registry())
            .arg(format!("producers:{TOKEN}"));
        command
    }

    /// Produces `readings` with [`PRODUCE`] and writes `in_file` as an Avro file; what it printed.
    async fn produce(&self, readings: &[Value], in_file: &[Value]) -> (Value, Vec<u8>) {
        let path = |name: &str| self.dir.path().join(name);
        std::fs::write(path("readings.ndjson"), to_ndjson(readings)).unwrap();
        std::fs::write(path("file.ndjson"), to_ndjson(in_file)).unwrap();
        let mut producer = self.producer(PRODUCE);
        producer.args([
            path("readings.ndjson"),
            path("file.ndjson"),
            path("file.avro"),
        ]);
        let out = run(producer).await;
        let file = std::fs::read(path("file.avro")).unwrap();
        (serde_json::from_slice(&out).unwrap(), file)
    }

    /// A sink of the rig's topics reading schemas from `registry` with the token as basic
    /// credentials, landing under the rig's `store` (and in a table, with `table`).
    async fn sink(&self, registry: String, table: bool) -> sink::Sink {
        let mut config = SinkConfig {
            store: StoreConfig::Local {
                path: self.dir.path().join("store"),
            },
            rotation: RotationConfig {
                idle_ms: 500,
                ..RotationConfig::default()
            },
            registry: Some(RegistryConfig {
                url: registry,
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
        config.kafka.brokers = self.kafka.clone();
        config.kafka.topic_prefix = self.prefix.clone();
        config.kafka.group_id = format!("{}sinks", self.prefix);
        config.upload.staging_dir = self.dir.path().join("staging");
        config.streams_dir = self.dir.path().join("streams");
        if table {
            let catalog = self.dir.path().join("catalog.db").display().to_string();
            let mut table = sink::table::TableConfig::new(catalog);
            table.commit_interval_ms = 500;
            config.table = Some(table);
        }
        let streams = service_kit::load_streams_dir(&config.streams_dir).unwrap();
        sink::start(config, streams, self.shutdown.clone())
            .await
            .unwrap()
    }

    /// Stops `sink` once it read `total` records, then the gateway; the sink (its task ended)
    /// and the rig's directory.
    async fn finish(self, mut sink: sink::Sink, total: u64) -> (sink::Sink, tempfile::TempDir) {
        let deadline = Instant::now() + Duration::from_secs(120);
        while received(&sink) < total {
            assert!(
                Instant::now() < deadline,
                "the sink read {} of {total} records",
                received(&sink)
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        self.shutdown.cancel();
        (&mut sink.task).await.unwrap().unwrap();
        self.gateway.task.await.unwrap().unwrap();
        (sink, self.dir)
    }
}

/// Runs `command` off the runtime's threads (a sink may be running on them); its output, once
/// it succeeded.
async fn run(mut command: Command) -> Vec<u8> {
    let what = format!("{:?}", command.get_program());
    let out = tokio::task::spawn_blocking(move || command.output().unwrap())
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

fn received(sink: &sink::Sink) -> u64 {
    sink.stats.records_received.load(Ordering::Relaxed)
}

/// `records` readings of seed `seed`, none repeated, the seed's own hour of times.
fn readings(records: usize, seed: u64) -> Vec<Value> {
    let spec = FleetSpec::default();
    sensor_readings(&FleetSpec {
        records,
        seed,
        duplicate_ratio: 0.0,
        start_ms: spec.start_ms + seed as i64 * 3_600_000,
        ..spec
    })
}

/// Posts an Avro container file of readings to the rig's gateway; how many it accepted.
async fn post_avro(rig: &Rig, file: Vec<u8>) -> u64 {
    let answer = reqwest::Client::new()
        .post(format!(
            "http://{}/v1/streams/sensor_readings/records",
            rig.gateway.addr
        ))
        .bearer_auth(TOKEN)
        .header("content-type", "avro/binary")
        .body(file)
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    let body: Value = serde_json::from_slice(&answer.bytes().await.unwrap()).unwrap();
    assert_eq!(body["rejected"], serde_json::json!([]), "{body}");
    body["accepted"].as_u64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confluent_serializers_avro_and_json_schema_land_once_through_the_gateways_registry() {
    let rig = Rig::start(false).await;
    let sent = readings(800, 72);
    let in_file = readings(200, 73);
    let (produced, file) = rig.produce(&sent, &in_file).await;
    // The producer's own schema and its JSON Schema were registered, and kept in registry.dir.
    let kept = std::fs::read_dir(rig.dir.path().join("registry"))
        .unwrap()
        .count();
    assert_eq!(kept, 2, "registered schemas kept");
    assert_eq!(post_avro(&rig, file).await, in_file.len() as u64);

    let sink = rig.sink(rig.registry(), false).await;
    let resent = sent.len().div_ceil(7) as u64;
    let bad = produced["bad"].as_u64().unwrap();
    let total = (sent.len() + in_file.len()) as u64 + resent + bad;
    let (sink, dir) = rig.finish(sink, total).await;
    let duplicates = sink.stats.duplicates_dropped.load(Ordering::Relaxed);
    assert_eq!(duplicates, resent, "each re-sent reading dropped once");

    let store = dir.path().join("store");
    let landed = common::pyarrow(&["--dir", store.to_str().unwrap()]);
    let all: Vec<Value> = sent.iter().chain(&in_file).cloned().collect();
    common::assert_landed_exactly(&all, &landed);

    let mut reasons = Vec::new();
    for entry in walk(&store.join("landing/_dead_letters")) {
        for line in std::fs::read_to_string(entry).unwrap().lines() {
            let d: Value = serde_json::from_str(line).unwrap();
            reasons.push(d["reason"].as_str().unwrap().to_owned());
        }
    }
    assert_eq!(reasons.len() as u64, bad, "{reasons:?}");
    let own_id = produced["own_id"].as_u64().unwrap();
    for reason in [
        "a registry-framed value holds a 4-byte schema id".to_owned(),
        "malformed JSON".to_owned(),
        "schema id 2147483000: the registry does not know it".to_owned(),
        format!("schema id {own_id}: the value does not match its Avro schema"),
    ] {
        assert!(
            reasons.iter().any(|r| r.starts_with(&reason)),
            "{reason}: {reasons:?}"
        );
    }
}

/// The sink's registry is unreachable when the sink starts: it waits for it, dead-letters
/// nothing and lands nothing past the first framed value, and once the registry answers it
/// lands every reading once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_that_does_not_answer_is_waited_for_and_loses_nothing() {
    let rig = Rig::start(false).await;
    let sent = readings(120, 74);
    let (produced, _) = rig.produce(&sent, &[]).await;
    let port = common::free_port();
    let sink = rig
        .sink(format!("http://127.0.0.1:{port}/registry"), false)
        .await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    // The first reading is JSON; the second is the first framed value.
    assert!(
        received(&sink) <= 1,
        "read {} before the registry answered",
        received(&sink)
    );
    assert_eq!(sink.stats.dead_letters.load(Ordering::Relaxed), 0);
    let registry = common::proxy(port, rig.gateway.addr.port()).await;
    let bad = produced["bad"].as_u64().unwrap();
    let total = sent.len() as u64 + sent.len().div_ceil(7) as u64 + bad;
    let (sink, dir) = rig.finish(sink, total).await;
    registry.cancel();
    assert_eq!(sink.stats.dead_letters.load(Ordering::Relaxed), bad);
    let landed = common::pyarrow(&["--dir", dir.path().join("store").to_str().unwrap()]);
    common::assert_landed_exactly(&sent, &landed);
}

/// Produces readings with the subject's latest schema (the definition's), then registers a
/// schema that adds a nullable `humidity` and produces readings that set it. Prints the new
/// schema's id.
const EVOLVE: &str = r#"
import json, sys
from confluent_kafka import Producer
from confluent_kafka.serialization import SerializationContext, MessageField
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer

brokers, topic, registry, credentials, path = sys.argv[1:6]
client = SchemaRegistryClient({"url": registry, "basic.auth.user.info": credentials})
ctx = SerializationContext(topic, MessageField.VALUE)
latest = AvroSerializer(client, None, conf={"auto.register.schemas": False, "use.latest.version": True})
with open(path) as f:
    readings = [json.loads(line) for line in f]
half = len(readings) // 2
p = Producer({"bootstrap.servers": brokers, "enable.idempotence": True})
for r in readings[:half]:
    p.produce(topic, key=r["device_id"], value=latest(dict(r, ts=r["ts"] * 1000), ctx))
schema = json.loads(client.get_latest_version(topic + "-value").schema.schema_str)
schema["fields"].append({"name": "humidity", "type": ["null", "double"], "default": None,
                         "doc": "Relative humidity, percent"})
evolved = AvroSerializer(client, json.dumps(schema))
for i, r in enumerate(readings[half:]):
    value = evolved(dict(r, ts=r["ts"] * 1000, humidity=40 + i * 0.5), ctx)
    p.produce(topic, key=r["device_id"], value=value)
sys.exit(1 if p.flush(30) else 0)
"#;

/// A producer registers a schema with a new nullable field: the gateway adds it to the stream's
/// definition (version 2, in the directory the sink reads too), the sink takes the new
/// definition when the first reading that sets the field comes, and the field lands in the new
/// files and as a new column of the table. A rig without `registry.add_fields` refuses the
/// schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_that_adds_a_nullable_field_adds_it_to_the_stream_and_the_table() {
    let refusing = Rig::start(false).await;
    let subject = format!("{}sensor_readings-value", refusing.prefix);
    let mut schema: Value = serde_json::from_str(&schemas::registry::export::avro_schema(
        schemas::example_streams().get("sensor_readings").unwrap(),
    ))
    .unwrap();
    schema["fields"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({"name": "humidity", "type": ["null", "double"], "default": null}));
    let refused = reqwest::Client::new()
        .post(format!(
            "{}/subjects/{subject}/versions",
            refusing.registry()
        ))
        .bearer_auth(TOKEN)
        .header("content-type", "application/vnd.schemaregistry.v1+json")
        .body(serde_json::json!({"schema": schema.to_string()}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 409);
    let body = String::from_utf8_lossy(&refused.bytes().await.unwrap()).into_owned();
    assert!(body.contains("registry.add_fields"), "{body}");
    refusing.shutdown.cancel();

    let rig = Rig::start(true).await;
    let sent = readings(200, 75);
    // The sink runs from the start, on the definition of version 1.
    let sink = rig.sink(rig.registry(), true).await;
    let path = rig.dir.path().join("evolve.ndjson");
    std::fs::write(&path, to_ndjson(&sent)).unwrap();
    let mut producer = rig.producer(EVOLVE);
    producer.arg(&path);
    run(producer).await;
    let definition =
        std::fs::read_to_string(rig.dir.path().join("streams/sensor_readings.toml")).unwrap();
    let def = schemas::StreamDef::from_toml(&definition).unwrap();
    assert_eq!(def.version, 2, "{definition}");
    let humidity = &def.fields[def.field_index("humidity").unwrap()];
    assert_eq!(
        (humidity.ty.to_string(), humidity.required),
        ("float64".into(), false)
    );
    assert_eq!(humidity.doc, "Relative humidity, percent");

    let (_, dir) = rig.finish(sink, sent.len() as u64).await;
    let landed = common::pyarrow(&["--dir", dir.path().join("store").to_str().unwrap()]);
    common::assert_same_records(&sent, &landed);
    let (versions, humid) = common::column_added_in(&landed, "humidity", "2");
    assert_eq!(versions.len(), 2, "{versions:?}");
    let want: f64 = (0..100).map(|i| 40.0 + f64::from(i) * 0.5).sum();
    assert_eq!((humid.len(), humid.iter().sum::<f64>()), (100, want));
    let mut reader = Command::new(common::service_env("EDGE_INGEST_PYTHON"));
    reader
        .arg(common::repo_root().join("scripts/read_table.py"))
        .arg("--catalog")
        .arg(dir.path().join("catalog.db"))
        .args(["--table", "sensor_readings"]);
    let table: Value = serde_json::from_slice(&run(reader).await).unwrap();
    common::assert_same_records(&sent, &table);
    assert!(
        table["schema"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f["name"] == "humidity" && f["type"] == "double"),
        "{}",
        table["schema"]
    );
    let in_table: f64 = table["rows"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["humidity"].as_f64())
        .sum();
    assert_eq!(in_table, want);
}

/// Encodes readings with the npm registry's client, `@kafkajs/confluent-schema-registry`:
/// every other one as Avro under the subject's latest schema (the definition's), the others as
/// JSON under a JSON Schema it registers. Writes `key<TAB>hex value` lines.
const NODE_ENCODE: &str = r#"
const { SchemaRegistry, SchemaType } = require("@kafkajs/confluent-schema-registry");
const fs = require("fs");
const [url, credentials, subject, input, output] = process.argv.slice(1);
const [username, password] = credentials.split(":");
(async () => {
  const registry = new SchemaRegistry({ host: url, auth: { username, password } });
  const avro = await registry.getLatestSchemaId(subject);
  const schema = { $schema: "http://json-schema.org/draft-07/schema#", type: "object",
    required: ["device_id", "sensor", "ts", "value"],
    properties: { device_id: { type: "string" }, sensor: { type: "string" },
      ts: { type: "integer" }, value: { type: "number" }, unit: { type: "string" },
      quality: { type: "integer" }, tags: { type: "object", additionalProperties: { type: "string" } } } };
  const { id: json } = await registry.register(
    { type: SchemaType.JSON, schema: JSON.stringify(schema) }, { subject });
  const readings = fs.readFileSync(input, "utf8").split("\n").filter(Boolean).map(JSON.parse);
  const lines = [];
  for (const [i, r] of readings.entries()) {
    const value = i % 2 === 0
      ? await registry.encode(avro, { ...r, ts: r.ts * 1000 })
      : await registry.encode(json, r);
    lines.push(`${r.device_id}\t${value.toString("hex")}`);
  }
  fs.writeFileSync(output, lines.join("\n") + "\n");
})().catch((e) => { console.error(e); process.exit(1); });
"#;

/// Produces `key<TAB>hex value` lines as they are.
const PRODUCE_HEX: &str = r#"
import sys
from confluent_kafka import Producer
brokers, topic, path = sys.argv[1:4]
p = Producer({"bootstrap.servers": brokers, "enable.idempotence": True})
with open(path) as f:
    for line in f:
        key, value = line.rstrip("\n").split("\t")
        p.produce(topic, key=key, value=bytes.fromhex(value))
sys.exit(1 if p.flush(30) else 0)
"#;

/// The npm registry's schema registry client against the gateway's registry: its Avro and JSON
/// Schema values land once, read back by pyarrow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_npm_registry_client_encodes_values_the_sink_lands_once() {
    let rig = Rig::start(false).await;
    let sent = readings(300, 76);
    let input = rig.dir.path().join("node.ndjson");
    let encoded = rig.dir.path().join("node.hex");
    std::fs::write(&input, to_ndjson(&sent)).unwrap();
    let topic = format!("{}sensor_readings", rig.prefix);
    let mut node = Command::new(common::service_env("EDGE_INGEST_NODE"));
    node.env("NODE_PATH", common::service_env("EDGE_INGEST_NODE_MODULES"))
        .args(["-e", NODE_ENCODE, &rig.registry()])
        .arg(format!("producers:{TOKEN}"))
        .arg(format!("{topic}-value"))
        .args([&input, &encoded]);
    run(node).await;
    let mut producer = Command::new(&rig.python);
    producer
        .args(["-c", PRODUCE_HEX, &rig.kafka, &topic])
        .arg(&encoded);
    run(producer).await;
    let sink = rig.sink(rig.registry(), false).await;
    let (sink, dir) = rig.finish(sink, sent.len() as u64).await;
    assert_eq!(sink.stats.dead_letters.load(Ordering::Relaxed), 0);
    let landed = common::pyarrow(&["--dir", dir.path().join("store").to_str().unwrap()]);
    common::assert_landed_exactly(&sent, &landed);
}

/// Produces readings with confluent-kafka's `ProtobufSerializer`: the message class is built
/// from a `FileDescriptorProto` (proto3, `optional` fields, a map, `google.protobuf.Timestamp`),
/// which the serializer registers as base64. Prints the schema's id.
const PRODUCE_PROTOBUF: &str = r#"
import json, struct, sys
from confluent_kafka import Producer
from confluent_kafka.serialization import SerializationContext, MessageField
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, timestamp_pb2

brokers, topic, registry, credentials, path = sys.argv[1:6]
F = descriptor_pb2.FieldDescriptorProto
file = descriptor_pb2.FileDescriptorProto(name="plant/reading.proto", package="plant",
    syntax="proto3", dependency=["google/protobuf/timestamp.proto"])
m = file.message_type.add(name="Reading")
m.field.add(name="device_id", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
m.field.add(name="sensor", number=2, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
m.field.add(name="ts", number=3, type=F.TYPE_MESSAGE, label=F.LABEL_OPTIONAL,
            type_name=".google.protobuf.Timestamp")
m.field.add(name="value", number=4, type=F.TYPE_DOUBLE, label=F.LABEL_OPTIONAL)
for i, (name, number, kind) in enumerate([("unit", 5, F.TYPE_STRING), ("quality", 6, F.TYPE_INT64)]):
    m.oneof_decl.add(name="_" + name)
    m.field.add(name=name, number=number, type=kind, label=F.LABEL_OPTIONAL, oneof_index=i,
                proto3_optional=True)
entry = m.nested_type.add(name="TagsEntry")
entry.options.map_entry = True
entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
entry.field.add(name="value", number=2, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
m.field.add(name="tags", number=7, type=F.TYPE_MESSAGE, label=F.LABEL_REPEATED,
            type_name=".plant.Reading.TagsEntry")
pool = descriptor_pool.DescriptorPool()
pool.AddSerializedFile(timestamp_pb2.DESCRIPTOR.serialized_pb)
pool.Add(file)
Reading = message_factory.GetMessageClass(pool.FindMessageTypeByName("plant.Reading"))
client = SchemaRegistryClient({"url": registry, "basic.auth.user.info": credentials})
serialize = ProtobufSerializer(Reading, client, {"use.deprecated.format": False})
ctx = SerializationContext(topic, MessageField.VALUE)
p = Producer({"bootstrap.servers": brokers, "enable.idempotence": True})
value = None
with open(path) as f:
    for line in f:
        r = json.loads(line)
        msg = Reading(device_id=r["device_id"], sensor=r["sensor"], value=r["value"],
                      unit=r["unit"], quality=r["quality"], tags=r["tags"])
        msg.ts.FromMilliseconds(r["ts"])
        value = serialize(msg, ctx)
        p.produce(topic, key=r["device_id"], value=value)
print(json.dumps({"id": struct.unpack(">I", value[1:5])[0]}))
sys.exit(1 if p.flush(30) else 0)
"#;

/// confluent-kafka's `ProtobufSerializer` with a message class of its own: the gateway takes
/// its schema (a base64 `FileDescriptorProto`), and the sink lands every reading once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protobuf_serializer_values_land_once() {
    let rig = Rig::start(false).await;
    let sent = readings(300, 77);
    let path = rig.dir.path().join("protobuf.ndjson");
    std::fs::write(&path, to_ndjson(&sent)).unwrap();
    let mut producer = rig.producer(PRODUCE_PROTOBUF);
    producer.arg(&path);
    let id: Value = serde_json::from_slice(&run(producer).await).unwrap();
    let schema = reqwest::Client::new()
        .get(format!("{}/schemas/ids/{}", rig.registry(), id["id"]))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let schema: Value = serde_json::from_slice(&schema).unwrap();
    assert_eq!(schema["schemaType"], "PROTOBUF", "{schema}");
    let sink = rig.sink(rig.registry(), false).await;
    let (sink, dir) = rig.finish(sink, sent.len() as u64).await;
    assert_eq!(sink.stats.dead_letters.load(Ordering::Relaxed), 0);
    let landed = common::pyarrow(&["--dir", dir.path().join("store").to_str().unwrap()]);
    common::assert_landed_exactly(&sent, &landed);
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
