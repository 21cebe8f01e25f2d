//! `sink redrive`: a stream's dead letters back into their topics, once its definition takes them.
//!
//! The sink's dead-letter objects (`<key_prefix>/_dead_letters/<stream>/…`) hold every record it
//! could not land, with its topic, partition, offset and payload. Once the cause is mended (a
//! definition that was refused and is fixed now, a field its producers set before the file had
//! it), `sink redrive --stream S` reads them, checks each payload against the stream's
//! definition as it is now, and produces those that pass to the topic they came from, in the
//! gateway's wire format (key, canonical value, `content-hash`, `schema-version`, `ingest-ts`
//! of the redrive), so that the sinks of the group land them like any record. Records still
//! invalid stay where they are and are counted by reason.
//!
//! Each object's redriven offsets are written to `<key_prefix>/_redriven/<object's path>.<ms>.json`
//! once Kafka acknowledged every one of them, and a later run leaves those offsets out: run it
//! again after another fix, and only what that fix lets through goes. A crash between the
//! acknowledgement and that note produces the object's records again at the next run; the
//! sinks drop them by content hash (their dedupe window), as any record re-sent. Nothing is
//! deleted: dead-letter objects stay, for the record.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use anyhow::Context as _;
use bytes::Bytes;
use schemas::{StreamDef, Streams};
use serde::{Deserialize, Serialize};
use service_kit::kafka::redrive::Tally;
use service_kit::kafka::{GroupProducer, Messages};

use crate::SinkConfig;
use crate::store::{ObjectStore, PutOutcome};

/// What to redrive.
#[derive(Debug, Clone, Default)]
pub struct RedriveOptions {
    pub stream: String,
    /// Only dead letters of this day (`YYYY-MM-DD`, the ingest time's, as the objects' folders).
    pub date: Option<String>,
    /// With `date`: only this hour (0–23).
    pub hour: Option<u8>,
    /// Check and count, produce nothing, note nothing.
    pub dry_run: bool,
}

/// What a run did.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize)]
pub struct RedriveReport {
    pub stream: String,
    /// Dead-letter objects read.
    pub objects: u64,
    /// Objects under the dead letters that are not dead-letter objects of a sink (logged).
    pub unreadable_objects: u64,
    /// Dead letters left out: an earlier run redrove them.
    pub redriven_before: u64,
    /// Offsets noted in the dead letters as skipped at an offset gap: their records were not
    /// in Kafka when the sink read the partition, so there is nothing to send back.
    pub skipped_offsets: u64,
    /// The others, checked against the definition as it is now.
    #[serde(flatten)]
    pub tally: Tally,
    pub dry_run: bool,
}

/// One line of a dead-letter object (what `PartitionState::dead_letter` writes).
#[derive(Debug, Deserialize)]
struct DeadLetterLine {
    topic: String,
    offset: i64,
    /// Absent only on the note of an offset gap.
    #[serde(default)]
    payload_hex: Option<String>,
    /// Set on the note of an offset gap skipped (`on_offset_gap = "skip"`): its last offset.
    #[serde(default)]
    skipped_through: Option<i64>,
}

/// What `_redriven/` notes of an object: the offsets produced again.
#[derive(Debug, Serialize, Deserialize)]
struct Note {
    offsets: Vec<i64>,
    at: String,
}

