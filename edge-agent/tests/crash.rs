//! The agent process killed with SIGKILL at random points while it reads, spools and delivers to
//! a gateway that fails, times out and answers 429: nothing is lost, nothing lands twice.

mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rand::Rng;
use support::{Faults, Stub, assert_exactly_once, config, readings};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_random_points_loses_nothing_and_lands_nothing_twice() {
    let stub = Stub::start(Faults {
        unavailable: 10,
        too_many: 3,
        slow: 4,
        slow_for: Duration::from_millis(1500),
        ..Faults::default()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    // 60,000 distinct readings and 12,000 re-sent ones.
    let (lines, expected) = readings(60_000, 40, 5, 1);
    let input = dir.path().join("readings.ndjson");
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let cfg = dir.path().join("agent.toml");
    std::fs::write(
        &cfg,
        config(
            &dir.path().join("state"),
            &stub.url(),
            "[batch]\nmax_records = 400\nmax_age_ms = 100\n",
            &format!(
                "[[sources]]\ntype = \"file\"\npath = {input:?}\nstream = \"sensor_readings\"\n"
            ),
        ),
    )
    .unwrap();
    let mut rng = rand::rng();
    let mut kills = 0;
    let mut runs = 0;
    loop {
        runs += 1;
        let log = std::fs::File::create(dir.path().join(format!("agent-{runs}.log"))).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_edge-agent"))
            .args(["run", "--config"])
            .arg(&cfg)
            .env("RUST_LOG", "edge_agent=info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_millis(rng.random_range(300..2500));
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            if kills < 6 && Instant::now() > deadline {
                break None;
            }
            assert!(runs < 40, "the agent never finished");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        match status {
            Some(status) => {
                let log =
                    std::fs::read_to_string(dir.path().join(format!("agent-{runs}.log"))).unwrap();
                assert!(status.success(), "agent failed: {status}\n{log}");
                break;
            }
            None => {
                child.kill().unwrap();
                child.wait().unwrap();
                kills += 1;
            }
        }
    }
    assert!(
        kills >= 3,
        "only {kills} kills: the run was too short to test anything"
    );
    let recorded = stub.recorded.lock().unwrap();
    eprintln!(
        "{kills} kills over {runs} runs; {} requests, {} replayed by Idempotency-Key",
        recorded.requests, recorded.replays
    );
    drop(recorded);
    assert_exactly_once(&stub.landed(), &expected);
}
