use std::sync::Mutex;
use std::sync::atomic::AtomicBool;

use super::*;
use crate::chunk::Spares;
use crate::spool::{FsyncPolicy, SpoolOptions, Usage};

fn def() -> Arc<StreamDef> {
    schemas::example_streams()
        .get("sensor_readings")
        .unwrap()
        .clone()
}

const SHIPPED: &str = include_str!("../../../streams/sensor_readings.toml");

/// The shipped definition's file in `dir`, for a pipeline to follow.
fn shipped_file(dir: &Path) -> std::path::PathBuf {
    let file = dir.join("sensor_readings.toml");
    std::fs::write(&file, SHIPPED).unwrap();
    file
}

/// The shipped definition with a nullable `humidity` first among the fields.
fn humidity_first() -> String {
    SHIPPED.replacen(
        "[[fields]]",
        "[[fields]]\nname = \"humidity\"\ntype = \"float64\"\n\n[[fields]]",
        1,
    )
}

fn line(i: usize) -> String {
    format!(
        r#"{{"device_id":"d{}","sensor":"s","ts":{},"value":{i}.5}}"#,
        i % 3,
        1_700_000_000_000u64 + i as u64
    )
}

fn pipeline(dir: &Path, encoding: BodyEncoding, max_records: usize) -> (Pipeline, Arc<Spool>) {
    pipeline_with(
        dir,
        encoding,
        max_records,
        1 << 24,
        &StreamSettings::default(),
    )
}

fn pipeline_with(
    dir: &Path,
    encoding: BodyEncoding,
    max_records: usize,
    max_bytes: u64,
    settings: &StreamSettings,
) -> (Pipeline, Arc<Spool>) {
    let options = SpoolOptions {
        max_bytes,
        segment_bytes: 1 << 20,
        fsync: FsyncPolicy::Batch,
        fsync_interval: Duration::from_secs(1),
    };
    let (spool, _) = Spool::open(
        &dir.join("spool"),
        "sensor_readings",
        options,
        Arc::new(Usage::default()),
    )
    .unwrap();
    let spool = Arc::new(spool);
    let batch = BatchConfig {
        max_records,
        encoding,
        ..BatchConfig::default()
    };
    let p = Pipeline::new(
        def(),
        settings,
        batch,
        &DedupeConfig::default(),
        spool.clone(),
        dir,
    )
    .unwrap();
    (p, spool)
}

fn chunk(lines: &[String], log: &Arc<Mutex<Vec<(usize, ChunkOutcome)>>>, tag: usize) -> Chunk {
    let log = log.clone();
    Chunk::new(
        (lines.join("\n") + "\n").into_bytes(),
        Some(Box::new(move |o| log.lock().unwrap().push((tag, o)))),
    )
}

#[test]
fn callbacks_fire_in_order_once_durable_and_batches_decode_to_the_records() {
    for encoding in [BodyEncoding::Ndjson, BodyEncoding::Parquet] {
        let dir = tempfile::tempdir().unwrap();
        let (mut p, spool) = pipeline(dir.path(), encoding, 4);
        let log = Arc::new(Mutex::new(Vec::new()));
        let never = AtomicBool::new(false);
        let lines: Vec<String> = (0..6).map(line).collect();
        p.push_chunk(chunk(&lines[..3], &log, 0), &never).unwrap();
        assert!(
            log.lock().unwrap().is_empty(),
            "3 records: the batch is still open"
        );
        let mut second = lines[3..].to_vec();
        second.push(lines[0].clone());
        second.push("{\"oops\"".into());
        p.push_chunk(chunk(&second, &log, 1), &never).unwrap();
        // The batch closed at 4 records: the first chunk is durable, the second is not yet.
        assert_eq!(
            log.lock()
                .unwrap()
                .iter()
                .map(|(t, _)| *t)
                .collect::<Vec<_>>(),
            [0]
        );
        p.close_batch(&never).unwrap();
        let log = log.lock().unwrap();
        assert_eq!(log.len(), 2);
        assert_eq!(
            (
                log[1].1.accepted,
                log[1].1.duplicates,
                log[1].1.rejected[0].index
            ),
            (3, 1, 4)
        );
        let mut landed = Vec::new();
        while let Some((seq, b)) = spool.first_pending().unwrap() {
            assert_eq!(b.encoding, encoding);
            landed.extend(b.records(&def()).unwrap().into_iter().map(|r| r.hash));
            spool.ack(seq).unwrap();
        }
        let mut expected: Vec<_> = lines
            .iter()
            .map(|l| schemas::check_bytes(&def(), l.as_bytes()).unwrap().hash)
            .collect();
        expected.sort_by_key(|h| h.0);
        landed.sort_by_key(|h| h.0);
        assert_eq!(landed, expected);
    }
}

