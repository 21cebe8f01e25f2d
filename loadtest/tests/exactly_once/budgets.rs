//! The memory and staging budgets, dead-letter ranges, and stops while uploads fail.

use super::*;

/// 400 records over 4 partitions with a memory budget of 8 kB: open files write their row
/// groups early instead of holding them, and files still close only by rotation (here: at
/// shutdown, one per partition).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_budget_spills_row_groups_not_small_files() {
    let run = land_with_budgets(400, "budget", |c| c.memory_budget_bytes = 8_000).await;
    assert_eq!(run.early_files, 0);
    assert_eq!(run.landed.files.len(), 4, "one file per partition");
    let spilled = run.stats.spilled_row_groups.load(Ordering::Relaxed);
    assert!(spilled >= 5, "row groups written early: {spilled}");
    let row_groups: usize = run.landed.files.iter().map(|f| f.row_groups).sum();
    assert!(row_groups > 4, "{row_groups} row groups in 4 files");
}

/// 2,000 records over 4 partitions with a memory budget of 8 kB (open files write their row
/// groups to disk early) and a staging budget of 20 kB: whenever the staged files together pass
/// it, the file with the most on disk closes early. With the memory budget alone, the files
/// grow on disk until rotation: the disk was not bounded. Every record lands once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staging_budget_closes_the_file_with_the_most_on_disk() {
    let run = land_with_budgets(2_000, "staging-budget", |c| {
        c.memory_budget_bytes = 8_000;
        c.upload.staging_budget_bytes = 20_000;
    })
    .await;
    let sizes: Vec<u64> = run.landed.files.iter().map(|f| f.size).collect();
    let early = run.early_files;
    eprintln!("{early} files before the stop; sizes {sizes:?}");
    assert!(
        early >= 4,
        "only {early} files closed by the staging budget"
    );
    assert!(
        sizes.iter().all(|&s| s < 40_000),
        "a file of twice the budget: {sizes:?}"
    );
}

/// What [`land_with_budgets`] saw.
struct BudgetRun {
    /// Files written before the stop.
    early_files: u64,
    stats: std::sync::Arc<sink::SinkStats>,
    landed: Landed,
}

/// Sends `n` distinct readings over 4 partitions and lands them (each exactly once, checked)
/// with a local sink whose budgets `budgets` sets; records, bytes and idle time close no file
/// within the test, which does not cross an ingest-hour boundary either.
async fn land_with_budgets(
    n: usize,
    group: &str,
    budgets: impl FnOnce(&mut SinkConfig),
) -> BudgetRun {
    clear_of_an_hour_boundary(Duration::from_secs(60)).await;
    let streams = schemas::example_streams();
    let (cluster, producer) = mock_cluster(4);
    let readings = distinct_readings(n);
    for r in &readings {
        send_plain(&producer, r["device_id"].as_str().unwrap(), &r.to_string()).await;
    }
    let landing = tempfile::tempdir().unwrap();
    let shutdown = CancellationToken::new();
    let mut config = local_sink(
        &cluster,
        landing.path(),
        group,
        RotationConfig {
            idle_ms: 600_000,
            ..RotationConfig::default()
        },
    );
    budgets(&mut config);
    let sink = sink::start(config, streams, shutdown.clone())
        .await
        .unwrap();
    wait_received(&sink, n as u64).await;
    let early_files = sink.stats.files_written.load(Ordering::Relaxed);
    shutdown.cancel();
    sink.task.await.unwrap().unwrap();
    let landed = assert_exactly_once(&readings, landing.path());
    drop(cluster);
    BudgetRun {
        early_files,
        stats: sink.stats,
        landed,
    }
}

/// A producer writing garbage to a busy partition: the dead letters a range holds in memory
/// close it (file and dead-letter object) at `rotation.max_dead_letter_bytes`, or when they are
/// most of what the partition over the memory budget holds, instead of growing until the
/// partition goes idle or the hour ends. Every reading lands once and every dead letter is
/// written once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_close_their_range_by_size_and_budget() {
    clear_of_an_hour_boundary(Duration::from_secs(60)).await;
    for by_budget in [false, true] {
        dead_letter_flood(by_budget).await;
    }
}