/// Redrives the dead letters of `options.stream` (blocking on Kafka acknowledgements, object by
/// object). Fails on a store or Kafka error; what was noted by then stays done.
pub async fn redrive(
    config: &SinkConfig,
    streams: &Streams,
    options: &RedriveOptions,
) -> anyhow::Result<RedriveReport> {
    let stream = &options.stream;
    let def = service_kit::kafka::redrive::definition(streams, stream, &config.streams_dir)?;
    let folder = folder(options)?;
    let store = ObjectStore::from_config(&config.store).await?;
    let dead_prefix = format!("{}/_dead_letters/{stream}/{folder}", config.key_prefix);
    let note_prefix = format!("{}/_redriven/{stream}/{folder}", config.key_prefix);
    let mut objects: Vec<String> = store
        .list(&dead_prefix)
        .await?
        .into_iter()
        .filter(|k| k.ends_with(".ndjson"))
        .collect();
    objects.sort();
    let notes = notes_by_object(store.list(&note_prefix).await?);
    // Made at the first record to produce: a run with nothing to do needs no brokers.
    let mut producer = None;
    let mut report = RedriveReport {
        stream: stream.clone(),
        dry_run: options.dry_run,
        ..RedriveReport::default()
    };
    let total = objects.len();
    for (n, key) in objects.iter().enumerate() {
        let relative = key
            .strip_prefix(&format!("{}/_dead_letters/", config.key_prefix))
            .expect("listed under the prefix");
        let note_key_start = format!("{}/_redriven/{relative}.", config.key_prefix);
        let done = redriven_before(&store, notes.get(relative)).await?;
        let data = store
            .get(key)
            .await?
            .with_context(|| format!("dead-letter object {key} is gone"))?;
        let counted = report.clone();
        let (by_topic, offsets) = match check_object(def, key, &data, &done, &mut report) {
            Ok(checked) => checked,
            Err(e) => {
                // Not a dead-letter object of a sink (another program's file, a damaged copy):
                // left alone, and the run goes on.
                report = counted;
                report.unreadable_objects += 1;
                tracing::warn!(object = %key, error = %format!("{e:#}"), "not a dead-letter object; left out");
                continue;
            }
        };
        if !offsets.is_empty() && !options.dry_run {
            let producer = match &mut producer {
                Some(p) => p,
                None => producer.insert(make_producer(config)?),
            };
            let batches = by_topic.iter().map(|(t, m)| (t.as_str(), m));
            service_kit::kafka::redrive::produce(producer, batches)
                .await
                .with_context(|| format!("redriving {key}"))?;
            let note = Note {
                offsets,
                at: chrono::Utc::now().to_rfc3339(),
            };
            let note_key = format!(
                "{note_key_start}{}.json",
                chrono::Utc::now().timestamp_millis()
            );
            let body = Bytes::from(serde_json::to_vec(&note)?);
            if store.put_if_absent(&note_key, body).await? == PutOutcome::AlreadyExists {
                tracing::warn!(key = %note_key, "a redrive note of the same millisecond is there already");
            }
        }
        report.objects += 1;
        tracing::info!(
            object = %key,
            done = n + 1,
            of = total,
            redriven = report.tally.redriven,
            still_invalid = report.tally.still_invalid,
            "dead-letter object redriven"
        );
    }
    Ok(report)
}

/// The folder under a stream's dead letters that `options` selects (`""`: all of them).
fn folder(options: &RedriveOptions) -> anyhow::Result<String> {
    match (&options.date, options.hour) {
        (None, None) => Ok(String::new()),
        (None, Some(_)) => anyhow::bail!("--hour needs --date"),
        (Some(date), hour) => {
            chrono::NaiveDate::parse_from_str(date, "%Y-%m-%d")
                .with_context(|| format!("--date {date:?} is not YYYY-MM-DD"))?;
            match hour {
                None => Ok(format!("date={date}/")),
                Some(h) if h < 24 => Ok(format!("date={date}/hour={h:02}/")),
                Some(h) => anyhow::bail!("--hour {h} is not 0 to 23"),
            }
        }
    }
}

/// The keys of the notes under `_redriven/`, by the path of their object under the dead
/// letters (`<path>.<ms>.json`).
fn notes_by_object(keys: Vec<String>) -> HashMap<String, Vec<String>> {
    let mut by_object: HashMap<String, Vec<String>> = HashMap::new();
    for key in keys {
        let object = key
            .split_once("/_redriven/")
            .and_then(|(_, path)| path.strip_suffix(".json"))
            .and_then(|path| path.rsplit_once('.'))
            .map(|(object, _ms)| object.to_owned());
        if let Some(object) = object {
            by_object.entry(object).or_default().push(key);
        }
    }
    by_object
}

/// The offsets of an object that earlier runs produced again, from its notes.
async fn redriven_before(
    store: &ObjectStore,
    notes: Option<&Vec<String>>,
) -> anyhow::Result<BTreeSet<i64>> {
    let mut done = BTreeSet::new();
    for key in notes.into_iter().flatten() {
        let Some(data) = store.get(key).await? else {
            continue;
        };
        let note: Note = serde_json::from_slice(&data)
            .with_context(|| format!("redrive note {key} is not one"))?;
        done.extend(note.offsets);
    }
    Ok(done)
}