/// The pipeline writes a spooled batch's digests without an fsync; acknowledging the batch
/// (which takes it out of the spool) makes them durable first, and a restart after that knows
/// them from the log alone. An acknowledgement syncs only as far as its batches need: one whose
/// digests an earlier fsync covered leaves without one (as while a backlog is delivered).
#[test]
fn acknowledging_a_batch_makes_its_digests_durable_first() {
    let dir = tempfile::tempdir().unwrap();
    let never = AtomicBool::new(false);
    let lines: Vec<String> = (0..6).map(line).collect();
    let (mut p, spool) = pipeline(dir.path(), BodyEncoding::Ndjson, 2);
    let syncer = p.log.syncer();
    let push = |p: &mut Pipeline, lines: &[String]| {
        p.push_chunk(Chunk::new(lines.join("\n").into_bytes(), None), &never)
            .unwrap()
    };
    let ack_first = || {
        let (seq, _) = spool.first_pending().unwrap().expect("released");
        spool.ack(seq).unwrap();
    };
    push(&mut p, &lines[..4]);
    assert_eq!(p.stats.batches, 2);
    assert!(syncer.behind(), "the spool is fsynced, the log is not");
    ack_first();
    assert!(
        !syncer.behind(),
        "synced before the batch left the spool: both batches' digests"
    );
    push(&mut p, &lines[4..]);
    assert!(syncer.behind());
    ack_first();
    assert!(
        syncer.behind(),
        "the second batch's digests were durable: no fsync"
    );
    ack_first();
    assert!(!syncer.behind());
    assert_eq!(spool.pending(), (0, 0));
    drop(p);
    let (mut p, _) = pipeline(dir.path(), BodyEncoding::Ndjson, 2);
    push(&mut p, &lines);
    assert_eq!(p.stats.duplicates, 6);
}

/// A batch found in the spool at start, whose digests the start logged again because the log
/// lacked them (lost with the page cache), needs them durable before it leaves.
#[test]
fn a_batch_found_at_start_leaves_after_the_digests_logged_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let never = AtomicBool::new(false);
    let lines: Vec<String> = (0..2).map(line).collect();
    {
        let (mut p, _) = pipeline(dir.path(), BodyEncoding::Ndjson, 2);
        p.push_chunk(Chunk::new(lines.join("\n").into_bytes(), None), &never)
            .unwrap();
    }
    std::fs::remove_file(dir.path().join("sensor_readings.digests")).unwrap();
    let (p, spool) = pipeline(dir.path(), BodyEncoding::Ndjson, 2);
    let syncer = p.log.syncer();
    assert!(syncer.behind(), "logged again at start, not synced");
    let (seq, _) = spool.first_pending().unwrap().expect("found at start");
    spool.ack(seq).unwrap();
    assert!(!syncer.behind());
}

#[test]
fn a_restart_drops_what_was_spooled_even_without_the_dedupe_log() {
    let dir = tempfile::tempdir().unwrap();
    let never = AtomicBool::new(false);
    let lines: Vec<String> = (0..10).map(line).collect();
    {
        let (mut p, _) = pipeline(dir.path(), BodyEncoding::Ndjson, 5);
        p.push_chunk(
            Chunk::new((lines[..5].join("\n")).into_bytes(), None),
            &never,
        )
        .unwrap();
    }
    // The crash came between spooling and logging: no digest log.
    std::fs::remove_file(dir.path().join("sensor_readings.digests")).unwrap();
    let (mut p, _) = pipeline(dir.path(), BodyEncoding::Ndjson, 100);
    p.push_chunk(Chunk::new(lines.join("\n").into_bytes(), None), &never)
        .unwrap();
    assert_eq!((p.stats.read, p.stats.duplicates), (10, 5));
    p.close_batch(&never).unwrap();
    drop(p);
    // The second run logged the digests of the batch it found in the spool as well as those of
    // the batch it spooled; a start that finds them logged does not log them again.
    let log_bytes = || {
        std::fs::metadata(dir.path().join("sensor_readings.digests"))
            .unwrap()
            .len()
    };
    assert_eq!(log_bytes(), 10 * 20);
    drop(pipeline(dir.path(), BodyEncoding::Ndjson, 100));
    assert_eq!(log_bytes(), 10 * 20);
    // With the spool gone (all delivered), the log alone remembers them.
    std::fs::remove_dir_all(dir.path().join("spool")).unwrap();
    let (mut p, _) = pipeline(dir.path(), BodyEncoding::Ndjson, 100);
    p.push_chunk(Chunk::new(lines.join("\n").into_bytes(), None), &never)
        .unwrap();
    assert_eq!(
        p.stats.duplicates, 10,
        "lines 0..5 were logged when the second run found them in the spool, 5..10 when it \
         spooled them"
    );
}

