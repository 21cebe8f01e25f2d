//! The shipped systemd unit (`deploy/systemd/edge-agent.service`): `systemd-analyze verify`
//! finds nothing wrong with it, `systemd-analyze security` rates its hardening as the agent's
//! chapter of the docs says, and the environment it sets reaches the agent's config.

use crate::support;

use std::path::Path;
use std::process::Command;

use support::service_env;

const UNIT: &str = "edge-agent.service";

/// The unit with its `/usr/local/bin/edge-agent` replaced by the binary under test, in `dir`.
fn unit_in(dir: &Path) -> (String, std::path::PathBuf) {
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/systemd")
        .join(UNIT);
    let text = std::fs::read_to_string(shipped).unwrap().replace(
        "/usr/local/bin/edge-agent",
        env!("CARGO_BIN_EXE_edge-agent"),
    );
    let path = dir.join(UNIT);
    std::fs::write(&path, &text).unwrap();
    (text, path)
}

fn analyze(args: &[&str], unit: &Path) -> (bool, String) {
    let out = Command::new(service_env("EDGE_INGEST_SYSTEMD_ANALYZE"))
        .args(args)
        .arg(unit)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn the_systemd_unit_verifies_and_is_hardened() {
    let dir = tempfile::tempdir().unwrap();
    let (text, unit) = unit_in(dir.path());
    // verify exits 0 on unknown keys too, but says so.
    let (ok, said) = analyze(&["verify"], &unit);
    assert!(ok && said.trim().is_empty(), "{said}");
    let (ok, said) = analyze(&["security", "--offline=yes"], &unit);
    assert!(ok, "{said}");
    let exposure: f64 = said
        .lines()
        .find_map(|l| {
            l.split_once("Overall exposure level for ")?
                .1
                .split_once(": ")
        })
        .and_then(|(_, level)| level.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no exposure level in:\n{said}"));
    assert!(exposure <= 3.5, "exposure {exposure}:\n{said}");
    // The streams directory it sets is the one the agent reads (an override of the config's).
    let streams = text
        .lines()
        .find_map(|l| l.strip_prefix("Environment=EDGE_AGENT_STREAMS_DIR="))
        .expect("the unit sets the streams directory");
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/edge-agent.toml");
    let out = Command::new(env!("CARGO_BIN_EXE_edge-agent"))
        .args(["check", "--config"])
        .arg(&config)
        .env("EDGE_AGENT_STREAMS_DIR", streams)
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && said.contains(streams),
        "check did not read {streams}: {said}"
    );
}