/// Checks the dead letters of one object: those that pass (and that no earlier run produced)
/// as messages by topic, and their offsets.
fn check_object(
    def: &StreamDef,
    key: &str,
    data: &[u8],
    done: &BTreeSet<i64>,
    report: &mut RedriveReport,
) -> anyhow::Result<(BTreeMap<String, Messages>, Vec<i64>)> {
    let mut by_topic: BTreeMap<String, Messages> = BTreeMap::new();
    let mut offsets = Vec::new();
    for (i, line) in data.split(|&b| b == b'\n').enumerate() {
        if line.trim_ascii().is_empty() {
            continue;
        }
        let dead: DeadLetterLine = serde_json::from_slice(line)
            .with_context(|| format!("line {} of {key} is not a dead letter", i + 1))?;
        if let Some(last) = dead.skipped_through {
            report.skipped_offsets += (last - dead.offset + 1).max(0) as u64;
            continue;
        }
        if done.contains(&dead.offset) {
            report.redriven_before += 1;
            continue;
        }
        let payload = dead
            .payload_hex
            .as_deref()
            .with_context(|| format!("line {} of {key} has no payload_hex", i + 1))
            .and_then(|text| {
                hex::decode(text).with_context(|| format!("line {} of {key}: payload_hex", i + 1))
            })?;
        if let Some(valid) = report.tally.check(def, &payload) {
            by_topic
                .entry(dead.topic)
                .or_insert_with(|| Messages::new(def, 1, payload.len()))
                .push(def, &valid);
            offsets.push(dead.offset);
        }
    }
    Ok((by_topic, offsets))
}

/// An idempotent producer to the sink's brokers, with its TLS and SASL settings.
fn make_producer(config: &SinkConfig) -> anyhow::Result<GroupProducer> {
    service_kit::kafka::redrive::producer(&config.kafka.brokers, |client| {
        service_kit::kafka::security::apply(
            client,
            config.kafka.tls.as_ref(),
            config.kafka.sasl.as_ref(),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folders_by_date_and_hour() {
        let opts = |date: Option<&str>, hour: Option<u8>| RedriveOptions {
            stream: "s".into(),
            date: date.map(str::to_owned),
            hour,
            dry_run: false,
        };
        assert_eq!(folder(&opts(None, None)).unwrap(), "");
        assert_eq!(
            folder(&opts(Some("2026-11-25"), None)).unwrap(),
            "date=2026-11-25/"
        );
        assert_eq!(
            folder(&opts(Some("2026-11-25"), Some(7))).unwrap(),
            "date=2026-11-25/hour=07/"
        );
        assert!(folder(&opts(None, Some(7))).is_err());
        assert!(folder(&opts(Some("2026-11-25"), Some(24))).is_err());
        assert!(folder(&opts(Some("25.11.2026"), None)).is_err());
        assert!(folder(&opts(Some("../x"), None)).is_err());
    }

    #[test]
    fn a_gap_note_is_counted_and_the_dead_letters_beside_it_are_checked() {
        let streams = schemas::example_streams();
        let def = streams.get("sensor_readings").unwrap();
        let valid = r#"{"device_id":"d","sensor":"t","ts":1,"value":1.5}"#;
        let data = format!(
            "{}\n{}\n{}\n",
            serde_json::json!({"topic": "ingest.sensor_readings", "partition": 0, "offset": 3,
                "payload_hex": hex::encode("{not json"), "reason": "malformed"}),
            serde_json::json!({"topic": "ingest.sensor_readings", "partition": 0, "offset": 4,
                "skipped_through": 99, "skipped_records": 96, "reason": "gap"}),
            serde_json::json!({"topic": "ingest.sensor_readings", "partition": 0, "offset": 100,
                "payload_hex": hex::encode(valid), "reason": "unknown field"}),
        );
        let mut report = RedriveReport::default();
        let (by_topic, offsets) =
            check_object(def, "k", data.as_bytes(), &BTreeSet::new(), &mut report).unwrap();
        assert_eq!(report.skipped_offsets, 96);
        assert_eq!(offsets, [100]);
        assert_eq!(by_topic.len(), 1);
    }

    #[test]
    fn notes_are_found_by_their_object() {
        let object = "s/date=2026-11-25/hour=04/s-p0-o00000000000000000005.ndjson";
        let notes = notes_by_object(vec![
            format!("landing/_redriven/{object}.1764043200000.json"),
            format!("landing/_redriven/{object}.1764043200001.json"),
            "landing/_redriven/s/date=2026-11-25/hour=04/s-p0-o00000000000000000050.ndjson.1.json"
                .to_owned(),
            "landing/_redriven/stray".to_owned(),
        ]);
        assert_eq!(notes[object].len(), 2);
        assert_eq!(notes.len(), 2);
    }
}