/// A full disk at start (the digest log cannot be written) does not stop the stream, and the
/// window still holds what the spool holds.
#[cfg(target_os = "linux")]
#[test]
fn a_dedupe_log_that_cannot_be_written_at_start_is_not_fatal() {
    let dir = tempfile::tempdir().unwrap();
    let never = AtomicBool::new(false);
    let lines = (0..5).map(line).collect::<Vec<_>>().join("\n");
    {
        let (mut p, _) = pipeline(dir.path(), BodyEncoding::Ndjson, 5);
        p.push_chunk(Chunk::new(lines.clone().into_bytes(), None), &never)
            .unwrap();
    }
    // Writes to /dev/full fail with ENOSPC.
    let log = dir.path().join("sensor_readings.digests");
    std::fs::remove_file(&log).unwrap();
    std::os::unix::fs::symlink("/dev/full", &log).unwrap();
    let (mut p, _) = pipeline(dir.path(), BodyEncoding::Ndjson, 100);
    p.push_chunk(Chunk::new(lines.into_bytes(), None), &never)
        .unwrap();
    assert_eq!((p.stats.read, p.stats.duplicates), (5, 5));
}

#[test]
fn records_dropped_by_a_full_spool_are_not_duplicates_when_sent_again() {
    let never = AtomicBool::new(false);
    let lines: Vec<String> = (0..8).map(line).collect();
    // The spool's size with one batch of 4 records, and with two.
    let (one, two) = {
        let dir = tempfile::tempdir().unwrap();
        let (mut p, spool) = pipeline(dir.path(), BodyEncoding::Ndjson, 4);
        p.push_chunk(Chunk::new(lines[..4].join("\n").into_bytes(), None), &never)
            .unwrap();
        let one = spool.bytes();
        p.push_chunk(Chunk::new(lines[4..].join("\n").into_bytes(), None), &never)
            .unwrap();
        (one, spool.bytes())
    };
    assert!(two > one && one > 0);
    let dir = tempfile::tempdir().unwrap();
    let settings = StreamSettings {
        overflow: Overflow::DropNewest,
        ..StreamSettings::default()
    };
    // Room for one batch, not two.
    let (mut p, spool) = pipeline_with(
        dir.path(),
        BodyEncoding::Ndjson,
        4,
        one + (two - one) / 2,
        &settings,
    );
    let log = Arc::new(Mutex::new(Vec::new()));
    p.push_chunk(chunk(&lines[..4], &log, 0), &never).unwrap();
    p.push_chunk(chunk(&lines[4..], &log, 1), &never).unwrap();
    {
        let log = log.lock().unwrap();
        assert_eq!(log.len(), 2);
        assert!(!log[0].1.spool_dropped);
        assert!(
            log[1].1.spool_dropped,
            "the second batch found the spool full"
        );
    }
    assert_eq!(p.stats.spool_dropped, 4);
    // The first batch is delivered; the client sends the dropped records again.
    let (seq, _) = spool.first_pending().unwrap().unwrap();
    spool.ack(seq).unwrap();
    p.push_chunk(chunk(&lines[4..], &log, 2), &never).unwrap();
    let log = log.lock().unwrap();
    assert_eq!(log.len(), 3);
    assert_eq!((log[2].1.accepted, log[2].1.duplicates), (4, 0));
    assert!(!log[2].1.spool_dropped);
    let (_, batch) = spool.first_pending().unwrap().unwrap();
    assert_eq!(batch.records, 4, "the re-sent records are in the spool");
}

