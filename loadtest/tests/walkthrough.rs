//! The README's "Running against real services" walk-through, run as written against the test
//! services: its commands in order, with the suite's broker (`EDGE_INGEST_KAFKA`, as the page
//! says), free ports, topics of this run's own and a shorter idle time for the sink's files
//! given by the environment, and the debug builds of the binaries in place of the release ones.

use crate::common;

use std::time::Duration;

/// The commands of the first `sh` block after the heading `## Running against real services`.
fn walkthrough(readme: &str) -> Vec<String> {
    let section = readme
        .split("\n## Running against real services\n")
        .nth(1)
        .expect("the README has no real-services walk-through");
    let block = section
        .split("```sh\n")
        .nth(1)
        .and_then(|b| b.split("\n```").next())
        .expect("the walk-through has no sh block");
    block.lines().map(str::to_owned).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readmes_real_services_walkthrough_lands_every_reading_once() {
    let kafka = common::service_env("EDGE_INGEST_KAFKA");
    let root = common::repo_root();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let commands = walkthrough(&readme);
    // The suite's services run already; the binaries are built by this test (debug).
    let mut script = vec!["trap 'kill $(jobs -p) 2>/dev/null' EXIT".to_owned()];
    for line in &commands {
        if line.starts_with("scripts/services.sh ") || line == "cargo build --release" {
            continue;
        }
        let line = line
            .replace("; scripts/services.sh stop /tmp/edge-ingest-services", "")
            .replace("target/release/", "$BIN/");
        script.push(line);
    }
    assert!(
        script.iter().any(|l| l.contains("loadtest verify")),
        "{commands:?}"
    );
    let built = std::process::Command::new(env!("CARGO"))
        .args([
            "build",
            "-p",
            "edge-agent",
            "-p",
            "ingest-gateway",
            "-p",
            "sink",
            "--bins",
        ])
        .current_dir(&root)
        .status()
        .unwrap();
    assert!(built.success());
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_loadtest"))
        .parent()
        .unwrap()
        .to_path_buf();

    // The walk-through's working directory: the repository's configs and stream definitions.
    let dir = tempfile::tempdir().unwrap();
    for name in ["config", "streams"] {
        std::os::unix::fs::symlink(root.join(name), dir.path().join(name)).unwrap();
    }
    let (gateway, sink_admin, agent_admin) = (
        common::free_port(),
        common::free_port(),
        common::free_port(),
    );
    let prefix = format!("walkthrough-{}.", common::unique_id());
    let out = tokio::time::timeout(
        Duration::from_secs(600),
        tokio::process::Command::new("bash")
            .args(["-euo", "pipefail", "-c", &script.join("\n")])
            .current_dir(dir.path())
            .env("BIN", &bin)
            .env("EDGE_INGEST_KAFKA", &kafka)
            .env("INGEST_GATEWAY_LISTEN", format!("127.0.0.1:{gateway}"))
            .env("INGEST_GATEWAY_KAFKA__TOPIC_PREFIX", &prefix)
            .env("SINK_KAFKA__TOPIC_PREFIX", &prefix)
            .env("SINK_ADMIN_LISTEN", format!("127.0.0.1:{sink_admin}"))
            .env("SINK_ROTATION__IDLE_MS", "2000")
            .env(
                "EDGE_AGENT_GATEWAY__URL",
                format!("http://127.0.0.1:{gateway}"),
            )
            .env(
                "EDGE_AGENT_ADMIN_LISTEN",
                format!("127.0.0.1:{agent_admin}"),
            )
            .env("RUST_LOG", "warn")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the walk-through did not finish in 10 minutes")
    .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // verify's report: every distinct reading of the generated file landed once.
    let report: serde_json::Value = serde_json::from_str(
        &stdout[stdout.find('{').expect("no report")..stdout.rfind('}').unwrap() + 1],
    )
    .unwrap();
    assert_eq!(report["passed"], true, "{report}");
    assert_eq!(report["sent_lines"], 100_000, "{report}");
    assert_eq!(report["missing"], 0, "{report}");
    assert_eq!(report["duplicated"], 0, "{report}");
    assert!(report["expected"].as_u64().unwrap() > 50_000, "{report}");
}
