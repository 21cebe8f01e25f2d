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
