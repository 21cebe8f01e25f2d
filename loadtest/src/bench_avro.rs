//! bench-sink's Avro path: the same readings as Avro values in the schema registry wire format,
//! on a topic of their own, the stream's schema served by a gateway's registry, so the sink's
//! records per CPU-second with Avro values compare with its JSON ones in one run.

use anyhow::{Context as _, bail};
use apache_avro::types::Value as Avro;
use rdkafka::ClientConfig;
use rdkafka::message::OwnedHeaders;
use rdkafka::producer::{FutureProducer, FutureRecord};
use schemas::{FieldType, StreamDef};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::bench_gateway::send_queued;

/// The Avro topic and the gateway whose registry serves its schema (stopped when dropped).
pub struct AvroTopic {
    /// The topic prefix of the Avro topic.
    pub prefix: String,
    /// The registry's URL, for the sink's `[registry]`.
    pub registry: String,
    shutdown: CancellationToken,
}

impl Drop for AvroTopic {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Starts a gateway for `<prefix>avro.` topics and produces `lines` (the readings' JSON) to its
/// `sensor_readings` topic as Avro values of the schema the registry serves, keyed and with
/// `headers` per line as the JSON topic has them.
pub async fn produce(
    brokers: &str,
    (prefix, partitions): (&str, i32),
    lines: &[&[u8]],
    headers: &[Option<OwnedHeaders>],
) -> anyhow::Result<AvroTopic> {
    let prefix = format!("{prefix}avro.");
    let mut config = ingest_gateway::GatewayConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        admin_listen: None,
        ..ingest_gateway::GatewayConfig::default()
    };
    config.auth.allow_anonymous = true;
    config.kafka.brokers = brokers.to_owned();
    config.kafka.topic_prefix = prefix.clone();
    config.kafka.topic_partitions = partitions;
    config.kafka.create_topics = true;
    let streams = schemas::example_streams();
    let def = streams
        .get("sensor_readings")
        .cloned()
        .context("sensor_readings stream missing")?;
    let shutdown = CancellationToken::new();
    let gateway = ingest_gateway::start(config, streams, shutdown.clone()).await?;
    let registry = format!("http://{}/registry", gateway.addr);
    let topic = format!("{prefix}sensor_readings");
    let latest = reqwest::get(format!("{registry}/subjects/{topic}-value/versions/latest"))
        .await?
        .bytes()
        .await?;
    let latest: Value = serde_json::from_slice(&latest).context("the registry's answer")?;
    let id = latest["id"].as_u64().context("no schema id")? as u32;
    let schema = apache_avro::Schema::parse_str(latest["schema"].as_str().context("no schema")?)?;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("compression.type", "zstd")
        .set("linger.ms", "20")
        .create()?;
    let mut values = Vec::with_capacity(lines.len());
    for line in lines {
        let json: Value = serde_json::from_slice(line)?;
        let mut value = vec![schemas::registry::MAGIC];
        value.extend_from_slice(&id.to_be_bytes());
        value.extend(apache_avro::to_avro_datum(&schema, record(&def, &json)?)?);
        let key = json["device_id"].as_str().unwrap_or_default().to_owned();
        values.push((key, value));
    }
    let mut pending = Vec::with_capacity(values.len());
    for ((key, value), headers) in values.iter().zip(headers) {
        let record = FutureRecord::to(&topic).key(key).payload(value);
        let record = match headers {
            Some(headers) => record.headers(headers.clone()),
            None => record,
        };
        pending.push(send_queued(&producer, record).await);
    }
    for f in pending {
        f.await?.map_err(|(e, _)| e)?;
    }
    eprintln!(
        "bench: produced {} Avro records (schema id {id}) to {topic}",
        lines.len()
    );
    Ok(AvroTopic {
        prefix,
        registry,
        shutdown,
    })
}

/// A reading as the Avro record of the definition's exported schema.
fn record(def: &StreamDef, json: &Value) -> anyhow::Result<Avro> {
    let mut fields = Vec::with_capacity(def.fields.len());
    for field in &def.fields {
        let value = match json.get(&field.name).filter(|v| !v.is_null()) {
            Some(v) => avro_value(&field.ty, v)?,
            None if field.required => bail!("field '{}' missing", field.name),
            None => Avro::Null,
        };
        let value = match (field.required, value) {
            (true, value) => value,
            (false, Avro::Null) => Avro::Union(0, Box::new(Avro::Null)),
            (false, value) => Avro::Union(1, Box::new(value)),
        };
        fields.push((field.name.clone(), value));
    }
    Ok(Avro::Record(fields))
}

fn avro_value(ty: &FieldType, v: &Value) -> anyhow::Result<Avro> {
    let wrong = || anyhow::anyhow!("{v} is not a {ty}");
    Ok(match ty {
        FieldType::String => Avro::String(v.as_str().ok_or_else(wrong)?.to_owned()),
        FieldType::Bool => Avro::Boolean(v.as_bool().ok_or_else(wrong)?),
        FieldType::Int64 => Avro::Long(v.as_i64().ok_or_else(wrong)?),
        FieldType::Float64 => Avro::Double(v.as_f64().ok_or_else(wrong)?),
        FieldType::Timestamp => {
            Avro::TimestampMicros(schemas::value::parse_timestamp(v).ok_or_else(wrong)?)
        }
        FieldType::List(t) => Avro::Array(
            v.as_array()
                .ok_or_else(wrong)?
                .iter()
                .map(|item| avro_value(t, item))
                .collect::<anyhow::Result<_>>()?,
        ),
        FieldType::Map(t) => Avro::Map(
            v.as_object()
                .ok_or_else(wrong)?
                .iter()
                .map(|(k, item)| Ok((k.clone(), avro_value(t, item)?)))
                .collect::<anyhow::Result<_>>()?,
        ),
    })
}
