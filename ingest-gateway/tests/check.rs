//! `ingest-gateway --check`: the shipped config is valid; a broken token, certificate or Kafka
//! setting is named, with a non-zero exit, and nothing connects or listens.

use crate::common;

/// Runs `ingest-gateway --check` on the shipped config with `env` overrides; returns whether
/// it passed and what it printed.
fn check(env: &[(&str, &str)]) -> (bool, String) {
    let args = ["--check", "--config", "config/ingest-gateway.toml"].map(std::ffi::OsStr::new);
    common::run_from_root(env!("CARGO_BIN_EXE_ingest-gateway"), &args, env)
}

#[test]
fn the_check_passes_the_shipped_config_and_names_what_is_wrong() {
    let (ok, text) = check(&[]);
    assert!(ok, "{text}");
    assert!(text.contains("configuration is valid: 2 streams"), "{text}");
    // The Kafka brokers of the shipped config are not running: the check does not connect.
    let cases: [(&[(&str, &str)], &str); 3] = [
        (
            &[
                ("INGEST_GATEWAY_TLS__CERT", "/nonexistent/cert.pem"),
                ("INGEST_GATEWAY_TLS__KEY", "/nonexistent/key.pem"),
            ],
            "/nonexistent/cert.pem",
        ),
        (
            &[(
                "INGEST_GATEWAY_KAFKA__SASL",
                "{ mechanism = \"PLAIN\", username = \"u\" }",
            )],
            "give one of kafka.sasl.password",
        ),
        (
            &[(
                "INGEST_GATEWAY_AUTH__TOKENS",
                "[{ name = \"site\", blake3 = \"not-hex\", streams = [\"*\"] }]",
            )],
            "auth.tokens 'site': blake3 must be 64 hex digits",
        ),
    ];
    for (env, expected) in cases {
        let (ok, text) = check(env);
        assert!(!ok && text.contains(expected), "{env:?}: {text}");
    }
}

/// `--check --compatible-with DIR`: the shipped definitions against an older set (without the
/// vehicle stream, without a field of the sensor stream) are compatible, and a retyped field is
/// named, with a non-zero exit.
#[test]
fn the_check_tells_whether_definitions_may_replace_those_in_force() {
    let running = tempfile::tempdir().unwrap();
    let shipped = common::repo_root().join("streams/sensor_readings.toml");
    let sensor = std::fs::read_to_string(shipped).unwrap();
    let without_tags = &sensor[..sensor.rfind("[[fields]]").unwrap()];
    assert!(!without_tags.contains("name = \"tags\""));
    let file = running.path().join("sensor_readings.toml");
    std::fs::write(&file, without_tags).unwrap();
    let dir = running.path().as_os_str();
    let args = [
        "--check",
        "--config",
        "config/ingest-gateway.toml",
        "--compatible-with",
    ]
    .map(std::ffi::OsStr::new);
    let with = |args: &[&std::ffi::OsStr]| {
        common::run_from_root(env!("CARGO_BIN_EXE_ingest-gateway"), args, &[])
    };
    let (ok, text) = with(&[&args[..], &[dir]].concat());
    assert!(ok, "{text}");
    assert!(
        text.contains("streams added [\"vehicle_telemetry\"], changed [\"sensor_readings\"]"),
        "{text}"
    );
    std::fs::write(
        &file,
        sensor.replace("type = \"int64\"", "type = \"float64\""),
    )
    .unwrap();
    let (ok, text) = with(&[&args[..], &[dir]].concat());
    assert!(!ok, "{text}");
    assert!(
        text.contains(
            "stream 'sensor_readings': field 'quality' changes type from float64 to int64"
        ),
        "{text}"
    );
}

/// Kubernetes sets variables for every Service of the namespace in every pod; those of a Service
/// named `ingest-gateway` begin with the gateway's prefix and name no key: they are left out. A
/// variable that names a key with a value that does not fit is a configuration error (exit
/// code 2), one JSON log event when the logs are JSON.
#[test]
fn kubernetes_service_variables_do_not_stop_the_gateway() {
    let (ok, text) = check(&common::kubernetes_service_variables(
        "ingest-gateway",
        8080,
    ));
    assert!(ok, "{text}");
    let args = ["--check", "--config", "config/ingest-gateway.toml"].map(std::ffi::OsStr::new);
    let bad = [
        ("INGEST_GATEWAY_WORKER_NICE", "lots"),
        ("INGEST_GATEWAY_LOG_FORMAT", "json"),
    ];
    let (code, text) =
        common::exit_code_from_root(env!("CARGO_BIN_EXE_ingest-gateway"), &args, &bad);
    assert_eq!(code, Some(2), "{text}");
    let fatal: serde_json::Value = serde_json::from_str(text.trim()).expect(&text);
    assert_eq!(fatal["level"], "ERROR", "{text}");
    assert_eq!(fatal["fields"]["exit_code"], 2, "{text}");
    let error = fatal["fields"]["error"].as_str().unwrap();
    assert!(error.to_lowercase().contains("worker_nice"), "{text}");
}