async fn dead_letter_flood(by_budget: bool) {
    let streams = schemas::example_streams();
    let (cluster, producer) = mock_cluster(1);
    let readings = distinct_readings(200);
    for (i, r) in readings.iter().enumerate() {
        let garbage = format!("garbage {i}: not the JSON of a reading at all");
        for value in [r.to_string(), garbage] {
            send_plain(&producer, "k", &value).await;
        }
    }
    let landing = tempfile::tempdir().unwrap();
    let shutdown = CancellationToken::new();
    // No idle period, age or size target closes a range within this test.
    let mut config = local_sink(
        &cluster,
        landing.path(),
        "dead-letters",
        RotationConfig {
            idle_ms: 600_000,
            max_dead_letter_bytes: if by_budget { 1 << 30 } else { 8_000 },
            ..RotationConfig::default()
        },
    );
    if by_budget {
        config.memory_budget_bytes = 8_000;
    }
    let sink = sink::start(config, streams.clone(), shutdown.clone())
        .await
        .unwrap();
    wait_received(&sink, 400).await;
    let dead_dir = landing.path().join("landing/_dead_letters");
    let objects = || {
        if dead_dir.exists() {
            walk(&dead_dir)
        } else {
            Vec::new()
        }
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while objects().len() < 3 {
        assert!(
            Instant::now() < deadline,
            "budget {by_budget}: {} dead-letter objects while the sink runs",
            objects().len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shutdown.cancel();
    sink.task.await.unwrap().unwrap();
    assert!(sink.stats.files_written.load(Ordering::Relaxed) >= 3);
    let mut offsets = Vec::new();
    for object in objects() {
        let text = std::fs::read_to_string(&object).unwrap();
        if !by_budget {
            assert!(text.len() < 8_000 + 400, "{} bytes", text.len());
        }
        for line in text.lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            offsets.push(v["offset"].as_i64().unwrap());
        }
    }
    offsets.sort_unstable();
    let garbage: Vec<i64> = (0..200).map(|i| 2 * i + 1).collect();
    assert_eq!(offsets, garbage, "every dead letter once");
    assert_exactly_once(&readings, landing.path());
    drop(cluster);
}

/// A sink stopped while its upload fails, after it wrote the range's dead letters (the landing
/// folder cannot be written, so the upload is retried until the stop; a crash there leaves the
/// same). It commits nothing: before, the stop's own flush took the range whose file it had
/// given up for one of skipped records only and committed past it, and its readings were lost.
/// The next sink reads the range again with other rotation settings, so its range ends
/// elsewhere (here: later). It finds the dead-letter object at the key of the first dead
/// letter, drops the dead letters that object holds and writes only the rest. Every dead letter
/// is written once and every reading lands once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_while_uploads_fail_loses_nothing_and_writes_dead_letters_once() {
    stop_while_uploads_fail(1_000).await;
}

/// As above, with the next sink's first range ending inside the dead-letter object it finds:
/// the dead letters after that range's end that the object holds are not written again when
/// they arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_a_found_object_holds_are_skipped_past_the_range() {
    stop_while_uploads_fail(20).await;
}

/// Records and dead letters through a sink stopped while its uploads fail (ranges of 40 rows),
/// then a sink with ranges of `second_records` rows.
async fn stop_while_uploads_fail(second_records: usize) {
    clear_of_an_hour_boundary(Duration::from_secs(60)).await;
    let (cluster, producer) = mock_cluster(1);
    let readings = distinct_readings(120);
    let mut garbage = Vec::new();
    send_with_garbage(&producer, &readings, 0, &mut garbage).await;
    let landing = tempfile::tempdir().unwrap();
    // A file where the stream's landing folder goes: landing files cannot be written there,
    // dead letters (under `_dead_letters/`) can.
    let blocker = landing.path().join("landing/sensor_readings");
    std::fs::create_dir_all(blocker.parent().unwrap()).unwrap();
    std::fs::write(&blocker, b"not a folder").unwrap();
    let rotation = |max_records| RotationConfig {
        idle_ms: 300,
        max_records,
        ..RotationConfig::default()
    };

    let (first, shutdown) =
        start_local_sink(&cluster, landing.path(), "dead-crash", rotation(40)).await;
    wait_for("dead letters, then a failing upload", 30, || {
        first.stats.store_failing.load(Ordering::Relaxed)
            && !dead_letter_offsets(landing.path()).is_empty()
    })
    .await;
    shutdown.cancel();
    first.task.await.unwrap().unwrap();
    assert_eq!(first.stats.files_written.load(Ordering::Relaxed), 0);
    assert_eq!(
        committed(&cluster, "dead-crash", 0),
        None,
        "committed while nothing landed"
    );
    let before = dead_letter_offsets(landing.path());
    assert!(before.len() < garbage.len(), "{before:?}");

    std::fs::remove_file(&blocker).unwrap();
    let (second, shutdown) = start_local_sink(
        &cluster,
        landing.path(),
        "dead-crash",
        rotation(second_records),
    )
    .await;
    wait_written(&second, readings.len() as u64).await;
    shutdown.cancel();
    second.task.await.unwrap().unwrap();
    assert_eq!(
        dead_letter_offsets(landing.path()),
        garbage,
        "every dead letter once"
    );
    assert_eq!(
        second
            .stats
            .adopted_dead_letter_objects
            .load(Ordering::Relaxed),
        1
    );
    assert_exactly_once(&readings, landing.path());
    drop(cluster);
}