#[test]
fn plain_lines_go_into_ndjson_batches_as_they_are_and_others_canonically() {
    let dir = tempfile::tempdir().unwrap();
    let (mut p, spool) = pipeline(dir.path(), BodyEncoding::Ndjson, 100);
    let never = AtomicBool::new(false);
    let log = Arc::new(Mutex::new(Vec::new()));
    // Plain objects of the stream's keys (any order, spaces inside) stand for themselves; an
    // escape or a repeated key makes the line one the receiver might read differently.
    let plain = [
        r#"{"value":1.5,"ts":1700000000000,"sensor":"s","device_id":"a"}"#,
        r#"{ "device_id" : "b", "sensor":"s","ts":1700000000000,"value":2 }"#,
    ];
    let escaped = r#"{"device_id":"\u0063","sensor":"s","ts":1700000000000,"value":3}"#;
    let repeated = r#"{"device_id":"d","sensor":"s","ts":1700000000000,"value":9,"value":4}"#;
    let lines: Vec<String> = [plain[0], plain[1], escaped, repeated]
        .iter()
        .map(|l| format!("  {l}\r"))
        .collect();
    p.push_chunk(chunk(&lines, &log, 0), &never).unwrap();
    p.close_batch(&never).unwrap();
    let (_, batch) = spool.first_pending().unwrap().unwrap();
    let body = zstd::bulk::decompress(&batch.body, 1 << 20).unwrap();
    let got: Vec<&[u8]> = body
        .split(|c| *c == b'\n')
        .filter(|l| !l.is_empty())
        .collect();
    let canonical = |text: &str| {
        let record = schemas::check_bytes(&def(), text.as_bytes())
            .unwrap()
            .record;
        schemas::wire::encode_value(&def(), &record)
    };
    assert_eq!(got[0], plain[0].as_bytes());
    assert_eq!(got[1], plain[1].as_bytes());
    assert_eq!(got[2], &canonical(escaped)[..]);
    assert_eq!(got[3], &canonical(repeated)[..]);
    assert_eq!(got.len(), 4);
    // The batch id is the hash of what is sent.
    assert_eq!(batch.id.0, *blake3::hash(&body).as_bytes());
}

/// With a filter, a plain line the filter keeps goes into the batch as its own text (held
/// across chunks: its chunk is gone by then), and a line that must be decoded into a record
/// takes part in the same series. Parquet batches get the same rows.
#[test]
fn filtered_lines_go_into_batches_as_they_are() {
    for encoding in [BodyEncoding::Ndjson, BodyEncoding::Parquet] {
        let dir = tempfile::tempdir().unwrap();
        let filter = serde_json::from_value(serde_json::json!(
            {"type": "deadband", "field": "value", "absolute": 1.0, "send_previous": false}
        ))
        .unwrap();
        let settings = StreamSettings {
            filters: vec![filter],
            ..StreamSettings::default()
        };
        let (mut p, spool) = pipeline_with(dir.path(), encoding, 100, 1 << 24, &settings);
        let never = AtomicBool::new(false);
        let log = Arc::new(Mutex::new(Vec::new()));
        let at = |ms: u64, value: &str| {
            format!(
                r#"{{"device_id":"d0","sensor":"s","ts":{},"value":{value},"tags":{{"site":"a"}}}}"#,
                1_700_000_000_000 + ms
            )
        };
        // Kept: the first, the one that breaks the band, and the last one held (at the stop).
        // Dropped: 1.2, and 5.05, a repeated key (decoded into a record, then held).
        let repeated =
            r#"{"device_id":"d0","sensor":"s","ts":1700000000003,"value":9,"value":5.05}"#;
        let chunks = [
            vec![at(0, "1.0"), at(1, "1.2"), at(2, "5.0")],
            vec![repeated.to_owned()],
            vec![format!(" {} ", at(4, "5.1"))],
        ];
        for (tag, lines) in chunks.iter().enumerate() {
            p.push_chunk(chunk(lines, &log, tag), &never).unwrap();
        }
        p.flush_filters(true, &never).unwrap();
        p.close_batch(&never).unwrap();
        assert_eq!((p.stats.read, p.stats.filtered), (5, 2));
        let (_, batch) = spool.first_pending().unwrap().unwrap();
        let tags = def().field_index("tags").unwrap();
        let values: Vec<(schemas::Value, schemas::Value)> = batch
            .records(&def())
            .unwrap()
            .into_iter()
            .map(|r| (r.record.values[3].clone(), r.record.values[tags].clone()))
            .collect();
        let site = schemas::Value::Map(vec![("site".into(), schemas::Value::Str("a".into()))]);
        let kept = [1.0, 5.0, 5.1].map(|v| (schemas::Value::Float(v), site.clone()));
        assert_eq!(values, kept, "{encoding:?}");
        if encoding == BodyEncoding::Ndjson {
            let body = zstd::bulk::decompress(&batch.body, 1 << 20).unwrap();
            let expected = [at(0, "1.0"), at(2, "5.0"), at(4, "5.1")].join("\n") + "\n";
            assert_eq!(String::from_utf8(body).unwrap(), expected);
        }
    }
}

