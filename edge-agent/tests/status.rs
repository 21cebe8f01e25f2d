//! `edge-agent status` (and the admin port's `/status`) while the agent runs: what waits in the
//! spool for a gateway that answers 503, and nothing once it takes the batches; the file
//! source's read position.

mod support;

use std::time::{Duration, Instant};

use support::{
    Faults, Stub, assert_exactly_once, config_with_root, file_source_toml, free_port, readings,
    start, wait_landed,
};

/// The status of the agent configured in `cfg` (a file), from the edge-agent binary.
fn status_json(cfg: &std::path::Path) -> serde_json::Value {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_edge-agent"))
        .args(["status", "--json", "--config"])
        .arg(cfg)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn waiting(status: &serde_json::Value) -> (u64, u64) {
    let spool = &status["streams"][0]["spool"];
    (
        spool["batches"].as_u64().unwrap(),
        spool["records"].as_u64().unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_what_waits_while_the_agent_runs() {
    let stub = Stub::start(Faults {
        unavailable: 100,
        ..Faults::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let (lines, expected) = readings(500, 5, 0, 47);
    let input = dir.path().join("r.ndjson");
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let cfg_path = dir.path().join("agent.toml");
    let admin = format!("127.0.0.1:{}", free_port());
    let cfg = config_with_root(
        &dir.path().join("state"),
        &stub.url(),
        &format!("admin_listen = \"{admin}\""),
        "[batch]\nmax_records = 100\n",
        &file_source_toml(&input, "follow = true\n"),
    );
    std::fs::write(&cfg_path, &cfg).unwrap();
    let (agent, shutdown) = start(&cfg);

    // Every reading spooled in 5 batches, none delivered, and the read position saved (every
    // second).
    let size = std::fs::metadata(&input).unwrap().len();
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        let status = status_json(&cfg_path);
        if waiting(&status) == (5, 500) && status["files"][0]["read_bytes"] == size {
            break status;
        }
        assert!(Instant::now() < deadline, "never spooled: {status:#}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(stub.landed_total(), 0);
    let stream = &status["streams"][0];
    assert_eq!(stream["stream"], "sensor_readings");
    assert_eq!(stream["rejected_batches"], 0);
    let oldest = stream["spool"]["oldest_created_ms"].as_u64().unwrap();
    assert!(oldest <= status["now_ms"].as_u64().unwrap());
    assert!(status["spool_bytes"].as_u64().unwrap() > 0);
    let file = &status["files"][0];
    assert_eq!(file["path"], input.to_str().unwrap());
    assert_eq!(file["read_bytes"], size);
    assert_eq!(file["size_bytes"], size);

    // The same from the admin port, for tooling where no Prometheus scrapes the box.
    let remote = reqwest::get(format!("http://{admin}/status"))
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    let remote: serde_json::Value = serde_json::from_slice(&remote).unwrap();
    assert_eq!(waiting(&remote), (5, 500), "{remote:#}");
    assert_eq!(remote["files"], status["files"]);

    // The table names the stream and its waiting records.
    let table = std::process::Command::new(env!("CARGO_BIN_EXE_edge-agent"))
        .args(["status", "--config"])
        .arg(&cfg_path)
        .output()
        .unwrap();
    let table = String::from_utf8(table.stdout).unwrap();
    let row = table
        .lines()
        .find(|l| l.starts_with("sensor_readings"))
        .unwrap_or_else(|| panic!("no stream row:\n{table}"));
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cells[1..3], ["5", "500"], "{table}");

    stub.set_faults(Faults::default());
    wait_landed(&stub, expected.len()).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while waiting(&status_json(&cfg_path)) != (0, 0) {
        assert!(
            Instant::now() < deadline,
            "delivered batches still shown as waiting"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shutdown.cancel();
    agent.await.unwrap().unwrap();
    assert_exactly_once(&stub.landed(), &expected);
}

/// A swinging-door filter's reduction report, in `/status` and `edge-agent status` while the
/// agent runs and after it stops: readings in, readings kept (what the gateway got), the band
/// and the largest deviation of a dropped reading, within it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reports_what_the_filters_reduced() {
    let stub = Stub::start(Faults::default()).await;
    let dir = tempfile::tempdir().unwrap();
    // A slow oscillation with a little noise, a reading a second.
    let lines: Vec<String> = (0..2_000)
        .map(|i| {
            let noise = if i % 2 == 0 { 0.05 } else { -0.05 };
            serde_json::json!({
                "device_id": "d1",
                "sensor": "temp",
                "ts": 1_700_000_000_000i64 + i * 1_000,
                "value": 20.0 + 5.0 * (i as f64 / 100.0).sin() + noise,
            })
            .to_string()
        })
        .collect();
    let input = dir.path().join("r.ndjson");
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let cfg_path = dir.path().join("agent.toml");
    let admin = format!("127.0.0.1:{}", free_port());
    let cfg = config_with_root(
        &dir.path().join("state"),
        &stub.url(),
        &format!("admin_listen = \"{admin}\""),
        "[batch]\nmax_records = 100\nmax_age_ms = 200\n\
         [[streams.sensor_readings.filters]]\ntype = \"swinging_door\"\nfield = \"value\"\nabsolute = 0.5\n",
        &file_source_toml(&input, "follow = true\n"),
    );
    std::fs::write(&cfg_path, &cfg).unwrap();
    let (agent, shutdown) = start(&cfg);

    let reduction =
        |status: &serde_json::Value| status["streams"][0]["reduction"]["filters"][0].clone();
    let deadline = Instant::now() + Duration::from_secs(30);
    let report = loop {
        // (The admin port opens once the agent is up.)
        let remote = match reqwest::get(format!("http://{admin}/status")).await {
            Ok(answer) => serde_json::from_slice(&answer.bytes().await.unwrap()).unwrap(),
            Err(_) => serde_json::Value::Null,
        };
        let r = reduction(&remote);
        if r["readings_in"] == 2_000 && r["kept"].as_u64() == Some(stub.landed_total() as u64) {
            break r;
        }
        assert!(
            Instant::now() < deadline,
            "no report of every reading ({} landed; state: {:?}): {remote:#}",
            stub.landed_total(),
            std::fs::read_dir(dir.path().join("state"))
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(report["filter"], "swinging_door");
    assert_eq!(report["band"], 0.5);
    let kept = report["kept"].as_u64().unwrap();
    assert!((2..200).contains(&kept), "kept {kept} of 2,000");
    let deviation = report["max_deviation"].as_f64().unwrap();
    assert!(deviation > 0.0 && deviation <= 0.5, "{deviation}");
    // The same from the state directory, and in the table.
    assert_eq!(reduction(&status_json(&cfg_path)), report);
    let table = std::process::Command::new(env!("CARGO_BIN_EXE_edge-agent"))
        .args(["status", "--config"])
        .arg(&cfg_path)
        .output()
        .unwrap();
    let table = String::from_utf8(table.stdout).unwrap();
    assert!(
        table.contains(&format!(
            "filter swinging_door: 2000 readings in, {kept} kept ({:.1}%); largest deviation {deviation} of band 0.5",
            100.0 * kept as f64 / 2000.0
        )),
        "{table}"
    );

    // Stopped, the series' held last reading is sent, and the report says so.
    shutdown.cancel();
    agent.await.unwrap().unwrap();
    let last = reduction(&status_json(&cfg_path));
    assert_eq!(last["kept"], kept + 1, "{last:#}");
}