/// A sink stopped (or crashed) after it wrote dead letters through offset 44 but before their
/// range's file; the partition holds only 30 records when the next sink reads it, so that
/// sink's range ends inside the object it finds. The range does not close before the object's
/// last offset: closing it there, its commit would start the next reader of the partition
/// inside the object, where the key of the next dead letter names no object, and those dead
/// letters would be written twice. Here the second sink stops before the rest is produced and
/// commits nothing; a third reads everything and lands it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_ending_inside_a_found_dead_letter_object_waits_past_it() {
    clear_of_an_hour_boundary(Duration::from_secs(60)).await;
    let streams = schemas::example_streams();
    let def = streams.get("sensor_readings").unwrap().clone();
    let (cluster, producer) = mock_cluster(1);
    let readings = distinct_readings(120);
    let mut garbage = Vec::new();
    send_with_garbage(&producer, &readings[..24], 0, &mut garbage).await;
    assert_eq!(garbage, [4, 9, 14, 19, 24, 29]);

    // The crashed sink's dead letters: offsets 4 to 44, the object named after the first.
    let mut crashed = sink::partition::PartitionState::new(def, TOPIC.into(), 0, 10);
    for (i, offset) in (4..=44).step_by(5).enumerate() {
        let payload = format!("garbage after reading {}", 4 * i + 3);
        crashed.dead_letter(offset, now_micros(), "malformed JSON", payload.as_bytes());
    }
    let landing = tempfile::tempdir().unwrap();
    let store = ObjectStore::Local(landing.path().to_path_buf());
    let key = sink::parquet_file::dead_letter_key("landing", "sensor_readings", now_micros(), 0, 4);
    let text = bytes::Bytes::copy_from_slice(crashed.dead.text());
    assert_eq!(
        store.put_if_absent(&key, text).await.unwrap(),
        PutOutcome::Created
    );

    let run = |until: u64| {
        let config = local_sink(
            &cluster,
            landing.path(),
            "inside",
            RotationConfig {
                idle_ms: 300,
                max_records: 20,
                ..RotationConfig::default()
            },
        );
        let streams = streams.clone();
        async move {
            let shutdown = CancellationToken::new();
            let sink = sink::start(config, streams, shutdown.clone())
                .await
                .unwrap();
            wait_received(&sink, until).await;
            // Idle periods pass: a range that may close would.
            tokio::time::sleep(Duration::from_millis(1_200)).await;
            shutdown.cancel();
            sink.task.await.unwrap().unwrap();
            sink.stats
        }
    };
    let second = run(30).await;
    assert_eq!(
        second.adopted_dead_letter_objects.load(Ordering::Relaxed),
        1
    );
    assert_eq!(second.files_written.load(Ordering::Relaxed), 0);
    assert_eq!(committed(&cluster, "inside", 0), None);

    send_with_garbage(&producer, &readings, 24, &mut garbage).await;
    run(150).await;
    assert_eq!(
        dead_letter_offsets(landing.path()),
        garbage,
        "every dead letter once"
    );
    assert_exactly_once(&readings, landing.path());
    drop(cluster);
}

/// The offsets of the dead letters in a local landing zone, in order (repeats kept).
fn dead_letter_offsets(landing: &std::path::Path) -> Vec<i64> {
    let dir = landing.join("landing/_dead_letters");
    let mut offsets = Vec::new();
    if !dir.exists() {
        return offsets;
    }
    // Not the temporary files of objects being written.
    let objects = walk(&dir).into_iter().filter(|p| {
        !p.file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with('.'))
    });
    for object in objects {
        for line in std::fs::read_to_string(&object).unwrap().lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            offsets.push(v["offset"].as_i64().unwrap());
        }
    }
    offsets.sort_unstable();
    offsets
}