/// A stop (every source gone) emits the downsample windows still open, before the last batch
/// closes: a window's readings are acknowledged upstream as they arrive, so a stop that did not
/// emit it would lose them.
/// A pipeline (batches of up to 100 records) whose one filter takes the mean `value` per
/// series and minute.
fn downsampling(dir: &Path, encoding: BodyEncoding) -> (Pipeline, Arc<Spool>) {
    let filter = serde_json::from_value(serde_json::json!(
        {"type": "downsample", "window_secs": 60, "aggregate": "mean", "field": "value"}
    ))
    .unwrap();
    let settings = StreamSettings {
        filters: vec![filter],
        ..StreamSettings::default()
    };
    pipeline_with(dir, encoding, 100, 1 << 24, &settings)
}

#[test]
fn a_stop_emits_the_open_downsample_windows() {
    let dir = tempfile::tempdir().unwrap();
    let (p, spool) = downsampling(dir.path(), BodyEncoding::Ndjson);
    // Three series (d0, d1, d2), two readings each, all in one minute.
    let lines: Vec<String> = (0..6).map(line).collect();
    let log = Arc::new(Mutex::new(Vec::new()));
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    tx.send(chunk(&lines, &log, 0)).unwrap();
    drop(tx);
    let stats = p.run(rx, &AtomicBool::new(false)).unwrap();
    assert_eq!((stats.read, stats.filtered, stats.batched), (6, 3, 3));
    assert_eq!(log.lock().unwrap().len(), 1, "the chunk's callback fired");
    let (_, batch) = spool.first_pending().unwrap().unwrap();
    let mut means: Vec<(String, f64)> = batch
        .records(&def())
        .unwrap()
        .iter()
        .map(|r| match (&r.record.values[0], &r.record.values[3]) {
            (schemas::Value::Str(device), schemas::Value::Float(v)) => (device.to_string(), *v),
            other => panic!("{other:?}"),
        })
        .collect();
    means.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        means,
        [("d0".into(), 2.0), ("d1".into(), 3.0), ("d2".into(), 4.0)]
    );
}

/// The definition's file gains a field, put first so that the other fields move: the open
/// downsample windows go out under the old definition, the filters start over under the new
/// one, and the record that set the field is batched, not skipped. An incompatible edit after it
/// is refused when a record needs it, and that record is skipped as invalid.
#[test]
fn a_changed_definition_is_taken_when_a_record_needs_it() {
    let dir = tempfile::tempdir().unwrap();
    let file = shipped_file(dir.path());
    let (p, spool) = downsampling(dir.path(), BodyEncoding::Parquet);
    let mut p = p.follow_definition(DefinitionFile::new(dir.path(), "sensor_readings"));
    let current = p.current();
    let never = AtomicBool::new(false);
    let log = Arc::new(Mutex::new(Vec::new()));
    let lines: Vec<String> = (0..6).map(line).collect();
    p.push_chunk(chunk(&lines, &log, 0), &never).unwrap();

    let humid = humidity_first();
    std::fs::write(&file, &humid).unwrap();
    let set = r#"{"device_id":"d0","sensor":"s","ts":1700000000100,"value":8.5,"humidity":40.5}"#;
    p.push_chunk(chunk(&[set.to_owned()], &log, 1), &never)
        .unwrap();
    assert_eq!(p.stats.invalid, 0);
    assert!(current.get().field_index("humidity").is_some());

    // `quality` retyped and `site` added: refused at the first record that sets `site`.
    let retyped = format!("{humid}\n[[fields]]\nname = \"site\"\ntype = \"string\"\n")
        .replace("type = \"int64\"", "type = \"string\"");
    std::fs::write(&file, retyped).unwrap();
    let sited = r#"{"device_id":"d0","sensor":"s","ts":1700000000200,"value":1.5,"site":"a"}"#;
    p.push_chunk(chunk(&[sited.to_owned()], &log, 2), &never)
        .unwrap();
    assert_eq!(p.stats.invalid, 1);
    assert!(current.get().field_index("site").is_none());
    assert!(p.refused);
    // Mended (the `humidity` definition again): the refusal ends without another record.
    std::fs::write(&file, &humid).unwrap();
    p.recheck_refused(&never).unwrap();
    assert!(!p.refused);
    p.flush_filters(true, &never).unwrap();
    p.close_batch(&never).unwrap();

    // The three windows of the old definition, then the new record's window alone.
    let (seq, first) = spool.first_pending().unwrap().unwrap();
    let mut means: Vec<f64> = first
        .records(&def())
        .unwrap()
        .iter()
        .map(|r| match r.record.values[3] {
            schemas::Value::Float(v) => v,
            ref other => panic!("{other:?}"),
        })
        .collect();
    means.sort_by(f64::total_cmp);
    assert_eq!(means, [2.0, 3.0, 4.0]);
    spool.ack(seq).unwrap();
    let (_, second) = spool.first_pending().unwrap().unwrap();
    let records = second.records(&current.get()).unwrap();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].record.values[0], schemas::Value::Float(40.5));
}

/// Records skipped as invalid are kept, and when a record makes the pipeline take a compatible
/// change they are tried again under it: those that pass now are batched (once: a second try
/// finds them in the dedupe window), and those that still do not stay kept. Before, they were
/// counted and lost.
#[test]
fn kept_invalid_records_pass_once_the_definition_takes_them() {
    let dir = tempfile::tempdir().unwrap();
    let file = shipped_file(dir.path());
    let (p, spool) = pipeline(dir.path(), BodyEncoding::Ndjson, 1000);
    let kept = KeptInvalid::open(&dir.path().join("invalid"), "sensor_readings", 1 << 20).unwrap();
    let mut p = p
        .follow_definition(DefinitionFile::new(dir.path(), "sensor_readings"))
        .keep_invalid(kept);
    let never = AtomicBool::new(false);
    let log = Arc::new(Mutex::new(Vec::new()));
    let humid = |i: usize| {
        format!(
            r#"{{"device_id":"d0","sensor":"s","ts":{},"value":1.5,"humidity":{i}.5}}"#,
            1_700_000_000_000u64 + i as u64
        )
    };
    let mut first: Vec<String> = (0..5).map(humid).collect();
    first.push("{oops".to_owned());
    p.push_chunk(chunk(&first, &log, 0), &never).unwrap();
    p.close_batch(&never).unwrap();
    p.sync(true).unwrap();
    assert_eq!((p.stats.invalid, p.stats.batched), (6, 0));
    assert_eq!(log.lock().unwrap().len(), 1, "acknowledged once kept");

    std::fs::write(&file, humidity_first()).unwrap();
    p.push_chunk(chunk(&[humid(5)], &log, 1), &never).unwrap();
    p.close_batch(&never).unwrap();
    p.sync(true).unwrap();
    assert_eq!((p.stats.retried, p.stats.batched), (5, 6));
    // A second try (the next start) finds the garbage only, and the window drops repeats.
    p.kept
        .as_mut()
        .unwrap()
        .keep(humid(0).as_bytes(), "again", 0);
    p.retry_kept(&never).unwrap();
    assert_eq!((p.stats.retried, p.stats.batched), (6, 6));
    let current = p.current().get();
    let mut values = Vec::new();
    while let Some((seq, batch)) = spool.first_pending().unwrap() {
        for r in batch.records(&current).unwrap() {
            values.push(r.record.values[current.field_index("humidity").unwrap()].clone());
        }
        spool.ack(seq).unwrap();
    }
    let mut values: Vec<f64> = values
        .into_iter()
        .map(|v| match v {
            schemas::Value::Float(f) => f,
            other => panic!("{other:?}"),
        })
        .collect();
    values.sort_by(f64::total_cmp);
    assert_eq!(values, [0.5, 1.5, 2.5, 3.5, 4.5, 5.5]);
    let left: Vec<crate::invalid::Kept> = p.kept.as_mut().unwrap().take().unwrap().collect();
    assert_eq!(left.len(), 1, "{left:?}");
    assert_eq!(left[0].bytes(), b"{oops");
}

/// Many kept records go back in chunks of [`RETRY_CHUNK_BYTES`], every one of them.
#[test]
fn a_large_kept_file_is_tried_in_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let file = shipped_file(dir.path());
    let (p, _spool) = pipeline(dir.path(), BodyEncoding::Ndjson, 50_000);
    let mut kept =
        KeptInvalid::open(&dir.path().join("invalid"), "sensor_readings", 1 << 24).unwrap();
    let lines: Vec<String> = (0..5000)
        .map(|i| {
            format!(
                r#"{{"device_id":"d{}","sensor":"s","ts":{},"value":1.5,"humidity":{i}.5}}"#,
                i % 7,
                1_700_000_000_000u64 + i as u64
            )
        })
        .collect();
    for line in &lines {
        assert!(kept.keep(line.as_bytes(), "field 'humidity' unknown", 0));
    }
    assert!(kept.bytes() > 2 * RETRY_CHUNK_BYTES as u64);
    kept.sync().unwrap();
    std::fs::write(&file, humidity_first()).unwrap();
    let mut p = p
        .follow_definition(DefinitionFile::new(dir.path(), "sensor_readings"))
        .keep_invalid(kept);
    let never = AtomicBool::new(false);
    // What a record that needs the new definition does: read the file, take the change.
    p.redefine(&never).unwrap();
    assert_eq!((p.stats.retried, p.stats.batched), (5000, 5000));
    assert!(!p.kept.as_ref().unwrap().any());
}

/// A chunk of invalid lines only is acknowledged at once (nothing to spool), and its lines are
/// kept before that: the callback finds them in the file. Before, they were still in the
/// keeper's buffer when the chunk was acknowledged, and a crash then lost them.
#[test]
fn invalid_lines_are_kept_before_their_chunk_is_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let (p, _spool) = pipeline(dir.path(), BodyEncoding::Ndjson, 1000);
    let invalid = dir.path().join("invalid");
    let kept = KeptInvalid::open(&invalid, "sensor_readings", 1 << 20).unwrap();
    let mut p = p.keep_invalid(kept);
    let seen = Arc::new(Mutex::new(None));
    let file = invalid.join("sensor_readings.ndjson");
    let done: Done = {
        let seen = seen.clone();
        Box::new(move |_| {
            *seen.lock().unwrap() = Some(std::fs::read_to_string(&file).unwrap_or_default());
        })
    };
    let never = AtomicBool::new(false);
    p.push_chunk(Chunk::new(b"{oops\n[1]\n".to_vec(), Some(done)), &never)
        .unwrap();
    let seen = seen.lock().unwrap().clone().expect("acknowledged");
    assert_eq!(seen.lines().count(), 2, "{seen:?}");
}

/// The buffer of a chunk that a line source read into goes back to the source's spares once the
/// pipeline has taken its lines, and the source's next chunk is read into it.
#[test]
fn chunk_buffers_go_back_to_their_source() {
    let dir = tempfile::tempdir().unwrap();
    let (mut p, _spool) = pipeline(dir.path(), BodyEncoding::Ndjson, 4);
    let spares = Spares::default();
    let mut data = Vec::with_capacity(4096);
    data.extend_from_slice((line(0) + "\n" + &line(1) + "\n").as_bytes());
    let at = data.as_ptr();
    let chunk = Chunk::recycled(data, None, spares.clone());
    p.push_chunk(chunk, &AtomicBool::new(false)).unwrap();
    assert_eq!(p.stats.read, 2);
    let again = spares.take(4096);
    assert_eq!((again.as_ptr(), again.len()), (at, 4096));
    // Nothing more was kept: the next buffer is a new one.
    let new = spares.take(4096);
    assert_ne!(new.as_ptr(), at);
}
